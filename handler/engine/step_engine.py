"""The step-level denoising engine: one request is one job that advances one step at a time.

Mirrors diffusers 0.42.1: ``StableDiffusionPipeline.__call__`` (SD 1.x, SD 2.x),
``StableDiffusionXLPipeline.__call__`` (SDXL) and ``StableDiffusion3Pipeline.__call__`` (SD 3.x),
cut at the denoising loop so jobs can join and leave between steps; a job with an input image
mirrors the family's ``Img2ImgPipeline`` and, with a mask, its ``InpaintPipeline`` for the model's
own (4- or 16-channel) denoiser; a job with ControlNets mirrors ``StableDiffusion(XL)ControlNetPipeline``
(from an image, its ``Img2Img`` variant) or ``StableDiffusion3ControlNetPipeline``. What differs
between the families is theirs (``handler.families``); the loop reads the same for all. Their numbered steps map to:

- ``start``: 3. encode the prompts of the jobs started together (each text encoder's own:
  ``prompt_2``, ``prompt_3`` where given) in one call per LoRA set and ``clip_skip`` among them
  (negative prompts without it, as ``encode_prompt`` encodes them; SDXL: and 7. its added time
  ids); 4. each job's own scheduler and timesteps (``retrieve_timesteps``: a copy of one built per
  scheduler, step count or custom ``timesteps``/``sigmas`` and, where the schedule depends on it,
  latent shape; from an image, the last
  ``strength`` of them, ``get_timesteps``); 5. initial latents from one CPU generator per image
  (from an image: its VAE latents noised to the first timestep, ``prepare_latents``; with a mask
  also ``prepare_mask_latents``); 6. ``prepare_extra_step_kwargs`` (the job's DDIM ``eta`` and the
  generators, where the family's pipeline passes them); the ControlNet pipelines' step 3, each
  control image as its ControlNets read it (SD 3.x: through the VAE encoder, sampled from a CPU
  generator seeded with the job's seed). Its copies to the device, diffusers' own included, are
  queued without blocking (``handler.families.transfer.QueuedCopies``).
- ``step``: one iteration of the denoising loop for any set of jobs of one latent shape, in ONE
  denoiser forward (UNet or transformer): each job's rows (doubled for classifier-free guidance
  when its guidance scale is above 1) at its own timestep, with the residuals of the ControlNets
  acting in its step (``handler.adapters.controlnets``: each ControlNet once over the rows that use it, zeros
  for the others), then per job the guidance and its own ``scheduler.step`` (and, inpainting, the
  unmasked area put back at the next noise level). A job with a DeepCache (``JobSpec.cache``) at a
  cached step runs only the shallow branch in that forward, the deep blocks running as a sub-batch of
  the other rows (``handler.families.deep_cache``); a job with a first-block cache (SD 3.x) runs the first
  transformer block in the step's forward and the other blocks only where its first block's residual
  changed by more than its threshold (``handler.families.first_block_cache``). An SD 3.x job with
  skip-layer guidance at a step of its window adds its images' rows once more (the prompt's
  conditioning; ``StableDiffusion3Pipeline``'s second transformer call), which take each skipped
  block's inputs back in that forward, and its guided noise gains their difference from the
  prompt's (``handler.families.first_block_cache.SkipRows``). SD 3.x's ControlNet residuals are added
  after each transformer block by the same block wrappers. A step reads no
  tensor value on the host (``handler.families.schedules``): on a GPU, nothing in it waits for the
  device; first-block caching's decision is the one exception, a step with such jobs reads one vector.
- ``decode``: the end of ``__call__``: VAE decode, the safety checker (SD, where the model has one)
  or the watermark (SDXL), PIL images; ``decode_later`` queues the VAE decode and the pixels' copy
  to the host (with ``decode_stream: own``, on CUDA on a stream of their own, beside the next
  forward) and leaves the rest to whoever asks for the images (``handler.engine.decoding``).

Left out, because no request can ask for it: ``cross_attention_kwargs`` and its one LoRA scale
(each LoRA's weight is the request's), IP-Adapter images, caller-supplied latents or
embeddings, ``denoising_start``/``denoising_end``, SDXL's aesthetic scores, inpainting's
``padding_mask_crop`` and 9- or 33-channel inpainting denoisers, ControlNet inpainting, guess mode
and global-pooling ControlNets, output types other than PIL, step callbacks. UNets with a guidance
embedding (``time_cond_proj_dim``, LCM) are refused at load.
Different by design: jobs of one shape share one denoiser forward, so an image equals diffusers' to
float rounding, not bit for bit; SDXL's VAE is kept in float32 instead of being upcast around each
decode (same arithmetic); SDXL's time ids pair each row with its own side's, where diffusers'
text-to-image pipelines pair several images' rows with the other side's given both negative sizes
(``handler.families.sdxl.time_id_sizes``); SD 3's inpainting decodes with the VAE's shift factor
(``handler.families.sd3``); ``guidance_rescale`` applies to every guided job of a UNet family,
where diffusers' SD 1.x/2.x image-to-image and inpaint pipelines and every ControlNet pipeline
(SDXL's included) have none; a custom schedule (``timesteps``, ``sigmas``) also serves a job from an
image with ControlNets, where diffusers' ControlNet img2img pipelines take none (cut by ``strength``
as its other img2img pipelines cut it); SD 3's control latents are sampled from a CPU generator
seeded with the job's seed, and each of several SD 3 ControlNets reads its own config
(``handler.families.sd3``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg
from diffusers.utils.torch_utils import randn_tensor

from handler.adapters.controlnets import Control, ControlNetLibrary
from handler.adapters.embeddings import EmbeddingLibrary
from handler.adapters.lora_slots import SlotRows
from handler.adapters.loras import Adapters, LoraLibrary
from handler.config import FamilyRules, FaultInjection, StepCache
from handler.engine.decoding import DecodeFailed, DecodeStream, LaterDecode
from handler.engine.jobs import DenoiseJob, Inpainting, JobSpec
from handler.engine.timing import Span
from handler.families import Conditioning, Decoded, Family, Pipeline, Residuals, Scheduler, schedules
from handler.families.base import SubBatchRows, mark_rows, padded_rows, steps_by_index
from handler.families.deep_cache import Branch, CacheRows, DeepCacheHooks, RowCache, branches, kept_row_shape
from handler.families.first_block_cache import FirstBlockCache, FirstBlockHooks, SkipRows, kept_row_elements
from handler.families.transfer import queued_copies, to_device, to_host


@dataclass
class StepEngine:
    """Starts, steps and decodes ``DenoiseJob``s with one loaded pipeline and its family."""

    pipeline: Pipeline
    family: Family
    device: torch.device
    dtype: torch.dtype
    description: str
    loras: LoraLibrary
    controlnets: ControlNetLibrary
    fault_injection: FaultInjection = field(default_factory=FaultInjection)
    row_counts: tuple[int, ...] = ()  # what a forward's rows are padded to (ascending; none: unpadded)
    cuda_graphs: bool = False  # the compiled denoiser replays CUDA graphs
    deep_cache: DeepCacheHooks | None = None  # DeepCache per row (a UNet); None: not served
    first_block: FirstBlockHooks | None = None  # first-block caching per row (a transformer); None: not served
    embeddings: EmbeddingLibrary | None = None  # textual-inversion embeddings prompts name; None: none served
    # The compiled denoiser's first graph of a shape takes any row count (2 or more): its inputs' rows
    # are marked dynamic, and the LoRA rows' plan of a cached forward and of its sub-batches (the
    # regions mark their own arguments).
    dynamic_rows: bool = False
    compiled_decoder: bool = False  # the VAE's decode is compiled (warm-up decodes one image and two)
    decode_stream: DecodeStream = field(default_factory=DecodeStream)  # where the VAE decodes (the step's stream)

    @property
    def rules(self) -> FamilyRules:
        """The family's request rules, with the step caches this engine serves."""
        served = branches(self.family.denoiser) if self.deep_cache is not None else 0
        blocks = 0 if self.first_block is None else self.first_block.blocks
        return dataclasses.replace(
            self.family.rules,
            cache_branches=served,
            first_block_cache=self.first_block is not None,
            transformer_blocks=blocks,
        )

    def warm_up_cache(self) -> StepCache | None:
        """A step cache whose job compiles a compiled denoiser's regions at warm-up (None: it is
        eager, or serves no cache): interval 2 runs a full step, then (2 steps or more) a cached one."""
        hooks = self.deep_cache or self.first_block
        if hooks is None or not hooks.compiled:
            return None
        return StepCache(mode="deep", interval=2) if self.deep_cache is not None else StepCache(mode="first_block")

    def kept_bytes(self, spec: JobSpec) -> int:
        """What a job of ``spec`` keeps in its step cache while it runs (its rows' kept outputs,
        freed after its last step); 0 without a cache."""
        if spec.cache is None or spec.cache.mode == "off":
            return 0
        latent = self.latent_shape(spec.width, spec.height)
        if spec.cache.mode == "first_block":
            elements = kept_row_elements(self.family.denoiser, latent)
        else:
            elements = math.prod(kept_row_shape(self.family.denoiser, Branch.of(spec.cache.branch), latent))
        return spec.rows * elements * self.dtype.itemsize

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """Channels, height and width of one image's latents."""
        return self.family.latent_shape(width, height)

    def start(self, specs: Sequence[JobSpec]) -> list[DenoiseJob]:
        """``__call__`` steps 3 to 7 for jobs started together: their prompts through the text
        encoder(s) in one call per LoRA set (its adapters active) and ``clip_skip``, then each job's
        scheduler, latents and step arguments."""
        conditionings: dict[int, Conditioning] = {}
        with queued_copies(self.device):  # diffusers' copies to the device wait for no forward queued before
            for adapters in dict.fromkeys(spec.adapters for spec in specs):
                group = [index for index, spec in enumerate(specs) if spec.adapters == adapters]
                self.loras.activate(adapters)
                conditionings.update(zip(group, self.family.encode([specs[index] for index in group]), strict=True))
            jobs = [self._start(spec, conditionings[index]) for index, spec in enumerate(specs)]
        for job in jobs:
            job.cache = self._row_cache(job.spec)
        return jobs

    def _row_cache(self, spec: JobSpec) -> RowCache | FirstBlockCache | None:
        """A job's own step cache, where its spec asks for one."""
        if spec.cache is None or spec.cache.mode == "off":
            return None
        if not self.rules.serves(spec.cache):
            raise ValueError(f"step cache {spec.cache.model_dump()} is not served by this engine")
        if spec.cache.mode == "first_block":
            return FirstBlockCache(spec.cache.threshold)
        return RowCache(spec.cache.interval, Branch.of(spec.cache.branch))

    def _start(self, spec: JobSpec, conditioning: Conditioning) -> DenoiseJob:
        """Steps 4 to 6 for one job with its encoded prompt."""
        dtype = conditioning.hidden_states.dtype
        shape = (spec.images, *self.latent_shape(spec.width, spec.height))
        with torch.inference_mode():
            scheduler, host_timesteps = self.family.scheduler(
                spec.scheduler, spec.num_inference_steps, shape[1:], spec.custom_schedule()
            )
            generators = [torch.Generator("cpu").manual_seed(seed) for seed in spec.seeds]
            if spec.image is not None:
                return self._start_from_image(spec, conditioning, scheduler, host_timesteps, generators, shape)
            noise = randn_tensor(shape, generator=generators, device=self.device, dtype=dtype)
            latents = self.family.initial_latents(scheduler, noise)
            self.family.prepare_scheduler(scheduler)
            step_kwargs = self.family.step_kwargs(scheduler, generators, spec.eta)
            return DenoiseJob(
                spec,
                scheduler,
                scheduler.timesteps,
                latents,
                conditioning,
                step_kwargs,
                controls=self._controls(spec),
                host_timesteps=host_timesteps,
                skip_mask=self._skip_mask(spec),
            )

    def _skip_mask(self, spec: JobSpec) -> torch.Tensor | None:
        """The transformer blocks a job's skip-layer guidance skips, on the device (None: it has none)."""
        if spec.skip_layer_guidance is None:
            return None
        if self.first_block is None:
            raise ValueError(f"skip-layer guidance is not served by this engine ({self.family.name})")
        return to_device(self.first_block.skip_mask(spec.skip_layer_guidance.layers), self.device)

    def _controls(self, spec: JobSpec) -> tuple[Control, ...]:
        """What each of a job's ControlNets reads of its control image (the ControlNet pipelines'
        step 3; SD 3.x's draws its latents, in order, from one generator seeded with the job's seed),
        and which of their residuals each place of the denoiser's forward adds."""
        if not spec.controls:
            return ()
        family, nets = self.family, [self.controlnets.net(control.net) for control in spec.controls]
        slots = family.control_slots([family.control_residuals(net) for net in nets])
        generator = torch.Generator("cpu").manual_seed(spec.seeds[0])  # SD 3.x's: torch.manual_seed(seed)
        return tuple(
            Control(
                control, family.control_input(net, control.image, spec.width, spec.height, spec.rows, generator), slots
            )
            for control, net in zip(spec.controls, nets, strict=True)
        )

    def _start_from_image(
        self,
        spec: JobSpec,
        conditioning: Conditioning,
        scheduler: Scheduler,
        host_timesteps: list[float],
        generators: list[torch.Generator],
        shape: tuple[int, ...],
    ) -> DenoiseJob:
        """Steps 4 to 6 of the img2img and inpaint pipelines: the last ``strength`` of the schedule
        (``get_timesteps``), and latents from the image's (``prepare_latents``, with a mask
        ``prepare_mask_latents``)."""
        assert spec.image is not None
        family, dtype, steps = self.family, conditioning.hidden_states.dtype, spec.num_inference_steps
        start = (steps - family.rules.image_steps(steps, spec.strength)) * scheduler.order
        timesteps = scheduler.timesteps[start:]
        if steps_by_index(scheduler):
            scheduler.set_begin_index(start)
        first_timestep = timesteps[:1].repeat(spec.images)
        table = schedules.noise_table(scheduler, self.device, dtype)
        pixels = family.preprocess(spec.image, spec.width, spec.height, dtype)
        step_kwargs = family.step_kwargs(scheduler, generators, spec.eta)
        inpainting = None
        if spec.mask is None:  # img2img: each image encoded with its own generator
            image_latents = family.encode_image(pixels.repeat(spec.images, 1, 1, 1), generators, inpaint=False)
            noise = randn_tensor(shape, generator=generators, device=self.device, dtype=dtype)
            latents = schedules.noised(family, scheduler, image_latents, noise, table, first_timestep)
        else:  # inpaint: the image encoded once, with the first generator
            image_latents = family.encode_image(pixels, generators[:1], inpaint=True).repeat(spec.images, 1, 1, 1)
            noise = randn_tensor(shape, generator=generators, device=self.device, dtype=dtype)
            if spec.strength == 1.0:
                latents = family.initial_latents(scheduler, noise)
            else:
                latents = schedules.noised(family, scheduler, image_latents, noise, table, first_timestep)
            mask = family.preprocess_mask(spec.mask, spec.width, spec.height)
            if "generator" in step_kwargs:
                # The pipeline encodes the masked image too (with the first generator, whose state the
                # scheduler's steps then draw from), though a 4- or 16-channel denoiser never reads it.
                family.encode_image(pixels * (mask < 0.5), generators[:1], inpaint=True)
            latent_size = shape[-2:]
            mask = torch.nn.functional.interpolate(mask, size=latent_size).to(device=self.device, dtype=dtype)
            inpainting = Inpainting(image_latents, noise, mask, table)
        return DenoiseJob(
            spec,
            scheduler,
            timesteps,
            latents,
            conditioning,
            step_kwargs,
            inpainting=inpainting,
            controls=self._controls(spec),
            host_timesteps=host_timesteps[start:],
            skip_mask=self._skip_mask(spec),
        )

    def step(self, jobs: list[DenoiseJob]) -> int:
        """Advance every job one step with ONE denoiser forward, each job's rows with its own LoRA set
        and ControlNet residuals (each ControlNet run once over the rows acting with it), padded to
        the least of ``row_counts`` at or above them (the compiled denoiser's CUDA graphs, or its
        graphs of two rows and more for a single row: copies of the last row with its LoRA set,
        without ControlNet, dropped after). Jobs at a DeepCache cached step skip the deep blocks
        (``handler.families.deep_cache``); jobs with a first-block cache decide inside the forward,
        and jobs at a step of their skip-layer guidance add rows that skip its blocks
        (``handler.families.first_block_cache``). A forward with a step cache, skip-layer rows or
        SD 3.x ControlNet rows runs the denoiser's own forward (around its compiled regions), unpadded, whichever job
        brings them. All jobs must share a latent shape.
        Returns the ControlNet forwards run."""
        shapes = {job.latent_shape for job in jobs}
        if len(shapes) != 1:
            raise ValueError(f"one denoiser forward needs one latent shape, got {sorted(shapes)}")
        self._simulate_out_of_memory(
            "step",
            sum(job.images for job in jobs) * jobs[0].spec.width * jobs[0].spec.height,
            self.fault_injection.out_of_memory_above_pixels,
        )
        with torch.inference_mode():
            ordered = sorted(jobs, key=_row_order, reverse=True)
            noise, control_forwards = self._forward(ordered)
            for job, job_noise in zip(ordered, noise.split([job.rows for job in ordered]), strict=True):
                self._advance(job, job_noise)
        return control_forwards

    def _forward(self, jobs: list[DenoiseJob]) -> tuple[torch.Tensor, int]:
        """One denoiser forward over the jobs' rows (padded), each at its own timestep: the noise
        prediction of their rows, and the ControlNet forwards it ran."""
        family = self.family
        inputs, timesteps = [], []
        for job in jobs:
            timestep = job.timesteps[job.step]
            copies = job.rows // job.images  # guided: twice; at a skip-layer step: 3 times
            job_rows = torch.cat([job.latents] * copies) if copies > 1 else job.latents
            inputs.append(family.model_input(job.scheduler, job_rows, timestep))
            timesteps.append(timestep.float().expand(job.rows))
        rows, padding = sum(job.rows for job in jobs), self.padding(jobs)
        own = self._own_forward(jobs)
        replays = self.cuda_graphs and not own
        latents = padded_rows(torch.cat(inputs), padding)
        timestep_rows = padded_rows(torch.cat(timesteps), padding)
        conditioning = Conditioning.concat([piece for job in jobs for piece in job.forward_conditioning()])
        conditioning = conditioning.padded(padding)
        residuals, control_forwards = self.controlnets.residuals(
            [(job.acting(), job.rows) for job in jobs] + [([], padding)], latents, timestep_rows, conditioning
        )
        # The padding rows take the last job's LoRA set: a set every row shares stays one scalar weight.
        sets = [(job.spec.adapters, job.rows) for job in jobs] + [(jobs[-1].spec.adapters, padding)]
        in_blocks = own and family.controls_in_blocks  # the block wrappers add them
        with self.loras.rows(sets, self.device) as slot_rows, self._per_row_blocks(jobs, residuals):
            if self.dynamic_rows:
                rows_dynamic(latents, timestep_rows, conditioning, residuals, slot_rows)
            if replays:  # each step a new run of the graphs: the last run's outputs are done with
                torch.compiler.cudagraph_mark_step_begin()
            noise = family.forward(latents, timestep_rows, conditioning, None if in_blocks else residuals)[:rows]
        if replays:  # the graph's next replay overwrites its output, which a scheduler may keep
            noise = noise.clone()
        return noise, control_forwards

    def padding(self, jobs: list[DenoiseJob]) -> int:
        """The rows a forward of ``jobs`` runs beyond theirs: copies of the last row up to the least
        of ``row_counts`` at or above them; none where it runs the denoiser's own forward (a step
        cache, skip-layer guidance or SD 3.x ControlNet rows: ``_own_forward``), which runs any count."""
        if self._own_forward(jobs):
            return 0
        rows = sum(job.rows for job in jobs)
        return padded_count(rows, self.row_counts) - rows

    def _own_forward(self, jobs: list[DenoiseJob]) -> bool:
        """Whether a forward runs the denoiser's own forward (around its compiled regions), its blocks
        acting per row, at any row count: a job in it has a step cache or skips layers, or (where the
        family's block wrappers add them) ControlNets acting."""
        in_blocks = self.family.controls_in_blocks
        return any(job.cache is not None or job.skips_layers or (in_blocks and job.acting()) for job in jobs)

    def _per_row_blocks(
        self, jobs: list[DenoiseJob], residuals: Residuals | None
    ) -> contextlib.AbstractContextManager[None]:
        """The denoiser's blocks acting per row over a forward's rows, where it runs its own forward
        (``_own_forward``); a sub-batch of its parts (by index) takes their LoRA sets; a
        transformer's blocks add the ControlNet ``residuals``."""
        if not self._own_forward(jobs):
            return contextlib.nullcontext()
        if self.first_block is not None:
            parts = [part for job in jobs for part in _transformer_parts(job)]
            return self.first_block.forward(
                [(cache, rows) for cache, rows, _ in parts],
                self._sub_batch_rows([(job.spec.adapters, rows) for _, rows, job in parts]),
                self._skip_rows(jobs),
                residuals,
            )
        assert self.deep_cache is not None
        rows = [
            CacheRows(job.cache if isinstance(job.cache, RowCache) else None, job.rows, job.cached_step) for job in jobs
        ]
        return self.deep_cache.forward(rows, self._sub_batch_rows([(job.spec.adapters, job.rows) for job in jobs]))

    def _sub_batch_rows(self, sets: list[tuple[Adapters, int]]) -> SubBatchRows:
        """The LoRA rows of a sub-batch of a forward's parts (by index), each part's LoRA set and
        rows in ``sets``."""

        @contextlib.contextmanager
        def sub_batch_rows(running: list[int]) -> Iterator[SlotRows | None]:
            subset = [sets[index] for index in running]
            with self.loras.rows(subset, self.device) as slot_rows:
                if self.dynamic_rows:
                    mark_rows(sum(rows for _, rows in subset), slot_rows or ())
                yield slot_rows

        return sub_batch_rows

    def _skip_rows(self, jobs: list[DenoiseJob]) -> SkipRows | None:
        """The blocks each row of a forward skips (skip-layer guidance; None: no row skips any):
        a job's guided rows none, its skip-layer rows its guidance's."""
        skipping = [job for job in jobs if job.skips_layers]
        if not skipping:
            return None
        assert self.first_block is not None
        rows = sum(job.rows for job in jobs)
        mask = torch.zeros((rows, self.first_block.blocks), dtype=torch.bool, device=self.device)
        stop = 0
        for job in jobs:
            stop += job.rows
            if job.skips_layers:  # its last rows
                assert job.skip_mask is not None  # made at its start
                mask[stop - job.images : stop] = job.skip_mask
        layers = {layer for job in skipping for layer in _skip_layers(job)}
        return SkipRows(mask, frozenset(layers))

    def _advance(self, job: DenoiseJob, noise: torch.Tensor) -> None:
        """A job's guidance and ``scheduler.step`` on its rows' noise prediction (and, inpainting,
        the unmasked area put back at the next noise level)."""
        if job.guided:
            unconditional, conditional, *skipped = noise.split(job.images)
            noise = unconditional + job.spec.guidance_scale * (conditional - unconditional)
            if job.spec.guidance_rescale > 0:  # the UNet pipelines' step 7, per image
                noise = rescale_noise_cfg(noise, conditional, guidance_rescale=job.spec.guidance_rescale)
            if skipped and job.spec.skip_layer_guidance is not None:  # StableDiffusion3Pipeline's, after the guidance
                noise = noise + (conditional - skipped[0]) * job.spec.skip_layer_guidance.scale
        job.latents = schedules.step(
            job.scheduler,
            noise,
            job.timesteps[job.step],
            job.host_timesteps[job.step],
            job.latents,
            job.step_kwargs,
        )
        job.step += 1
        if job.done and job.cache is not None:  # what it kept is not read again: freed before the job is answered
            job.cache.release()
        if job.inpainting is not None:
            next_timestep = job.timesteps[job.step : job.step + 1] if not job.done else None
            job.latents = job.inpainting.blend(self.family, job.scheduler, job.latents, next_timestep)

    def decode(self, latents: torch.Tensor, width: int, height: int, tiled: bool = False) -> Decoded:
        """The end of ``__call__`` for finished latents of one shape, waited for (``tiled``: the
        VAE decodes in overlapping tiles, which needs less memory and may differ slightly at the
        seams)."""
        try:
            return self.decode_later(latents, width, height, tiled).result().decoded
        except DecodeFailed as failed:
            raise failed.error from None  # as if made here: its callers (warm-up, previews) see the error itself

    def decode_later(self, latents: torch.Tensor, width: int, height: int, tiled: bool = False) -> LaterDecode:
        """``decode`` in two parts: the VAE decode and the copy of its pixels to the host queued
        on the device now (on the decode stream, after the step's work queued so far; its out of
        memory raised here), the family's host part (safety checker or watermark, PIL
        images) run by whoever first asks for the images (``LaterDecode``)."""
        if not tiled:
            self._simulate_out_of_memory(
                "VAE decode", latents.shape[0] * width * height, self.fault_injection.vae_out_of_memory_above_pixels
            )
        with torch.inference_mode(), self.decode_stream.after_the_step(latents):
            span = Span(self.device)  # marks on the decode stream
            pixels = to_host(self.family.vae_decode(latents, tiled))
            span.end()
        return LaterDecode.queued(pixels, span, functools.partial(self._postprocess, width * height))

    def _postprocess(self, image_pixels: int, pixels: torch.Tensor) -> Decoded:
        """The family's end of the pipeline on decoded pixels (``LaterDecode`` makes them again
        image by image where it runs out of memory)."""
        self._simulate_out_of_memory(
            "postprocess", pixels.shape[0] * image_pixels, self.fault_injection.postprocess_out_of_memory_above_pixels
        )
        return self.family.postprocess(pixels)

    @staticmethod
    def _simulate_out_of_memory(stage: str, pixels: int, limit: int | None) -> None:
        """Fault injection: out of memory above a pixel count (off unless configured)."""
        if limit is not None and pixels > limit:
            raise torch.OutOfMemoryError(
                f"simulated out of memory: {pixels} pixels in one {stage}, fault_injection allows {limit}"
            )


def rows_dynamic(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Conditioning,
    residuals: Residuals | None,
    slot_rows: SlotRows | None,
) -> None:
    """Mark the rows of a compiled denoiser's inputs dynamic (``mark_rows``), the LoRA rows' plan
    included: a step cache's regions read it too."""
    tensors = [latents, timesteps, conditioning.hidden_states, *conditioning.added.values(), *(residuals or ())]
    mark_rows(latents.shape[0], [*tensors, *(slot_rows or ())])


def _transformer_parts(job: DenoiseJob) -> list[tuple[FirstBlockCache | None, int, DenoiseJob]]:
    """A job's parts of a transformer's forward: its guided rows with its first-block cache, and
    its skip-layer guidance rows (which run every block but the skipped ones, never cached)."""
    cache = job.cache if isinstance(job.cache, FirstBlockCache) else None
    return [(cache, job.spec.rows, job)] + ([(None, job.images, job)] if job.skips_layers else [])


def _skip_layers(job: DenoiseJob) -> tuple[int, ...]:
    assert job.spec.skip_layer_guidance is not None
    return job.spec.skip_layer_guidance.layers


def padded_count(rows: int, counts: Sequence[int]) -> int:
    """The rows a forward of ``rows`` rows runs at: the least of ``counts`` (ascending) at or above
    them; ``rows`` where none is."""
    return next((count for count in counts if count >= rows), rows)


def _row_order(job: DenoiseJob) -> float:
    """A forward's rows in descending order of this: rows at a full step first, then those at a
    DeepCache cached step, deeper branches (which skip less) first, so that the rows a module runs
    are one block, a view of its input."""
    return job.cache.branch.number if job.cached_step and isinstance(job.cache, RowCache) else math.inf
