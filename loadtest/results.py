"""What one sweep point measured: the client's figures (locust) and the server's (metric deltas)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from loadtest.config import SweepPoint
from loadtest.run import LoadResult


@dataclass(frozen=True)
class ServerFigures:
    """What the server measured during one point (from the metrics endpoint, as deltas). The step
    and decode seconds are sums of ``sd_denoise_step_seconds`` and ``sd_vae_decode_seconds``. On a
    GPU a step's is the device's timeline from before its forward to after it (waits for a
    host-bound step included), so a point's time beyond its steps is time no forward ran. A
    decode's includes the host's safety check and conversion to images, which on a GPU run beside
    the next forwards: steps and decodes may overlap."""

    mean_queue_s: float
    mean_handler_s: float
    mean_batch_size: float
    mean_step_images: float
    images: float
    step_seconds: float
    decode_seconds: float


@dataclass(frozen=True)
class PointResult:
    point: SweepPoint
    client: LoadResult
    server: ServerFigures
    meets_sla: bool
    violations: list[str]
    request_log: str

    def as_row(self) -> dict:
        return {
            **self.point.model_dump(),
            **self.client.as_dict(),
            **asdict(self.server),
            "meets_sla": self.meets_sla,
            "violations": "; ".join(self.violations),
        }


def _delta(before: dict, after: dict, name: str) -> float:
    def total(samples: dict) -> float:
        return sum(value for (sample, _), value in samples.items() if sample == name)

    return total(after) - total(before)


def server_figures(before: dict, after: dict) -> ServerFigures:
    """Means over one point. The queue time is TorchServe's end-to-end latency less the handler's
    (arrival to admission), summed over the point's requests, per request; it holds in both batching
    modes, where TorchServe's own queue latency restarts at every continuous-batching iteration.
    (prometheus-client's parser names counter samples ``*_total``.)"""
    requests_served = _delta(before, after, "ts_inference_requests_total") or 1.0
    handled = _delta(before, after, "sd_request_latency_seconds_count") or 1.0
    batches = _delta(before, after, "sd_batch_size_count") or 1.0
    forwards = _delta(before, after, "sd_iteration_batch_size_count") or 1.0
    served_s = _delta(before, after, "ts_inference_latency_microseconds_total") / 1e6
    handler_s = _delta(before, after, "sd_request_latency_seconds_sum")
    return ServerFigures(
        mean_queue_s=max(0.0, (served_s - handler_s) / requests_served),
        mean_handler_s=handler_s / handled,
        mean_batch_size=_delta(before, after, "sd_batch_size_sum") / batches,
        mean_step_images=_delta(before, after, "sd_iteration_batch_size_sum") / forwards,
        images=_delta(before, after, "sd_images_total"),
        step_seconds=_delta(before, after, "sd_denoise_step_seconds_sum"),
        decode_seconds=_delta(before, after, "sd_vae_decode_seconds_sum"),
    )
