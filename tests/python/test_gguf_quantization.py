"""quantization="gguf" and quantization="int4" end to end (model_executor/quantization/gguf.py,
int4.py, woq.py; the weight-only CPU kernel).

- The bundled SmolLM2-135M (a GGUF of Q4_1 projections, Q8_0 embedding) in float32: with
  quantization="gguf" against the same file dequantized at load (quantization=None) — teacher-forced
  logprobs of 16 sequences within 1e-3, greedy tokens identical wherever the dequantized model's
  top-2 margin exceeds 1e-3; every projection on WoqLinearMethod with a weight that dequantizes to
  the dequantized model's exactly (q / k rows un-permuted, q / k / v and gate / up fused); weight
  bytes cut by the projections' share; tensor parallelism (3 ranks: the model has 9 heads and 3 KV
  heads, so 2 does not divide it) close to one rank.
- quantization="int4": the bundled model's perplexity of a fixed text against bfloat16 (printed),
  and a tiny float32 model against the same model whose projections hold quantize_int4's
  dequantized weights.
- Errors: "gguf" on a Hugging Face folder, or on cuda (named before any weight is read).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tiny_models import PagedHarness, build_tiny_engine_folder, build_tiny_model

DATA = Path(__file__).resolve().parent / "data"
TOL = 1e-3  # teacher-forced logprob deviation; measured ~5e-5 (float32 summation order only)

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three laws of thermodynamics", "In 1492, Columbus", "Water boils at", "The best way to learn a language is",
    "import numpy as np\n", "Photosynthesis is the process", "My favourite recipe for pancakes:",
    "The quick brown fox", "SELECT name FROM users WHERE", "A haiku about autumn:", "The mitochondria is",
    "Dear hiring manager,", "1, 1, 2, 3, 5, 8,",
]


def teacher_forced(llm, seqs: list[list[int]]) -> list[list[float]]:
    """Per sequence, the logprob of each token after the first given the tokens before it."""
    from pagedllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return [[d[s[i]].logprob for i, d in enumerate(o.prompt_logprobs) if i > 0] for o, s in zip(outs, seqs)]


def max_deviation(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.fixture(scope="module")
def bundled():
    """The bundled model in float32, quantization "gguf" and None, with 16 greedy generations of
    32 tokens each (top-2 logprobs) and the teacher-forced logprobs of the dequantized model's
    sequences on both."""
    from pagedllm import LLM, SamplingParams

    llms, runs = {}, {}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    try:
        for q in ("gguf", None):
            llms[q] = LLM(dtype="float32", device="cpu", quantization=q, kv_cache_memory_bytes=128 << 20,
                          max_model_len=512)
            runs[q] = llms[q].generate(PROMPTS, params, use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in runs[None]]
        forced = {q: teacher_forced(llms[q], seqs) for q in llms}
        yield {"llms": llms, "runs": runs, "seqs": seqs, "forced": forced}
    finally:
        for llm in llms.values():
            llm.shutdown()


@pytest.mark.slow
def test_gguf_logprobs_and_greedy_tokens_match_the_dequantized_model(bundled):
    forced = bundled["forced"]
    dev = max_deviation(forced["gguf"], forced[None])
    compared = identical = 0
    for q_out, d_out in zip(bundled["runs"]["gguf"], bundled["runs"][None]):
        q_ids, d_ids = q_out.outputs[0].token_ids, d_out.outputs[0].token_ids
        assert len(q_ids) == len(d_ids) == 32
        identical += list(q_ids) == list(d_ids)
        for t, top in enumerate(d_out.outputs[0].logprobs):
            best = sorted((lp.logprob for lp in top.values()), reverse=True)
            if best[0] - best[1] <= TOL:
                break  # a near tie: the quantized model may take the other token from here on
            assert q_ids[t] == d_ids[t], (q_out.prompt, t)
            compared += 1
    print(f"bundled SmolLM2-135M fp32, gguf vs dequantized: teacher-forced max |dlogprob| {dev:.2e} over "
          f"{sum(map(len, forced[None]))} positions; greedy {identical}/16 identical, {compared} steps compared")
    assert dev < TOL
    assert compared >= 16 * 8  # most steps are compared (no near ties at all in the measured run)


@pytest.mark.slow
def test_gguf_projections_are_the_files_quantized_weights_exactly(bundled):
    from pagedllm.model_executor.loader import bundled_gguf_path
    from pagedllm.model_executor.quantization.gguf import GGUFConfig
    from pagedllm.model_executor.quantization.woq import WoqLinearMethod

    quant = bundled["llms"]["gguf"].llm_engine.runner.model
    plain = bundled["llms"][None].llm_engine.runner.model
    for p in quant.projections():
        assert isinstance(p.quant_method, WoqLinearMethod) and p.weight is None
        qw = p.quant_method.qweight  # the form (the data is packed): Q4_1's
        assert (qw.bits, qw.group_size, qw.min is not None, qw.source) == (4, 32, True, "Q4_1")
    config = GGUFConfig(bundled_gguf_path())
    for i, layer in enumerate(plain.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            proj = getattr(layer, name)
            qw = config.linear_method(proj, f"layers.{i}.{name}").qweight
            assert torch.equal(qw.dequantize(), proj.weight), (i, name)
    assert config.types == {"Q4_1": 7 * len(plain.layers)}  # q, k, v, o, gate, up, down per layer


@pytest.mark.slow
def test_gguf_weight_bytes_drop_by_the_projections_share(bundled):
    quant, plain = (bundled["llms"][q].llm_engine.runner for q in ("gguf", None))
    params = sum(p.weight.numel() for p in plain.model.projections())
    saved = plain.weight_bytes - quant.weight_bytes
    # float32 (4 bytes) -> Q4_1 in the kernel's form: a 4-bit code plus a float32 scale and min per
    # 32 weights (0.75 bytes); everything else (embedding, norms) is the same
    assert saved == params * (4 - 0.75)
    print(f"weight bytes: dequantized {plain.weight_bytes / 2**20:.1f} MiB, gguf {quant.weight_bytes / 2**20:.1f} MiB")


@pytest.mark.slow
def test_gguf_under_tensor_parallelism_equals_one_rank(bundled):
    """3 ranks (q / k / v heads, gate / up rows and o / down input groups split) against the one-rank
    gguf model, teacher-forced on 4 of its sequences."""
    from pagedllm import LLM

    seqs = bundled["seqs"][:4]
    llm = LLM(dtype="float32", device="cpu", quantization="gguf", tensor_parallel_size=3,
              kv_cache_memory_bytes=64 << 20, max_model_len=256)
    try:
        forced = teacher_forced(llm, seqs)
        rank0_bytes = llm.llm_engine.runner.weight_bytes
    finally:
        llm.shutdown()
    dev = max_deviation(forced, bundled["forced"]["gguf"][:4])
    print(f"gguf TP 3 vs TP 1: teacher-forced max |dlogprob| {dev:.2e}")
    assert dev < TOL
    assert rank0_bytes < 0.5 * bundled["llms"]["gguf"].llm_engine.runner.weight_bytes


def test_gguf_needs_a_gguf_model_on_the_cpu(tmp_path, monkeypatch):
    """...named before any weight is read."""
    import pagedllm.engine.llm_engine as engine_module
    from pagedllm import LLM
    from pagedllm.model_executor.quantization import get_quantization_config

    def no_executor(config):
        raise AssertionError("the executor (weights) was built before the error")

    monkeypatch.setattr(engine_module, "make_executor", no_executor)
    folder = build_tiny_engine_folder("llama", tmp_path)
    with pytest.raises(ValueError, match='quantization="gguf" needs a GGUF model'):
        LLM(str(folder), device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' runs on cpu so far, not on cuda"):
        get_quantization_config("gguf", None, torch.device("cuda"), Path("model.gguf"))


# ---------------------------------------------------------------- int4
def _perplexity(llm, ids) -> float:
    from pagedllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


@pytest.mark.slow
def test_bundled_model_int4_perplexity_close_to_bf16():
    from pagedllm import LLM

    text = (DATA / "perplexity_text.md").read_text()
    ppl = {}
    for q in (None, "int4"):
        llm = LLM(dtype="bfloat16", device="cpu", quantization=q, max_model_len=4096, kv_cache_memory_bytes=512 << 20)
        ids = llm.get_tokenizer()(text)["input_ids"][:3000]
        assert len(ids) == 3000
        ppl[q] = _perplexity(llm, ids)
        llm.shutdown()
    ratio = ppl["int4"] / ppl[None]
    print(f"bundled SmolLM2-135M, 3,000 tokens of {DATA / 'perplexity_text.md'}: perplexity bf16 {ppl[None]:.3f}, "
          f"int4 {ppl['int4']:.3f}, ratio {ratio:.4f}")
    # Measured: bf16 60.35, int4 82.44, ratio 1.366 (float32: the same ratio, and the same perplexity
    # as the float32 model holding quantize_int4(w).dequantize(): the loss is the quantization's,
    # not the kernel's). The bundled weights are already Q4_1 (16 levels from each block's min);
    # int4's grid must hold 0 exactly (an integer zero point), which shifts a Q4_1 block by up to
    # half a step even where the groups align (group 32: ratio 1.28), on a 135M model that is
    # sensitive to it. The bound leaves ~6% of room above the measurement: a broken kernel or grid
    # gives perplexities in the hundreds or more.
    assert ratio < 1.45


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"intermediate_size": 480})],
                         ids=["llama", "qwen2-k480"])  # qwen2: biases; down_proj's 480 inputs: groups of 32
def test_int4_model_equals_the_model_of_its_dequantized_weights(tmp_path, arch, overrides):
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM
    from pagedllm.model_executor.quantization import get_quantization_config
    from pagedllm.model_executor.quantization.int4 import quantize_int4
    from pagedllm.model_executor.quantization.woq import WoqLinearMethod

    build_tiny_model(arch, tmp_path, **overrides)
    cfg = ModelConfig.from_pretrained(tmp_path)
    models = []
    for _ in range(2):
        m = LlamaForCausalLM(cfg, torch.float32, torch.device("cpu"))
        m.load_weights(load_safetensors(tmp_path))
        models.append(m)
    quant, ref = models
    quant.quantize_weights(get_quantization_config("int4", None, torch.device("cpu")))
    groups = set()
    with torch.no_grad():
        for qp, rp in zip(quant.projections(), ref.projections()):
            assert isinstance(qp.quant_method, WoqLinearMethod) and qp.weight is None
            qw = quantize_int4(rp.weight)
            groups.add((rp.weight.shape[1], qw.group_size))
            rp.weight.copy_(qw.dequantize())
    assert groups == ({(256, 128), (480, 32)} if overrides else {(256, 128), (512, 128)})
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (37, 12)]
    outs = []
    for m in (quant, ref):
        h = PagedHarness(m, 2, 64)
        steps = [h.step([(0, seqs[0]), (1, seqs[1])])]
        steps += [h.step([(0, [5 + t]), (1, [9 + t])]) for t in range(3)]
        outs.append(torch.cat(steps))
    dev = (outs[0] - outs[1]).abs().max().item()
    print(f"int4 {arch}: max |dlogit| vs the dequantized-weight model {dev:.2e}")
    assert dev < 1e-4
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
