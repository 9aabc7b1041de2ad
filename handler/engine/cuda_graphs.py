"""The ``cudagraphs`` compile backend (``compile.backend``): dynamo traces the denoiser, AOT autograd
makes its functional ATen graph, and torch's cudagraph trees record that graph, eager's own
kernels, and replay it as CUDA graphs, as they do inductor's generated code in ``reduce-overhead``.

Adapted from torch 2.13's ``torch._dynamo.backends.cudagraphs.cudagraphs`` (inference only), with
what inductor's own path does instead (``torch._inductor.compile_fx``: ``cudagraphify``,
``get_static_input_idxs``):

- A graph is recorded from its real calls, once per concrete value of its dynamic sizes (cudagraph
  trees warm it up at its first call and record it at its second). dynamo's backend records from
  the example inputs, where a dynamic size is a SymInt and not an int, so every row count would
  replay the graph recorded for the first (pytorch/pytorch#131009).
- What dynamo marks static is a static input: the module's parameters and buffers, and the tensors
  it reads off its modules (so those must stay in place: ``SlotLoras.rows``). dynamo's backend counts
  none once modules are inlined (torch's default), so every weight would be copied into the graph's
  pool and again at each replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.cudagraphs import (
    check_for_skip,
    find_input_mutations,
    get_device_index,
    get_stack_traces,
)
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import cudagraphify, get_static_input_idxs
from torch._inductor.cudagraph_utils import get_placeholder_info, log_cudagraph_skip_and_bump_counter
from torch._inductor.utils import num_fw_fixed_arguments


def eager_kernels_in_cuda_graphs(model: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """A ``torch.compile`` backend: ``model``'s ATen graph, recorded as CUDA graphs for each size it
    is called at (off CUDA, or where a graph cannot be recorded, run as it is; torch logs why)."""

    def recorded(aot_model: torch.fx.GraphModule, aot_inputs: list[Any]) -> Callable[..., Any]:
        run = boxed_nop(aot_model, aot_inputs)
        fixed = num_fw_fixed_arguments(len(example_inputs), len(aot_inputs))
        with inductor_config.patch(graph_partition=False):  # else an operation on the CPU is not a skip
            skip = check_for_skip(aot_model, fixed)
        if skip:
            log_cudagraph_skip_and_bump_counter(skip)  # "skipping cudagraphs due to ..."
            return run
        replay = cudagraphify(
            run,
            get_static_input_idxs(fixed),
            device_index=get_device_index(aot_model),
            stack_traces=get_stack_traces(aot_model),
            is_backward=False,
            is_inference=True,
            placeholders=get_placeholder_info(aot_model.graph),
            mutated_input_idxs=tuple(find_input_mutations(aot_model.graph)),
        )
        replay._boxed_call = True  # type: ignore[attr-defined]
        return replay

    compile_ = aot_autograd(
        fw_compiler=recorded,
        inference_compiler=recorded,
        keep_inference_input_mutations=torch._dynamo.config.cudagraph_backend_keep_input_mutation,
    )
    return compile_(model, example_inputs)
