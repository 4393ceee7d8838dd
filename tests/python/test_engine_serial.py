"""The engine process's wire format (engine/serial_utils.py): every RequestOutput field survives
encode -> pickle -> decode, and a stripped output carries no prompt ids."""

import pickle

from pagedllm.engine.serial_utils import decode_output, encode_output, without_prompt_ids
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _outputs():
    lp = {7: Logprob(-0.25, 1, "x"), 9: Logprob(-2.0, 2, None)}
    yield RequestOutput("a", "text", [1, 2, 3], [None, lp], [
        CompletionOutput(0, "hi", [7], -0.25, [lp], None, None),
        CompletionOutput(1, "", [], None, None, "stop", "</s>"),
    ], False, RequestMetrics(1.5, 2.5, 3.5, 4.5, None), 16)
    yield RequestOutput("b", None, [4], None, [CompletionOutput(0, "\ufffd\u00e9", [1, 2], None, None, "length", 2)],
                        True, None, None)
    yield RequestOutput("c", None, [], None, [], True, {"custom": 1}, 0)  # another metrics object


def test_round_trip_keeps_every_field():
    for out in _outputs():
        back = decode_output(pickle.loads(pickle.dumps(encode_output(out))))
        assert back == out
        assert type(back.metrics) is type(out.metrics)


def test_without_prompt_ids_drops_only_them():
    for out in _outputs():
        back = decode_output(without_prompt_ids(encode_output(out)))
        assert back.prompt_token_ids is None
        back.prompt_token_ids = out.prompt_token_ids
        assert back == out
