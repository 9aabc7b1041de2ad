"""`make bench-gpu`: Stable Diffusion at real sizes on the GPU it finds, in-process and served.

Random-weight pipelines of the published architectures (``bench.sd15``, ``bench.sdxl``,
``bench.sd35``: nothing downloaded) through the code a worker runs, in ten sections. Each writes
``<output>/<section>.json`` when it ends, and ``gpu.md`` and ``gpu.png`` are rendered from every
section file there (``bench.gpu_report``), so sections can run in separate calls:

1. ``variants``: SD 1.5, 512x512, 50 DDIM steps, batch 1, guidance 7.5: eager (SDPA, serving dtype:
   float16 on a GPU), vanilla attention, channels_last, torch.compile in ``default``,
   ``max-autotune-no-cudagraphs`` and ``reduce-overhead`` (CUDA graphs) modes, and ``cudagraphs``
   (eager's kernels replayed as CUDA graphs: ``compile.backend``; also in channels_last): UNet it/s, seconds
   per image, peak memory, compile cold and warm (the persisted inductor cache), image distance to
   eager, the largest batch with SDPA and with vanilla attention, and a torch.profiler breakdown of
   an eager call (kernels against wall time, host syncs). ``--variants`` measures a subset (eager
   always) and merges it into the section's rows; without ``--sections``, it runs this section alone.
2. ``scaling``: images/s at batch 1 to 16, eager and the fastest compile mode of ``variants``
   (``--compiled`` names another).
3. ``engine``: the step engine against the diffusers call it mirrors, same requests, batch 1 and 8;
   on CUDA also with its denoiser compiled in ``reduce-overhead`` mode and with eager's kernels in
   CUDA graphs (``cudagraphs``), each step's rows padded to the graphs' row counts
   (``handler.compile.pad_rows``).
4. ``served``: TorchServe on this GPU (one worker), dynamic and continuous batching, 25 steps, a
   closed loop at concurrency 1, 4, 8 and 16: images/s, p50, p95, against the in-process ceiling
   (the eager pipeline at the same batch, measured in the same run), and, on a server of its own,
   the worker's profile of 10 served forwards at concurrency 16 (``handler.profiler``: kernels
   against the wall time of the worker's loop, host syncs and kernel launches per step), per mode.
   ``--served-modes`` measures a subset of the two modes; ``--served-setting KEY=VALUE`` sets a
   handler setting of the served sections' servers (``decode_stream=own``,
   ``iteration_budget_ms=25``, ``compile.enabled=true``; the report names them), checked before any
   GPU time is spent; the in-process ceiling stays the eager pipeline's, and ``--reuse-ceilings``
   takes the ceilings an earlier run measured in the same scratch.
5. ``sdxl``: SDXL 1024x1024, 30 steps, batch 1: eager, float32 and the fastest compile mode of
   ``variants`` (``--compiled`` names another), each image's and first step's distance to float32's.
6. ``sd35``: SD 3.5 Medium (T5 included) 1024x1024, 28 flow-matching steps, guidance 7.5, eager at
   batch 1 and 4: transformer it/s (the ``unet_it_s`` figure), seconds per call, peak memory.
7. ``sd35_served``: SD 3.5 Medium through TorchServe with continuous batching (what packaging ships
   for one GPU), closed loop at concurrency 1 and 4, against ``sd35``'s in-process figures, and
   the worker's profile of 10 served forwards at concurrency 4.
8. ``lora``: SD 1.5, 512x512, 8 requests with no LoRA, one LoRA, 8 different LoRAs and 8 sets of 3
   (rank 16, attention and feed-forward) in one forward, per design of the row-wise LoRA path
   (``bench.loras``): step time over no LoRA, and which design ``auto`` took per layer (the quick
   plan's compiled designs on the ``cudagraphs`` backend: traced, not compiled, on a CPU).
9. ``controlnet``: SD 1.5, 512x512, two random ControlNets: one request with a ControlNet against
   none, and 8 requests with one ControlNet on all, on half, two on four each, in the shared UNet
   forward against a forward per ControlNet set (``bench.controlnets``).
10. ``cache``: step caching per request (``bench.cache``): 8 requests with no cache, all cached,
    half cached and mixed settings, DeepCache on SD 1.5 (512x512, 25 DDIM steps) and first-block
    caching on SD 3.5 Medium (512x512, 28 flow-matching steps): images/s against no cache, the share
    of the cached requests' steps that reused their cache, PSNR against no cache.

``--quick`` runs the same code on the CPU at tiny sizes (the random tiny models, 64x64, one step,
concurrency 1 and 2, scaling at batch 1): what CI runs, so that a GPU run has nothing left to debug
but the GPU.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from pydantic import ValidationError

from bench import cache as bench_cache
from bench import controlnets, loras, sd15, sd35, sdxl
from bench.engine import DENOISERS, measure_model
from bench.gpu_report import SECTION_RENDERERS, percent_text, render
from bench.measure import PROMPTS, Workload, error_text
from bench.pipeline import Runner, environment, summary, to_reference
from bench.report import number_text
from bench.variants import by_name, select
from handler.config import HandlerSettings
from handler.engine.loading import release_cached_memory, resolve_device
from loadtest.client import closed_loop
from loadtest.results import server_figures
from server import console_script, merged_model_config, serve_archive, write_model_config
from server.paths import BUILD, REPORTS, ROOT, TINY_MODEL_DIRS

logger = logging.getLogger("bench-gpu")

SECTIONS = tuple(SECTION_RENDERERS)  # variants, scaling, ..., lora, controlnet, cache
EAGER = "eager"
# The SDXL section's reference: the same call in float32, to tell float16's rounding (eager as far
# from it as a compiled variant) from a graph that computes something else (farther).
FLOAT32 = "sdpa-fp32"
SECTION_VARIANTS = (
    EAGER,
    "vanilla",
    "channels-last",
    "compile-default",
    "compile-max-autotune-no-cudagraphs",
    "compile-reduce-overhead",
    "cudagraphs",
    "cudagraphs-channels-last",
)
# The shipped model-config.yaml with only the mode forced: continuous batching is what packaging
# ships for a one-GPU host, dynamic batching what it ships for several workers.
SERVED_MODES = {"dynamic": {"continuousBatching": False}, "continuous": {"continuousBatching": True}}
# Handler settings a served section sets itself: the model it serves, the profile's own server.
BENCH_OWNED_SETTINGS = ("model_path", "profiler")
RANDOM_MODELS = {"sd15": sd15.ensure_model, "sdxl": sdxl.ensure_model, "sd35": sd35.ensure_model}
FLOW = "flow_match_euler"  # SD 3's scheduler


@dataclass(frozen=True)
class Plan:
    """Models and sizes of one run: the issue's on a GPU, tiny ones for CI."""

    sd15_model: str  # "sd15" (random weights, made once) or a diffusers directory
    sdxl_model: str  # "sdxl" or a diffusers directory
    side: int
    steps: int
    served_steps: int
    batches: tuple[int, ...]
    engine_batches: tuple[int, ...]
    concurrency: tuple[int, ...]
    sdxl_side: int
    sdxl_steps: int
    sd35_model: str  # "sd35" or a diffusers directory
    sd35_side: int
    sd35_steps: int
    sd35_batches: tuple[int, ...]  # in-process batches, and the served concurrency
    lora_side: int  # SD 1.5 with LoRAs (bench.loras): side, LoRA rank, steps timed per round
    lora_rank: int
    lora_steps: int
    repeats: int
    engine_repeats: int
    requests_per_client: int
    max_batch_limit: int
    controlnet_side: int  # SD 1.5 with ControlNets (bench.controlnets): side, steps timed per round
    controlnet_steps: int
    cache_side: int  # step caching (bench.cache): SD 1.5's side and steps, SD 3.5's, paired rounds
    cache_steps: int
    cache_sd35_side: int
    cache_sd35_steps: int
    cache_repeats: int
    # SDXL's compiled variant beside eager. The quick plan leaves it out: the variants section
    # already runs the compiled path of the same code on SD 1.5's tiny model, the compiled SDXL
    # UNet is checked against diffusers in tests/unit/test_engine_lora_slots.py, and its cold
    # compile is half a minute of the suite.
    sdxl_compiled: bool = True
    # The served step's profile (handler.profiler, on a server of its own): this many forwards, from
    # the first of more guided images than the second-highest concurrency; the quick plan's from the
    # first forward (its one-step requests may never share one).
    served_profile_steps: int = 10
    served_profile_first_forward: bool = False
    # The lora section's compiled designs' compile.backend. The quick plan traces them only
    # ("cudagraphs": dynamo's graphs of eager's kernels, nothing recorded off CUDA): inductor's
    # compile of the tiny UNet's gathered slots is tests/unit/test_engine_lora_slots.py's, and
    # compiling it again here was 160 s of the suite (2026-11-30).
    lora_compile_backend: str = "inductor"


FULL = Plan(
    "sd15",
    "sdxl",
    sd15.NATIVE_SIDE,
    50,
    25,
    (1, 2, 4, 8, 16),
    (1, 8),
    (1, 4, 8, 16),
    sdxl.NATIVE_SIDE,
    30,
    "sd35",
    sd35.NATIVE_SIDE,
    28,
    (1, 4),
    sd15.NATIVE_SIDE,
    16,
    5,
    repeats=3,
    engine_repeats=5,
    requests_per_client=6,
    max_batch_limit=128,
    controlnet_side=sd15.NATIVE_SIDE,
    controlnet_steps=5,
    cache_side=sd15.NATIVE_SIDE,
    cache_steps=25,
    cache_sd35_side=512,
    cache_sd35_steps=28,
    cache_repeats=1,
)
# Scaling at batch 1 only: a CPU compiles each new batch's graph cold (98 s of the quick run's
# 474 s, 2026-11-26), and batch 1's is the one the variants section left warm.
QUICK = Plan(
    str(TINY_MODEL_DIRS["sd1"].relative_to(ROOT)),
    str(TINY_MODEL_DIRS["sdxl"].relative_to(ROOT)),
    64,
    1,
    1,
    (1,),
    (1, 2),
    (1, 2),
    64,
    1,
    str(TINY_MODEL_DIRS["sd35"].relative_to(ROOT)),
    64,
    1,
    (1, 2),
    64,
    4,
    1,
    repeats=1,
    engine_repeats=1,
    requests_per_client=2,
    max_batch_limit=0,
    controlnet_side=64,
    controlnet_steps=1,
    cache_side=64,
    cache_steps=2,
    cache_sd35_side=64,
    cache_sd35_steps=4,  # the tiny model's first block changes by more than 0.3 at its second step
    cache_repeats=1,
    sdxl_compiled=False,
    served_profile_steps=2,  # over two TorchServe calls in continuous batching: each 1-step request ends one
    served_profile_first_forward=True,
    lora_compile_backend="cudagraphs",
)


BUILD_FAILURES: dict[str, Exception] = {}  # random-weight architectures that failed to build in this run


@functools.cache
def model_dir(name: str) -> Path:
    """A random-weight architecture by name (written once), or a directory relative to the repository.
    One that failed to build fails again at once: a later section does not spend minutes on it."""
    if name not in RANDOM_MODELS:
        return (ROOT / name).resolve()
    if name in BUILD_FAILURES:
        failed = BUILD_FAILURES[name]
        raise RuntimeError(f"the random-weight {name} model failed to build earlier in this run") from failed
    try:
        return RANDOM_MODELS[name]()
    except Exception as error:
        BUILD_FAILURES[name] = error
        raise


class GpuBench:
    """Runs the sections of one plan; every section's JSON carries the environment it ran in."""

    def __init__(
        self,
        plan: Plan,
        device: str,
        output: Path,
        scratch: Path,
        timeout: float,
        compiled: str | None = None,
        served_settings: dict | None = None,
        served_modes: tuple[str, ...] = tuple(SERVED_MODES),
        reuse_ceilings: bool = False,
    ):
        self.plan = plan
        self.compiled = compiled  # the compile mode scaling and sdxl measure; None: the fastest in variants
        self.served_settings = served_settings or {}  # handler settings of the served sections' servers
        self.served_modes = served_modes  # the batching modes the served section measures
        self.reuse_ceilings = reuse_ceilings  # in-process ceilings an earlier run left in scratch are taken
        self.device_setting = device
        self.device = resolve_device(device)
        self.output = output
        self.scratch = scratch
        self.timeout = timeout
        self.caches = scratch / "inductor"  # shared, so a shape compiled in one section is warm in the next
        self.environment = environment(self.device)
        self.measured: dict[str, dict] = {}  # what each section measured in this run, as last saved
        self.rows: dict[tuple[str, str], dict] = {}  # (workload, variant) -> the row this run measured

    def workload(
        self, model: str, side: int, steps: int, batch: int = 1, max_batch_limit: int = 0, scheduler: str = "ddim"
    ) -> Workload:
        return Workload(
            str(model_dir(model)),
            self.device_setting,
            side,
            side,
            steps,
            batch,
            self.plan.repeats,
            scheduler=scheduler,
            max_batch_limit=max_batch_limit,
        )

    def section(self, name: str) -> dict | None:
        path = self.output / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def save(self, name: str, result: dict, status: str = "running") -> None:
        """The section's file, rewritten after every measurement (``status`` "running" until it ends),
        so a call stopped at its time limit keeps what it measured."""
        self.output.mkdir(parents=True, exist_ok=True)
        self.measured[name] = result
        result = {
            "section": name,
            "status": status,
            "environment": self.environment,
            "plan": asdict(self.plan),
            **result,
        }
        (self.output / f"{name}.json").write_text(json.dumps(result, indent=2))

    def best_compiled(self) -> str:
        """The compile mode asked for (``--compiled``), else the one with the highest UNet it/s in
        ``variants`` (``compile-default`` before it ran)."""
        if self.compiled:
            return self.compiled
        rows = (self.section("variants") or {}).get("variants", [])
        compiled = [row for row in rows if row["status"] == "ok" and by_name(row["name"]).compiled]
        if not compiled:
            logger.warning("no compiled variant measured in %s: using compile-default", self.output / "variants.json")
            return "compile-default"
        return max(compiled, key=lambda row: row["unet_it_s"])["name"]

    def variants(self, names: list[str] | None) -> dict:
        """Measured variants merged into the rows of an earlier call on the same GPU and workload."""
        workload = self.workload(
            self.plan.sd15_model, self.plan.side, self.plan.steps, max_batch_limit=self.plan.max_batch_limit
        )
        previous = self.section("variants")
        same = (
            previous
            and previous.get("workload") == asdict(workload)
            and previous["environment"]["device_name"] == self.environment["device_name"]
        )
        rows = {row["name"]: row for row in previous["variants"]} if same else {}

        def merged(results: dict[str, dict]) -> dict:
            rows.update(
                {name: {"name": name, "summary": by_name(name).summary, **result} for name, result in results.items()}
            )
            return {
                "workload": asdict(workload),
                "baseline": EAGER,
                "variants": [rows[name] for name in SECTION_VARIANTS if name in rows],
            }

        if rows:  # an earlier call's rows on this GPU stand even if this call fails before measuring
            self.measured["variants"] = merged({})

        runner = Runner(
            workload,
            self.scratch / "variants",
            self.timeout,
            baseline=EAGER,
            profile=True,
            caches=self.caches,
            max_batch_for={EAGER, "vanilla"},
        )
        results = runner.variants(
            select(names or list(SECTION_VARIANTS), EAGER),
            self.device,
            on_result=lambda partial: self.save("variants", merged(partial)),
        )
        self.rows.update({(row_key(workload), name): row for name, row in results.items()})
        return merged(results)

    def row(self, workload: Workload, name: str, scratch: str, reuse: bool = False) -> dict:
        """``name``'s row on ``workload``: the one a section of this run measured (the batch-1 scaling
        point and ceiling are the variants section's workload), else (``reuse``) the one an earlier
        run measured in ``scratch`` for the same workload, else measured now, in ``scratch``."""
        key = (row_key(workload), name)
        if key in self.rows and self.rows[key].get("status") == "ok":  # a failed one is measured again
            logger.info("%s on %s: measured by an earlier section of this run", name, workload)
        else:
            runner = Runner(workload, self.scratch / scratch, self.timeout, caches=self.caches, reuse=reuse)
            self.rows[key] = runner.variant(by_name(name), self.device, warm=False)
        return self.rows[key]

    def scaling(self) -> dict:
        compiled = self.best_compiled()
        largest = {
            row["name"]: row["max_batch"]
            for row in (self.section("variants") or {}).get("variants", [])
            if "max_batch" in row
        }
        result = {"compiled": compiled, "rows": [], "largest_batch": largest}
        for name in (EAGER, compiled):
            for batch in self.plan.batches:
                workload = self.workload(self.plan.sd15_model, self.plan.side, self.plan.steps, batch)
                row = self.row(workload, name, f"scaling-{batch}")
                result["rows"].append({"variant": name, "batch": batch, **row})
                logger.info("scaling %s batch %d: %s", name, batch, summary(row))
                self.save("scaling", result)
        return result

    def engine(self) -> dict:
        """Eager, and on CUDA with CUDA graphs (inductor's kernels, and eager's; padded rows)."""
        rows: list[dict] = []
        for denoiser in DENOISERS if self.device.type == "cuda" else ("eager",):
            measured = measure_model(
                "sd1",
                model_dir(self.plan.sd15_model),
                self.device_setting,
                list(self.plan.engine_batches),
                self.plan.served_steps,
                self.plan.engine_repeats,
                denoiser=denoiser,
            )
            rows += [{**asdict(row), "ratio": row.ratio, "engine_it_s": row.engine_it_s} for row in measured]
            torch._dynamo.reset()  # its graphs and their CUDA graphs' pool go with it
            gc.collect()  # the engine and diffusers' pipeline measured here leave the GPU to the next one
            release_cached_memory()
            self.save("engine", {"rows": rows})  # eager's rows kept should the compiled ones not finish
        return {"rows": rows}

    def served(self) -> dict:
        """Closed-loop load through TorchServe in each batching mode, next to the in-process ceiling."""
        plan = self.plan
        modes = {mode: SERVED_MODES[mode] for mode in self.served_modes}
        return self._served("served", plan.sd15_model, plan.side, plan.served_steps, plan.concurrency, modes)

    def sd35_served(self) -> dict:
        """SD 3.5 Medium through TorchServe with continuous batching, against ``sd35``'s in-process
        figures at the same batch where that section measured them."""
        plan = self.plan
        measured = {
            row["batch"]: row.get("images_per_s")
            for row in (self.section("sd35") or {}).get("rows", [])
            if row["status"] == "ok"
        }
        continuous = {"continuous": SERVED_MODES["continuous"]}
        return self._served(
            "sd35_served",
            plan.sd35_model,
            plan.sd35_side,
            plan.sd35_steps,
            plan.sd35_batches,
            continuous,
            measured,
            FLOW,
        )

    def _served(
        self,
        section: str,
        model: str,
        side: int,
        steps: int,
        concurrencies: tuple[int, ...],
        modes: dict[str, dict],
        ceilings: dict[int, float | None] | None = None,
        scheduler: str = "ddim",
    ) -> dict:
        """Closed-loop load through TorchServe (one worker on this GPU) in ``modes``, next to the
        in-process ceiling at batch = concurrency (measured here with ``scheduler``, the one the
        server defaults to, unless ``ceilings`` has it)."""
        check_serving_tools()
        result: dict = {
            "ceiling_images_per_s": {},
            "points": [],
            "settings": self.served_settings,
            "reuse_ceilings": self.reuse_ceilings,
        }
        for concurrency in concurrencies:
            ceiling = (ceilings or {}).get(concurrency)
            if ceiling is None:
                workload = self.workload(model, side, steps, concurrency, scheduler=scheduler)
                row = self.row(workload, EAGER, f"{section}-ceiling-{concurrency}", self.reuse_ceilings)
                ceiling = row.get("images_per_s")
                logger.info("in-process ceiling, batch %d: %s", concurrency, summary(row))
            result["ceiling_images_per_s"][concurrency] = ceiling
        bodies = functools.partial(self.bodies, side=side, steps=steps)
        for mode, frontend in modes.items():
            workdir = (self.scratch / f"{section}-{mode}").resolve()
            config = served_config(workdir, model, concurrencies, frontend, self.served_settings)
            with serve_archive(model_dir(model), config, workdir, gpus=1, stop_grace=0) as server:
                for concurrency in concurrencies:
                    closed_loop(server, bodies(concurrency), concurrency)  # warm-up at this concurrency
                    before = server.settled_metric_samples()
                    results, seconds = closed_loop(
                        server, bodies(concurrency * self.plan.requests_per_client), concurrency
                    )
                    figures = server_figures(before, server.settled_metric_samples())
                    point = served_point(
                        mode, concurrency, results, seconds, result["ceiling_images_per_s"][concurrency]
                    )
                    step_share, decode_share = figures.step_seconds / seconds, figures.decode_seconds / seconds
                    result["points"].append(
                        {
                            **point,
                            "mean_batch_size": figures.mean_batch_size,
                            "mean_step_images": figures.mean_step_images,
                            "step_share": step_share,
                            "decode_share": decode_share,
                        }
                    )
                    logger.info(
                        "%s, %s batching, concurrency %d: %.2f images/s, p95 %s s, %s of in-process, "
                        "%.1f images per denoiser forward; steps %s and decodes %s of the time",
                        section,
                        mode,
                        concurrency,
                        point["images_per_s"],
                        number_text(point["p95_s"]),
                        percent_text(point["ratio"]),
                        figures.mean_step_images,
                        percent_text(step_share),
                        percent_text(decode_share),
                    )
                    self.save(section, result)
            profile = self.served_profile(
                workdir.with_name(f"{workdir.name}-profile"), model, concurrencies, frontend, bodies
            )
            result.setdefault("profiles", {})[mode] = profile
            self.save(section, result)
        return result

    def served_profile(
        self, workdir: Path, model: str, concurrencies: tuple[int, ...], frontend: dict, bodies: Callable
    ) -> dict | None:
        """The worker's own profile of its served step (``handler.profiler``), on a server of its own
        (no timed loop runs in a process that profiled): a closed loop of twice the highest
        concurrency's requests, the window the plan's forwards from the first of more guided images
        than the second-highest concurrency (or from the first forward). None where no window closed."""
        shutil.rmtree(workdir, ignore_errors=True)
        below = sorted(concurrencies)[-2] if len(concurrencies) > 1 else 0
        profiler = {
            "steps": self.plan.served_profile_steps,
            "min_rows": 1 if self.plan.served_profile_first_forward else 2 * below + 1,
            "dir": str(workdir / "profiles"),
        }
        top = max(concurrencies)
        config = served_config(workdir, model, concurrencies, frontend, self.served_settings, profiler)
        with serve_archive(model_dir(model), config, workdir, gpus=1, stop_grace=0) as server:
            closed_loop(server, bodies(2 * top), top)
        written = sorted((workdir / "profiles").glob("step-profile-*.json"), key=lambda path: path.stat().st_mtime)
        return json.loads(written[-1].read_text()) if written else None

    def bodies(self, count: int, side: int, steps: int) -> list[dict]:
        """``count`` requests of the served workload (the server's default scheduler, guidance 7.5)."""
        return [
            {
                "prompt": PROMPTS[index % len(PROMPTS)],
                "seed": index,
                "num_inference_steps": steps,
                "width": side,
                "height": side,
            }
            for index in range(count)
        ]

    def sdxl(self) -> dict:
        """SDXL eager, in float32 and (the full plan) in the compile mode of ``best_compiled``:
        UNet it/s, and each image's distance to eager's and to float32's, and each first step's to
        float32's (``to_reference``)."""
        workload = self.workload(self.plan.sdxl_model, self.plan.sdxl_side, self.plan.sdxl_steps)
        scratch = self.scratch / "sdxl"

        def rows(results: dict[str, dict]) -> dict:
            return {
                "workload": asdict(workload),
                "baseline": EAGER,
                "variants": [
                    {"name": name, "summary": by_name(name).summary, **result} for name, result in results.items()
                ],
                "reference": FLOAT32,
                "to_reference": to_reference(results, scratch, FLOAT32),
            }

        names = [EAGER, FLOAT32, *([self.best_compiled()] if self.plan.sdxl_compiled else [])]
        runner = Runner(workload, scratch, self.timeout, baseline=EAGER, caches=self.caches)
        return rows(
            runner.variants(
                [by_name(name) for name in names],
                self.device,
                warm=False,
                on_result=lambda partial: self.save("sdxl", rows(partial)),
            )
        )

    def sd35(self) -> dict:
        """SD 3.5 Medium in-process, eager, at each batch: transformer it/s, seconds per call, peak memory."""
        plan = self.plan
        result: dict = {"rows": []}
        for batch in plan.sd35_batches:
            workload = self.workload(plan.sd35_model, plan.sd35_side, plan.sd35_steps, batch, scheduler=FLOW)
            runner = Runner(workload, self.scratch / f"sd35-{batch}", self.timeout, baseline=EAGER, caches=self.caches)
            row = runner.variant(by_name(EAGER), self.device, warm=False)
            result["rows"].append({"variant": EAGER, "batch": batch, "workload": asdict(workload), **row})
            logger.info("SD 3.5 Medium batch %d: %s", batch, summary(row))
            self.save("sd35", result)
        return result

    def lora(self) -> dict:
        """LoRA sets sharing one SD 1.5 forward, per design of the row-wise path (``bench.loras``)."""
        plan = self.plan
        model = loras.Model("sd15", model_dir(plan.sd15_model), plan.lora_side, plan.lora_rank, 0.02)
        return loras.measure(model, plan.lora_steps, plan.repeats, plan.lora_compile_backend)

    def controlnet(self) -> dict:
        """ControlNets in the shared SD 1.5 forward against a forward per ControlNet set (``bench.controlnets``)."""
        plan = self.plan
        model = controlnets.Model("sd15", model_dir(plan.sd15_model), plan.controlnet_side, None)
        return controlnets.measure(model, plan.controlnet_steps, plan.repeats)

    def cache(self) -> dict:
        """Step caching per request against no cache (``bench.cache``): DeepCache on SD 1.5,
        first-block caching on SD 3.5 Medium."""
        plan = self.plan
        models = [
            bench_cache.Model("sd15", model_dir(plan.sd15_model), plan.cache_side, plan.cache_steps),
            bench_cache.Model(
                "sd35",
                model_dir(plan.sd35_model),
                plan.cache_sd35_side,
                plan.cache_sd35_steps,
                FLOW,
                bench_cache.FIRST_BLOCK_WORKLOADS,
            ),
        ]
        result: dict = {"results": []}
        for model in models:
            result["results"].append(bench_cache.measure(model, model.steps, plan.cache_repeats))
            self.save("cache", result)
            release_cached_memory()
        return result

    def run(self, section: str, variant_names: list[str] | None) -> bool:
        """One section, its file saved and the report rendered whatever happens; False when it failed."""
        started = time.perf_counter()
        logger.info("section %s", section)
        self.measured.pop(section, None)
        try:
            result = self.variants(variant_names) if section == "variants" else getattr(self, section)()
            self.save(section, result, status="ok")
            failed = False
        except Exception as error:  # noqa: BLE001 - the next section still runs; the report says what failed
            logger.exception("section %s failed", section)
            # What this run measured, never an earlier run's file (it may be another GPU's).
            self.save(section, {**self.measured.get(section, {}), "error": error_text(error)}, status="failed")
            failed = True
        try:
            render(self.output)
        except Exception:  # noqa: BLE001 - the section's file is saved; the next section still runs
            logger.exception("rendering %s failed", self.output / "gpu.md")
        logger.info(
            "section %s %s in %.0f s; report in %s",
            section,
            "FAILED" if failed else "done",
            time.perf_counter() - started,
            self.output / "gpu.md",
        )
        return not failed


def row_key(workload: Workload) -> str:
    """What a row measured on ``workload`` is known by: the largest-batch search (``max_batch_limit``,
    the variants section's) adds to a row and changes none of its timings."""
    return json.dumps({**asdict(workload), "max_batch_limit": None}, sort_keys=True)


def check_serving_tools() -> None:
    """TorchServe's commands and a Java runtime, before any GPU time is spent on the section."""
    for command in ("torchserve", "torch-model-archiver"):
        console_script(command)
    if shutil.which("java") is None:
        raise FileNotFoundError("no java on PATH: TorchServe's frontend needs Java 17 or later (docs/performance.md)")


def served_config(
    workdir: Path,
    model: str,
    concurrencies: tuple[int, ...],
    frontend: dict,
    settings: dict,
    profiler: dict | None = None,
) -> Path:
    """The model config of a served section's server: one worker, TorchServe's batch the highest
    concurrency (``frontend``: the batching mode's settings), the handler ``settings`` asked for
    (``--served-setting``), ``handler.profiler`` where given."""
    handler: dict = {"model_path": str(model_dir(model)), **settings}
    if profiler:
        handler["profiler"] = profiler
    return write_model_config(
        workdir, handler=handler, minWorkers=1, maxWorkers=1, batchSize=max(concurrencies), **frontend
    )


def served_point(
    mode: str, concurrency: int, results: list[tuple[float, bool, int]], seconds: float, ceiling: float | None
) -> dict:
    latencies = [latency for latency, ok, _ in results if ok]
    p50, p95 = (float(value) for value in np.quantile(latencies, [0.5, 0.95])) if latencies else (None, None)
    images_per_s = len(latencies) / seconds
    return {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(latencies),
        "retries": sum(retries for _, _, retries in results),
        "images_per_s": images_per_s,
        "p50_s": p50,
        "p95_s": p95,
        "ceiling_images_per_s": ceiling,
        "ratio": images_per_s / ceiling if ceiling else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sections", nargs="*", choices=SECTIONS, help="default: every section (variants alone with --variants)"
    )
    parser.add_argument(
        "--variants", nargs="*", choices=SECTION_VARIANTS, help="the variants section's subset (eager always runs)"
    )
    parser.add_argument(
        "--compiled",
        choices=[name for name in SECTION_VARIANTS if by_name(name).compiled],
        help="the compile mode scaling and sdxl measure (default: the fastest in the output directory's "
        "variants.json, compile-default without one)",
    )
    parser.add_argument(
        "--served-modes",
        nargs="+",
        default=list(SERVED_MODES),
        choices=list(SERVED_MODES),
        help="the batching modes the served section measures (default: both)",
    )
    parser.add_argument(
        "--served-setting",
        dest="served_settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a handler setting of the served sections' servers, VALUE read as YAML, KEY dotted for nested "
        "settings (decode_stream=own, iteration_budget_ms=25, compile.enabled=true); repeatable; default: as shipped",
    )
    parser.add_argument(
        "--reuse-ceilings",
        action="store_true",
        help="take the served sections' in-process ceilings from an earlier run in the same --scratch (same "
        "workload), so runs with other --served-setting values share them",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="CI mode: tiny models, 64x64, one step, on the CPU")
    parser.add_argument("--output-dir", type=Path, help="default: reports/gpu (reports/gpu-quick with --quick)")
    parser.add_argument(
        "--scratch", type=Path, help="images, inductor caches and server state (default: build/bench-gpu)"
    )
    parser.add_argument("--timeout", type=float, default=450, help="seconds one measuring process may take")
    args = parser.parse_args(argv)
    args.sections = args.sections or (["variants"] if args.variants else list(SECTIONS))
    if args.quick and args.device == "auto":
        args.device = "cpu"
    args.output_dir = args.output_dir or REPORTS / ("gpu-quick" if args.quick else "gpu")
    args.scratch = args.scratch or BUILD / ("bench-gpu-quick" if args.quick else "bench-gpu")
    try:
        args.served_settings = handler_settings(args.served_settings)
    except ValueError as error:
        parser.error(f"--served-setting: {error}")
    args.served_modes = tuple(dict.fromkeys(args.served_modes))
    if args.served_modes != tuple(SERVED_MODES) and "served" not in args.sections:
        logger.warning("--served-modes: no served section runs; ignored")
    if args.served_settings and not {"served", "sd35_served"} & set(args.sections):
        logger.warning("--served-setting: no served section runs; ignored")
    return args


def handler_settings(assignments: list[str]) -> dict:
    """``KEY=VALUE`` assignments as the nested ``handler`` settings of a model config (VALUE read as
    YAML, a word YAML 1.1 reads as a boolean other than true and false kept as text, a dotted KEY
    nested), checked as a worker reads the served sections' model config. Raises ValueError naming
    the assignment or the setting refused."""
    settings: dict = {}
    for assignment in assignments:
        key, equals, text = assignment.partition("=")
        if not equals or not key:
            raise ValueError(f"{assignment!r} is not KEY=VALUE")
        *parents, name = key.split(".")
        if (section := key.split(".", 1)[0]) in BENCH_OWNED_SETTINGS:
            raise ValueError(f"{assignment!r}: the bench sets {section} itself")
        target = settings
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise ValueError(f"{assignment!r}: {parent} is set to a value, not settings")
        if isinstance(target.get(name), dict):
            raise ValueError(f"{assignment!r}: {key} has settings of its own, set them one by one")
        value = yaml.safe_load(text)
        target[name] = text if isinstance(value, bool) and text.lower() not in ("true", "false") else value
    try:
        HandlerSettings.from_model_yaml(merged_model_config({"model_path": "model", **settings}))
    except (ValidationError, ValueError) as error:
        raise ValueError(str(error)) from None
    return settings


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    plan = QUICK if args.quick else FULL
    bench = GpuBench(
        plan,
        args.device,
        args.output_dir,
        args.scratch,
        args.timeout,
        args.compiled,
        args.served_settings,
        args.served_modes,
        args.reuse_ceilings,
    )
    if bench.device.type != "cuda" and not args.quick:
        logger.warning("no GPU here (%s): the full plan will be slow; --quick is the CPU mode", bench.device)
    logger.info("plan: %s on %s; sections %s", plan, bench.device, ", ".join(args.sections))
    if args.served_settings or args.served_modes != tuple(SERVED_MODES):
        logger.info("served: %s batching, handler settings %s", " and ".join(args.served_modes), args.served_settings)
    failed = []
    for number, section in enumerate(args.sections, 1):
        logger.info("[%d/%d]", number, len(args.sections))
        if not bench.run(section, args.variants):
            failed.append(section)
    report = args.output_dir / "gpu.md"
    if report.is_file():
        print(report.read_text())
    if failed:
        sys.exit(f"failed sections: {', '.join(failed)} (their errors are in {args.output_dir})")


if __name__ == "__main__":
    main()
