"""LyCORIS LoHa and LoKr modules as exact LoRA pairs (``handler.adapters.lycoris``): for every
layout the ``lycoris-lora`` package trains (linear, 3x3 and 1x1 convolutions; Tucker halves; LoKr's
full, decomposed and both-decomposed halves; alphas absent, below and above the dim), ``up @ down``
equals the delta its own module adds in its forward; the pair's rank is the factors' product,
capped at the layer's smaller side; what is not a LoHa, LoKr or LoRA module is refused naming the
module, and no file of random shapes raises anything else."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from handler.adapters.lycoris import factors, holds_lycoris

logging.getLogger("LyCORIS").setLevel(logging.ERROR)

LAYERS = {
    "linear": lambda: torch.nn.Linear(16, 24),
    "conv3x3": lambda: torch.nn.Conv2d(8, 12, 3, padding=1),
    "conv1x1": lambda: torch.nn.Conv2d(8, 12, 1),
}
OPTIONS = {
    "loha": [{}, {"use_tucker": True}],
    "lokr": [
        {},
        {"decompose_both": True},
        {"use_tucker": True},
        {"decompose_both": True, "use_tucker": True},
        {"full_matrix": True},
        {"factor": 4},
    ],
}
CASES = [
    (algo, options, layer, dim, alpha)
    for algo, choices in OPTIONS.items()
    for options, layer, dim, alpha in itertools.product(choices, LAYERS, (1, 2, 6), (0.0, 1.0, 3.0))
]


def trained(algo: str, layer: torch.nn.Module, dim: int, alpha: float, **options):
    """A module as the lycoris-lora package trains it, its parameters random (it starts one half at 0)."""
    from lycoris.modules.loha import LohaModule
    from lycoris.modules.lokr import LokrModule

    module = (LohaModule if algo == "loha" else LokrModule)("m", layer, 1.0, dim, alpha, **options)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if not name.startswith("org_"):
                parameter.normal_()
    return module


@pytest.mark.parametrize(("algo", "options", "layer", "dim", "alpha"), CASES)
def test_the_pair_multiplies_to_the_delta_lycoris_adds(algo, options, layer, dim, alpha):
    torch.manual_seed(0)
    base = LAYERS[layer]()
    module = trained(algo, base, dim, alpha, **options)
    parameters = {name: value.detach() for name, value in module.custom_state_dict().items()}
    assert holds_lycoris({f"lora_unet_m.{name}": value for name, value in parameters.items()})
    up, down = factors("lora_unet_m", parameters)
    delta = module.get_weight(base.weight.shape).detach()  # what its forward adds at multiplier 1
    torch.testing.assert_close((up @ down).reshape(base.weight.shape), delta, rtol=1e-5, atol=1e-5 * delta.abs().max())
    assert up.shape[1] <= min(base.weight.shape[0], base.weight[0].numel())


def test_the_rank_is_the_factors_product_capped_at_the_smaller_side():
    torch.manual_seed(0)
    small = {
        name: value.detach()
        for name, value in trained("loha", torch.nn.Linear(64, 48), 3, 1.0).custom_state_dict().items()
    }
    assert factors("m", small)[0].shape == (48, 9)  # dim x dim
    large = {
        name: value.detach()
        for name, value in trained("loha", torch.nn.Linear(64, 48), 8, 1.0).custom_state_dict().items()
    }
    up, down = factors("m", large)
    assert up.shape == (48, 48) and torch.equal(up, torch.eye(48))  # 64 > 48: the delta beside an identity


def test_a_plain_lora_module_in_a_lycoris_file_keeps_its_scale():
    up, down = torch.randn(24, 4), torch.randn(4, 16)
    got_up, got_down = factors("m", {"lora_up.weight": up, "lora_down.weight": down, "alpha": torch.tensor(2.0)})
    torch.testing.assert_close(got_up @ got_down, up @ down * 0.5)


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"hada_w1_a": torch.ones(4, 2), "dora_scale": torch.ones(4, 1)}, "DoRA"),
        ({"oft_blocks": torch.ones(2, 2, 2)}, "OFT"),
        (
            {
                "lora_up.weight": torch.ones(4, 2),
                "lora_down.weight": torch.ones(2, 3),
                "lora_mid.weight": torch.ones(2, 2),
            },
            "lora_mid",
        ),
        ({"hada_w1_a": torch.ones(4, 2), "lokr_w1": torch.ones(2, 2)}, "no LoRA, LoHa or LoKr module"),
        (
            {"hada_w1_a": torch.ones(4, 2), "hada_w1_b": torch.ones(2, 3), "hada_w2_a": torch.ones(4, 2)},
            "without hada_w2_b",
        ),
        ({name: torch.ones(4, 2) for name in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}, "do not fit"),
        (
            {"lokr_w1": torch.ones(2, 2), "lokr_w1_b": torch.ones(1, 2), "lokr_w2": torch.ones(2, 2)},
            "one form per half",
        ),
        (
            {
                "lora_up.weight": torch.ones(4, 2),
                "lora_down.weight": torch.ones(2, 3),
                "alpha": torch.tensor(float("nan")),
            },
            "finite",
        ),
        (
            {"lora_up.weight": torch.ones(4, 2), "lora_down.weight": torch.ones(2, 3), "alpha": torch.ones(2)},
            "one number",
        ),
    ],
)
def test_what_is_no_lora_loha_or_lokr_module_is_refused_naming_it(parameters, says):
    with pytest.raises(ValueError, match=says) as refused:
        factors("lora_unet_mid_block_attentions_0_proj_in", parameters)
    assert "lora_unet_mid_block_attentions_0_proj_in" in str(refused.value)


def test_kohya_files_with_lycoris_modules_are_told_from_plain_loras():
    assert holds_lycoris({"lora_unet_x.hada_w1_a": torch.ones(1)})
    assert holds_lycoris({"lora_te_x.oft_blocks": torch.ones(1)})  # refused by name, not by diffusers' converter
    assert not holds_lycoris({"lora_unet_x.lora_down.weight": torch.ones(1), "lora_unet_x.dora_scale": torch.ones(1)})
    assert not holds_lycoris({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.ones(1)})


NAMES = [
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "hada_t1",
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w2",
    "lokr_w2_b",
    "lokr_t2",
    "alpha",
]


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(NAMES),
        st.lists(st.integers(1, 5), min_size=0, max_size=4),
        min_size=1,
    )
)
def test_random_shapes_are_refused_or_factored_never_another_error(shapes):
    parameters = {name: torch.ones(shape) for name, shape in shapes.items()}
    try:
        up, down = factors("m", parameters)
    except ValueError as refused:
        assert str(refused).startswith("m: ")
    else:
        assert up.dim() == 2 and down.dim() == 2 and up.shape[1] == down.shape[0]
