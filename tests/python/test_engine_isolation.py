"""A request whose per-request setup fails during a step (here: its sampler registration, a fault
injected for one seed) fails alone: the engine loop finishes it with the error, the requests
scheduled in the same step go on and give exactly what they give alone (greedy), the engine keeps
serving, and no KV block stays held. Sync and async scheduling; the engine on a thread of the test
process so the fault can be injected."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tiny_models import build_tiny_engine_folder

torch.set_num_threads(2)
FAULT_SEED = 666


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_engine_folder("llama", tmp_path_factory.mktemp("isolation_llama"), seed=3)


async def _collect(engine, ids, params, rid):
    last = None
    async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
        last = out
    return last


def _metric(engine, name, **labels):
    return sum(m.value for m in engine.get_metrics()
               if m.name == "pagedllm:" + name and all(m.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_requests_failing_setup_fails_only_that_request(folder, monkeypatch, async_scheduling):
    from pagedllm import SamplingParams
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.sample.sampler import Sampler

    original = Sampler.add_sequence

    def faulty(self, seq_id, params, *args, **kwargs):
        if params.seed == FAULT_SEED:
            raise RuntimeError("injected sampler fault")
        return original(self, seq_id, params, *args, **kwargs)

    monkeypatch.setattr(Sampler, "add_sequence", faulty)
    engine = AsyncLLM(model=str(folder), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20,
                      async_scheduling=async_scheduling, multiprocess=False)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        bad = SamplingParams(temperature=0.8, seed=FAULT_SEED, max_tokens=12, ignore_eos=True)
        prompts = [[5, 17, 99, 3], [41, 42, 43, 44, 45, 46], [7] * 9]

        async def together():  # one step schedules all four; the faulty one in the middle
            tasks = [_collect(engine, prompts[0], greedy, "a"), _collect(engine, prompts[1], greedy, "b"),
                     _collect(engine, [8, 9, 10], bad, "bad"), _collect(engine, prompts[2], greedy, "c")]
            return await asyncio.gather(*tasks, return_exceptions=True)

        a, b, failed, c = asyncio.run(together())
        assert isinstance(failed, RuntimeError) and "injected sampler fault" in str(failed), failed
        for out, ids, rid in zip((a, b, c), prompts, "xyz"):
            assert not isinstance(out, BaseException), out
            alone = asyncio.run(_collect(engine, ids, greedy, rid))
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids
            assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
        deadline = time.monotonic() + 5
        while (_metric(engine, "kv_cache_usage_perc") or _metric(engine, "num_requests_running")) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(engine, "kv_cache_usage_perc") == 0 and _metric(engine, "num_requests_running") == 0
        assert _metric(engine, "request_success", finished_reason="error") == 1
        assert _metric(engine, "request_success", finished_reason="length") == 6
    finally:
        engine.shutdown()
