"""FP8 checkpoints (model_executor/quantization/fp8_checkpoint.py; issue #23), on the CPU (where
the fp8 method is weight-only: the e4m3 weight dequantized per call, float activations; its CUDA
path — the FP8 GEMV and torch._scaled_mm with e4m3 activations — is tested in
test_quantization_cuda.py):

- the converter of one module's e4m3 weight and scale: per tensor and per channel exactly the
  checkpoint's dequantization; errors name the bad dtype or shape;
- a tiny Llama / Qwen2 written as an FP8 checkpoint — by the compressed-tensors package
  (apply_quantization_config, its qparams, ModelCompressor: "float-quantized"; per channel and per
  tensor) and in the "fp8" quant_method layout (per tensor, with KV-cache scales that are dropped; block-scaled weight_scale_inv) — loads
  from its config.json: every projection on the fp8 method, holding exactly the weights the
  package's decompress (or the layout's formula) gives, and teacher-forced log-probabilities within
  1e-3 of the float32 model holding those weights (measured 0.0). Block scales are re-quantized per
  row at load (one more e4m3 rounding of each weight: within 1/16 of the row's largest; measured
  0.38 in log-probability on this sharp random model — the cost of that path, printed);
- bad configs are ValueErrors naming the value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import build_tiny_engine_folder

FP8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJ


def _e4m3_rows(w: torch.Tensor, per_tensor: bool):
    s = w.abs().amax() / 448 if per_tensor else w.abs().amax(dim=1, keepdim=True) / 448
    return (w / s).clamp(-448, 448).to(FP8), s.to(torch.float32)


def _write(src: Path, dst: Path, tensors: dict, qconfig: dict) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def fp8_folder(src: Path, out: Path, block: int | None):
    """(quant_method "fp8" folder, float32 folder of its dequantized weights): per-tensor scales
    (weight_scale), or with `block` a weight_scale_inv per block x block tile."""
    q_t, deq = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not _is_proj(name):
            q_t[name] = deq[name] = w
            continue
        module = name[:-len(".weight")]
        if block is None:
            q, s = _e4m3_rows(w, per_tensor=True)
            q_t[name], q_t[f"{module}.weight_scale"] = q, s.reshape(())
            deq[name] = q.float() * s
            if module.endswith("k_proj"):  # an "-FP8-KV" checkpoint's KV-cache scales: read and dropped
                attn = module.rpartition(".")[0]
                q_t[f"{attn}.k_scale"], q_t[f"{attn}.v_scale"] = torch.tensor(0.02), torch.tensor(0.03)
                q_t[f"{module}.output_scale"] = torch.tensor(0.02)
        else:
            n, k = w.shape
            rows, cols = -(-n // block), -(-k // block)
            pad = torch.zeros(rows * block, cols * block)
            pad[:n, :k] = w
            tiles = pad.view(rows, block, cols, block)
            s = (tiles.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
            q = (tiles / s[:, None, :, None]).clamp(-448, 448).to(FP8).view(rows * block, cols * block)[:n, :k]
            q_t[name], q_t[f"{module}.weight_scale_inv"] = q, s
            deq[name] = q.float() * s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    config = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": None if block is None else [block, block]}
    tag = "tensor" if block is None else f"block{block}"
    return _write(src, out / f"fp8-{tag}", q_t, config), _write(src, out / f"deq-{tag}", deq, {}), deq


def ct_fp8_folder(src: Path, out: Path, strategy: str):
    """A folder written by the compressed-tensors package (FP8 W8A8, dynamic per-token activations),
    and the float32 folder of the package's decompress of each module."""
    from compressed_tensors.compressors import BaseCompressor
    from test_quant_checkpoints import ct_save
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts, format="float-quantized")
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    for _, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.detach()
            lo, hi = (w.amin(), w.amax()) if strategy == "tensor" else (w.amin(1, keepdim=True), w.amax(1, keepdim=True))
            scale, _ = calculate_qparams(lo.reshape(-1, 1) if strategy == "tensor" else lo, hi.reshape(-1, 1)
                                         if strategy == "tensor" else hi, weights)
            m.weight_scale = torch.nn.Parameter(scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype),
                                                requires_grad=False)
    qfolder = ct_save(model, src, out / f"ct-{strategy}")
    saved = load_file(str(qfolder / "model.safetensors"))
    decompress = BaseCompressor.get_value_from_registry("float-quantized").decompress
    deq = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name[:-len(".weight")]
        if _is_proj(name):
            local = {k[len(module) + 1:]: v for k, v in saved.items() if k.startswith(module + ".")}
            assert local["weight"].dtype == FP8, (name, local["weight"].dtype)
            deq[name] = decompress(local, QuantizationScheme(targets=["Linear"], weights=weights))["weight"].float()
        else:
            deq[name] = t
    return qfolder, _write(src, out / f"deq-ct-{strategy}", deq, {}), deq


def _logprobs(llm):
    from pagedllm import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 1024, (n,), generator=g).tolist()} for n in (37, 19)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    return torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])


def _run(folder: Path):
    """(logprobs, {projection: (method, held weight)})."""
    from pagedllm import LLM

    llm = LLM(str(folder), device="cpu", dtype="float32", num_gpu_blocks_override=64)
    try:
        lps = _logprobs(llm)
        model = llm.llm_engine.runner.model
        held = {}
        for i, layer in enumerate(model.layers):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                p = getattr(layer, name)
                weight = p.quant_method.dequantized_weight(p) if hasattr(p, "fp8_weight") else None
                held[f"{i}.{name}"] = (type(p.quant_method).__name__, weight)
    finally:
        llm.shutdown()
    return lps, held


def _stacked(deq: dict, i: int, name: str) -> torch.Tensor:
    parts = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
             "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}[name]
    return torch.cat([deq[f"model.layers.{i}.{p}.weight"] for p in parts])


def _check(qfolder: Path, dfolder: Path, deq: dict, exact: bool, what: str) -> None:
    lq, held = _run(qfolder)
    lr, _ = _run(dfolder)
    for key, (method, weight) in held.items():
        assert method == "Fp8LinearMethod", (what, key, method)
        ref = _stacked(deq, *key.split(".", 1)[:1] and (int(key.split(".")[0]), key.split(".", 1)[1]))
        if exact:
            assert torch.equal(weight, ref), (what, key)
        else:  # block scales re-quantized per row: one more e4m3 rounding (relative 2^-4) of each weight
            assert (weight - ref).abs().max() <= 0.0625 * ref.abs().amax(dim=1, keepdim=True).max(), (what, key)
    dev = (lq - lr).abs().max().item()
    print(f"{what}: teacher-forced logprobs within {dev:.2e} of the float32 model holding the dequantized weights")
    # the CPU computes FP8 weight-only (float32 activations): float32 rounding apart (re-quantized
    # block scales: the held weights themselves differ, by one e4m3 rounding)
    assert dev < (1e-3 if exact else 0.5), what


@pytest.mark.slow
@pytest.mark.parametrize("block", [None, 32])
def test_fp8_quant_method_checkpoint(tmp_path, block):
    src = build_tiny_engine_folder("llama", tmp_path / "src")
    qfolder, dfolder, deq = fp8_folder(src, tmp_path, block)
    _check(qfolder, dfolder, deq, exact=block is None, what=f"fp8 checkpoint, {'per tensor' if block is None else 'blocks'}")


@pytest.mark.slow
@pytest.mark.parametrize("arch,strategy", [("llama", "channel"), ("qwen2", "tensor")])
def test_compressed_tensors_fp8_checkpoint_written_by_the_package(tmp_path, arch, strategy):
    src = build_tiny_engine_folder(arch, tmp_path / "src")
    qfolder, dfolder, deq = ct_fp8_folder(src, tmp_path, strategy)
    config = json.loads((qfolder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    _check(qfolder, dfolder, deq, exact=True, what=f"compressed-tensors FP8 {arch} {strategy}")


def test_fp8_weight_converter_layouts_and_errors():
    from pagedllm.model_executor.quantization.fp8_checkpoint import fp8_weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g)
    q, s = _e4m3_rows(w, per_tensor=False)
    for scale in (s, s.view(48)):
        assert torch.equal(fp8_weight(q, scale, "m").dequantize(), q.float() * s)
    q1, s1 = _e4m3_rows(w, per_tensor=True)
    for scale in (s1.reshape(()), s1.reshape(1)):
        assert torch.equal(fp8_weight(q1, scale, "m").dequantize(), q1.float() * s1)
    with pytest.raises(ValueError, match=r"m.weight is torch.bfloat16, expected torch.float8_e4m3fn"):
        fp8_weight(w.bfloat16(), s, "m")
    with pytest.raises(ValueError, match=r"m weight scale has shape \(3,\): expected a scalar, \[48\] or \[48, 1\]"):
        fp8_weight(q, torch.ones(3), "m")
    with pytest.raises(ValueError, match=r"m block scale has shape \(1, 1\), expected \(2, 3\) for \[48, 80\] in "
                                         r"blocks of 32 x 32"):
        fp8_weight(q, torch.ones(1, 1), "m", (32, 32))


def test_fp8_configs_refuse_what_they_do_not_run():
    from pagedllm.model_executor.quantization import get_quantization_config

    cpu = torch.device("cpu")
    bad = [({"activation_scheme": "mixed"}, "activation_scheme='mixed' is not supported"),
           ({"fmt": "e5m2"}, "fmt='e5m2' is not supported: supported 'e4m3'"),
           ({"weight_block_size": [128]}, r"weight_block_size=\[128\] must be null or two positive integers")]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            get_quantization_config(None, "fp8", cpu, checkpoint_config={"quant_method": "fp8", **extra})
    with pytest.raises(ValueError, match="FP8 checkpoints on cuda compute with bfloat16 activations, got dtype=float32"):
        get_quantization_config(None, "fp8", torch.device("cuda"), checkpoint_config={"quant_method": "fp8"},
                                dtype=torch.float32)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}
    with pytest.raises(ValueError, match="FP8 weights strategy='group' is not supported"):
        get_quantization_config(None, "compressed-tensors", cpu, checkpoint_config={
            "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}})
    # the online method keeps its name on a plain checkpoint
    assert get_quantization_config("fp8", None, torch.device("cuda"), dtype=torch.bfloat16).name == "fp8"
