"""Speculative decoding in the native core (pagedllm/spec_decode.h), driven by the simulated model
of engine_sim.py, whose next token is a pure function of the context it reads back from the KV
store. Whatever drafts the scheduler proposes and however many are accepted, the outputs must be
those of the same workload without speculation: the verification rows read the right context
(drafts included), accepted runs are cut by max_tokens / EOS / stop ids / stop strings exactly as
token-by-token decoding would, rejected drafts' slots are released, and no block leaks — under a
pool small enough for preemption, with chunked prefill, prefix caching, n > 1, aborts, cancelled
steps and two steps in flight. Also: the native n-gram proposer against a plain Python search, and
the config's errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm import _C
from test_rejection_sampler import reference_ngram
from test_engine_sim import check_idle, check_stop_rules, compare, make_requests, run_engine

REPEAT = 8


@pytest.fixture(scope="module")
def repeating_workload():
    reqs = make_requests(seed=11, num_requests=600)
    ref = run_engine(reqs, seed=1, num_blocks=20000, block_size=16, budget=8192, max_num_seqs=512,
                     chunked=False, prefix_caching=False, repeat_period=REPEAT)
    assert not ref["aborted"]
    check_stop_rules(reqs, ref)
    return reqs, ref


def spec_stats_ok(st, k):
    assert st.spec_decode_num_drafts > 0
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens, "some drafts rejected"
    per_pos = list(st.spec_decode_num_accepted_tokens_per_pos)
    assert len(per_pos) == k and sum(per_pos) == st.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), "position j+1 accepted only after j"


@pytest.mark.parametrize("k", [1, 4])
def test_speculation_matches_plain_decoding_under_preemption_aborts_and_cancels(repeating_workload, k):
    reqs, ref = repeating_workload
    num_blocks = 48
    spec = dict(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    run = run_engine(reqs, seed=5, num_blocks=num_blocks, block_size=16, budget=96, max_num_seqs=24,
                     abort_prob=0.03, cancel_prob=0.01, speculative=spec, repeat_period=REPEAT)
    check_stop_rules(reqs, run)
    check_idle(run, num_blocks)
    assert compare(reqs, run, ref) > 400
    st = run["stats"]
    spec_stats_ok(st, k)
    assert st.num_preemptions > 0 and st.num_chunked_prefills > 0 and st.prefix_cache_hits > 0
    assert st.num_forks > 0 and st.num_copy_orders > 0
    # fewer steps than tokens: several tokens per step
    assert st.num_generation_tokens > 0


def test_speculation_two_steps_in_flight_small_blocks(repeating_workload):
    reqs, ref = repeating_workload
    reqs = reqs[:300]
    num_blocks = 80
    run = run_engine(reqs, seed=3, num_blocks=num_blocks, block_size=8, budget=64, max_num_seqs=16,
                     policy="priority", pipeline=True, repeat_period=REPEAT,
                     speculative=dict(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4))
    check_stop_rules(reqs, run)
    check_idle(run, num_blocks)
    assert compare(reqs, run, ref) == sum(p["n"] for _, _, p, _ in reqs)
    spec_stats_ok(run["stats"], 3)


def test_speculation_takes_fewer_steps_and_switches_off_by_batch_size(repeating_workload):
    reqs, _ = repeating_workload
    reqs = [r for r in reqs if r[2]["n"] == 1][:40]
    common = dict(seed=0, num_blocks=4000, block_size=16, budget=2048, max_num_seqs=64, repeat_period=REPEAT)
    plain = run_engine(reqs, **common)
    spec = run_engine(reqs, **common, speculative=dict(num_speculative_tokens=4))
    assert spec["results"] == plain["results"]
    assert spec["steps"] < plain["steps"]
    off = run_engine(reqs, **common, speculative=dict(num_speculative_tokens=4, disable_by_batch_size=1))
    assert off["results"] == plain["results"]
    assert off["stats"].spec_decode_num_drafts == 0 and off["steps"] == plain["steps"]


def test_accept_all_emits_the_drafts():
    cfg = _C.EngineConfig(num_blocks=64, block_size=16, max_model_len=128,
                          speculative=_C.SpeculativeConfig(num_speculative_tokens=3, accept_all=True))
    core = _C.EngineCore(cfg)
    prompt = [5, 6, 7, 8, 9, 5, 6]
    core.add_request("r", np.array(prompt, dtype=np.int32), _C.RequestParams(max_tokens=20))
    out = core.schedule()
    res = core.update_from_output(out, np.array([7], dtype=np.int32))  # prompt step: no drafts
    core.release(out)
    out = core.schedule()
    # context ... 5 6 7: the earliest "6 7" is followed by 8 9 5
    assert out.draft_token_ids.tolist() == [8, 9, 5, -1] and out.num_tokens == 4
    assert out.input_ids.tolist() == [7, 8, 9, 5]
    res = core.update_from_output(out, np.array([1, 1, 1, 42], dtype=np.int32))  # all "rejected", accepted anyway
    assert res.token_ids.tolist() == [8, 9, 5, 42]
    core.release(out)
    st = core.stats()
    assert (st.spec_decode_num_drafts, st.spec_decode_num_draft_tokens, st.spec_decode_num_accepted_tokens) == (1, 3, 3)
    assert list(st.spec_decode_num_accepted_tokens_per_pos) == [1, 1, 1]
    core.abort_request("r")
    assert core.num_kv_seqs() == 0 and core.stats().num_free_blocks == 64


def test_rejected_slots_are_released_and_minus_one_rows_are_checked():
    bs = 8
    cfg = _C.EngineConfig(num_blocks=16, block_size=bs, max_model_len=128, enable_prefix_caching=False,
                          speculative=_C.SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1))
    core = _C.EngineCore(cfg)
    prompt = list(range(2, 9)) + [2]  # 8 tokens: "2" recurs, followed by 3 4 5 ...
    core.add_request("r", np.array(prompt, dtype=np.int32), _C.RequestParams(max_tokens=40))
    out = core.schedule()
    core.update_from_output(out, np.array([3], dtype=np.int32))
    core.release(out)
    free_before = core.stats().num_free_blocks  # 1 block holds the 8 computed prompt tokens
    out = core.schedule()
    assert out.draft_token_ids.tolist() == [4, 5, 6, 7, 8, 2, 3, -1][: out.num_sampled] or out.num_draft_tokens == 8
    assert out.num_draft_tokens == 7 and out.num_tokens == 8  # "2 3" -> 4 5 6 7 8 2 3 (the rest of the context)
    assert core.stats().num_free_blocks == free_before - 1  # 9 + 7 slots: a second block
    with pytest.raises(ValueError, match="-1 only past a rejection"):
        core.update_from_output(out, np.array([-1] + [0] * 7, dtype=np.int32))
    # reject at once: the correction token 50 is emitted, the drafts' slots go back
    res = core.update_from_output(out, np.array([50, 5, 6, 7, 8, 2, 3, 4], dtype=np.int32))
    core.release(out)
    assert res.token_ids.tolist() == [50]
    assert core.stats().num_free_blocks == free_before - 1  # 10 tokens, 9 computed: 2 blocks
    st = core.stats()
    assert (st.spec_decode_num_draft_tokens, st.spec_decode_num_accepted_tokens) == (7, 0)
    core.abort_request("r")
    assert core.stats().num_free_blocks == 16


def test_drafts_never_pass_max_tokens():
    cfg = _C.EngineConfig(num_blocks=64, block_size=16, max_model_len=64,
                          speculative=_C.SpeculativeConfig(num_speculative_tokens=6, accept_all=True))
    core = _C.EngineCore(cfg)
    core.add_request("r", np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32), _C.RequestParams(max_tokens=4))
    emitted = []
    while core.has_unfinished_requests():
        out = core.schedule()
        assert out.num_draft_tokens <= 4 - len(emitted) - 1
        res = core.update_from_output(out, np.full(out.num_sampled, 9, dtype=np.int32))
        emitted += res.token_ids.tolist()
        core.release(out)
    assert len(emitted) == 4 and core.num_kv_seqs() == 0


def test_accept_all_pads_the_drafts_to_k():
    cfg = _C.EngineConfig(num_blocks=64, block_size=16, max_model_len=128,
                          speculative=_C.SpeculativeConfig(num_speculative_tokens=3, accept_all=True))
    core = _C.EngineCore(cfg)
    core.add_request("r", np.array([5, 6, 7], dtype=np.int32), _C.RequestParams(max_tokens=20))
    out = core.schedule()
    core.update_from_output(out, np.array([9], dtype=np.int32))  # 9: no earlier occurrence
    core.release(out)
    out = core.schedule()
    assert out.draft_token_ids.tolist() == [9, 9, 9, -1]
    core.release(out)
    core.abort_request("r")


def test_native_ngram_proposer_matches_a_plain_search():
    seed = random.SystemRandom().randrange(2**31)
    rng = np.random.default_rng(seed)
    for _ in range(2000):
        L = int(rng.integers(1, 60))
        tokens = rng.integers(0, int(rng.integers(2, 12)), size=L).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert _C.propose_ngram(tokens, lo, hi, k) == reference_ngram(tokens, k, lo, hi), (seed, tokens, lo, hi, k)


@pytest.mark.parametrize("fields, match", [
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, disable_by_batch_size=-3), "disable_by_batch_size"),
])
def test_bad_config_is_named(fields, match):
    cfg = _C.EngineConfig(num_blocks=8, block_size=16, max_model_len=64, speculative=_C.SpeculativeConfig(**fields))
    with pytest.raises(ValueError, match=match):
        _C.EngineCore(cfg)


def test_async_scheduling_gives_no_placeholders_to_speculating_sequences():
    def core_with(disable):
        cfg = _C.EngineConfig(num_blocks=64, block_size=16, max_model_len=128, async_scheduling=True,
                              speculative=_C.SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                                                               disable_by_batch_size=disable))
        core = _C.EngineCore(cfg)
        for r in ("a", "b"):
            core.add_request(r, np.array([5, 6, 5, 6, 5], dtype=np.int32), _C.RequestParams(max_tokens=30))
        return core

    # speculating (2 running < 3): step 1 cannot pipeline the prompts' sequences: nothing scheduled
    core = core_with(3)
    first = core.schedule()
    second = core.schedule()
    assert first.num_seqs == 2 and second.num_tokens == 0 and second.num_placeholders == 0
    core.update_from_output(first, np.array([6, 6], dtype=np.int32))
    core.release(second)
    core.release(first)
    third = core.schedule()  # now with drafts ("5 6" was followed by "5 6 5")
    assert third.num_draft_tokens == 4
    core.release(third)
    # off by batch size (2 running >= 2): placeholders as without speculation
    core = core_with(2)
    first = core.schedule()
    second = core.schedule()
    assert second.num_placeholders == 2 and second.num_draft_tokens == 0
    core.release(second)
    core.release(first)


def test_n_gt_1_whose_last_prompt_chunk_is_one_token_forks_without_drafts():
    # (a review found this hang: the 1-token last chunk was a "decode" that got drafts, and the
    # forked child inherited a computed count past its tokens)
    cfg = _C.EngineConfig(num_blocks=32, block_size=16, max_model_len=64, max_num_batched_tokens=8,
                          speculative=_C.SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    core = _C.EngineCore(cfg)
    core.add_request("r", np.array([3, 4, 3, 4, 3, 4, 3, 4, 3], dtype=np.int32), _C.RequestParams(max_tokens=6, n=2))
    finished, steps = set(), 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 50, "no progress"
        out = core.schedule()
        if out.num_sampled and out.num_prefill_seqs and out.num_decode_seqs == 0 and out.num_tokens == 1:
            assert out.num_draft_tokens == 0
        res = core.update_from_output(out, np.full(out.num_sampled, 3, dtype=np.int32))
        finished |= {f[2] for f in res.finished}
        core.release(out)
    assert finished == {0, 1} and core.num_kv_seqs() == 0 and core.stats().num_free_blocks == 32
    assert core.stats().spec_decode_num_drafts > 0


def test_drafts_never_preempt_a_decode():
    # 3 blocks of 8: the prompts take one each; in the first decode step b needs the last free
    # block for its 9th token, which a's drafts (positions 8..11) would also need: b gets it
    for k in (0, 4):
        spec = _C.SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1)
        core = _C.EngineCore(_C.EngineConfig(num_blocks=3, block_size=8, max_model_len=24, speculative=spec))
        core.add_request("a", np.array([1, 2, 1, 2, 1, 2, 1], dtype=np.int32), _C.RequestParams(max_tokens=12))
        core.add_request("b", np.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int32), _C.RequestParams(max_tokens=4))
        for _ in range(2):
            out = core.schedule()
            assert out.num_seqs == 2
            core.update_from_output(out, np.full(out.num_sampled, 30, dtype=np.int32))
            core.release(out)
        assert core.stats().num_preemptions == 0
        core.abort_request("a")
        core.abort_request("b")


def test_async_scheduling_pipelines_a_sequence_whose_ngram_found_nothing():
    cfg = _C.EngineConfig(num_blocks=64, block_size=16, max_model_len=128, async_scheduling=True,
                          speculative=_C.SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    core = _C.EngineCore(cfg)
    core.add_request("a", np.array([5, 6, 7], dtype=np.int32), _C.RequestParams(max_tokens=30))
    out = core.schedule()  # the prompt
    core.update_from_output(out, np.array([9], dtype=np.int32))  # 9: never seen before
    core.release(out)
    pending = core.schedule()  # a decode: the n-gram finds nothing (no drafts)
    assert pending.num_draft_tokens == 0 and pending.num_tokens == 1
    placeholders = 0
    token = 20
    for _ in range(6):  # pipelined: the next step is scheduled before this one's token is known
        nxt = core.schedule()
        placeholders += nxt.num_placeholders
        core.update_from_output(pending, np.full(pending.num_sampled, token, dtype=np.int32))
        token += 1
        core.release(pending)
        pending = nxt
        if nxt.num_tokens == 0:  # it waits for its token to try the n-gram again
            core.release(nxt)
            pending = core.schedule()
    assert placeholders >= 4  # kSpecRetrySteps pipelined steps after each miss
    core.release(pending)
    core.abort_request("a")
