"""LyCORIS LoHa and LoKr files (kohya module names, ``hada_*`` / ``lokr_*`` keys, ``alpha``) served
as exact LoRAs, so that every path a LoRA takes (rows of a shared forward, a compiled denoiser's
slots, the text encoders) takes them too.

Each module's delta is LyCORIS's own (``lycoris/functional/{loha,lokr}.py``, as the A1111 and
ComfyUI loaders compute it; scale ``alpha / dim``, ``dim`` the rank of a factorized half, alpha
absent or 0: ``dim``; a LoKr of two full halves: scale 1). It is a product ``up @ down`` of two
factors, exactly:

- LoHa, ``(A1 B1) * (A2 B2)`` elementwise: ``up`` the row-wise products of A1's and A2's columns,
  ``down`` the column-wise products of B1's and B2's rows (rank ``dim1 x dim2``); a Tucker half
  ``einsum(t, b, a)`` is ``a.T`` times ``t`` contracted with ``b``;
- LoKr, ``kron(U1 V1, U2 V2) = kron(U1, U2) kron(V1, V2)`` (rank ``rank1 x rank2``), a full half
  an identity times itself;
- where that rank is over the layer's smaller side, the delta itself beside an identity.

Each pair becomes a kohya LoRA pair (``lora_down`` = down, ``lora_up`` = up times the scale, no
``alpha``: diffusers gives each module an alpha of its own rank, scale 1, which the parity tests
keep), read by diffusers' own kohya converter, which names the model's modules; a convolution's
``down`` then takes the layer's kernel shape.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
from diffusers.utils import convert_unet_state_dict_to_peft
from peft.tuners.tuners_utils import BaseTunerLayer

LOHA, LOKR, LORA = "LoHa", "LoKr", "LoRA"
# What a module's parameters tell: its algorithm (by their prefix) and the parameters it may hold.
KINDS = {"hada_": LOHA, "lokr_": LOKR, "lora_": LORA}
PARAMETERS = {
    LOHA: {"alpha", *(f"hada_{name}" for name in ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2"))},
    LOKR: {"alpha", *(f"lokr_{name}" for name in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b", "t2"))},
    LORA: {"alpha", "lora_up.weight", "lora_down.weight"},
}
# LyCORIS algorithms a key tells, that are not served (named in the refusal).
OTHERS = {
    "dora_scale": "weight-decomposed (DoRA)",
    "oft_": "OFT",
    "boft_": "BOFT",
    "a1.": "GLoRA",
    "a2.": "GLoRA",
    "b1.": "GLoRA",
    "b2.": "GLoRA",
    "diff": "full-weight difference",
    "w_norm": "norm",
    "b_norm": "norm",
    "on_input": "IA3",
    "weight": "IA3",
}
_PEFT_DOWN = re.compile(r"^(?P<module>.+)\.lora_A(\.[^.]+)?\.weight$")


def holds_lycoris(state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether a LoRA file holds LyCORIS modules (kohya's ``lora_..`` module names with LoHa, LoKr
    or another LyCORIS algorithm's parameters, refused by name)."""
    prefixes = ("hada_", "lokr_", *(prefix for prefix in OTHERS if prefix != "dora_scale"))
    for key in state_dict:
        module, _, parameter = key.partition(".")
        if module.startswith("lora_") and parameter.startswith(prefixes):
            return True
    return False


def as_lora(pipeline: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LyCORIS file's state dict as a LoRA state dict ``load_lora_weights`` reads (diffusers'
    layout, every scale folded in). Raises ValueError naming the first module that cannot be."""
    kohya: dict[str, torch.Tensor] = {}
    for module, parameters in _modules(state_dict).items():
        up, down = factors(module, parameters)
        kohya |= {f"{module}.lora_up.weight": up, f"{module}.lora_down.weight": down}
    options = {"unet_config": pipeline.unet.config} if hasattr(pipeline, "unet") else {}
    converted = pipeline.lora_state_dict(kohya, **options)
    converted = converted[0] if isinstance(converted, tuple) else converted
    return _with_kernels(pipeline, converted)


def _modules(state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The file's parameters by kohya module name (``lora_unet_..``: ``{hada_w1_a: ..}``)."""
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in state_dict.items():
        module, _, parameter = key.partition(".")
        if not parameter:
            raise ValueError(f"key {key!r} names no module parameter (kohya's module.parameter keys)")
        modules[module][parameter] = value
    return modules


def _kind(module: str, parameters: dict[str, torch.Tensor]) -> str:
    for prefix, what in OTHERS.items():
        if any(name.startswith(prefix) for name in parameters):
            raise ValueError(f"{module}: LyCORIS {what} modules are not served (LoRA, LoCon, LoHa and LoKr are)")
    kinds = {kind for name in parameters for prefix, kind in KINDS.items() if name.startswith(prefix)}
    if len(kinds) != 1:
        raise ValueError(f"{module}: parameters {sorted(parameters)} are no LoRA, LoHa or LoKr module")
    kind = kinds.pop()
    unknown = sorted(set(parameters) - PARAMETERS[kind])
    if unknown:
        raise ValueError(f"{module}: {', '.join(unknown)} in a {kind} module are not served")
    return kind


def factors(module: str, parameters: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(up, down): out x rank and rank x (in x kernel) in float32, the scale folded into up."""
    kind = _kind(module, parameters)
    alpha = _alpha(module, parameters)
    tensors = {name: value.float() for name, value in parameters.items()}
    dim: int | None
    try:
        if kind == LOHA:
            up, down, dim = _loha(tensors)
        elif kind == LOKR:
            up, down, dim = _lokr(tensors)
        else:
            up, down = _pair(tensors["lora_up.weight"].flatten(1), tensors["lora_down.weight"].flatten(1))
            dim = down.shape[0]
        scale = 1.0 if dim is None else (alpha or dim) / dim
        up, down = _capped(up * scale, down)
    except KeyError as missing:
        raise ValueError(f"{module}: a {kind} module without {missing.args[0]}") from None
    except (RuntimeError, ValueError, IndexError) as error:  # factors whose shapes do not fit
        raise ValueError(f"{module}: {kind} factors of shapes that do not fit: {error}") from None
    return up.contiguous(), down.contiguous()


def _alpha(module: str, parameters: dict[str, torch.Tensor]) -> float:
    """The module's alpha (0 where it has none: LyCORIS then takes its dim)."""
    if "alpha" not in parameters:
        return 0.0
    alpha = parameters["alpha"]
    if alpha.numel() != 1:
        raise ValueError(f"{module}: alpha must be one number, not a tensor of shape {tuple(alpha.shape)}")
    if not torch.isfinite(alpha.float()).all():
        raise ValueError(f"{module}: alpha must be a finite number, not {float(alpha)}")
    return float(alpha)


def _loha(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    (up1, down1), (up2, down2) = (_loha_half(t, index) for index in (1, 2))
    if up1.shape[0] != up2.shape[0] or down1.shape[1] != down2.shape[1]:
        raise ValueError(f"halves of {up1.shape[0]} x {down1.shape[1]} and {up2.shape[0]} x {down2.shape[1]}")
    up = (up1[:, :, None] * up2[:, None, :]).flatten(1)
    down = (down1[:, None, :] * down2[None, :, :]).flatten(0, 1)
    return up, down, t["hada_w1_b"].shape[0]


def _loha_half(t: dict[str, torch.Tensor], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = t[f"hada_w{index}_a"], t[f"hada_w{index}_b"]
    tucker = t.get(f"hada_t{index}")
    if tucker is None:
        return _pair(a, b.flatten(1))
    return _tucker(tucker, a, b)


def _tucker(core: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Tucker half, lycoris' ``einsum("i j ..., j r, i p -> p r ...", t, b, a)``: ``a.T`` times the
    core contracted with ``b``."""
    return _pair(a.T, torch.einsum("i j ..., j r -> i r ...", core, b).flatten(1))


def _lokr(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    for full, parts in (
        ("lokr_w1", ("lokr_w1_a", "lokr_w1_b")),
        ("lokr_w2", ("lokr_w2_a", "lokr_w2_b", "lokr_t2")),
    ):
        both = [name for name in parts if name in t]
        if full in t and both:
            raise ValueError(f"both {full} and {', '.join(both)}: one form per half")
    if "lokr_w1" in t:
        up1, down1 = _full(t["lokr_w1"])
    else:
        up1, down1 = _pair(t["lokr_w1_a"], t["lokr_w1_b"])
    if "lokr_w2" in t:
        up2, down2 = _full(t["lokr_w2"].flatten(1))
    elif "lokr_t2" in t:
        up2, down2 = _tucker(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
    else:
        up2, down2 = _pair(t["lokr_w2_a"], t["lokr_w2_b"].flatten(1))
    # The dim of the first factorized half (A1111's and ComfyUI's rule); two full halves: scale 1.
    factorized = [t[key] for key in ("lokr_w1_b", "lokr_w2_b") if key in t]
    dim = factorized[0].shape[0] if factorized else None
    return _kron(up1, up2), _kron(down1, down2), dim


def _pair(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(up, down)``, two matrices whose product is defined."""
    if up.dim() != 2 or down.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ValueError(f"{tuple(up.shape)} and {tuple(down.shape)} do not multiply")
    return up, down


def _kron(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The Kronecker product of two matrices (``torch.kron`` fails on some strides of a 1-wide one)."""
    (rows1, columns1), (rows2, columns2) = first.shape, second.shape
    return (first[:, None, :, None] * second[None, :, None, :]).reshape(rows1 * rows2, columns1 * columns2)


def _full(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full matrix as up @ down, the identity on its smaller side."""
    if weight.dim() != 2:
        raise ValueError(f"a full half of shape {tuple(weight.shape)}")
    rows, columns = weight.shape
    if rows <= columns:
        return torch.eye(rows), weight
    return weight, torch.eye(columns)


def _capped(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair of the smaller rank: ``(up, down)``, or the delta beside an identity where its rank
    is over the layer's smaller side."""
    if up.shape[1] <= min(up.shape[0], down.shape[1]):
        return up, down
    return _full(up @ down)


def _with_kernels(pipeline: Any, converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converted state dict with each UNet convolution's pair in its layer's shapes: down a conv
    of the layer's kernel to the rank, up a 1x1 conv back. Raises ValueError where a pair does not
    fit its layer, naming both."""
    unet = getattr(pipeline, "unet", None)
    if unet is None:
        return converted
    text_encoders = {key: value for key, value in converted.items() if not key.startswith("unet.")}
    peft = convert_unet_state_dict_to_peft(
        {key[5:]: value for key, value in converted.items() if key.startswith("unet.")}
    )
    for key, down in list(peft.items()):
        match = _PEFT_DOWN.match(key)
        if match is None:
            continue
        try:
            layer = unet.get_submodule(match["module"])
        except AttributeError:
            raise ValueError(
                f"unet.{match['module']}: the UNet has no such layer (from the file's module names)"
            ) from None
        if isinstance(layer, BaseTunerLayer):  # a LoRA loaded before wrapped it
            layer = layer.get_base_layer()
        up_key = key.replace(".lora_A", ".lora_B")
        up = peft[up_key]
        weight = layer.weight
        if up.shape[0] != weight.shape[0] or down.shape[1] != weight[0].numel():
            raise ValueError(
                f"unet.{match['module']}: a delta of {up.shape[0]} x {down.shape[1]} does not fit the layer's "
                f"weight of {tuple(weight.shape)}"
            )
        if isinstance(layer, torch.nn.Conv2d):
            peft[key] = down.reshape(down.shape[0], *weight.shape[1:])
            peft[up_key] = up.reshape(*up.shape, 1, 1)
    return text_encoders | {f"unet.{key}": value for key, value in peft.items()}
