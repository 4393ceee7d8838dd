"""Async scheduling (LLMEngine(async_scheduling=True)): step N + 1 is scheduled and launched before
step N's tokens reach the host, its placeholder token ids filled on the device from step N's
sampled ids. On CPU the engine runs both ways over the same requests — greedy and seeded
sampling, n > 1, logprobs and prompt logprobs, penalties, min_tokens, stop token ids that end
sequences at steps nobody can predict (so the next step's row is wasted), a stop string, an
abort mid-run, streaming — and every request's outputs must be identical, with placeholders
actually used and no KV block left held. Also under preemption (a tiny KV pool) with chunked
prefill, and on the bf16 CPU path whose LM head takes the greedy argmax itself. Plus the
fill_placeholder_ids op against a reference, and PendingSample's row scatter."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from tiny_models import build_tiny_engine_folder

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_engine_folder("llama", tmp_path_factory.mktemp("async_sched_llama"), seed=5)


def _requests():
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    g = torch.Generator().manual_seed(17)
    ids = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 19, 33, 8, 12, 27, 9, 40, 14)]
    # every id ending in 3 stops (about 1 token in 10): finishes at steps nobody predicts
    stops = list(range(3, 1024, 10))
    return [
        ("greedy", ids[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
        ("seeded", ids[1], SamplingParams(temperature=0.9, top_p=0.8, seed=5, n=2, max_tokens=14, ignore_eos=True,
                                          logprobs=2)),
        ("delta", ids[2], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, min_tokens=4,
                                         output_kind=RequestOutputKind.DELTA)),
        ("unseeded", ids[3], SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)),
        ("stop_ids", ids[6], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=stops)),
        ("stop_ids_seeded", ids[7], SamplingParams(temperature=0.8, seed=9, max_tokens=40, stop_token_ids=stops,
                                                   n=3, output_kind=RequestOutputKind.DELTA)),
        ("penalty", ids[8], SamplingParams(temperature=0.7, seed=3, max_tokens=25, ignore_eos=True,
                                           repetition_penalty=1.3, presence_penalty=0.5, prompt_logprobs=2)),
        # added at step 3: stop strings ("7>" ends any token id ending in 7 in "<id>" words)
        ("stop", ids[4], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["7>"])),
        ("aborted", ids[5], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                           output_kind=RequestOutputKind.DELTA)),
    ]


def _summary(out):
    prompt_lp = None if out.prompt_logprobs is None else [
        None if d is None else {t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs]
    return [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs],
             prompt_lp)
            for c in out.outputs]


def _same(a, b, tol=1e-4):
    """Equal outputs: tokens, text, finish reasons exactly; logprobs within tol (the logits of a row
    can differ in the last bits when the batch around it differs: a wasted row, a skipped step)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= tol
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, tol) for x, y in zip(a, b))
    return a == b


def _engine(folder, async_sched, **kw):
    from pagedllm.engine.llm_engine import EngineArgs, LLMEngine

    args = dict(model=str(folder), dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256,
                max_num_seqs=16, async_scheduling=async_sched)
    args.update(kw)
    eng = LLMEngine(EngineArgs(**args))
    assert eng.async_scheduling is async_sched
    placeholders = []
    execute = eng.runner.execute_model

    def counting(sched, **k):
        placeholders.append(int(sched.num_placeholders))
        return execute(sched, **k)

    eng.runner.execute_model = counting
    return eng, placeholders


def _drain_and_check(eng):
    """After the run: nothing in flight, no output held, no KV block held by a sequence."""
    assert not eng.has_unfinished_requests()
    stats = eng.core.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_usage == 0.0
    assert eng.core.num_outputs_held == 0


def _run(folder, async_sched: bool):
    eng, placeholders = _engine(folder, async_sched)
    reqs = {rid: (ids, p) for rid, ids, p in _requests()}
    for rid in reqs:
        if rid != "stop":
            eng.add_request(rid, None, reqs[rid][0], reqs[rid][1])
    finals, streamed = {}, defaultdict(list)

    def record(out):
        assert out.request_id not in finals, f"{out.request_id}: an output after its final one"
        for c in out.outputs:
            streamed[(out.request_id, c.index)].append((list(c.token_ids), c.text))
        if out.finished:
            finals[out.request_id] = _summary(out)

    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            record(out)
        steps += 1
        if steps == 3:
            eng.add_request("stop", None, reqs["stop"][0], reqs["stop"][1])
        if steps == 6:
            final = eng.abort_request("aborted")
            assert final is not None and final.finished
            record(final)
        assert steps < 300
    _drain_and_check(eng)
    eng.shutdown()
    return finals, dict(streamed), placeholders


def test_async_scheduling_gives_identical_outputs(folder):
    finals, streamed, none = _run(folder, False)
    a_finals, a_streamed, placeholders = _run(folder, True)
    assert set(finals) == {rid for rid, _, _ in _requests()}
    assert not any(none)
    assert sum(placeholders) > 50  # most decode rows were placeholders
    # the workload covers what it should: early stops, a stop string, an abort, prompt logprobs
    assert any(len(c[1]) < 40 and c[3] == "stop" for c in finals["stop_ids"] + finals["stop_ids_seeded"])
    assert finals["stop"][0][3] == "stop" and finals["stop"][0][4] == "7>"
    assert finals["aborted"][0][3] == "abort"
    assert finals["penalty"][0][7] is not None
    for rid in finals:
        if rid == "unseeded":  # the engine's shared stream: depends on the batch composition
            assert len(a_finals[rid][0][1]) == len(finals[rid][0][1]) == 9
            continue
        if rid == "aborted":  # DELTA pieces grouped differently around the abort: compared joined below
            assert a_finals[rid][0][3] == finals[rid][0][3] == "abort"
            continue
        assert _same(a_finals[rid], finals[rid]), (rid, a_finals[rid], finals[rid])
    for key in streamed:  # streamed pieces, where each step gives one token in both modes
        if key[0] in ("greedy", "delta", "stop"):
            assert a_streamed[key] == streamed[key], key
    # the aborted request (DELTA) streamed the same tokens in both modes: the abort finishes the
    # launched step and its final output carries what that step produced
    def joined(stream):
        return [t for ids, _ in stream for t in ids], "".join(text for _, text in stream)

    assert joined(a_streamed[("aborted", 0)]) == joined(streamed[("aborted", 0)])
    assert len(joined(streamed[("aborted", 0)])[0]) >= 4


def _run_simple(folder, async_sched, requests, **kw):
    eng, placeholders = _engine(folder, async_sched, **kw)
    for rid, ids, p in requests:
        eng.add_request(rid, None, ids, p)
    finals = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = _summary(out)
        steps += 1
        assert steps < 2000
    _drain_and_check(eng)
    preemptions = eng.core.stats().num_preemptions
    eng.shutdown()
    return finals, placeholders, preemptions


def test_async_scheduling_under_preemption_and_chunked_prefill(folder):
    """A KV pool of a few blocks and a 48-token budget: long prompts are chunked and running
    sequences are preempted and recomputed; async and sync give the same outputs."""
    from pagedllm import SamplingParams

    g = torch.Generator().manual_seed(23)
    stops = list(range(5, 1024, 13))
    reqs = [(f"r{i}", torch.randint(3, 1024, (n,), generator=g).tolist(),
             SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=30 + i, stop_token_ids=stops))
            for i, n in enumerate((70, 12, 45, 30, 90, 8, 33, 60))]
    # the tiny model in float32: 2 layers x 2 KV heads x head_dim 64 x 4 bytes x (K, V) = 2 KiB per
    # token; 12 blocks of 16 tokens (the longest request needs 8)
    kw = dict(kv_cache_memory_bytes=12 * 16 * 2048, max_num_batched_tokens=48, block_size=16)
    finals, none, pre_sync = _run_simple(folder, False, reqs, **kw)
    a_finals, placeholders, pre_async = _run_simple(folder, True, reqs, **kw)
    assert pre_sync > 0 and pre_async > 0, (pre_sync, pre_async)
    assert not any(none) and sum(placeholders) > 20
    assert _same(a_finals, finals)


def test_async_scheduling_with_the_amx_argmax_head(folder, tmp_path):
    """bf16 on CPU: where the LM head takes the greedy argmax itself (no logits), the ids it
    returns feed the next step's placeholders."""
    from pagedllm import SamplingParams

    g = torch.Generator().manual_seed(31)
    reqs = [(f"g{i}", torch.randint(3, 1024, (n,), generator=g).tolist(),
             SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True))
            for i, n in enumerate((9, 30, 17))]
    from pagedllm.engine.llm_engine import EngineArgs, LLMEngine

    probe = LLMEngine(EngineArgs(model=str(folder), dtype="bfloat16", kv_cache_memory_bytes=8 << 20,
                                 max_model_len=128, device="cpu"))
    head = probe.runner.argmax_applies(1)
    probe.shutdown()
    if not head:
        pytest.skip("this CPU has no AMX LM head (the argmax-in-the-head path does not exist here)")
    finals, _, _ = _run_simple(folder, False, reqs, dtype="bfloat16", device="cpu")
    a_finals, placeholders, _ = _run_simple(folder, True, reqs, dtype="bfloat16", device="cpu")
    assert sum(placeholders) > 10
    assert _same(a_finals, finals)


def test_async_scheduling_argument(folder):
    from pagedllm.engine.llm_engine import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match="async_scheduling must be True, False or 'auto', got 'on'"):
        LLMEngine(EngineArgs(model=str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20,
                             max_model_len=128, async_scheduling="on"))
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20,
                               max_model_len=128, device="cpu"))
    assert eng.async_scheduling is False  # "auto": on for CUDA only
    eng.shutdown()
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20,
                               max_model_len=128, device="cpu", async_scheduling="true"))  # the CLI's spelling
    assert eng.async_scheduling is True
    eng.shutdown()


def test_llm_generate_leaves_nothing_in_flight(folder):
    """LLM.generate stops once its requests finished; the step launched after their last tokens
    (placeholders only) must not stay held: no output held, nothing in flight, a second call
    gives the same tokens."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128, async_scheduling=True)
    engine = llm.llm_engine
    assert engine.async_scheduling is True
    prompt = [{"prompt_token_ids": [5, 9, 33, 1]}]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[5]  # the request now ends on a stop id, with a placeholder step after it
    cut = free.token_ids.index(stop) + 1
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    for _ in range(2):
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == list(free.token_ids[:cut]) and out.finish_reason == "stop"
        assert engine.core.num_outputs_held == 0 and engine._inflight is None
        assert not engine.has_unfinished_requests()
    llm.shutdown()


def _check_fill_placeholder_ids(device, cases, seed):
    """ops.fill_placeholder_ids on `device` against torch.where over fresh random ids, rows
    (-1 = keep) and sampled ids, for each (tokens, sampled rows) in cases."""
    from pagedllm import ops

    g = torch.Generator().manual_seed(seed)
    for t, r in cases:
        ids = torch.randint(0, 5000, (t,), generator=g, dtype=torch.int32)
        rows = torch.randint(-1, r, (t,), generator=g, dtype=torch.int32)
        sampled = torch.randint(0, 150000, (r,), generator=g, dtype=torch.int64)
        expected = torch.where(rows >= 0, sampled[rows.clamp(min=0).long()].to(torch.int32), ids)
        out = ops.fill_placeholder_ids(ids.to(device), rows.to(device), sampled.to(device))
        assert torch.equal(out.cpu(), expected)


def test_fill_placeholder_ids_matches_reference():
    _check_fill_placeholder_ids("cpu", ((1, 1), (7, 3), (300, 129)), seed=3)


def test_fill_placeholder_ids_errors():
    from pagedllm import ops

    ids = torch.zeros(4, dtype=torch.int32)
    rows = torch.tensor([0, -1, 5, 1], dtype=torch.int32)
    sampled = torch.arange(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"prev_rows\[2\] = 5 but sampled has 3 rows"):
        ops.fill_placeholder_ids(ids, rows, sampled)
    with pytest.raises(ValueError, match="input_ids must be int32, got int64"):
        ops.fill_placeholder_ids(ids.long(), rows, sampled)
    with pytest.raises(ValueError, match="prev_rows"):
        ops.fill_placeholder_ids(ids, rows[:3], sampled)


@pytest.mark.cuda
def test_fill_placeholder_ids_cuda_matches_reference():
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    _check_fill_placeholder_ids("cuda", ((1, 1), (256, 256), (1000, 77)), seed=4)


def test_pending_sample_scatters_skipped_rows():
    from pagedllm.sample import Sampler
    from pagedllm import SamplingParams

    sampler = Sampler(50, seed=0)
    for seq in (3, 8):
        sampler.add_sequence(seq, SamplingParams(temperature=0.0, logprobs=1), [1, 2], 0, [])
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    pending = sampler.sample_async(logits, np.array([3, 8]), rows=np.array([1, 3]), num_rows=4)
    out = pending.result()
    want = logits.argmax(-1)
    assert pending.device_ids.tolist() == [0, int(want[0]), 0, int(want[1])]
    assert out.sampled_token_ids.tolist() == [0, int(want[0]), 0, int(want[1])]
    assert out.sampled_token_ids.dtype == np.int32
    assert out.logprobs.token_ids.shape == (2, 2)  # logprobs of the sampled rows only
    assert sampler.known(np.array([3, 4, 8])).tolist() == [True, False, True]
