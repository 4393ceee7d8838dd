"""Batch-1 decode forward of the Llama-3-8B shape as ONE CUDA graph, in variants: where do the
~11 us per layer of rotary + decode attention + their kernel boundaries go, and what do GEMV
prefetch and PDL settings change?

Engine-free: LlamaForCausalLM on a config-only folder (bench/throughput_gpu.py's SHAPES), random
bf16 weights drawn on the GPU (init_dummy_weights), one sequence of --ctx tokens (the decode token
at position ctx - 1; block size 16, block-table width ceil(max_model_len / 16) = 32 of distinct
blocks, the KV cache filled with random values), logits of that one row. Per layer the chain is
fused_add_rms_norm -> qkv GEMV -> rotary_embedding_and_cache -> paged decode attention -> o GEMV ->
fused_add_rms_norm -> gate_up GEMV -> silu_and_mul -> down GEMV (every kernel but attention
launched with PDL). Variants (each captured as one graph: embeddings, 32 layers, final norm, LM
head); DecoderLayer._attention is monkeypatched for the decomposition ones:
  base            the model as it is
  no_attn         no rotary, no attention: the o GEMV reads the q part of qkv. At T = 1 the old
                  `qkv[:, :q_size].contiguous()` is already contiguous, so NO copy kernel runs
                  (the o GEMV directly follows the qkv GEMV)
  copy_only       no_attn with a real copy kernel (qkv[:, :q_size].clone()) in attention's place
  rotary_only     rotary_embedding_and_cache as the model runs it, no attention: the o GEMV reads
                  the rotated query
  attn_only       no rotary kernel: self.attn.attend on a per-layer preallocated query (filled by a
                  copy of q during the uncaptured warm-up steps; no copy in the graph)
  attn_copy       no rotary kernel: attend on qkv[:, :q_size].clone() (a copy kernel in the graph)
  (not by default: o_prefetch, o_prefetch0, qkv_o_prefetch, all_prefetch: GEMV config prefetch;
  no_pdl: ops.set_pdl_enabled(False))
Session 10 also timed knobs from a patch that is not in the tree (results -2.json): the decode
kernel's dependents triggered at its end, GEMVs without pre-wait loads, a persistent split-K
workspace and a PDL launch of the decode kernel. The last two are now the code (AttentionOptions::
workspace, launch_pdl in cuda/paged_decode_v2.cu); the others changed nothing or were slower.
Variants may set environment variables (V(env=...)) read by the C++ launchers at every launch, so a
graph keeps what was set while it was captured; the script sets them (os.environ) only around the capture
(o_env: only around the o projection's GEMV call). Every variant that runs the model's attention
must give logits bit-equal to base (checked; a mismatch is an error). Each graph: warm-up, then
--replays back-to-back replays, each between two CUDA events; the median (and min, p90, mean) in
microseconds. The variant list runs --passes times (reversed on odd passes), each pass capturing
its own graphs. Per-layer decomposition from the medians over passes. --dump: graphs written with
cudaGraphDebugDotPrint (torch's CUDAGraph debug mode) as DIR/<variant>.dot, captured after the
timed passes. Floor: the matrix weight bytes (every projection + LM head, bf16) over the device
copy bandwidth (4 GiB device-to-device copy, read + write bytes, mean of 10), before and after.

    python3 bench/batch1_graph.py [--ctx 300] [--replays 200] [--passes 3] [--tag -2] [--out DIR]
Prints one JSON document and writes DIR/<date>-<machine>-batch1_graph<tag>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_kernels import git_commit  # noqa: E402
from throughput_gpu import SHAPES, copy_bandwidth  # noqa: E402

BLOCK_SIZE = 16
PROJ = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")



def V(proj=(), config=None, pdl=True, attn="model", env=None, o_env=None, rope="model", qkv_config=None,
      split_k=None, early=True, gate_up="model", gate_up_config=None, lm_head_config=None):
    """proj: projections through ops.gemv(config=config) (those the layer calls through
    their linear method without fusions: not the qkv with the rope epilogue nor the gate_up with paired rows, whose
    configs are qkv_config / gate_up_config); attn: model | none | copy | rotary |
    attend_prealloc | attend_copy; env: set around the capture; o_env: around the o GEMV call;
    rope: model (as the runner leaves it: paired qkv rows where they apply) | counters (the qkv
    rows unpaired: the epilogue's last CTA per head rotates it) | separate (no rope epilogue: the
    rotary kernel; implied by every attn but model, which replace DecoderLayer._attention);
    qkv_config, gate_up_config, lm_head_config: the rope qkv GEMV's, the SiLU-epilogue gate_up
    GEMV's and the LM head GEMV's config (DecoderLayer.qkv_gemv_config / gate_up_gemv_config,
    LlamaForCausalLM.lm_head_gemv_config); split_k: the decode
    attention's split (Attention.split_k; 0 = one pass); early: the decode kernel's early context
    loads (attention.EARLY_CONTEXT_LOADS); gate_up: model (as the runner leaves it: paired gate/up
    rows, the SiLU in the gate_up GEMV's epilogue) | unpaired (the silu_and_mul kernel). `exact`:
    whether the logits must equal base's bit for bit (not for another split or GEMV tiling, whose
    sums differ, nor without early loads, with which the cost model may split otherwise, nor for
    rope or gate_up variants: their graphs are replayed after the weights are paired again, so only
    their timing counts)."""
    if attn != "model":
        rope = "separate"
    return {"proj": tuple(proj), "config": config, "pdl": pdl, "attn": attn, "env": dict(env or {}),
            "o_env": dict(o_env or {}), "rope": rope, "qkv_config": qkv_config, "split_k": split_k,
            "early": early, "gate_up": gate_up, "gate_up_config": gate_up_config, "lm_head_config": lm_head_config,
            "exact": attn == "model" and rope == "model" and split_k is None and early and gate_up == "model"
            and not any(set(c or {}) & {"variant", "warps", "splits"}
                        for c in (config, qkv_config, gate_up_config, lm_head_config))}


VARIANTS = {
    "base": V(),
    "no_attn": V(attn="none"),
    "copy_only": V(attn="copy"),
    "rotary_only": V(attn="rotary"),
    "attn_only": V(attn="attend_prealloc"),
    "attn_copy": V(attn="attend_copy"),
    "o_prefetch": V(("o_proj",), {"prefetch": 1}),
    "o_prefetch0": V(("o_proj",), {"prefetch": 0}),
    "qkv_o_prefetch": V(("qkv_proj", "o_proj"), {"prefetch": 1}),
    "all_prefetch": V(PROJ, {"prefetch": 1}),
    "no_pdl": V(pdl=False),
    "rope_counters": V(rope="counters"),
    "rope_separate": V(rope="separate"),
    "qkv_rows32": V(qkv_config={"variant": 2}),
    "split1": V(split_k=0),
    "split4": V(split_k=4),
    "split16": V(split_k=16),
    "no_early": V(early=False),
    # GEMV tilings per projection (gemv.h GemvConfig; the automatic choice, 8 warps and no split
    # for every Llama-3-8B projection, is variant 3 for qkv since session 12 — one wave of its 384
    # row tiles at 3 CTAs per SM — and variant 1 for the others), 4 warps, or a cluster K split
    "qkv_v1": V(qkv_config={"variant": 1}),
    "qkv_v3": V(qkv_config={"variant": 3}),  # = base since session 12, but not held to bit equality
    "qkv_v3w4": V(qkv_config={"variant": 3, "warps": 4}),
    "o_v3": V(("o_proj",), {"variant": 3}),
    "down_v3": V(("down_proj",), {"variant": 3}),
    "gate_up_v3": V(gate_up_config={"variant": 3}),
    "lm_head_v3": V(lm_head_config={"variant": 3}),
    "qkv_w4": V(qkv_config={"warps": 4}),
    "qkv_split2": V(qkv_config={"splits": 2}),
    "o_w4": V(("o_proj",), {"warps": 4}),
    "o_split2": V(("o_proj",), {"splits": 2}),
    "down_w4": V(("down_proj",), {"warps": 4}),
    "down_split2": V(("down_proj",), {"splits": 2}),
    "gate_up_unpaired": V(gate_up="unpaired"),
}
DEFAULT_VARIANTS = ["base", "no_attn", "copy_only", "rotary_only", "attn_only", "attn_copy"]


class Env:
    """Sets environment variables while active (restoring the previous values)."""

    def __init__(self, values: dict):
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(args):
    from pagedllm import ops
    from pagedllm.model_executor.layers.attention import AttentionMetadata
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.dummy import init_dummy_weights
    from pagedllm.model_executor.models import LlamaForCausalLM

    dev = torch.device("cuda")
    cfg = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(cfg))
        mc = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(mc, torch.bfloat16, dev, max_positions=args.max_model_len)
    init_dummy_weights(model, args.seed)
    model.eval()
    model.pack_weights()  # as the runner; a no-op on CUDA
    log(f"paired rotary rows: {model.pair_rotary_rows()}")  # as the runner
    log(f"paired gate/up rows: {model.pair_gate_up_rows()}")
    width = math.ceil(args.max_model_len / BLOCK_SIZE)
    num_blocks = width + 4
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + 1)
    kv_caches = []
    for _ in range(mc.num_hidden_layers):
        k, v = ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, mc.num_key_value_heads, mc.head_dim, torch.bfloat16, dev)
        k.normal_(generator=gen)
        v.normal_(generator=gen)
        kv_caches.append((k, v))
    ctx = args.ctx
    tables = torch.randperm(num_blocks, device=dev, generator=gen)[:width].to(torch.int32).view(1, width)
    slot = (tables[0, (ctx - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE).view(1)
    meta = AttentionMetadata(slot_mapping=slot, block_tables=tables,
                             seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev), decode_only=True)
    ids = torch.randint(0, mc.vocab_size, (1,), device=dev, generator=gen).to(torch.int32)
    positions = torch.tensor([ctx - 1], dtype=torch.int64, device=dev)
    logits_indices = torch.zeros(1, dtype=torch.int64, device=dev)
    return model, kv_caches, meta, ids, positions, logits_indices, width


class Patched:
    """Applies one variant's monkeypatches (projection configs, o-GEMV environment, PDL, attention
    replacement, environment knobs) while active; counts the patched projections' calls by name."""

    def __init__(self, model, spec):
        from pagedllm import ops
        from pagedllm.model_executor.models import llama

        self.ops, self.llama, self.spec, self.model = ops, llama, spec, model
        self.was_paired, self.gate_up_was_paired, self.counters = False, False, None
        names = set(spec["proj"]) | ({"o_proj"} if spec["o_env"] else set())
        self.routes = {id(getattr(layer, n)): n for layer in model.layers for n in names}
        self.hits: dict[str, int] = {}
        self.env = Env(spec["env"])
        self.queries: dict[int, torch.Tensor] = {}  # attend_prealloc: per layer

    def __enter__(self):
        ops, llama, spec = self.ops, self.llama, self.spec
        from pagedllm.model_executor.layers.linear_method import UnquantizedLinearMethod

        self._method = UnquantizedLinearMethod
        self._apply, self._attn, self._pdl = UnquantizedLinearMethod.apply, llama.DecoderLayer._attention, \
            ops.pdl_enabled()
        orig, routes, hits = self._apply, self.routes, self.hits
        config, proj, o_env = spec["config"], set(spec["proj"]), spec["o_env"]

        def apply(method, layer, x, out=None, **fusion):
            name = routes.get(id(layer))
            fused = out is not None or any(v is not None and v is not False for v in fusion.values())
            if name is None or fused or not method.fusions_apply(layer, x.shape[0]):
                return orig(method, layer, x, out=out, **fusion)
            hits[name] = hits.get(name, 0) + 1
            with Env(o_env if name == "o_proj" else {}):
                if name in proj:
                    return ops.gemv(x, layer.weight, layer.bias, config=dict(config))
                return orig(method, layer, x, out=out, **fusion)

        if routes:
            UnquantizedLinearMethod.apply = apply
        mode = spec["attn"]
        queries = self.queries
        if mode != "model":
            def attention(layer, qkv, positions, cos_sin, rotary, kv_cache, meta):
                T = qkv.shape[0]
                q = qkv[:, :layer.q_size]
                if mode == "none":  # as the first script: at T = 1 a no-op (already contiguous)
                    return q.contiguous().view(T, layer.q_size)
                if mode == "copy":
                    return q.clone()
                if mode == "rotary":
                    k = qkv[:, layer.q_size:layer.q_size + layer.kv_size].view(T, layer.num_kv_heads, layer.head_dim)
                    v = qkv[:, layer.q_size + layer.kv_size:].view(T, layer.num_kv_heads, layer.head_dim)
                    query = torch.empty((T, layer.num_heads, layer.head_dim), dtype=qkv.dtype, device=qkv.device)
                    key_cache, value_cache = kv_cache
                    ops.rotary_embedding_and_cache(positions, q.view(T, layer.num_heads, layer.head_dim), k, v,
                                                   rotary.cos, rotary.sin, query, key_cache, value_cache,
                                                   meta.slot_mapping)
                    return query.view(T, layer.q_size)
                if mode == "attend_prealloc":
                    buf = queries.get(id(layer))
                    if buf is None:
                        buf = queries[id(layer)] = torch.empty((T, layer.num_heads, layer.head_dim),
                                                               dtype=qkv.dtype, device=qkv.device)
                    if not torch.cuda.is_current_stream_capturing():
                        buf.copy_(q.view(T, layer.num_heads, layer.head_dim))
                    return layer.attn.attend(buf, kv_cache, meta).view(T, layer.q_size)
                if mode == "attend_copy":
                    query = q.clone().view(T, layer.num_heads, layer.head_dim)
                    return layer.attn.attend(query, kv_cache, meta).view(T, layer.q_size)
                raise ValueError(mode)
            llama.DecoderLayer._attention = attention
        if not spec["pdl"]:
            ops.set_pdl_enabled(False)
        if spec["rope"] != "model":
            self.was_paired = self.model._unpair_rotary_rows()
        if spec["gate_up"] != "model":
            self.gate_up_was_paired = self.model._unpair_gate_up_rows()
        if spec["rope"] == "separate":
            self.counters = [layer.rope_counters for layer in self.model.layers]
            for layer in self.model.layers:
                layer.rope_counters = None
        from pagedllm.model_executor.layers import attention as attention_mod

        self.attention_mod, self._early = attention_mod, attention_mod.EARLY_CONTEXT_LOADS
        attention_mod.EARLY_CONTEXT_LOADS = spec["early"]
        for layer in self.model.layers:
            layer.qkv_gemv_config = spec["qkv_config"]
            layer.gate_up_gemv_config = spec["gate_up_config"]
            layer.attn.split_k = spec["split_k"]
        self.model.lm_head_gemv_config = spec["lm_head_config"]
        self.env.__enter__()
        return self

    def __exit__(self, *exc):
        self.env.__exit__(*exc)
        self.attention_mod.EARLY_CONTEXT_LOADS = self._early
        for layer in self.model.layers:
            layer.qkv_gemv_config = None
            layer.gate_up_gemv_config = None
            layer.attn.split_k = None
        self.model.lm_head_gemv_config = None
        if self.counters is not None:
            for layer, c in zip(self.model.layers, self.counters):
                layer.rope_counters = c
            self.counters = None
        if self.was_paired:
            self.model.pair_rotary_rows()
            self.was_paired = False
        if self.gate_up_was_paired:
            self.model.pair_gate_up_rows()
            self.gate_up_was_paired = False
        self._method.apply = self._apply
        self.llama.DecoderLayer._attention = self._attn
        self.ops.set_pdl_enabled(self._pdl)
        return False


def capture(step, patch: Patched, debug: bool = False):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with patch, torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture (lazy init, allocator)
            step()
        patch.hits.clear()
        graph = torch.cuda.CUDAGraph()
        if debug:  # run -2 (torch 2.11): enable_debug_mode alone gave empty .dot files; keep_graph untested
            try:
                graph = torch.cuda.CUDAGraph(keep_graph=True)
            except TypeError:
                graph.enable_debug_mode()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph, out


def time_graph(graph, replays: int, warmup: int) -> dict:
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in events:  # back to back: the host stays ahead of the GPU (launch << replay)
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1e3 for a, b in events)
    span = events[0][0].elapsed_time(events[-1][1]) * 1e3
    return {"median_us": round(statistics.median(ts), 1), "min_us": round(ts[0], 1),
            "p90_us": round(ts[int(0.9 * (len(ts) - 1))], 1), "mean_span_us": round(span / replays, 1),
            "replays": replays}


def per_layer(a, b, L):
    return [round((x - y) / L, 2) for x, y in zip(a, b)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    p.add_argument("--ctx", type=int, default=300)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--dump", nargs="*", default=["base"], choices=list(VARIANTS),
                   help="variants whose graph is written as DIR/<variant>.dot (after the timed passes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", default="h200")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.replays < 50:
        p.error("--replays: at least 50")
    if "base" not in args.variants:
        p.error("--variants: base is needed (the reference)")
    if not torch.cuda.is_available():
        log("batch1_graph: no CUDA device")
        return 2
    from pagedllm import ops

    torch.backends.cuda.matmul.allow_tf32 = False
    bw_before = copy_bandwidth()
    log(f"copy bandwidth {bw_before / 1e12:.3f} TB/s")
    model, kv_caches, meta, ids, positions, logits_indices, width = build(args)
    L = len(model.layers)
    weight_bytes = sum(getattr(layer, n).weight.numel() * getattr(layer, n).weight.element_size()
                       for layer in model.layers for n in PROJ)
    weight_bytes += model.lm_head_weight.numel() * model.lm_head_weight.element_size()
    log(f"model built: {L} layers, matrix weights {weight_bytes / 1e9:.3f} GB, block table width {width}")

    def step():
        return model(ids, positions, kv_caches, meta, logits_indices)

    doc = {
        "bench": "batch1_graph", "commit": git_commit(), "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_properties(0).name, "torch": torch.__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_") and k != "PAGEDLLM_COMMIT"},
        "shape": {"name": args.shape, "layers": L, "context": args.ctx, "block_size": BLOCK_SIZE,
                  "block_table_width": width, "max_model_len": args.max_model_len, "dtype": "bfloat16",
                  "gemv_max_tokens": model.gemv_max_tokens, "pdl_default": ops.pdl_enabled()},
        "variants": {name: {k: (list(v) if isinstance(v, tuple) else v) for k, v in VARIANTS[name].items()}
                     for name in args.variants},
        "passes": [], "errors": {},
    }
    ref = None
    with torch.inference_mode():
        for pas in range(args.passes):
            results = {}
            order = ["base"] + [n for n in args.variants if n != "base"]
            if pas % 2 == 1:
                order = ["base"] + order[1:][::-1]
            for name in order:
                spec = VARIANTS[name]
                try:
                    patch = Patched(model, spec)
                    graph, out = capture(step, patch)
                    if name == "base" and "decode_plan" not in doc:
                        doc["decode_plan"] = ops.last_cuda_decode_plan()
                    r = time_graph(graph, args.replays, args.warmup)
                    r["patched_calls"] = dict(patch.hits)
                    logits = out.float().clone()
                    if name == "base" and ref is None:
                        ref = logits
                    if ref is not None:
                        r["max_abs_diff_vs_base"] = float((logits - ref).abs().max())
                        r["bit_equal_vs_base"] = bool(torch.equal(logits, ref))
                        if spec["exact"] and not r["bit_equal_vs_base"]:
                            doc["errors"][f"pass{pas + 1}/{name}"] = "logits differ from base"
                    del graph, out
                    torch.cuda.empty_cache()
                except Exception as e:  # record and go on with the other variants
                    r = {"error": f"{type(e).__name__}: {e}"}
                    doc["errors"][f"pass{pas + 1}/{name}"] = r["error"]
                results[name] = r
                log(f"pass {pas + 1} {name}: {r}")
            doc["passes"].append({n: results[n] for n in args.variants})
        dumps = {}
        for name in args.dump or []:
            try:
                patch = Patched(model, VARIANTS[name])
                graph, out = capture(step, patch, debug=True)
                path = Path(args.out) / f"{name}.dot"
                os.makedirs(args.out, exist_ok=True)
                graph.debug_dump(str(path))  # a keep_graph graph is never instantiated here (not replayed)
                text = path.read_text(errors="replace") if path.exists() else ""
                low = text.lower()
                dumps[name] = {"file": path.name, "bytes": len(text), "edges": text.count("->"),
                               "kernel_nodes": low.count("kernel_node") or low.count("kernel"),
                               "mem_alloc": low.count("mem_alloc"), "mem_free": low.count("mem_free"),
                               "programmatic": low.count("programmatic")}
                del graph, out
                torch.cuda.empty_cache()
            except Exception as e:
                dumps[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"dump {name}: {dumps[name]}")
        doc["dumps"] = dumps
    bw_after = copy_bandwidth()
    floor_us = weight_bytes / bw_before * 1e6
    doc["floor"] = {"matrix_weight_bytes": weight_bytes, "copy_bytes_per_s_before": bw_before,
                    "copy_bytes_per_s_after": bw_after, "floor_us": round(floor_us, 1),
                    "floor_us_after": round(weight_bytes / bw_after * 1e6, 1)}
    summary = {}
    for name in args.variants:
        meds = [ps[name].get("median_us") for ps in doc["passes"]]
        if any(m is None for m in meds):
            continue
        s = {"median_us_per_pass": meds, "median_of_passes_us": round(statistics.median(meds), 1),
             "x_floor": [round(m / floor_us, 4) for m in meds]}
        base = [ps.get("base", {}).get("median_us") for ps in doc["passes"]]
        if all(b is not None for b in base) and name != "base":
            s["minus_base_us"] = [round(m - b, 1) for m, b in zip(meds, base)]
            s["minus_base_us_per_layer"] = per_layer(meds, base, L)
        summary[name] = s
    doc["summary"] = summary
    # Per-layer decomposition (us per layer; per pass, and from the medians over passes).
    terms = {"rotary (rotary_only - no_attn)": ("rotary_only", "no_attn"),
             "attention after rotary (base - rotary_only)": ("base", "rotary_only"),
             "attention alone (attn_only - no_attn)": ("attn_only", "no_attn"),
             "copy kernel (copy_only - no_attn)": ("copy_only", "no_attn"),
             "attention after a copy (attn_copy - copy_only)": ("attn_copy", "copy_only"),
             "rotary + attention (base - no_attn)": ("base", "no_attn")}
    dec = {}
    for label, (a, b) in terms.items():
        if a in summary and b in summary:
            dec[label] = {"per_pass": per_layer(summary[a]["median_us_per_pass"], summary[b]["median_us_per_pass"], L),
                          "of_medians": round((summary[a]["median_of_passes_us"] - summary[b]["median_of_passes_us"]) / L, 2)}
    if all(n in summary for n in ("base", "no_attn", "rotary_only", "attn_only")):
        m = {n: summary[n]["median_of_passes_us"] for n in ("base", "no_attn", "rotary_only", "attn_only")}
        dec["interaction (base - no_attn - rotary - attention alone)"] = {
            "of_medians": round((m["base"] - m["rotary_only"] - m["attn_only"] + m["no_attn"]) / L, 2)}
    doc["decomposition_us_per_layer"] = dec
    text = json.dumps(doc, indent=1)
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / f"{doc['date']}-{args.machine}-batch1_graph{args.tag}.json"
    path.write_text(text + "\n")
    log(f"wrote {path}")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
