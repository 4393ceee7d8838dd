"""The offline LLM API's behaviour (vLLM's rules) on a random tiny Llama with SmolLM2's tokenizer:
prompt forms and order, per-prompt params, max_model_len rules, priority, n > 1, prompt logprobs
against HF (also across chunked prefill), abort, metrics, argument errors, shutdown + restart."""

from __future__ import annotations

import shutil

import pytest
import torch

from llm_reference import bundled_folder
from tiny_models import build_tiny_model

torch.set_num_threads(1)
MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = build_tiny_model("llama", folder, vocab_size=49152)  # SmolLM2's tokenizer
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_folder() / f, folder / f)
    return folder, hf


@pytest.fixture(scope="module")
def llm(tiny_folder):
    from pagedllm import LLM, ops

    before = ops.get_num_threads()
    ops.set_num_threads(1)
    engine = LLM(str(tiny_folder[0]), dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=MAX_LEN,
                 max_num_batched_tokens=64, enable_prefix_caching=False)
    yield engine
    engine.shutdown()
    ops.set_num_threads(before)


def greedy(**kw):
    from pagedllm import SamplingParams

    kw.setdefault("max_tokens", 8)
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def metric(llm, name):
    return next(m for m in llm.get_metrics() if m.name == "pagedllm:" + name)


def assert_idle(llm):
    assert not llm.llm_engine.has_unfinished_requests()
    assert metric(llm, "kv_cache_usage_perc").value == 0.0
    assert metric(llm, "num_requests_running").value == 0 and metric(llm, "num_requests_waiting").value == 0


def test_prompt_forms_order_and_per_prompt_params(llm):
    from pagedllm import TokensPrompt

    tok = llm.get_tokenizer()
    prompts = ["hello there", {"prompt": "a text prompt"}, TokensPrompt(prompt_token_ids=[5, 6, 7]),
               {"prompt_token_ids": [9, 10, 11, 12], "prompt": "echoed"}]
    params = [greedy(max_tokens=n) for n in (1, 2, 3, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4]
    assert [o.prompt for o in outs] == ["hello there", "a text prompt", None, "echoed"]
    assert outs[0].prompt_token_ids == tok.encode("hello there")
    assert outs[2].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    single = llm.generate("hello there", greedy(max_tokens=1), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 sampling params for 4 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    assert_idle(llm)


def test_bad_prompts_raise_and_queue_nothing(llm):
    ok = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=f"max_model_len is {MAX_LEN}"):
        llm.generate([ok, {"prompt_token_ids": [5] * MAX_LEN}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([ok, {"prompt_token_ids": []}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="50000"):
        llm.generate([ok, {"prompt_token_ids": [1, 50000]}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=f"token id {2**70} is outside the vocabulary"):  # beyond int64
        llm.generate([ok, {"prompt_token_ids": [1, 2**70]}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([ok, 42], greedy(), use_tqdm=False)
    assert_idle(llm)
    assert llm.generate(ok, greedy(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_truncate_prompt_tokens_and_allowed_token_ids(llm):
    """vLLM's truncate_prompt_tokens keeps the prompt's last k tokens (-1: max_model_len - 1, so an
    over-long prompt runs); allowed_token_ids restricts every sampled token (random sampling too)."""
    from pagedllm import SamplingParams

    ids = list(range(100, 160))
    cut = llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=7), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-7:]}, greedy(), use_tqdm=False)[0]
    assert list(cut.prompt_token_ids) == ids[-7:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    longer = llm.generate({"prompt_token_ids": [5] * (MAX_LEN + 9)}, greedy(truncate_prompt_tokens=-1, max_tokens=1),
                          use_tqdm=False)[0]
    assert len(longer.prompt_token_ids) == MAX_LEN - 1 and len(longer.outputs[0].token_ids) == 1
    allowed = [11, 500, 4242]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3,
                        SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed),
                        use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) and len(o.outputs[0].token_ids) == 10 for o in outs)
    with pytest.raises(ValueError, match=r"allowed_token_ids contains token ids outside the vocabulary \[0, 49152\)"):
        llm.generate({"prompt_token_ids": [5]}, greedy(allowed_token_ids=[49152]), use_tqdm=False)
    assert_idle(llm)


def test_prompt_ending_inside_a_utf8_character(llm):
    """Offline: a prompt ending with the first byte of "é" and an output forced to its second byte:
    the output text is "é" (the whole character, after the prompt's complete ones)."""
    tok = llm.get_tokenizer()
    ids = tok.encode("caf", add_special_tokens=False) + [tok.convert_tokens_to_ids("Ã")]
    out = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=1, allowed_token_ids=[tok.convert_tokens_to_ids("©")]),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == "é"


def test_request_output_metrics_are_ordered_timestamps(llm):
    """RequestOutput.metrics (vLLM's): arrival <= first scheduled <= first token <= last token <=
    finished, all set once a request finished."""
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy(max_tokens=5), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time


def test_generation_stops_at_max_model_len(llm):
    from pagedllm import SamplingParams

    prompt = {"prompt_token_ids": list(range(3, MAX_LEN - 2))}  # MAX_LEN - 5 tokens
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    out = llm.generate(prompt, greedy(max_tokens=100), use_tqdm=False)[0]  # max_tokens beyond the room
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_prompt_logprobs_match_hf_across_chunks(llm, tiny_folder):
    _, hf = tiny_folder
    ids = torch.randint(3, 49152, (150,), generator=torch.Generator().manual_seed(4)).tolist()  # > 2 chunks of 64
    chunks_before = metric(llm, "num_chunked_prefills").value
    out = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert metric(llm, "num_chunked_prefills").value > chunks_before
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4, pos
        top = ref[pos - 1].topk(2).indices.tolist()
        assert {t for t, lp in entry.items() if lp.rank in (1, 2)} >= set(top) - {ids[pos]}
    with torch.no_grad():
        last = hf(torch.tensor([ids])).logits[0, -1]
    assert out.outputs[0].token_ids[0] == int(last.argmax())


def test_n_sequences_fork(llm):
    from pagedllm import SamplingParams

    forks = metric(llm, "num_forks").value
    out = llm.generate({"prompt_token_ids": list(range(10, 50))},
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert metric(llm, "num_forks").value >= forks + 2
    assert_idle(llm)


def test_priority_scheduling(tiny_folder):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="priority"):
        llm_fcfs = LLM(str(tiny_folder[0]), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=MAX_LEN)
        try:
            llm_fcfs.generate(["a", "b"], greedy(), priority=[0, 1], use_tqdm=False)
        finally:
            llm_fcfs.shutdown()
    llm = LLM(str(tiny_folder[0]), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=MAX_LEN,
              scheduling_policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    for request_id, prio in (("late", 5), ("urgent", 0)):
        engine.add_request(request_id, None, [5, 6, 7, 8], greedy(max_tokens=4), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "late"]
    outs = llm.generate(["x", "y"], greedy(max_tokens=2), priority=[3, 1], use_tqdm=False)
    assert [o.prompt for o in outs] == ["x", "y"]  # input order whatever the priority
    llm.shutdown()


def test_abort_frees_everything(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", None, list(range(5, 60)), greedy(max_tokens=50))
    engine.step()
    assert metric(llm, "kv_cache_usage_perc").value > 0
    final = engine.abort_request("to-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert_idle(llm)


def test_metrics_count_tokens(llm):
    before = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    outs = llm.generate([{"prompt_token_ids": [5] * 20}, {"prompt_token_ids": [6] * 30}], greedy(max_tokens=7),
                        use_tqdm=False)
    after = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    assert after["pagedllm:prompt_tokens"] - before["pagedllm:prompt_tokens"] == 50
    assert after["pagedllm:generation_tokens"] - before["pagedllm:generation_tokens"] == 14
    names = {m.name for m in llm.get_metrics()}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "cache_config_info"):
        assert "pagedllm:" + name in names
    info = metric(llm, "cache_config_info")
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    assert all(len(o.outputs[0].token_ids) == 7 for o in outs)


def test_constructor_errors_name_the_argument(tiny_folder):
    from pagedllm import LLM

    folder = str(tiny_folder[0])
    for kwargs, pattern in [
        (dict(block_size=24), "block_size=24"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1, got 0"),
        # 4 heads, 2 KV heads: both numbers named, before any process starts
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's num_attention_heads=4"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="mpi"),
             r"distributed_executor_backend='mpi' is not supported: use one of \['uni', 'mp', 'ray'\]"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'uni' runs one rank"),
        (dict(dtype="float16", device="cpu"), "float16"),
        (dict(max_model_len=10**6), "max_model_len=1000000"),
        (dict(scheduling_policy="lifo"), "lifo"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64), "max_num_batched_tokens=16"),
        (dict(kv_cache_memory_bytes=100), "0 KV blocks"),
        (dict(kv_cache_dtype="int8"), r"kv_cache_dtype='int8' is not supported: use one of \['auto', 'fp8'"),
        (dict(calculate_kv_scales=True), "calculate_kv_scales=True needs an FP8 KV cache"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            LLM(folder, **kwargs)
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(folder, no_such_option=1)
    # vLLM arguments that would change what runs are refused by name until implemented (a user
    # asking for LoRA adapters must not silently get none)
    for kwargs in (dict(enable_lora=True),
                   dict(cpu_offload_gb=4), dict(hf_overrides={"num_hidden_layers": 1}), dict(max_logprobs=100)):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"{name}=.* is not supported"):
            LLM(folder, **kwargs)


def test_vllm_arguments_without_effect_are_accepted_and_logged(caplog):
    """revision, download_dir, swap_space... change nothing here: accepted (with an info log), as
    are the unimplemented ones at their neutral value."""
    import logging

    from pagedllm.entrypoints.llm import check_vllm_args

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        check_vllm_args(dict(revision="main", download_dir="/tmp", swap_space=4,
                             enable_lora=False, hf_overrides=None))
    assert "swap_space=" in caplog.text and "revision=" in caplog.text


def test_async_engine_names_of_vllm():
    import pagedllm
    from pagedllm import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine

    assert AsyncLLMEngine is AsyncLLM and callable(AsyncLLMEngine.from_engine_args)
    assert issubclass(AsyncEngineArgs, pagedllm.EngineArgs)


def test_shutdown_then_a_second_llm(tiny_folder):
    from pagedllm import LLM

    prompt = {"prompt_token_ids": [7, 8, 9]}
    first = LLM(str(tiny_folder[0]), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=MAX_LEN)
    a = first.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    first.shutdown()
    second = LLM(str(tiny_folder[0]), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=MAX_LEN)
    assert second.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids == a
    second.shutdown()
