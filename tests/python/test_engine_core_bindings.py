"""pagedllm._C.EngineCore through the bindings: zero-copy views, error messages, and a hypothesis
state machine over random interleavings of add / abort / finish_sequence / schedule / update /
release (including two steps in flight and steps released without update), checking after every
operation that no KV block is leaked or held by a sequence the engine no longer runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm import _C


def make_core(**kw):
    cfg = dict(num_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
    cfg.update(kw)
    return _C.EngineCore(_C.EngineConfig(**cfg))


def test_views_are_zero_copy_and_valid_until_release():
    core = make_core()
    core.add_request("a", np.arange(10, 30, dtype=np.int32), _C.RequestParams(max_tokens=2))
    out = core.schedule()
    ids = out.input_ids
    assert ids.dtype == np.int32 and ids.shape == (20,) and not ids.flags.owndata
    assert ids.base is not None
    assert np.array_equal(ids, np.arange(10, 30))
    assert out.positions.dtype == np.int64 and out.slot_mapping.dtype == np.int64
    assert out.block_tables.shape == (1, core.max_blocks_per_seq) and out.block_tables.dtype == np.int32
    assert out.query_start_loc.tolist() == [0, 20] and out.seq_lens.tolist() == [20]
    assert out.logits_indices.tolist() == [19] and out.copy_orders.shape == (0, 2)
    assert out.new_seqs == [(0, "a", 0)]
    # the same native memory: a second view sees the same address
    assert out.input_ids.__array_interface__["data"][0] == ids.__array_interface__["data"][0]
    result = core.update_from_output(out, np.array([5], dtype=np.int64))  # int64 is converted
    assert result.seq_ids.tolist() == [0] and result.token_ids.tolist() == [5]
    core.release(out)
    assert core.num_outputs_held == 0


def test_errors_are_value_errors_naming_the_values():
    core = make_core()
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len \(256\)"):
        core.add_request("long", list(range(300)), _C.RequestParams())
    with pytest.raises(ValueError, match=r"prompt_len \(200\) \+ max_tokens \(100\) = 300 exceeds max_model_len \(256\)"):
        core.add_request("sum", list(range(200)), _C.RequestParams(max_tokens=100))
    with pytest.raises(ValueError, match=r"-4"):
        core.add_request("neg", [1, -4], _C.RequestParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"dtype kind 'f'"):
        core.add_request("float", np.array([1.5]), _C.RequestParams(max_tokens=1))
    with pytest.raises(TypeError, match="max_tokenz"):
        _C.RequestParams(max_tokenz=3)
    with pytest.raises(ValueError, match="lifo"):
        make_core(scheduling_policy="lifo")
    core.add_request("ok", [1, 2, 3], _C.RequestParams(max_tokens=1))
    out = core.schedule()
    with pytest.raises(ValueError, match=r"has 2 entries but step 0 sampled 1 rows"):
        core.update_from_output(out, np.array([1, 2], dtype=np.int32))
    core.update_from_output(out, np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="already updated"):
        core.update_from_output(out, np.array([1], dtype=np.int32))
    core.release(out)
    with pytest.raises(ValueError, match="no live sequence with seq_id 12345"):
        core.finish_sequence(12345, None)
    st_ = core.stats().as_dict()
    assert st_["num_finished_requests"] == 1 and st_["num_free_blocks"] == 64


class EngineMachine(RuleBasedStateMachine):
    """Random operations; the engine must stay consistent and leak nothing."""

    def __init__(self):
        super().__init__()
        self.core = make_core(num_blocks=12, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=96)
        self.held = []  # outputs scheduled, not released: [out, updated]
        self.next_id = 0
        self.live_seqs: set[int] = set()

    @rule(plen=st.integers(1, 60), max_tokens=st.integers(0, 30), n=st.integers(1, 3),
          logprobs=st.booleans(), prefix=st.booleans())
    def add(self, plen, max_tokens, n, logprobs, prefix):
        prompt = ([7] * 40 + list(range(plen)))[:plen] if prefix else list(range(100, 100 + plen))
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.core.add_request(rid, prompt, _C.RequestParams(max_tokens=max_tokens, n=n, prompt_logprobs=logprobs))

    @precondition(lambda self: self.next_id > 0)
    @rule(k=st.integers(0, 1000))
    def abort(self, k):
        self.core.abort_request(f"r{k % self.next_id}")

    @precondition(lambda self: len(self.held) < 2)
    @rule()
    def schedule(self):
        out = self.core.schedule()
        assert out.num_tokens <= 24 and out.num_seqs <= 6
        for seq_id, _, _ in out.new_seqs:
            self.live_seqs.add(seq_id)
        self.held.append([out, False])

    @precondition(lambda self: any(not u for _, u in self.held))
    @rule(data=st.data())
    def update(self, data):
        entry = next(e for e in self.held if not e[1])
        out = entry[0]
        tokens = np.array(data.draw(st.lists(st.integers(0, 50), min_size=out.num_sampled,
                                             max_size=out.num_sampled)), dtype=np.int32)
        result = self.core.update_from_output(out, tokens)
        for _, seq_id, _, reason, _ in result.finished:
            assert reason in ("stop", "length", "abort")
            self.live_seqs.discard(seq_id)
        entry[1] = True

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 1))
    def release(self, which):
        out, _ = self.held.pop(which % len(self.held))
        self.core.release(out)  # un-updated: cancelled, its sequences recompute later

    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data())
    def finish_sequence(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live_seqs)))
        self.live_seqs.discard(seq_id)
        try:
            self.core.finish_sequence(seq_id, "stop-string")
        except ValueError as e:  # it finished or was aborted meanwhile
            assert "no live sequence" in str(e)

    @invariant()
    def consistent(self):
        s = self.core.stats()
        assert s.num_running <= 6
        assert s.num_free_blocks + round(s.kv_usage * s.num_blocks) == s.num_blocks
        if not self.held:
            assert self.core.num_kv_seqs() == s.num_running  # waiting sequences hold no blocks
        if not self.core.has_unfinished_requests():
            assert s.num_running == 0 and s.num_waiting == 0 and self.core.num_kv_seqs() == 0

    def teardown(self):
        for out, _ in self.held:
            self.core.release(out)
        for k in range(self.next_id):
            self.core.abort_request(f"r{k}")
        s = self.core.stats()
        assert s.num_free_blocks == s.num_blocks and s.kv_usage == 0.0 and self.core.num_kv_seqs() == 0
        assert not self.core.has_unfinished_requests()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
