"""quantization="int8" end to end (model_executor/quantization/int8.py on the CPU).

- The model's logits with every decoder projection on the int8 kernel equal (within float32
  rounding) those of the same model whose projections compute the W8A8 formula in plain PyTorch
  float64 (the same codes, scales and per-group activation quantization): prefill and decode steps,
  Llama (fp32 and bf16) and Qwen2 (biases).
- The bundled SmolLM2-135M: perplexity of a fixed text (tests/python/data/perplexity_text.md, the
  project's design notes, ~3,000 tokens) within 3% of bfloat16; printed.
- The engine: generation, weight bytes halved, tensor parallelism (2 ranks) close to one rank.
- Errors: an unknown method, a checkpoint quantized in another format, a device the method does
  not run on — each names what is supported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pagedllm import ops
from tiny_models import PagedHarness, build_tiny_engine_folder, build_tiny_model

DATA = Path(__file__).resolve().parent / "data"


class ReferenceW8A8:
    """A linear method computing int8_linear's formula in float64 PyTorch (the test's reference)."""

    def __init__(self, codes: torch.Tensor, w_scale: torch.Tensor, bias):
        self.codes, self.w_scale, self.bias = codes, w_scale, bias

    def fusions_apply(self, layer, tokens):
        return False

    def writes_float32(self, layer, tokens):
        return False

    def apply(self, layer, x, out=None, **fusion):
        M, K = x.shape
        group = ops.int8_activation_group(K)
        xf = x.float().reshape(M, K // group, group)
        s = xf.abs().amax(-1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(xf / s[:, :, None]).clamp(-127, 127).double()
        c = self.codes.double().view(self.codes.shape[0], K // group, group)
        y = (torch.einsum("mgk,ngk->mng", q, c) * s.double()[:, None, :]).sum(-1) * self.w_scale.double()
        if self.bias is not None:
            y = y + self.bias.double()
        y = y.to(x.dtype)
        return y if out is None else out.copy_(y)


def _models(folder: Path, dtype):
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM
    from pagedllm.model_executor.quantization import get_quantization_config

    cfg = ModelConfig.from_pretrained(folder)
    quant = LlamaForCausalLM(cfg, dtype, torch.device("cpu"))
    quant.load_weights(load_safetensors(folder))
    ref = LlamaForCausalLM(cfg, dtype, torch.device("cpu"))
    ref.load_weights(load_safetensors(folder))
    quant.quantize_weights(get_quantization_config("int8", None, torch.device("cpu")))
    for p in ref.projections():
        codes, scale = ops.int8_quantize_weight(p.weight)
        bias = p.apply_bias()
        p.quant_method = ReferenceW8A8(codes, scale, None if bias is None else bias.detach().float())
    return quant, ref


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32)],
                         ids=["llama-fp32", "llama-bf16", "qwen2-fp32"])
def test_int8_model_equals_a_pytorch_reference_of_the_same_quantization(tmp_path, arch, dtype):
    build_tiny_model(arch, tmp_path)
    quant, ref = _models(tmp_path, dtype)
    assert all(p.weight is None for p in quant.projections())  # the 16/32-bit weights are gone
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (37, 12)]
    hq, hr = PagedHarness(quant, 2, 64), PagedHarness(ref, 2, 64)
    outs = {}
    for name, h in (("quant", hq), ("ref", hr)):
        steps = [h.step([(0, seqs[0]), (1, seqs[1])])]
        steps += [h.step([(0, [5 + t]), (1, [9 + t])]) for t in range(3)]
        outs[name] = torch.cat(steps)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: the activations round between layers
    assert (outs["quant"] - outs["ref"]).abs().max().item() < tol
    assert (outs["quant"].argmax(-1) == outs["ref"].argmax(-1)).float().mean().item() >= (1.0 if dtype == torch.float32 else 0.9)


def bundled_perplexity(quantization) -> float:
    """Perplexity of the bundled SmolLM2-135M in bfloat16 (with `quantization`) on the first 3,000
    tokens of tests/python/data/perplexity_text.md (teacher-forced prompt logprobs)."""
    from pagedllm import LLM, SamplingParams

    text = (DATA / "perplexity_text.md").read_text()
    llm = LLM(dtype="bfloat16", device="cpu", quantization=quantization, max_model_len=4096,
              kv_cache_memory_bytes=512 << 20)
    try:
        ids = llm.get_tokenizer()(text)["input_ids"][:3000]
        assert len(ids) == 3000
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
    finally:
        llm.shutdown()
    lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


@pytest.mark.slow
def test_bundled_model_int8_perplexity_within_3_percent_of_bf16():
    ppl = {q: bundled_perplexity(q) for q in (None, "int8")}
    ratio = ppl["int8"] / ppl[None]
    print(f"bundled SmolLM2-135M, 3,000 tokens of {DATA / 'perplexity_text.md'}: perplexity bf16 {ppl[None]:.3f}, "
          f"int8 {ppl['int8']:.3f}, ratio {ratio:.4f}")
    assert ratio < 1.03


@pytest.mark.slow
def test_engine_int8_generates_cuts_the_projection_bytes_and_runs_under_tp2(tmp_path):
    from pagedllm import LLM, SamplingParams

    folder = build_tiny_engine_folder("qwen2", tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 1024, (n,), generator=g).tolist()} for n in (9, 30, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs, weight_bytes = {}, {}
    for q, tp in ((None, 1), ("int8", 1), ("int8", 2)):
        llm = LLM(str(folder), device="cpu", dtype="float32", quantization=q, tensor_parallel_size=tp,
                  num_gpu_blocks_override=128)
        runs[(q, tp)] = llm.generate(prompts, params, use_tqdm=False)
        weight_bytes[(q, tp)] = llm.llm_engine.runner.weight_bytes
        llm.shutdown()
    model = json.loads((folder / "config.json").read_text())
    layers, hidden, inter = model["num_hidden_layers"], model["hidden_size"], model["intermediate_size"]
    proj = layers * (hidden * (hidden + 2 * 2 * 64) + hidden * hidden + 3 * hidden * inter)  # qkv, o, gate_up, down
    saved = weight_bytes[(None, 1)] - weight_bytes[("int8", 1)]
    assert 0.7 * proj * 3 < saved <= proj * 3  # fp32 -> int8: ~3 of 4 bytes per projection weight
    assert weight_bytes[("int8", 2)] < 0.6 * weight_bytes[("int8", 1)]  # rank 0 holds about half
    for key in (("int8", 1), ("int8", 2)):  # close to the float model: the first greedy tokens agree
        first = [a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4] for a, b in zip(runs[key], runs[(None, 1)])]
        assert all(first), key

    def deviation(key) -> float:
        """The largest |logprob - float model's| of the sampled tokens, over the first 4 steps."""
        return max(abs(x[t].logprob - y[t].logprob)
                   for a, b in zip(runs[key], runs[(None, 1)])
                   for x, y in list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))[:4]
                   for t in x.keys() & y.keys())

    # each rank quantizes its own row-parallel shard (its own scales): the deviation from the float
    # model stays of the size one rank's quantization has (here up to ~0.15 on a sharp random model)
    one, two = deviation(("int8", 1)), deviation(("int8", 2))
    print(f"int8 logprob deviation from fp32: TP 1 {one:.4f}, TP 2 {two:.4f}")
    assert 0 < one < 0.3 and two < 2 * one + 0.02


def test_unsupported_methods_checkpoints_and_devices_are_named(tmp_path, monkeypatch):
    """...before any weight is read: the engine checks before it makes its executor."""
    import pagedllm.engine.llm_engine as engine_module
    from pagedllm import LLM
    from pagedllm.model_executor.quantization import get_quantization_config

    def no_executor(config):
        raise AssertionError("the executor (weights) was built before the error")

    monkeypatch.setattr(engine_module, "make_executor", no_executor)
    folder = build_tiny_engine_folder("llama", tmp_path)
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes' is not supported: use one of \[.*'int8'.*\]"):
        LLM(str(folder), device="cpu", quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization='int8' runs on cpu so far, not on cuda"):
        get_quantization_config("int8", None, torch.device("cuda"))
    for name in ("fp8", "int4"):  # CUDA kernels of bfloat16 activations: the dtype is checked before loading
        with pytest.raises(ValueError, match=f"quantization='{name}' on cuda computes with bfloat16 activations, "
                                             "got dtype=float16"):
            get_quantization_config(name, None, torch.device("cuda"), dtype=torch.float16)
        assert get_quantization_config(name, None, torch.device("cuda"), dtype=torch.bfloat16).name == name
    with pytest.raises(ValueError, match="quantization='awq' is a checkpoint format.*this checkpoint is not quantized"):
        LLM(str(folder), device="cpu", quantization="awq")
    with pytest.raises(ValueError, match='quantization="gguf" needs a GGUF model'):
        LLM(str(folder), device="cpu", quantization="gguf")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized with 'bitsandbytes'.*supported checkpoint formats are "
                                         r"\['gptq', 'awq', 'compressed-tensors', 'fp8'\]"):
        LLM(str(folder), device="cpu")
    # a supported format with an unsupported setting (test_quant_checkpoints.py has the others)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPTQ bits=3 is not supported: supported bits are \[4, 8\]"):
        LLM(str(folder), device="cpu")


def test_auto_dtype_takes_bfloat16_for_cudas_quantized_kernels():
    """dtype="auto" on CUDA becomes bfloat16 for methods whose kernels need it (a float16 GPTQ
    checkpoint, online fp8 / int4); an explicit other dtype is refused by get_quantization_config."""
    from pagedllm.model_executor.quantization import required_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert required_dtype(None, "gptq", cuda) == torch.bfloat16
    assert required_dtype("fp8", None, cuda) == torch.bfloat16 and required_dtype("int4", None, cuda) == torch.bfloat16
    assert required_dtype("int8", None, cuda) is None and required_dtype(None, None, cuda) is None
    assert required_dtype(None, "gptq", cpu) is None and required_dtype("int4", None, cpu) is None
