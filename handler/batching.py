"""Group the valid requests of one TorchServe batch into pipeline calls.

A pipeline call shares one size, step count, scheduler and guidance scale; prompts, negative
prompts, seeds and image counts may differ, because every image gets its own generator. Grouping
is a pure function so it can be tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from handler.request import GenerationRequest


@dataclass(frozen=True)
class CallKey:
    """What must be equal for requests to share one pipeline call."""

    width: int
    height: int
    num_inference_steps: int
    scheduler: str
    guidance_scale: float

    @classmethod
    def of(cls, request: GenerationRequest) -> CallKey:
        return cls(
            width=request.width,
            height=request.height,
            num_inference_steps=request.num_inference_steps,
            scheduler=request.scheduler,
            guidance_scale=request.guidance_scale,
        )


@dataclass(frozen=True)
class PipelineCall:
    """Requests (by their index in the TorchServe batch) generated together in one call."""

    key: CallKey
    members: tuple[int, ...]

    def halves(self) -> tuple[PipelineCall, PipelineCall]:
        """The call split in two (for a retry after running out of memory); needs two members."""
        middle = len(self.members) // 2
        return PipelineCall(self.key, self.members[:middle]), PipelineCall(self.key, self.members[middle:])

    def image_count(self, requests: dict[int, GenerationRequest]) -> int:
        return sum(requests[index].num_images_per_prompt for index in self.members)


def group_requests(requests: dict[int, GenerationRequest], max_images_per_call: int) -> list[PipelineCall]:
    """Group requests by ``CallKey`` in arrival order, splitting a group so that no call has
    more than ``max_images_per_call`` images. A request is never split across calls."""
    groups: dict[CallKey, list[list[int]]] = {}
    for index, request in requests.items():
        calls = groups.setdefault(CallKey.of(request), [[]])
        current = calls[-1]
        images = sum(requests[member].num_images_per_prompt for member in current)
        if current and images + request.num_images_per_prompt > max_images_per_call:
            current = []
            calls.append(current)
        current.append(index)
    return [PipelineCall(key, tuple(members)) for key, calls in groups.items() for members in calls]


@dataclass(frozen=True)
class CallInputs:
    """Per-image inputs of one pipeline call, in image order."""

    prompts: list[str]
    negative_prompts: list[str]
    seeds: list[int]
    owners: list[int]

    @classmethod
    def of(cls, call: PipelineCall, requests: dict[int, GenerationRequest]) -> CallInputs:
        prompts: list[str] = []
        negative_prompts: list[str] = []
        seeds: list[int] = []
        owners: list[int] = []
        for index in call.members:
            request = requests[index]
            for seed in request.image_seeds():
                prompts.append(request.prompt)
                negative_prompts.append(request.negative_prompt or "")
                seeds.append(seed)
                owners.append(index)
        return cls(prompts, negative_prompts, seeds, owners)

    def split_by_owner(self, images: Sequence) -> dict[int, list]:
        """Hand each request its own images, in order."""
        per_request: dict[int, list] = {}
        for owner, image in zip(self.owners, images, strict=True):
            per_request.setdefault(owner, []).append(image)
        return per_request
