"""Beam search in the native core, driven by engine_sim's simulated model (no weights).

The "model" reads each sampled row's context back from a fake KV store through the step's block
tables and slot mapping (engine_sim.SimModel), and its logprobs are a pseudo-random function of
that context alone. A beam whose fork, copy-on-write copy, replay or block table were wrong would
therefore read another context and get other logprobs. Every beam-search request's hypotheses must
equal those of an independent Python implementation of Hugging Face's beam step run on the same
function; plain requests in the same runs must equal an ample run. Runs vary the pool (preemption
of whole groups), the token budget (chunked prompts and replays), prefix caching, two steps in
flight, cancelled steps, aborts, several EOS ids and ignore_eos; at the end nothing holds KV.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_sim import SimModel  # noqa: E402

from pagedllm import _C  # noqa: E402

VOCAB = 48
MAX_MODEL_LEN = 160


def ctx_logprobs(ctx) -> np.ndarray:
    """float32 [VOCAB] log-softmax of pseudo-random logits seeded by the context's token ids."""
    digest = hashlib.blake2b(np.asarray(ctx, dtype=np.int32).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    logits = rng.standard_normal(VOCAB) * 2.5
    logits -= logits.max()
    return (logits - np.log(np.exp(logits).sum())).astype(np.float32)


def reference_beam_search(prompt, width, max_tokens, eos, ignore_eos, length_penalty):
    """Hugging Face's beam step (transformers' _beam_search, early_stopping=False), written out:
    [(generated tokens, cum_logprob, score, finish_reason)] best first."""
    keep = max(2, 1 + (0 if ignore_eos else len(set(eos)))) * width
    limit = min(len(prompt) + max_tokens, MAX_MODEL_LEN)
    running = [(list(prompt), np.float32(0.0))] + [(list(prompt), np.float32(-1e9))] * (width - 1)
    finished: list = []  # (score, cum, tokens, reason), best first
    improvable, generated = True, 0
    while True:
        cands = []
        for b, (toks, score) in enumerate(running):
            lp = ctx_logprobs(toks)
            for rank, t in enumerate(np.argsort(-lp, kind="stable")[:keep]):
                cands.append((np.float32(score + lp[t]), b, rank, int(t)))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[:keep]
        at_length = len(running[0][0]) + 1 >= limit
        hits = [at_length or (not ignore_eos and t in eos) for _, _, _, t in cands]
        if improvable:
            norm = np.float32(float(generated + 1) ** length_penalty)
            for i in range(min(width, len(cands))):
                if not hits[i]:
                    continue
                score, b, _, t = cands[i]
                reason = "length" if at_length and not (not ignore_eos and t in eos) else "stop"
                hyp = (np.float32(score / norm), score, running[b][0][len(prompt):] + [t], reason)
                pos = next((j for j, h in enumerate(finished) if hyp[0] > h[0]), len(finished))
                finished.insert(pos, hyp)
                del finished[width:]
        nxt = [(running[b][0] + [t], s) for (s, b, _, t), hit in zip(cands, hits) if not hit][:width]
        while len(nxt) < width:
            s, b, _, t = cands[0]
            nxt.append((running[b][0] + [t], np.float32(s - 1e9)))
        running = nxt
        generated += 1
        if improvable and len(finished) >= width:
            best = max(s for _, s in running) / np.float32(float(generated) ** length_penalty)
            improvable = bool(best > finished[-1][0])
        if not improvable or all(hits):
            return [(tokens, float(cum), float(score), reason) for score, cum, tokens, reason in finished]


def make_workload(seed: int):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(24):
        prompt = rng.integers(2, VOCAB, size=int(rng.integers(1, 40))).tolist()
        if i % 3 != 2:
            eos = [0] if rng.random() < 0.7 else [0, 1]
            p = dict(use_beam_search=True, n=int(rng.integers(1, 5)), max_tokens=int(rng.integers(1, 30)),
                     eos_token_ids=eos, ignore_eos=bool(rng.random() < 0.3),
                     length_penalty=float(rng.choice([0.5, 1.0, 1.5])))
        else:
            p = dict(n=int(rng.integers(1, 3)), max_tokens=int(rng.integers(1, 30)), eos_token_ids=[0])
        reqs.append((f"r{i}", prompt, p))
    return reqs


def run(reqs, *, seed, num_blocks, budget, max_num_seqs=16, block_size=8, chunked=True, prefix_caching=True,
        pipeline=False, cancel_prob=0.0, abort_prob=0.0):
    cfg = _C.EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                          max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=chunked,
                          enable_prefix_caching=prefix_caching)
    core = _C.EngineCore(cfg)
    model = SimModel(num_blocks, block_size, MAX_MODEL_LEN, VOCAB, seed=99)
    rng = np.random.default_rng(seed)
    by_id = {rid: (prompt, p) for rid, prompt, p in reqs}
    tokens: dict[int, list[int]] = {}
    owner: dict[int, tuple[str, int]] = {}
    beams, plain, aborted, live = {}, {}, set(), set()
    k_max = max(max(2, 1 + len(p["eos_token_ids"])) * p["n"] for _, _, p in reqs)

    def apply(out):
        contexts = []
        sampled = model.step(out, lambda _sid, ctx: contexts.append(np.array(ctx)))
        ids = np.zeros((out.num_sampled, k_max), dtype=np.int64)
        lps = np.full((out.num_sampled, k_max), -np.inf, dtype=np.float32)
        for r, ctx in enumerate(contexts):
            lp = ctx_logprobs(ctx)
            order = np.argsort(-lp, kind="stable")[:k_max]
            ids[r], lps[r] = order, lp[order]
        result = core.update_from_output(out, sampled, ids, lps)
        for seq_id, tok in zip(result.seq_ids.tolist(), result.token_ids.tolist()):
            tokens[seq_id].append(tok)
        for rid, seq_id, index, reason, _ in result.finished:
            if not by_id[rid][1].get("use_beam_search"):
                plain[(rid, index)] = (tokens[seq_id][len(by_id[rid][0]):], reason)
        for rid, hyps in result.beam_results:
            beams[rid] = hyps
        for rid in result.request_finished:
            live.discard(rid)

    pending = list(reqs)
    steps = 0
    while pending or core.has_unfinished_requests():
        steps += 1
        assert steps < 20_000, "no progress"
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                rid, prompt, p = pending.pop(0)
                core.add_request(rid, np.asarray(prompt, dtype=np.int32), _C.RequestParams(**p))
                live.add(rid)
        if abort_prob and live and rng.random() < abort_prob:
            rid = sorted(live)[int(rng.integers(len(live)))]
            assert core.abort_request(rid)
            aborted.add(rid)
            live.discard(rid)
        out = core.schedule()
        for seq_id, rid, index in out.new_seqs:
            tokens[seq_id] = list(by_id[rid][0])
            owner[seq_id] = (rid, index)
        if cancel_prob and rng.random() < cancel_prob:
            model.register(out)
            core.release(out)
            continue
        out2 = core.schedule() if pipeline else None
        if out2 is not None:
            for seq_id, rid, index in out2.new_seqs:
                tokens[seq_id] = list(by_id[rid][0])
        apply(out)
        if out2 is not None:
            apply(out2)
            core.release(out2)
        core.release(out)
    assert core.num_kv_seqs() == 0
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return dict(beams=beams, plain=plain, aborted=aborted, stats=stats)


@pytest.fixture(scope="module")
def workload():
    reqs = make_workload(5)
    ample = run(reqs, seed=0, num_blocks=4096, budget=4096)
    return reqs, ample


def test_ample_run_matches_the_reference(workload):
    reqs, ample = workload
    n_beam = 0
    for rid, prompt, p in reqs:
        if not p.get("use_beam_search"):
            continue
        n_beam += 1
        want = reference_beam_search(prompt, p["n"], p["max_tokens"], p["eos_token_ids"], p["ignore_eos"],
                                     p["length_penalty"])
        got = ample["beams"][rid]
        assert [h[0] for h in got] == [h[0] for h in want], rid
        assert [h[3] for h in got] == [h[3] for h in want], rid
        for g, w in zip(got, want):
            assert abs(g[1] - w[1]) < 1e-4 and abs(g[2] - w[2]) < 1e-4, (rid, g, w)
    assert n_beam >= 12 and ample["stats"].num_forks > 0


@pytest.mark.parametrize("kw", [
    dict(num_blocks=30, budget=24),
    dict(num_blocks=30, budget=24, prefix_caching=False),
    dict(num_blocks=28, budget=9, max_num_seqs=8),
    dict(num_blocks=30, budget=64, pipeline=True),
    dict(num_blocks=30, budget=24, cancel_prob=0.15),
    dict(num_blocks=4096, budget=4096, chunked=False),
], ids=["tiny-pool", "tiny-pool-no-prefix-cache", "tiny-budget-few-seqs", "two-in-flight", "cancels",
        "no-chunking"])
def test_same_results_under_pressure(workload, kw):
    reqs, ample = workload
    got = run(reqs, seed=1, **kw)
    assert got["beams"] == ample["beams"]
    assert got["plain"] == ample["plain"]
    if kw["num_blocks"] < 100 and "max_num_seqs" not in kw:
        assert got["stats"].num_preemptions > 0


def test_aborts_mid_search_leak_nothing(workload):
    reqs, ample = workload
    got = run(reqs, seed=2, num_blocks=30, budget=24, abort_prob=0.1)
    assert got["aborted"]
    for rid, hyps in got["beams"].items():  # what was not aborted finished as in the ample run
        assert hyps == ample["beams"][rid]


@pytest.mark.parametrize("prefix_caching,chunked", [(False, True), (True, True), (False, False), (True, False)])
def test_a_preempted_group_comes_back_in_a_tight_pool(prefix_caching, chunked):
    """A long plain request ahead of a 4-beam group in a pool that barely fits the group: the group
    is preempted again and again, yet both finish (its leader replays once, the other beams fork the
    leader's KV: a re-admission needs the blocks the group held, not 4 whole contexts)."""
    cfg = _C.EngineConfig(num_blocks=20, block_size=8, max_num_batched_tokens=64 if chunked else 160, max_num_seqs=16,
                          max_model_len=160, enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching)
    core = _C.EngineCore(cfg)
    model = SimModel(20, 8, 160, VOCAB, seed=3)
    core.add_request("A", (np.arange(60) % 40 + 2).astype(np.int32),
                     _C.RequestParams(max_tokens=90, eos_token_ids=[0], arrival_time=1.0))
    prompt = (np.arange(40) % 41 + 2).tolist()
    core.add_request("B", np.asarray(prompt, dtype=np.int32),
                     _C.RequestParams(use_beam_search=True, n=4, max_tokens=16, eos_token_ids=[0], arrival_time=2.0))
    done, beams = set(), {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        out = core.schedule()
        contexts = []
        sampled = model.step(out, lambda _sid, ctx: contexts.append(np.array(ctx)))
        ids = np.zeros((out.num_sampled, 8), dtype=np.int64)
        lps = np.zeros((out.num_sampled, 8), dtype=np.float32)
        for r, ctx in enumerate(contexts):
            lp = ctx_logprobs(ctx)
            order = np.argsort(-lp, kind="stable")[:8]
            ids[r], lps[r] = order, lp[order]
        result = core.update_from_output(out, sampled, ids, lps)
        done.update(result.request_finished)
        beams.update(dict(result.beam_results))
        core.release(out)
    assert done == {"A", "B"}
    assert core.stats().num_preemptions > 0
    want = reference_beam_search(prompt, 4, 16, [0], False, 1.0)
    assert [h[0] for h in beams["B"]] == [h[0] for h in want]
    assert core.num_kv_seqs() == 0 and core.stats().num_free_blocks == 20


def test_more_beams_than_the_token_budget_is_refused():
    cfg = _C.EngineConfig(num_blocks=64, block_size=8, max_num_batched_tokens=3, max_num_seqs=16, max_model_len=64)
    core = _C.EngineCore(cfg)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        core.add_request("B", np.arange(2, 12, dtype=np.int32),
                         _C.RequestParams(use_beam_search=True, n=4, max_tokens=4, eos_token_ids=[0]))
    assert not core.has_unfinished_requests()
