"""RequestOutputs as plain tuples for the engine process's pipe (vLLM's serial_utils: it encodes
its EngineCoreOutputs with msgspec for the same reason).

Pickling dataclass instances goes through copyreg for every object (about 2-8 us per output
with its CompletionOutput and RequestMetrics); tuples of str / int / list pickle in C, about ten
times faster each way, and at 256 streams the engine sends ~15k outputs a second. The tuples
follow the dataclasses' field order (read from ``dataclasses.fields``, so a new field travels
without changes here). Logprob dicts (rare) stay objects inside the tuples.

    encode_output(out) -> tuple      decode_output(t) -> RequestOutput (equal to out)
    without_prompt_ids(t) -> tuple   the same output with prompt_token_ids None (sent once)
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter

from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

_COMPLETION = attrgetter(*[f.name for f in dataclasses.fields(CompletionOutput)])
_METRICS = attrgetter(*[f.name for f in dataclasses.fields(RequestMetrics)])
_REQUEST = [f.name for f in dataclasses.fields(RequestOutput)]
_OUTPUTS = _REQUEST.index("outputs")
_METRICS_AT = _REQUEST.index("metrics")
_PROMPT_IDS = _REQUEST.index("prompt_token_ids")
_GET_REQUEST = attrgetter(*_REQUEST)


def encode_output(out: RequestOutput) -> tuple:
    fields = list(_GET_REQUEST(out))
    fields[_OUTPUTS] = [_COMPLETION(c) for c in out.outputs]
    m = fields[_METRICS_AT]
    if isinstance(m, RequestMetrics):
        fields[_METRICS_AT] = ("m", _METRICS(m))
    elif m is not None:  # another metrics object: pickled as it is
        fields[_METRICS_AT] = ("o", m)
    return tuple(fields)


def decode_output(t: tuple) -> RequestOutput:
    fields = list(t)
    fields[_OUTPUTS] = [CompletionOutput(*c) for c in t[_OUTPUTS]]
    m = t[_METRICS_AT]
    if m is not None:
        fields[_METRICS_AT] = RequestMetrics(*m[1]) if m[0] == "m" else m[1]
    return RequestOutput(*fields)


def without_prompt_ids(t: tuple) -> tuple:
    return t[:_PROMPT_IDS] + (None,) + t[_PROMPT_IDS + 1:]
