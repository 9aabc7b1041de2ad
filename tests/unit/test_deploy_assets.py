"""Static checks of the deployment files (no Docker engine and no cluster here): the Dockerfile,
the Compose file against the Compose schema, the Kubernetes manifests (kustomize output) against a
pinned Kubernetes version and the custom resources' published schemas, and the KServe variant."""

from __future__ import annotations

import copy
import gzip
import importlib.metadata
import io
import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from server import read_properties
from server.archive import serving_defaults
from server.paths import CONFIG_PROPERTIES, DOCKERFILE, K8S_DIR, MODEL_CONFIG, REQUIREMENTS, ROOT
from server.process import default_stop_grace
from server.properties import bound_to
from tests.harness.imports import import_statements
from tests.harness.serving import SHIPPED_CONFIG

DOCKER = ROOT / "docker"
KSERVE = ROOT / "deploy" / "kserve"
SCHEMAS = ROOT / "tests" / "schemas"
KUBERNETES_VERSION = "1.33"
PORTS = {"8080", "8081", "8082", "7070"}  # HTTP inference, management, metrics; gRPC inference
# What a pod's or KServe's TorchServe config may differ in from config.properties.
DEPLOYMENT_KEYS = {
    "inference_address",
    "management_address",
    "metrics_address",
    "grpc_inference_address",
    "grpc_management_address",
    "disable_token_authorization",
    "model_store",
    "metrics_config",
}
CUSTOM_RESOURCE_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-serving.kserve.io-v1beta1",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime-serving.kserve.io-v1alpha1",
}


# What the image copies: the serving code and tools, configuration and the default model.
SERVING_FILES = {
    "requirements.txt",
    "config.properties",
    "metrics.yaml",
    "model-config.yaml",
    "handler/",
    "models/shapes-sd/",
    "server/",
    "loras/",
    "controlnets/",
}
# Development, tests, load tests and benchmarks only.
DEV_ONLY = {
    "pytest",
    "hypothesis",
    "grpcio",
    "grpcio-tools",
    "locust",
    "matplotlib",
    "tqdm",
    "jsonschema",
    "kubernetes-validate",
    "dockerfile-parse",
    "grafana-foundation-sdk",
}


def requirement_names(path: Path) -> set[str]:
    """The distributions a requirements file pins (normalized names), following ``-r``."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            names |= requirement_names(path.parent / line[3:].strip())
        elif line:
            names.add(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def installed_closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they require (installed here), without extras."""
    seen, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # a requirement for another platform
            continue
        for requirement in requirements:
            if "extra ==" not in requirement:
                pending.append(re.split(r"[=<>!~\[; (]", requirement, maxsplit=1)[0].lower().replace("_", "-"))
    return seen


def schema(name: str) -> dict:
    return json.loads(gzip.decompress((SCHEMAS / f"{name}.json.gz").read_bytes()))


def validate_manifest(document: dict) -> None:
    """Built-in kinds against Kubernetes' schemas (strict: unknown fields fail), custom resources
    against their CRD's schema."""
    custom = CUSTOM_RESOURCE_SCHEMAS.get((document["apiVersion"], document["kind"]))
    if custom:
        # A CRD's openAPIV3Schema is OpenAPI's JSON Schema subset (draft 4); some of its patterns are
        # Go regular expressions, so the schema itself is not checked, only the document.
        jsonschema.Draft4Validator(schema(custom)).validate(document)
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


@cache
def kustomized() -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is missing: `make system-deps` installs it (Debian kubernetes-client)")
    output = subprocess.run([kubectl, "kustomize", str(K8S_DIR)], capture_output=True, text=True, check=True).stdout
    return tuple(yaml.safe_load_all(output))


def by_kind(kind: str) -> dict:
    [document] = [doc for doc in kustomized() if doc["kind"] == kind]
    return document


def duration_seconds(duration: str) -> float:
    """A Compose duration (``1m30s``, ``300s``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(number + unit for number, unit in parts) == duration, f"not a duration: {duration}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(number) * scale[unit] for number, unit in parts)


# --- Dockerfile ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(DOCKERFILE.read_bytes()))


def instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [item["value"] for item in parser.structure if item["instruction"] == name]


def build_arg_defaults(parser: DockerfileParser) -> dict[str, str]:
    return dict(value.partition("=")[::2] for value in instructions(parser, "ARG"))


def test_dockerfile_base_is_a_pinned_cuda_runtime(dockerfile):
    image = build_arg_defaults(dockerfile)["BASE_IMAGE"]
    name, _, tag = image.partition(":")
    # Fully qualified: buildah and podman resolve no short names without a registries.conf search list.
    assert name == "docker.io/nvidia/cuda" and "runtime" in tag, image
    assert re.fullmatch(r"\d+\.\d+\.\d+-[a-z0-9.-]+", tag), f"base image tag not pinned: {image}"
    assert instructions(dockerfile, "FROM") == ["${BASE_IMAGE}"]


def test_dockerfile_defaults_fit_the_cuda_base(dockerfile):
    """The default torch build matches the base's CUDA release, and the default Python source its Ubuntu."""
    defaults = build_arg_defaults(dockerfile)
    cuda = re.search(r":(\d+)\.(\d+)\.\d+-runtime-ubuntu", defaults["BASE_IMAGE"])
    assert cuda, defaults["BASE_IMAGE"]
    assert defaults["TORCH_INDEX_URL"].endswith(f"/cu{cuda[1]}{cuda[2]}"), defaults["TORCH_INDEX_URL"]
    assert defaults["PYTHON_SOURCE"] == "deadsnakes"
    assert defaults["TORCH_WHEEL_DIR"] == defaults["PIP_CERT"] == ""


def test_every_build_argument_is_documented(dockerfile):
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    for name in build_arg_defaults(dockerfile):
        assert f"#   {name} " in header, f"the Dockerfile's header does not document {name}"
        assert f"`{name}`" in deploy, f"docs/deploy.md does not document {name}"


def test_dockerfile_installs_the_pinned_dependencies_and_java_17(dockerfile):
    runs = "\n".join(instructions(dockerfile, "RUN"))
    assert "pip install pip==26.3" in runs and "torch==2.13.0" in runs and "-r requirements.txt" in runs
    assert "openjdk-17-jre-headless" in runs and "python3.11" in runs


def test_dockerfile_has_the_compiler_torch_compile_needs_at_run_time(dockerfile):
    runs = "\n".join(instructions(dockerfile, "RUN"))
    assert {"gcc", "g++", "libc6-dev", "python3.11-dev"} <= set(runs.split())


def test_dockerfile_installs_and_copies_what_serving_needs_only(dockerfile):
    runs = "\n".join(instructions(dockerfile, "RUN"))
    assert "requirements-dev" not in runs and "requirements-dev" not in " ".join(instructions(dockerfile, "COPY"))
    copied = {source for value in instructions(dockerfile, "COPY") for source in value.split()[:-1]}
    assert copied == SERVING_FILES, copied ^ SERVING_FILES


def test_requirements_are_split_into_serving_and_development():
    serving = requirement_names(REQUIREMENTS)
    assert not serving & DEV_ONLY, serving & DEV_ONLY
    assert (ROOT / "requirements-dev.txt").read_text().splitlines().count("-r requirements.txt") == 1
    assert DEV_ONLY <= requirement_names(ROOT / "requirements-dev.txt")
    for line in (REQUIREMENTS).read_text().splitlines() + (ROOT / "requirements-dev.txt").read_text().splitlines():
        assert not line or line.startswith(("#", "-r ")) or "==" in line, f"not pinned: {line}"


def test_the_serving_code_imports_only_what_requirements_txt_installs():
    """Every third-party module the image's code imports comes from requirements.txt or what it pulls in."""
    provided = installed_closure(requirement_names(REQUIREMENTS))
    distributions = importlib.metadata.packages_distributions()
    copied = {source.rstrip("/") for source in SERVING_FILES if source.endswith("/")}
    sources = [path for folder in copied for path in (ROOT / folder).rglob("*.py")]
    for source in sources:
        for name, _ in import_statements(source):
            module = name.split(".")[0]
            if module in sys.stdlib_module_names:
                continue
            if (ROOT / module).is_dir():
                assert module in copied, f"{source.relative_to(ROOT)} imports {name}, which the image does not copy"
                continue
            owners = {name.lower().replace("_", "-") for name in distributions.get(module, [])}
            assert owners & provided, (
                f"{source.relative_to(ROOT)} imports {module} ({owners or 'not installed'}), not in requirements.txt"
            )


def test_dockerfile_runs_as_non_root_with_healthcheck_ports_and_the_start_script(dockerfile):
    users = instructions(dockerfile, "USER")
    assert users and users[-1] not in {"root", "0"}, users
    [healthcheck] = instructions(dockerfile, "HEALTHCHECK")
    assert "server.healthcheck" in healthcheck and "Authorization" not in healthcheck
    assert set(" ".join(instructions(dockerfile, "EXPOSE")).split()) == PORTS
    assert json.loads(instructions(dockerfile, "ENTRYPOINT")[-1]) == ["server/start.sh"]
    for source in " ".join(value.rsplit(" ", 1)[0] for value in instructions(dockerfile, "COPY")).split():
        assert (ROOT / source).exists(), f"COPY source {source} does not exist"


def test_dockerfile_holds_no_secrets(dockerfile):
    for item in dockerfile.structure:
        if item["instruction"] in {"ENV", "ARG", "LABEL"}:
            assert not re.search(r"(KEY|TOKEN|PASSWORD|SECRET)\w*=", item["value"], re.IGNORECASE), item["content"]
        if item["instruction"] == "COPY":
            assert "key_file" not in item["value"], item["content"]
    assert "Bearer" not in DOCKERFILE.read_text()


# --- Compose ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_file_matches_the_compose_schema(compose):
    jsonschema.validate(compose, schema("compose-spec"))
    broken = copy.deepcopy(compose)
    broken["services"]["torchserve"]["ports"] = "8080"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema("compose-spec"))


def test_compose_stack_publishes_on_loopback_reserves_a_gpu_and_mounts_what_exists(compose):
    services = compose["services"]
    assert set(services) == {"torchserve", "prometheus", "grafana"}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image}"
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"
    ts = services["torchserve"]
    assert {p.rsplit(":", 1)[1] for p in ts["ports"]} == PORTS
    [device] = ts["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert ts["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}


def test_compose_prometheus_scrapes_the_torchserve_service_with_the_rules():
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["torchserve:8082"]
    assert all((DOCKER / "prometheus" / path).is_file() for path in config["rule_files"])


# --- Kubernetes ---------------------------------------------------------------------------------


def test_every_kustomized_manifest_validates():
    kinds = [document["kind"] for document in kustomized()]
    assert sorted(kinds) == sorted(
        [
            "Namespace",
            "ConfigMap",
            "ConfigMap",
            "Service",
            "Deployment",
            "PersistentVolumeClaim",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "ServiceMonitor",
            "PrometheusRule",
        ]
    )
    for document in kustomized():
        validate_manifest(document)


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda doc: doc["spec"].update(replica=2)),
        ("Deployment", lambda doc: doc["spec"]["template"]["spec"]["containers"][0].update(ports="8080")),
        ("HorizontalPodAutoscaler", lambda doc: doc["spec"].update(minReplicas="one")),
        ("ServiceMonitor", lambda doc: doc["spec"].update(endpoints="metrics")),
    ],
)
def test_validation_catches_a_broken_manifest(kind, mutate):
    document = copy.deepcopy(by_kind(kind))
    mutate(document)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate_manifest(document)


def test_selectors_and_ports_line_up():
    deployment, service = by_kind("Deployment"), by_kind("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (service["spec"]["selector"], by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    assert by_kind("ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    container_ports = {
        port["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for port in c.get("ports", [])
    }
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= container_ports
    assert by_kind("ServiceMonitor")["spec"]["endpoints"][0]["port"] in {
        port["name"] for port in service["spec"]["ports"]
    }


def test_pod_has_gpu_probes_without_keys_and_runs_as_non_root():
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    torchserve = next(c for c in pod["containers"] if c["name"] == "torchserve")
    assert torchserve["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in torchserve
    assert "server.healthcheck" in torchserve["readinessProbe"]["exec"]["command"]
    assert "Authorization" not in json.dumps(pod), "a key or auth header in the pod spec"
    assert pod["securityContext"]["runAsNonRoot"] is True
    proxy = next(c for c in pod["containers"] if c["name"] == "auth-proxy")
    assert proxy["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "stable-diffusion-auth"


def test_every_autoscaler_metric_is_served_per_pod_by_an_adapter_rule():
    hpa = by_kind("HorizontalPodAutoscaler")
    adapter = yaml.safe_load((K8S_DIR / "prometheus-adapter" / "values.yaml").read_text())
    rules = {rule["name"]["as"]: rule for rule in adapter["rules"]["custom"]}
    names = [metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]]
    assert names == ["sd_queued_requests", "sd_in_flight_images"] and set(names) == set(rules)
    for rule in rules.values():
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        counter = rule["seriesQuery"].split("{")[0].endswith(("_total", "_microseconds"))
        assert ("rate(<<.Series>>" in rule["metricsQuery"]) == counter, "counters through rate(), gauges as they are"
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind("Deployment")["metadata"]["name"]


def test_every_deployment_runs_one_gpu_per_pod_so_packaging_ships_continuous_batching(compose):
    """The start script packages the model in the pod (or KServe's archive is built with GPUS=1):
    one visible GPU, one worker, continuous batching. Pods scale, not workers."""
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    torchserve = next(c for c in pod["containers"] if c["name"] == "torchserve")
    [device] = compose["services"]["torchserve"]["deploy"]["resources"]["reservations"]["devices"]
    kserve = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())["spec"]["predictor"]["model"]
    gpus = {
        torchserve["resources"]["limits"]["nvidia.com/gpu"],
        device["count"],
        int(kserve["resources"]["limits"]["nvidia.com/gpu"]),
    }
    assert gpus == {1}
    filled, _ = serving_defaults(SHIPPED_CONFIG, gpus=1)
    assert filled["continuousBatching"] is True and (filled["minWorkers"], filled["maxWorkers"]) == (1, 1)


def test_auth_proxy_checks_the_key_and_reaches_torchserve_on_loopback():
    template = (K8S_DIR / "auth-proxy" / "default.conf.template").read_text()
    pod_config = read_properties(K8S_DIR / "config.properties")
    assert '"Bearer ${INFERENCE_KEY}" 1;' in template and "return 401" in template
    assert f"proxy_pass {pod_config['inference_address']};" in template
    assert pod_config["inference_address"].startswith("http://127.0.0.1:")
    assert pod_config["management_address"].startswith("http://127.0.0.1:")
    # the proxy passes every body TorchServe takes (an input image), and its 401 is one the openai SDK reads
    (megabytes,) = re.findall(r"client_max_body_size (\d+)m;", template)
    assert int(megabytes) * 2**20 == int(pod_config["max_request_size"])
    assert '"error": {' in template and '"code": "invalid_api_key"' in template


@pytest.mark.parametrize(
    "config", [K8S_DIR / "config.properties", KSERVE / "config" / "config.properties"], ids=["kubernetes", "kserve"]
)
def test_deployment_configs_differ_from_config_properties_only_where_documented(config):
    base, deployed = read_properties(CONFIG_PROPERTIES), read_properties(config)
    changed = {key for key in base.keys() | deployed.keys() if base.get(key) != deployed.get(key)}
    assert changed <= DEPLOYMENT_KEYS, changed - DEPLOYMENT_KEYS
    assert deployed["enable_model_api"] == "false"


# --- KServe -------------------------------------------------------------------------------------


def test_kserve_variant_validates_and_uses_the_torchserve_layout():
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    service = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())
    for document in (runtime, service):
        validate_manifest(document)
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {item["name"] for item in runtime["spec"]["supportedModelFormats"]}
    env = {item["name"]: item["value"] for item in runtime["spec"]["containers"][0]["env"]}
    assert env["MODEL_STORE"] == "/mnt/models/model-store" and env["CONFIG"] == "/mnt/models/config/config.properties"
    kserve_config = read_properties(KSERVE / "config" / "config.properties")
    assert kserve_config["model_store"] == env["MODEL_STORE"]
    assert kserve_config["inference_address"].endswith(
        f":{runtime['spec']['containers'][0]['ports'][0]['containerPort']}"
    )


def listening(env: dict[str, str], config: Path, dockerfile: DockerfileParser) -> dict[str, str]:
    """The addresses TorchServe listens on in a container: the config, moved by start.sh to
    BIND_ADDRESS (the image's, unless the manifest sets it) where that is not empty."""
    bind = env.get("BIND_ADDRESS", dockerfile.envs["BIND_ADDRESS"])
    properties = read_properties(config)
    return bound_to(properties, bind) if bind else properties


def test_without_token_authorization_nothing_but_the_intended_listeners_leave_the_pods_loopback(dockerfile):
    """The Kubernetes and KServe configs turn token authorization off (the auth proxy, KServe's
    ingress): the image's BIND_ADDRESS=0.0.0.0 must not move their loopback listeners to the pod IP."""
    container = next(item for item in by_kind("Deployment")["spec"]["template"]["spec"]["containers"])
    k8s_env = {item["name"]: item.get("value", "") for item in container["env"]}
    k8s_config = K8S_DIR / "config.properties"
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    kserve_env = {item["name"]: item.get("value", "") for item in runtime["spec"]["containers"][0]["env"]}
    kserve_config = KSERVE / "config" / "config.properties"
    for env, config in ((k8s_env, k8s_config), (kserve_env, kserve_config)):
        assert read_properties(config)["disable_token_authorization"] == "true"
        addresses = listening(env, config, dockerfile)
        for key in ("inference_address", "management_address", "metrics_address"):
            host = urlparse(addresses[key]).hostname
            intended = urlparse(read_properties(config)[key]).hostname
            assert host == intended, f"{config}: {key} listens on {host}, the config says {intended}"
        assert urlparse(addresses["management_address"]).hostname == "127.0.0.1"
        assert addresses["grpc_management_address"] == "127.0.0.1"
    assert urlparse(listening(k8s_env, k8s_config, dockerfile)["inference_address"]).hostname == "127.0.0.1"


@pytest.mark.parametrize(
    "variable, folder, claim",
    [
        ("LORA_DIR", "loras", "stable-diffusion-loras"),
        ("CONTROLNET_DIR", "controlnets", "stable-diffusion-controlnets"),
    ],
)
def test_the_image_and_every_manifest_serve_loras_and_controlnets_from_mounted_directories(variable, folder, claim):
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    (directory,) = re.findall(rf"\b{variable}=(\S+)", dockerfile)
    pod = next(d for d in kustomized() if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] != "auth-proxy")
    kserve = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())["spec"]["predictor"]
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["torchserve"]
    for mounts, volumes in (
        (server["volumeMounts"], pod["volumes"]),
        (kserve["model"]["volumeMounts"], kserve["volumes"]),
    ):
        (mount,) = [m for m in mounts if m["mountPath"] == directory]
        (volume,) = [v for v in volumes if v["name"] == mount["name"]]
        assert mount["readOnly"] and volume["persistentVolumeClaim"]["claimName"] == claim
    assert f"../{folder}:{directory}:ro" in compose["volumes"]
    assert f"COPY {folder}/ {directory}/" in dockerfile


# --- Stopping -----------------------------------------------------------------------------------


def test_every_orchestrator_waits_for_the_drain_before_killing(compose):
    """On stop the server drains for its grace period, then stops TorchServe: every orchestrator's
    kill deadline covers both (20 s at least for TorchServe's stop)."""
    grace = default_stop_grace(yaml.safe_load(MODEL_CONFIG.read_text()))
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= grace + 20
    containers = {container["name"]: container for container in pod["containers"]}
    probe = containers["torchserve"]["readinessProbe"]["exec"]["command"]
    pre_stop = containers["torchserve"]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:4] == [probe[0], "-m", "server.cli", "stop"]
    assert pre_stop[pre_stop.index("--workdir") + 1] == probe[probe.index("--workdir") + 1]
    # the proxy keeps forwarding while TorchServe drains, on an address its metrics listen on
    proxy_wait = " ".join(containers["auth-proxy"]["lifecycle"]["preStop"]["exec"]["command"])
    metrics = read_properties(K8S_DIR / "config.properties")["metrics_address"]
    assert re.search(r"http://127\.0\.0\.1:(\d+)/metrics", proxy_wait)[1] == metrics.rsplit(":", 1)[1]
    assert metrics.startswith(("http://0.0.0.0:", "http://127.0.0.1:"))
    assert duration_seconds(compose["services"]["torchserve"]["stop_grace_period"]) >= grace + 20
    kserve = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())["spec"]["predictor"]
    assert kserve["timeout"] >= grace + 20
