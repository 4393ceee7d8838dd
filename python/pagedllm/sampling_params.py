"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults).

A vLLM user's ``SamplingParams(...)`` call works unchanged. Differences from vLLM, on purpose:
``max_tokens=0`` is accepted (score the prompt only, e.g. for ``prompt_logprobs``; the engine
finishes the request with ``"length"`` without sampling), and temperatures below 1e-2 are not
raised to 1e-2 (the sampler works in float32 and stays finite down to the greedy threshold
``_SAMPLING_EPS``; below it a request is greedy).

Errors: every invalid value raises ``ValueError`` whose message starts with the field's name.
"""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

#: Temperatures below this are greedy (argmax), as in vLLM.
_SAMPLING_EPS = 1e-5
#: repetition_penalty's range: float32 logits (|logit| < ~1e4) divided or multiplied by it stay finite.
_REPETITION_PENALTY_MIN, _REPETITION_PENALTY_MAX = 1e-30, 1e30

#: torch.Generator.manual_seed accepts seeds in this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
#: (min, max) of repetition_penalty and of seed, for documents that state the ranges (the OpenAPI schema)
REPETITION_PENALTY_BOUNDS = (_REPETITION_PENALTY_MIN, _REPETITION_PENALTY_MAX)
SEED_BOUNDS = (_SEED_MIN, _SEED_MAX)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``vllm.sampling_params.StructuredOutputsParams``); exactly
    one of: ``json`` (a JSON schema, dict or str), ``json_object=True`` (any JSON object), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (EBNF, xgrammar's dialect of
    GBNF). ``disable_any_whitespace`` (vLLM's name): JSON without free whitespace between tokens
    (small models otherwise tend to emit whitespace until max_tokens). Compiled by
    pagedllm.structured_output (xgrammar) when the request is added."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice and grammar, "
                             f"got {given or 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}.")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r:.80}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}.")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}.")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r}.")

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached by (JSON kinds: "json-compact" and
        "json_object-compact" with disable_any_whitespace)."""
        compact = "-compact" if self.disable_any_whitespace else ""
        if self.json is not None:
            # the schema's own key order: it is the order the properties are generated in
            return "json" + compact, self.json if isinstance(self.json, str) else _json.dumps(self.json)
        if self.json_object:
            return "json_object" + compact, ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(list(self.choice))
        return "grammar", self.grammar


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (used by streaming front ends).

    CUMULATIVE: all text/tokens so far; DELTA: only what is new since the last output;
    FINAL_ONLY: a single output when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's ``SamplingParams``).

    Fields (defaults as vLLM):
      n: number of output sequences (completions) for the prompt, >= 1. n > 1 forks the
        prompt's KV blocks copy-on-write; each child samples independently.
      presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token
        that appears in the output so far (presence: once; frequency: times its count).
      repetition_penalty: > 0 (in [1e-30, 1e30]); logits of tokens in the prompt or the output are divided by it
        when positive and multiplied by it when negative (CTRL, Keskar et al. 2019, sec. 4.1).
      temperature: >= 0; 0 (below 1e-5) = greedy.
      top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability sum
        reaches top_p (nucleus sampling, Holtzman et al. 2020, sec. 3.1).
      top_k: -1 or 0 = off; otherwise >= 1; larger than the vocabulary = no limit.
      min_p: in [0, 1]; drop tokens whose probability is below min_p * the top probability.
      seed: per-request seed (same result whatever else is in the batch); None = engine's stream.
      stop: stop strings (str or list of str, non-empty); the text is cut before the match
        (after it with include_stop_str_in_output) and stop_reason is the matched string.
      stop_token_ids: token ids that end the sequence (stop_reason = the id).
      ignore_eos: keep generating after EOS (EOS is still masked before min_tokens).
      max_tokens: most output tokens per sequence (default 16); None = up to max_model_len;
        0 = compute the prompt only (for prompt_logprobs).
      min_tokens: before this many output tokens, EOS and stop_token_ids are masked out and
        stop strings do not end the sequence; <= max_tokens.
      logprobs: number of top log-probabilities returned per output token (plus the sampled
        token's); None = none, -1 = the whole vocabulary.
      prompt_logprobs: the same for each prompt token (first entry is None).
      skip_special_tokens, spaces_between_special_tokens: detokenization options.
      include_stop_str_in_output: keep the matched stop string (or stop token's text) in text.
      logit_bias: {token_id: bias} added to the logits before sampling.
      allowed_token_ids: only these token ids can be sampled (every other logit is -inf before
        sampling; the returned logprobs stay those of the raw distribution, as vLLM's); non-empty.
      truncate_prompt_tokens: keep only the prompt's last k tokens (left truncation, vLLM's); -1:
        the last max_model_len - 1; None: the whole prompt.
      output_kind: RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY).
      use_beam_search: beam search with n beams (vLLM v0's field; LLM.beam_search and the server's
        use_beam_search build it): the n completions are the n best hypotheses, best first, greedy
        over the model's logprobs (temperature 0). Not with stop strings, stop_token_ids,
        min_tokens, penalties, logit_bias, allowed_token_ids, logprobs, prompt_logprobs or
        structured_outputs; max_tokens >= 1.
      length_penalty: beam search: a hypothesis scores cum_logprob / num_generated ** length_penalty
        (Hugging Face's; > 0 favours longer outputs).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: output constrained to a JSON schema, a regex, a choice or a grammar (StructuredOutputsParams)
    structured_outputs: Optional[StructuredOutputsParams] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Normalise the forms vLLM accepts.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.seed == -1:
            self.seed = None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token_id: bias}}, got {type(self.logit_bias).__name__}.")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"logit_bias must map int token ids to float biases: {exc}.") from None
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.") from None
        self._verify_args()
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect (as vLLM).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    # ------------------------------------------------------------------ validation
    def _verify_args(self) -> None:
        def need_number(name: str) -> None:
            value = getattr(self, name)
            if not _is_number(value) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}.")

        def need_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}.")

        need_int("n")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            need_number(name)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not _REPETITION_PENALTY_MIN <= self.repetition_penalty <= _REPETITION_PENALTY_MAX:
            # the sampler divides / multiplies float32 logits by it: outside this range they become
            # 0 or inf (1e-60 is 0 in float32), and the step's sampling would fail for every request
            raise ValueError(f"repetition_penalty must be greater than zero, in [{_REPETITION_PENALTY_MIN:g}, "
                             f"{_REPETITION_PENALTY_MAX:g}] (penalised float32 logits stay finite), got "
                             f"{self.repetition_penalty}.")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        need_int("top_k")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        need_int("seed", allow_none=True)
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}.")
        need_int("max_tokens", allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0 (0 = score the prompt only), got {self.max_tokens}.")
        need_int("min_tokens")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            need_int(name, allow_none=True)
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be non-negative (or -1 for the whole vocabulary), got {value}.")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got an item {s!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}.")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    raise ValueError(f"logit_bias token id must be non-negative, got {token_id}.")
                if math.isnan(bias):
                    raise ValueError(f"logit_bias for token {token_id} is NaN.")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative ints, got {ids!r:.80}.")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        need_int("truncate_prompt_tokens", allow_none=True)
        if self.truncate_prompt_tokens is not None:
            _check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a bool, got {self.use_beam_search!r}.")
        need_number("length_penalty")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}.")
        if self.use_beam_search:
            self._verify_beam_search()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}.")

    def _verify_beam_search(self) -> None:
        if self.temperature >= _SAMPLING_EPS:
            raise ValueError(f"temperature must be 0 with use_beam_search (beam search is greedy over the "
                             f"logprobs), got {self.temperature}.")
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 with use_beam_search, got {self.max_tokens}.")
        unsupported = {
            "stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids), "min_tokens": self.min_tokens != 0,
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None, "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
        }
        bad = [name for name, set_ in unsupported.items() if set_]
        if bad:
            raise ValueError(f"use_beam_search does not support {', '.join(bad)} (leave them at their defaults).")

    def verify_for_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary (ValueError naming the field).

        Called when a request is added (the vocabulary size is not known at construction).
        """
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}.")
        if self.use_beam_search and 2 * self.n > vocab_size:
            raise ValueError(f"n={self.n} beams need the top {2 * self.n} tokens of each step: more than the "
                             f"vocabulary size {vocab_size} (use_beam_search needs 2 * n <= vocab_size).")
        limit = vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}={value} is larger than the vocabulary size {vocab_size}.")

    # ------------------------------------------------------------------ derived properties
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids as a set (the engine adds the model's EOS ids where it needs them)."""
        return set(self.stop_token_ids)

    def clone(self) -> "SamplingParams":
        """A copy (lists and dicts copied too)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs["stop"] = list(self.stop)
        kwargs["stop_token_ids"] = list(self.stop_token_ids)
        kwargs["logit_bias"] = dict(self.logit_bias) if self.logit_bias is not None else None
        kwargs["allowed_token_ids"] = list(self.allowed_token_ids) if self.allowed_token_ids is not None else None
        return SamplingParams(**kwargs)

    def to_request_params(
        self,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str = "",
    ):
        """The native engine's view of these params: a ``pagedllm._C.RequestParams``.

        eos_token_ids: the model's EOS ids (tokenizer / generation_config); the engine stops on
          them unless ignore_eos, and never before min_tokens.
        priority: lower = more urgent (vLLM). arrival_time: seconds (time.time()), default now.
        max_tokens None -> -1 (until max_model_len). prompt_logprobs -> a bool (the engine only
        needs to know that the prompt's logits must be computed, not served from the cache).
        """
        import time

        from pagedllm import _C

        if not hasattr(_C, "RequestParams"):
            raise RuntimeError("pagedllm._C has no RequestParams: the native engine is not built into this _C")
        p = _C.RequestParams()
        p.max_tokens = -1 if self.max_tokens is None else int(self.max_tokens)
        p.min_tokens = int(self.min_tokens)
        p.eos_token_ids = [int(t) for t in eos_token_ids]
        p.stop_token_ids = [int(t) for t in self.stop_token_ids]
        p.ignore_eos = bool(self.ignore_eos)
        p.n = int(self.n)
        p.priority = int(priority)
        p.arrival_time = float(time.time() if arrival_time is None else arrival_time)
        p.cache_salt = str(cache_salt)
        p.prompt_logprobs = self.prompt_logprobs is not None
        p.use_beam_search = bool(self.use_beam_search)
        p.length_penalty = float(self.length_penalty)
        return p

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"SamplingParams({parts})"


def _check_truncate_prompt_tokens(keep: int) -> None:
    if not (keep >= 1 or keep == -1):
        raise ValueError(f"truncate_prompt_tokens must be >= 1 (keep the prompt's last k tokens) or -1 (the last "
                         f"max_model_len - 1), got {keep}.")


def truncate_prompt_ids(token_ids: list[int], keep: Optional[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` token ids (-1: the last
    max_model_len - 1; None: all of them, the same list). ValueError naming the field for keep 0
    or below -1."""
    if keep is None:
        return token_ids
    _check_truncate_prompt_tokens(keep)
    keep = max_model_len - 1 if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


@dataclass
class BeamSearchParams:
    """Parameters of ``LLM.beam_search`` (vLLM's ``BeamSearchParams``).

    beam_width: beams kept per step and hypotheses returned, in [1, max_num_seqs] (the engine
      checks the upper bound). max_tokens: most tokens generated per hypothesis, >= 1.
    ignore_eos: EOS does not end a hypothesis. temperature: 0 only (beam search is greedy over the
      model's logprobs; > 0 is a ValueError). length_penalty: score = cum_logprob /
      num_generated ** length_penalty (Hugging Face's). include_stop_str_in_output: keep the EOS
      token's text in BeamSearchSequence.text. skip_special_tokens: as in SamplingParams.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}.")
        self.to_sampling_params()  # every other check

    def to_sampling_params(self) -> SamplingParams:
        """The equivalent SamplingParams (n = beam_width, use_beam_search, FINAL_ONLY)."""
        return SamplingParams(n=self.beam_width, use_beam_search=True, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=self.temperature,
                              length_penalty=self.length_penalty, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              output_kind=RequestOutputKind.FINAL_ONLY)


__all__ = ["SamplingParams", "BeamSearchParams", "RequestOutputKind", "SamplingType", "_SAMPLING_EPS",
           "truncate_prompt_ids"]
