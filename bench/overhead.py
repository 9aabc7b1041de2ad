"""`make bench-overhead`: the serving overhead, measured side by side in one run.

The same request (default model, 64x64, 4 steps, fixed seed) is generated N times in-process by
the handler's own service (decode, step engine, encode: exactly what a worker runs) and N times over
HTTP through TorchServe, one at a time, once registered with batch size 1 and once with the
shipped batch size and delay (in the shipped batching mode). With the shipped registration the
same request also goes through the OpenAI Images API (``v1/images/generations``, JSON answer with
base64 images) alternately with the native API asking for JSON, so the two paths are compared on the
same work. Prints medians and ratios and writes reports/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import requests
import yaml

from handler.config import HandlerSettings
from handler.protocol import IncomingRequest
from handler.service import build_service
from loadtest.sweep import ModelRegistration
from server import TorchServe, build, config_on_free_ports
from server.paths import CONFIG_PROPERTIES, DEFAULT_MODEL_DIR, MODEL_CONFIG, REPORTS, ROOT

logger = logging.getLogger("overhead")

REQUEST = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 4, "seed": 7}
# The same work through each API, both answering JSON with one base64 PNG.
NATIVE_JSON = {**REQUEST, "response_format": "json"}
OPENAI = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 4, "seed": 7}
WARMUP = 3


def median_seconds(action, repeats: int) -> float:
    for _ in range(WARMUP):
        action()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def in_process(repeats: int) -> float:
    """The worker's own code path without TorchServe: service.run_batch on one request."""
    model_config = yaml.safe_load(MODEL_CONFIG.read_text())
    settings = HandlerSettings.from_model_yaml(model_config).model_copy(update={"model_path": str(DEFAULT_MODEL_DIR)})
    service, _ = build_service(settings, ROOT, lambda spec, value, labels: None)

    def once() -> None:
        response = service.run_batch({"overhead": IncomingRequest(dict(REQUEST), "application/json")})["overhead"]
        assert response.status == 200

    return median_seconds(once, repeats)


def over_http(server: TorchServe, repeats: int) -> float:

    def once() -> None:
        requests.post(server.predictions_url, json=REQUEST, headers=server.auth(), timeout=120).raise_for_status()

    return median_seconds(once, repeats)


def native_and_openai(server: TorchServe, repeats: int) -> tuple[float, float]:
    """Median seconds of the native JSON API and of the OpenAI API on the same request, taken in
    alternation so that both see the same machine state."""
    openai_url = f"{server.predictions_url}/1.0/v1/images/generations"
    native, openai = [], []
    for index in range(WARMUP + repeats):
        for url, body, timings in ((server.predictions_url, NATIVE_JSON, native), (openai_url, OPENAI, openai)):
            started = time.perf_counter()
            requests.post(url, json=body, headers=server.auth(), timeout=120).raise_for_status()
            if index >= WARMUP:
                timings.append(time.perf_counter() - started)
    return statistics.median(native), statistics.median(openai)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--output", type=Path, default=REPORTS / "overhead.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    shipped = yaml.safe_load(MODEL_CONFIG.read_text())
    results = {"request": REQUEST, "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        workdir = Path(tmp)
        archive = build(DEFAULT_MODEL_DIR, MODEL_CONFIG, workdir / "model_store")
        config = config_on_free_ports(CONFIG_PROPERTIES, workdir, enable_model_api="true")
        server = TorchServe(config, workdir / "model_store", workdir / "server", env={"TMPDIR": tmp})
        server.start(load_model=False)
        try:
            server.wait_started()
            registration = ModelRegistration(server)
            for label, batch_size, delay in (
                ("batch size 1", 1, 0),
                (
                    f"batch size {shipped['batchSize']}, delay {shipped['maxBatchDelay']} ms",
                    shipped["batchSize"],
                    shipped["maxBatchDelay"],
                ),
            ):
                registration.register(archive.name, batch_size, delay, workers=1)
                mode = "continuous batching" if server.describe()["continuousBatching"] else "dynamic batching"
                label = f"{mode}, {label}"
                logger.info("HTTP through TorchServe, %s", label)
                results[f"http_median_s ({label})"] = over_http(server, args.repeats)
                if batch_size != 1:
                    logger.info("native JSON and OpenAI APIs alternately, %s", label)
                    results["native_json_median_s"], results["openai_median_s"] = native_and_openai(
                        server, args.repeats
                    )
                registration.unregister()
        finally:
            server.stop()
    logger.info("in-process")
    results["in_process_median_s"] = in_process(args.repeats)
    base = results["in_process_median_s"]
    print(f"in-process (handler service, no server): median {base * 1000:.1f} ms")
    for key, value in results.items():
        if key.startswith("http_median_s"):
            label = key[len("http_median_s (") : -1]
            print(
                f"TorchServe, {label}: median {value * 1000:.1f} ms = {value / base:.2f}x in-process "
                f"(+{(value - base) * 1000:.1f} ms)"
            )
    native, openai = results["native_json_median_s"], results["openai_median_s"]
    print(
        f"OpenAI Images API against the native JSON API (same request, alternated): {openai * 1000:.1f} ms against "
        f"{native * 1000:.1f} ms = {openai / native:.2f}x ({(openai - native) * 1000:+.1f} ms)"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
