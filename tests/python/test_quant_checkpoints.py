"""GPTQ, AWQ and compressed-tensors checkpoints on the CPU (model_executor/quantization/gptq.py,
awq.py, compressed_tensors.py; issue #23).

The checkpoints are written here from the formats' published layouts, independently of the code
under test: GPTQ with AutoGPTQ's ``QuantLinear.pack`` (qlinear_cuda_old.py: qweight packed along K,
qzeros along N, classic format storing zeros - 1), AWQ with AutoAWQ's ``WQLinear_GEMM.from_linear``
(packed along N in the order [0, 2, 4, 6, 1, 3, 5, 7]), compressed-tensors with the
``compressed-tensors`` package's own compressors (an outside reference for its layout).

- Each converter's QuantizedWeight.dequantize() equals the format's own dequantization exactly
  (AutoGPTQ's torch forward, AutoAWQ's dequantize_gemm, the package's decompress), in float64.
- End to end: LLM(folder) on the quantized folder (the method from config.json) gives teacher-forced
  prompt logprobs within 1e-3 of the same engine on a float32 folder holding the dequantized
  weights, and the same greedy tokens; Llama and Qwen2 (qkv biases); a module left in 16 bits.
- tensor_parallel_size=2 equals one rank within 1e-3 (groups split across the ranks' inputs).
- Unsupported settings raise ValueError naming the value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import build_tiny_engine_folder

# hidden 128 (2 heads of 64), intermediate 256: every group size below divides every K
LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
QWEN2 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2)
PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


# ---- GPTQ: AutoGPTQ's quantizer, pack and dequantization ------------------------------------

def gptq_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int = 0):
    """AutoGPTQ's Quantizer (find_params, per row and group) then QuantLinear.pack's integer
    weight: q [K, N], zeros [G, N] (ints), scales fp16 [G, N]."""
    n, k = w.shape
    group = k if group == -1 else group
    maxq = 2 ** bits - 1
    wg = w.double().view(n, k // group, group)
    xmin = wg.amin(-1).clamp(max=0)
    xmax = wg.amax(-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    scale = (xmax - xmin) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    zero = zero.clamp(min_zero, maxq)
    s16 = scale.half()
    q = torch.round(wg / s16.double()[..., None]) + zero[..., None]
    q = q.clamp(0, maxq).view(n, k)
    return q.long().t().contiguous(), zero.long().t().contiguous(), s16.t().contiguous()


def gptq_pack(q: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool):
    """AutoGPTQ's QuantLinear.pack (bits 4, 8): qweight int32 [K * bits / 32, N], qzeros int32
    [G, N * bits / 32]; the classic format (v1) stores zeros - 1."""
    per = 32 // bits
    intweight = q.numpy().astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + per):
            qweight[row] |= intweight[j] << np.uint32(bits * (j - i))
        i += per
        row += 1
    z = (zeros - 1 if v1 else zeros).numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + per):
            qzeros[:, col] |= z[:, j] << np.uint32(bits * (j - i))
        i += per
        col += 1
    return torch.from_numpy(qweight.view(np.int32)), torch.from_numpy(qzeros.view(np.int32))


def gptq_dequantize(qweight, qzeros, scales, bits: int, group: int, v1: bool) -> torch.Tensor:
    """AutoGPTQ's QuantLinear.forward (torch path) weight, in float64, as [N, K]."""
    per = 32 // bits
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, per), wf.unsqueeze(0))
    zeros = torch.bitwise_and(zeros, 2 ** bits - 1).to(torch.int64)
    if v1:
        zeros = zeros + 1
    zeros = zeros.reshape(-1, 1, zeros.shape[1] * zeros.shape[2])
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, per, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight, 2 ** bits - 1).to(torch.int64)
    k = weight.shape[0] * weight.shape[1]
    group = k if group == -1 else group
    weight = weight.reshape(-1, group, weight.shape[2])
    w = scales.double().reshape(-1, 1, scales.shape[-1]) * (weight - zeros).double()
    return w.reshape(k, -1).t()


def gptq_module(w: torch.Tensor, bits: int, group: int, sym: bool, v1: bool):
    q, zeros, scales = gptq_quantize(w, bits, group, sym, min_zero=1 if v1 else 0)
    qweight, qzeros = gptq_pack(q, zeros, bits, v1)
    k = w.shape[1]
    g_idx = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return tensors, gptq_dequantize(qweight, qzeros, scales, bits, group, v1)


# ---- AWQ: AutoAWQ's pseudo_quantize_tensor, WQLinear_GEMM.from_linear, dequantize_gemm ---------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """WQLinear_GEMM.from_linear's packing of int values [R, N] along N: int32 [R, N / 8]."""
    v = values.numpy().astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(v.shape[1] // 8):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << np.uint32(i * 4)
    return torch.from_numpy(out.view(np.int32))


def awq_dequantize(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm (awq/utils/packing_utils.py), in float64, as [N, K]."""
    shifts = torch.arange(0, 32, 4)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).view(qweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).view(qzeros.shape[0], -1)
    reverse = torch.arange(izeros.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    iweights = torch.bitwise_and(iweights[:, reverse], 15).long()
    izeros = torch.bitwise_and(izeros[:, reverse], 15).long()
    k = qweight.shape[0]
    group = k if group == -1 else group
    w = (iweights - izeros.repeat_interleave(group, 0)).double() * scales.double().repeat_interleave(group, 0)
    return w.t()


def awq_module(w: torch.Tensor, group: int):
    n, k = w.shape
    g = k if group == -1 else group
    wg = w.double().view(n, k // g, g)
    mx, mn = wg.amax(-1), wg.amin(-1)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(mn / scales.double())).clamp(0, 15)
    q = (torch.round(wg / scales.double()[..., None]) + zeros[..., None]).clamp(0, 15).view(n, k).long()
    qweight, qzeros = awq_pack(q.t().contiguous()), awq_pack(zeros.long().t().contiguous())
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous()}
    return tensors, awq_dequantize(qweight, qzeros, tensors["scales"], group)


# ---- compressed-tensors: the package's qparams and compressors -------------------------------

def ct_args(bits: int, group: int, sym: bool):
    from compressed_tensors.quantization import QuantizationArgs

    if group == -1:
        return QuantizationArgs(num_bits=bits, strategy="channel", symmetric=sym)
    return QuantizationArgs(num_bits=bits, strategy="group", group_size=group, symmetric=sym)


def ct_qparams(w: torch.Tensor, args):
    """The package's calculate_qparams over each row's groups; scales rounded to bfloat16 (a
    checkpoint saved from a bf16 model)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w.shape
    g = k if args.strategy == "channel" else args.group_size
    wg = w.view(n, k // g, g)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    return scale.to(torch.bfloat16), zp.to(torch.int8)


def ct_module(w: torch.Tensor, bits: int, group: int, sym: bool, fmt: str = "pack-quantized"):
    """(tensors of one module compressed by the package, the package's decompress in float32)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    args = ct_args(bits, group, sym)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale, zp = ct_qparams(w, args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    ref = compressor.decompress({**tensors, "weight_scale": tensors["weight_scale"].float()}, scheme)["weight"]
    return dict(tensors), ref.double()


def _qw_float64(qw) -> torch.Tensor:
    return qw.dequantize(torch.float64)


# ---- (1) converters equal the formats' own dequantization ------------------------------------

@pytest.mark.parametrize("bits,group,sym,fmt", [(4, 128, True, "gptq"), (4, 64, False, "gptq_v2"),
                                                (4, -1, False, "gptq"), (8, -1, True, "gptq"),
                                                (8, 32, False, "gptq_v2"), (8, 128, True, "gptq_v2")])
def test_gptq_converter_equals_autogptq_dequantization(bits, group, sym, fmt):
    from pagedllm.model_executor.quantization.gptq import gptq_to_quantized

    w = _weight(96, 256, seed=bits + group)
    tensors, ref = gptq_module(w, bits, group, sym, v1=fmt == "gptq")
    qw = gptq_to_quantized(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], bits, group, fmt)
    assert qw.shape == (96, 256) and qw.bits == bits
    assert torch.equal(qw.dequantize(torch.float32).double(), ref)  # exact in float32
    assert torch.equal(_qw_float64(qw), ref)
    assert (ref - w.double()).abs().max() < 0.6 * tensors["scales"].float().max()  # and it is w quantized


@pytest.mark.parametrize("group", [128, 64, -1])
def test_awq_converter_equals_autoawq_dequantization(group):
    from pagedllm.model_executor.quantization.awq import awq_to_quantized

    w = _weight(64, 256, seed=7)
    tensors, ref = awq_module(w, group)
    qw = awq_to_quantized(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    assert torch.equal(qw.dequantize(torch.float32).double(), ref)
    assert (ref - w.double()).abs().max() < 0.6 * tensors["scales"].float().max()


def test_awq_order_of_one_word():
    """Outputs 0..7 holding values 0..7: the word's nibbles read 0, 2, 4, 6, 1, 3, 5, 7."""
    from pagedllm.model_executor.quantization.awq import unpack_awq

    packed = awq_pack(torch.arange(8).view(1, 8))
    assert [(int(packed[0, 0]) >> (4 * i)) & 15 for i in range(8)] == AWQ_ORDER
    assert unpack_awq(packed).tolist() == [list(range(8))]


@pytest.mark.parametrize("bits,group,sym,fmt", [(4, 128, True, "pack-quantized"), (4, -1, True, "pack-quantized"),
                                                (8, -1, True, "pack-quantized"), (8, 64, True, "pack-quantized"),
                                                (4, 64, False, "pack-quantized"), (8, -1, False, "pack-quantized"),
                                                (8, -1, True, "naive-quantized"), (4, 32, False, "naive-quantized")])
def test_compressed_tensors_converter_equals_the_packages_decompress(bits, group, sym, fmt):
    from pagedllm.model_executor.quantization.compressed_tensors import (
        naive_quantized_to_quantized,
        pack_quantized_to_quantized,
    )

    w = _weight(64, 256, seed=bits * 3 + group)
    tensors, ref = ct_module(w, bits, group, sym, fmt)
    assert ("weight_zero_point" in tensors) == (not sym)
    if fmt == "pack-quantized":
        assert tensors["weight_packed"].dtype == torch.int32
        qw = pack_quantized_to_quantized(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_shape"],
                                         tensors.get("weight_zero_point"))
    else:
        assert tensors["weight"].dtype == torch.int8
        qw = naive_quantized_to_quantized(tensors["weight"], tensors["weight_scale"], tensors.get("weight_zero_point"))
    assert qw.bits == (bits if fmt == "pack-quantized" else 8)
    assert torch.equal(qw.dequantize(torch.float32).double(), ref)
    assert (ref - w.double()).abs().max() < 1.5 * tensors["weight_scale"].float().max()  # clipped at the top


def test_activation_order_g_idx_is_refused():
    from pagedllm.model_executor.quantization.gptq import gptq_to_quantized

    w = _weight(32, 128, seed=1)
    tensors, _ = gptq_module(w, 4, 32, True, v1=True)
    g_idx = torch.randperm(128, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 32
    with pytest.raises(ValueError, match="activation order"):
        gptq_to_quantized(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, 4, 32, "gptq", "layers.0.x")
    with pytest.raises(ValueError, match="group_size=64 does not divide|do not fit"):
        gptq_to_quantized(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 4, 64, "gptq")


# ---- quantized folders -------------------------------------------------------------------------

def _copy_folder(src: Path, dst: Path, tensors: dict, quantization_config=None) -> Path:
    """dst: src's files (tokenizer, config.json with `quantization_config` added) with `tensors`
    as its model.safetensors."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def write_quantized(src: Path, out: Path, quantize_module, quantization_config: dict, dense=()):
    """(the quantized folder, a float32 folder holding its dequantized weights) from the float
    folder `src`: quantize_module(weight) -> (tensors of the module, dequantized [N, K] float64);
    modules whose name ends with one of `dense` stay 16/32-bit."""
    state = load_file(str(src / "model.safetensors"))
    quant, deq = {}, {}
    for name, t in state.items():
        module = name[:-len(".weight")]
        if (name.endswith(".weight") and any(module.endswith(p) for p in PARTS)
                and not any(module.endswith(d) for d in dense)):
            tensors, ref = quantize_module(t)
            quant.update({f"{module}.{leaf}": v for leaf, v in tensors.items()})
            deq[name] = ref.float()
        else:
            quant[name] = deq[name] = t
    return (_copy_folder(src, out / "quantized", quant, quantization_config),
            _copy_folder(src, out / "dequantized", deq))


def gptq_folder(src: Path, out: Path, bits: int, group: int, sym: bool, fmt: str, dense=()):
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": sym,
              "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}
    return write_quantized(src, out, lambda w: gptq_module(w, bits, group, sym, fmt == "gptq"), config, dense)


def awq_folder(src: Path, out: Path, group: int):
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return write_quantized(src, out, lambda w: awq_module(w, group), config)


def ct_save(model, src: Path, qfolder: Path) -> Path:
    """qfolder: `model` (its quantization applied) compressed and saved by the package's
    ModelCompressor in the scheme's format, config.json's quantization_config by the package, and
    src's other files (tokenizer)."""
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(qfolder)
    compressor.update_config(qfolder)
    for f in src.iterdir():
        if not (qfolder / f.name).exists():
            shutil.copy(f, qfolder / f.name)
    return qfolder


def ct_folder(arch: str, overrides: dict, out: Path, bits: int, group: int, sym: bool, fmt: str = "pack-quantized",
              ignore=("lm_head",)):
    """The whole model quantized and saved by the package (apply_quantization_config, qparams,
    ModelCompressor), and the float32 folder of the package's decompress of each module."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    src = build_tiny_engine_folder(arch, out / "src", **overrides)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = ct_args(bits, group, sym)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, format=fmt)},
        ignore=list(ignore)), show_progress=False)
    for _, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            scale, zp = ct_qparams(m.weight.detach(), args)
            m.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            m.weight_zero_point = torch.nn.Parameter(zp, requires_grad=False)
    qfolder = ct_save(model, src, out / "quantized")
    # the dequantized folder: the package's decompress of each module's saved tensors
    saved = load_file(str(qfolder / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    decompress = BaseCompressor.get_value_from_registry(fmt).decompress
    deq = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name[:-len(".weight")]
        if f"{module}.weight_scale" in saved:
            local = {k[len(module) + 1:]: v for k, v in saved.items() if k.startswith(module + ".")}
            local["weight_scale"] = local["weight_scale"].float()
            deq[name] = decompress(local, scheme)["weight"].float()
        else:
            deq[name] = t
    return qfolder, _copy_folder(src, out / "dequantized", deq)


# ---- (2) the engine on a quantized folder equals it on the dequantized one ---------------------

def _run(folder: Path, tp: int = 1):
    from pagedllm import LLM, SamplingParams

    g = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 1024, (n,), generator=g).tolist()} for n in (40, 23)]
    llm = LLM(str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp, num_gpu_blocks_override=64)
    try:
        if tp == 1:  # the checkpoint's method was picked up: every quantized projection on the weight-only kernel
            quantized = "quantization_config" in json.loads((folder / "config.json").read_text())
            methods = {type(p.quant_method).__name__ for p in llm.llm_engine.runner.model.projections()}
            assert ("WoqLinearMethod" in methods) == quantized, methods
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    lps = torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])
    return lps, [list(o.outputs[0].token_ids) for o in outs]


def _assert_same(quantized: Path, dequantized: Path, what: str, tp: int = 1) -> float:
    lq, tq = _run(quantized, tp)
    lr, tr = _run(dequantized)
    dev = (lq - lr).abs().max().item()
    print(f"{what}: teacher-forced logprobs within {dev:.2e} of the dequantized float32 model; greedy "
          f"{sum(a == b for x, y in zip(tq, tr) for a, b in zip(x, y))}/{sum(map(len, tr))} tokens equal")
    assert dev < 1e-3, what
    assert tq == tr, what
    return dev


def _src(tmp_path: Path, arch: str) -> Path:
    return build_tiny_engine_folder(arch, tmp_path / "src", **(LLAMA if arch == "llama" else QWEN2))


@pytest.mark.slow
@pytest.mark.parametrize("arch,bits,group,sym,fmt", [("llama", 4, 128, True, "gptq"),
                                                     ("qwen2", 8, -1, False, "gptq_v2")],
                         ids=["llama-4bit-g128-sym-v1", "qwen2-8bit-channel-asym-v2"])
def test_engine_gptq_equals_its_dequantized_weights(tmp_path, arch, bits, group, sym, fmt):
    q, d = gptq_folder(_src(tmp_path, arch), tmp_path, bits, group, sym, fmt)
    _assert_same(q, d, f"gptq {arch} {bits}-bit group {group} sym={sym} {fmt}")


@pytest.mark.slow
def test_engine_awq_equals_its_dequantized_weights(tmp_path):
    q, d = awq_folder(_src(tmp_path, "qwen2"), tmp_path, 64)
    _assert_same(q, d, "awq qwen2 group 64")


@pytest.mark.slow
@pytest.mark.parametrize("arch,bits,group,sym,fmt,ignore", [
    ("llama", 4, 128, True, "pack-quantized", ("lm_head",)),
    ("qwen2", 8, -1, True, "pack-quantized", ("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$")),
    ("llama", 8, -1, True, "naive-quantized", ("lm_head",)),
], ids=["llama-W4A16-g128", "qwen2-W8A16-channel-one-dense", "llama-naive-int8"])
def test_engine_compressed_tensors_equals_its_dequantized_weights(tmp_path, arch, bits, group, sym, fmt, ignore):
    q, d = ct_folder(arch, LLAMA if arch == "llama" else QWEN2, tmp_path, bits, group, sym, fmt, ignore)
    config = json.loads((q / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == fmt
    _assert_same(q, d, f"compressed-tensors {arch} {fmt} {bits}-bit group {group}")


# ---- (3) tensor parallelism ----------------------------------------------------------------------

@pytest.mark.slow
def test_gptq_tensor_parallel_2_equals_one_rank(tmp_path):
    """qwen2 (qkv biases), group 128: the row-parallel o_proj's 128 inputs split 64 per rank, so
    its groups are re-expressed with 64 inputs."""
    q, d = gptq_folder(_src(tmp_path, "qwen2"), tmp_path, 4, 128, True, "gptq")
    l1, t1 = _run(q, 1)
    l2, t2 = _run(q, 2)
    dev = (l1 - l2).abs().max().item()
    print(f"gptq TP 2 vs TP 1: teacher-forced logprobs within {dev:.2e}")
    assert dev < 1e-3 and t1 == t2


# ---- loading errors (model level, no engine) --------------------------------------------------------

def _load(folder: Path):
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM
    from pagedllm.model_executor.quantization import get_quantization_config

    cfg = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(cfg, torch.float32, torch.device("cpu"))
    quant = get_quantization_config(None, cfg.quantization, torch.device("cpu"), None, cfg.quantization_config)
    model.load_weights(load_safetensors(folder), quant)
    model.quantize_weights(quant)
    return model, quant


def test_model_loads_a_dense_module_and_refuses_a_partly_quantized_projection(tmp_path):
    src = _src(tmp_path, "llama")
    q, _ = gptq_folder(src, tmp_path / "a", 4, 64, True, "gptq", dense=("layers.1.mlp.down_proj",))
    model, quant = _load(q)
    from pagedllm.model_executor.quantization.woq import WoqLinearMethod

    methods = {f"{i}.{n}": type(getattr(layer, n).quant_method) for i, layer in enumerate(model.layers)
               for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert methods.pop("1.down_proj") is not WoqLinearMethod and set(methods.values()) == {WoqLinearMethod}
    assert "4-bit group 64 x13" in quant.describe()
    q, _ = gptq_folder(src, tmp_path / "b", 4, 64, True, "gptq", dense=("layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj, layers.0.self_attn.v_proj quantized but "
                                         r"layers.0.self_attn.k_proj not"):
        _load(q)


# ---- (4) bad configs ------------------------------------------------------------------------------

@pytest.mark.parametrize("method,config,match", [
    ("gptq", {"bits": 3}, r"GPTQ bits=3 is not supported: supported bits are \[4, 8\]"),
    ("gptq", {"bits": 4, "desc_act": True}, r"desc_act=True .* supported desc_act=False"),
    ("gptq", {"bits": 4, "group_size": 0}, r"group_size=0"),
    ("gptq", {"bits": 4, "lm_head": True}, r"lm_head=True"),
    ("gptq", {"bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' .* \['gptq', 'gptq_v2'\]"),
    ("gptq", {"bits": 4, "dynamic": {"-:.*": {}}}, r"dynamic="),
    ("awq", {"bits": 8}, r"AWQ bits=8 is not supported: supported bits are \[4\]"),
    ("awq", {"w_bit": 4, "zero_point": False}, r"zero_point=False .* supported zero_point=True"),
    ("awq", {"version": "GEMV"}, r"version='GEMV' .* \['gemm'\]"),
    ("compressed-tensors", {"format": "nvfp4-pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
     r"type='float' .* supported 'int'"),
    ("compressed-tensors", {"format": "int-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "strategy": "channel"}, "input_activations": {"num_bits": 8, "dynamic": True,
                                                                    "strategy": "token"}}}}, r"input_activations="),
    ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 2, "strategy": "group", "group_size": 128}}}}, r"num_bits=2 .* \[4, 8\]"),
    ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "group"}}}}, r"actorder='group'"),
    ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}}}}, r"strategy='block'"),
    ("compressed-tensors", {"format": "sparse-24-bitmask", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "strategy": "channel"}}}}, r"format='sparse-24-bitmask' .* \['pack-quantized', "
                                                   r"'naive-quantized'\]"),
    ("compressed-tensors", {"format": "pack-quantized", "transform_config": {"config_groups": {"u": {}}},
                            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}},
     r"transform_config="),
])
def test_unsupported_checkpoint_settings_are_named(method, config, match):
    from pagedllm.model_executor.quantization import get_quantization_config

    with pytest.raises(ValueError, match=match):
        get_quantization_config(None, method, torch.device("cpu"), None, {"quant_method": method, **config})


def test_checkpoint_formats_on_cuda_need_bfloat16_and_a_contradicting_name_is_refused():
    """CUDA runs the 4-bit formats through tinygemm (bfloat16 activations: another dtype is refused
    before loading; 8-bit or other groups are refused per layer at load: woq_cuda.woq_method_for)."""
    from pagedllm.model_executor.quantization import get_quantization_config

    cfg = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with pytest.raises(ValueError, match="'awq' checkpoints on cuda compute with bfloat16 activations, got dtype=float16"):
        get_quantization_config(None, "awq", torch.device("cuda"), None, cfg, torch.float16)
    assert get_quantization_config(None, "awq", torch.device("cuda"), None, cfg, torch.bfloat16).group_size == 128
    with pytest.raises(ValueError, match="quantization='int8' contradicts the checkpoint"):
        get_quantization_config("int8", "awq", torch.device("cpu"), None, cfg)
    assert get_quantization_config("awq", "awq", torch.device("cpu"), None, cfg).group_size == 128
