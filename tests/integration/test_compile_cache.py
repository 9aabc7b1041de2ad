"""torch.compile in serving: a worker persists inductor's cache in ``compile.cache_dir``, and the
worker TorchServe starts after a crash loads the compiled graphs from it instead of compiling."""

from __future__ import annotations

import re
import time

import pytest

from server import write_model_config as model_config
from tests.harness.serving import Client, serving, wait_until_serving, workers

pytestmark = pytest.mark.slow

COMPILE_LOG = re.compile(r"compile cache: dir=(\S+) fxgraph_cache_hit=(\d+) fxgraph_cache_miss=(\d+)")
READY_LOG = re.compile(r"stable-diffusion worker \S+ ready: .* load_s=([\d.]+) warmup_s=([\d.]+)")


def _worker_starts(log: str) -> list[dict]:
    """Per worker start, in order: its compile-cache line and its load and warm-up seconds."""
    caches, ready = COMPILE_LOG.findall(log), READY_LOG.findall(log)
    return [
        {"dir": directory, "hits": int(hits), "misses": int(misses), "load_s": float(load), "warmup_s": float(warmup)}
        for (directory, hits, misses), (load, warmup) in zip(caches, ready, strict=False)
    ]


def _wait_for_starts(server, count: int, timeout: float = 600) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        starts = _worker_starts(server.console_log.read_text(errors="replace"))
        if len(starts) >= count:
            return starts
        time.sleep(1)
    raise AssertionError(f"fewer than {count} compiled worker starts logged within {timeout} s")


def test_a_restarted_compiled_worker_loads_its_kernels_from_the_persisted_cache(tmp_path, record_property):
    cache = tmp_path / "inductor-cache"
    # The VAE decoder alone keeps the cold compilation short on a CPU; the cache works the same for the UNet.
    compiled = {"compile": {"enabled": True, "mode": "default", "targets": ["vae_decoder"], "cache_dir": str(cache)}}
    with serving(tmp_path, model_config(tmp_path, handler=compiled)) as server:
        client = Client(server)
        (cold,) = _wait_for_starts(server, 1)
        assert cold["dir"] == str(cache) and cold["hits"] == 0 and cold["misses"] > 0
        assert any(cache.rglob("*")), "the cold worker left nothing in the cache directory"
        before = client.image(prompt="a red circle", seed=3, num_inference_steps=4)

        (worker,) = workers(server)
        worker.kill()
        wait_until_serving(client)
        warm = _wait_for_starts(server, 2)[1]
        assert warm["dir"] == str(cache) and warm["misses"] == 0 and warm["hits"] == cold["misses"]
        after = client.image(prompt="a red circle", seed=3, num_inference_steps=4)
    assert (before == after).all(), "the cached kernels must give the image the freshly compiled ones gave"
    record_property("compile_cold_warmup_s", cold["warmup_s"])
    record_property("compile_warm_warmup_s", warm["warmup_s"])
    print(
        f"compiled VAE decoder worker start: warm-up {cold['warmup_s']:.1f} s cold, "
        f"{warm['warmup_s']:.1f} s from the cache"
    )
