"""benchmark_config.yaml as typed settings, shared by the locustfile, `make loadtest` and `make sweep`."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.paths import BENCHMARK_CONFIG, ROOT

# Request fields a mix entry's ``fields`` may not set: the load test sets them (the entry's own, a
# prompt from the file, a random seed, and the answer's form it checks: a PNG, JSON for several images).
OWN_FIELDS = frozenset(
    {
        "prompt",
        "seed",
        "width",
        "height",
        "num_inference_steps",
        "num_images_per_prompt",
        "response_format",
        "output_format",
        "output_compression",
        "stream",
        "partial_images",
    }
)
# The longest fields a kind's name shows as JSON.
MAX_NAMED_FIELDS = 100


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    name: str = "stable-diffusion"
    model_dir: Path = Path("models/shapes-sd")


class SLA(_Section):
    p95_seconds: float = Field(gt=0, description="client-side p95 latency")
    max_error_ratio: float = Field(ge=0, le=1, description="failed requests / all requests")


class MixEntry(_Section):
    """One kind of request and how often users send it."""

    weight: float = Field(gt=0)
    width: int = Field(ge=8, multiple_of=8)
    height: int = Field(ge=8, multiple_of=8)
    num_inference_steps: int = Field(ge=1)
    num_images_per_prompt: int = Field(1, ge=1)
    fields: dict[str, Any] = Field(
        {},
        description="more request fields, as the inference API takes them (scheduler, guidance_scale, loras, "
        "clip_skip, cache, negative_prompt, ...): the server checks their names and values",
    )

    @field_validator("fields")
    @classmethod
    def _request_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        own = sorted(set(fields) & OWN_FIELDS)
        if own:
            raise ValueError(f"{', '.join(own)}: set by the load test, not by an entry's fields")
        try:
            json.dumps(fields, allow_nan=False)
        except (TypeError, ValueError) as error:  # YAML's dates, .nan
            raise ValueError(f"fields must be JSON values, as a request carries them: {error}") from None
        return fields

    @property
    def name(self) -> str:
        """The locust request name, one statistics row per kind: its fields as JSON, or where that
        is long (an image in base64) their names and a digest of it."""
        name = f"{self.width}x{self.height} {self.num_inference_steps} steps x{self.num_images_per_prompt}"
        if not self.fields:
            return name
        fields = json.dumps(self.fields, sort_keys=True)
        if len(fields) > MAX_NAMED_FIELDS:
            fields = f"{', '.join(sorted(self.fields))} #{hashlib.sha1(fields.encode()).hexdigest()[:8]}"
        return f"{name} {fields}"

    def body(self, prompt: str, seed: int | None = None) -> dict[str, Any]:
        """A request of this kind (``seed`` None: the server draws one)."""
        body = {
            **self.fields,
            "prompt": prompt,
            "width": self.width,
            "height": self.height,
            "num_inference_steps": self.num_inference_steps,
            "num_images_per_prompt": self.num_images_per_prompt,
            "response_format": "image",
            "output_format": "png",
        }
        return body if seed is None else {**body, "seed": seed}


class LoadtestSection(_Section):
    users: int = Field(ge=1)
    spawn_rate: float = Field(gt=0)
    requests: int = Field(ge=1)
    duration_s: float = Field(gt=0)


class SweepPoint(_Section):
    continuous_batching: bool
    batch_size: int
    max_batch_delay: int
    workers: int
    concurrency: int

    @property
    def mode(self) -> str:
        return "continuous" if self.continuous_batching else "dynamic"

    @property
    def label(self) -> str:
        return (
            f"{self.mode}, batch {self.batch_size}, delay {self.max_batch_delay} ms, {self.workers} workers, "
            f"{self.concurrency} users"
        )


class SweepSection(_Section):
    continuous_batching: list[bool] = Field(
        [False], min_length=1, description="TorchServe batching modes: false dynamic batching, true continuous batching"
    )
    batch_size: list[int] = Field(min_length=1, description="continuous batching: most requests in flight")
    max_batch_delay: list[int] = Field(min_length=1, description="milliseconds")
    workers: list[int] = Field(min_length=1)
    concurrency: list[int] = Field(min_length=1)
    requests_per_point: int = Field(ge=1)
    duration_s_per_point: float = Field(gt=0)

    def points(self) -> list[SweepPoint]:
        """Every combination TorchServe can serve, grouped so each registration (batch size, delay,
        mode) is made once; the modes alternate, so a drift of the machine's speed during the sweep
        does not favour one. Continuous batching is left out above one worker: TorchServe 0.12 serves
        it with one worker per model, and a second worker refuses to load."""
        return [
            SweepPoint(
                continuous_batching=mode, batch_size=batch, max_batch_delay=delay, workers=workers, concurrency=users
            )
            for batch, delay, mode, workers, users in itertools.product(
                self.batch_size, self.max_batch_delay, self.continuous_batching, self.workers, self.concurrency
            )
            if not (mode and workers > 1)
        ]


class BenchmarkConfig(_Section):
    model: ModelSection = ModelSection()
    sla: SLA
    request_mix: list[MixEntry] = Field(min_length=1)
    prompts_file: Path
    warmup_requests: int = Field(0, ge=0)
    loadtest: LoadtestSection
    sweep: SweepSection

    @classmethod
    def load(cls, path: Path = BENCHMARK_CONFIG) -> BenchmarkConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def prompts(self) -> list[str]:
        path = self.prompts_file if self.prompts_file.is_absolute() else ROOT / self.prompts_file
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"{path} has no prompts")
        return prompts
