"""torch.compile in serving, on one worker with its UNet and VAE decoder compiled, LoRA slots and the
step cache: it persists inductor's cache in ``compile.cache_dir``, and the worker TorchServe starts
after a crash loads the compiled graphs from it instead of compiling; LoRAs on the compiled UNet
equal diffusers and recompile nothing; step caching on it equals the DeepCache helper; a ControlNet
on it equals diffusers' ControlNet pipeline and compiles nothing."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from bench.reference import ControlNetCall, Reference
from model_making.make_lora import write_lora
from server import write_model_config as model_config
from server.paths import CONTROLNET_DIR, DEFAULT_MODEL_DIR, ROOT
from tests.harness.engine_runs import compiled_lora_slots
from tests.harness.images import assert_moved, assert_same_image, png_base64
from tests.harness.serving import Client, eventually, serving, wait_until_serving, workers

pytestmark = pytest.mark.slow

COMPILE_LOG = re.compile(r"compile cache: dir=(\S+) fxgraph_cache_hit=(\d+) fxgraph_cache_miss=(\d+)")
READY_LOG = re.compile(r"stable-diffusion worker \S+ ready: .* load_s=([\d.]+) warmup_s=([\d.]+)")
WARMED_LOG = re.compile(r"warm-up (\d+x\d+): (\d+) graphs compiled \((\d+) in this worker\)")


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


SLOTS_LOG = re.compile(r"LoRA slots: (\d+) free; graphs compiled so far: (\d+)")


def slot_loads(console_log: Path) -> list[int]:
    """The graphs compiled so far at each LoRA load of the last worker that found a compile cache."""
    log = console_log.read_text(errors="replace")
    return [int(count) for _, count in SLOTS_LOG.findall(log[log.rindex("compile cache: ") :])]


def test_a_compiled_unet_with_lora_slots_equals_diffusers_and_a_restarted_worker_loads_its_graphs(
    tmp_path, record_property, monkeypatch
):
    """The compiled UNet with LoRA slots (handler.adapters.lora_slots) and the step cache behind a real
    TorchServe. Its warm-up compiles every graph into ``compile.cache_dir``, and the worker TorchServe
    starts after a crash loads them all from there (the run's inductor cache, where
    tests/unit/test_engine_lora_slots.py finds them too) and gives the same image. Then LoRA
    requests, a new adapter, an eviction (two slots, three LoRAs) and one unguided image, cached or
    not, compile nothing, and each image equals diffusers' call with the LoRA; a DeepCache request
    with a LoRA equals diffusers' call under the DeepCache helper, and a ControlNet request with a
    LoRA diffusers' ControlNet pipeline."""
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    elsewhere = tmp_path / "inherited-cache"  # what the server inherits: compile.cache_dir overrides it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(elsewhere))
    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copy(ROOT / "loras" / "outline.safetensors", loras)
    write_lora(DEFAULT_MODEL_DIR, loras / "random.safetensors", seed=1)
    write_lora(DEFAULT_MODEL_DIR, loras / "unet-only.safetensors", seed=2, text_encoder=False)
    handler = compiled_lora_slots(loras)
    handler["compile"]["cache_dir"] = str(cache)
    body = {"prompt": "a red circle outline", "seed": 3, "num_inference_steps": 4}
    reference = Reference(DEFAULT_MODEL_DIR)
    plain = np.asarray(reference(body["prompt"], body["seed"], 64, 64, 4).images[0])
    with serving(tmp_path, model_config(tmp_path, handler=handler)) as server:
        client = Client(server)
        (cold,) = _wait_for_starts(server, 1)
        assert cold["dir"] == str(cache) and cold["hits"] + cold["misses"] > 0
        before = client.image(**body, loras=[{"name": "outline", "scale": 1.0}])

        (worker,) = workers(server)
        worker.kill()
        wait_until_serving(client)
        warm = _wait_for_starts(server, 2)[1]
        assert warm["dir"] == str(cache) and warm["misses"] == 0 and warm["hits"] == cold["hits"] + cold["misses"]
        after = client.image(**body, loras=[{"name": "outline", "scale": 1.0}])
        assert (before == after).all(), "the cached graphs must give the image the freshly compiled ones gave"

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
        # a ControlNet with a LoRA: the graphs warm-up compiled take ControlNet residuals (zeros before)
        mask = Image.new("RGB", (64, 64))
        ImageDraw.Draw(mask).ellipse((6, 30, 30, 54), fill="white")
        controlnet = {"name": "shapes-mask", "image": png_base64(mask)}
        ours = client.image(**body, loras=[{"name": "outline", "scale": 1.0}], controlnets=[controlnet])
        calls = [ControlNetCall(CONTROLNET_DIR / "shapes-mask", mask)]
        theirs = reference(body["prompt"], body["seed"], 64, 64, 4, loras=outline, controlnets=calls)
        assert_same_image(ours, np.asarray(theirs.images[0]))
        assert_moved(ours, np.asarray(reference(body["prompt"], body["seed"], 64, 64, 4, loras=outline).images[0]))
        # one unguided image: one row, run as two; with a step cache, one row through the regions,
        # which warm-up compiled apart (the load after them counts the graphs)
        assert client.predict({**body, "guidance_scale": 1.0}).status_code == 200
        assert (
            client.predict({**body, "guidance_scale": 1.0, "cache": {"mode": "deep", "interval": 2}}).status_code == 200
        )
        assert client.predict({**body, "loras": [{"name": "unet-only", "scale": 1.0}]}).status_code == 200
        # the frontend copies the worker's log lines apart from its answers
        eventually(lambda: len(slot_loads(server.console_log)) >= 6, "the sixth LoRA load in the log", timeout=30)
        log = server.console_log.read_text(errors="replace")
    assert not any(elsewhere.rglob("*")), "the worker compiled into the inherited directory, not compile.cache_dir"
    # The restarted worker's loads into its two slots, least recently used evicted: outline, random,
    # unet-only (evicting random), random (evicting outline), outline (evicting unet-only), then after
    # the cached, the ControlNet and the unguided requests unet-only (evicting random). Each logs the
    # graphs compiled so far.
    loads = slot_loads(server.console_log)
    assert len(loads) == 6 and len(set(loads)) == 1 and loads[0] > 0, f"graphs compiled at each LoRA load: {loads}"
    # each worker's warm-up logs the graphs its shape compiled, all the worker's (the restarted one's
    # loaded from the cache), which the LoRA loads after it count too
    assert WARMED_LOG.findall(log) == [("64x64", str(loads[0]), str(loads[0]))] * 2
    record_property("compile_cold_warmup_s", cold["warmup_s"])
    record_property("compile_warm_warmup_s", warm["warmup_s"])
    print(
        f"compiled UNet with LoRA slots, worker start: warm-up {cold['warmup_s']:.1f} s "
        f"({cold['misses']} graphs compiled, {cold['hits']} from the cache), {warm['warmup_s']:.1f} s restarted; "
        f"{len(loads)} LoRA loads into 2 slots, graphs compiled at each {loads}"
    )
