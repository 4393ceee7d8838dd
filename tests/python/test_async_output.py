"""Async output processing (LLMEngine(async_output_processing=True)): a step's detokenization and
RequestOutputs are produced during the next step (after its forward pass is launched). On CPU the
engine runs both ways over the same requests — greedy and seeded sampling, n > 1, logprobs,
min_tokens, streaming (DELTA) and final-only outputs, a stop-string request arriving mid-run
(steps are then processed at once), an abort mid-run — and every request's outputs must be
identical: same tokens, text, logprobs, finish reasons and streamed pieces."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tiny_models import build_tiny_engine_folder

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_engine_folder("llama", tmp_path_factory.mktemp("async_output_llama"), seed=3)


def _requests():
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 19, 33, 8, 12, 27)]
    return [
        ("greedy", ids[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
        ("seeded", ids[1], SamplingParams(temperature=0.9, top_p=0.8, seed=5, n=2, max_tokens=14, ignore_eos=True,
                                          logprobs=2)),
        ("delta", ids[2], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, min_tokens=4,
                                         output_kind=RequestOutputKind.DELTA)),
        ("unseeded", ids[3], SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True,
                                            output_kind=RequestOutputKind.CUMULATIVE)),
        # added at step 3: stop strings ("7>" ends any token id ending in 7 in "<id>" words)
        ("stop", ids[4], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["7>"])),
        ("aborted", ids[5], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                           output_kind=RequestOutputKind.DELTA)),
    ]


def _summary(out):
    return [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for c in out.outputs]


def _run(folder, async_output: bool):
    from pagedllm.engine.llm_engine import EngineArgs, LLMEngine

    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", kv_cache_memory_bytes=32 << 20,
                               max_model_len=256, max_num_seqs=8, async_output_processing=async_output))
    assert eng.async_output_processing is async_output
    reqs = {rid: (ids, p) for rid, ids, p in _requests()}
    for rid in ("greedy", "seeded", "delta", "unseeded", "aborted"):
        eng.add_request(rid, None, reqs[rid][0], reqs[rid][1])
    finals, streamed, num_outputs = {}, defaultdict(list), defaultdict(int)

    def record(out):
        num_outputs[out.request_id] += 1
        for c in out.outputs:
            streamed[(out.request_id, c.index)].append((list(c.token_ids), c.text))
        if out.finished:
            assert out.request_id not in finals, f"{out.request_id} finished twice"
            finals[out.request_id] = _summary(out)

    steps = 0
    deferred_steps = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            record(out)
        steps += 1
        if eng._pending is not None:
            deferred_steps.append(steps)
        if steps == 3:
            eng.add_request("stop", None, reqs["stop"][0], reqs["stop"][1])
        if steps == 6:
            final = eng.abort_request("aborted")
            assert final is not None and final.finished
            record(final)
        assert steps < 200
    eng.shutdown()
    if async_output:  # deferred before the stop-string request came (step 3) and after it finished
        assert 1 in deferred_steps and 2 in deferred_steps and max(deferred_steps) > 6, deferred_steps
        assert len(deferred_steps) < steps  # not while it ran
    else:
        assert not deferred_steps
    return finals, dict(streamed), dict(num_outputs)


def test_async_output_processing_gives_identical_outputs(folder):
    sync = _run(folder, False)
    deferred = _run(folder, True)
    finals, streamed, _ = sync
    assert set(finals) == {"greedy", "seeded", "delta", "unseeded", "stop", "aborted"}
    assert finals["stop"][0][3] == "stop" and finals["stop"][0][4] == "7>"
    assert finals["aborted"][0][3] == "abort"
    assert len(finals["greedy"][0][1]) == 20 and len(finals["seeded"]) == 2
    assert deferred[0] == finals
    assert deferred[1] == streamed
    # streaming kinds report every step in both modes (one output per step, same pieces)
    assert deferred[2]["delta"] == sync[2]["delta"] and deferred[2]["unseeded"] == sync[2]["unseeded"]


def test_async_output_processing_argument(folder):
    from pagedllm.engine.llm_engine import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match="async_output_processing must be True, False or 'auto', got 'yes'"):
        LLMEngine(EngineArgs(model=str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20,
                             max_model_len=128, async_output_processing="yes"))
    eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20,
                               max_model_len=128, async_output_processing="auto"))
    assert eng.async_output_processing is False  # "auto": on for CUDA only
    eng.shutdown()
