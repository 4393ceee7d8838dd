"""ClientMux (engine/core_proc.py), the engine process's side of several front ends' pipes:
request ids are namespaced per front end and outputs routed back to their owner; abort_all and a
leaving front end touch only its own requests; metrics go with a front end's events or when it
asks, never to an idle front end (which may not be reading its pipe yet)."""

import multiprocessing

from pagedllm.engine.core_proc import ClientMux
from pagedllm.engine.serial_utils import decode_output
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

METRICS = ["a metrics snapshot"]


def _pipes(n):
    pairs = [multiprocessing.Pipe(duplex=True) for _ in range(n)]
    return [front for front, _ in pairs], ClientMux([engine for _, engine in pairs])


def _out(rid, finished=False):
    return RequestOutput(rid, None, [1, 2], None, [CompletionOutput(0, "x", [5], finish_reason="length" if finished
                                                                    else None)], finished)


def _drain(conn):
    msgs = []
    try:
        while conn.poll(0.2):
            msgs.append(conn.recv())
    except EOFError:  # the engine closed that pipe
        pass
    return msgs


def test_two_front_ends_same_request_id_stay_apart():
    fronts, mux = _pipes(2)
    params = SamplingParams(max_tokens=4)
    for front in fronts:
        front.send(("add", "7", None, [1, 2], params, 0, "", 0.0))
    cmds = [mux.recv(True), mux.recv(True)]
    assert sorted(c[1] for c in cmds) == ["0|7", "1|7"]
    mux.emit(("events", [("0|7", None), ("1|7", ValueError("too long"))], [_out("0|7")], [], None, METRICS))
    (msg0,) = _drain(fronts[0])
    (msg1,) = _drain(fronts[1])
    assert msg0[1] == [("7", None)] and [decode_output(t).request_id for t in msg0[2]] == ["7"]
    assert msg1[1][0][0] == "7" and isinstance(msg1[1][0][1], ValueError) and msg1[2] == []
    assert msg0[5] == METRICS and msg1[5] == METRICS  # both had events of their own


def test_abort_all_and_leaving_touch_only_own_requests():
    fronts, mux = _pipes(2)
    params = SamplingParams(max_tokens=4)
    for i, front in enumerate(fronts):
        front.send(("add", f"r{i}", None, [1], params, 0, "", 0.0))
    mux.recv(True), mux.recv(True)
    fronts[0].send(("abort_all",))
    assert mux.recv(True) == ("abort", ["0|r0"])
    fronts[1].send(("stop",))
    assert mux.recv(True) == ("abort", ["1|r1"])
    assert _drain(fronts[1]) == [("stopped", None)]
    fronts[0].close()  # the last front end gone: the loop is told to stop
    assert mux.recv(True) == ("abort", ["0|r0"])
    assert mux.recv(True) == ("stop",)


def test_metrics_reach_an_idle_front_end_only_when_it_asks():
    fronts, mux = _pipes(2)
    fronts[0].send(("add", "a", None, [1], SamplingParams(max_tokens=4), 0, "", 0.0))
    mux.recv(True)
    mux.emit(("events", [], [_out("0|a")], [], None, METRICS))
    assert len(_drain(fronts[0])) == 1
    assert _drain(fronts[1]) == []  # idle: nothing, not even metrics
    fronts[1].send(("metrics",))
    assert mux.recv(True) == ("metrics",)
    mux.emit(("events", [], [_out("0|a", finished=True)], [], None, METRICS))
    (msg,) = _drain(fronts[1])
    assert msg == ("events", [], [], [], None, METRICS)
    mux.emit(("events", [], [], [], None, METRICS))  # asked once: answered once
    assert _drain(fronts[1]) == []
