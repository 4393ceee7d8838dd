"""End to end: LLM.generate against Hugging Face transformers' generate (greedy, fp32) on the
bundled SmolLM2-135M-Instruct and on random tiny models of every supported architecture, and
against itself with prefix caching on/off, chunked-prefill budgets 16/37/none, forced preemption
and alone vs batched — each run asserting from get_metrics() that its feature fired."""

from __future__ import annotations

import shutil

import pytest
import torch

from llm_reference import bundled_folder, bundled_prompt_ids, first_mismatch, hf_greedy
from tiny_models import TINY_CONFIGS, build_tiny_model

torch.set_num_threads(1)
MAX_TOKENS = 32
EOS = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    from pagedllm import ops

    before = ops.get_num_threads()
    ops.set_num_threads(1)
    yield
    ops.set_num_threads(before)


def metrics(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        out[m.name.removeprefix("pagedllm:")] = getattr(m, "value", None) if hasattr(m, "value") else m
    return out


def histogram(llm, name):
    return next(m for m in llm.get_metrics() if m.name == "pagedllm:" + name)


def greedy(max_tokens=MAX_TOKENS, **kw):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def make_llm(model=None, **kw):
    from pagedllm import LLM

    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    return LLM(model, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def hf_reference():
    """HF greedy tokens (stopping at EOS) and raw logits for the 16 bundled prompts."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(bundled_folder()), dtype=torch.float32)
    hf.eval()
    prompts = [list(p) for p in bundled_prompt_ids()]
    return hf_greedy(hf, prompts, MAX_TOKENS, eos_token_id=EOS, pad_token_id=EOS)


@pytest.fixture(scope="module")
def bundled_llm():
    llm = make_llm()
    yield llm
    llm.shutdown()


def prompts_as_tokens(idx=None):
    from pagedllm import TokensPrompt

    ids = bundled_prompt_ids()
    return [TokensPrompt(prompt_token_ids=list(ids[i])) for i in (idx if idx is not None else range(len(ids)))]


def assert_matches_hf(outputs, hf_reference, idx=None):
    idx = list(idx) if idx is not None else list(range(len(outputs)))
    for out, i in zip(outputs, idx):
        ref_tokens, _ = hf_reference[i]
        assert out.outputs[0].token_ids == ref_tokens, (i, first_mismatch(out.outputs[0].token_ids, ref_tokens))


def test_greedy_token_identical_to_hf_with_logprobs(bundled_llm, hf_reference):
    outputs = bundled_llm.generate(prompts_as_tokens(), greedy(logprobs=1), use_tqdm=False)
    assert len(outputs) == 16
    assert_matches_hf(outputs, hf_reference)
    total = 0
    for out, (ref_tokens, ref_logits) in zip(outputs, hf_reference):
        comp = out.outputs[0]
        assert comp.finish_reason == ("stop" if comp.token_ids[-1] == EOS else "length")
        ref_lp = ref_logits.double().log_softmax(-1)
        for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4
            assert entry[tok].rank == 1
        assert abs(comp.cumulative_logprob - sum(ref_lp[s, t].item() for s, t in enumerate(comp.token_ids))) < 1e-3
        total += len(comp.token_ids)
    assert total >= 16 * 8  # most prompts give long answers, not an immediate EOS
    m = metrics(bundled_llm)
    assert m["generation_tokens"] >= total


def test_text_prompts_chat_and_order(bundled_llm, hf_reference):
    from transformers import AutoTokenizer

    from llm_reference import QUESTIONS, TEXTS

    tok = bundled_llm.get_tokenizer()
    assert isinstance(tok.eos_token, str)
    # plain strings (tokenized with BOS handling of the tokenizer) -> same as HF on the same ids
    outs = bundled_llm.generate(TEXTS[:3], greedy(), use_tqdm=False)
    assert [o.prompt for o in outs] == TEXTS[:3]
    assert [o.prompt_token_ids for o in outs] == [list(bundled_prompt_ids()[8 + i]) for i in range(3)]
    assert_matches_hf(outs, hf_reference, range(8, 11))
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    # chat(): template + BOS exactly once, same tokens as the chat-formatted reference
    chat = bundled_llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS[:2]], greedy(), use_tqdm=False)
    for i, out in enumerate(chat):
        assert out.prompt_token_ids == list(bundled_prompt_ids()[i])
        assert out.prompt_token_ids[0] == tok.bos_token_id != out.prompt_token_ids[1]  # BOS once
    assert_matches_hf(chat, hf_reference, range(2))
    assert "Paris" in chat[0].outputs[0].text


def test_prefix_caching_on_and_off(hf_reference):
    idx = [0, 2, 4, 6]  # chat prompts share the template's system prefix (> one 16-token block)
    results = {}
    for enabled in (True, False):
        llm = make_llm(enable_prefix_caching=enabled)
        first = llm.generate(prompts_as_tokens(idx), greedy(), use_tqdm=False)
        again = llm.generate(prompts_as_tokens(idx), greedy(), use_tqdm=False)
        m = metrics(llm)
        llm.shutdown()
        assert token_ids(first) == token_ids(again)
        assert_matches_hf(first, hf_reference, idx)
        results[enabled] = (token_ids(first), m)
    assert results[True][0] == results[False][0]
    assert results[True][1]["prefix_cache_hits"] > 0
    assert results[False][1]["prefix_cache_hits"] == 0


@pytest.mark.parametrize("budget", [16, 37, None])
def test_chunked_prefill_budgets(hf_reference, budget):
    idx = [0, 3, 8, 9]
    llm = make_llm(max_num_batched_tokens=budget, enable_prefix_caching=False)
    outs = llm.generate(prompts_as_tokens(idx), greedy(), use_tqdm=False)
    m = metrics(llm)
    llm.shutdown()
    assert_matches_hf(outs, hf_reference, idx)
    longest = max(len(bundled_prompt_ids()[i]) for i in idx)
    if budget is not None:
        assert longest > 2 * budget
        assert m["num_chunked_prefills"] > 0  # a prompt was cut into several chunks
    else:
        assert m["num_chunked_prefills"] == 0


def test_forced_preemption(hf_reference):
    idx = list(range(16))
    # 12 blocks of 16 tokens: far fewer than 16 sequences of ~40 + 32 tokens need at once
    llm = make_llm(num_gpu_blocks_override=12, enable_prefix_caching=False)
    outs = llm.generate(prompts_as_tokens(idx), greedy(), use_tqdm=False)
    m = metrics(llm)
    llm.shutdown()
    assert m["num_preemptions"] > 0
    assert_matches_hf(outs, hf_reference, idx)
    assert m["kv_cache_usage_perc"] == 0.0


def test_alone_and_in_a_batch(hf_reference):
    idx = [1, 4, 10, 12]
    llm = make_llm(enable_prefix_caching=False)
    alone = []
    for i in idx:
        alone += llm.generate(prompts_as_tokens([i]), greedy(), use_tqdm=False)
    steps_alone = metrics(llm)["num_steps"]
    batch = llm.generate(prompts_as_tokens(idx), greedy(), use_tqdm=False)
    steps_batch = metrics(llm)["num_steps"] - steps_alone
    seqs_hist = histogram(llm, "iteration_num_seqs")
    llm.shutdown()
    assert token_ids(alone) == token_ids(batch)
    assert_matches_hf(batch, hf_reference, idx)
    assert steps_batch < steps_alone  # the batch shared steps
    assert seqs_hist.count - seqs_hist.buckets["1"] > 0  # some step ran several sequences


# ---- random tiny models of every architecture ------------------------------------------------
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_models_greedy_match_hf(tmp_path, name):
    hf = build_tiny_model(name, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_folder() / f, tmp_path / f)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 23, 37, 50)]
    refs = hf_greedy(hf, prompts, 20, eos_token_id=None, pad_token_id=0)
    from pagedllm import TokensPrompt

    llm = make_llm(str(tmp_path), max_num_batched_tokens=32)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        greedy(max_tokens=20, ignore_eos=True, logprobs=0), use_tqdm=False)
    llm.shutdown()
    for out, (ref_tokens, ref_logits) in zip(outs, refs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == 20 and comp.finish_reason == "length"
        k = first_mismatch(comp.token_ids, ref_tokens)
        upto = len(ref_tokens) if k is None else k
        if k is not None:  # a mismatch is allowed only at a near-tie of HF's top-2 logits
            top2 = ref_logits[k].topk(2).values
            assert (top2[0] - top2[1]).item() <= 1e-3, (name, k)
        ref_lp = ref_logits.double().log_softmax(-1)
        for s in range(upto):
            assert abs(comp.logprobs[s][comp.token_ids[s]].logprob - ref_lp[s, comp.token_ids[s]].item()) < 1e-4
