"""torch.compile in serving: a worker persists inductor's cache in ``compile.cache_dir``, and the
worker TorchServe starts after a crash loads the compiled graphs from it instead of compiling; LoRAs
on a compiled UNet equal diffusers and recompile nothing; step caching on it equals the DeepCache helper."""

from __future__ import annotations

import re
import shutil
import time

import numpy as np
import pytest

from bench.reference import Reference
from model_making.make_lora import write_lora
from server import write_model_config as model_config
from server.paths import DEFAULT_MODEL_DIR, ROOT
from tests.harness.images import assert_moved, assert_same_image
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


SLOTS_LOG = re.compile(r"LoRA slots: (\d+) free; graphs compiled so far: (\d+)")


def test_loras_on_a_compiled_unet_equal_diffusers_and_recompile_nothing(tmp_path):
    """The compiled UNet's LoRA slots (handler.adapters.lora_slots) behind a real TorchServe: warm-up compiles
    both graphs of the served shape, then LoRA requests, a new adapter and an eviction (two slots,
    three LoRAs) compile nothing, and each image equals diffusers' call with the LoRA; a DeepCache
    request with a LoRA equals diffusers' call under the DeepCache helper."""
    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copy(ROOT / "loras" / "outline.safetensors", loras)
    write_lora(DEFAULT_MODEL_DIR, loras / "random.safetensors", seed=1)
    write_lora(DEFAULT_MODEL_DIR, loras / "unet-only.safetensors", seed=2, text_encoder=False)
    handler = {"compile": {"enabled": True, "targets": ["unet"]}, "loras": {"dir": str(loras), "max_loaded": 2}}
    body = {"prompt": "a red circle outline", "seed": 3, "num_inference_steps": 4}
    reference = Reference(DEFAULT_MODEL_DIR)
    plain = np.asarray(reference(body["prompt"], body["seed"], 64, 64, 4).images[0])
    with serving(tmp_path, model_config(tmp_path, handler=handler)) as server:
        client = Client(server)
        for name, scale in [("random", 0.8), ("outline", 1.0), ("unet-only", -0.5), ("random", 0.8)]:
            ours = client.image(**body, loras=[{"name": name, "scale": scale}])
            theirs = reference(body["prompt"], body["seed"], 64, 64, 4, loras=[(loras / f"{name}.safetensors", scale)])
            assert_same_image(ours, np.asarray(theirs.images[0]))
            assert_moved(ours, plain, f"LoRA {name} at {scale}")
        assert client.predict({**body, "loras": [{"name": "outline", "scale": 2.0}]}).status_code == 200
        # a cached request runs the step cache's regions, which warm-up compiled
        ours = client.image(**body, loras=[{"name": "outline", "scale": 1.0}], cache={"mode": "deep", "interval": 2})
        outline = [(loras / "outline.safetensors", 1.0)]
        theirs = reference(body["prompt"], body["seed"], 64, 64, 4, loras=outline, deep_cache=(2, 0))
        assert_same_image(ours, np.asarray(theirs.images[0]))
        loads = SLOTS_LOG.findall(server.console_log.read_text(errors="replace"))
    assert len(loads) == 5, loads  # random, outline, unet-only (evicting random), random (evicting outline), outline
    graphs = {int(count) for _, count in loads}
    assert len(graphs) == 1 and graphs.pop() > 0, f"graphs compiled at each LoRA load: {loads}"
    print(f"compiled UNet, 5 LoRA loads into 2 slots: graphs compiled at each load {[int(c) for _, c in loads]}")
