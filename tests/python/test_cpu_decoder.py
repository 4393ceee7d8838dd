"""The native CPU decoder stack (pagedllm/cpu_decoder.h, LlamaForCausalLM._native_stack) against
the Python layers it replaces: the same kernels in the same order, so logits and KV caches must be
bit-identical, for every architecture (qkv bias, q/k norm, sliding window) and for decode, prefill
and mixed steps."""

from __future__ import annotations

import pytest
import torch

from tiny_models import TINY_CONFIGS, PagedHarness, build_tiny_engine_folder, load_pagedllm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            if arch == "llama-bias":  # gate_up and down with biases (Qwen2 has the qkv bias)
                build_tiny_engine_folder("llama", folder, mlp_bias=True)
            else:
                build_tiny_engine_folder(arch, folder)
            cache[arch] = folder
        return cache[arch]

    return get


def load_packed(folder):
    """The bfloat16 model with its projections packed (as the model runner does)."""
    model = load_pagedllm(folder, torch.bfloat16)
    assert model.pack_weights()
    return model


def run_steps(model, steps, native: bool, monkeypatch, num_seqs: int = 3, max_len: int = 200,
              split_at: int | None = None) -> tuple[list[torch.Tensor], list, int]:
    """Logits of each step, the KV caches after them and how many layer calls the native stack
    ran. split_at: the layers run as two forward_layers calls, [0, split_at) and [split_at, L)."""
    monkeypatch.setenv("PAGEDLLM_CPU_NATIVE_DECODER", "1" if native else "0")
    fired = []
    original = type(model)._native_stack

    def spy(self, kv_caches, tokens):
        stack = original(self, kv_caches, tokens)
        fired.append(stack is not None)
        return stack

    monkeypatch.setattr(type(model), "_native_stack", spy)
    if split_at is not None:
        def forward(input_ids, positions, kv_caches, meta, logits_indices):
            state = model.embed(input_ids, positions)
            state = model.forward_layers(state, positions, kv_caches, meta, 0, split_at)
            state = model.forward_layers(state, positions, kv_caches, meta, split_at, len(model.layers))
            return model.logits(state, logits_indices)

        monkeypatch.setattr(model, "forward", forward)
    harness = PagedHarness(model, num_seqs, max_len, seed=5)
    logits = [harness.step(chunks) for chunks in steps]
    monkeypatch.setattr(type(model), "_native_stack", original)
    if split_at is not None:
        monkeypatch.delattr(model, "forward")
    return logits, harness.kv_caches, sum(fired)


def amx_or_skip():
    from pagedllm import ops

    if not ops.amx_linear_supported():
        pytest.skip("no AMX-BF16 on this machine: the native stack does not apply (test_no_native_stack_without_amx)")


def assert_identical(native, python, native_caches, python_caches) -> None:
    for i, (a, b) in enumerate(zip(native, python)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max().item()}"
    for (k1, v1), (k2, v2) in zip(native_caches, python_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS) + ["llama-bias"])
def test_native_stack_is_bit_identical_to_the_python_layers(tiny, arch, monkeypatch):
    amx_or_skip()
    folder = tiny(arch)
    model = load_packed(folder)
    assert model._native_applies
    g = torch.Generator().manual_seed(3)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 1024, (n,), generator=g).tolist()

    steps = [
        [(0, toks(20)), (1, toks(45)), (2, toks(7))],  # prefill of three (72 tokens)
        [(0, toks(1)), (1, toks(1)), (2, toks(1))],    # decode
        [(0, toks(1)), (1, toks(1)), (2, toks(30))],   # mixed: decodes and a chunk
        [(0, toks(1)), (1, toks(1)), (2, toks(1))],
        [(1, toks(1)), (2, toks(1))],                  # a smaller decode batch
        [(0, toks(140))],                              # above CPU_DECODER_MAX_TOKENS: Python path
        [(0, toks(1)), (1, toks(1)), (2, toks(1))],
    ]
    python, python_caches, fired_off = run_steps(model, steps, False, monkeypatch)
    native, native_caches, fired_on = run_steps(model, steps, True, monkeypatch)
    assert fired_off == 0
    assert fired_on == len(steps) - 1  # every step but the 140-token one
    assert_identical(native, python, native_caches, python_caches)


def test_native_stack_in_two_pieces_and_on_a_long_context(tiny, monkeypatch):
    """forward_layers over [0, 1) then [1, 2) (the second piece starts with a residual), and a
    600-token sequence (chunks of 120, then decode steps: with 2 or more threads the decode kernel
    splits its context in two): still bit-identical."""
    amx_or_skip()

    model = load_packed(tiny("llama3"))  # 1,024 positions
    g = torch.Generator().manual_seed(8)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 1024, (n,), generator=g).tolist()

    steps = [[(0, toks(120))] for _ in range(5)] + [[(0, toks(1))] for _ in range(3)]
    python, python_caches, _ = run_steps(model, steps, False, monkeypatch, num_seqs=1, max_len=700)
    native, native_caches, fired = run_steps(model, steps, True, monkeypatch, num_seqs=1, max_len=700, split_at=1)
    assert fired == 2 * len(steps)  # two pieces per step
    assert_identical(native, python, native_caches, python_caches)


def test_native_stack_with_the_engine_gives_the_same_tokens(tiny, monkeypatch):
    """Through LLM.generate (continuous batching, chunked prefill of 48 tokens): greedy tokens and
    logprobs are identical with the native stack on and off."""
    amx_or_skip()
    from pagedllm import LLM, SamplingParams

    folder = tiny("qwen2")
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 1024, (n,), generator=g).tolist()} for n in (5, 60, 33, 90)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for native in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_CPU_NATIVE_DECODER", native)
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=48,
                  enable_prefix_caching=False, device="cpu")
        outs[native] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                        for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (llm.llm_engine.runner.model._native is not None) == (native == "1")
        llm.shutdown()
    assert outs["1"] == outs["0"]


def test_greedy_argmax_in_the_lm_head_gives_the_sampler_tokens(tiny, monkeypatch):
    """Plain greedy steps take the argmax inside the AMX LM head (AmxLinearMethod.argmax, no logits
    written); the tokens equal those the sampler picks from the logits (the same requests asking
    for logprobs, which need the logits), and a batch mixing both kinds takes the logits path."""
    amx_or_skip()
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.layers.cpu_linear_methods import AmxLinearMethod

    calls = []
    original = AmxLinearMethod.argmax
    monkeypatch.setattr(AmxLinearMethod, "argmax",
                        lambda self, layer, x, vocab: calls.append(x.shape[0]) or original(self, layer, x, vocab))
    g = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(3, 1024, (n,), generator=g).tolist()} for n in (7, 40, 23)]
    llm = LLM(str(tiny("llama")), dtype="bfloat16", kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False,
              device="cpu")
    runs = {}
    for name, lp in (("fused", None), ("logits", 0)):
        calls.clear()
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=lp)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (len(calls) > 0) == (name == "fused")
    assert runs["fused"] == runs["logits"]
    calls.clear()
    mixed = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=lp) for lp in (None, 0, None)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)] == runs["logits"]
    assert not calls
    llm.shutdown()


def test_no_native_stack_without_amx(tiny, monkeypatch):
    """Where the projections are not AMX-packed (no AMX, or float32) the Python layers run."""
    from pagedllm.model_executor.layers.cpu_linear_methods import AmxLinearMethod

    monkeypatch.setattr(AmxLinearMethod, "applies", staticmethod(lambda weight: False))
    folder = tiny("llama")
    for dtype in (torch.bfloat16, torch.float32):
        model = load_pagedllm(folder, dtype)
        model.pack_weights()  # oneDNN's PackedLinearMethod (bfloat16, where oneDNN has it) or nothing
        assert not model._native_applies
        assert model._native_stack([None] * len(model.layers), 4) is None


def test_bad_operands_are_named(tiny):
    amx_or_skip()
    from pagedllm import _C, ops

    folder = tiny("llama")
    model = load_packed(folder)
    harness = PagedHarness(model, 1, 32)
    stack = model._build_native_stack(harness.kv_caches)
    assert stack.num_layers == len(model.layers)
    hidden = torch.zeros(_C.CPU_DECODER_MAX_TOKENS + 1, model.config.hidden_size, dtype=torch.bfloat16)
    i64, i32 = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    v = ops._view
    with pytest.raises(ValueError, match="129 tokens exceeds"):
        stack.forward(0, 1, v(hidden), v(hidden.clone()), False, v(i64), v(i64), v(i32.view(1, 1)), v(i32),
                      v(torch.zeros(2, dtype=torch.int32)), True)
    with pytest.raises(ValueError, match=r"layers \[0, 9\) out of range"):
        stack.forward(0, 9, v(hidden[:1]), v(hidden[1:2].clone()), False, v(i64), v(i64), v(i32.view(1, 1)),
                      v(i32), v(torch.zeros(2, dtype=torch.int32)), True)
    conf = _C.CpuDecoderConfig()
    conf.hidden_size, conf.intermediate_size = model.config.hidden_size, model.config.intermediate_size
    conf.num_heads, conf.num_kv_heads, conf.head_dim = 4, 2, 64
    bad = _C.CpuDecoderLayer()
    first = model.layers[0]
    bad.input_norm = bad.post_norm = v(first.input_layernorm.weight)
    bad.qkv = bad.o = bad.gate_up = bad.down = first.o_proj._packed_view  # o's shape for every projection
    bad.key_cache, bad.value_cache = v(harness.kv_caches[0][0]), v(harness.kv_caches[0][1])
    with pytest.raises(ValueError, match="layer 0 qkv must be a packed bfloat16 weight"):
        _C.CpuDecoderStack(conf, [bad], v(model.rotary.cos_sin_cache))
    with pytest.raises(ValueError, match="hidden and residual must not overlap"):
        stack.forward(0, 1, v(hidden[:2]), v(hidden[1:3]), True, v(i64), v(i64), v(i32.view(1, 1)), v(i32),
                      v(torch.zeros(2, dtype=torch.int32)), True)
