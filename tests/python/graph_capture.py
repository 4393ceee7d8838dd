"""CUDA-graph capture for the kernel tests: one warm-up call and the capture, both on a side stream."""

from __future__ import annotations

import torch

import pagedllm.ops as ops


def capture_graph(fn, pdl: bool | None = None):
    """Runs fn() once on a side stream (warm-up: lazy init, kernel attributes), then captures a
    second call in a torch.cuda.CUDAGraph on that stream, with programmatic dependent launch set
    to `pdl` meanwhile (None: left as it is; restored afterwards). The current stream waits for
    the side stream before and after. Returns (graph, what the captured call returned)."""
    was = ops.pdl_enabled()
    if pdl is not None:
        ops.set_pdl_enabled(pdl)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = fn()
        torch.cuda.current_stream().wait_stream(stream)
    finally:
        ops.set_pdl_enabled(was)
    return graph, out
