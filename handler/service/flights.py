"""The requests in flight: each one's API, validated request and job, with its clock readings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from handler.adapters.controlnets import ControlSpec
from handler.adapters.embeddings import rewrite
from handler.adapters.lora_rows import Adapters
from handler.api.protocol import Api
from handler.api.request import GenerationRequest
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.metrics import QueueGauges


def job_spec(
    request: GenerationRequest,
    adapters: Adapters = (),
    nets: tuple[str, ...] = (),
    embeddings: Mapping[str, str] | None = None,
) -> JobSpec:
    """What the engine generates for a validated request (image k from seed + k), with its LoRA
    adapters, ControlNets (``nets``: ids, one per ``request.controlnets``) and the tokens of the
    embeddings its prompts name (``embeddings``: name -> token) as the engine's libraries resolved them."""
    tokens = embeddings or {}

    def text(field: str) -> str | None:
        given = getattr(request, field)
        return None if given is None else rewrite(given, tokens)

    return JobSpec(
        rewrite(request.prompt, tokens),
        text("negative_prompt"),
        tuple(request.image_seeds()),
        request.width,
        request.height,
        request.num_inference_steps,
        request.scheduler,
        request.guidance_scale,
        request.image,
        request.mask,
        1.0 if request.strength is None else request.strength,
        adapters,
        tuple(
            ControlSpec(net, choice.image, choice.scale, choice.start, choice.end)
            for net, choice in zip(nets, request.controlnets, strict=True)
        ),
        None if request.cache.mode == "off" else request.cache,
        request.clip_skip,
        request.guidance_rescale,
        text("prompt_2"),
        text("negative_prompt_2"),
        text("prompt_3"),
        text("negative_prompt_3"),
        request.skip_layer_guidance(),
        request.size_conditioning(),
        None if request.timesteps is None else tuple(request.timesteps),
        None if request.sigmas is None else tuple(request.sigmas),
        request.eta,
    )


@dataclass
class Flight:
    """One admitted request on its way through the denoising loop, and the API it answers in."""

    api: Api
    request: GenerationRequest
    job: DenoiseJob
    arrived: float
    admitted: float
    deadline: float  # the latency SLA: what slack is measured against
    expires: float  # the time limit: past it the request is cancelled
    admitted_with: int  # requests admitted together, itself included
    over_grpc: bool = False
    denoised: float = 0.0
    max_step_images: int = 0
    parts_sent: int = 0


class Flights(dict[str, Flight]):
    """The requests in flight by TorchServe's request id, and how many the last forward left out."""

    waiting: int = 0

    def gauges(self, requests: int | None = None) -> QueueGauges:
        """The worker's queue: requests (``requests`` where more are counted) and images in flight,
        and those the last forward left out."""
        images = sum(flight.job.images for flight in self.values())
        return QueueGauges(len(self) if requests is None else requests, images, self.waiting)

    def specs_in_use(self, starting: Iterable[JobSpec]) -> list[JobSpec]:
        """The jobs whose LoRAs and ControlNets must stay loaded: those starting and those in flight."""
        return [*starting, *(flight.job.spec for flight in self.values())]
