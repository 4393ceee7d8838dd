"""AsyncLLM on a random tiny model: outputs equal the offline engine's, cumulative vs DELTA,
abort within a second with no KV block left, concurrent requests batched, bad requests rejected
with the engine still serving, metrics, shutdown and a second engine in the same process."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import MAX_MODEL_LEN, tiny_model_dir  # noqa: E402

from pagedllm.engine.async_llm import AsyncEngineArgs, AsyncLLM, EngineDeadError  # noqa: E402
from pagedllm.engine.core_client import InprocClient, MPClient  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["process", "thread"])
def engine(request):
    """The engine in its own process (the default) and on a thread of this one: every test runs on both."""
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(tiny_model_dir()), dtype="float32", max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 << 20, max_num_seqs=32), multiprocess=request.param == "process")
    assert isinstance(eng.client, MPClient if request.param == "process" else InprocClient)
    yield eng
    eng.shutdown()


def metric(engine, name: str) -> float:
    return next(m.value for m in engine.get_metrics() if m.name == "pagedllm:" + name and not m.labels.get("finished_reason"))


async def collect(engine, prompt, params, rid):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


def test_cumulative_and_delta_agree_and_match_offline(engine):
    prompt = {"prompt_token_ids": [5, 17, 300, 4000, 12, 99, 1000, 7]}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    delta = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        return await asyncio.gather(collect(engine, prompt, params, "cum"), collect(engine, prompt, delta, "delta"))

    cum, dl = asyncio.run(main())
    final = cum[-1].outputs[0]
    assert cum[-1].finished and final.finish_reason == "length" and len(final.token_ids) == 24
    # cumulative outputs grow monotonically
    lengths = [len(o.outputs[0].token_ids) for o in cum]
    assert lengths == sorted(lengths)
    assert all(cum[k].outputs[0].text.startswith(cum[k - 1].outputs[0].text) for k in range(1, len(cum)))
    # deltas join to the cumulative result
    assert "".join(o.outputs[0].text for o in dl if o.outputs) == final.text
    assert [t for o in dl for c in o.outputs for t in c.token_ids] == final.token_ids


def test_abort_ends_generator_within_a_second_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        gen = engine.generate({"prompt_token_ids": list(range(10, 60))}, params, "to-abort")
        first = await gen.__anext__()
        assert not first.finished
        assert metric(engine, "kv_cache_usage_perc") > 0
        t0 = time.monotonic()
        await engine.abort("to-abort")
        last = first
        async for out in gen:
            last = out
        return last, time.monotonic() - t0

    last, elapsed = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert elapsed < 1.0
    deadline = time.monotonic() + 1.0
    while metric(engine, "kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(engine, "kv_cache_usage_perc") == 0
    assert metric(engine, "num_requests_running") == 0


def test_cancelled_consumer_aborts_its_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def consume():
        async for _ in engine.generate({"prompt_token_ids": list(range(100, 140))}, params, "cancel-me"):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 1.0
    while (metric(engine, "num_requests_running") or metric(engine, "kv_cache_usage_perc")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(engine, "num_requests_running") == 0 and metric(engine, "kv_cache_usage_perc") == 0


def test_concurrent_requests_batch_together_and_match_solo(engine):
    prompts = [{"prompt_token_ids": [200 + i, 300 + 2 * i, 17, 400 + i]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = next(m for m in engine.get_metrics() if m.name == "pagedllm:iteration_num_seqs")

    async def together():
        return await asyncio.gather(*(collect(engine, p, params, f"b{i}") for i, p in enumerate(prompts)))

    batched = asyncio.run(together())
    after = next(m for m in engine.get_metrics() if m.name == "pagedllm:iteration_num_seqs")
    # some step ran more than one sequence: the 8 requests shared steps
    steps_with_one = after.buckets["1"] - before.buckets["1"]
    assert after.count - before.count > steps_with_one
    solo = asyncio.run(collect(engine, prompts[3], params, "solo3"))
    assert solo[-1].outputs[0].token_ids == batched[3][-1].outputs[0].token_ids


def test_bad_requests_raise_and_engine_keeps_serving(engine):
    ok = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, {"prompt_token_ids": []}, ok, "empty")
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, {"prompt_token_ids": [5] * MAX_MODEL_LEN}, ok, "long")
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(engine, {"prompt_token_ids": [10**9]}, ok, "oov")
        outs = await collect(engine, {"prompt_token_ids": [5, 6, 7]}, ok, "after")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_metrics_count_tokens_and_latencies(engine):
    names = lambda: {m.name: m for m in engine.get_metrics() if not m.labels.get("finished_reason")}  # noqa: E731
    before = names()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    asyncio.run(collect(engine, {"prompt_token_ids": [11, 12, 13, 14, 15]}, params, "metered"))
    after = names()
    def grew(name: str, attr: str) -> float:  # a metric not reported yet (no request before) counts as 0
        return getattr(after[name], attr) - (getattr(before[name], attr) if name in before else 0)

    assert grew("pagedllm:generation_tokens", "value") == 10
    assert grew("pagedllm:prompt_tokens", "value") == 5
    assert grew("pagedllm:time_to_first_token_seconds", "count") == 1
    assert grew("pagedllm:inter_token_latency_seconds", "count") == 9
    assert grew("pagedllm:e2e_request_latency_seconds", "count") == 1


def test_shutdown_then_a_second_engine():
    args = AsyncEngineArgs(model=str(tiny_model_dir()), dtype="float32", max_model_len=128,
                           kv_cache_memory_bytes=4 << 20)
    first = AsyncLLM.from_engine_args(args)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    a = asyncio.run(collect(first, {"prompt_token_ids": [1, 2, 3]}, params, "x"))
    first.shutdown()
    assert not first.is_running
    with pytest.raises(RuntimeError):
        asyncio.run(collect(first, {"prompt_token_ids": [1, 2, 3]}, params, "y"))
    second = AsyncLLM(model=str(tiny_model_dir()), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    try:
        b = asyncio.run(collect(second, {"prompt_token_ids": [1, 2, 3]}, params, "x"))
    finally:
        second.shutdown()
    assert a[-1].outputs[0].token_ids == b[-1].outputs[0].token_ids


def test_engine_process_death_fails_requests_in_flight():
    """SIGKILL of the engine process: the request in flight raises EngineDeadError, is_running turns
    False and a new request is refused with EngineDeadError."""
    import os
    import signal

    eng = AsyncLLM(model=str(tiny_model_dir()), dtype="float32", max_model_len=MAX_MODEL_LEN,
                   kv_cache_memory_bytes=4 << 20, multiprocess=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

        async def run():
            seen = 0
            with pytest.raises(EngineDeadError, match="exited with status -9"):
                async for _ in eng.generate({"prompt_token_ids": [1, 2, 3]}, params, "doomed"):
                    seen += 1
                    if seen == 3:
                        os.kill(eng.client.pid, signal.SIGKILL)
            return seen

        assert asyncio.run(run()) >= 3
        assert not eng.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(eng, {"prompt_token_ids": [1, 2, 3]}, params, "after"))
    finally:
        eng.shutdown()
