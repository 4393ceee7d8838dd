"""Speculative verification (sample/rejection_sampler.py) against a float64 reference written as
the papers' loop, on fresh random distributions and proposals (greedy and random rows, n-gram
one-hot drafts and draft distributions, rows with 0 .. K proposals), with the same random numbers;
and the lemma itself: over many draws, the emitted tokens follow the target's distribution at
each position (chi-square), whatever the draft."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm import _C
from pagedllm.sample.rejection_sampler import draw_random, rejection_sample
from pagedllm.spec_decode import NgramProposer


def reference(p, x, n, greedy, u, e, q):
    """One row, float64: the emitted tokens."""
    out = []
    for j in range(n):
        if greedy:
            ok = int(np.argmax(p[j])) == x[j]
        else:
            qx = 1.0 if q is None else q[j][x[j]]
            ok = u[j] * qx < p[j][x[j]]
        if not ok:
            if greedy:
                out.append(int(np.argmax(p[j])))
                return out
            if q is None:
                res = p[j].copy()
                res[x[j]] = 0.0
            else:
                res = np.maximum(p[j] - q[j], 0.0)
            if res.sum() <= 0:
                res = p[j]
            out.append(int(np.argmax(res / e[j])))
            return out
        out.append(int(x[j]))
    out.append(int(np.argmax(p[n])) if greedy else int(np.argmax(p[n] / e[n])))
    return out


def random_case(seed, B=24, K=4, V=11, with_q=False, peaked=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g, dtype=torch.float64) * (4.0 if peaked else 1.0)
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g, dtype=torch.float64), -1) if with_q else None
    # proposals: half drawn from the target's argmax (so greedy rows accept some), half random
    x = torch.where(torch.rand(B, K, generator=g) < 0.5, p[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g))
    n = torch.randint(0, K + 1, (B,), generator=g)
    greedy = torch.rand(B, generator=g) < 0.4
    u = torch.rand(B, K, generator=g, dtype=torch.float64)
    e = torch.empty(B, K + 1, V, dtype=torch.float64).exponential_(generator=g)
    return p, x, n, greedy, u, e, q


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("peaked", [False, True])
def test_matches_the_float64_reference(with_q, peaked):
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    p, x, n, greedy, u, e, q = random_case(seed, with_q=with_q, peaked=peaked)
    # both see the same (float32) numbers; the reference computes in float64
    p, u, e = p.float().double(), u.float().double(), e.float().double()
    q = None if q is None else q.float().double()
    out, emitted, accepted = rejection_sample(p.float(), x, n, greedy, u.float(), e.float(),
                                              None if q is None else q.float())
    for b in range(p.shape[0]):
        want = reference(p[b].numpy(), x[b].tolist(), int(n[b]), bool(greedy[b]), u[b].numpy(), e[b].numpy(),
                         None if q is None else q[b].numpy())
        got = out[b].tolist()
        assert got[:len(want)] == want and all(t == -1 for t in got[len(want):]), (b, got, want)
        assert int(emitted[b]) == len(want) and int(accepted[b]) == len(want) - 1


def test_greedy_rows_emit_what_greedy_decoding_would():
    p, x, n, _, u, e, _ = random_case(5, B=64, peaked=True)
    out, emitted, _ = rejection_sample(p.float(), x, n, torch.ones(64, dtype=torch.bool), u.float(), e.float())
    for b in range(64):
        toks = out[b, :int(emitted[b])].tolist()
        # every emitted token is the target's argmax at its position (the context being the
        # accepted proposals before it)
        assert toks == [int(p[b, j].argmax()) for j in range(len(toks))]
        assert len(toks) == 1 + next((j for j in range(int(n[b])) if x[b, j] != p[b, j].argmax()), int(n[b]))


@pytest.mark.parametrize("with_q", [False, True])
def test_emitted_tokens_follow_the_target_distribution(with_q):
    """The lemma: position 0's token ~ p_0; given position 0 accepted, position 1's token ~ p_1
    (the target's distributions here do not depend on the context)."""
    from scipy.stats import chisquare

    V, K, N = 6, 2, 120_000
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    # proposals drawn from the draft's distribution (one-hot drafts: from a distribution that is not p)
    x = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], dim=1)
    u, e = torch.rand(N, K, generator=g), torch.empty(N, K + 1, V).exponential_(generator=g)
    out, emitted, _ = rejection_sample(p.expand(N, K + 1, V), x, torch.full((N,), K), torch.zeros(N, dtype=torch.bool),
                                       u, e, q.expand(N, K, V) if with_q else None)
    for j in range(2):
        rows = emitted > j
        counts = torch.bincount(out[rows, j], minlength=V).numpy()
        probs = p[j].double().numpy()
        expected = probs / probs.sum() * counts.sum()
        assert chisquare(counts, expected).pvalue > 1e-4, (j, counts, expected)


def test_draw_random_is_reproducible_per_generator():
    a = draw_random(3, 2, 7, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], "cpu")
    b = draw_random(3, 2, 7, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (a[0] >= 0).all() and (a[0] < 1).all() and (a[1] > 0).all()


def test_bad_shapes_are_value_errors():
    p = torch.full((2, 3, 5), 0.2)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(p, torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 1]), torch.tensor([True, False]),
                         torch.rand(2, 2), torch.ones(2, 3, 5))
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(p, torch.zeros(2, 2, dtype=torch.long), torch.tensor([3, 1]), torch.tensor([True, False]),
                         torch.rand(2, 2), torch.ones(2, 3, 5))


# ---------------------------------------------------------------------------- n-gram proposals
def reference_ngram(t, k, lo, hi):
    for n in range(min(hi, len(t) - 1), lo - 1, -1):
        suffix = t[len(t) - n:]
        for i in range(len(t) - n):  # earliest occurrence first (vLLM v1)
            if t[i:i + n] == suffix:
                return t[i + n:i + n + k]
    return []


def test_ngram_proposals_match_a_plain_search():
    rng = random.Random(random.SystemRandom().randrange(2**31))
    for _ in range(300):
        t = [rng.randrange(6) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        want = reference_ngram(t, k, lo, hi)
        assert NgramProposer(k, lo, hi).propose(t).tolist() == want, (t, k, lo, hi)
        assert _C.propose_ngram(t, lo, hi, k) == want, (t, k, lo, hi)  # the scheduler's


def test_ngram_bad_bounds():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
