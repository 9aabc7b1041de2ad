"""What a deployment allows and assumes: the validation context of the request models, and the
errors that name the operator's setting a value breaks."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationInfo
from pydantic_core import PydanticCustomError

from handler.config import CacheSettings, FamilyRules, RequestDefaults, RequestLimits, StepCache


@dataclass(frozen=True)
class RequestPolicy:
    """What a deployment allows and assumes: the validation context of ``GenerationRequest``."""

    limits: RequestLimits = RequestLimits()
    defaults: RequestDefaults = RequestDefaults(width=512, height=512)
    streaming: bool = False  # continuous batching: answers leave in parts and can stream progress
    over_grpc: bool = False  # the request came over gRPC, whose answers TorchServe 0.12 ends with their first part
    model_name: str = "stable-diffusion"  # the name TorchServe serves this model under
    rules: FamilyRules = FamilyRules()  # what the served model's family allows
    cache: CacheSettings = CacheSettings()  # the step cache's default and limits

    @property
    def default_cache(self) -> StepCache:
        """The cache of a request without one: the configured default, off where the model serves none."""
        default = self.cache.default
        return default if self.rules.serves(default) else StepCache()

    @property
    def max_side(self) -> int:
        """The largest width or height: the configured one, or less where the model takes less."""
        return min(self.limits.max_side, self.rules.max_side or self.limits.max_side)

    @property
    def max_steps(self) -> int:
        """The most steps a request may run: the configured ones, or fewer where the model takes fewer."""
        return min(self.limits.max_inference_steps, self.rules.max_steps or self.limits.max_inference_steps)


def policy_of(info: ValidationInfo) -> RequestPolicy:
    """The policy a model is validated with (the defaults where none was given)."""
    return info.context if isinstance(info.context, RequestPolicy) else RequestPolicy()


def above_limit(value: float, limit: float, setting: str) -> PydanticCustomError:
    """The error of a value above the configured ``setting``."""
    return PydanticCustomError(
        "less_than_equal",
        "Input should be less than or equal to {limit} (the configured {setting}), got {value}",
        {"limit": limit, "setting": setting, "value": value},
    )


def above_model_limit(value: float, limit: float, what: str) -> PydanticCustomError:
    """The error of a value above what the served model takes (``what``: the limit, in words)."""
    return PydanticCustomError(
        "less_than_equal",
        "Input should be less than or equal to {limit} ({what}), got {value}",
        {"limit": limit, "what": what, "value": value},
    )


def at_most(items: list, limit: int, what: str, setting: str) -> None:
    """Raises where a request lists more ``what`` than the configured ``setting`` allows."""
    if len(items) > limit:
        raise PydanticCustomError(
            "too_long",
            "at most {limit} {what} per request (the configured {setting}), got {count}",
            {"limit": limit, "what": what, "setting": setting, "count": len(items)},
        )
