"""Pipeline parallelism on the CPU (gloo point-to-point between stages, worker processes): every
result against the same model on one rank.

- The split: even stages with the remainder on the last ones, PAGEDLLM_PP_LAYER_PARTITION, errors
  naming the numbers; each stage loads only its layers (the first also the embedding, norm, head).
- The engine: greedy tokens identical to one rank in fp32 and logprobs within 1e-4, at PP 2 (an
  odd layer count) and PP 3, TP 2 x PP 2, for several architectures; with many requests the
  stages hold different steps at once (pipeline_steps_in_flight) and the outputs stay the same.
- Prefix caching, chunked prefill, preemption, n > 1, seeded sampling, prompt logprobs, beam
  search and aborts mid-flight under PP 2: the same outputs as one rank, no KV block leaked.
- Errors before any process starts; a killed stage stops the engine and no child survives.
"""

from __future__ import annotations


import pytest
import torch

from test_tensor_parallel import (alive, assert_a_killed_rank_stops_the_engine, assert_same_outputs, generate,
                                  random_prompts, wait_gone)
from tiny_models import build_tiny_engine_folder, build_tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Engine folders of the tiny architectures with `layers` decoder layers, built once."""
    built = {}

    def get(name: str, layers: int = 5) -> str:
        if (name, layers) not in built:
            built[name, layers] = str(build_tiny_engine_folder(name, tmp_path_factory.mktemp(f"pp-{name}"),
                                                               num_hidden_layers=layers))
        return built[name, layers]

    return get


def engine(folder, tp: int = 1, pp: int = 1, **kwargs):
    from pagedllm import LLM

    kwargs.setdefault("num_gpu_blocks_override", 256)  # the same block count whatever the ranks
    kwargs.setdefault("dtype", "float32")
    return LLM(folder, device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp, **kwargs)


def run(folder, prompts, params, tp=1, pp=1, **kwargs):
    """(outputs, metrics by name) of an engine that is shut down afterwards."""
    llm = engine(folder, tp, pp, **kwargs)
    try:
        outs = generate(llm, prompts, params)
        metrics = {m.name.removeprefix("pagedllm:"): m for m in llm.get_metrics()}
        assert llm.llm_engine.core.num_kv_seqs() == 0  # nothing held after the requests
        return outs, metrics
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- the split
def test_partition_even_remainder_last_and_env_override(monkeypatch):
    from pagedllm.distributed.pipeline import PARTITION_ENV, pp_layer_range, pp_partition

    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert pp_partition(32, 4) == [8, 8, 8, 8]
    assert pp_partition(5, 2) == [2, 3]
    assert pp_partition(10, 4) == [2, 2, 3, 3]  # stage 0 also has the embedding and the head
    assert [pp_layer_range(10, s, 4) for s in range(4)] == [(0, 2), (2, 4), (4, 7), (7, 10)]
    monkeypatch.setenv(PARTITION_ENV, "1,4")
    assert pp_partition(5, 2) == [1, 4]
    for bad in ("1,3", "0,5", "a,b", "1,2,2"):
        monkeypatch.setenv(PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=PARTITION_ENV):
            pp_partition(5, 2)
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's 2 decoder layers"):
        pp_partition(2, 3)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_stage_loads_only_its_layers(tmp_path, stage):
    """Stage s of 3 over 5 layers holds layers pp_layer_range(5, s, 3) with the checkpoint's
    weights of those layers; only stage 0 has the embedding, the final norm and the LM head."""
    from safetensors.torch import load_file

    from pagedllm.distributed.pipeline import PipelineGroup, pp_layer_range
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM

    build_tiny_model("llama3", tmp_path, num_hidden_layers=5)
    state = {k.removeprefix("model."): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    cpu = torch.device("cpu")
    model = LlamaForCausalLM(ModelConfig.from_pretrained(tmp_path), torch.float32, cpu,
                             pp_group=PipelineGroup(stage, 3, 0, 1, cpu))
    model.load_weights(load_safetensors(tmp_path, lazy=True))
    start, end = pp_layer_range(5, stage, 3)
    assert (model.start_layer, model.end_layer) == (start, end) and len(model.layers) == end - start
    for i, layer in enumerate(model.layers):
        hf = f"layers.{start + i}."
        assert torch.equal(layer.o_proj.weight, state[hf + "self_attn.o_proj.weight"])
        assert torch.equal(layer.down_proj.weight, state[hf + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, state[hf + "input_layernorm.weight"])
    first = stage == 0
    assert (model.embed_tokens is not None, model.norm is not None, model.lm_head is not None) == (first,) * 3
    if first:
        assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
        assert torch.equal(model.embed_tokens.weight, state["embed_tokens.weight"])


# ---------------------------------------------------------------- the engine against one rank
@pytest.mark.slow
@pytest.mark.parametrize("arch,tp,pp", [("llama3", 1, 2), ("llama3", 1, 3), ("llama", 2, 2), ("qwen2", 1, 2),
                                        ("mistral", 1, 2), ("qwen3", 1, 2)])
def test_pipeline_greedy_and_logprobs_equal_one_rank(folders, arch, tp, pp):
    """fp32: the same greedy tokens as one rank and logprobs within 1e-4 (5 layers: uneven stages;
    llama: tied embeddings; mistral: a sliding window; qwen2: biases; qwen3: q/k norms)."""
    from pagedllm import SamplingParams

    folder = folders(arch)
    prompts = random_prompts(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref, _ = run(folder, prompts, params)
    outs, _ = run(folder, prompts, params, tp=tp, pp=pp)
    assert_same_outputs(outs, ref)


@pytest.mark.slow
def test_pipeline_bf16_with_packed_weights_close_to_one_rank(folders):
    """bfloat16 on the CPU: each stage packs its projections (oneDNN, or AMX and the native
    decoder stack where present; stage 1 has no LM head to pack). One request at a time (the same
    batches as one rank: bfloat16 GEMM sums depend on the batch's shape), the greedy tokens equal
    one rank's."""
    from pagedllm import SamplingParams
    from pagedllm.model_executor.layers.cpu_linear_methods import can_pack_linear

    if not can_pack_linear(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU's oneDNN has no bfloat16 packing")
    folder = folders("llama3")
    prompts = random_prompts(3, seed=15)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for pp in (1, 2):
        llm = engine(folder, 1, pp, dtype="bfloat16")
        try:
            runs[pp] = [generate(llm, [p], params)[0].outputs[0].token_ids for p in prompts]
        finally:
            llm.shutdown()
    assert runs[2] == runs[1]


@pytest.mark.slow
def test_stages_hold_different_steps_at_once(folders):
    """16 requests at PP 2: the engine submits a step while another is on the later stage
    (pipeline_steps_in_flight observes 2), each step holding about half the sequences; the outputs
    equal one rank's."""
    from pagedllm import SamplingParams

    folder = folders("llama3")
    prompts = random_prompts(16, seed=12)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    ref, ref_metrics = run(folder, prompts, params)
    outs, metrics = run(folder, prompts, params, pp=2)
    assert_same_outputs(outs, ref)
    in_flight = metrics["pipeline_steps_in_flight"]
    at_one, at_two = in_flight.buckets["1"], in_flight.buckets["2"] - in_flight.buckets["1"]  # (cumulative)
    assert at_two >= 10 and at_two > at_one
    assert "pipeline_steps_in_flight" not in ref_metrics
    # twice the steps of half the sequences each (one rank: all 16 in every decode step)
    assert metrics["num_steps"].value >= 1.8 * ref_metrics["num_steps"].value


def _feature_workload():
    from test_tensor_parallel import _feature_workload as workload

    return workload()


@pytest.mark.slow
def test_engine_features_under_pp2_equal_one_rank(folders):
    """Prefix caching, chunked prefill (32-token budget), preemption (24 blocks), n > 1, seeded
    sampling and prompt logprobs: the same outputs at PP 2 as on one rank; preemptions and prefix
    hits happen there too."""
    folder = folders("llama", layers=4)
    prompts, params = _feature_workload()
    kw = dict(num_gpu_blocks_override=24, max_num_batched_tokens=32, enable_chunked_prefill=True, max_model_len=256)
    runs = {}
    for pp in (1, 2):
        llm = engine(folder, 1, pp, **kw)
        try:
            outs = generate(llm, prompts[:3], params[:3])  # fills the prefix cache
            outs += generate(llm, prompts, params)
            metrics = {m.name.removeprefix("pagedllm:"): m.value for m in llm.get_metrics() if hasattr(m, "value")}
            runs[pp] = (outs, metrics["num_preemptions"], metrics["prefix_cache_hits"])
            assert llm.llm_engine.core.num_kv_seqs() == 0
        finally:
            llm.shutdown()
    assert_same_outputs(runs[2][0], runs[1][0])
    assert runs[2][1] > 0 and runs[2][2] > 0


@pytest.mark.slow
def test_beam_search_and_aborts_under_pp2(folders):
    """Beam search (W = 3) gives one rank's hypotheses; requests aborted while their steps are in
    flight leave the others' outputs unchanged and no KV block held."""
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import BeamSearchParams

    folder = folders("qwen2", layers=3)
    prompts = random_prompts(3, seed=13)
    beams = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for pp in (1, 2):
        llm = engine(folder, 1, pp)
        try:
            hyps = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, beams)]
            eng = llm.llm_engine
            for i, p in enumerate(random_prompts(8, seed=14)):
                eng.add_request(f"r{i}", None, p["prompt_token_ids"], greedy)
            done, steps = {}, 0
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
                steps += 1
                if steps == 5:  # mid-flight: r1 and r6 go
                    eng.abort_request("r1")
                    eng.abort_request("r6")
            assert eng.core.num_kv_seqs() == 0
            results[pp] = (hyps, {k: v for k, v in done.items() if k not in ("r1", "r6")})
        finally:
            llm.shutdown()
    assert results[2][0] == results[1][0]
    assert len(results[2][1]) == 6 and results[2][1] == results[1][1]


@pytest.mark.slow
def test_a_failure_while_flushing_the_pipeline_keeps_the_stages_in_step(folders):
    """PP 3: a sampler error while an abort flushes the steps in flight (ranks healthy): the abort
    raises it, the other steps in flight are still collected (the stages send rows in order) and
    released unapplied; afterwards the requests finish with one rank's tokens and no block is held."""
    from pagedllm import SamplingParams

    folder = folders("llama3")
    prompts = random_prompts(8, seed=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref, _ = run(folder, prompts, params)
    llm = engine(folder, 1, 3)
    try:
        eng = llm.llm_engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", None, p["prompt_token_ids"], params)
        for _ in range(4):
            eng.step()
        assert len(eng._pipeline) == 2  # two steps in flight after each step() at PP 3
        real = type(eng.sampler).__call__

        def failing(self, *args, **kwargs):
            type(self).__call__ = real  # once
            raise RuntimeError("injected sampler failure")

        type(eng.sampler).__call__ = failing
        try:
            with pytest.raises(RuntimeError, match="injected sampler failure"):
                eng.abort_request("r7")
        finally:
            type(eng.sampler).__call__ = real
        assert not eng._pipeline
        eng.abort_request("r7")
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert eng.core.num_kv_seqs() == 0
    finally:
        llm.shutdown()
    assert {f"r{i}": ref[i].outputs[0].token_ids for i in range(7)} == {k: v for k, v in done.items() if k != "r7"}


# ---------------------------------------------------------------- errors and process hygiene
def test_bad_pipeline_settings_fail_before_any_process_starts(folders):
    import multiprocessing

    from pagedllm import LLM

    folder = folders("llama", layers=2)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's 2 decoder layers"):
        LLM(folder, device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1, got 0"):
        LLM(folder, device="cpu", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="async_scheduling=True does not work with pipeline_parallel_size"):
        LLM(folder, device="cpu", pipeline_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_config with pipeline_parallel_size > 1"):
        LLM(folder, device="cpu", pipeline_parallel_size=2, speculative_config={"method": "ngram",
                                                                                 "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one rank"):
        LLM(folder, device="cpu", pipeline_parallel_size=2, distributed_executor_backend="uni")
    assert {p.pid for p in multiprocessing.active_children()} == before


@pytest.mark.slow
def test_killed_stage_stops_the_engine_and_no_child_survives(folders):
    llm = engine(folders("llama3"), 1, 2)
    executor = llm.llm_engine.executor
    assert_a_killed_rank_stops_the_engine(llm, r"rank 1 \(pid \d+\) stopped with exit code -9")
    assert executor.num_workers_alive == 0


@pytest.mark.slow
def test_server_with_pipeline_parallel_size_2_answers_the_openai_client():
    """`pagedllm serve -pp 2`: the openai client gets the one-stage server's greedy tokens for 8
    concurrent streamed completions; the log names each stage's layers; stopping the server
    stops the worker."""
    import concurrent.futures
    import re

    from server_utils import DEFAULT_ARGS, RemoteServer, tiny_model_dir

    def ask(server, i: int) -> str:
        stream = server.client().completions.create(model="tiny", prompt=f"Story {i}: once upon a time",
                                                    max_tokens=12, temperature=0.0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    results, workers = {}, []
    for pp in ("1", "2"):
        server = RemoteServer(str(tiny_model_dir()), DEFAULT_ARGS + ["--pipeline-parallel-size", pp])
        try:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results[pp] = list(pool.map(lambda i: ask(server, i), range(8)))
            if pp == "2":
                log = server.read_log()
                assert "pipeline stage 0/2: layers [0, 1) + embedding, norm, LM head" in log
                workers = [int(p) for p in re.findall(r"worker rank 1 \(pid (\d+)\)", log)]
                assert len(workers) == 1 and alive(workers[0])
        finally:
            server.stop()
    assert results["2"] == results["1"] and all(results["1"])
    assert wait_gone(workers) == []
