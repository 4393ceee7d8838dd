"""The Sampler: one batched call per engine step, logits [R, V] -> token ids (+ logprobs).

Per-sequence sampling parameters live in preallocated numpy tables indexed by a slot; a
sequence gets a slot in ``add_sequence`` and gives it back in ``remove_sequence``. One step
gathers the rows' parameters with a vectorised lookup of ``seq_ids`` (no per-row Python loop
for plain rows; only rows with logit_bias, allowed_token_ids, an active min_tokens mask, penalties
or a seed are visited individually).

Usage by the engine loop (see pagedllm.sample.__init__ for the whole contract)::

    sampler = Sampler(vocab_size, seed=0)
    sampler.add_sequence(seq_id, params, prompt_token_ids, index, eos_token_ids)   # new_seqs
    out = sampler(logits, sched_out.sample_seq_ids)     # SamplerOutput
    result = core.update_from_output(sched_out, out.sampled_token_ids)
    sampler.append_output_tokens(result.seq_ids, result.token_ids)
    for (_, seq_id, *_rest) in result.finished: sampler.remove_sequence(seq_id)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm import ops as native_ops
from pagedllm.sample import ops
from pagedllm.sampling_params import _SAMPLING_EPS, SamplingParams

_SEED_MASK = 2**64 - 1
# logits dtypes pagedllm.ops.argmax_rows takes, per device type
_NATIVE_ARGMAX_DTYPES = {"cpu": (torch.float32, torch.bfloat16),
                         "cuda": (torch.float32, torch.bfloat16, torch.float16)}

logger = logging.getLogger("pagedllm")


@dataclass
class LogprobsTensors:
    """Logprobs of R rows (numpy, on the host).

    token_ids int64 [R, K+1], logprobs float32 [R, K+1]: column 0 is the sampled (or, for
    prompt logprobs, the actual next) token, columns 1..K the top-K tokens, descending.
    ranks int64 [R]: rank of column 0's token (1 = most likely).
    num_logprobs int64 [R]: how many top-K columns row r asked for (-1 = row asked for none).
    K is the largest request in the batch; row r uses columns 0..num_logprobs[r].
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    num_logprobs: np.ndarray


@dataclass
class SamplerOutput:
    """sampled_token_ids: int32 [R] (numpy, host), for EngineCore.update_from_output.
    logprobs: LogprobsTensors when any row asked for logprobs, else None."""

    sampled_token_ids: np.ndarray
    logprobs: Optional[LogprobsTensors]


class PendingSample:
    """One sampler call's result on its way to the host (async scheduling).

    device_ids: int64 [R] on the logits' device, available at once (in stream order) — what the
    next step's placeholder tokens read (pagedllm.ops.fill_placeholder_ids). result(): the
    SamplerOutput, waiting for the device-to-host copies (issued non-blocking into pinned memory,
    behind an event) on CUDA. Rows a sampler call skipped (``rows`` given: the sampled rows are
    those of ``rows`` among ``num_rows``) get token id 0, and the logprobs cover the sampled rows only.
    """

    def __init__(self, device_ids: torch.Tensor, logprobs=None, num_logprobs=None,
                 rows: Optional[np.ndarray] = None, num_rows: Optional[int] = None) -> None:
        device_ids = device_ids.to(torch.int64)
        #: the rows (of num_rows) that the logprobs cover, or None: all of them
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        if rows is not None:
            full = torch.zeros(num_rows, dtype=torch.int64, device=device_ids.device)
            full[torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device_ids.device)] = device_ids
            device_ids = full
        self.device_ids = device_ids
        self._num_logprobs = num_logprobs
        parts = [device_ids] + ([] if logprobs is None else list(logprobs))
        self._event = None
        if device_ids.is_cuda:  # non-blocking copies land in pinned memory; the event says when
            self._host = [t.to("cpu", non_blocking=True) for t in parts]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = parts

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        host = [t.numpy() for t in self._host]
        logprobs = None
        if len(host) > 1:
            logprobs = LogprobsTensors(token_ids=host[1], logprobs=host[2], ranks=host[3],
                                       num_logprobs=self._num_logprobs)
        return SamplerOutput(host[0].astype(np.int32), logprobs)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function (Steele et al. 2014) on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _counter_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 U[0, 1) per (seed, position) pair (uint64 arrays): the top 53 bits of a hash."""
    h = _splitmix64(_splitmix64(seeds) ^ positions)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


class Sampler:
    """Batched sampler with per-sequence state (vLLM v1 semantics, see SamplingParams).

    vocab_size: V of the logits. seed: seeds the stream shared by unseeded rows (LLM(seed=...)).
    capacity: initial number of slots (grows by doubling as needed).
    Errors: ValueError for an unknown seq id, a seq id added twice, or params whose token ids
    are outside the vocabulary.
    """

    def __init__(self, vocab_size: int, seed: int = 0, capacity: int = 256) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self._default_gen = torch.Generator()
        self._default_gen.manual_seed(self.seed)
        self._capacity = 0
        self._free: list[int] = []
        # Sorted seq ids and their slots (vectorised lookup with np.searchsorted).
        self._keys = np.zeros(0, dtype=np.int64)
        self._key_slots = np.zeros(0, dtype=np.int64)
        self._grow(max(1, int(capacity)))

    # ------------------------------------------------------------------ slot tables
    def _grow(self, capacity: int) -> None:
        old = self._capacity

        def grow(arr: Optional[np.ndarray], dtype, fill) -> np.ndarray:
            new = np.full(capacity, fill, dtype=dtype)
            if arr is not None:
                new[:old] = arr
            return new

        g = lambda name: getattr(self, name, None)  # noqa: E731
        self.temperature = grow(g("temperature"), np.float32, 1.0)
        self.top_k = grow(g("top_k"), np.int64, 0)  # 0 = off
        self.top_p = grow(g("top_p"), np.float32, 1.0)
        self.min_p = grow(g("min_p"), np.float32, 0.0)
        self.repetition_penalty = grow(g("repetition_penalty"), np.float32, 1.0)
        self.frequency_penalty = grow(g("frequency_penalty"), np.float32, 0.0)
        self.presence_penalty = grow(g("presence_penalty"), np.float32, 0.0)
        self.min_tokens = grow(g("min_tokens"), np.int64, 0)
        self.num_logprobs = grow(g("num_logprobs"), np.int64, -1)  # -1 = none
        self.num_output_tokens = grow(g("num_output_tokens"), np.int64, 0)
        self.has_penalty = grow(g("has_penalty"), np.bool_, False)
        self.has_bias = grow(g("has_bias"), np.bool_, False)
        self.has_allowed = grow(g("has_allowed"), np.bool_, False)
        self.has_seed = grow(g("has_seed"), np.bool_, False)
        self.has_grammar = grow(g("has_grammar"), np.bool_, False)
        extend = capacity - old
        self._matchers: list = (g("_matchers") or []) + [None] * extend  # xgrammar GrammarMatcher
        self._bitmask = g("_bitmask")  # structured outputs: int32 [rows, ceil(V / 32)], reused each step
        self._batch_matcher = g("_batch_matcher")
        self._fill_pool = g("_fill_pool")  # start_grammar's thread
        self._pending_fill = g("_pending_fill")  # ((rows, row indices, slots), Future) of start_grammar
        self._seeds: list[Optional[int]] = (g("_seeds") or []) + [None] * extend
        self._stop_ids: list[list[int]] = (g("_stop_ids") or []) + [[] for _ in range(extend)]
        self._bias: list[Optional[tuple[list[int], list[float]]]] = (g("_bias") or []) + [None] * extend
        self._allowed: list[Optional[list[int]]] = (g("_allowed") or []) + [None] * extend
        self._prompt_ids: list[Optional[np.ndarray]] = (g("_prompt_ids") or []) + [None] * extend
        self._output_ids: list[Optional[list[int]]] = (g("_output_ids") or []) + [None] * extend
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity

    def _slots_for(self, seq_ids: np.ndarray) -> np.ndarray:
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if seq_ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        pos = np.searchsorted(self._keys, seq_ids)
        pos_c = np.minimum(pos, max(len(self._keys) - 1, 0))
        ok = (pos < len(self._keys)) & (self._keys[pos_c] == seq_ids) if len(self._keys) else np.zeros(len(seq_ids), bool)
        if not ok.all():
            bad = seq_ids[~ok][:8].tolist()
            raise ValueError(f"seq_ids {bad} were never added to the sampler (add_sequence) or were removed")
        return self._key_slots[pos_c]

    @property
    def num_sequences(self) -> int:
        return len(self._keys)

    def known(self, seq_ids) -> np.ndarray:
        """bool [R]: which of seq_ids the sampler holds (not removed yet)."""
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if len(self._keys) == 0:
            return np.zeros(len(seq_ids), dtype=bool)
        pos = np.minimum(np.searchsorted(self._keys, seq_ids), len(self._keys) - 1)
        return self._keys[pos] == seq_ids

    def has_sequence(self, seq_id: int) -> bool:
        pos = int(np.searchsorted(self._keys, seq_id))
        return pos < len(self._keys) and int(self._keys[pos]) == int(seq_id)

    def add_sequence(
        self,
        seq_id: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray = (),
        index: int = 0,
        eos_token_ids: Sequence[int] = (),
        matcher=None,
    ) -> None:
        """Register sequence ``seq_id`` (an engine seq id) with its request's params.

        prompt_token_ids: the request's prompt (kept only when repetition_penalty != 1).
        index: the sequence's CompletionOutput.index; a seeded request's sequence i uses seed
          ``params.seed + i`` (as vLLM's n > 1 children), so the n draws differ.
        eos_token_ids: the model's EOS ids; masked with stop_token_ids before min_tokens
          outputs (also with ignore_eos: the real EOS ids, never a placeholder).
        matcher: the sequence's xgrammar GrammarMatcher (structured outputs; pagedllm.structured_output),
          or None: each step keeps only the tokens it allows, and it accepts each appended token.
        """
        seq_id = int(seq_id)
        if self.has_sequence(seq_id):
            raise ValueError(f"seq_id {seq_id} is already in the sampler")
        params.verify_for_vocab(self.vocab_size)
        for t in eos_token_ids:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"eos_token_ids contains {t}, outside the vocabulary (vocab_size={self.vocab_size})")
        if not self._free:
            self._grow(self._capacity * 2)
        slot = self._free.pop()
        try:
            self._fill_slot(slot, params, prompt_token_ids, index, eos_token_ids)
            if matcher is not None and matcher.is_terminated():
                matcher = None  # a finished grammar constrains nothing more
            self.has_grammar[slot] = matcher is not None
            self._matchers[slot] = matcher
        except BaseException:
            self._free.append(slot)  # nothing registered
            raise
        pos = int(np.searchsorted(self._keys, seq_id))
        self._keys = np.insert(self._keys, pos, seq_id)
        self._key_slots = np.insert(self._key_slots, pos, slot)

    def _fill_slot(self, slot: int, params: SamplingParams, prompt_token_ids, index: int, eos_token_ids) -> None:
        greedy = params.temperature < _SAMPLING_EPS
        self.temperature[slot] = 0.0 if greedy else params.temperature
        top_k = params.top_k
        self.top_k[slot] = 0 if (top_k <= 0 or top_k >= self.vocab_size) else top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.min_tokens[slot] = params.min_tokens
        lp = params.logprobs
        if params.use_beam_search:  # the engine's beam step reads each beam's top max(2, 1 + #eos) x W
            n_eos = 0 if params.ignore_eos else len({int(t) for t in eos_token_ids})
            lp = max(2, 1 + n_eos) * params.n
            if lp > self.vocab_size:
                raise ValueError(f"beam search with n={params.n} needs the top {lp} tokens of each step, more "
                                 f"than the vocabulary size {self.vocab_size}")
        self.num_logprobs[slot] = -1 if lp is None else (self.vocab_size if lp == -1 else lp)
        self.num_output_tokens[slot] = 0
        penalty = (
            params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        )
        self.has_penalty[slot] = penalty
        self._output_ids[slot] = [] if penalty else None
        self._prompt_ids[slot] = (
            np.asarray(prompt_token_ids, dtype=np.int64).copy() if params.repetition_penalty != 1.0 else None
        )
        bias = params.logit_bias
        self.has_bias[slot] = bool(bias)
        self._bias[slot] = (list(bias.keys()), list(bias.values())) if bias else None
        self.has_allowed[slot] = params.allowed_token_ids is not None
        self._allowed[slot] = list(params.allowed_token_ids) if params.allowed_token_ids is not None else None
        stop_ids = sorted({int(t) for t in eos_token_ids} | set(params.stop_token_ids))
        self._stop_ids[slot] = stop_ids if params.min_tokens > 0 else []
        if params.seed is not None and not greedy:
            self.has_seed[slot] = True
            self._seeds[slot] = (params.seed + int(index)) & _SEED_MASK
        else:
            self.has_seed[slot] = False
            self._seeds[slot] = None

    def remove_sequence(self, seq_id: int) -> None:
        """Forget ``seq_id`` (finished or aborted) and free its slot; unknown ids are ignored."""
        seq_id = int(seq_id)
        pos = int(np.searchsorted(self._keys, seq_id))
        if pos >= len(self._keys) or int(self._keys[pos]) != seq_id:
            return
        slot = int(self._key_slots[pos])
        self._keys = np.delete(self._keys, pos)
        self._key_slots = np.delete(self._key_slots, pos)
        self._prompt_ids[slot] = None
        self._output_ids[slot] = None
        self._bias[slot] = None
        self._allowed[slot] = None
        self._matchers[slot] = None
        self.has_grammar[slot] = False
        self._stop_ids[slot] = []
        self._free.append(slot)

    def append_output_tokens(self, seq_ids: np.ndarray, token_ids: np.ndarray) -> None:
        """Record tokens the engine appended (UpdateResult.seq_ids / token_ids, int64/int32 [K]).

        Feeds min_tokens counting and the penalties' output history. Ids not in the sampler
        (e.g. already removed) are skipped.
        """
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if seq_ids.size == 0 or len(self._keys) == 0:
            return
        token_ids = np.asarray(token_ids)
        pos = np.minimum(np.searchsorted(self._keys, seq_ids), len(self._keys) - 1)
        known = self._keys[pos] == seq_ids
        slots = self._key_slots[pos[known]]
        np.add.at(self.num_output_tokens, slots, 1)
        pen = self.has_penalty[slots]
        if pen.any():
            for slot, tok in zip(slots[pen].tolist(), token_ids[known][pen].tolist()):
                self._output_ids[slot].append(tok)
        gram = self.has_grammar[slots]
        if gram.any():
            for slot, tok in zip(slots[gram].tolist(), token_ids[known][gram].tolist()):
                matcher = self._matchers[slot]
                if not matcher.accept_token(int(tok)):
                    # only when another mask left no token the grammar allows (e.g. min_tokens
                    # masking the EOS that the grammar needs): that sequence goes on unconstrained,
                    # its neighbours are not failed
                    logger.error("structured output: the grammar refused token %d; the sequence is no longer "
                                 "constrained", int(tok))
                    self.has_grammar[slot] = False
                    self._matchers[slot] = None
                elif matcher.is_terminated():  # it took its stop token (EOS with ignore_eos, min_tokens)
                    self.has_grammar[slot] = False  # the grammar is complete; what follows is free
                    self._matchers[slot] = None

    # ------------------------------------------------------------------ sampling
    def _uniforms(self, slots: np.ndarray, offsets: Optional[np.ndarray] = None) -> torch.Tensor:
        """One U[0, 1) float64 per row (CPU). Unseeded rows: the engine's stream. Seeded rows: a
        counter-based draw (splitmix64 of the sequence's seed and the output position the row
        samples: num_output_tokens + offsets), so a seeded token depends only on its seed, its
        position and its context — not on the batch, the device, preemption, wasted rows of async
        scheduling, or how many speculative rows were verified (seeded runs are identical with
        speculation on and off)."""
        u = torch.rand(len(slots), generator=self._default_gen, dtype=torch.float64)
        seeded = np.nonzero(self.has_seed[slots])[0]
        if seeded.size:
            s = slots[seeded]
            pos = self.num_output_tokens[s] + (0 if offsets is None else offsets[seeded])
            seeds = np.array([self._seeds[int(x)] for x in s.tolist()], dtype=np.uint64)
            u[torch.from_numpy(seeded)] = torch.from_numpy(_counter_uniform(seeds, pos.astype(np.uint64)))
        return u

    def argmax_suffices(self, seq_ids) -> bool:
        """Whether this step's sample is the argmax of the raw logits for every row (greedy,
        nothing that changes the logits, no logprobs): then a model may pick the ids itself without
        materializing the logits (LlamaForCausalLM.forward(greedy_vocab=...)); wrap them with
        ``from_argmax``."""
        slots = self._slots_for(seq_ids)
        return len(slots) > 0 and not bool((self.num_logprobs[slots] >= 0).any()) and self._plain_greedy(slots)

    @staticmethod
    def from_argmax(token_ids) -> SamplerOutput:
        """The SamplerOutput of ids chosen as argmax_suffices allows (int [R], host or device)."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.cpu().numpy()
        return SamplerOutput(np.asarray(token_ids, dtype=np.int32), None)

    def _plain_greedy(self, slots: np.ndarray) -> bool:
        """Every row greedy with nothing that changes the logits this step."""
        return bool(
            (self.temperature[slots] < _SAMPLING_EPS).all()
            and not self.has_bias[slots].any()
            and not self.has_allowed[slots].any()
            and not self.has_grammar[slots].any()
            and not self.has_penalty[slots].any()
            and not (self.num_output_tokens[slots] < self.min_tokens[slots]).any()
        )

    def _check(self, logits: torch.Tensor, seq_ids) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
        if len(seq_ids) != logits.shape[0]:
            raise ValueError(f"seq_ids has {len(seq_ids)} entries but logits has {logits.shape[0]} rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits has {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")

    def _process(self, logits: torch.Tensor, slots: np.ndarray, want_raw: bool, spec: Optional["_SpecRows"] = None):
        """The logits transforms of one step. Returns (processed logits float32 [R, V] — the
        distribution the draw uses, after temperature/min_p/top_k/top_p for random rows —,
        argmax of the penalised logits for greedy rows or None, greedy row mask, raw logprobs).
        spec: speculative verification rows — row r samples output position num_output_tokens +
        spec.offsets[r], after the drafts spec.before(r) (min_tokens and the penalties count them)."""
        device = logits.device
        # A float32 copy: the transforms work in place and the caller's tensor stays intact.
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True).contiguous()
        raw_logprobs = ops.compute_logprobs(logits) if want_raw else None

        # min_tokens: mask EOS and stop_token_ids while fewer outputs than min_tokens.
        num_out = self.num_output_tokens[slots] + (0 if spec is None else spec.offsets)
        active_min = np.nonzero(num_out < self.min_tokens[slots])[0]
        if active_min.size:
            rows = active_min.tolist()
            ops.mask_tokens(logits, rows, [self._stop_ids[int(slots[r])] for r in rows])
        # structured outputs: only the tokens each row's grammar can continue with
        gram_rows = np.nonzero(self.has_grammar[slots])[0]
        if gram_rows.size:
            self._apply_grammar(logits, gram_rows, slots[gram_rows])
        # logit_bias
        for r in np.nonzero(self.has_bias[slots])[0].tolist():
            ids, vals = self._bias[int(slots[r])]
            logits[r, torch.tensor(ids, device=device)] += torch.tensor(vals, device=device, dtype=logits.dtype)
        # allowed_token_ids: every other logit -inf
        for r in np.nonzero(self.has_allowed[slots])[0].tolist():
            ids = torch.tensor(self._allowed[int(slots[r])], device=device)
            kept = logits[r, ids]
            logits[r].fill_(float("-inf"))
            logits[r, ids] = kept
        # penalties
        pen_rows = np.nonzero(self.has_penalty[slots])[0]
        if pen_rows.size:
            self._apply_penalties(logits, pen_rows, slots[pen_rows], device, spec)

        temps = self.temperature[slots]
        greedy_rows = temps < _SAMPLING_EPS
        greedy_sampled = logits.argmax(dim=-1) if greedy_rows.any() else None
        if not greedy_rows.all():
            t = torch.from_numpy(np.where(greedy_rows, np.float32(1.0), temps)).to(device)
            ops.apply_temperature(logits, t)
            min_p = self.min_p[slots]
            if (min_p > 0).any():
                ops.apply_min_p(logits, torch.from_numpy(min_p).to(device))
            top_k = self.top_k[slots]
            top_p = self.top_p[slots]
            k = p = None
            if (top_k > 0).any():
                k = torch.from_numpy(np.where(top_k > 0, top_k, self.vocab_size)).to(device)
            if (top_p < 1.0).any():
                p = torch.from_numpy(top_p).to(device)
            logits = ops.apply_top_k_top_p(logits, k, p)
        return logits, greedy_sampled, greedy_rows, raw_logprobs

    def start_grammar(self, seq_ids) -> None:
        """Begin filling the token bitmask of the next call's constrained rows (``__call__`` with
        these seq_ids) on a thread, so that it overlaps the step's forward pass; the engine calls
        it before launching the model, once the matchers have every earlier token. Without a call,
        or when the next call's rows differ, the bitmask is filled in the call."""
        self._pending_fill = None
        if not self.has_grammar.any():
            return
        slots = self._slots_for(seq_ids)
        rows = np.nonzero(self.has_grammar[slots])[0]
        if rows.size == 0:
            return
        n_rows = len(slots)
        bitmask = self._grammar_bitmask(n_rows)
        matchers = [self._matchers[s] for s in slots[rows].tolist()]
        if self._fill_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-bitmask")
        future = self._fill_pool.submit(self._batch_matcher.batch_fill_next_token_bitmask, matchers, bitmask,
                                        indices=rows.tolist())
        self._pending_fill = ((n_rows, rows.tobytes(), slots[rows].tobytes()), future)

    def shutdown(self) -> None:
        """Stop start_grammar's thread."""
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=True)
            self._fill_pool = None

    def _grammar_bitmask(self, n_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < n_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(n_rows, 64), self.vocab_size)
        if self._batch_matcher is None:
            # bench/sampler.py --mixes json: 2 cores fill fastest on 1 thread (2: 4x slower at 64 rows);
            # the H200's 16-core host on 4 (2x one thread's speed at 256 rows, 8 threads slower again)
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(1, min(4, (os.cpu_count() or 2) // 4)))
        return self._bitmask[:n_rows]

    def _apply_grammar(self, logits: torch.Tensor, rows: np.ndarray, slots: np.ndarray) -> None:
        """-inf for every token the row's GrammarMatcher does not allow next (xgrammar's token
        bitmask, one bit per token, filled by up to 4 threads on a larger machine; a matcher that
        took its stop token has left the sampler: append_output_tokens). On a GPU this runs while
        the step's forward pass does (nothing before it in the step waits for the device); the
        bitmask and row indices reach the device from pinned memory. CPU: the bits unpacked by
        numpy and one masked_fill (a fifth of xgrammar's CPU kernel's time at 64 x 49152)."""
        import xgrammar as xgr

        n_rows = logits.shape[0]
        pending, self._pending_fill = self._pending_fill, None
        row_list = rows.tolist()
        if pending is not None and pending[0] == (n_rows, rows.tobytes(), slots.tobytes()):
            pending[1].result()  # start_grammar filled these rows during the forward pass
            bitmask = self._bitmask[:n_rows]
        else:
            if pending is not None:
                pending[1].result()  # not these rows: let it finish before the bitmask is refilled
            bitmask = self._grammar_bitmask(n_rows)
            self._batch_matcher.batch_fill_next_token_bitmask([self._matchers[s] for s in slots.tolist()], bitmask,
                                                              indices=row_list)
        if logits.device.type == "cpu":
            bits = np.unpackbits(bitmask.numpy()[rows].view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
            banned = torch.from_numpy(bits) == 0
            if len(row_list) == n_rows:
                logits[:, :self.vocab_size].masked_fill_(banned, float("-inf"))
            else:
                index = torch.from_numpy(rows)
                logits[index] = logits[index].masked_fill_(banned, float("-inf"))
            return
        # pinned copies (the host allocator keeps them until the copy ran): a copy from pageable
        # memory, or xgrammar building the indices from a list, would wait for the forward pass
        device_mask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        indices = None
        if len(row_list) != n_rows:
            indices = torch.from_numpy(rows.astype(np.int32)).pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=self.vocab_size, indices=indices)

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, seq_ids, draft_token_ids=None) -> torch.Tensor:
        """The float32 [R, V] logits the draw of ``__call__`` would use (for tests and debugging):
        after min_tokens masking, logit_bias and penalties, and for non-greedy rows temperature,
        min_p, top_k and top_p (masked tokens are -inf). Consumes no random numbers."""
        self._check(logits, seq_ids)
        return self._process(logits, self._slots_for(seq_ids), False, _SpecRows.of(draft_token_ids))[0]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seq_ids, draft_token_ids=None) -> SamplerOutput:
        """Sample one token for each row of ``logits``.

        logits: [R, V] float32/bf16/fp16 on CPU or CUDA (V == vocab_size, or larger: padded
          vocabulary columns are ignored). seq_ids: int64 [R] (SchedulerOutput.sample_seq_ids);
          a sequence appears once per call, or — speculative decoding — on k + 1 consecutive rows.
        draft_token_ids: int32 [R] (SchedulerOutput.draft_token_ids) or None: row r of a
          speculative run samples the position after the drafts of the run's earlier rows (see
          _SpecRows); each row is sampled from the target's distribution there, and the native
          scheduler accepts drafts while they equal those samples (pagedllm/spec_decode.h).
        Returns SamplerOutput (token ids int32 [R] on the host, logprobs if any row asked).
        """
        return self.sample_async(logits, seq_ids, draft_token_ids=draft_token_ids).result()

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, seq_ids, rows: Optional[np.ndarray] = None,
                     num_rows: Optional[int] = None, draft_token_ids=None) -> PendingSample:
        """As ``__call__``, but returns at once with the ids still on the device (PendingSample);
        its result() is what ``__call__`` returns. ``rows`` / ``num_rows``: these R rows are rows
        ``rows`` of a step of num_rows sampled rows (the others get id 0: rows of sequences that
        finished after the step was scheduled, under async scheduling)."""
        self._check(logits, seq_ids)
        spec = _SpecRows.of(draft_token_ids)
        if logits.shape[0] == 0:
            return PendingSample(torch.zeros(0, dtype=torch.int64, device=logits.device), rows=rows,
                                 num_rows=num_rows)
        slots = self._slots_for(seq_ids)
        device = logits.device
        num_logprobs = self.num_logprobs[slots]
        want_logprobs = bool((num_logprobs >= 0).any())
        if not want_logprobs and self._plain_greedy(slots):
            # argmax of the raw logits: no copy, no transform (exact also for bf16 logits). The
            # native kernel is ~10x torch.argmax on the CPU and on CUDA (one CTA per row there).
            if logits.dtype in _NATIVE_ARGMAX_DTYPES.get(logits.device.type, ()) and logits.stride(-1) == 1:
                sampled = native_ops.argmax_rows(logits, self.vocab_size)
            else:
                sampled = logits[:, : self.vocab_size].argmax(dim=-1)
            return PendingSample(sampled, rows=rows, num_rows=num_rows)
        logits, greedy_sampled, greedy_rows, raw_logprobs = self._process(logits, slots, want_logprobs, spec)
        if greedy_rows.all():
            sampled = greedy_sampled
        else:
            random_sampled = ops.random_sample(logits, self._uniforms(slots, None if spec is None else spec.offsets))
            if greedy_sampled is not None:
                mask = torch.from_numpy(greedy_rows).to(device)
                sampled = torch.where(mask, greedy_sampled, random_sampled)
            else:
                sampled = random_sampled

        if raw_logprobs is None:
            return PendingSample(sampled, rows=rows, num_rows=num_rows)
        k_max = int(num_logprobs.max())
        ids, vals, ranks = ops.gather_logprobs(raw_logprobs, sampled, max(k_max, 0))
        return PendingSample(sampled, (ids, vals, ranks), num_logprobs.copy(), rows=rows, num_rows=num_rows)

    def _apply_penalties(self, logits: torch.Tensor, rows: np.ndarray, slots: np.ndarray, device,
                         spec: Optional["_SpecRows"] = None) -> None:
        """Penalties on the tokens each row has seen (prompt for the repetition penalty, output —
        and, for a speculative row, the drafts before it), with ops.apply_penalties_sparse: the cost
        follows the history length, not the vocabulary."""
        ids_list, counts_list = [], []
        for r, s in zip(rows.tolist(), slots.tolist()):
            out = np.asarray(self._output_ids[s] or [], dtype=np.int64)
            if spec is not None and spec.offsets[r]:
                out = np.concatenate([out, spec.before(r)])
            prompt = self._prompt_ids[s]
            toks, counts = np.unique(out, return_counts=True) if out.size else (out, out)
            if prompt is not None and prompt.size:
                extra = np.setdiff1d(np.unique(prompt), toks, assume_unique=True)
                toks = np.concatenate([toks, extra])
                counts = np.concatenate([counts, np.zeros(len(extra), dtype=counts.dtype)])
            ids_list.append(toks)
            counts_list.append(counts)
        width = max((len(t) for t in ids_list), default=0)
        if width == 0:
            return
        n = len(rows)
        keep = [i for i in range(n) if len(ids_list[i])]
        ids = np.zeros((len(keep), width), dtype=np.int64)
        counts = np.zeros((len(keep), width), dtype=np.int64)
        for j, i in enumerate(keep):
            t, c = ids_list[i], counts_list[i]
            reps = -(-width // len(t))  # pad by repeating the row's own entries (same values written)
            ids[j] = np.tile(t, reps)[:width]
            counts[j] = np.tile(c, reps)[:width]
        sel = slots[keep]
        ops.apply_penalties_sparse(
            logits,
            torch.from_numpy(rows[keep]).to(device),
            torch.from_numpy(ids).to(device),
            torch.from_numpy(counts).to(device),
            torch.from_numpy(self.repetition_penalty[sel]).to(device),
            torch.from_numpy(self.frequency_penalty[sel]).to(device),
            torch.from_numpy(self.presence_penalty[sel]).to(device),
        )


class _SpecRows:
    """The speculative runs among a call's rows (SchedulerOutput.draft_token_ids): a run is k + 1
    consecutive rows of one sequence whose first k carry drafts. offsets int64 [R]: a row's index
    within its run (0 for plain rows); before(r): the drafts of the run's rows before r."""

    def __init__(self, drafts: np.ndarray) -> None:
        self.drafts = drafts
        idx = np.arange(len(drafts))
        starts = np.ones(len(drafts), dtype=bool)
        starts[1:] = drafts[:-1] < 0  # a row after a draft row continues that run
        self.start = np.maximum.accumulate(np.where(starts, idx, 0))
        self.offsets = idx - self.start

    @classmethod
    def of(cls, draft_token_ids) -> Optional["_SpecRows"]:
        if draft_token_ids is None:
            return None
        drafts = np.asarray(draft_token_ids, dtype=np.int64)
        return cls(drafts) if (drafts >= 0).any() else None

    def before(self, r: int) -> np.ndarray:
        return self.drafts[self.start[r]:r]

