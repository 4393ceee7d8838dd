"""Randomized end-to-end runs of pagedllm._C.EngineCore driven by the simulated model.

Thousands of requests with random lengths, shared prefixes, salts, n > 1, prompt-only and
prompt-logprob requests, min/max tokens, EOS / stop tokens and caller-side stop strings run
against a KV pool so small that preemption happens often, with chunked prefill, random aborts,
cancelled steps and two steps in flight. Checked: every request finishes or is aborted; output
lengths and finish reasons obey the stop rules; token sequences equal those of a run with an ample
pool, no chunking and no prefix caching (aborted ones are a prefix of it); the budget and
max_num_seqs hold every step; no block leaks; the stats prove that each feature fired.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_sim import SimModel
from pagedllm import _C

VOCAB = 64
EOS = 1
STOP_STR_TOKEN = 63  # the caller-side "stop string": finish_sequence(seq_id, "STOP")
MAX_MODEL_LEN = 256


def make_requests(seed: int, num_requests: int):
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(2, VOCAB, size=int(rng.integers(16, 90))).tolist() for _ in range(6)]
    reqs = []
    for i in range(num_requests):
        plen = int(rng.integers(1, 160))
        if rng.random() < 0.5:
            pre = prefixes[int(rng.integers(len(prefixes)))]
            prompt = (pre + rng.integers(2, VOCAB, size=plen).tolist())[: max(plen, len(pre) + 1)]
        else:
            prompt = rng.integers(2, VOCAB, size=plen).tolist()
        prompt = prompt[: MAX_MODEL_LEN - 1]
        room = MAX_MODEL_LEN - len(prompt)
        u = rng.random()
        max_tokens = 0 if u < 0.03 else (-1 if u < 0.08 else int(rng.integers(1, min(40, room) + 1)))
        min_tokens = int(rng.integers(0, min(max_tokens, 6) + 1)) if max_tokens > 0 else int(rng.integers(0, 3))
        if max_tokens == 0:
            min_tokens = 0
        p = dict(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            eos_token_ids=[EOS],
            ignore_eos=bool(rng.random() < 0.1),
            stop_token_ids=rng.integers(2, VOCAB - 1, size=int(rng.integers(0, 3))).tolist(),
            n=int(rng.choice([1, 1, 1, 1, 1, 2, 3])),
            priority=int(rng.integers(0, 4)),
            arrival_time=float(i),
            cache_salt="" if rng.random() < 0.85 else f"salt{i % 2}",
            prompt_logprobs=bool(rng.random() < 0.1),
        )
        reqs.append((f"req{i}", prompt, p, bool(rng.random() < 0.15)))  # last: uses a stop string
    return reqs


def run_engine(reqs, *, seed, num_blocks, block_size, budget, max_num_seqs, chunked=True,
               prefix_caching=True, policy="fcfs", abort_prob=0.0, cancel_prob=0.0, pipeline=False,
               speculative=None, repeat_period=0):
    """speculative: SpeculativeConfig fields (n-gram drafts) or None; repeat_period: SimModel's."""
    cfg = _C.EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                          max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                          enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching,
                          scheduling_policy=policy)
    k = 0
    if speculative:
        cfg.speculative = _C.SpeculativeConfig(**speculative)
        k = speculative["num_speculative_tokens"]
    core = _C.EngineCore(cfg)
    model = SimModel(num_blocks, block_size, MAX_MODEL_LEN, VOCAB, seed=1234, repeat_period=repeat_period)
    rng = np.random.default_rng(seed)
    by_id = {rid: (prompt, p, stop_str) for rid, prompt, p, stop_str in reqs}
    seq_info: dict[int, tuple[str, int]] = {}
    tokens: dict[int, list[int]] = {}  # seq id -> prompt + outputs
    results: dict[tuple[str, int], tuple[list[int], str, object]] = {}
    aborted: dict[str, dict[int, list[int]]] = {}
    live: set[str] = set()
    plp_covered: dict[str, list[int]] = {}
    next_req = 0
    steps = 0

    drafts: dict[int, list[int]] = {}  # seq id -> this step's drafts

    def check_context(seq_id, ctx):
        # a verification row reads the committed tokens and the drafts before its position
        expected = tokens[seq_id] + drafts.get(seq_id, [])[: max(0, len(ctx) - len(tokens[seq_id]))]
        assert len(ctx) == len(expected) and np.array_equal(ctx, expected), f"seq {seq_id}: wrong context"

    def check_step(out):
        assert 0 <= out.num_tokens <= budget
        assert out.num_seqs <= max_num_seqs and out.num_sampled <= max_num_seqs * (1 + k)
        for seq_id in out.seq_ids.tolist():  # a sequence is in one step at a time
            drafts[seq_id] = []
        for seq_id, d in zip(out.sample_seq_ids.tolist(), out.draft_token_ids.tolist()):
            if d >= 0:
                drafts[seq_id].append(d)
        assert sum(len(drafts[s]) for s in out.seq_ids.tolist()) == out.num_draft_tokens
        assert all(len(drafts[s]) <= k for s in out.seq_ids.tolist())
        qsl = out.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == out.num_tokens and (np.diff(qsl) >= 1).all()
        assert (np.diff(qsl)[: out.num_decode_seqs] == 1).all()
        assert out.num_decode_seqs + out.num_prefill_seqs == out.num_seqs
        for seq_id, rid, index in out.new_seqs:
            assert seq_id not in seq_info
            seq_info[seq_id] = (rid, index)
            tokens[seq_id] = list(by_id[rid][0])

    def record_prompt_logprob_rows(out):  # only for steps that ran (a cancelled step hands them out again)
        for rid, first_row, num_rows, first_pos in out.prompt_logprob_rows:
            prompt = by_id[rid][0]
            rows = slice(first_row, first_row + num_rows)
            assert np.array_equal(out.positions[rows], np.arange(first_pos, first_pos + num_rows))
            assert np.array_equal(out.input_ids[rows], prompt[first_pos:first_pos + num_rows])
            plp_covered.setdefault(rid, []).extend(range(first_pos, first_pos + num_rows))

    def apply(out, sampled):
        record_prompt_logprob_rows(out)
        result = core.update_from_output(out, sampled)
        finished_now = {int(f[1]) for f in result.finished}
        for f in result.finished:
            rid, seq_id, index, reason, stop_reason = f
            results[(rid, index)] = (tokens[seq_id][len(by_id[rid][0]):], reason, stop_reason)
        for rid in result.request_finished:
            live.discard(rid)
        # tokens in order; a sequence's tokens after its stop string are dropped (a speculative run
        # appends several tokens per sequence: the engine's output processor does the same)
        stopped: set[int] = set()
        for seq_id, tok in zip(result.seq_ids.tolist(), result.token_ids.tolist()):
            if seq_id in stopped:
                continue
            tokens[seq_id].append(tok)
            rid, index = seq_info[seq_id]
            prompt, p, stop_str = by_id[rid]
            n_out = len(tokens[seq_id]) - len(prompt)
            if stop_str and tok == STOP_STR_TOKEN and n_out >= p["min_tokens"]:
                stopped.add(seq_id)
                results[(rid, index)] = (tokens[seq_id][len(prompt):], "stop", "STOP")
                if seq_id not in finished_now and core.finish_sequence(seq_id, "STOP"):
                    live.discard(rid)
            elif seq_id in finished_now:
                results[(rid, index)] = (tokens[seq_id][len(prompt):],) + results[(rid, index)][1:]

    while next_req < len(reqs) or core.has_unfinished_requests():
        steps += 1
        assert steps < 100_000, "no progress"
        for _ in range(int(rng.integers(0, 9))):
            if next_req < len(reqs):
                rid, prompt, p, _ = reqs[next_req]
                core.add_request(rid, np.asarray(prompt, dtype=np.int32), _C.RequestParams(**p))
                live.add(rid)
                next_req += 1
        if abort_prob and live and rng.random() < abort_prob:
            rid = sorted(live)[int(rng.integers(len(live)))]
            assert core.abort_request(rid)
            aborted[rid] = {}
            live.discard(rid)
        out = core.schedule()
        check_step(out)
        if cancel_prob and rng.random() < cancel_prob:
            model.register(out)
            core.release(out)  # the "model" failed: nothing ran
            continue
        out2 = core.schedule() if pipeline else None
        if out2 is not None:
            check_step(out2)
            assert not set(out.seq_ids.tolist()) & set(out2.seq_ids.tolist())
        sampled = model.step(out, check_context)
        apply(out, sampled)
        if out2 is not None:
            apply(out2, model.step(out2, check_context))
            core.release(out2)
        core.release(out)
        st = core.stats()
        assert st.num_running <= max_num_seqs

    # Aborted requests: what they produced so far.
    for seq_id, (rid, index) in seq_info.items():
        if rid in aborted and (rid, index) not in results:
            aborted[rid][index] = tokens[seq_id][len(by_id[rid][0]):]
    return dict(results=results, aborted=aborted, stats=core.stats(), core=core, steps=steps,
                plp_covered=plp_covered)


def check_stop_rules(reqs, run):
    results, aborted = run["results"], run["aborted"]
    for rid, prompt, p, stop_str in reqs:
        if rid in aborted:
            continue
        for index in range(p["n"]):
            out, reason, stop_reason = results[(rid, index)]
            mt = p["max_tokens"]
            assert mt < 0 or len(out) <= mt
            if reason == "length":
                assert len(out) == mt or len(prompt) + len(out) == MAX_MODEL_LEN, (rid, len(out), mt)
                assert stop_reason is None
            else:
                assert reason == "stop", reason
                assert len(out) >= p["min_tokens"]
                last = out[-1]
                if stop_reason is None:
                    assert last == EOS and not p["ignore_eos"]
                elif stop_reason == "STOP":
                    assert stop_str and last == STOP_STR_TOKEN
                else:
                    assert stop_reason == last and last in p["stop_token_ids"]
        if p["prompt_logprobs"]:
            assert sorted(run["plp_covered"].get(rid, [])) == list(range(len(prompt) - 1)), rid


def check_idle(run, num_blocks):
    st, core = run["stats"], run["core"]
    assert not core.has_unfinished_requests()
    assert st.num_running == 0 and st.num_waiting == 0 and st.num_unfinished_requests == 0
    assert st.num_free_blocks == num_blocks and st.kv_usage == 0.0
    assert core.num_kv_seqs() == 0
    assert core.num_outputs_held == 0


@pytest.fixture(scope="module")
def workload():
    reqs = make_requests(seed=7, num_requests=2000)
    ref = run_engine(reqs, seed=1, num_blocks=20000, block_size=16, budget=8192, max_num_seqs=512,
                     chunked=False, prefix_caching=False)
    assert not ref["aborted"]
    check_stop_rules(reqs, ref)
    check_idle(ref, 20000)
    assert ref["stats"].num_preemptions == 0 and ref["stats"].num_chunked_prefills == 0
    return reqs, ref


def compare(reqs, run, ref):
    n_compared = 0
    for rid, prompt, p, _ in reqs:
        for index in range(p["n"]):
            want = ref["results"][(rid, index)]
            if rid in run["aborted"]:
                got = run["aborted"][rid].get(index)
                if got is None:
                    got = run["results"].get((rid, index), (None,))[0]
                if got is not None:
                    assert want[0][: len(got)] == got, (rid, index)
                continue
            assert run["results"][(rid, index)] == want, (rid, index)
            n_compared += 1
    return n_compared


@pytest.mark.slow
def test_tiny_pool_fcfs_chunked_aborts_cancels_matches_ample_run(workload):
    reqs, ref = workload
    num_blocks = 48
    run = run_engine(reqs, seed=2, num_blocks=num_blocks, block_size=16, budget=96, max_num_seqs=24,
                     abort_prob=0.03, cancel_prob=0.01)
    check_stop_rules(reqs, run)
    check_idle(run, num_blocks)
    assert compare(reqs, run, ref) > 1500
    st = run["stats"]
    assert st.num_preemptions > 50
    assert st.num_recomputed_tokens > 0
    assert st.num_chunked_prefills > 100
    assert st.prefix_cache_hits > 0
    assert st.num_forks > 0 and st.num_copy_orders > 0
    assert st.num_aborted_requests == len(run["aborted"]) > 0


@pytest.mark.slow
def test_tiny_pool_priority_two_steps_in_flight_matches_ample_run(workload):
    reqs, ref = workload
    reqs = reqs[:1000]
    num_blocks = 80
    run = run_engine(reqs, seed=3, num_blocks=num_blocks, block_size=8, budget=64, max_num_seqs=16,
                     policy="priority", pipeline=True)
    check_stop_rules(reqs, run)
    check_idle(run, num_blocks)
    assert compare(reqs, run, ref) == sum(p["n"] for _, _, p, _ in reqs)
    st = run["stats"]
    assert st.num_preemptions > 0 and st.num_chunked_prefills > 0 and st.prefix_cache_hits > 0
    assert st.num_forks > 0 and st.num_copy_orders > 0


def test_no_chunking_ample_pool_with_prefix_caching_matches(workload):
    reqs, ref = workload
    reqs = reqs[:300]
    run = run_engine(reqs, seed=4, num_blocks=4000, block_size=32, budget=1024, max_num_seqs=64,
                     chunked=False)
    check_stop_rules(reqs, run)
    check_idle(run, 4000)
    assert compare(reqs, run, ref) == sum(p["n"] for _, _, p, _ in reqs)
    assert run["stats"].prefix_cache_hits > 0 and run["stats"].num_chunked_prefills == 0
