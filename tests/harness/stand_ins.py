"""A stand-in for the step engine and the service built on it, shared by the service tests and
the fuzzing tests (``tests/unit/test_request_fuzz.py``)."""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import torch
from PIL import Image

from handler.adapters.controlnets import ControlNetLibrary
from handler.adapters.loras import LoraLibrary
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest
from handler.config import CacheSettings, FamilyRules, RequestDefaults
from handler.engine.decoding import DecodeFailed, LaterDecode
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.scheduling import StepProfile
from handler.engine.step_engine import StepEngine
from handler.engine.timing import Span
from handler.families import Conditioning, Decoded
from handler.metrics import DiffusionMetrics, MetricSpec
from handler.service.loops import DiffusionService

SHAPE = (4, 8, 8)  # latents of a 64x64 image
FAILS_AT_START, FAILS_STEPPING = "explode at start", "explode"  # prompts that make the stand-in fail


class SolidColorEngine:
    """Stands in for ``StepEngine``: image k of a job is grey level ``seed + k``; prompts (and
    settings) ask for failures."""

    device = torch.device("cpu")
    loras = LoraLibrary(None, torch.nn.Module(), None, max_loaded=1)  # no LoRA directory
    # no ControlNet directory, for any family that takes ControlNets
    controlnets = ControlNetLibrary(
        SimpleNamespace(rules=FamilyRules(), controlnet_files=True), None, 1, torch.device("cpu"), torch.float32
    )
    embeddings = None  # no embedding directory
    # What the service's row costs read of a family: as for one without ControlNets, they count no
    # denoiser operations, and a new shape's rows cost their count.
    family = SimpleNamespace(rules=FamilyRules(controlnets=False), controls_in_blocks=False)
    row_counts: tuple[int, ...] = ()  # no padding
    cuda_graphs = False
    padding = StepEngine.padding  # the step engine's rules
    _own_forward = StepEngine._own_forward

    def __init__(
        self,
        out_of_memory_above_images: int = 1000,
        decode_out_of_memory_above_images: int = 1000,
        images_out_of_memory_above: int = 1000,
        tiles_fail: bool = False,
        flagged_seeds: set[int] | None = None,
    ):
        self.out_of_memory_above_images = out_of_memory_above_images
        self.decode_out_of_memory_above_images = decode_out_of_memory_above_images
        self.images_out_of_memory_above = images_out_of_memory_above  # the host part (a safety checker's place)
        self.tiles_fail = tiles_fail
        self.flagged_seeds = flagged_seeds
        self.broken = False  # every step fails while set
        self.starts: list[list[str]] = []  # prompts of the jobs in each start call
        self.steps: list[list[str]] = []  # prompts of the jobs in each forward
        self.decodes: list[tuple[int, bool]] = []  # (images, tiled)
        self.images_made_on: list[str] = []  # the threads that made each decode's images
        self.images_fail_for_seed: int | None = None  # making the images of a decode with this seed fails

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        return 4, height // 8, width // 8

    def start(self, specs: list[JobSpec]) -> list[DenoiseJob]:
        """Jobs started together; the whole call fails when one prompt asks for it, as a shared
        text-encoder call would."""
        self.starts.append([spec.prompt for spec in specs])
        if any(spec.prompt == FAILS_AT_START for spec in specs):
            raise RuntimeError("text encoder broke")
        return [self._job(spec) for spec in specs]

    def _job(self, spec: JobSpec) -> DenoiseJob:
        latents = (
            torch.tensor([float(seed % 256) for seed in spec.seeds])
            .view(-1, 1, 1, 1)
            .expand(-1, *self.latent_shape(spec.width, spec.height))
            .clone()
        )
        rows = spec.images * (2 if spec.guidance_scale > 1 else 1)
        return DenoiseJob(
            spec, None, torch.arange(spec.num_inference_steps), latents, Conditioning(torch.zeros(rows, 1, 1))
        )

    def step(self, jobs: list[DenoiseJob]) -> int:
        self.steps.append([job.spec.prompt for job in jobs])
        if self.broken or any(job.spec.prompt == FAILS_STEPPING for job in jobs):
            raise RuntimeError("boom")
        if sum(job.images for job in jobs) > self.out_of_memory_above_images:
            raise torch.OutOfMemoryError("CUDA out of memory")
        for job in jobs:
            job.step += 1
        return 0  # ControlNet forwards

    def decode(self, latents: torch.Tensor, width: int, height: int, tiled: bool = False) -> Decoded:
        try:
            return self.decode_later(latents, width, height, tiled).result().decoded
        except DecodeFailed as failed:
            raise failed.error from None  # as the step engine's decode raises it

    def decode_later(self, latents: torch.Tensor, width: int, height: int, tiled: bool = False) -> LaterDecode:
        self.decodes.append((latents.shape[0], tiled))
        if tiled and self.tiles_fail or not tiled and latents.shape[0] > self.decode_out_of_memory_above_images:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return LaterDecode.queued(latents, Span(self.device).end(), functools.partial(self._images, width, height))

    def _images(self, width: int, height: int, latents: torch.Tensor) -> Decoded:
        """The host part of a decode (the thread it ran on recorded)."""
        self.images_made_on.append(threading.current_thread().name)
        if latents.shape[0] > self.images_out_of_memory_above:
            raise torch.OutOfMemoryError("CUDA out of memory")
        levels = [int(value) for value in latents[:, 0, 0, 0]]
        if self.images_fail_for_seed in levels:
            raise RuntimeError("safety checker broke")
        images = [Image.new("RGB", (width, height), (level,) * 3) for level in levels]
        flags = None if self.flagged_seeds is None else [level in self.flagged_seeds for level in levels]
        return Decoded(images, flags)


class RecordingSink:
    def __init__(self) -> None:
        self.records: list[tuple[str, float, tuple[str, ...]]] = []

    def __call__(self, spec: MetricSpec, value: float, labels: tuple[str, ...]) -> None:
        self.records.append((spec.name, value, labels))

    def values(self, name: str) -> list[float]:
        return [value for recorded, value, _ in self.records if recorded == name]

    def names(self) -> set[str]:
        return {name for name, _, _ in self.records}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def make_service(
    engine=None, sink=None, streaming=True, cap_profile=(2, 4, 8, 16), sla=2.0, cache=None, **kwargs
) -> DiffusionService:
    """A service whose profile says one forward takes the same time for 2 to 16 UNet rows (cap 16
    rows: 8 guided images); ``cache``: its ``CacheSettings``."""
    engine = engine or SolidColorEngine()
    policy = RequestPolicy(
        defaults=RequestDefaults(width=64, height=64),
        streaming=streaming,
        rules=getattr(engine, "rules", FamilyRules()),
        cache=cache or CacheSettings(),
    )
    profile = StepProfile(engine, max_images=8)
    for shape in (SHAPE, (4, 8, 16), (4, 16, 16)):
        profile.seconds[shape] = {size: 0.1 for size in cap_profile}
    return DiffusionService(
        engine,
        policy,
        profile,
        DiffusionMetrics(sink or RecordingSink(), sla),
        sla,
        clock=kwargs.pop("clock", Clock()),
        **kwargs,
    )


def batch(service: DiffusionService, *incoming: IncomingRequest) -> list:
    responses = service.run_batch({str(index): item for index, item in enumerate(incoming)})
    return [responses[str(index)] for index in range(len(incoming))]


def run(
    service: DiffusionService, arrivals: dict[int, dict[str, IncomingRequest]], limit: int = 200
) -> dict[str, list]:
    """Continuous batching: iterate until every request has its final part; ``arrivals`` maps an
    iteration to the requests that arrive then."""
    parts: dict[str, list] = {}
    live: dict[str, IncomingRequest] = {}
    for iteration in range(limit):
        live.update(arrivals.get(iteration, {}))
        if not live and iteration > max(arrivals):
            return parts
        for rid, part in service.iterate(
            {
                rid: live[rid] if iteration in arrivals and rid in arrivals[iteration] else IncomingRequest(None)
                for rid in live
            }
        ).items():
            parts.setdefault(rid, []).append(part)
            if part.final:
                del live[rid]
    raise AssertionError("requests did not finish")
