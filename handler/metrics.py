"""Metric names, types and labels in one place, and what the service records.

Every metric means the same with TorchServe's dynamic batching and with its continuous batching:
both run the same step engine. The service records through ``DiffusionMetrics``; where the
numbers go is a ``MetricSink`` (TorchServe's metrics in the handler, a list in tests). ``METRICS``
is the source of the handler's entries in ``metrics.yaml`` (``make metrics-config`` generates the
file; a unit test keeps it equal).

TorchServe gives every histogram the fixed buckets 0.005 .. 10 in Prometheus mode. Latencies are
recorded in seconds; because a request on a CPU or at a large size can take longer than 10 s,
``sd_request_latency_sla_ratio`` records latency divided by the configured SLA as well, so its
buckets (0.5%, ..., 100%, 250%, ..., 1000% of the SLA) give a correct p95 up to 10x the SLA,
and ``sd_latency_sla_seconds`` publishes the SLA to turn the ratio back into seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]
MODEL_LABEL = "model_name"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    unit: str
    help: str
    labels: tuple[str, ...] = ()

    @property
    def dimensions(self) -> list[str]:
        """Label names as TorchServe declares them: the model name first."""
        return [MODEL_LABEL, *self.labels]


REQUEST_LATENCY = MetricSpec(
    "sd_request_latency_seconds",
    "histogram",
    "s",
    "handler time of one admitted request, from admission to its answer (images or an error) leaving the worker",
)
REQUEST_LATENCY_SLA_RATIO = MetricSpec(
    "sd_request_latency_sla_ratio", "histogram", "ratio", "request latency divided by the configured SLA"
)
LATENCY_SLA = MetricSpec("sd_latency_sla_seconds", "gauge", "s", "the configured request latency SLA")
DENOISE_STEP = MetricSpec(
    "sd_denoise_step_seconds",
    "histogram",
    "s",
    "one denoising step: one denoiser forward (UNet or transformer) over the jobs stepped together",
)
VAE_DECODE = MetricSpec(
    "sd_vae_decode_seconds", "histogram", "s", "VAE decode, safety check and post-processing of jobs done together"
)
ENCODE = MetricSpec("sd_encode_seconds", "histogram", "s", "encoding one request's images into the response")
BATCH_SIZE = MetricSpec(
    "sd_batch_size",
    "histogram",
    "requests",
    "requests admitted together (a TorchServe batch, or joining one iteration)",
)
PIPELINE_CALLS = MetricSpec(
    "sd_pipeline_calls_total", "counter", "calls", "pipeline runs completed: jobs of one shape decoded together"
)
IMAGES = MetricSpec("sd_images_total", "counter", "images", "images generated")
INVALID_REQUESTS = MetricSpec(
    "sd_invalid_requests_total", "counter", "requests", "requests rejected with 400, by rejected field", ("field",)
)
OOM_RETRIES = MetricSpec(
    "sd_oom_retries_total",
    "counter",
    "retries",
    "retries after running out of memory, by stage: a step split in halves, a VAE decode per image or in tiles, "
    "a postprocess (safety checker) per image",
    ("stage",),
)
OOM_STAGES = ("step", "vae_decode", "postprocess")
WORKER_WARMUP = MetricSpec(
    "sd_worker_warmup_seconds", "gauge", "s", "worker start: load, optimization, compile, warm-up and step profile"
)
IN_FLIGHT = MetricSpec(
    "sd_in_flight_requests",
    "gauge",
    "requests",
    "requests in this worker's denoising loop (admitted, not answered)",
    ("worker",),
)
IN_FLIGHT_IMAGES = MetricSpec(
    "sd_in_flight_images", "gauge", "images", "images of the requests in this worker's denoising loop", ("worker",)
)
WAITING = MetricSpec(
    "sd_waiting_requests",
    "gauge",
    "requests",
    "requests in this worker waiting for a denoising step: admitted, not finished, left out of the last denoiser "
    "forward (by the batch cap or another latent shape)",
    ("worker",),
)
CANCELLED = MetricSpec(
    "sd_cancelled_requests_total",
    "counter",
    "requests",
    "requests the worker stopped denoising, by reason: client_gone (the client closed its connection), deadline "
    "(past request_timeout_s) or shutdown (the server's stop grace period ended first)",
    ("reason",),
)
CancelReason = Literal["client_gone", "deadline", "shutdown"]
CANCEL_REASONS: tuple[CancelReason, ...] = ("client_gone", "deadline", "shutdown")
ITERATION_BATCH_SIZE = MetricSpec(
    "sd_iteration_batch_size", "histogram", "images", "images stepped by one denoiser forward (UNet or transformer)"
)
ITERATION_CACHED_IMAGES = MetricSpec(
    "sd_iteration_cached_images",
    "histogram",
    "images",
    "images of a denoising step that reused their step cache (DeepCache: deep blocks, first-block: the blocks "
    "after the first, not run; 0: none)",
)
ITERATION_LORA_ADAPTERS = MetricSpec(
    "sd_iteration_lora_adapters",
    "histogram",
    "adapters",
    "distinct LoRA adapters in one denoiser forward, whose rows each get their own request's set (0: no LoRA)",
)
ITERATION_CONTROLNET_FORWARDS = MetricSpec(
    "sd_iteration_controlnet_forwards",
    "histogram",
    "forwards",
    "ControlNet forwards in one denoising step: each ControlNet once over the rows acting with it, beside the one "
    "denoiser forward (0: none)",
)
CONTROLNET_REQUESTS = MetricSpec(
    "sd_controlnet_requests_total",
    "counter",
    "requests",
    "requests admitted with a ControlNet, by ControlNet name (a directory in the ControlNet directory, checked: "
    "bounded by it)",
    ("controlnet",),
)
CONTROLNETS_LOADED = MetricSpec(
    "sd_controlnets_loaded",
    "gauge",
    "controlnets",
    "ControlNets in this worker's memory (handler.controlnets.max_loaded)",
    ("worker",),
)
LORA_REQUESTS = MetricSpec(
    "sd_lora_requests_total",
    "counter",
    "requests",
    "requests admitted with a LoRA adapter, by LoRA name (a file stem in the LoRA directory, checked: bounded by it)",
    ("lora",),
)
LORAS_LOADED = MetricSpec(
    "sd_loras_loaded",
    "gauge",
    "adapters",
    "LoRA adapters in this worker's memory (handler.loras.max_loaded)",
    ("worker",),
)
DEADLINE_MISSES = MetricSpec(
    "sd_deadline_misses_total", "counter", "requests", "requests finished later than the latency SLA after admission"
)

METRICS = (
    REQUEST_LATENCY,
    REQUEST_LATENCY_SLA_RATIO,
    LATENCY_SLA,
    DENOISE_STEP,
    VAE_DECODE,
    ENCODE,
    BATCH_SIZE,
    PIPELINE_CALLS,
    IMAGES,
    INVALID_REQUESTS,
    OOM_RETRIES,
    WORKER_WARMUP,
    IN_FLIGHT,
    IN_FLIGHT_IMAGES,
    WAITING,
    CANCELLED,
    ITERATION_BATCH_SIZE,
    ITERATION_CACHED_IMAGES,
    ITERATION_LORA_ADAPTERS,
    DEADLINE_MISSES,
    LORA_REQUESTS,
    LORAS_LOADED,
    ITERATION_CONTROLNET_FORWARDS,
    CONTROLNET_REQUESTS,
    CONTROLNETS_LOADED,
)

# Where recorded values go: called with the metric, the value and the values of ``spec.labels``.
MetricSink = Callable[[MetricSpec, float, tuple[str, ...]], None]


@dataclass(frozen=True)
class QueueGauges:
    """A worker's queue at one moment: requests and images in its denoising loop, and requests
    waiting for a step."""

    requests: int = 0
    images: int = 0
    waiting: int = 0


class DiffusionMetrics:
    """What the service measures, in its own words. ``worker`` labels the per-worker gauges."""

    def __init__(self, sink: MetricSink, latency_sla_seconds: float, worker: str = "0"):
        self.sink = sink
        self.latency_sla_seconds = latency_sla_seconds
        self.worker = worker
        self._queue: QueueGauges | None = None
        self._loras_loaded: int | None = None
        self._controlnets_loaded: int | None = None

    def _record(self, spec: MetricSpec, value: float, *labels: str) -> None:
        self.sink(spec, value, labels)

    def batch_received(self, size: int) -> None:
        """Requests admitted together: a TorchServe batch, or the requests joining one iteration."""
        self._record(BATCH_SIZE, size)

    def request_rejected(self, fields: list[str]) -> None:
        for field in sorted(set(fields)):
            self._record(INVALID_REQUESTS, 1, field)

    def queue(self, queue: QueueGauges) -> None:
        """The queue gauges, each recorded when it changes: every record is a log line that
        TorchServe's frontend parses, at a cost of its CPU (docs/benchmarks.md, "Serving overhead")."""
        last = self._queue
        self._queue = queue
        for spec, value, before in (
            (IN_FLIGHT, queue.requests, last and last.requests),
            (IN_FLIGHT_IMAGES, queue.images, last and last.images),
            (WAITING, queue.waiting, last and last.waiting),
        ):
            if last is None or value != before:
                self._record(spec, value, self.worker)

    def lora_requests(self, names: list[str]) -> None:
        """A request admitted with these LoRAs (names that resolved to files in the directory)."""
        for name in names:
            self._record(LORA_REQUESTS, 1, name)

    def loras_loaded(self, count: int) -> None:
        """The adapters in memory, recorded when the count changes (as the queue gauges)."""
        if count != self._loras_loaded:
            self._loras_loaded = count
            self._record(LORAS_LOADED, count, self.worker)

    def controlnet_requests(self, names: list[str]) -> None:
        """A request admitted with these ControlNets (names that resolved to directories)."""
        for name in names:
            self._record(CONTROLNET_REQUESTS, 1, name)

    def controlnets_loaded(self, count: int) -> None:
        """The ControlNets in memory, recorded when the count changes."""
        if count != self._controlnets_loaded:
            self._controlnets_loaded = count
            self._record(CONTROLNETS_LOADED, count, self.worker)

    def cancelled(self, reason: CancelReason) -> None:
        self._record(CANCELLED, 1, reason)

    def step(self, images: int, adapters: int, control_forwards: int, cached_images: int = 0) -> None:
        """One denoiser forward over ``images`` images with ``adapters`` distinct LoRA adapters,
        ``control_forwards`` ControlNet forwards beside it, and ``cached_images`` of the images that
        reused their step cache."""
        self._record(ITERATION_BATCH_SIZE, images)
        self._record(ITERATION_CACHED_IMAGES, cached_images)
        self._record(ITERATION_LORA_ADAPTERS, adapters)
        self._record(ITERATION_CONTROLNET_FORWARDS, control_forwards)

    def step_seconds(self, seconds: float) -> None:
        """The time of one denoising step (on CUDA, read after the fact from the device's events)."""
        self._record(DENOISE_STEP, seconds)

    def decoded(self, images: int, seconds: float) -> None:
        """Jobs of one shape that finished together, decoded (one pipeline run's end)."""
        self._record(PIPELINE_CALLS, 1)
        self._record(IMAGES, images)
        self._record(VAE_DECODE, seconds)

    def out_of_memory_retry(self, stage: str) -> None:
        self._record(OOM_RETRIES, 1, stage)

    def request_completed(self, latency_seconds: float, encode_seconds: float | None) -> None:
        """An admitted request's answer left the worker (``encode_seconds`` None: it failed)."""
        self._record(REQUEST_LATENCY, latency_seconds)
        self._record(REQUEST_LATENCY_SLA_RATIO, latency_seconds / self.latency_sla_seconds)
        if encode_seconds is not None:
            self._record(ENCODE, encode_seconds)
        if latency_seconds > self.latency_sla_seconds:
            self._record(DEADLINE_MISSES, 1)

    def worker_ready(self, seconds: float) -> None:
        """A worker starts: its gauges read an empty queue (also where a worker of the same id died
        with requests in flight), and the counters exist, so that their rate reads 0, not nothing.
        The SLA gauge is recorded here only: a gauge keeps its value."""
        self._record(WORKER_WARMUP, seconds)
        self._record(LATENCY_SLA, self.latency_sla_seconds)
        self._record(DEADLINE_MISSES, 0)
        self._queue = None
        self.queue(QueueGauges())
        for stage in OOM_STAGES:
            self._record(OOM_RETRIES, 0, stage)
        for reason in CANCEL_REASONS:
            self._record(CANCELLED, 0, reason)
