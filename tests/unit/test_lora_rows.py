"""Per-row LoRA sets in one forward (``handler.adapters.lora_rows``) on PEFT's own LoRA layers, Linear and
strided Conv2d: every row equals PEFT's ``set_adapters`` path run on that row alone with
its set, in both designs; a forward without LoRA (or with LoRAs at scale 0) is the base forward;
the stacked weights stay bounded and go with their adapters; what the row path cannot serve is
named."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from handler.adapters.lora_rows import STACKS_PER_LAYER, RowLoras, RowPlan

ADAPTERS = {  # name: (config, layers)
    "a": (dict(r=2, lora_alpha=4), ["linear", "conv"]),
    "b": (dict(r=3, lora_alpha=3, use_rslora=True), ["linear", "conv"]),
    "c": (dict(r=4, lora_alpha=2), ["linear"]),
}
SETS = [(), (("a", 1.0),), (("b", 0.5), ("a", -0.7)), (("c", 1.2),), (("a", 0.3), ("b", 1.0), ("c", 0.4))]


class Layers(torch.nn.Module):
    """A Linear on tokens and a strided, padded 3x3 Conv2d on an image, as a denoiser holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(12, 10)
        self.conv = torch.nn.Conv2d(3, 6, 3, stride=2, padding=1)

    def forward(self, tokens: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(tokens), self.conv(image)


@pytest.fixture
def model() -> Layers:
    torch.manual_seed(0)
    model = Layers().double()
    for name, (config, targets) in ADAPTERS.items():
        lora = LoraConfig(target_modules=targets, init_lora_weights=False, **config)
        inject_adapter_in_model(lora, model, adapter_name=name)
    return model.double().eval()


def peft_alone(model: Layers, adapters, tokens, image):
    """PEFT's own path for one set: ``set_adapters`` as diffusers does it (active adapters, their
    weights as ``set_scale``)."""
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            present = [name for name, _ in adapters if name in layer.lora_A]
            layer.enable_adapters(bool(present))
            if present:
                layer.set_adapter(present)
                for name, weight in adapters:
                    layer.set_scale(name, weight)
    return model(tokens, image)


def inputs(rows: int):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(rows, 5, 12, generator=generator, dtype=torch.float64)
    image = torch.randn(rows, 3, 9, 9, generator=generator, dtype=torch.float64)
    return tokens, image


@pytest.mark.parametrize("strategy", ["segments", "stacked", "auto"])
def test_each_row_gets_exactly_its_own_set(model, strategy):
    rows_per_set = [2, 1, 3, 2, 1]  # as jobs hold rows: images, doubled with guidance
    tokens, image = inputs(sum(rows_per_set))
    expected = [
        peft_alone(model, adapters, tokens[start : start + count], image[start : start + count])
        for adapters, count, start in zip(SETS, rows_per_set, [0, 2, 3, 6, 8], strict=True)
    ]
    row_loras = RowLoras(model, strategy)
    row_loras.attach()
    row_loras.switch_off()
    with row_loras.rows(list(zip(SETS, rows_per_set, strict=True)), torch.device("cpu")):
        outputs = model(tokens, image)
    for index, wanted in enumerate(expected):
        start = sum(rows_per_set[:index])
        rows = slice(start, start + rows_per_set[index])
        for output, want in zip(outputs, wanted, strict=True):
            torch.testing.assert_close(output[rows], want, rtol=1e-5, atol=1e-6)  # weights in float32


@pytest.mark.parametrize("sets", [[((), 3)], [((("a", 0.0),), 1), ((("b", 0.0), ("a", 0.0)), 2)]])
def test_a_forward_without_lora_or_at_scale_0_is_the_base_forward(model, sets):
    tokens, image = inputs(3)
    row_loras = RowLoras(model)
    row_loras.attach()
    row_loras.switch_off()
    base = (model.linear.base_layer(tokens), model.conv.base_layer(image))
    with row_loras.rows(sets, torch.device("cpu")) as plan:
        assert plan is None
        ours = model(tokens, image)
    assert all(torch.equal(got, want) for got, want in zip(ours, base, strict=True))


def test_an_adapter_at_scale_0_is_left_out_of_the_plan():
    plan = RowPlan.of([((("a", 0.0), ("b", 1.0)), 2), ((("a", 0.0),), 1)], torch.device("cpu"))
    assert plan is not None and plan.adapters == ("b",) and plan.members["b"][0] == slice(0, 2)


def test_the_plan_weights_rows_keeps_uniform_adapters_scalar_and_blocks_as_views():
    plan = RowPlan.of([((("a", 1.0),), 2), ((("b", 0.5), ("a", 1.0)), 2), ((), 1)], torch.device("cpu"))
    assert plan is not None and plan.adapters == ("a", "b") and plan.rows == 5
    assert plan.weights.tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.5], [1.0, 0.5], [0.0, 0.0]]
    assert plan.uniform == {} and plan.members["a"][0] == slice(0, 4)
    assert plan.members["b"][0] == slice(2, 4) and plan.members["b"][1].tolist() == [0.5, 0.5]
    scattered = RowPlan.of([((("a", 1.0),), 2), ((("b", 1.0),), 1), ((("a", 0.5),), 1)], torch.device("cpu"))
    assert scattered is not None and scattered.members["a"][0].tolist() == [0, 1, 3]  # type: ignore[union-attr]
    everywhere = RowPlan.of([((("a", 0.8),), 4)], torch.device("cpu"))
    assert everywhere is not None and everywhere.uniform == {"a": 0.8} and everywhere.members == {}
    ranks = plan.rank_weights(("b", "a"), (1, 2), torch.float32)
    assert ranks.tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 1.0, 1.0], [0.5, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_a_layer_given_other_rows_than_the_forward_fails_loudly(model):
    tokens, image = inputs(3)
    row_loras = RowLoras(model)
    row_loras.attach()
    with row_loras.rows([((("a", 1.0),), 2)], torch.device("cpu")), pytest.raises(RuntimeError, match="3 rows"):
        model(tokens, image)


def test_stacked_weights_are_bounded_and_go_with_their_adapters(model):
    row_loras = RowLoras(model, "stacked")
    row_loras.attach()
    tokens, image = inputs(2)
    for weight in range(STACKS_PER_LAYER + 3):  # more adapter combinations than a layer keeps
        extra = f"extra{weight}"
        inject_adapter_in_model(LoraConfig(r=1, target_modules=["linear"]), model, adapter_name=extra)
        with row_loras.rows([((("a", 1.0),), 1), (((extra, 1.0),), 1)], torch.device("cpu")):
            model(tokens, image)
    stacks = row_loras._stacks[id(model.linear)]
    assert len(stacks) == STACKS_PER_LAYER
    row_loras.forget("a")
    assert not any("a" in key for layer in row_loras._stacks.values() for key in layer)


def test_what_the_row_path_cannot_serve_is_named(model):
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["linear"], use_dora=True), model, adapter_name="dora")
    model.grouped = torch.nn.Conv2d(4, 4, 3, groups=2).double()  # PEFT groups its B
    model.dilated = torch.nn.Conv2d(3, 4, 3, padding=2, dilation=2).double()  # PEFT's A is not dilated
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["grouped"]), model, adapter_name="grouped")
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["dilated"]), model, adapter_name="dilated")
    row_loras = RowLoras(model)
    row_loras.attach()
    assert "DoraLinearVariant adapters (on linear) are not served" in (row_loras.unsupported("dora") or "")
    assert "a LoRA on grouped (Conv2d(4, 4, kernel_size=(3, 3), stride=(1, 1), groups=2)) is not served" == (
        row_loras.unsupported("grouped")
    )
    assert "a LoRA on dilated (Conv2d(3, 4, kernel_size=(3, 3)" in (row_loras.unsupported("dilated") or "")
    assert row_loras.unsupported("a") is None


@pytest.mark.parametrize(
    ("sets", "design"), [([((("a", 0.8),), 3)], "stacked"), ([((("a", 0.8),), 2), ((), 1)], "segments")]
)
def test_auto_stacks_one_adapter_on_every_row_and_not_on_some(model, sets, design):
    """One adapter held by every row costs no extra arithmetic stacked (and its weight then scales
    A's output, not B's); held by some rows only, stacking would compute it on the others too."""
    tokens, image = inputs(3)
    row_loras = RowLoras(model)
    row_loras.attach()
    row_loras.switch_off()
    with row_loras.rows(sets, torch.device("cpu")):
        model(tokens, image)
    assert dict(row_loras.designs) == {design: 2}
