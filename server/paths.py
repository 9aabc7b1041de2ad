"""The repository's layout: its root and the shared files and folders, defined here only.

Everything outside the archive (packaging, the server, model making, observability, load tests,
benchmarks, tests) finds the repository's files through these names; ``handler/`` never does (it runs
inside the archive, where none of them exists).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HANDLER_PACKAGE = ROOT / "handler"
REQUIREMENTS = ROOT / "requirements.txt"  # what serving needs, pinned (the image installs only this file)
DOCKERFILE = ROOT / "docker" / "Dockerfile"  # the serving image
CONFIG_PROPERTIES = ROOT / "config.properties"  # TorchServe's server settings
MODEL_CONFIG = ROOT / "model-config.yaml"  # the archive's frontend and handler settings
METRICS_CONFIG = ROOT / "metrics.yaml"  # TorchServe's metrics_config (generated from handler/metrics.py)
LOG_CONFIG = ROOT / "server" / "log4j2.xml"  # TorchServe's frontend logging
BENCHMARK_CONFIG = ROOT / "benchmark_config.yaml"  # SLA, request mix, load test and sweep
MODEL_STORE = ROOT / "model_store"
RUNTIME = ROOT / "runtime"  # make serve's working directory: key_file.json, logs/
REPORTS = ROOT / "reports"  # load test, sweep and benchmark output
BUILD = ROOT / "build"  # scratch space of the benchmarks
DOCS_IMG = ROOT / "docs" / "img"
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
GRAFANA_DIR = ROOT / "docker" / "grafana"
K8S_DIR = ROOT / "deploy" / "k8s"

MODELS = ROOT / "models"
# The default model: trained on shapes and colours (make train-default-model), committed.
DEFAULT_MODEL_DIR = MODELS / "shapes-sd"
# The LoRA adapters make serve serves (LORA_DIR): the default model's, committed.
LORA_DIR = ROOT / "loras"
# The ControlNets make serve serves (CONTROLNET_DIR): the default model's, committed.
CONTROLNET_DIR = ROOT / "controlnets"
# Random-weight tiny models of every family the engine serves (make model), for tests that need no
# image quality; sd1 is the default model's architecture.
TINY_MODEL_DIRS = {
    "sd1": MODELS / "tiny-sd",
    "sd2": MODELS / "tiny-sd2",
    "sdxl": MODELS / "tiny-sdxl",
    "sd1-safety": MODELS / "tiny-sd-safety",
    "sd3": MODELS / "tiny-sd3",
    "sd35": MODELS / "tiny-sd35",
}
RANDOM_MODEL_DIR = TINY_MODEL_DIRS["sd1"]
