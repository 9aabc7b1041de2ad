"""The ``cudagraphs`` compile backend (``handler.engine.cuda_graphs``) on the CPU, where torch records
no CUDA graph: with the recording stood in for (``cudagraph_trees.cudagraphify``, the function that
records one graph) and the CUDA checks passed, a graph whose rows are marked dynamic is recorded
once per row count at its first call of that count, with the module's parameters as static inputs,
and replays it for the same count; the worker's warm-up warns, per shape, of the graphs that run
without CUDA graphs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor import cudagraph_trees

from handler.adapters.lora_slots import SlotRows, SlotState
from handler.config import HandlerSettings, WarmupShape
from handler.engine import cuda_graphs
from handler.service import loops
from server.paths import DEFAULT_MODEL_DIR


@pytest.fixture
def recordings(monkeypatch) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(rows, static input indices, parameter indices) of each graph recorded; each records by
    running the graph as it is."""
    recorded = []

    def record(model, inputs, static_input_idxs=(), **_):
        tensors = [value for value in inputs if isinstance(value, torch.Tensor)]
        rows = next(value.shape[0] for value in tensors if not isinstance(value, torch.nn.Parameter))
        parameters = tuple(index for index, value in enumerate(inputs) if isinstance(value, torch.nn.Parameter))
        recorded.append((rows, tuple(static_input_idxs), parameters))
        return model, model(list(inputs))

    monkeypatch.setattr(cudagraph_trees, "cudagraphify", record)
    monkeypatch.setattr(cuda_graphs, "check_for_skip", lambda *_: None)  # a CPU graph: recorded all the same
    monkeypatch.setattr(cuda_graphs, "get_device_index", lambda _: 0)
    torch._dynamo.reset()
    yield recorded
    torch._dynamo.reset()


class Planned(torch.nn.Module):
    """Two linear layers and a per-row scale read off the module, as LoRA slot layers read their plan."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
        self.state = SlotState()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        assert self.state.rows is not None
        return self.layers(latents) * self.state.rows.weights


def test_a_graph_is_recorded_once_per_row_count_with_what_it_reads_off_modules_static(recordings):
    module = Planned().requires_grad_(False)
    compiled = torch.compile(module, backend=cuda_graphs.eager_kernels_in_cuda_graphs)
    with torch.inference_mode():
        for rows in (2, 4, 8, 4, 2):
            latents = torch.randn(rows, 4)
            module.state.rows = SlotRows(None, torch.rand(rows, 1))
            for tensor in (latents, module.state.rows.weights):  # as the step engine marks the denoiser's rows
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            assert torch.equal(compiled(latents), module(latents)), rows
    assert [rows for rows, _, _ in recordings] == [2, 4, 8], "one recording per row count, replayed after"
    for _, static, parameters in recordings:
        # the weights and the plan: read where recorded, not copied at each replay (so a plan must stay in place)
        assert len(parameters) == 4 and len(static) == 5 and set(parameters) <= set(static)


@pytest.mark.parametrize("replays", [True, False])
def test_warm_up_warns_of_each_shapes_graphs_run_without_cuda_graphs(replays, monkeypatch, caplog):
    """The count of graphs torch ran without CUDA graphs is the process's: a shape reports its own
    (none: no warning), and an engine that replays no CUDA graphs warns of none."""
    settings = HandlerSettings.model_validate(
        {"model_path": str(DEFAULT_MODEL_DIR), "max_images_per_call": 1, "limits": {"max_images_per_request": 1}}
    )
    service, _ = loops.build_service(settings, "/unused", lambda *_: None)
    service.engine.cuda_graphs = replays  # the default model's eager engine, as if it replayed them
    counts = iter([0, 2, 2, 2, 2, 5])  # before and after each of three shapes
    monkeypatch.setattr(loops, "cuda_graph_skips", lambda: next(counts))
    with caplog.at_level(logging.WARNING, logger=loops.__name__):
        service.warm_up(tuple(WarmupShape(width=64, height=side) for side in (64, 72, 80)))
    warnings = [record.getMessage() for record in caplog.records if "without CUDA graphs" in record.getMessage()]
    assert [warning.split(", each")[0] for warning in warnings] == (
        [
            "warm-up 64x64: 2 compiled graphs run without CUDA graphs",
            "warm-up 64x80: 3 compiled graphs run without CUDA graphs",
        ]
        if replays
        else []
    )
