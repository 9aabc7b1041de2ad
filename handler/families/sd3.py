"""SD 3.x: ``StableDiffusion3Pipeline`` (diffusers 0.42.1) and its img2img and inpaint pipelines:
SD 3 Medium (MMDiT), SD 3.5 Medium (MMDiT-X: RMS-norm on queries and keys, dual-attention layers),
SD 3.5 Large and Large Turbo.

What differs from the UNet families:

- text: three encoders, CLIP-L and CLIP-G (penultimate hidden states side by side, padded to T5's
  width, then T5's tokens after them; their pooled projections joined) and T5 (``max_sequence_length``
  tokens; zeros where the model is served without it, as ``text_encoder_3=None`` does in diffusers);
  an absent negative prompt is the encoding of "" (SD 3 has no ``force_zeros_for_empty_prompt``);
- the denoiser: ``SD3Transformer2DModel`` with ``pooled_projections``; its joint attention
  processors stay as the model has them;
- the schedule: flow matching (``FlowMatchEulerDiscreteScheduler``) with the model's ``shift``, and
  ``mu`` from the image's token count where the scheduler config asks for dynamic shifting (then
  the schedule depends on the latent shape);
- the noise arithmetic: no ``init_noise_sigma`` or ``scale_model_input``; an input image is noised
  with ``scale_noise``; ``scheduler.step`` gets no generator or eta (``__call__`` passes none);
- the VAE: 16 latent channels, ``(latents - shift_factor) * scaling_factor`` on the way in and the
  inverse on the way out; sizes on a 16-pixel grid (VAE 8 x patch 2);
- image-to-image rounds the skipped steps down (``int(steps - steps x strength)``), so any positive
  strength runs at least one step;
- no safety checker, no watermark;
- ControlNets (``StableDiffusion3ControlNetPipeline``, text to image alone): ``SD3ControlNetModel``
  directories; a control image is encoded by the VAE (its latent distribution sampled with a CPU
  generator seeded with the job's seed, one draw per row: the unguided and guided rows differ, as in
  diffusers' call after ``torch.manual_seed(seed)`` on the CPU), shifted unless the ControlNet zeroes
  its pooled projections (InstantX's); each ControlNet's block residuals are added after every
  transformer block but the last (``context_pre_only``), a ControlNet of fewer blocks than the
  transformer's spreading each over several and a job's several ControlNets summed pairwise as
  ``SD3MultiControlNetModel`` sums them (``control_slots``), by the engine's block wrappers
  (``handler.families.first_block_cache``).

Knowingly different from diffusers: the inpaint pipeline's decode leaves out the VAE's
``shift_factor`` (diffusers issue #13611) although its encode subtracts it; inpainted images here
are decoded as ``StableDiffusion3Pipeline`` and the img2img pipeline decode (with the shift).
ControlNets: diffusers samples the control latents from torch's global generator on the pipeline's
device (on a GPU, the GPU's: no seed given to the call reproduces it), here from the CPU generator
above; with several ControlNets its pipeline reads the first one's config for all (pooled
projections, VAE shift, whether it reads the prompt), here each reads its own.
Skip-layer guidance (``skip_guidance_layers``) runs in the step's one forward: the engine's rows,
the transformer's block wrappers (``handler.families.first_block_cache``). Left out, because no
request can ask for it: IP-Adapter images, 33-channel inpainting transformers, inpainting
ControlNets (``extra_conditioning_channels``), ControlNet files (diffusers converts none for SD 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3ControlNetModel, StableDiffusion3Pipeline
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.embeddings import PatchEmbed
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from diffusers.utils.torch_utils import randn_tensor
from PIL.Image import Image

from handler.config import SchedulerName
from handler.families.base import (
    Conditioning,
    Family,
    Pipeline,
    PromptSpec,
    Residuals,
    Scheduler,
    SchedulerChoice,
    TextEmbedding,
)

SCHEDULERS: dict[SchedulerName, SchedulerChoice] = {"flow_match_euler": (FlowMatchEulerDiscreteScheduler, {})}
LATENT_CHANNELS = 16
# What an SD 3.x ControlNet's config must share with the transformer's: the latents it patches and
# the conditioning it reads (its residuals' width and its position embedding are checked apart).
CONTROLNET_FIT = ("in_channels", "patch_size", "pooled_projection_dim")


class StableDiffusion3Family(Family):
    """SD 3.x."""

    pipeline_class: ClassVar[type] = StableDiffusion3Pipeline
    denoiser_name: ClassVar[str] = "transformer"
    schedulers: ClassVar[dict[SchedulerName, SchedulerChoice]] = SCHEDULERS
    strength_rounding: ClassVar[Literal["steps", "start"]] = "start"
    own_attention: ClassVar[type | None] = JointAttnProcessor2_0  # SDPA; no other processor fits
    clip_layer_from_last: ClassVar[int] = 2  # the CLIP encoders' penultimate hidden states
    takes_guidance_rescale: ClassVar[bool] = False  # StableDiffusion3Pipeline has none
    takes_controlnets: ClassVar[bool] = True
    controlnet_class: ClassVar[Any] = SD3ControlNetModel
    controls_in_blocks: ClassVar[bool] = True
    # StableDiffusion3ControlNetPipeline is text to image alone, without skip-layer guidance or a step cache.
    controlnet_excludes: ClassVar[tuple[str, ...]] = ("image", "skip_guidance_layers", "cache")

    @classmethod
    def refuse(cls, pipeline: Pipeline) -> str | None:
        channels = pipeline.transformer.config.in_channels
        if channels != LATENT_CHANNELS:
            return (
                f"{type(pipeline).__name__} with a {channels}-channel transformer is not supported by this handler's "
                f"step engine (it serves {LATENT_CHANNELS}-channel SD 3.x transformers)"
            )
        return None

    @property
    def name(self) -> str:
        return "SD 3.x"

    @property
    def patch_size(self) -> int:
        return self.pipeline.transformer.config.patch_size

    @property
    def max_side(self) -> int | None:
        """What the transformer's position embeddings cover (``pos_embed_max_size`` patches a side:
        3072 pixels for SD 3.5 Large); a larger side fails in its patch embedding."""
        patches = self.pipeline.transformer.config.pos_embed_max_size
        return None if patches is None else patches * self.patch_size * self.pipeline.vae_scale_factor

    @property
    def text_encoders(self) -> int:
        """``prompt_2`` for CLIP-G and ``prompt_3`` for T5, where the model is served with it."""
        return 2 if self.pipeline.text_encoder_3 is None else 3

    def _encode_texts(self, texts: list[tuple[str, ...]], clip_skip: int | None) -> list[TextEmbedding]:
        """The three encoders (``encode_prompt``): joined hidden states and pooled projections."""
        prompts, prompts_2, *prompts_3 = (list(column) for column in zip(*texts, strict=True))
        hidden_states, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=prompts_2,
            prompt_3=prompts_3[0] if prompts_3 else None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            clip_skip=clip_skip,
            max_sequence_length=self.max_sequence_length,
        )
        return [
            TextEmbedding(row, pooled_row)
            for row, pooled_row in zip(hidden_states.split(1), pooled.split(1), strict=True)
        ]

    def _condition(self, spec: PromptSpec, rows: TextEmbedding) -> Conditioning:
        assert rows.pooled is not None  # the CLIP encoders pool
        return Conditioning(rows.hidden_states, {"pooled_projections": rows.pooled})

    def _timestep_options(self, latent_shape: tuple[int, ...]) -> dict[str, float]:
        """``mu`` from the image's token count where the scheduler shifts dynamically (``__call__`` step 5)."""
        config = self.pipeline.scheduler.config
        if not config.get("use_dynamic_shifting", None):
            return {}
        _, height, width = latent_shape
        tokens = (height // self.patch_size) * (width // self.patch_size)
        mu = calculate_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )
        return {"mu": mu}

    def step_kwargs(self, scheduler: Scheduler, generators: list[torch.Generator], eta: float) -> dict[str, Any]:
        """None: SD 3's pipelines pass its flow-matching steps neither eta nor generators."""
        return {}

    def initial_latents(self, scheduler: Scheduler, noise: torch.Tensor) -> torch.Tensor:
        return noise

    def model_input(self, scheduler: Scheduler, rows: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return rows

    def add_noise(
        self, scheduler: Scheduler, original: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        return scheduler.scale_noise(original, timesteps, noise)  # type: ignore[attr-defined]  # flow matching's

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Conditioning,
        residuals: Residuals | None = None,
    ) -> torch.Tensor:
        if residuals is not None:  # the engine's block wrappers add them (controls_in_blocks)
            raise ValueError(f"{self.name}'s ControlNet residuals are added between its blocks, not in its forward")
        return self.pipeline.transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=conditioning.hidden_states,
            pooled_projections=conditioning.added["pooled_projections"],
            return_dict=False,
        )[0]

    # ControlNets: StableDiffusion3ControlNetPipeline's.

    def controlnet_refusal(self, config: Any) -> str | None:
        """A ControlNet fits where it patches the transformer's latents, its residuals have the
        transformer's width and it reads the transformer's conditioning (and position embedding,
        where it has its own); inpainting ControlNets (extra conditioning channels) are not served."""
        transformer = self.pipeline.transformer.config
        compared = list(CONTROLNET_FIT)
        compared += ["joint_attention_dim"] if config.joint_attention_dim is not None else []  # None: reads no prompt
        compared += ["pos_embed_max_size"] if config.use_pos_embed else []  # else the transformer's own
        pairs = {key: (getattr(config, key, None), getattr(transformer, key)) for key in compared}
        pairs["width"] = (_width(config), _width(transformer))
        differing = [f"{key} {theirs} (transformer: {ours})" for key, (theirs, ours) in pairs.items() if theirs != ours]
        if differing:
            return f"it does not fit this {self.name} model's transformer: {', '.join(differing)}"
        if config.extra_conditioning_channels:
            return "inpainting ControlNets (extra_conditioning_channels) are not served"
        if not config.num_layers:
            return "it has no blocks (num_layers 0)"
        if len(self.pipeline.transformer.transformer_blocks) < 2:  # first_block_cache's wrappers add residuals
            return "a transformer of one block takes no ControlNets here"
        return None

    def prepare_controlnet(self, net: Any) -> Any:
        """A ControlNet without a position embedding of its own (SD 3.5 Large's) takes a copy of
        the transformer's, as the ControlNet pipeline gives it (``_get_pos_embed_from_transformer``:
        here the base weights of a layer a LoRA wraps)."""
        if not net.config.use_pos_embed:
            config, transformer = self.pipeline.transformer.config, self.pipeline.transformer
            embedding = PatchEmbed(
                height=config.sample_size,
                width=config.sample_size,
                patch_size=config.patch_size,
                in_channels=config.in_channels,
                embed_dim=transformer.inner_dim,
                pos_embed_max_size=config.pos_embed_max_size,
            )
            state = transformer.pos_embed.state_dict()
            base = {key.replace("base_layer.", ""): value for key, value in state.items() if "lora_" not in key}
            embedding.load_state_dict(base)
            net.pos_embed = embedding.to(net.dtype).to(net.device)
        return net

    def control_forward(
        self, net: Any, latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Conditioning, images: torch.Tensor
    ) -> Residuals:
        """One ControlNet call as the pipeline's step makes it: the prompt's hidden states where it
        has a context embedder, pooled projections zeroed where its config says (InstantX's)."""
        config, pooled = net.config, conditioning.added["pooled_projections"]
        (samples,) = net(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=conditioning.hidden_states if config.joint_attention_dim is not None else None,
            pooled_projections=torch.zeros_like(pooled) if config.force_zeros_for_pooled_projection else pooled,
            controlnet_cond=images,
            conditioning_scale=1.0,
            return_dict=False,
        )
        return list(samples)

    def control_residuals(self, net: Any) -> int:
        return len(net.controlnet_blocks)

    def control_slots(self, residuals: Sequence[int]) -> tuple[int, ...]:
        """Block ``i`` adds residual ``int(i / (blocks / n))``, as ``SD3Transformer2DModel.forward``,
        where ``n`` is the fewest residuals of the job's ControlNets: ``SD3MultiControlNetModel`` sums
        theirs pairwise (``zip``), so the deeper ones' last residuals go unused."""
        blocks = len(self.pipeline.transformer.transformer_blocks)
        interval = blocks / min(residuals)
        return tuple(int(index / interval) for index in range(blocks))

    def control_input(
        self, net: Any, image: Image, width: int, height: int, rows: int, generator: torch.Generator
    ) -> torch.Tensor:
        """The pipeline's step 3: the control image in [-1, 1] through the VAE encoder, its latent
        distribution sampled once per row (``rows``, drawn from ``generator``), shifted unless the
        ControlNet zeroes its pooled projections, scaled."""
        vae = self.pipeline.vae
        distribution = vae.encode(self.preprocess(image.convert("RGB"), width, height, self.dtype)).latent_dist
        mean = distribution.mean
        noise = randn_tensor((rows, *mean.shape[1:]), generator=generator, device=mean.device, dtype=mean.dtype)
        shift = 0 if net.config.force_zeros_for_pooled_projection else vae.config.shift_factor
        return (mean + distribution.std * noise - shift) * vae.config.scaling_factor

    def control_placeholder(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return torch.zeros_like(latents)

    def encode_image(self, pixels: torch.Tensor, generators: list[torch.Generator], inpaint: bool) -> torch.Tensor:
        config = self.pipeline.vae.config
        return (self._vae_encode(pixels, generators) - config.shift_factor) * config.scaling_factor

    def vae_decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        config = self.pipeline.vae.config
        return self._decode(latents / config.scaling_factor + config.shift_factor, tiled)


def _width(config: Any) -> int:
    """A transformer's (or ControlNet's) hidden width: its heads times their width."""
    return int(config.num_attention_heads * config.attention_head_dim)
