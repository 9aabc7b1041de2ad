"""diffusers' own pipeline call for a request: the reference every served image is checked against
(the tests) and the step engine is timed against (``make bench-engine``).

The pipeline is loaded by diffusers alone (``AutoPipelineForText2Image``, no handler code; a
request with an input image calls ``AutoPipelineForImage2Image`` or, with a mask,
``AutoPipelineForInpainting``, each ``from_pipe`` of it), and each call gets what a user of
diffusers would pass for the request: one CPU generator per image seeded ``seed + k``, the
request's scheduler built from the model's own scheduler configuration as the handler names it
(``handler.families.SCHEDULERS``; the model's own where the request names none), and the
pipeline's defaults for everything a request cannot set.

Two diffusers 0.42.1 SD 3 pipelines cannot be called as the others are: the img2img pipeline fails
with several images and a generator per image (it encodes ``image[i:i+1]`` of a one-image batch), so
each image is its own call (image k from seed + k, what the engine's image k equals); the inpaint
pipeline's decode leaves out the VAE's ``shift_factor`` (diffusers issue #13611), so its latents are
decoded as ``StableDiffusion3Pipeline`` decodes them, which is what the engine serves
(``handler.families.sd3``). ``StableDiffusion3ControlNetPipeline`` samples its control images'
latents from torch's global generator: a call with SD 3 ControlNets seeds it with the call's first
seed (``torch.manual_seed``, its state restored after), which is what the engine's generator for them is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoPipelineForImage2Image,
    AutoPipelineForInpainting,
    AutoPipelineForText2Image,
    ControlNetModel,
    DiffusionPipeline,
    SD3ControlNetModel,
    StableDiffusion3ControlNetPipeline,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusion3Pipeline,
)
from PIL.Image import Image
from safetensors.torch import load_file

from handler.config import MAX_SEED, SizeConditioning, SkipLayerGuidance, StepCache
from handler.families import SCHEDULERS
from handler.families.sd import flat_text_model


@dataclass(frozen=True)
class ControlNetCall:
    """One ControlNet of a call: its directory, control image, scale and window."""

    path: Path
    image: Image
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0


@dataclass(frozen=True)
class ReferenceOutput:
    images: list[Image]
    nsfw_content_detected: list[bool] | None


class Reference:
    """One model loaded by diffusers, called as a user would call it."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        text_encoder_3: bool = True,
        pipeline: DiffusionPipeline | None = None,
    ):
        """``text_encoder_3``: False loads an SD 3.x model without its T5 encoder
        (``text_encoder_3=None``); ``pipeline``: one already loaded from ``model_dir``, for a model
        too large to hold twice."""
        self.model_dir = Path(model_dir)
        without_t5 = {} if text_encoder_3 else {"text_encoder_3": None, "tokenizer_3": None}
        self.pipeline: DiffusionPipeline = pipeline or AutoPipelineForText2Image.from_pretrained(
            str(model_dir), dtype=dtype, use_safetensors=True, **without_t5
        ).to(device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.scheduler_config = self.pipeline.scheduler.config
        self.own_scheduler = type(self.pipeline.scheduler)

    def __call__(
        self,
        prompt: str,
        seed: int,
        width: int,
        height: int,
        num_inference_steps: int,
        *,
        negative_prompt: str | None = None,
        clip_skip: int | None = None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        guidance_scale: float = 7.5,
        guidance_rescale: float = 0.0,
        image: Image | None = None,
        mask: Image | None = None,
        strength: float = 1.0,
        loras: Sequence[tuple[Path, float]] = (),
        controlnets: Sequence[ControlNetCall] = (),
        deep_cache: tuple[int, int] | None = None,
        first_block: float | None = None,
        embeddings: Sequence[Path] = (),
        lycoris: Sequence[tuple[Path, float]] = (),
        other_prompts: Mapping[str, str | None] | None = None,
        skip_layer_guidance: SkipLayerGuidance | None = None,
        size_conditioning: SizeConditioning | None = None,
        timesteps: Sequence[int] | None = None,
        sigmas: Sequence[float] | None = None,
        eta: float = 0.0,
    ) -> ReferenceOutput:
        """One request: ``num_images_per_prompt`` images of one prompt, image k from ``seed + k``
        (wrapping past the largest seed, as requests do); from ``image`` (of the request's size)
        with ``strength``, repainting where ``mask`` is white; with LoRA files and scales loaded
        (``load_lora_weights``, ``set_adapters``) for this call only; with ControlNets (the
        ControlNet pipelines, several as ``MultiControlNetModel``); with ``deep_cache`` (interval,
        branch), the ``DeepCache`` package's ``DeepCacheSDHelper`` on the pipeline called (uniform
        mode); with ``first_block`` (a threshold), diffusers' First Block Cache on SD 3's transformer
        (``first_block_cache``); with textual-inversion ``embeddings`` loaded for this call only
        (``load_textual_inversion``, each under its file stem; SDXL's ``clip_l`` and ``clip_g``
        into its two text encoders, as diffusers' documentation does); with LyCORIS files and weights
        merged into the weights for this call only (``merged_lycoris``); ``clip_skip`` and
        ``guidance_rescale`` and ``other_prompts`` (``prompt_2``, ``negative_prompt_2``, ...)
        and ``skip_layer_guidance`` (as ``skip_guidance_layers`` and its settings) and SDXL's
        ``size_conditioning`` (``original_size``, ...) and a custom schedule (``timesteps`` or
        ``sigmas``) and DDIM's ``eta`` passed on where given, to a pipeline that
        takes them (SD 1.x/2.x's text encoder read as diffusers PR #14043 reads it:
        ``handler.families.sd.flat_text_model``;
        diffusers' SD 1.x/2.x img2img and inpaint pipelines and the ControlNet pipelines take no
        ``guidance_rescale``); ``scheduler`` None: the model's own."""
        seeds = [(seed + index) % (MAX_SEED + 1) for index in range(num_images_per_prompt)]
        inputs: dict = {"width": width, "height": height}
        pipeline = self.pipeline
        extra = self._controlnet_inputs(controlnets, text_to_image=image is None)
        nets = extra.pop("pipe")
        if image is not None and mask is None:  # its size is the image's
            pipeline, inputs = AutoPipelineForImage2Image.from_pipe(self.pipeline, **nets), {"image": image}
        elif image is not None:
            pipeline = AutoPipelineForInpainting.from_pipe(self.pipeline, **nets)
            inputs.update(image=image, mask_image=mask)
        elif controlnets:
            pipeline = AutoPipelineForText2Image.from_pipe(self.pipeline, **nets)
        inputs.update(extra)
        if clip_skip is not None:
            inputs["clip_skip"] = clip_skip
        if guidance_rescale:
            inputs["guidance_rescale"] = guidance_rescale
        inputs.update({name: text for name, text in (other_prompts or {}).items() if text is not None})
        inputs.update({name: list(given) for name, given in (("timesteps", timesteps), ("sigmas", sigmas)) if given})
        if eta:
            inputs["eta"] = eta
        if size_conditioning is not None:
            inputs.update({name: value for name, value in vars(size_conditioning).items() if value is not None})
        if skip_layer_guidance is not None:
            if image is not None:
                raise ValueError("diffusers' SD 3 img2img and inpaint pipelines take no skip-layer guidance")
            inputs.update(
                skip_guidance_layers=list(skip_layer_guidance.layers),
                skip_layer_guidance_scale=skip_layer_guidance.scale,
                skip_layer_guidance_start=skip_layer_guidance.start,
                skip_layer_guidance_stop=skip_layer_guidance.stop,
            )
        if image is not None:
            inputs["strength"] = strength
        names = [f"reference{index}" for index in range(len(loras))]
        for name, (path, _) in zip(names, loras, strict=True):
            self.pipeline.load_lora_weights(str(path), adapter_name=name)
        if loras:
            self.pipeline.set_adapters(names, [scale for _, scale in loras])
        for path in embeddings:
            self._load_embedding(path)
        helper = None
        if deep_cache is not None:
            from DeepCache import DeepCacheSDHelper  # the reference of tests and make bench-cache only

            helper = DeepCacheSDHelper(pipe=pipeline)
            helper.set_params(cache_interval=deep_cache[0], cache_branch_id=deep_cache[1])
            helper.enable()
        try:
            with self.merged_lycoris(lycoris):
                one_by_one = len(seeds) > 1 and (
                    isinstance(pipeline, StableDiffusion3Img2ImgPipeline)
                    or _mispaired_time_ids(image, guidance_scale, size_conditioning)
                )
                calls = [(1, [one]) for one in seeds] if one_by_one else [(num_images_per_prompt, seeds)]
                outputs = [
                    self._call(
                        prompt,
                        negative_prompt,
                        count,
                        call_seeds,
                        num_inference_steps,
                        scheduler,
                        guidance_scale,
                        inputs,
                        pipeline,
                        first_block,
                    )
                    for count, call_seeds in calls
                ]
                if len(outputs) == 1:
                    return outputs[0]
                return ReferenceOutput([image for output in outputs for image in output.images], None)
        finally:
            if helper is not None:
                helper.disable()
            if loras:
                self.pipeline.delete_adapters(names)
            for path in embeddings:
                self._unload_embedding(path.stem)

    @contextlib.contextmanager
    def merged_lycoris(self, files: Sequence[tuple[Path, float]]) -> Iterator[None]:
        """During the block, each LyCORIS file's deltas times its weight are merged into the weights
        of the UNet and text encoders, each delta computed by the ``lycoris-lora`` package
        (``lycoris.functional.{loha,lokr}.diff_weight``: LoHa's gamma its alpha over its dim, LoKr's
        its alpha, which the package divides by the rank); for the tests' files (LoHa and LoKr
        modules only, with alphas). The weights are back after it."""
        if not files:
            yield
            return
        from model_making.make_lora import kohya_modules

        layers = {
            f"{prefix}{infix}{name}".replace(".", "_"): layer
            for prefix, infix, component in kohya_modules(self.pipeline)
            for name, layer in component.named_modules()
        }
        saved: dict[torch.nn.Module, torch.Tensor] = {}
        try:
            for path, weight in files:
                state = load_file(path)
                for name in sorted({key.split(".")[0] for key in state}):
                    layer = layers[name]
                    delta = _lycoris_delta(
                        {key.split(".", 1)[1]: value for key, value in state.items() if key.startswith(f"{name}.")}
                    )
                    saved.setdefault(layer, layer.weight.detach().clone())
                    with torch.no_grad():
                        layer.weight.add_(weight * delta.reshape(layer.weight.shape).to(layer.weight.dtype))
            yield
        finally:
            with torch.no_grad():
                for layer, original in saved.items():
                    layer.weight.copy_(original)

    def _text_encoders(self) -> list[tuple[str, Any, Any]]:
        """(SDXL file key, tokenizer, text encoder) of each text encoder an embedding goes into."""
        if getattr(self.pipeline, "text_encoder_2", None) is None:
            return [("", self.pipeline.tokenizer, self.pipeline.text_encoder)]
        return [
            ("clip_l", self.pipeline.tokenizer, self.pipeline.text_encoder),
            ("clip_g", self.pipeline.tokenizer_2, self.pipeline.text_encoder_2),
        ]

    def _load_embedding(self, path: Path) -> None:
        for key, tokenizer, encoder in self._text_encoders():
            source = load_file(path)[key] if key else str(path)
            self.pipeline.load_textual_inversion(source, token=path.stem, tokenizer=tokenizer, text_encoder=encoder)

    def _unload_embedding(self, token: str) -> None:
        for _, tokenizer, encoder in self._text_encoders():
            added = [name for name in tokenizer.get_added_vocab() if name == token or name.startswith(f"{token}_")]
            self.pipeline.unload_textual_inversion(added, tokenizer=tokenizer, text_encoder=encoder)

    def _controlnet_inputs(self, controlnets: Sequence[ControlNetCall], text_to_image: bool) -> dict[str, Any]:
        """What the ControlNet pipelines take for ``controlnets``: the nets (under "pipe", for
        ``from_pipe``), the control images, scales and windows (one ControlNet: not as lists)."""
        if not controlnets:
            return {"pipe": {}}
        sd3 = isinstance(self.pipeline, StableDiffusion3Pipeline)
        net_class = SD3ControlNetModel if sd3 else ControlNetModel
        nets = [
            net_class.from_pretrained(str(call.path), torch_dtype=self.pipeline.dtype, use_safetensors=True).to(
                self.pipeline.device
            )
            for call in controlnets
        ]
        one = len(controlnets) == 1

        def each(values: list) -> Any:
            return values[0] if one else values

        return {
            "pipe": {"controlnet": each(nets)},
            "image" if text_to_image and not sd3 else "control_image": each([call.image for call in controlnets]),
            "controlnet_conditioning_scale": each([float(call.scale) for call in controlnets]),
            "control_guidance_start": each([float(call.start) for call in controlnets]),
            "control_guidance_end": each([float(call.end) for call in controlnets]),
        }

    def batch(
        self,
        prompts: list[str],
        seeds: list[int],
        width: int,
        height: int,
        num_inference_steps: int,
        scheduler: str | None = None,
        guidance_scale: float = 7.5,
    ) -> ReferenceOutput:
        """Several one-image requests (prompt k from seed k) in one call, as a user batches them."""
        inputs = {"width": width, "height": height}
        return self._call(prompts, None, 1, seeds, num_inference_steps, scheduler, guidance_scale, inputs)

    def _call(
        self,
        prompt: str | list[str],
        negative_prompt: str | None,
        images_per_prompt: int,
        seeds: list[int],
        num_inference_steps: int,
        scheduler: str | None,
        guidance_scale: float,
        inputs: dict,
        pipeline: Any = None,  # diffusers pipelines declare neither their components nor __call__ to a type checker
        first_block: float | None = None,
    ) -> ReferenceOutput:
        pipeline = pipeline or self.pipeline
        scheduler_class, overrides = SCHEDULERS[scheduler] if scheduler else (self.own_scheduler, {})
        pipeline.scheduler = scheduler_class.from_config(self.scheduler_config, **overrides)
        pipeline.set_progress_bar_config(disable=True)
        sd3_inpaint = isinstance(pipeline, StableDiffusion3InpaintPipeline)
        caching = (
            contextlib.nullcontext() if first_block is None else first_block_cache(pipeline.transformer, first_block)
        )
        with caching, flat_text_model(pipeline.text_encoder, inputs.get("clip_skip")), torch.random.fork_rng([]):
            if isinstance(pipeline, StableDiffusion3ControlNetPipeline):  # its control latents' generator
                torch.manual_seed(seeds[0])
            output = pipeline(
                prompt=prompt,
                negative_prompt=negative_prompt,
                num_images_per_prompt=images_per_prompt,
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds],
                output_type="latent" if sd3_inpaint else "pil",
                **inputs,
            )
        if sd3_inpaint:
            return ReferenceOutput(_sd3_decode(pipeline, output.images), None)
        return ReferenceOutput(output.images, getattr(output, "nsfw_content_detected", None))


def cache_options(cache: StepCache | None) -> dict[str, Any]:
    """A request's step cache as ``Reference.__call__``'s options: ``deep_cache`` or ``first_block``."""
    if cache is None or cache.mode == "off":
        return {}
    if cache.mode == "deep":
        return {"deep_cache": (cache.interval, cache.branch)}
    return {"first_block": cache.threshold}


@contextlib.contextmanager
def first_block_cache(transformer: Any, threshold: float) -> Iterator[None]:
    """diffusers' First Block Cache (``apply_first_block_cache``) on an SD 3 transformer for one
    pipeline call, in the one cache context ``StableDiffusion3Pipeline`` (no ``CacheMixin``) does not
    set. Its tail hook subtracts the last block's encoder hidden states, which SD 3's last block
    (``context_pre_only``) returns as None: that block returns its encoder input instead, which the
    model discards after it."""
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    last = transformer.transformer_blocks[-1]
    own = last.forward

    def forward(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        encoder, hidden = own(**kwargs)
        return (kwargs["encoder_hidden_states"] if encoder is None else encoder), hidden

    last.forward = forward
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(transformer, CacheContext("cond_uncond"))
    try:
        yield
    finally:
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.remove_hook("fbc_leader_block_hook", recurse=True)
        registry.remove_hook("fbc_block_hook", recurse=True)
        del last.forward


def _sd3_decode(pipeline: Any, latents: torch.Tensor) -> list[Image]:
    """SD 3 latents to images as ``StableDiffusion3Pipeline.__call__`` decodes them (with the VAE's shift)."""
    config = pipeline.vae.config
    with torch.no_grad():
        image = pipeline.vae.decode(latents / config.scaling_factor + config.shift_factor, return_dict=False)[0]
    return pipeline.image_processor.postprocess(image, output_type="pil")


def _lycoris_delta(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    """One LoHa or LoKr module's delta, by the ``lycoris-lora`` package's functions."""
    from lycoris.functional import loha, lokr  # the tests' and benchmarks' reference only

    alpha = float(parameters["alpha"])
    if "hada_w1_a" in parameters:
        names = ["hada_w1_b", "hada_w1_a", "hada_w2_b", "hada_w2_a", "hada_t1", "hada_t2"]
        dim = parameters["hada_w1_b"].shape[0]
        return loha.diff_weight(*(parameters.get(name) for name in names), gamma=alpha / dim)
    names = ["lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"]
    return lokr.diff_weight(*(parameters.get(name) for name in names), gamma=alpha)


def _mispaired_time_ids(image: Image | None, guidance_scale: float, sizes: SizeConditioning | None) -> bool:
    """Whether diffusers' SDXL text-to-image pipelines (and their ControlNet pipeline) would pair
    several images' rows with the other side's time ids: they repeat [negative; positive] ids per
    image against [negatives; positives] embeddings, which only differ with both negative sizes
    given. The server pairs each row with its own side's, so such a request's reference is one call
    per image (as diffusers' img2img and inpaint pipelines pair them)."""
    return (
        image is None
        and guidance_scale > 1
        and sizes is not None
        and sizes.negative_original_size is not None
        and sizes.negative_target_size is not None
    )
