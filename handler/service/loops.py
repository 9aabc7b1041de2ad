"""One service for both TorchServe batching modes: admit, step, finish, answer.

Requests become jobs of the step engine at admission (``handler.service.admission``). Then
iterations: jobs that would pass their time limit are cancelled, ONE denoiser forward steps the
chosen jobs of one latent shape whatever their steps, scheduler and guidance
(``handler.service.stepping``), and finished jobs are decoded together, encoded on encoder
threads and answered (``handler.service.finishing``; on a GPU while the next forward runs).
TorchServe's two modes are two loops over the same iteration:

- dynamic batching (``run_batch``): a batch is admitted, then iterated until every job is done;
- continuous batching (``iterate``): one iteration per call; requests join and leave between
  steps, and streamed requests get a progress line per step.

Every request gets exactly one final ``Response`` (``handler.service.answers``); a bad or failing
request never fails the others.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from handler.adapters.lora_slots import compiled_graphs
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest, Response
from handler.config import HandlerSettings, StepCache, WarmupShape
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.loading import (
    cuda_graph_skips,
    load_engine,
    release_cached_memory,
    reserved_memory,
    use_device,
)
from handler.engine.profiling import StepsProfiler
from handler.engine.scheduling import StepProfile
from handler.engine.step_engine import StepEngine
from handler.metrics import DiffusionMetrics, MetricSink
from handler.service.admission import Admission
from handler.service.answers import Answers, joined
from handler.service.finishing import Finishing
from handler.service.flights import Flights
from handler.service.stepping import Stepping

logger = logging.getLogger(__name__)


class DiffusionService:
    """Serves text-to-image requests with one step engine, in either batching mode."""

    def __init__(
        self,
        engine: StepEngine,
        policy: RequestPolicy,
        profile: StepProfile,
        metrics: DiffusionMetrics,
        latency_sla_seconds: float,
        log_prompts: bool = False,
        iteration_budget_seconds: float = 0.0,
        request_timeout_seconds: float = math.inf,
        batch_size: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drain_left: Callable[[], float | None] = lambda: None,
        encode_threads: int = 4,
        overlap_encoding: bool | None = None,
        profiler: StepsProfiler | None = None,
    ):
        self.engine = engine
        self.policy = policy
        self.profile = profile
        self.metrics = metrics
        self.iteration_budget = iteration_budget_seconds
        self.batch_size = batch_size  # TorchServe's: with continuous batching, the most requests in flight
        self.clock = clock
        self.flights = Flights()
        self.answers = Answers(self.flights, metrics, clock)
        # drain_left: while the server is stopping, the seconds left to answer every request (None otherwise)
        self.admission = Admission(
            engine,
            policy,
            profile,
            metrics,
            self.flights,
            clock,
            latency_sla_seconds,
            request_timeout_seconds,
            log_prompts,
            drain_left,
        )
        self.stepping = Stepping(
            engine,
            profile,
            metrics,
            self.flights,
            self.answers,
            clock,
            request_timeout_seconds,
            drain_left,
            profiler,
        )
        # overlap_encoding, None: on CUDA, where the forward queued before the encodings runs meanwhile
        overlap = engine.device.type == "cuda" if overlap_encoding is None else overlap_encoding
        encoder = ThreadPoolExecutor(
            encode_threads, thread_name_prefix="sd-encode", initializer=use_device, initargs=(engine.device,)
        )
        self.finishing = Finishing(engine, metrics, self.flights, self.answers, encoder, overlap)

    # The two loops TorchServe's modes run.

    def run_batch(self, requests: dict[str, IncomingRequest]) -> dict[str, Response]:
        """Dynamic batching: admit the batch and iterate until every job is done."""
        try:
            responses = self.admission.admit(requests)
            while self.flights:
                responses.update(self._iteration())
        finally:  # an unexpected error fails this batch (TorchServe answers it); the next starts clean
            self.flights.clear()
            self.flights.waiting = 0
            self.answers.delivered()
        return responses

    def iterate(self, requests: dict[str, IncomingRequest]) -> dict[str, Response]:
        """Continuous batching: iterations for the requests TorchServe has in flight (by id), ids
        not seen before admitted first, until ``_call_done``. One ``Response`` per id: an empty
        body while a request that is not streamed is still denoising. A flight whose id is
        missing lost its client."""
        for gone in set(self.flights) - set(requests):
            logger.info("request %s left before it finished (client gone); dropping it", gone)
            del self.flights[gone]
            self.metrics.cancelled("client_gone")
        started = self.clock()
        responses = self.admission.admit(
            {rid: incoming for rid, incoming in requests.items() if rid not in self.flights}
        )
        while True:
            for rid, response in self._iteration().items():
                responses[rid] = joined(responses[rid], response) if rid in responses else response
            if self._call_done(started, responses):
                break
        for rid in requests:
            if rid not in responses:
                responses[rid] = self.answers.part(self.flights[rid], b"", final=False)
        self.answers.delivered()
        return responses

    def _iteration(self) -> dict[str, Response]:
        """1. Cancel what would pass its time limit; 2. step the chosen jobs in one forward (queued
        on a GPU, not waited for); 3. decode the finished ones, encode them on the encoder threads
        and answer those encoded."""
        responses = self.stepping.cancel_expired()
        responses.update(self.stepping.step_chosen())
        responses.update(self.finishing.finish())
        if not self.flights:  # idle next: the last steps' times are read now
            self.stepping.timer.collect(wait=True)
        self.metrics.queue(self.flights.gauges())
        return responses

    def _call_done(self, started: float, responses: dict[str, Response]) -> bool:
        """Whether a continuous-batching call returns now. Never while a gRPC request is unfinished:
        TorchServe 0.12 ends a gRPC call with the first part of its answer, so that answer must
        leave whole. Else when a request finished or none is left, or when the iteration budget is
        spent and a new call helps someone: a request could join (fewer in flight than
        TorchServe's batch size) or a streamed request awaits its progress lines. A full batch
        without a stream keeps stepping: TorchServe would let no request join, so a return would
        only cost a round trip."""
        if any(flight.over_grpc for flight in self.flights.values()):
            return False
        if not self.flights or any(response.final for response in responses.values()):
            return True
        if self.clock() - started < self.iteration_budget:
            return False
        full = self.batch_size is not None and len(self.flights) >= self.batch_size
        return not full or any(flight.request.stream for flight in self.flights.values())

    def warm_up(self, shapes: tuple[WarmupShape, ...]) -> float:
        """Profile each shape's step times, then run one job of it through start, steps and decode
        (a compiled VAE decoder also decodes one image and two), so that the first request pays no
        allocation or compilation. The profile's steps at 1, 2, 4, ... images compile a compiled
        denoiser for each row count; in one with LoRA slots, the same runs again with LoRA rows;
        with a step cache served, each run also steps a cached job beside the plain one, cached jobs
        of the profile's sizes and a cached single row, which compiles the cache's regions on all
        rows, on a sub-batch and on one row. Returns seconds."""
        started = time.perf_counter()
        cache = self.engine.warm_up_cache()
        for shape in shapes:
            graphs, reserved, skips = compiled_graphs(), reserved_memory(self.engine.device), cuda_graph_skips()
            self.profile.measure(shape.width, shape.height)
            spec = self._warm_up_spec(shape)
            if not self.profile.fits_job(spec):
                logger.warning("warm-up shape %s does not fit in memory; skipped", shape.model_dump())
                self._log_warmed_up(shape, graphs, reserved, skips)  # what its profile compiled
                continue
            self._warm_up_decodes(self._warm_up_jobs(spec, cache))
            if self.engine.loras.slots is not None:
                with self.engine.loras.slots.lora_graph():
                    self.profile.step_each_size(shape.width, shape.height)  # the profile's, with LoRA rows
                    self._warm_up_jobs(spec, cache)
            self._log_warmed_up(shape, graphs, reserved, skips)
        return time.perf_counter() - started

    def _log_warmed_up(
        self, shape: WarmupShape, graphs_before: int, reserved_before: int | None, skips_before: int
    ) -> None:
        """The graphs a shape's warm-up compiled (with CUDA graphs, each records one) and the device
        memory it left reserved (CUDA graphs' pools included); a warning for those of its graphs
        that run without CUDA graphs where the denoiser should replay them."""
        graphs, reserved = compiled_graphs(), reserved_memory(self.engine.device)
        memory = ""
        if reserved is not None and reserved_before is not None:
            mib, grown = reserved / 2**20, (reserved - reserved_before) / 2**20
            memory = f"; device memory reserved {mib:.0f} MiB ({grown:+.0f} MiB)"
        logger.info(
            "warm-up %dx%d: %d graphs compiled (%d in this worker)%s",
            shape.width,
            shape.height,
            graphs - graphs_before,
            graphs,
            memory,
        )
        skipped = cuda_graph_skips() - skips_before
        if self.engine.cuda_graphs and skipped:
            logger.warning(
                "warm-up %dx%d: %d compiled graphs run without CUDA graphs, each launching its kernels one by "
                "one (torch's cudagraphs log says why)",
                shape.width,
                shape.height,
                skipped,
            )

    def _warm_up_spec(self, shape: WarmupShape) -> JobSpec:
        defaults = self.policy.defaults
        return JobSpec(
            "warm-up",
            None,
            tuple(range(shape.batch_size)),
            shape.width,
            shape.height,
            shape.num_inference_steps,
            defaults.scheduler,
            defaults.guidance_scale,
        )

    def _warm_up_jobs(self, spec: JobSpec, cache: StepCache | None) -> DenoiseJob:
        """A job of ``spec`` to the end, then (``cache``) it and one with the cache stepped
        together, cached jobs of the profile's sizes, and a cached single unguided image alone: a
        cached forward is not padded, so its one row compiles the regions at one row (dynamo
        compiles a size of 1 apart), here rather than in the first such request. Returns the first job."""
        (job,) = self._warm_up_together([spec])
        if cache is not None:
            cached = dataclasses.replace(spec, cache=cache)
            self._warm_up_together([spec, cached])
            self.profile.step_each_size(spec.width, spec.height, cache)
            self._warm_up_together([dataclasses.replace(cached, seeds=spec.seeds[:1], guidance_scale=1.0)])
        return job

    def _warm_up_together(self, specs: list[JobSpec]) -> list[DenoiseJob]:
        jobs = self.engine.start(specs)
        while not all(job.done for job in jobs):
            self.engine.step([job for job in jobs if not job.done])
        for job in jobs:
            self.engine.decode(job.latents, job.spec.width, job.spec.height)
        return jobs

    def _warm_up_decodes(self, job: DenoiseJob) -> None:
        """Where the VAE decoder is compiled: one image of ``job`` decoded, then two in one call (a
        step decodes the images of every job that finished in it together), so that its graph of
        one image and its graph of two or more (its rows marked dynamic) compile here, not in a
        request. Out of memory is left to serving, which decodes image by image."""
        if not self.engine.compiled_decoder:
            return
        image = job.latents[:1]
        try:
            for latents in (image, torch.cat([image, image])):
                self.engine.decode(latents, job.spec.width, job.spec.height)
        except torch.OutOfMemoryError:
            logger.warning("warm-up: out of memory decoding %d images of %s", len(latents), job.latent_shape)
        else:
            return
        release_cached_memory()  # outside the except block: the failed decode's tensors are gone


def build_service(
    settings: HandlerSettings,
    model_dir: str | Path,
    sink: MetricSink,
    gpu_id: int | None = None,
    streaming: bool = False,
    batch_size: int | None = None,
    worker: str = "0",
    model_name: str = "stable-diffusion",
    drain_left: Callable[[], float | None] = lambda: None,
) -> tuple[DiffusionService, HandlerSettings]:
    """Load the pipeline and build the service exactly as a worker does (the handler, the
    benchmarks and the tests share this); return it with the settings resolved for the model
    (``HandlerSettings.for_model``). ``streaming``: continuous batching, which can stream progress;
    ``batch_size``: TorchServe's; ``worker``: the label of this worker's gauges; ``model_name``: the name TorchServe
    serves it under; ``drain_left``: while the server is stopping, the seconds left to answer every
    request."""
    engine = load_engine(settings, model_dir, gpu_id)
    rules = engine.rules
    settings = settings.for_model(*engine.family.native_size(), rules)
    policy = RequestPolicy(
        settings.limits,
        settings.defaults,
        streaming=streaming,
        model_name=model_name,
        rules=rules,
        cache=settings.cache,
    )
    if policy.default_cache != settings.cache.default:
        logger.warning(
            "handler.cache.default %s is not served by this model (%s); requests without a cache get none",
            settings.cache.default.model_dump(),
            rules.served_caches(),
        )
    sla, options = settings.metrics.latency_sla_seconds, settings.profiler
    service = DiffusionService(
        engine,
        policy,
        StepProfile(engine, settings.max_images_per_call, settings.defaults.scheduler, settings.step_time_cap),
        DiffusionMetrics(sink, sla, worker),
        sla,
        settings.log_prompts,
        settings.iteration_budget_ms / 1000,
        settings.request_timeout_s or math.inf,
        batch_size,
        drain_left=drain_left,
        encode_threads=settings.encode_threads,
        profiler=StepsProfiler(engine.device, options.steps, options.min_rows, options.dir) if options.steps else None,
    )
    return service, settings
