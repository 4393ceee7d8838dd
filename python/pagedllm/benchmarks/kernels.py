"""`pagedllm bench kernels`: pagedllm's kernels beside their peers (and yours), each checked
against a float64 reference before it is timed.

    pagedllm bench kernels [--op paged_decode rms_norm reshape_and_cache silu_and_mul]
        [--batch 1 16 64] [--context 512 4096] [--dtype bfloat16] [--device cpu|cuda]
        [--compare sdpa torch] [--num-heads 32 --num-kv-heads 8 --head-size 128 --hidden-size 4096]
        [--json OUT.json] [--plot OUT.png]

For every case (op x batch x context x dtype) each kernel's output is compared with the op's
float64 reference on the same fresh random inputs (max |error| / max(1, max |reference|) within
the dtype's tolerance); a kernel that fails is reported ("check": "failed", its error) and not
timed, and the command exits with status 1. Timing: CUDA events around repeated calls on GPUs;
wall clock around repeated calls on CPUs (pagedllm's threads = --threads, torch's too); the
median of --trials. Each row reports microseconds, achieved bandwidth (bytes the op must move /
time) and FLOP/s, and the fraction of the roofline — the device's copy bandwidth and matmul
FLOP/s measured in the same run — that the time reaches: max(bytes / bandwidth, flops / peak) / time.

Your kernel beside ours (same inputs, same check, same timing)::

    from pagedllm.benchmarks import kernels

    def my_rms_norm(inputs):                 # inputs: the op's dict of tensors (see OPS[op].make)
        x, w = inputs["x"], inputs["weight"]
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + inputs["eps"]).to(x.dtype) * w

    kernels.register_kernel("rms_norm", "mine", my_rms_norm)
    result = kernels.run(kernels.BenchConfig(ops=["rms_norm"], batch=[16], compare=["mine"]))

Peers: torch SDPA on contiguous K/V (paged_decode: the pages gathered before timing), torch's own
ops (rms_norm: F.rms_norm; silu_and_mul: F.silu(a) * b; reshape_and_cache: index_copy_). JSON
carries the commit, the machine and the settings; --plot draws the roofline chart and, for
paged_decode, time against context length (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pagedllm import ops

#: relative tolerance of the reference check per dtype (max |error| / max(1, max |reference|))
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
BLOCK_SIZE = 16


@dataclasses.dataclass
class Case:
    """One shape of one op: batch (sequences or tokens), context (paged_decode), dtype, device and
    the model dimensions."""

    op: str
    batch: int
    context: int
    dtype: torch.dtype
    device: torch.device
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int


@dataclasses.dataclass
class OpSpec:
    """make(case, generator) -> inputs (dict of tensors and numbers); reference(inputs) -> float64
    output; bytes(case) / flops(case): what the op must move and compute; kernels: name -> fn(inputs)
    -> output (the reference's shape); uses_context: whether --context applies."""

    make: Callable[[Case, torch.Generator], dict]
    reference: Callable[[dict], torch.Tensor]
    bytes: Callable[[Case], float]
    flops: Callable[[Case], float]
    kernels: dict[str, Callable[[dict], torch.Tensor]]
    uses_context: bool = False


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _randn(shape, case: Case, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(case.dtype).to(case.device)


# ---- paged_decode --------------------------------------------------------------------------------
def _decode_make(case: Case, gen: torch.Generator) -> dict:
    b, n, hq, hkv, d = case.batch, case.context, case.num_heads, case.num_kv_heads, case.head_size
    k, v = _randn((b, hkv, n, d), case, gen), _randn((b, hkv, n, d), case, gen)
    per_seq = math.ceil(n / BLOCK_SIZE)
    kc, vc = ops.allocate_kv_cache(b * per_seq, BLOCK_SIZE, hkv, d, case.dtype, case.device)
    tables = torch.randperm(b * per_seq, generator=gen).view(b, per_seq).to(torch.int32).to(case.device)
    pos = torch.arange(n, device=case.device)
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    ops.reshape_and_cache(k.transpose(1, 2).reshape(-1, hkv, d).contiguous(),
                          v.transpose(1, 2).reshape(-1, hkv, d).contiguous(), kc, vc, slots)
    return {"query": _randn((b, hq, d), case, gen), "key": k, "value": v, "key_cache": kc, "value_cache": vc,
            "block_tables": tables, "seq_lens": torch.full((b,), n, dtype=torch.int32, device=case.device),
            "scale": d ** -0.5, "out": torch.empty((b, hq, d), dtype=case.dtype, device=case.device)}


def _decode_reference(x: dict) -> torch.Tensor:
    q, k, v = x["query"].double(), x["key"].double(), x["value"].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, L, D]
    p = torch.softmax(torch.einsum("bhd,bhld->bhl", q, k) * x["scale"], dim=-1)
    return torch.einsum("bhl,bhld->bhd", p, v)


def _decode_pagedllm(x: dict) -> torch.Tensor:
    ops.paged_attention(x["out"], x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"],
                        x["scale"])
    return x["out"]


def _decode_sdpa(x: dict) -> torch.Tensor:
    q = x["query"].unsqueeze(2)  # [B, Hq, 1, D]
    return F.scaled_dot_product_attention(q, x["key"], x["value"], scale=x["scale"], enable_gqa=True).squeeze(2)


def _decode_bytes(c: Case) -> float:
    return (2 * c.batch * c.context * c.num_kv_heads + 2 * c.batch * c.num_heads) * c.head_size * _elem(c.dtype)


# ---- rms_norm, silu_and_mul, reshape_and_cache -----------------------------------------------------
def _norm_make(case: Case, gen: torch.Generator) -> dict:
    return {"x": _randn((case.batch, case.hidden_size), case, gen),
            "weight": (1 + 0.5 * torch.rand(case.hidden_size, generator=gen)).to(case.dtype).to(case.device),
            "eps": 1e-5, "out": torch.empty((case.batch, case.hidden_size), dtype=case.dtype, device=case.device)}


def _norm_reference(x: dict) -> torch.Tensor:
    h = x["x"].double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + x["eps"]) * x["weight"].double()


def _silu_make(case: Case, gen: torch.Generator) -> dict:
    i = case.hidden_size
    return {"x": _randn((case.batch, 2 * i), case, gen),
            "out": torch.empty((case.batch, i), dtype=case.dtype, device=case.device)}


def _silu_reference(x: dict) -> torch.Tensor:
    a, b = x["x"].double().chunk(2, dim=-1)
    return F.silu(a) * b


def _cache_make(case: Case, gen: torch.Generator) -> dict:
    t, hkv, d = case.batch, case.num_kv_heads, case.head_size
    num_blocks = max(4, 2 * math.ceil(t / BLOCK_SIZE))
    kc, vc = ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, hkv, d, case.dtype, case.device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:t].to(case.device)
    return {"key": _randn((t, hkv, d), case, gen), "value": _randn((t, hkv, d), case, gen), "key_cache": kc,
            "value_cache": vc, "slot_mapping": slots}


def _cache_rows(x: dict) -> torch.Tensor:
    """The caches' rows at the slots, [2, T, Hkv, D] (what a write put there; the caches are
    ops.kv_cache_shape: [num_blocks, Hkv, block_size, D])."""
    blocks, offsets = x["slot_mapping"] // BLOCK_SIZE, x["slot_mapping"] % BLOCK_SIZE
    return torch.stack([x["key_cache"][blocks, :, offsets], x["value_cache"][blocks, :, offsets]])


def _cache_pagedllm(x: dict) -> dict:
    ops.reshape_and_cache(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"])
    return x


def _cache_torch(x: dict) -> dict:
    """The same writes by advanced indexing."""
    blocks, offsets = x["slot_mapping"] // BLOCK_SIZE, x["slot_mapping"] % BLOCK_SIZE
    x["key_cache"][blocks, :, offsets] = x["key"]
    x["value_cache"][blocks, :, offsets] = x["value"]
    return x


OPS: dict[str, OpSpec] = {
    "paged_decode": OpSpec(_decode_make, _decode_reference, _decode_bytes,
                           lambda c: 4.0 * c.batch * c.num_heads * c.context * c.head_size,
                           {"pagedllm": _decode_pagedllm, "sdpa": _decode_sdpa}, uses_context=True),
    "rms_norm": OpSpec(_norm_make, _norm_reference, lambda c: 2.0 * c.batch * c.hidden_size * _elem(c.dtype),
                       lambda c: 4.0 * c.batch * c.hidden_size,
                       {"pagedllm": lambda x: ops.rms_norm(x["out"], x["x"], x["weight"], x["eps"]),
                        "torch": lambda x: F.rms_norm(x["x"], (x["x"].shape[-1],), x["weight"], x["eps"])}),
    "silu_and_mul": OpSpec(_silu_make, _silu_reference, lambda c: 3.0 * c.batch * c.hidden_size * _elem(c.dtype),
                           lambda c: 5.0 * c.batch * c.hidden_size,
                           {"pagedllm": lambda x: ops.silu_and_mul(x["out"], x["x"]),
                            "torch": lambda x: F.silu(x["x"][:, :x["x"].shape[1] // 2]) * x["x"][:, x["x"].shape[1] // 2:]}),
    "reshape_and_cache": OpSpec(_cache_make, lambda x: torch.stack([x["key"], x["value"]]).double(),
                                lambda c: 4.0 * c.batch * c.num_kv_heads * c.head_size * _elem(c.dtype),
                                lambda c: 0.0, {"pagedllm": _cache_pagedllm, "torch": _cache_torch}),
}
#: outputs of kernels that write into inputs (reshape_and_cache): read back after the call
_READ_BACK = {"reshape_and_cache": _cache_rows}


def register_kernel(op: str, name: str, fn: Callable[[dict], torch.Tensor]) -> None:
    """Add `fn` as kernel `name` of `op` (one of OPS): fn(inputs) returns the op's output (the
    reference's shape; reshape_and_cache: writes the caches, return anything). Select it with
    BenchConfig.compare / --compare. ValueError for an unknown op or a name already taken."""
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {sorted(OPS)}")
    if name in OPS[op].kernels:
        raise ValueError(f"op {op!r} already has a kernel named {name!r}")
    OPS[op].kernels[name] = fn


@dataclasses.dataclass
class BenchConfig:
    ops: list[str] = dataclasses.field(default_factory=lambda: list(OPS))
    batch: list[int] = dataclasses.field(default_factory=lambda: [1, 16, 64])
    context: list[int] = dataclasses.field(default_factory=lambda: [512, 4096])
    dtype: list[str] = dataclasses.field(default_factory=lambda: ["bfloat16"])
    device: str = "auto"
    #: peers to run beside "pagedllm" (names in OPS[op].kernels; unknown names are skipped per op)
    compare: list[str] = dataclasses.field(default_factory=lambda: ["sdpa", "torch"])
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    hidden_size: int = 4096
    trials: int = 7
    threads: int = 0  # CPU: 0 = every core this process may use
    seed: int = 0


def _timer(device: torch.device, budget_s: float = 0.05):
    """A function fn -> median seconds per call: calls are repeated to fill ~budget_s per trial."""
    def measure(fn: Callable[[], object], trials: int) -> float:
        fn()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        reps = max(1, min(1000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
        times = []
        for _ in range(trials):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / reps)
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.append((time.perf_counter() - t0) / reps)
        return statistics.median(times)
    return measure


def measure_roofline(device: torch.device, dtype: torch.dtype, trials: int = 5) -> dict:
    """The device's copy bandwidth (bytes/s: read + write of a large tensor) and matmul FLOP/s in
    `dtype`, measured now."""
    measure = _timer(device, 0.1)
    n = (256 << 20) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    bandwidth = 2 * n / measure(lambda: dst.copy_(src), trials)
    m = 4096 if device.type == "cuda" else 512
    a = torch.randn(m, m, device=device).to(dtype)
    b = torch.randn(m, m, device=device).to(dtype)
    flops = 2 * m**3 / measure(lambda: a @ b, trials)
    return {"bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops, "copy_bytes": n, "matmul_n": m}


def _check(op: str, spec: OpSpec, fn, inputs: dict, reference: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    out = fn(inputs)
    if op in _READ_BACK:
        out = _READ_BACK[op](inputs)
    out = out.double()
    if out.shape != reference.shape:
        return False, float("inf")
    err = float((out - reference).abs().max()) / max(1.0, float(reference.abs().max()))
    return err <= TOLERANCE[dtype], err


def run(config: BenchConfig) -> dict:
    """Every case of `config` (module docstring); returns the result document (JSON-ready)."""
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                          else "cpu" if config.device == "auto" else config.device)
    unknown = sorted(set(config.ops) - set(OPS))
    if unknown:
        raise ValueError(f"--op {unknown} unknown: choose from {sorted(OPS)}")
    if device.type == "cpu":
        threads = config.threads or len(os.sched_getaffinity(0))
        ops.set_cpu_threads(threads)
    dtypes = [getattr(torch, d) for d in config.dtype]
    gen = torch.Generator().manual_seed(config.seed)
    measure = _timer(device)
    rooflines = {str(d).removeprefix("torch."): measure_roofline(device, d) for d in dtypes}
    rows, failed = [], 0
    for op in config.ops:
        spec = OPS[op]
        names = ["pagedllm"] + [n for n in config.compare if n in spec.kernels and n != "pagedllm"]
        for dtype in dtypes:
            roof = rooflines[str(dtype).removeprefix("torch.")]
            for batch in config.batch:
                for context in (config.context if spec.uses_context else [0]):
                    case = Case(op, batch, context, dtype, device, config.num_heads, config.num_kv_heads,
                                config.head_size, config.hidden_size)
                    inputs = spec.make(case, gen)
                    reference = spec.reference(inputs)
                    for name in names:
                        fn = spec.kernels[name]
                        ok, err = _check(op, spec, fn, inputs, reference, dtype)
                        row = {"op": op, "kernel": name, "batch": batch, "context": context or None,
                               "dtype": str(dtype).removeprefix("torch."), "check": "passed" if ok else "failed",
                               "max_rel_error": err}
                        if ok:
                            t = measure(lambda: fn(inputs), config.trials)
                            nbytes, flops = spec.bytes(case), spec.flops(case)
                            t_roof = max(nbytes / roof["bandwidth_bytes_per_s"], flops / roof["matmul_flops_per_s"])
                            row.update(time_us=t * 1e6, bandwidth_gb_s=nbytes / t / 1e9, tflops=flops / t / 1e12,
                                       arithmetic_intensity=flops / nbytes if nbytes else 0.0,
                                       roofline_fraction=t_roof / t)
                        else:
                            failed += 1
                        rows.append(row)
    return {"bench": "kernels", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "commit": _commit(), "settings": {**dataclasses.asdict(config), "device": str(device)},
            "roofline": rooflines, "rows": rows, "failed_checks": failed}


def _commit() -> str:
    from pagedllm.benchmarks.throughput import git_commit

    return git_commit(Path(__file__).resolve().parents[3])


def print_table(result: dict, file=sys.stdout) -> None:
    head = f"{'op':<18}{'kernel':<10}{'dtype':<10}{'batch':>6}{'context':>8}{'check':>8}{'us':>11}{'GB/s':>9}" \
           f"{'TFLOP/s':>9}{'roofline':>9}"
    print(head, file=file)
    for r in result["rows"]:
        timed = r["check"] == "passed"
        print(f"{r['op']:<18}{r['kernel']:<10}{r['dtype']:<10}{r['batch']:>6}{(r['context'] or '-'):>8}"
              f"{r['check']:>8}" + (f"{r['time_us']:>11.2f}{r['bandwidth_gb_s']:>9.1f}{r['tflops']:>9.3f}"
                                    f"{r['roofline_fraction']:>9.2f}" if timed else f"  error {r['max_rel_error']:.3g}"),
              file=file)


def plot(result: dict, path: str) -> None:
    """The roofline chart (achieved FLOP/s against arithmetic intensity, the measured bandwidth and
    matmul ceilings) and, for paged_decode, time against context length; one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
    rows = [r for r in result["rows"] if r["check"] == "passed"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, roof in result["roofline"].items():
        bw, peak = roof["bandwidth_bytes_per_s"], roof["matmul_flops_per_s"]
        xs = [2.0**e for e in range(-4, 12)]
        left.plot(xs, [min(peak, bw * x) / 1e12 for x in xs], "--", label=f"roofline {dtype}")
    for key in sorted({(r["op"], r["kernel"]) for r in rows if r["arithmetic_intensity"] > 0}):
        pts = [r for r in rows if (r["op"], r["kernel"]) == key]
        left.scatter([r["arithmetic_intensity"] for r in pts], [r["tflops"] for r in pts], s=16,
                     marker="o" if key[1] == "pagedllm" else "x", label=f"{key[0]} ({key[1]})")
    left.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="TFLOP/s",
             title="roofline (ceilings measured in this run; small inputs may sit in cache)")
    left.legend(fontsize=7)
    decode = [r for r in rows if r["op"] == "paged_decode"]
    for key in sorted({(r["kernel"], r["dtype"], r["batch"]) for r in decode}):
        pts = sorted((r["context"], r["time_us"]) for r in decode if (r["kernel"], r["dtype"], r["batch"]) == key)
        right.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]} B={key[2]}")
    right.set(xlabel="context (tokens)", ylabel="microseconds", title="paged_decode: time against context")
    if decode:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench kernels", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchConfig()
    p.add_argument("--op", nargs="+", default=d.ops, choices=sorted(OPS))
    p.add_argument("--batch", nargs="+", type=int, default=d.batch, help="sequences (decode) or tokens")
    p.add_argument("--context", nargs="+", type=int, default=d.context, help="paged_decode context lengths")
    p.add_argument("--dtype", nargs="+", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--compare", nargs="*", default=d.compare, help="peers beside pagedllm (sdpa, torch, registered)")
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--head-size", type=int, default=d.head_size)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--trials", type=int, default=d.trials)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: every core of this process)")
    p.add_argument("--json", default=None, help="write the result document here")
    p.add_argument("--plot", default=None, help="write the roofline / context plot (PNG) here")
    args = p.parse_args(argv)
    config = BenchConfig(ops=args.op, batch=args.batch, context=args.context, dtype=args.dtype, device=args.device,
                         compare=args.compare, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                         head_size=args.head_size, hidden_size=args.hidden_size, trials=args.trials,
                         threads=args.threads)
    try:
        result = run(config)
    except ValueError as exc:
        print(f"pagedllm bench kernels: {exc}", file=sys.stderr)
        return 2
    print_table(result)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError as exc:
            print(f"pagedllm bench kernels: {exc}", file=sys.stderr)
            return 2
    if result["failed_checks"]:
        print(f"{result['failed_checks']} kernel(s) failed the float64 reference check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
