"""pagedllm.ops: the paged KV-cache and attention kernels, called with torch tensors.

Thin wrappers: each function makes :class:`pagedllm._C.TensorView` views of its torch tensors and
calls the native launcher (declared in ``cpp/include/pagedllm/attention.h`` and ``cache_ops.h``;
the fused layer ops of ``layer_ops.h`` are in :mod:`pagedllm.ops.layer_ops`),
which validates everything and dispatches to the CPU kernels or, for CUDA tensors, the CUDA ones
on ``torch.cuda.current_stream()``. Bad arguments raise ``ValueError`` naming the bad value.

KV cache layout (both devices), per layer: ``key_cache`` and ``value_cache`` each
``[num_blocks, num_kv_heads, block_size, head_size]``, contiguous; slot ``s`` is block
``s // block_size``, row ``s % block_size``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedllm import _C

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "supported_cache_dtypes",
    "fp8_query_dtypes",
    "kv_cache_shape",
    "allocate_kv_cache",
    "reshape_and_cache",
    "paged_attention",
    "paged_prefill_attention",
    "last_cuda_decode_plan",
    "copy_blocks",
    "swap_blocks",
    "set_num_threads",
    "set_cpu_threads",
    "get_num_threads",
    "layer_ops_supported",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "scaled_fp8_quant",
    "Fp8Rows",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "rotary_paired_order",
    "gate_up_paired_order",
    "argmax_rows",
    "fill_placeholder_ids",
    "amx_linear_supported",
    "amx_pack_linear_weight",
    "amx_linear",
    "amx_linear_silu_mul",
    "amx_linear_argmax",
    "int8_linear_vnni",
    "int8_activation_group",
    "int8_quantize_weight",
    "int8_pack_linear_weight",
    "int8_linear",
    "woq_linear_avx512",
    "woq_vnni_available",
    "woq_vnni_pack_weight",
    "woq_vnni_linear",
    "FP8_GEMV_MAX_TOKENS",
    "fp8_gemv",
    "int4_dequantize",
    "woq_pack_weight",
    "woq_linear",
    "GEMV_MAX_TOKENS",
    "gemv",
    "GemvRope",
    "gemv_supported",
    "gemv_fusion_fits",
    "pdl_enabled",
    "set_pdl_enabled",
]

#: Tokens per KV block the kernels support (the engine accepts exactly these).
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = tuple(_C.supported_block_sizes())
#: Attention head sizes the kernels support.
SUPPORTED_HEAD_SIZES: tuple[int, ...] = tuple(_C.supported_head_sizes())


def supported_cache_dtypes(device: str | torch.device = "cpu") -> tuple[torch.dtype, ...]:
    """KV-cache dtypes the kernels of ``device`` ('cpu' or 'cuda') implement (FP8 included)."""
    return tuple(getattr(torch, name) for name in _C.supported_cache_dtypes(torch.device(device).type))


def fp8_query_dtypes(device: str | torch.device = "cpu") -> tuple[torch.dtype, ...]:
    """Query / key / value dtypes (the model's compute dtype) the kernels of ``device`` take with an
    FP8 KV cache: float32 and bfloat16 on the CPU, bfloat16 and float16 on CUDA."""
    return tuple(getattr(torch, name) for name in _C.fp8_query_dtypes(torch.device(device).type))


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.int8: "int8",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


# pagedllm::DType codes (cpp/include/pagedllm/tensor_view.h), for TensorView.from_parts
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 3, torch.int64: 4,
                torch.uint8: 5, torch.int8: 6, torch.float8_e4m3fn: 7, torch.float8_e5m2: 8}


def _view(t: torch.Tensor) -> "_C.TensorView":
    # Called several times per kernel launch (~1.5 us on the dev VM against ~2.3 us through the generic
    # constructor): an integer dtype code, the shape and stride tuples as they are.
    code = _DTYPE_CODES.get(getattr(t, "dtype", None))
    if code is not None and isinstance(t, torch.Tensor):
        if t.is_cuda:
            return _C.TensorView.from_parts(t.data_ptr(), code, t.shape, t.stride(), True, t.get_device())
        if t.is_cpu:
            return _C.TensorView.from_parts(t.data_ptr(), code, t.shape, t.stride(), False, 0)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    # unsupported dtype or device: the generic constructor names it in its error
    dtype = _DTYPE_NAMES.get(t.dtype) or str(t.dtype)
    return _C.TensorView(t.data_ptr(), dtype, t.shape, t.stride(), t.device.type, t.device.index or 0)


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def set_num_threads(n: int) -> None:
    """Threads the CPU kernels use (n <= 0: all cores). Independent of torch's thread count."""
    _C.set_num_threads(int(n))


def set_cpu_threads(n: int) -> None:
    """Both torch's intra-op threads and the CPU kernels' threads to n (n >= 1): what --threads and
    each CPU worker process set."""
    torch.set_num_threads(int(n))
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads the CPU kernels use."""
    return _C.get_num_threads()


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
    """``(num_blocks, num_kv_heads, block_size, head_size)``: one layer's key (or value) cache.

    Raises ValueError for a non-positive size or an unsupported block / head size.
    """
    return tuple(_C.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-filled ``(key_cache, value_cache)`` of :func:`kv_cache_shape` for one layer.

    Raises ValueError for an unsupported size or a dtype the device's kernels lack (float16 on
    the CPU), listing the supported ones.
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    device = torch.device(device)
    supported = supported_cache_dtypes(device)
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(f"allocate_kv_cache: cache dtype {str(dtype).removeprefix('torch.')} is not "
                         f"supported on {device.type}; supported dtypes on {device.type}: {names}")
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))


def _scale_view(scale: torch.Tensor | None) -> "_C.TensorView | None":
    return None if scale is None else _view(scale)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (int64 ``[T]``,
    same device; a negative slot skips the token). FP8 caches (float8_e4m3fn / float8_e5m2) store
    ``key / k_scale`` and ``value / v_scale`` rounded to nearest-even and saturated to the format's
    largest finite value; ``k_scale`` / ``v_scale`` are float32 ``[1]`` tensors on the cache's
    device (None = 1.0), ignored for 16/32-bit caches."""
    _C.reshape_and_cache(_view(key), _view(value), _view(key_cache), _view(value_cache),
                         _view(slot_mapping), _stream(key_cache), _scale_view(k_scale), _scale_view(v_scale))


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, sliding_window: int | None = None, soft_cap: float | None = None,
                    split_k: int | None = None, workspace: torch.Tensor | None = None,
                    early_context_loads: bool = False, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Decode attention, one query per sequence, written into ``out`` ``[B, Hq, D]``.

    ``query`` ``[B, Hq, D]`` (the cache's dtype; with an FP8 cache one of
    :func:`fp8_query_dtypes`), ``block_tables`` int32 ``[B, M]``, ``seq_lens`` int32
    ``[B]`` (context length including the query's token). ``sliding_window``: attend to the last
    N tokens; ``soft_cap``: Gemma-2 logit soft-cap; ``split_k``: None/-1 auto, 0 single pass,
    k > 0 force a k-way flash-decoding split. ``workspace``: CUDA only, a contiguous tensor on the
    cache's device used as the split-K scratch when large enough (B * Hq * splits * (D + 2)
    floats; else the call allocates its own, as without it): no memory nodes in a captured graph.
    Keep it alive and use it from one stream. Ignored on the CPU. ValueError for a workspace on
    another device, not contiguous or not 16-byte aligned. ``early_context_loads``: CUDA only, a
    promise that the kernels still running on the stream write at most each sequence's last
    token of these caches (a decode step's KV-cache write just before, as in a model layer); the
    kernel then loads the rest of each context before waiting for the previous kernel
    (``AttentionOptions::early_context_loads``). Same results. ``k_scale`` / ``v_scale``: an FP8
    cache's float32 ``[1]`` scales on its device (None = 1.0; read when the kernel runs).
    """
    ws_ptr = ws_bytes = 0
    if workspace is not None and key_cache.is_cuda:
        if workspace.device != key_cache.device or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous tensor on {key_cache.device}, got "
                             f"{'a strided tensor' if workspace.device == key_cache.device else workspace.device}")
        if workspace.data_ptr() % 16:
            raise ValueError(f"workspace must start on a 16-byte boundary (the partials are read as float4), "
                             f"got address {workspace.data_ptr():#x}")
        ws_ptr, ws_bytes = workspace.data_ptr(), workspace.numel() * workspace.element_size()
    _C.paged_attention(_view(out), _view(query), _view(key_cache), _view(value_cache),
                       _view(block_tables), _view(seq_lens), float(scale),
                       int(sliding_window or 0), float(soft_cap or 0.0),
                       -1 if split_k is None else int(split_k), _stream(key_cache), ws_ptr, ws_bytes,
                       bool(early_context_loads), _scale_view(k_scale), _scale_view(v_scale))


def last_cuda_decode_plan() -> dict:
    """What this thread's last CUDA :func:`paged_attention` call ran (for tests and benchmarks):
    ``{'kernel': 'v2-warp' | 'v2-pair' | 'v2-cta' | 'v1' | 'fp32', 'splits': int,
    'combine': 'none' | 'kernel' | 'in-kernel'}`` — the decode kernel, its flash-decoding partitions
    per sequence and how they were combined (reduction kernel, or by the last partition inside the
    decode kernel). Empty strings before the first call (see ``pagedllm/attention.h``)."""
    return dict(_C.last_cuda_decode_plan())


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Varlen causal attention of query chunks (prefill, chunked prefill, mixed decode rows).

    ``query``/``out`` ``[T, Hq, D]``; ``query_start_loc`` int32 ``[B+1]``; ``seq_lens`` int32
    ``[B]`` is each context length including its chunk; row i of sequence b sits at position
    ``seq_lens[b] - q_len_b + i`` and sees positions up to its own. ``k_scale`` / ``v_scale``: as
    for :func:`paged_attention`.
    """
    _C.paged_prefill_attention(_view(out), _view(query), _view(key_cache), _view(value_cache),
                               _view(block_tables), _view(seq_lens), _view(query_start_loc),
                               float(scale), int(sliding_window or 0), float(soft_cap or 0.0),
                               _stream(key_cache), _scale_view(k_scale), _scale_view(v_scale))


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: copy block ``src`` to ``dst`` for each row of ``block_mapping`` (int64
    ``[C, 2]`` on the caches' device) in every layer's key and value cache."""
    stream = _stream(key_caches[0]) if len(key_caches) else 0
    _C.copy_blocks([_view(k) for k in key_caches], [_view(v) for v in value_caches],
                   _view(block_mapping), stream)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between caches, e.g. GPU -> CPU (swap out) or back; ``block_mapping`` int64
    ``[C, 2]`` of (src_block, dst_block) on the CPU."""
    stream = _stream(src) if src.is_cuda else _stream(dst)
    _C.swap_blocks(_view(src), _view(dst), _view(block_mapping), stream)


from pagedllm.ops.layer_ops import (  # noqa: E402  (uses _view above)
    fused_add_rms_norm,
    gate_up_paired_order,
    layer_ops_supported,
    rms_norm,
    rotary_embedding,
    rotary_embedding_and_cache,
    rotary_paired_order,
    Fp8Rows,
    scaled_fp8_quant,
    silu_and_mul,
)
from pagedllm.ops.sampling_ops import argmax_rows, fill_placeholder_ids  # noqa: E402
from pagedllm.ops.cpu_linear import (  # noqa: E402
    amx_linear,
    amx_linear_argmax,
    amx_linear_silu_mul,
    amx_linear_supported,
    amx_pack_linear_weight,
)
from pagedllm.ops.quant_linear import (  # noqa: E402
    int8_activation_group,
    int8_linear,
    int8_linear_vnni,
    int8_pack_linear_weight,
    int8_quantize_weight,
)
from pagedllm.ops.woq_linear import (  # noqa: E402
    woq_linear,
    woq_linear_avx512,
    woq_pack_weight,
    woq_vnni_available,
    woq_vnni_linear,
    woq_vnni_pack_weight,
)
from pagedllm.ops.quant_ops import FP8_GEMV_MAX_TOKENS, fp8_gemv, int4_dequantize  # noqa: E402
from pagedllm.ops.gemv import (  # noqa: E402
    GEMV_MAX_TOKENS,
    GemvRope,
    gemv,
    gemv_fusion_fits,
    gemv_supported,
    pdl_enabled,
    set_pdl_enabled,
)
