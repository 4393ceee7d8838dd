"""quantization="gguf": a GGUF file's quantized projections computed in their own types.

The decoder projections stored as Q8_0, Q4_0, Q4_1, Q4_K or Q6_K are converted exactly (no
rounding: every value scale * code + min below is the float32 the format's reference dequantizer
gives, ggml's dequantize_row_* as the ``gguf`` package's quants.py implements it) to a
QuantizedWeight (woq.py) and computed by the CPU's weight-only kernel. Everything else (the
embedding, the norms, the LM head, projections in F32/F16/BF16 or another quantized type) comes
from the dequantized Hugging Face folder that loader.convert_gguf writes, as without
quantization="gguf". Block layouts (ggml-common.h, QK_K = 256):

- Q8_0, 32 values, 34 bytes: d (fp16), qs int8[32]; w = d * q.
- Q4_0, 32 values, 18 bytes: d, qs[16]: value j < 16 is qs[j] & 15, value 16 + j is qs[j] >> 4; w = d * (q - 8).
- Q4_1, 32 values, 20 bytes: d, m (fp16), qs[16] as Q4_0; w = d * q + m.
- Q4_K, 256 values, 144 bytes: d, dmin (fp16), scales[12] (eight 6-bit scales sc_j and mins m_j),
  qs[128]: values 64 c + l (l < 32) are qs[32 c + l] & 15 (sub-block 2 c), 64 c + 32 + l its high
  nibble (sub-block 2 c + 1); w = d sc_j * q - dmin m_j.
- Q6_K, 256 values, 210 bytes: ql[128], qh[64], scales int8[16], d (fp16); 6-bit q - 32 per value,
  w = d sc_j * (q - 32) for the 16 sub-blocks of 16.

llama.cpp's converter permutes the rows of LLaMA's q and k projections (rotary pairs interleaved);
they are permuted back here, as transformers does for the dequantized folder.
"""

from __future__ import annotations

import json
import logging
import os
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.layers.linear_method import LinearMethodBase
from pagedllm.model_executor.quantization.base import QuantizationConfig
from pagedllm.model_executor.quantization.woq import QuantizedWeight, load_layer
from pagedllm.model_executor.quantization.woq_cuda import tinygemm_applies, woq_method_for

logger = logging.getLogger("pagedllm")

QK_K = 256


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """uint8 [n, chunks * 2 * span] of qs [n, chunks * span]: per chunk the low nibbles, then the high."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q8_0(b):
    return b[:, 2:].copy().view(np.int8), 32, _f16(b, 0), None


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:], 16), 32, d, -8.0 * d


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), 32, _f16(b, 0), _f16(b, 2)


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc12 = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mix = sc12[:, 0], sc12[:, 1], sc12[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return _nibbles(b[:, 16:], 32), 32, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b, 208)
    low = _nibbles(ql, 64).reshape(n, -1, 32)  # [n, 8, 32]: per half of 128 values, 4 runs of 32
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = (low | (high.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n, QK_K), 16, d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32), None


#: GGML type name -> (values per block, bytes per block, decoder of blocks [n, bytes] ->
#: (codes [n, values], group, scale [n, values / group], min or None))
GGUF_DECODERS = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q6_K": (QK_K, 210, _q6_k),
}
SUPPORTED_GGUF_TYPES = tuple(GGUF_DECODERS)


def decode_gguf(type_name: str, data: np.ndarray, in_features: int) -> QuantizedWeight:
    """The QuantizedWeight of a GGUF tensor of type `type_name` with `in_features` values per row,
    its raw bytes `data` uint8 [out_features, bytes per row] (gguf.GGUFReader's tensor.data).
    ValueError for another type or a row length that is not whole blocks."""
    if type_name not in GGUF_DECODERS:
        raise ValueError(f"GGUF type {type_name} is not computed natively: supported {list(SUPPORTED_GGUF_TYPES)}")
    values, nbytes, decode = GGUF_DECODERS[type_name]
    rows = data.shape[0]
    if in_features % values or data.size != rows * in_features // values * nbytes:
        raise ValueError(f"GGUF {type_name} tensor of {rows} rows x {in_features} values: {data.size} bytes is not "
                         f"whole blocks of {values} values / {nbytes} bytes")
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, nbytes)
    codes, group, scale, mn = decode(blocks)
    bits = 8 if codes.dtype == np.int8 else 4
    g = in_features // group
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, in_features)), bits, group,
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, g)),
        None if mn is None else torch.from_numpy(np.ascontiguousarray(mn, dtype=np.float32).reshape(rows, g)),
        type_name)


def unpermute_rows(qw: QuantizedWeight, n_head: int) -> QuantizedWeight:
    """Undo llama.cpp's q/k row permutation (per head: row 2 i + j <- row j D/2 + i of HF's order)."""
    rows = qw.shape[0]
    d = rows // n_head
    order = torch.arange(rows).view(n_head, d // 2, 2).transpose(1, 2).reshape(-1)
    # gguf row order[r] holds HF row r
    take = lambda t: None if t is None else t.index_select(0, order).contiguous()  # noqa: E731
    return QuantizedWeight(take(qw.codes), qw.bits, qw.group_size, take(qw.scale), take(qw.min), qw.source)


_INDEX_VERSION = 1


class _GGUFTensor:
    """A tensor of the file, as gguf.GGUFReader's ReaderTensor gives it: tensor_type, shape (GGML
    order: shape[0] is the row length), and data — its bytes as uint8 [rows, bytes per row], a
    read-only memory map."""

    def __init__(self, file: Path, name: str, type_name: str, shape: list, offset: int, n_bytes: int):
        import gguf

        self.file, self.name, self.offset, self.n_bytes = file, name, offset, n_bytes
        self.tensor_type = gguf.GGMLQuantizationType[type_name]
        self.shape = np.array(shape, dtype=np.uint64)

    @property
    def data(self) -> np.ndarray:
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        return np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.offset, shape=(rows, self.n_bytes // rows))


#: our projection -> GGUF tensor names of its parts (shard ids in order)
_GGUF_PARTS = {
    "qkv_proj": (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")),
    "o_proj": ((None, "attn_output"),),
    "gate_up_proj": ((0, "ffn_gate"), (1, "ffn_up")),
    "down_proj": ((None, "ffn_down"),),
}


class GGUFConfig(QuantizationConfig):
    """quantization="gguf" over `gguf_file` (module docstring)."""

    name = "gguf"

    def __init__(self, gguf_file: Optional[Path]):
        if gguf_file is None:
            raise ValueError('quantization="gguf" needs a GGUF model: pass model=<file>.gguf (or a folder holding '
                             'one, or the bundled default model)')
        self.gguf_file = Path(gguf_file)
        self.types: dict[str, int] = {}

    @cached_property
    def _index(self) -> dict:
        """{"architecture", "tensors": {name: [GGML type name, dims, data offset, bytes]}} of the
        file: gguf.GGUFReader's (which parses every metadata field: ~6 s for the bundled file's
        49k-token vocabulary), kept as JSON in the conversion cache (keyed by the file's content,
        loader.gguf_cache_key) so that later start-ups read it in milliseconds."""
        from pagedllm.model_executor.loader import cache_root, gguf_cache_key

        path = cache_root() / "gguf" / f"{self.gguf_file.stem}-{gguf_cache_key(self.gguf_file)}.tensors.json"
        try:
            data = json.loads(path.read_text())
            if data.get("version") == _INDEX_VERSION:
                return data
        except (OSError, ValueError):
            pass
        import gguf

        reader = gguf.GGUFReader(str(self.gguf_file))
        field = reader.fields.get("general.architecture")
        data = {"version": _INDEX_VERSION, "architecture": str(field.contents()) if field is not None else "",
                "tensors": {t.name: [t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)]
                            for t in reader.tensors}}
        try:  # a cache, not a requirement: a read-only cache folder only costs the next start-up
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)
        except OSError:
            pass
        return data

    @cached_property
    def _tensors(self) -> dict:
        return {name: _GGUFTensor(self.gguf_file, name, *info) for name, info in self._index["tensors"].items()}

    @cached_property
    def architecture(self) -> str:
        return self._index["architecture"]

    def linear_method(self, layer: nn.Module, prefix: str = "") -> Optional[LinearMethodBase]:
        """WoqLinearMethod of the projection `prefix` ("layers.<i>.<qkv_proj|o_proj|gate_up_proj|down_proj>"),
        or None (keep the dequantized weight) when a part is not in a supported quantized type."""
        index, _, proj = prefix.removeprefix("layers.").partition(".")
        if proj not in _GGUF_PARTS:
            raise ValueError(f"GGUFConfig: no GGUF tensors for the projection {prefix!r}")
        parts = {}
        for shard, gname in _GGUF_PARTS[proj]:
            name = f"blk.{index}.{gname}.weight"
            t = self._tensors.get(name)
            if t is None:
                raise ValueError(f"{self.gguf_file}: has no tensor {name}")
            kind = t.tensor_type.name
            if kind not in GGUF_DECODERS:
                self.types[kind] = self.types.get(kind, 0) + 1
                logger.warning("GGUF %s is %s, which pagedllm does not compute natively (%s): %s keeps its "
                               "dequantized weight", name, kind, ", ".join(SUPPORTED_GGUF_TYPES), prefix)
                return None
            qw = decode_gguf(kind, t.data, int(t.shape[0]))
            if self.architecture == "llama" and shard in ("q", "k"):
                heads = layer.total_num_heads if shard == "q" else layer.total_num_kv_heads
                qw = unpermute_rows(qw, heads)
            self.types[kind] = self.types.get(kind, 0) + 1
            parts[shard] = qw
        qw = load_layer(layer, parts, f"GGUF {prefix}")
        if layer.weight is not None and layer.weight.is_cuda and not tinygemm_applies(qw):
            logger.warning("GGUF %s: %s (%d-bit codes in groups of %d) has no CUDA kernel (4-bit only): it keeps its "
                           "dequantized weight", prefix, qw.source, qw.bits, qw.group_size)
            return None
        return woq_method_for(layer, qw, f"GGUF {prefix}")

    def describe(self) -> str:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.types.items()))
        return f"gguf ({self.gguf_file.name}: projection parts {kinds or 'not read yet'}; weight-only CPU kernel)"
