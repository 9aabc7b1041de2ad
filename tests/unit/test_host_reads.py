"""No denoising step reads a tensor's value on the host: on a GPU each such read waits for the device;
nor does starting jobs wait for the forwards queued before it.

Every family and scheduler the server offers, with LoRA rows, ControlNets (the UNet families), an
image-to-image and an inpainting job, a DeepCache job (the UNet families), jobs of each custom
schedule (timesteps, sigmas) the scheduler takes and one with DDIM's eta in the same forwards.
Counted per step after the first, under a ``TorchDispatchMode``: the operations that read a value
(``aten._local_scalar_dense``, ``is_nonzero``, ``nonzero``, ``item``); and under a
``TorchFunctionMode`` the methods that take a value to the host and ``torch.linalg.solve`` (UniPC's
coefficients: it reads its result's status). A dispatch mode does not see a CPU tensor indexed with
a 0-d CPU tensor, so the jobs' device timesteps are also marked: a step that indexes with one, or
takes its value, is caught as well."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
)
from torch.overrides import TorchFunctionMode

from handler.config import HandlerSettings
from handler.engine import step_engine
from handler.engine.loading import load_engine
from handler.engine.step_engine import StepEngine
from handler.families import base, transfer
from handler.families.base import set_timesteps_on_host
from handler.families.transfer import QueuedCopies
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import (
    assert_same_images,
    engine_with_adapters,
    hole,
    jobs_of_every_kind,
    picture,
    spec,
)
from tests.harness.host_reads import HostReads, ValueReads

SIDE = 32
STEPS = 4


class DeviceTimesteps(torch.Tensor):
    """A job's schedule as if on a device: indexing it gives marked timesteps, and any use of a
    marked timestep as a number (an index of one element: a read; a gather by a 1-d one is not) is
    recorded. Other results are plain tensors."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        marked_index = name == "__getitem__" and isinstance(args[1], DeviceTimesteps) and args[1].dim() == 0
        if marked_index or name in {"__bool__", "__index__", "__int__", "__float__", "item", "tolist"}:
            cls.reads.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if name == "__getitem__" and type(args[0]) is cls and isinstance(result, torch.Tensor):
            return result.as_subclass(cls)
        return result


@pytest.fixture(scope="module", params=["sd1", "sd2", "sdxl", "sd3"])
def engine(request, tmp_path_factory) -> StepEngine:
    return engine_with_adapters(request.param, tmp_path_factory.mktemp(request.param))


def marked(jobs):
    for job in jobs:
        job.timesteps = job.timesteps.as_subclass(DeviceTimesteps)
    return jobs


def test_a_step_reads_no_value_on_the_host_for_every_scheduler(engine):
    """Every step of every job, its first included: a second set of jobs joins the first after one
    step, as requests join a running batch (starting a job may read: admission is not a step)."""
    for scheduler in engine.family.rules.schedulers:
        first = marked(jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True))
        DeviceTimesteps.reads = []
        with HostReads() as reads, ValueReads() as values:
            engine.step(first)
        second = marked(jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True))
        with reads, values:
            while not all(job.done for job in first + second):
                engine.step([job for job in first + second if not job.done])
        assert reads.reads == [], f"{engine.family.name}, {scheduler}: a step read values on the host: {reads.reads}"
        assert values.reads == [], f"{engine.family.name}, {scheduler}: a step took values to the host: {values.reads}"
        assert DeviceTimesteps.reads == [], f"{engine.family.name}, {scheduler}: a step read a device timestep"
    with HostReads() as reads:
        engine.decode_later(torch.cat([job.latents for job in first]), SIDE, SIDE)
    assert reads.reads == [], f"{engine.family.name}: queuing a decode read values on the host: {reads.reads}"


def test_the_check_finds_a_read():
    """The positive control: a scheduler step given the device timestep, as diffusers' loop does."""
    engine = load_engine(HandlerSettings.model_validate({"model_path": str(TINY_MODEL_DIRS["sd1"])}), "/unused")
    (job,) = engine.start([spec(side=SIDE, steps=STEPS, scheduler="ddim")])
    timesteps = job.timesteps.as_subclass(DeviceTimesteps)
    DeviceTimesteps.reads = []
    with HostReads() as reads:
        job.scheduler.step(torch.zeros_like(job.latents), timesteps[1], job.latents, return_dict=False)
    assert DeviceTimesteps.reads and reads.reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl", "sd3"])
def test_on_a_gpu_a_step_never_synchronizes(family, tmp_path):
    """What the dispatch count stands for, on the device itself: CUDA refuses a synchronization (a
    value read, a blocking copy) in any step, a joining job's first included, and in queuing the
    finished jobs' decode."""
    engine = engine_with_adapters(family, tmp_path, device="cuda")
    for scheduler in engine.family.rules.schedulers:
        first = jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True)
        engine.step(first)  # the engine's first forwards: cuDNN and cuBLAS set up their handles
        second = jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True)
        latents = torch.cat([job.latents for job in first + second])
        engine.decode(latents, SIDE, SIDE)  # the VAE's first call
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            while not all(job.done for job in first + second):
                engine.step([job for job in first + second if not job.done])
            latents = torch.cat([job.latents for job in first + second])
            decode = engine.decode_later(latents, SIDE, SIDE)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # The host part on the pixels' host copy makes the images it makes on the device.
        with torch.inference_mode():
            on_device = engine.family.postprocess(engine.family.vae_decode(latents, False))
        assert_same_images(decode.result().decoded, on_device, tolerance=0)


def test_starting_jobs_queues_its_copies_to_the_device(monkeypatch):
    """``QueuedCopies`` (``StepEngine.start`` runs under it on CUDA; a ``meta`` device stands in
    here): a host tensor's ``to`` the device, however asked, is ``to_device``'s copy; other ``to``
    calls are left as they are."""
    host = torch.arange(6.0).view(2, 3)
    meta = torch.device("meta")
    queued, to_device = [], transfer.to_device
    monkeypatch.setattr(transfer, "to_device", lambda *args: queued.append(args[1:]) or to_device(*args))
    asked = {
        (meta, None): [lambda: host.to("meta"), lambda: host.to(meta, non_blocking=False)],
        (meta, torch.float16): [
            lambda: host.to(meta, torch.float16),
            lambda: host.to(device="meta", dtype=torch.float16, copy=True),
            lambda: host.to(torch.empty(0, dtype=torch.float16, device="meta")),
        ],
    }
    for (device, dtype), calls in asked.items():
        for call in calls:
            expected = call()
            with QueuedCopies(meta):
                result = call()
            assert (result.device, result.dtype, result.shape) == (expected.device, expected.dtype, expected.shape)
            assert queued == [(device, dtype)]
            queued.clear()
    with QueuedCopies(meta):
        assert host.to(torch.float16).device.type == "cpu" and host.to("cpu") is host
        host.to("meta", memory_format=torch.contiguous_format)
        host.to("meta").to("meta", torch.float16)  # from the device
    assert queued == [(meta, None)]


def test_every_copy_starting_jobs_makes_is_read_and_made_alike(engine, monkeypatch):
    """Every ``to`` a device that starting jobs of every kind makes (diffusers' own included) is
    one ``QueuedCopies`` reads; taking the CPU for the device, it makes them as its copies, and
    they start the same jobs."""
    queued, unread, to_device, parse_to = [], [], transfer.to_device, torch._C._nn._parse_to

    def parse(*args, **kwargs):
        try:
            device, _, _, memory_format = parsed = parse_to(*args, **kwargs)
        except (RuntimeError, TypeError):
            unread.append(args)
            raise
        if device is not None and memory_format is not None:
            unread.append(args)
        return parsed

    monkeypatch.setattr(torch._C._nn, "_parse_to", parse)
    monkeypatch.setattr(transfer, "to_device", lambda *args: queued.append(args[1]) or to_device(*args))
    for scheduler in engine.family.rules.schedulers:
        plain = jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True)
        with monkeypatch.context() as forced:
            forced.setattr(step_engine, "queued_copies", lambda device: QueuedCopies(torch.device("cpu")))
            rewritten = jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True)
        assert queued and not unread, (
            f"{engine.family.name}, {scheduler}: {len(queued)} queued, left as asked: {unread}"
        )
        for mine, theirs in zip(rewritten, plain, strict=True):
            assert_started_alike(mine, theirs)
        queued.clear()


def test_schedule_templates_leave_on_the_device_what_diffusers_leaves(engine, monkeypatch):
    """The schedule templates jobs start from are made on the host (``set_timesteps_on_host``),
    which leaves on a device (``meta`` here: no values) the tensors diffusers' ``set_timesteps``
    leaves there, in its dtypes and shapes; the GPU start test compares them with diffusers' on
    CUDA, values included."""
    made = []
    monkeypatch.setattr(
        base, "set_timesteps_on_host", lambda *args: made.append(args[0]) or set_timesteps_on_host(*args)
    )
    engine.family._templates.clear()
    for scheduler in engine.family.rules.schedulers:
        starting(engine, scheduler)
    templates = [template for template, _ in engine.family._templates.values()]
    assert templates and all(any(template is one for one in made) for template in templates)
    for name, steps, options, custom in engine.family._templates:
        scheduler_class, overrides = engine.family.schedulers[name]
        config = {**engine.family.pipeline.scheduler.config, **overrides}
        assert_placed_alike(scheduler_class, config, steps, dict(options), dict(custom))


@pytest.mark.parametrize(
    ("scheduler_class", "config", "options"),
    [
        (DDIMScheduler, {"timestep_spacing": "trailing"}, {}),
        (PNDMScheduler, {}, {}),
        (EulerDiscreteScheduler, {"use_karras_sigmas": True, "final_sigmas_type": "sigma_min"}, {}),
        (EulerDiscreteScheduler, {"use_exponential_sigmas": True, "prediction_type": "v_prediction"}, {}),
        (EulerAncestralDiscreteScheduler, {"timestep_spacing": "trailing"}, {}),
        (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}, {}),
        (DPMSolverMultistepScheduler, {"use_lu_lambdas": True, "final_sigmas_type": "zero"}, {}),
        (FlowMatchEulerDiscreteScheduler, {"invert_sigmas": True}, {}),
        (FlowMatchEulerDiscreteScheduler, {"shift_terminal": 0.02}, {}),
        (FlowMatchEulerDiscreteScheduler, {"use_dynamic_shifting": True}, {"mu": 0.8}),
    ],
)
def test_schedules_of_other_configs_are_placed_alike(scheduler_class, config, options):
    """Checkpoints bring other scheduler configs: their schedules, made on the host, are left where
    diffusers leaves them too."""
    assert_placed_alike(scheduler_class, config, 7, options)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))]
)
def test_euler_with_continuous_timesteps_differs_from_diffusers_by_a_bit_at_most(device):
    """The one schedule whose values may differ (README): Euler with continuous timesteps, whose
    logarithm diffusers takes on the device. Left where diffusers leaves it, its timesteps within
    one float32 step of diffusers' (equal on the CPU), its sigmas equal."""
    config = {"timestep_type": "continuous", "prediction_type": "v_prediction"}
    mine, theirs = EulerDiscreteScheduler.from_config(config), EulerDiscreteScheduler.from_config(config)
    host = set_timesteps_on_host(mine, 7, torch.device(device), {})
    theirs.set_timesteps(7, device=device)
    assert devices(mine) == devices(theirs) and host == mine.timesteps.tolist()
    step = (torch.nextafter(theirs.timesteps, torch.full_like(theirs.timesteps, torch.inf)) - theirs.timesteps).abs()
    assert ((mine.timesteps - theirs.timesteps).abs() <= step).all()
    assert device == "cuda" or torch.equal(mine.timesteps, theirs.timesteps)
    assert torch.equal(mine.sigmas, theirs.sigmas)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_copy_queued_under_queued_copies_is_staged_once(monkeypatch):
    """``to_device`` called where ``QueuedCopies`` is active (the schedule templates, the noise
    tables) stages its pinned copy once: its own copy to the device is not rewritten again."""
    calls, to_device, cuda = [], transfer.to_device, torch.device("cuda")
    monkeypatch.setattr(transfer, "to_device", lambda *args: calls.append(args) or to_device(*args))
    with QueuedCopies(cuda):
        copied = transfer.to_device(torch.arange(3.0), cuda)
    assert len(calls) == 1 and copied.device.type == "cuda" and copied.tolist() == [0.0, 1.0, 2.0]


def set_timesteps_arguments(steps: int, options: dict, custom: dict) -> dict:
    """What diffusers' ``set_timesteps`` takes for a template's steps, timestep options and custom
    schedule (its steps then none, as ``retrieve_timesteps`` calls it)."""
    given = {field: list(values) for field, values in custom.items()}
    return {**({} if given else {"num_inference_steps": steps}), **options, **given}


def assert_placed_alike(scheduler_class, config: dict, steps: int, options: dict, custom: dict | None = None) -> None:
    """``set_timesteps_on_host`` for a ``meta`` device leaves each tensor where diffusers'
    ``set_timesteps`` leaves it, in its dtype and shape (``custom``: a custom schedule's)."""
    meta = torch.device("meta")
    mine, theirs = scheduler_class.from_config(config), scheduler_class.from_config(config)
    arguments = set_timesteps_arguments(steps, options, custom or {})
    set_timesteps_on_host(mine, arguments.pop("num_inference_steps", None), meta, arguments)
    with MetaToHost():
        theirs.set_timesteps(device=meta, **set_timesteps_arguments(steps, options, custom or {}))
    assert devices(mine) == devices(theirs), (scheduler_class.__name__, config)


class MetaToHost(TorchFunctionMode):
    """A ``meta`` tensor's ``to`` the host (or ``cpu``) is an empty host tensor of its shape and dtype (it has no
    values to copy), so that diffusers' ``set_timesteps`` runs for a ``meta`` device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu and args[0].device.type == "meta":  # DPM2's set_timesteps
            return torch.empty(args[0].shape, dtype=args[0].dtype)
        if func is torch.Tensor.to and args[0].device.type == "meta":
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cpu":
                return torch.empty(args[0].shape, dtype=dtype or args[0].dtype)
        return func(*args, **kwargs)


def devices(scheduler) -> dict[str, tuple[torch.device, torch.dtype, tuple[int, ...]]]:
    """Where each of ``scheduler``'s tensors is, in what dtype and shape."""
    return {name: (v.device, v.dtype, tuple(v.shape)) for name, v in vars(scheduler).items() if torch.is_tensor(v)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl", "sd3"])
def test_on_a_gpu_starting_jobs_never_synchronizes(family, tmp_path, monkeypatch):
    """Jobs of every kind (token ids, CPU noise, input images and masks, ControlNet images, the
    schedulers' tables, inpainting at strength 1) start behind a queued forward without a
    synchronization, their schedule templates made there too; the templates equal diffusers' own
    on the device, and the jobs those started with diffusers' own blocking copies and its own
    ``set_timesteps``."""
    engine = engine_with_adapters(family, tmp_path, device="cuda")
    for scheduler in engine.family.rules.schedulers:
        running = starting(engine, scheduler)  # first calls: handles, allocations
        engine.step(running)
        engine.family._templates.clear()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.step(running)
            queued = starting(engine, scheduler)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_templates_are_diffusers_own(engine.family)
        with monkeypatch.context() as blocking:
            blocking.setattr(step_engine, "queued_copies", lambda device: contextlib.nullcontext())
            blocking.setattr(base, "set_timesteps_on_host", diffusers_set_timesteps)
            engine.family._templates.clear()
            copied = starting(engine, scheduler)
        for mine, theirs in zip(queued, copied, strict=True):
            assert_started_alike(mine, theirs)


def diffusers_set_timesteps(scheduler, steps: int, device: torch.device, options: dict) -> list[float]:
    """What ``set_timesteps_on_host`` stands for: diffusers' own, on the device, read back."""
    scheduler.set_timesteps(steps, device=device, **options)
    return scheduler.timesteps.tolist()


def starting(engine: StepEngine, scheduler: str) -> list:
    """Jobs of every kind, and an inpainting job at strength 1 (noised from pure noise; DDIM's
    and PNDM's table goes to the device after its first step)."""
    common = dict(side=SIDE, steps=STEPS, scheduler=scheduler)
    whole = spec("inpaint whole", 8, image=picture(SIDE, 3), mask=hole(SIDE), strength=1.0, **common)
    return jobs_of_every_kind(engine, scheduler, cached=True, skip_layers=True, schedule_settings=True) + engine.start(
        [whole]
    )


def assert_templates_are_diffusers_own(family) -> None:
    """Every schedule template ``family`` keeps equals its scheduler set by diffusers on the
    family's device (each attribute: tensors by value and device), and its host timesteps those."""
    assert family._templates
    for (name, steps, options, custom), (template, host) in family._templates.items():
        scheduler_class, overrides = family.schedulers[name]
        theirs = scheduler_class.from_config(family.pipeline.scheduler.config, **overrides)
        theirs.set_timesteps(device=family.device, **set_timesteps_arguments(steps, dict(options), dict(custom)))
        assert host == theirs.timesteps.tolist(), (name, steps)
        mine = {k: v for k, v in vars(template).items() if k != "lms_coefficients"}  # test_schedule_steps.py's
        assert mine.keys() == vars(theirs).keys(), (name, steps)
        for attribute, other in vars(theirs).items():
            value = mine[attribute]
            if torch.is_tensor(other):
                same = value.device == other.device and value.dtype == other.dtype and equal(value, other)
            elif isinstance(other, np.ndarray):
                same = value.dtype == other.dtype and np.array_equal(value, other)
            else:
                same = type(value) is type(other) and value == other
            assert same, (name, steps, attribute)


def started_with(job) -> dict[str, object]:
    """What a job started with, by name: its tensors, its scheduler's tensors and begin index, its
    generators' states and its host timesteps."""
    state: dict[str, object] = {
        "latents": job.latents,
        "timesteps": job.timesteps,
        "hidden": job.conditioning.hidden_states,
    }
    state |= job.conditioning.added
    state |= {f"control {index}": control.image for index, control in enumerate(job.controls)}
    if job.inpainting is not None:
        state |= vars(job.inpainting)
    state |= {f"scheduler {name}": value for name, value in vars(job.scheduler).items() if torch.is_tensor(value)}
    state["begin index"] = getattr(job.scheduler, "begin_index", None)
    state |= {f"generator {index}": g.get_state() for index, g in enumerate(job.step_kwargs.get("generator", []))}
    state["host timesteps"] = job.host_timesteps
    return state


def assert_started_alike(mine, theirs) -> None:
    """Two jobs started with the same tensors (values and devices) and states."""
    ours, others = started_with(mine), started_with(theirs)
    assert ours.keys() == others.keys(), mine.spec.prompt
    for name, value in ours.items():
        other = others[name]
        same = value.device == other.device and equal(value, other) if torch.is_tensor(value) else value == other
        assert same, (mine.spec.prompt, name)


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values, NaN where the other has NaN (DPM2's interpolated sigmas past its last step are)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
