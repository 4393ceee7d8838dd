"""Tensor parallelism on the CPU (pagedllm's shared-memory communicator, and gloo): every result
against the same model on one rank.

- The parallel layers: the model's logits split over 2 and 4 ranks (threads over one shared-memory
  group, in this process) equal the one-rank logits within 1e-4 for Llama, Mistral (one KV head:
  fewer KV heads than ranks, replicated), Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Llama 3
  RoPE; every rank computes the same bits.
- The engine (worker processes): greedy tokens identical to tensor_parallel_size=1 in fp32,
  logprobs within 1e-4, for those architectures at TP 2; the bundled SmolLM2 (9 heads, 3 KV
  heads) at TP 3 over 16 prompts; prefix caching, chunked prefill, preemption, n > 1, seeded
  sampling, prompt logprobs and async scheduling at TP 2 equal TP 1; both CPU backends (shm, gloo).
- Errors before any process starts (head counts), a killed worker (the engine raises, naming
  it; no child survives), shutdown, a killed driver and Ctrl-C leave no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tiny_models import PagedHarness, build_tiny_engine_folder, build_tiny_model

TOL = 1e-4
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------- helpers
def run_ranks(world: int, fn):
    """fn(group) on `world` ranks of one shared-memory group, each in a thread of this process;
    returns the results in rank order (the first error is raised after all ranks stopped)."""
    from pagedllm.distributed.parallel_state import GroupCoordinator

    cpu = torch.device("cpu")
    first = GroupCoordinator.init(0, world, cpu, "shm")
    groups = [first] + [GroupCoordinator.init(r, world, cpu, "shm", shm_handle=first.shm.handle())
                        for r in range(1, world)]
    results, errors = [None] * world, []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(groups[rank])
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)
            groups[rank].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in reversed(groups):
        g.destroy()
    if errors:
        raise errors[0]
    return results


def shard_logits(folder: Path, group=None, dtype=torch.float32, pack: bool = False) -> torch.Tensor:
    """Logits of a prefill of two sequences and one decode step, on this rank's shard (pack: the
    CPU's packed linear methods, as the model runner sets them up in bfloat16)."""
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM

    cfg = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(cfg, dtype, torch.device("cpu"), tp_group=group)
    model.load_weights(load_safetensors(folder, lazy=group is not None))
    if pack:
        model.pack_weights()
    harness = PagedHarness(model, 2, 64)
    ids = lambda lo, hi: [i % cfg.vocab_size for i in range(lo, hi)]  # noqa: E731
    prefill = harness.step([(0, ids(5, 40)), (1, ids(100, 117))])
    decode = harness.step([(0, [7]), (1, [9])])
    return torch.cat([prefill, decode])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Engine folders (weights + synthetic tokenizer) of the tiny architectures, built once."""
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_engine_folder(name, tmp_path_factory.mktemp(f"tp-{name}"))
        return built[name]

    return get


def engine(folder, tp: int, **kwargs):
    from pagedllm import LLM

    kwargs.setdefault("num_gpu_blocks_override", 256)  # the same block count whatever the ranks
    return LLM(str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp, **kwargs)


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same_outputs(a, b, tol: float = TOL) -> None:
    """Token ids equal; sample logprobs (and prompt logprobs) within tol."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids, (x.request_id, cx.token_ids, cy.token_ids)
            if cx.logprobs is not None:
                for lx, ly in zip(cx.logprobs, cy.logprobs):
                    assert lx.keys() == ly.keys()
                    for t in lx:
                        assert abs(lx[t].logprob - ly[t].logprob) <= tol
        if x.prompt_logprobs is not None:
            for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
                assert lx.keys() == ly.keys()
                for t in lx:
                    assert abs(lx[t].logprob - ly[t].logprob) <= tol


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 40) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 1024, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, which no one reaped yet, has stopped)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def wait_gone(pids, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# ---------------------------------------------------------------- layers and the model
def test_partition_heads_and_errors_name_both_numbers():
    from pagedllm.model_executor.layers.linear import partition_heads

    assert partition_heads(32, 8, 4) == (8, 2, 1)
    assert partition_heads(32, 8, 8) == (4, 1, 1)
    assert partition_heads(32, 2, 8) == (4, 1, 4)  # 2 KV heads over 8 ranks: each held by 4 ranks
    assert partition_heads(9, 3, 3) == (3, 1, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's num_attention_heads=9"):
        partition_heads(9, 3, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 and the model's num_key_value_heads=6"):
        partition_heads(12, 6, 4)


def test_group_collectives_over_shared_memory(gen):
    """all_reduce sums (the same bits on every rank), all_gather concatenates along any dim,
    broadcast copies rank 0's tensor, all_reduce_min agrees."""
    data = [torch.randn(3, 5, generator=gen) for _ in range(3)]

    def body(g):
        x = data[g.rank].clone()
        g.all_reduce(x)
        y = torch.full((2, 2), float(g.rank))
        cat0, cat1 = g.all_gather(data[g.rank], dim=0), g.all_gather(data[g.rank], dim=1)
        b = data[g.rank].clone()
        g.broadcast(b, src=0)
        return x, cat0, cat1, b, g.all_reduce_min(10 - g.rank), g.all_gather(y, dim=-1)

    outs = run_ranks(3, body)
    ref = data[0].double() + data[1].double() + data[2].double()
    for x, cat0, cat1, b, lo, y in outs:
        assert torch.equal(x, outs[0][0]) and (x.double() - ref).abs().max() < 1e-6
        assert torch.equal(cat0, torch.cat(data, 0)) and torch.equal(cat1, torch.cat(data, 1))
        assert torch.equal(b, data[0]) and lo == 8
        assert torch.equal(y[:, 2:4], torch.ones(2, 2))


def test_step_message_round_trips_real_scheduler_outputs():
    """encode_step -> bytes -> decode_step gives every array a model runner reads, equal to the
    SchedulerOutput's (block tables sent only up to max_row_blocks, rebuilt with zero columns),
    over steps with prefill chunks, decodes, a fork (n=2: copy-on-write orders, repeated logits
    rows) and prompt-logprob rows."""
    import numpy as np

    from pagedllm import _C
    from pagedllm.executor.step_message import decode_step, encode_step, message_kind, STEP

    core = _C.EngineCore(_C.EngineConfig(num_blocks=64, block_size=16, max_model_len=256,
                                         max_num_batched_tokens=40, max_num_seqs=8))
    core.add_request("a", np.arange(10, 60, dtype=np.int32), _C.RequestParams(max_tokens=20, n=2))
    core.add_request("b", np.arange(3, 10, dtype=np.int32), _C.RequestParams(max_tokens=20, prompt_logprobs=1))
    fields = ("positions", "slot_mapping", "logits_indices", "input_ids", "prev_sample_rows", "seq_lens",
              "query_start_loc", "block_tables", "copy_orders")
    seen = {"copies": 0, "prompt_rows": 0, "narrow": 0}
    for _ in range(12):
        out = core.schedule()
        if out.num_tokens == 0:
            core.release(out)
            break
        parts = encode_step(out, prev_num_sampled=0)
        message = bytearray(b"".join(p.tobytes() for p in parts))
        assert message_kind(message) == STEP
        view = decode_step(message)
        for name in fields:
            assert np.array_equal(getattr(view, name), np.asarray(getattr(out, name))), name
        assert [r[1:] for r in view.prompt_logprob_rows] == [tuple(r[1:]) for r in out.prompt_logprob_rows]
        for name in ("step_id", "num_tokens", "num_seqs", "num_sampled", "max_query_len", "num_placeholders"):
            assert getattr(view, name) == getattr(out, name), name
        seen["copies"] += len(out.copy_orders)
        seen["prompt_rows"] += len(out.prompt_logprob_rows)
        seen["narrow"] += out.max_row_blocks < out.block_tables.shape[1]
        core.update_from_output(out, np.full(out.num_sampled, 7, dtype=np.int32))
        core.release(out)
    assert seen["copies"] and seen["prompt_rows"] and seen["narrow"]


ARCH_VARIANTS = {  # name -> (TINY_CONFIGS name, overrides)
    "llama": ("llama", {}), "mistral": ("mistral", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
    "llama3": ("llama3", {}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),  # the down projection's bias: added by rank 0 only
    "llama-vocab-100": ("llama", {"vocab_size": 100}),  # 4 ranks of 64 rows: ranks 2 and 3 hold padding only
}


def _queue_reader(reader, count: int, results) -> None:
    """A MessageQueue reader process: checks each message's pattern, reports (index, ok)."""
    import numpy as np

    for i in range(count):
        message = np.frombuffer(reader.get(), dtype=np.int64)
        results.put((i, bool(message[0] == i and (message == i).all()), int(message.size)))
    reader.close()


def test_message_queue_delivers_every_message_to_every_reader_in_order():
    """Two reader processes get 200 messages in order, among them payloads larger than a slot
    (through the pipes) and larger than a pipe's buffer (1 MiB: the writer must not block before
    the readers know of the message), with idle gaps (the readers fall asleep on the semaphore)."""
    import multiprocessing

    import numpy as np

    from pagedllm.distributed.shm_broadcast import MessageQueue

    ctx = multiprocessing.get_context("spawn")
    queue = MessageQueue(2, 4096, ctx, num_slots=3)
    results = ctx.Queue()
    count = 200
    procs = [ctx.Process(target=_queue_reader, args=(queue.reader(r), count, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    sizes = []
    try:
        for i in range(count):
            size = 131072 if i % 50 == 7 else (700 if i % 10 == 3 else 1 + i % 400)  # 1 MiB, 5.6 KB, small
            sizes.append(size)
            queue.put([np.full(size, i, dtype=np.int64)], alive=lambda: None)
            if i % 60 == 0:
                time.sleep(0.05)
        got = [results.get(timeout=60) for _ in range(2 * count)]
    finally:
        for p in procs:
            p.join(30)
        queue.close()
    assert all(p.exitcode == 0 for p in procs)
    assert all(ok for _, ok, _ in got)
    assert sorted(i for i, _, _ in got) == sorted(list(range(count)) * 2)
    assert {(i, n) for i, _, n in got} == {(i, sizes[i]) for i in range(count)}


@pytest.mark.parametrize("arch", list(ARCH_VARIANTS))
def test_sharded_model_logits_equal_one_rank(arch, tmp_path):
    """The parallel layers over 2 and 4 ranks give the one-rank logits (fp32, within 1e-4;
    greedy ids identical), the same on every rank. mistral has 1 KV head (replicated), llama3 8
    query heads over 2 KV heads."""
    name, overrides = ARCH_VARIANTS[arch]
    build_tiny_model(name, tmp_path, **overrides)
    ref = shard_logits(tmp_path)
    for world in (2, 4):
        outs = run_ranks(world, lambda g: shard_logits(tmp_path, g))
        for out in outs:
            assert torch.equal(out, outs[0])
        assert (outs[0] - ref).abs().max().item() < TOL
        assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))


def test_sharded_packed_bf16_close_to_one_rank(tmp_path):
    """bfloat16 on the CPU with the packed linear methods (oneDNN, or AMX where present) on each
    of 2 ranks: within a few bfloat16 roundings of one rank (the partial sums are rounded before the
    all-reduce), greedy ids mostly equal; the same bits on both ranks."""
    from pagedllm.model_executor.layers.cpu_linear_methods import can_pack_linear

    if not can_pack_linear(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU's oneDNN has no bfloat16 packing")
    build_tiny_model("qwen2", tmp_path)
    ref = shard_logits(tmp_path, dtype=torch.bfloat16, pack=True)
    outs = run_ranks(2, lambda g: shard_logits(tmp_path, g, dtype=torch.bfloat16, pack=True))
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - ref).abs().max().item() < 0.15
    assert (outs[0].argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def test_each_rank_loads_only_its_slices(tmp_path):
    """Rank r of 2 holds rows / columns of the checkpoint's tensors: q and k/v heads, gate and up
    halves, o and down columns, its vocabulary rows (zero padding past the vocabulary)."""
    from safetensors.torch import load_file

    hf = build_tiny_model("qwen2", tmp_path, vocab_size=1000)  # 1000 rows: 500 per rank, padded to 512
    state = {k.removeprefix("model."): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}

    def body(g):
        from pagedllm.model_executor.config import ModelConfig
        from pagedllm.model_executor.loader import load_safetensors
        from pagedllm.model_executor.models import LlamaForCausalLM

        m = LlamaForCausalLM(ModelConfig.from_pretrained(tmp_path), torch.float32, torch.device("cpu"), tp_group=g)
        m.load_weights(load_safetensors(tmp_path, lazy=True))
        return m

    from pagedllm.model_executor.loader import CheckpointTensor

    read: dict[int, int] = {}  # thread -> elements read from the checkpoint
    narrow, full = CheckpointTensor.narrow, CheckpointTensor.full

    def count(t: torch.Tensor) -> torch.Tensor:
        ident = threading.get_ident()
        read[ident] = read.get(ident, 0) + t.numel()
        return t

    CheckpointTensor.narrow = lambda self, *a: count(narrow(self, *a))
    CheckpointTensor.full = lambda self: count(full(self))
    try:
        ranks = run_ranks(2, body)
    finally:
        CheckpointTensor.narrow, CheckpointTensor.full = narrow, full
    total = sum(t.numel() for t in state.values())
    assert len(read) == 2 and all(n < 0.55 * total for n in read.values()), (read, total)  # its half, and norms
    D = 64
    for r, m in enumerate(ranks):
        layer = m.layers[1]
        qkv = layer.qkv_proj.weight
        assert torch.equal(qkv[: 2 * D], state["layers.1.self_attn.q_proj.weight"][r * 2 * D: (r + 1) * 2 * D])
        assert torch.equal(qkv[2 * D: 3 * D], state["layers.1.self_attn.k_proj.weight"][r * D: (r + 1) * D])
        assert torch.equal(layer.qkv_proj.bias[3 * D:], state["layers.1.self_attn.v_proj.bias"][r * D: (r + 1) * D])
        gate_up = layer.gate_up_proj.weight
        assert torch.equal(gate_up[256:], state["layers.1.mlp.up_proj.weight"][r * 256: (r + 1) * 256])
        assert torch.equal(layer.down_proj.weight, state["layers.1.mlp.down_proj.weight"][:, r * 256: (r + 1) * 256])
        emb = m.embed_tokens.weight
        assert emb.shape == (512, 256)  # ceil(1000 / 2) rounded up to a multiple of 64
        rows = 512 if r == 0 else 488
        assert torch.equal(emb[:rows], state["embed_tokens.weight"][r * 512: r * 512 + rows])
        assert torch.equal(emb[rows:], torch.zeros(512 - rows, 256))  # ids 1000..1023 do not exist
        assert m.lm_head.weight is m.embed_tokens.weight  # tied
    del hf


# ---------------------------------------------------------------- the engine
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shm", "gloo"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_engine_tp2_greedy_and_logprobs_equal_tp1(folders, arch, backend, monkeypatch):
    """Through the engine's worker processes, with either CPU backend."""
    from pagedllm import SamplingParams

    monkeypatch.setenv("PAGEDLLM_CPU_TP_BACKEND", backend)
    folder = folders(arch)
    prompts = random_prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    one = engine(folder, 1)
    ref = generate(one, prompts, params)
    one.shutdown()
    two = engine(folder, 2)
    try:
        assert two.llm_engine.executor.backend == backend
        assert_same_outputs(generate(two, prompts, params), ref)
    finally:
        two.shutdown()
    import torch.distributed as dist

    assert not dist.is_initialized()  # gloo: shutdown left torch.distributed's group


@pytest.mark.slow
def test_bundled_model_tp3_greedy_equals_tp1():
    """SmolLM2-135M (9 heads, 3 KV heads, 30 layers): one KV head per rank at TP 3."""
    from pagedllm import LLM, SamplingParams

    prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=512)
    one = LLM(**kw)
    ref = generate(one, prompts, params)
    one.shutdown()
    three = LLM(tensor_parallel_size=3, **kw)
    try:
        assert three.llm_engine.executor.worker_info[0]["num_kv_heads"] == 1
        assert_same_outputs(generate(three, prompts, params), ref, tol=float("inf"))
    finally:
        three.shutdown()


def _feature_workload():
    """(prompts, params): a shared 48-token prefix (prefix caching), a 150-token prompt (chunks of
    32 tokens), n=2, a seeded sample, prompt logprobs — enough KV for preemption at 24 blocks."""
    from pagedllm import SamplingParams

    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 1024, (48,), generator=g).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(3, 1024, (n,), generator=g).tolist()} for n in (5, 9, 14)]
    prompts.append({"prompt_token_ids": torch.randint(3, 1024, (150,), generator=g).tolist()})
    prompts += random_prompts(2, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    params = [greedy, greedy, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=1),
              greedy]
    return prompts, params


def _metric(llm, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "pagedllm:" + name)


@pytest.mark.slow
def test_engine_features_under_tp2_equal_tp1(folders):
    """Prefix caching, chunked prefill (32-token budget), preemption (24 blocks), n > 1, seeded
    sampling and prompt logprobs: the same outputs, preemptions and prefix hits at TP 2 as at TP 1."""
    folder = folders("llama")
    prompts, params = _feature_workload()
    kw = dict(num_gpu_blocks_override=24, max_num_batched_tokens=32, enable_chunked_prefill=True, max_model_len=256)
    runs = {}
    for tp in (1, 2):
        llm = engine(folder, tp, **kw)
        try:
            outs = generate(llm, prompts[:3], params[:3])  # fills the prefix cache
            outs += generate(llm, prompts, params)
            runs[tp] = (outs, _metric(llm, "num_preemptions"), _metric(llm, "prefix_cache_hits"))
        finally:
            llm.shutdown()
    assert_same_outputs(runs[2][0], runs[1][0])
    assert runs[1][1] > 0 and runs[2][1] == runs[1][1]  # preemptions happened, alike
    assert runs[1][2] > 0 and runs[2][2] == runs[1][2]  # prefix-cache hits, alike


@pytest.mark.slow
def test_async_scheduling_under_tp2_equals_tp1(folders):
    """With async scheduling the placeholder ids reach rank 1 by a broadcast of rank 0's samples."""
    from pagedllm import SamplingParams

    folder = folders("qwen2")
    prompts = random_prompts(5, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    one = engine(folder, 1)
    ref = generate(one, prompts, params)
    one.shutdown()
    two = engine(folder, 2, async_scheduling=True)
    try:
        assert two.llm_engine.async_scheduling
        assert_same_outputs(generate(two, prompts, params), ref)
    finally:
        two.shutdown()


# ---------------------------------------------------------------- errors and process hygiene
def test_bad_head_counts_fail_before_any_process_starts(folders, tmp_path):
    import multiprocessing

    from pagedllm import LLM

    folder = build_tiny_engine_folder("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=513)
    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=4 and the model's num_key_value_heads=2|"
                                         "tensor_parallel_size=4 does not divide"):
        LLM(str(folder), device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's intermediate_size=513"):
        LLM(str(folder), device="cpu", tensor_parallel_size=2)
    assert set(p.pid for p in multiprocessing.active_children()) == before


@pytest.mark.slow
def test_rank0_error_at_start_up_is_raised_as_is_and_no_worker_survives(folders):
    """A rank-0 error (no room for one KV block) is the ValueError one rank gives, not a worker's
    report of the aborted group; the workers are gone."""
    import multiprocessing

    from pagedllm import LLM

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="0 KV blocks"):
        LLM(str(folders("llama")), device="cpu", dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=1)
    started = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
    assert wait_gone(started) == []


@pytest.mark.slow
def test_dropped_engine_stops_its_workers_without_shutdown(folders):
    """An LLM dropped without shutdown() (a notebook, an error after start-up): garbage
    collection runs the executor's finalizer, which stops the workers."""
    import gc

    llm = engine(folders("llama"), 2)
    (pid,) = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert wait_gone([pid]) == []


def assert_a_killed_rank_stops_the_engine(llm, reported: str) -> None:
    """SIGKILL the engine's one worker rank mid-run: generate raises RuntimeError matching
    `reported`, the next call says the engine has stopped, and after shutdown the process is gone
    (shared by the tensor-parallel, pipeline-parallel and Ray tests)."""
    from pagedllm import SamplingParams

    (pid,) = llm.llm_engine.executor.worker_pids
    assert alive(pid)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL)).start()
    with pytest.raises(RuntimeError, match=reported):
        for _ in range(200):  # long enough that the kill lands mid-run
            generate(llm, random_prompts(8, seed=9), params)
    with pytest.raises(RuntimeError, match="engine has stopped"):
        generate(llm, random_prompts(1, seed=9), params)
    llm.shutdown()
    assert wait_gone([pid]) == []


@pytest.mark.slow
def test_killed_worker_stops_the_engine_and_no_child_survives(folders):
    llm = engine(folders("llama"), 2)
    executor = llm.llm_engine.executor
    assert_a_killed_rank_stops_the_engine(llm, r"rank 1 \(pid \d+\) stopped with exit code -9")
    assert executor.num_workers_alive == 0


@pytest.mark.slow
def test_shutdown_leaves_no_worker_and_a_second_engine_starts(folders):
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    pids = []
    for _ in range(2):
        llm = engine(folders("llama"), 2)
        pids += llm.llm_engine.executor.worker_pids
        assert len(generate(llm, random_prompts(2, seed=2), params)[0].outputs[0].token_ids) == 4
        llm.shutdown()
        llm.shutdown()  # idempotent
    assert wait_gone(pids, timeout=5) == []


_DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    from pagedllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM({folder!r}, device="cpu", dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=256)
        print("WORKERS", *llm.llm_engine.executor.worker_pids, flush=True)
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        while True:
            llm.generate([{{"prompt_token_ids": [5, 6, 7]}}] * 4, params, use_tqdm=False)
            print("STEP", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_driver_killed_or_interrupted_leaves_no_worker(folders, tmp_path, how):
    """A driver killed outright (its workers notice their parent is gone) or interrupted by
    Ctrl-C (SIGINT to the process group: workers ignore it, the driver's exit stops them)."""
    from server_utils import package_root

    script = tmp_path / "driver.py"
    script.write_text(_DRIVER.format(here=str(HERE), folder=str(folders("llama"))))
    env = dict(os.environ, PYTHONPATH=package_root())
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        workers, lines = [], []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("WORKERS"):
                workers = [int(p) for p in line.split()[1:]]
            if line.startswith("STEP") and workers:
                break
            if not line and proc.poll() is not None:
                break
        assert workers, "".join(lines)
        if how == "SIGKILL":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
        proc.wait(60)
        assert wait_gone(workers) == [], "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


@pytest.mark.slow
def test_server_with_tensor_parallel_size_2_answers_the_openai_client():
    """`pagedllm serve --tensor-parallel-size 2`: the openai client gets the one-rank server's
    greedy tokens (completions and chat, streamed too); stopping the server stops its worker."""
    import re

    from server_utils import DEFAULT_ARGS, RemoteServer, tiny_model_dir

    def ask(server) -> tuple[list, str, str]:
        client = server.client()
        done = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12,
                                         temperature=0.0, extra_body={"return_token_ids": True})
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                              max_tokens=10, temperature=0.0)
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                                max_tokens=10, temperature=0.0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == chat.choices[0].message.content
        return done.choices[0].token_ids, done.choices[0].text, chat.choices[0].message.content

    results, workers = {}, []
    for tp in ("1", "2"):
        server = RemoteServer(str(tiny_model_dir()), DEFAULT_ARGS + ["--tensor-parallel-size", tp])
        try:
            results[tp] = ask(server)
            if tp == "2":
                workers = [int(p) for p in re.findall(r"worker rank 1 \(pid (\d+)\)", server.read_log())]
                assert len(workers) == 1, server.read_log()[-3000:]
                assert alive(workers[0])
        finally:
            server.stop()
    assert results["2"] == results["1"] and len(results["1"][0]) == 12
    assert wait_gone(workers) == []


# ---------------------------------------------------------------- CUDA shards (one GPU, threads)
class ThreadGroup:
    """A tensor-parallel group of threads of this process on one device (tests only: NCCL refuses
    two ranks on one GPU): all_reduce / all_gather through shared slots and a barrier, summing in
    rank order. Threads share PyTorch's default CUDA stream, so the kernels stay ordered."""

    class Shared:
        def __init__(self, world: int):
            self.barrier = threading.Barrier(world)
            self.slots: list = [None] * world
            self.result = None

    def __init__(self, rank: int, world: int, device, shared: "ThreadGroup.Shared"):
        self.rank, self.world_size, self.device, self.backend = rank, world, torch.device(device), "threads"
        self.shared, self.shm, self.process_group = shared, None, None

    def _exchange(self, x, combine):
        s = self.shared
        s.slots[self.rank] = x
        s.barrier.wait()
        if self.rank == 0:
            s.result = combine(list(s.slots))
        s.barrier.wait()
        out = s.result
        s.barrier.wait()
        return out

    def all_reduce(self, x):
        def add(parts):
            total = parts[0].float().clone()
            for p in parts[1:]:
                total += p.float()
            return total.to(parts[0].dtype)
        return x.copy_(self._exchange(x, add))

    def all_gather(self, x, dim: int = -1):
        return self._exchange(x.contiguous(), lambda parts: torch.cat(parts, dim=dim)).clone()

    def broadcast(self, x, src: int = 0):
        return x.copy_(self._exchange(x, lambda parts: parts[src].clone()))

    def all_reduce_min(self, value: int) -> int:
        return int(self._exchange(value, min))

    def barrier(self):
        self.shared.barrier.wait()

    def abort(self):
        self.shared.barrier.abort()

    def destroy(self):
        pass


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_cuda_shards_equal_one_rank(tmp_path, arch, dtype):
    """The CUDA paths of a shard — the GEMV for decode steps with the rope epilogue over paired
    rotary rows of this rank's heads, the gate_up GEMV's SiLU epilogue over paired rows of this
    rank's intermediate features, the LM head GEMV over a vocabulary shard; F.linear and the paired
    kernels for prefill — over 2 ranks (threads on this GPU) against one rank, as the model runner
    sets the model up. fp32: within 1e-4; bf16: within a few roundings, greedy ids mostly equal."""
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM

    build_tiny_model(arch, tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)

    def logits(group) -> torch.Tensor:
        model = LlamaForCausalLM(cfg, dtype, torch.device("cuda"), tp_group=group)
        model.load_weights(load_safetensors(tmp_path, lazy=True))
        model.pack_weights()
        gemv = dtype != torch.float32  # the GEMV and its epilogues run in bf16 / fp16 only
        assert model.pair_rotary_rows() == (gemv and not cfg.qk_norm)
        assert model.pair_gate_up_rows() == gemv
        harness = PagedHarness(model, 3, 64)
        steps = [harness.step([(0, list(range(5, 40))), (1, list(range(100, 117))), (2, [9, 10, 11])])]
        for t in range(4):  # decode steps: GEMV-sized
            steps.append(harness.step([(0, [7 + t]), (1, [9 + t]), (2, [50 + t])]))
        torch.cuda.synchronize()
        return torch.cat(steps).float().cpu()

    ref = logits(None)
    shared = ThreadGroup.Shared(2)
    outs = [None, None]
    errors = []

    def run(rank):
        try:
            outs[rank] = logits(ThreadGroup(rank, 2, "cuda", shared))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert torch.equal(outs[0], outs[1])
    if dtype == torch.float32:
        assert (outs[0] - ref).abs().max().item() < TOL
        assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))
    else:  # partial sums rounded to bf16 on each rank before the all-reduce
        assert (outs[0] - ref).abs().max().item() < 0.15
        assert (outs[0].argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
