"""pagedllm._C KV-cache bindings: behaviour, ValueError messages, and a hypothesis state machine
that checks issue 2's invariants (ref counts = holders, free xor referenced, copy orders from a
shared block to one the writer alone owns, every sequence reads back its own tokens, pool whole
at the end) after every step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from pagedllm import _C


# --------------------------------------------------------------------------- behaviour
def test_allocate_slots_block_ids_and_slots():
    kv = _C.KVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    assert (kv.block_size, kv.num_blocks, kv.num_free_blocks) == (16, 8, 8)
    assert not kv.prefix_caching_enabled
    assert kv.num_blocks_needed(1, 40) == 3
    assert kv.allocate_slots(1, 40) == []
    ids = kv.block_ids(1)
    assert ids.dtype == np.int32 and ids.shape == (3,)
    slots = kv.slots(1, 0, 40)
    assert slots.dtype == np.int64
    expected = np.array([ids[p // 16] * 16 + p % 16 for p in range(40)])
    np.testing.assert_array_equal(slots, expected)
    assert kv.slot(1, 39) == expected[39]
    assert 1 in kv and kv.contains(1) and kv.num_tokens(1) == 40
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_free_blocks) == (8, 5)
    assert stats.usage == pytest.approx(3 / 8)
    kv.free(1)
    assert kv.stats().usage == 0.0 and kv.num_free_blocks == 8


def test_out_of_blocks_returns_none_and_changes_nothing():
    kv = _C.KVCacheManager(4, 8, True)
    assert kv.allocate_slots(1, 20) == []
    assert kv.allocate_slots(2, 9) is None
    assert 2 not in kv
    assert kv.allocate_slots(1, 13) is None
    assert kv.num_tokens(1) == 20 and kv.num_free_blocks == 1
    kv.free(1)


def test_fork_copy_on_write_returns_copy_orders():
    kv = _C.KVCacheManager(8, 8, True)
    kv.allocate_slots(1, 12)
    kv.fork(1, 2)
    shared = kv.block_ids(1)
    assert [kv.ref_count(int(b)) for b in shared] == [2, 2]
    copies = kv.allocate_slots(2, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared[1] and dst == kv.block_ids(2)[1] and dst != src
    assert kv.block_ids(2)[0] == shared[0]
    assert kv.ref_count(src) == 1 and kv.ref_count(dst) == 1
    assert kv.allocate_slots(1, 1) == []  # the parent owns its block alone again
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8


def test_prefix_hit_numpy_tokens_and_stats():
    kv = _C.KVCacheManager(16, 8, True)
    prompt = np.arange(1, 33, dtype=np.int32)  # 4 full blocks
    assert kv.find_cached_prefix(prompt).num_tokens == 0
    kv.allocate_slots(1, len(prompt))
    kv.cache_full_blocks(1, prompt, len(prompt))
    first = kv.block_ids(1).tolist()
    kv.free(1)
    hit = kv.find_cached_prefix(prompt.tolist())  # a plain list works too
    assert hit.num_tokens == 24 and hit.blocks == first[:3]  # the last token is left to compute
    assert kv.find_cached_prefix(prompt, extra_key=7).num_tokens == 0
    stats = kv.stats()
    assert stats.prefix_cache_queries == 3 * 32 and stats.prefix_cache_hits == 24
    assert stats.num_cached_blocks == 4
    assert kv.num_blocks_needed(2, 8, hit) == 4
    assert kv.allocate_slots(2, 8, hit) == []
    assert kv.block_ids(2).tolist()[:3] == first[:3]
    kv.free(2)
    kv.reset_prefix_cache()
    assert kv.stats().num_cached_blocks == 0
    assert kv.find_cached_prefix(prompt).num_tokens == 0


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: _C.KVCacheManager(8, 12, True), "got 12"),
        (lambda: _C.KVCacheManager(8, 256, True), "got 256"),
        (lambda: _C.KVCacheManager(0, 16, True), "got 0"),
        (lambda: _C.BlockPool(-3), "got -3"),
        (lambda: _C.BlockTable(7), "got 7"),
        (lambda: _C.PrefixCache(4, 48), "got 48"),
    ],
)
def test_construction_errors_name_the_value(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_usage_errors_are_value_errors_and_leave_the_pool_whole():
    kv = _C.KVCacheManager(8, 8, True)
    kv.allocate_slots(1, 10)
    with pytest.raises(ValueError, match="unknown sequence id 5"):
        kv.free(5)
    with pytest.raises(ValueError, match="position 10"):
        kv.slot(1, 10)
    with pytest.raises(ValueError, match="-2"):
        kv.allocate_slots(1, -2)
    with pytest.raises(ValueError, match="child sequence id 1"):
        kv.fork(1, 1)
    with pytest.raises(ValueError, match="unknown sequence id 9"):
        kv.fork(9, 10)
    with pytest.raises(ValueError, match="no longer cached"):
        kv.allocate_slots(3, 1, _C.PrefixHit([0], 8))
    with pytest.raises(ValueError, match="already exists"):
        kv.allocate_slots(1, 1, _C.PrefixHit([0], 8))
    with pytest.raises(ValueError, match="1-D"):
        kv.find_cached_prefix(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="block id 99"):
        kv.ref_count(99)
    assert kv.num_free_blocks == 6 and kv.num_seqs == 1
    kv.free(1)
    with pytest.raises(ValueError, match="double free"):
        kv.free(1)
    assert kv.num_free_blocks == 8


def test_block_pool_and_block_table_bindings():
    pool = _C.BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.allocate() == _C.NO_BLOCK == -1
    pool.set_reusable(1, True)  # holds cached content: freed to the LRU tail, not the head
    for b in (3, 2, 1, 0):
        pool.release(b)
    assert pool.free_queue() == [0, 2, 3, 1] and pool.is_reusable(1)
    with pytest.raises(ValueError, match="block 2 is already free"):
        pool.release(2)
    table = _C.BlockTable(8)
    assert table.append_slots(pool, 12) == []
    child = table.fork(pool)
    copies = child.append_slots(pool, 1)
    assert copies == [(table.block_ids()[1], child.block_ids()[1])]
    assert table.append_slots(pool, 100) is None  # needs 13 blocks, 1 free
    child.free(pool)
    table.free(pool)
    assert pool.num_free_blocks == 4


def test_prefix_cache_binding_collision_only_misses():
    cache = _C.PrefixCache(8, 8)
    a, b = list(range(8)), list(range(100, 108))
    link = cache.insert(0, _C.ChainLink.root(), 42, a)
    assert link.block == 0
    assert cache.lookup(_C.ChainLink.root(), 42, b) == _C.NO_BLOCK  # same hash, other tokens
    assert cache.insert(1, _C.ChainLink.root(), 42, b) == _C.ChainLink.dead(42)
    h = _C.PrefixCache.hash_block(_C.ChainLink.root().hash, a)
    assert h == _C.PrefixCache.hash_block(_C.ChainLink.root().hash, np.array(a, dtype=np.int32))
    assert h != _C.PrefixCache.hash_block(_C.ChainLink.root().hash, a, extra_key=1)


# --------------------------------------------------------------------------- state machine
BLOCK_SIZE = 8
NUM_BLOCKS = 24
TEMPLATES = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [5] * 20, [9, 8] * 13]


def _value(token: int, extra: int) -> int:
    return token * 4 + extra


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/free/cache/lookup against a simulated KV store."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.kv = _C.KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, True)
        self.store = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, dtype=np.int64)  # slot -> value written
        self.model: dict[int, dict] = {}  # seq -> {"tokens": [...], "extra": int, "computed": int}
        self.next_id = 0

    # -- helpers
    def _write(self, seq: int, start: int, end: int) -> None:
        m = self.model[seq]
        if end <= start:
            return
        slots = self.kv.slots(seq, start, end - start)
        for pos, slot in zip(range(start, end), slots):
            assert self.kv.ref_count(int(slot) // BLOCK_SIZE) == 1, "write into a shared block"
            self.store[slot] = _value(m["tokens"][pos], m["extra"])

    def _apply_copies(self, seq: int, copies) -> None:
        ids = set(self.kv.block_ids(seq).tolist())
        for src, dst in copies:
            assert self.kv.ref_count(src) >= 1 and src not in ids
            assert self.kv.ref_count(dst) == 1 and dst in ids
            self.store[dst * BLOCK_SIZE:(dst + 1) * BLOCK_SIZE] = self.store[src * BLOCK_SIZE:(src + 1) * BLOCK_SIZE]

    def _check_hit(self, hit, tokens, extra) -> None:
        assert hit.num_tokens == len(hit.blocks) * BLOCK_SIZE
        assert hit.num_tokens <= max(len(tokens) - 1, 0)
        for pos in range(hit.num_tokens):
            slot = hit.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            assert self.store[slot] == _value(tokens[pos], extra)

    # -- rules
    @rule(target=seqs, template=st.sampled_from(TEMPLATES), suffix=st.lists(st.integers(0, 5), min_size=1, max_size=20),
          extra=st.sampled_from([0, 0, 1]), chunk=st.floats(0.0, 1.0))
    def new_seq(self, template, suffix, extra, chunk):
        tokens = template + suffix
        seq = self.next_id
        self.next_id += 1
        hit = self.kv.find_cached_prefix(tokens, extra)
        self._check_hit(hit, tokens, extra)
        remaining = len(tokens) - hit.num_tokens
        n = max(1, int(round(remaining * chunk)))
        needed = self.kv.num_blocks_needed(seq, n, hit)
        free_before = self.kv.num_free_blocks
        copies = self.kv.allocate_slots(seq, n, hit)
        if copies is None:
            assert needed > free_before and seq not in self.kv and self.kv.num_free_blocks == free_before
            return seq  # not live: later rules ignore it
        assert copies == [] and self.kv.num_free_blocks == free_before - needed
        self.model[seq] = {"tokens": tokens, "extra": extra, "computed": hit.num_tokens + n}
        self._write(seq, hit.num_tokens, hit.num_tokens + n)
        self.kv.cache_full_blocks(seq, tokens, hit.num_tokens + n, extra)
        return seq

    @rule(seq=seqs, new_tokens=st.lists(st.integers(0, 5), min_size=1, max_size=10), cache=st.booleans())
    def extend(self, seq, new_tokens, cache):
        if seq not in self.model:
            return
        m = self.model[seq]
        tokens = m["tokens"]
        if m["computed"] < len(tokens):  # next prefill chunk
            n = min(len(new_tokens), len(tokens) - m["computed"])
        else:  # decode
            n = len(new_tokens)
            tokens = tokens + new_tokens
        needed = self.kv.num_blocks_needed(seq, n)
        free_before = self.kv.num_free_blocks
        copies = self.kv.allocate_slots(seq, n)
        if copies is None:
            assert needed > free_before and self.kv.num_free_blocks == free_before
            assert self.kv.num_tokens(seq) == m["computed"]
            return
        m["tokens"] = tokens
        assert self.kv.num_free_blocks == free_before - needed
        self._apply_copies(seq, copies)
        self._write(seq, m["computed"], m["computed"] + n)
        m["computed"] += n
        if cache:
            self.kv.cache_full_blocks(seq, m["tokens"], m["computed"], m["extra"])

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        child = self.next_id
        self.next_id += 1
        if parent not in self.model:
            with pytest.raises(ValueError, match=f"unknown sequence id {parent}"):
                self.kv.fork(parent, child)
            return child
        self.kv.fork(parent, child)
        m = self.model[parent]
        self.model[child] = {"tokens": m["tokens"][: m["computed"]], "extra": m["extra"], "computed": m["computed"]}
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.model:
            self.kv.free(seq)
            del self.model[seq]
        else:
            with pytest.raises(ValueError, match="unknown sequence id"):
                self.kv.free(seq)

    @rule(template=st.sampled_from(TEMPLATES), suffix=st.lists(st.integers(0, 5), max_size=10), extra=st.sampled_from([0, 1]))
    def lookup(self, template, suffix, extra):
        tokens = template + suffix
        self._check_hit(self.kv.find_cached_prefix(tokens, extra, record_stats=False), tokens, extra)

    @rule()
    def reset_prefix_cache(self):
        self.kv.reset_prefix_cache()

    # -- invariants, after every step
    @invariant()
    def ref_counts_free_queue_and_contents(self):
        holders = np.zeros(NUM_BLOCKS, dtype=np.int64)
        for seq, m in self.model.items():
            ids = self.kv.block_ids(seq)
            assert len(set(ids.tolist())) == len(ids)
            assert self.kv.num_tokens(seq) == m["computed"]
            holders[ids] += 1
            if m["computed"]:
                slots = self.kv.slots(seq, 0, m["computed"])
                want = np.array([_value(t, m["extra"]) for t in m["tokens"][: m["computed"]]])
                np.testing.assert_array_equal(self.store[slots], want)
        refs = np.array([self.kv.ref_count(b) for b in range(NUM_BLOCKS)])
        np.testing.assert_array_equal(refs, holders)
        free = self.kv.free_queue()
        assert len(free) == len(set(free)) == self.kv.num_free_blocks
        assert set(free) == {b for b in range(NUM_BLOCKS) if holders[b] == 0}
        stats = self.kv.stats()
        assert stats.num_cached_blocks == sum(self.kv.is_cached(b) for b in range(NUM_BLOCKS))
        assert stats.usage == pytest.approx(1 - len(free) / NUM_BLOCKS)

    def teardown(self):
        for seq in list(self.model):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(self.kv.ref_count(b) == 0 for b in range(NUM_BLOCKS))


KVCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheMachine = KVCacheMachine.TestCase
