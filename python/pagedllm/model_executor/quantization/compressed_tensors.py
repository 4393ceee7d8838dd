"""compressed-tensors checkpoints (config.json ``quantization_config.quant_method ==
"compressed-tensors"``, as llm-compressor writes them) with integer weight-only schemes on the
CPU: each decoder projection's weight converted exactly to a QuantizedWeight (woq.py) and computed
by the weight-only kernel.

Layouts of one linear module of N outputs and K inputs (the ``compressed-tensors`` package,
compressors/pack_quantized and compressors/naive_quantized; its ``decompress`` is the reference),
b = num_bits, G scale columns (strategy "group": K / group_size; "channel": 1; "tensor": a single
scale):

- "pack-quantized" (W4A16, W8A16): ``weight_packed`` int32 [N, K * b / 32], the signed codes q in
  [-2^(b-1), 2^(b-1)) stored as q + 2^(b-1), packed along K low bits first (value j of a word at
  bits j * b: for b = 4 and 8 the package's dense packing, and its older per-word packing, agree);
  ``weight_shape`` int [2] = (N, K); ``weight_scale`` [N, G] (the model's float dtype); for an
  asymmetric scheme ``weight_zero_point`` [N * b / 32, G] int32, signed, offset and packed the same
  way but along N (older versions: int8 [N, G] unpacked);
- "naive-quantized": ``weight`` int8 [N, K] (q itself), ``weight_scale``, ``weight_zero_point``
  int8 [N, G] when asymmetric.

    w[n, k] = weight_scale[n, g] * (q[n, k] - z[n, g]),    g = k // (K / G),  z = 0 when symmetric

Supported: weights of type "int" with num_bits 4 or 8, strategy "group", "channel" or "tensor",
symmetric or not, actorder none or "weight" (static: the order does not reach the checkpoint);
formats "pack-quantized" and "naive-quantized" (per config group, or "mixed-precision" over them);
modules in ``ignore`` (or targeted by no group) load as 16/32-bit weights. Refused (ValueError
naming the value): float weights (FP8 "float-quantized", NVFP4, MXFP4: the CUDA path's, not
converted on the CPU), activation quantization (``input_activations``: W8A8 "int-quantized", W4A8),
other bit widths, "block" and other strategies, actorder "group" (g_idx), dynamic weights, KV cache
schemes, sparsity and transforms (rotations), a status other than "compressed".

Exactness: a symmetric 8-bit weight is int8 codes q times the float32 scale, the package's own
float32 dequantization bit for bit; the others carry a min (-scale * (z + offset)), exact when the
scale has at most 15 significant bits (bf16, fp16: every checkpoint saved from a 16-bit model),
else within one float32 rounding of it.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from pagedllm.model_executor.quantization.woq import QuantizedWeight
from pagedllm.model_executor.quantization.woq_checkpoint import (
    CheckpointWoqConfig,
    check_trivial_g_idx,
    is_projection_part,
    require,
    unpack_int32,
    zero_point_form,
)

SUPPORTED_FORMATS = ("pack-quantized", "naive-quantized")
SUPPORTED_BITS = (4, 8)
SUPPORTED_STRATEGIES = ("group", "channel", "tensor")
_STATIC_ACTORDER = (None, False, "weight", "static")


def _scale_columns(t: torch.Tensor, n: int, what: str, module: str) -> torch.Tensor:
    """t as [N, G] (a per-tensor value [] / [1] / [1, 1] repeated over the rows)."""
    if t.numel() == 1:
        return t.reshape(1, 1).expand(n, 1)
    if t.dim() != 2 or t.shape[0] != n:
        raise ValueError(f"compressed-tensors {module}: {what} {tuple(t.shape)} is not [{n}, groups]")
    return t


def _to_quantized(u: torch.Tensor, zero: Optional[torch.Tensor], scale: torch.Tensor, bits: int,
                  module: str, fmt: str) -> QuantizedWeight:
    """w = scale * (u - 2^(b-1) - zero) for unsigned codes u [N, K], zero [N, G] signed or None."""
    n, k = u.shape
    scale = _scale_columns(scale, n, "weight_scale", module)
    g = scale.shape[1]
    if k % g:
        raise ValueError(f"compressed-tensors {module}: {g} scale columns do not divide its {k} inputs")
    offset = 1 << (bits - 1)
    z = torch.full((n, g), offset, dtype=torch.int32)
    if zero is not None:
        z = z + _scale_columns(zero, n, "weight_zero_point", module).to(torch.int32)
    return zero_point_form(u, z, scale.to(torch.float32), bits, k // g, fmt)


def pack_quantized_to_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape,
                                weight_zero_point: Optional[torch.Tensor] = None,
                                weight_g_idx: Optional[torch.Tensor] = None,
                                module: str = "module") -> QuantizedWeight:
    """The QuantizedWeight [N, K] of one "pack-quantized" module (module docstring); the bit width
    follows from weight_packed's columns against K. ValueError on shapes that do not fit."""
    n, k = (int(v) for v in torch.as_tensor(weight_shape).reshape(-1).tolist())
    cols = weight_packed.shape[1]
    bits = next((b for b in SUPPORTED_BITS if k * b == 32 * cols), None)
    if weight_packed.dtype != torch.int32 or weight_packed.shape[0] != n or bits is None:
        raise ValueError(f"compressed-tensors {module}: weight_packed {weight_packed.dtype} "
                         f"{tuple(weight_packed.shape)} is not int32 [{n}, {k} * bits / 32] with bits in "
                         f"{list(SUPPORTED_BITS)} (weight_shape {(n, k)})")
    u = unpack_int32(weight_packed, bits, dim=1)
    zero = None
    if weight_zero_point is not None:
        zp = weight_zero_point
        if zp.dtype == torch.int32 and zp.shape[0] * 32 == n * bits:  # packed along N
            zp = unpack_int32(zp, bits, dim=0) - (1 << (bits - 1))
        zero = zp
    qw = _to_quantized(u, zero, weight_scale, bits, module, f"compressed-tensors W{bits}A16")
    check_trivial_g_idx(module, weight_g_idx, k, qw.group_size, "compressed-tensors")
    return qw


def naive_quantized_to_quantized(weight: torch.Tensor, weight_scale: torch.Tensor,
                                 weight_zero_point: Optional[torch.Tensor] = None,
                                 weight_g_idx: Optional[torch.Tensor] = None,
                                 module: str = "module") -> QuantizedWeight:
    """The QuantizedWeight [N, K] of one "naive-quantized" integer module (module docstring):
    int8 codes (any num_bits up to 8 stored as int8) in the 8-bit form."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"compressed-tensors {module}: naive-quantized weight {weight.dtype} "
                         f"{tuple(weight.shape)} is not int8 [out, in]")
    u = (weight.to(torch.int16) + 128).to(torch.int32)
    qw = _to_quantized(u, weight_zero_point, weight_scale, 8, module, "compressed-tensors int8")
    check_trivial_g_idx(module, weight_g_idx, weight.shape[1], qw.group_size, "compressed-tensors")
    return qw


def _refuse(what: str, value, supported) -> ValueError:
    return ValueError(f"compressed-tensors {what}={value!r} is not supported on the CPU: supported {supported}")


def _check_weights(group: str, args) -> None:
    """ValueError naming the first unsupported field of a config group's weight QuantizationArgs."""
    if not args:
        raise ValueError(f"compressed-tensors config group {group!r} quantizes no weights (weights=None): pagedllm "
                         "loads weight-quantized schemes (W4A16, W8A16)")
    where = f"config group {group!r} weights"
    if args.get("type", "int") != "int":
        raise _refuse(f"{where} type", args.get("type"), "'int', or 'float' with 8 bits (FP8: fp8_checkpoint.py); "
                      "FP4 weights are not loaded")
    if args.get("num_bits", 8) not in SUPPORTED_BITS:
        raise _refuse(f"{where} num_bits", args.get("num_bits"), list(SUPPORTED_BITS))
    strategy = args.get("strategy") or {None: "tensor", -1: "channel"}.get(args.get("group_size"), "group")
    if strategy not in SUPPORTED_STRATEGIES:
        raise _refuse(f"{where} strategy", strategy, list(SUPPORTED_STRATEGIES))
    if strategy == "group" and not (isinstance(args.get("group_size"), int) and args["group_size"] > 0):
        raise _refuse(f"{where} group_size", args.get("group_size"), "a positive number of inputs")
    if args.get("dynamic", False) not in (False, None):
        raise _refuse(f"{where} dynamic", args.get("dynamic"), "False")
    if args.get("actorder") not in _STATIC_ACTORDER:
        raise _refuse(f"{where} actorder", args.get("actorder"), "None or 'weight' (activation order 'group' "
                      "permutes the inputs by g_idx)")


def _is_fp8(args) -> bool:
    return bool(args) and args.get("type") == "float" and args.get("num_bits") == 8


def _fp8_config(config: dict, groups: dict, fp8: list[str]):
    """The CompressedTensorsFp8Config of a checkpoint whose config groups are all FP8 weights."""
    from pagedllm.model_executor.quantization.fp8_checkpoint import CompressedTensorsFp8Config

    if len(fp8) != len(groups):
        raise _refuse("config groups mixing FP8 and integer weights", sorted(groups), "all FP8 or all integer")
    blocks = set()
    for gname in fp8:
        w = groups[gname]["weights"]
        fmt = groups[gname].get("format") or config.get("format")
        if fmt not in ("float-quantized", "naive-quantized", None):
            raise _refuse(f"config group {gname!r} format", fmt, "'float-quantized' for FP8 weights")
        strategy = w.get("strategy") or "tensor"
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(f"config group {gname!r} FP8 weights strategy", strategy, ["tensor", "channel", "block"])
        if w.get("dynamic", False) not in (False, None):
            raise _refuse(f"config group {gname!r} FP8 weights dynamic", w.get("dynamic"), "False")
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, (list, tuple)) and len(block) == 2):
                raise _refuse(f"config group {gname!r} block_structure", block, "[rows, columns], e.g. [128, 128]")
            blocks.add((int(block[0]), int(block[1])))
        acts = groups[gname].get("input_activations")
        if acts and not _is_fp8(acts):
            raise _refuse(f"config group {gname!r} input_activations", acts, "FP8 (type 'float', 8 bits) or None")
        if groups[gname].get("output_activations"):
            raise _refuse(f"config group {gname!r} output_activations", groups[gname]["output_activations"], "None")
    if len(blocks) > 1:
        raise _refuse("FP8 block structures", sorted(blocks), "one for all groups")
    ignore = list(config.get("ignore") or [])

    def matches(module: str) -> bool:
        name = f"model.{module}"
        return not any(_matches(name, t) for t in ignore) and any(
            _matches(name, t) for g in fp8 for t in groups[g].get("targets", []))

    return CompressedTensorsFp8Config(matches, next(iter(blocks)) if blocks else None)


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' match of an HF module name (a decoder projection: a Linear) to a target."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in ("Linear", name)


class CompressedTensorsConfig(CheckpointWoqConfig):
    """A compressed-tensors checkpoint's quantization_config (module docstring)."""

    name = "compressed-tensors"
    leaves = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")

    def __init__(self, groups: dict[str, dict], formats: dict[str, str], ignore: list[str]):
        super().__init__()
        self.groups, self.formats, self.ignore = groups, formats, ignore

    @classmethod
    def from_config(cls, config: dict):
        """From config.json's quantization_config; ValueError naming an unsupported value and what is
        supported."""
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise _refuse("quantization_status", status, "'compressed'")
        # kv_cache_scheme: the checkpoint's k_scale / v_scale are read by the model (kv_cache.py) and
        # used with kv_cache_dtype="fp8"
        for key in ("sparsity_config", "moe_sparsity_config", "transform_config"):
            if config.get(key):
                raise _refuse(key, config[key], "none")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups: nothing is quantized")
        fp8 = [g for g, grp in groups.items() if _is_fp8(grp.get("weights"))]
        if fp8:  # FP8 W8A8 / W8A16: the fp8 linear method (fp8_checkpoint.py)
            return _fp8_config(config, groups, fp8)
        top = config.get("format")
        formats = {}
        for gname, group in groups.items():
            for side in ("input_activations", "output_activations"):
                if group.get(side):
                    raise _refuse(f"config group {gname!r} {side}", group[side],
                                  "None (weight-only schemes W4A16, W8A16; activation quantization such as "
                                  "W8A8 'int-quantized' is not run)")
            _check_weights(gname, group.get("weights"))
            fmt = group.get("format") or top
            if fmt not in SUPPORTED_FORMATS:
                raise _refuse(f"config group {gname!r} format", fmt, list(SUPPORTED_FORMATS))
            if fmt == "naive-quantized":  # its "weight" tensors are claimed by name: targets must be names
                for t in group.get("targets", []):
                    if not (t == "Linear" or t.startswith("re:") or "." in t):
                        raise _refuse(f"config group {gname!r} naive-quantized target", t,
                                      "'Linear', 're:' patterns and module names")
            formats[gname] = fmt
        return cls(groups, formats, list(config.get("ignore") or []))

    def _naive_target(self, module: str) -> bool:
        """Whether the checkpoint's "weight" of `module` (a decoder projection's part or the LM head:
        the Linear modules) holds naive-quantized int8 codes."""
        if not (is_projection_part(module) or module == "lm_head"):
            return False
        name = module if module == "lm_head" else f"model.{module}"
        if any(_matches(name, t) for t in self.ignore):
            return False
        return any(self.formats[g] == "naive-quantized" and any(_matches(name, t) for t in grp.get("targets", []))
                   for g, grp in self.groups.items())

    def claims(self, module: str, leaf: str) -> bool:
        if leaf == "weight":
            return "naive-quantized" in self.formats.values() and self._naive_target(module)
        return leaf in self.leaves

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        if "weight_packed" in tensors:
            require(module, tensors, ("weight_scale", "weight_shape"), "compressed-tensors")
            return pack_quantized_to_quantized(tensors["weight_packed"], tensors["weight_scale"],
                                               tensors["weight_shape"], tensors.get("weight_zero_point"),
                                               tensors.get("weight_g_idx"), module)
        require(module, tensors, ("weight", "weight_scale"), "compressed-tensors")
        return naive_quantized_to_quantized(tensors["weight"], tensors["weight_scale"],
                                            tensors.get("weight_zero_point"), tensors.get("weight_g_idx"), module)

    def describe(self) -> str:
        return (f"compressed-tensors ({', '.join(sorted(set(self.formats.values())))}; {self.describe_forms()}; "
                "weight-only CPU kernel)")
