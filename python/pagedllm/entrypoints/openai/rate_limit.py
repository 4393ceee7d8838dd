"""Rate limits per API key (per client address without keys): requests and tokens per minute,
each a token bucket (capacity = the per-minute limit, refilled continuously at limit / 60 per
second). A request takes 1 from the request bucket and its prompt tokens + max_tokens (the tokens
it may use) from the token bucket when it is admitted; a request that does not fit is a 429 with
Retry-After (whole seconds until it would fit) and an OpenAI error object, counted in
``pagedllm:rate_limited_requests`` (label ``limit``: requests / tokens). A request larger than the
whole token bucket can never fit: a 429 saying so, without Retry-After.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Optional

from pagedllm.entrypoints.openai.errors import OpenAIError


class TokenBucket:
    """capacity units, refilled at per_minute / 60 per second (time.monotonic)."""

    def __init__(self, per_minute: float):
        self.capacity = float(per_minute)
        self.rate = float(per_minute) / 60.0
        self.level = float(per_minute)
        self.stamp = time.monotonic()

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until n units are available (0: now); refills first."""
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return 0.0 if self.level >= n else (n - self.level) / self.rate


class RateLimiter:
    """Per-key request and token buckets (None: that limit is off)."""

    def __init__(self, requests_per_minute: Optional[int] = None, tokens_per_minute: Optional[int] = None):
        for name, value in (("rate_limit_rpm", requests_per_minute), ("rate_limit_tpm", tokens_per_minute)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        self.rpm, self.tpm = requests_per_minute, tokens_per_minute
        self._buckets: dict[str, tuple[Optional[TokenBucket], Optional[TokenBucket]]] = {}
        self._lock = threading.Lock()
        self.refused = {"requests": 0, "tokens": 0}

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def admit(self, key: str, tokens: int) -> None:
        """Take 1 request and `tokens` tokens from `key`'s buckets, or raise a 429 OpenAIError."""
        if not self.enabled:
            return
        with self._lock:
            req, tok = self._buckets.setdefault(
                key, (TokenBucket(self.rpm) if self.rpm else None, TokenBucket(self.tpm) if self.tpm else None))
            if tok is not None and tokens > tok.capacity:
                self.refused["tokens"] += 1
                raise OpenAIError(f"this request may use {tokens} tokens (prompt + max_tokens), more than the "
                                  f"rate limit of {self.tpm} tokens per minute (--rate-limit-tpm)", 429, None)
            now = time.monotonic()
            wait_req = req.wait_for(1, now) if req is not None else 0.0
            wait_tok = tok.wait_for(tokens, now) if tok is not None else 0.0
            if wait_req > 0 or wait_tok > 0:
                which = "requests" if wait_req >= wait_tok else "tokens"
                self.refused[which] += 1
                limit = (f"{self.rpm} requests per minute (--rate-limit-rpm)" if which == "requests"
                         else f"{self.tpm} tokens per minute (--rate-limit-tpm)")
                retry = max(1, math.ceil(max(wait_req, wait_tok)))
                raise OpenAIError(f"rate limit reached: {limit}; retry in {retry} s", 429, None,
                                  {"Retry-After": str(retry)})
            if req is not None:
                req.level -= 1
            if tok is not None:
                tok.level -= tokens


__all__ = ["RateLimiter", "TokenBucket"]
