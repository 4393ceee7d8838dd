"""``speculative_config``: vLLM's dict (or its JSON text, as ``--speculative-config`` takes it),
checked and turned into the native core's ``_C.SpeculativeConfig``.

Supported keys (vLLM's names):

- ``method``: ``"ngram"`` (prompt lookup; inferred when ``model`` is absent) or ``"draft_model"``
  (inferred when ``model`` is given): a smaller model with the same vocabulary proposes k tokens
  greedily (pagedllm.spec_decode.draft_model). EAGLE/MTP methods are refused with a ValueError.
- ``model``: the draft model (a folder or .gguf file, as LLM(model=...)); ``quantization``: the
  draft's (vLLM's key; default none), ``dtype``: the draft's (pagedllm's key; default the target's).
- ``num_speculative_tokens``: k >= 1 (required), at most 64.
- ``prompt_lookup_min`` / ``prompt_lookup_max``: n-gram lengths; as vLLM, both default to 5 and one
  given alone sets the other.
- ``disable_by_batch_size``: no drafts in a step with at least this many running sequences (vLLM
  v0's ``speculative_disable_by_batch_size``); default: DEFAULT_DISABLE_BY_BATCH_SIZE for the
  device (docs/speculative_decoding.md has the measurement), 0 for never.
- ``rejection_sample_method``: ``"standard"`` (exact verification), or ``"synthetic"`` with
  ``synthetic_acceptance_length`` = k + 1: every step verifies k drafts (the n-gram's, padded with
  the context's last token) and accepts them all whatever the target samples — a debug mode to
  measure verification cost on random weights (its outputs are not the model's).

Anything else is a ValueError naming the key and the supported ones.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

#: running sequences from which a step gets no drafts, per device type (measured:
#: docs/speculative_decoding.md)
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 128, "cuda": 32}

_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size", "rejection_sample_method", "synthetic_acceptance_length", "quantization", "dtype"}


@dataclasses.dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int
    accept_all: bool = False
    #: method "draft_model": the draft's path, quantization and dtype (None: the target's)
    model: Optional[str] = None
    quantization: Optional[str] = None
    dtype: Optional[str] = None

    @classmethod
    def from_user(cls, value: Any, device_type: str = "cpu") -> Optional["SpeculativeConfig"]:
        """None for None / {} / ""; else the checked config (ValueError naming what is wrong)."""
        if value is None or (isinstance(value, (dict, str)) and not value):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown}; supported: {sorted(_KEYS)}")
        method = value.get("method") or ("ngram" if value.get("model") is None else "draft_model")
        if method == "[ngram]":
            method = "ngram"
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method={method!r} is not supported; use 'ngram' or 'draft_model'")
        model = value.get("model")
        if method == "draft_model" and not model:
            raise ValueError("speculative_config: method='draft_model' needs model (the draft's path)")
        if method == "ngram" and model is not None:
            raise ValueError(f"speculative_config: method='ngram' takes no model (got {model!r}); a draft model is "
                             "method='draft_model'")
        if method == "ngram" and ("quantization" in value or "dtype" in value):
            raise ValueError("speculative_config: quantization and dtype are a draft model's (method='draft_model')")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in [1, 64], got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        disable = value.get("disable_by_batch_size")
        if disable is None:
            disable = DEFAULT_DISABLE_BY_BATCH_SIZE.get(device_type, 0)
        if isinstance(disable, bool) or not isinstance(disable, int) or disable < 0:
            raise ValueError(f"speculative_config: disable_by_batch_size must be an int >= 0 (0: never), got "
                             f"{disable!r}")
        how = value.get("rejection_sample_method", "standard")
        accept_all = False
        if how == "synthetic":
            length = value.get("synthetic_acceptance_length")
            if length != k + 1:
                raise ValueError(f"speculative_config: rejection_sample_method='synthetic' is supported with "
                                 f"synthetic_acceptance_length = num_speculative_tokens + 1 = {k + 1} (accept every "
                                 f"draft) only, got {length!r}")
            accept_all = True
        elif how != "standard":
            raise ValueError(f"speculative_config: rejection_sample_method must be 'standard' or 'synthetic', got "
                             f"{how!r}")
        elif "synthetic_acceptance_length" in value:
            raise ValueError("speculative_config: synthetic_acceptance_length needs rejection_sample_method='synthetic'")
        return cls(method, k, lo, hi, disable, accept_all, model=model, quantization=value.get("quantization"),
                   dtype=value.get("dtype"))

    def native(self):
        from pagedllm import _C

        return _C.SpeculativeConfig(num_speculative_tokens=self.num_speculative_tokens,
                                    prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                                    disable_by_batch_size=self.disable_by_batch_size, accept_all=self.accept_all,
                                    external_drafts=self.method == "draft_model")


__all__ = ["DEFAULT_DISABLE_BY_BATCH_SIZE", "SpeculativeConfig"]
