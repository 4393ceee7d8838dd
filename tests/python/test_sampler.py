"""The Sampler's logits transforms against plain float64 references, its draws (chi-square),
seeds across batch compositions, n > 1, min_tokens masking, logprobs, and bad input."""

import numpy as np
import pytest
import torch
from scipy import stats

from pagedllm.sample import Sampler, compute_prompt_logprobs, logprob_dict
from pagedllm.sampling_params import SamplingParams

torch.set_num_threads(1)

V = 64


def fixed_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0


def make_sampler(params_list, prompts=None, vocab=V, eos=(), seed=0):
    s = Sampler(vocab, seed=seed, capacity=2)  # small capacity: exercises table growth
    for i, p in enumerate(params_list):
        s.add_sequence(100 + 7 * i, p, (prompts[i] if prompts else ()), 0, eos)
    return s, np.array([100 + 7 * i for i in range(len(params_list))], dtype=np.int64)


# ---------------------------------------------------------------- plain references (float64)
def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    e = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    return e / e.sum()


def ref_top_k(x, k):
    out = x.copy()
    if 0 < k < len(x):
        kth = np.sort(x)[::-1][k - 1]
        out[x < kth] = -np.inf
    return out


def ref_top_p(x, p):
    """Keep a token when the mass of strictly more likely tokens is below p."""
    probs = softmax(x)
    order = np.argsort(-x, kind="stable")
    out = np.full_like(x, -np.inf)
    before = 0.0
    for i in order:
        if before < p or i == order[0]:
            out[i] = x[i]
        before += probs[i]
    return out


def ref_min_p(x, min_p):
    probs = softmax(x)
    out = x.copy()
    out[probs < min_p * probs.max()] = -np.inf
    return out


def ref_penalties(x, prompt, output, rep, freq, pres):
    out = x.copy()
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        c = output.count(t)
        out[t] -= freq * c + pres
    return out


def assert_same_survivors(got: torch.Tensor, want: np.ndarray):
    got = got.double().numpy()
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), (
        f"surviving tokens differ: got {np.flatnonzero(np.isfinite(got))}, want {np.flatnonzero(np.isfinite(want))}"
    )
    f = np.isfinite(want)
    np.testing.assert_allclose(got[f], want[f], rtol=0, atol=1e-6 * max(1.0, np.abs(want[f]).max()))


# ---------------------------------------------------------------- transforms
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature(temperature):
    logits = fixed_logits(3, seed=1)
    s, ids = make_sampler([SamplingParams(temperature=temperature)] * 3)
    got = s.processed_logits(logits, ids)
    for r in range(3):
        assert_same_survivors(got[r], logits[r].double().numpy() / temperature)


@pytest.mark.parametrize("k", [1, 2, 5, 63, 64, 65, 10**7])
def test_top_k(k):
    logits = fixed_logits(2, seed=2)
    s, ids = make_sampler([SamplingParams(top_k=k), SamplingParams()])
    got = s.processed_logits(logits, ids)
    assert_same_survivors(got[0], ref_top_k(logits[0].double().numpy(), k))
    assert torch.isfinite(got[1]).all()  # the row without top_k is untouched in a mixed batch
    assert int(torch.isfinite(got[0]).sum()) == min(k, V)


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.5, 0.9, 0.999])
def test_top_p(p):
    logits = fixed_logits(3, seed=3)
    s, ids = make_sampler([SamplingParams(top_p=p, temperature=0.8)] * 3)
    got = s.processed_logits(logits, ids)
    for r in range(3):
        assert_same_survivors(got[r], ref_top_p(logits[r].double().numpy() / 0.8, p))
    if p == 1e-9:
        assert int(torch.isfinite(got).sum()) == 3  # only the argmax survives


def test_top_k_and_top_p_together():
    logits = fixed_logits(2, seed=4)
    s, ids = make_sampler([SamplingParams(top_k=10, top_p=0.7), SamplingParams(top_k=3, top_p=0.99)])
    got = s.processed_logits(logits, ids)
    for r, (k, p) in enumerate([(10, 0.7), (3, 0.99)]):
        assert_same_survivors(got[r], ref_top_p(ref_top_k(logits[r].double().numpy(), k), p))


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p(min_p):
    logits = fixed_logits(2, seed=5)
    s, ids = make_sampler([SamplingParams(min_p=min_p, temperature=1.3)] * 2)
    got = s.processed_logits(logits, ids)
    for r in range(2):
        assert_same_survivors(got[r], ref_min_p(logits[r].double().numpy() / 1.3, min_p))


@pytest.mark.parametrize(
    "rep,freq,pres",
    [(1.5, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.6, 0.0), (1.0, 0.0, -1.2), (1.3, 0.4, 0.9)],
)
def test_penalties(rep, freq, pres):
    logits = fixed_logits(2, seed=6)
    prompt = [1, 2, 3, 3, 40]
    outputs = [[5, 5, 5, 2, 60], [7]]
    params = SamplingParams(temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    s, ids = make_sampler([params, params], prompts=[prompt, prompt])
    for step in range(5):  # feed the output history the way the engine loop does
        toks = [o[step] for o in outputs if step < len(o)]
        s.append_output_tokens(ids[: len(toks)], np.array(toks, dtype=np.int32))
    got = s.processed_logits(logits, ids)
    for r in range(2):
        want = ref_penalties(logits[r].double().numpy(), prompt, outputs[r], rep, freq, pres)
        assert_same_survivors(got[r], want)
    assert not torch.equal(got, logits)  # the penalty path ran


def test_logit_bias():
    logits = fixed_logits(2, seed=7)
    bias = {0: 5.0, 17: -100.0, 63: 0.25}
    s, ids = make_sampler([SamplingParams(logit_bias=bias, temperature=0), SamplingParams(temperature=0)])
    got = s.processed_logits(logits, ids)
    want = logits[0].double().numpy().copy()
    for t, b in bias.items():
        want[t] += b
    assert_same_survivors(got[0], want)
    assert_same_survivors(got[1], logits[1].double().numpy())
    # a strong bias decides the greedy token
    out = s(logits, ids)
    assert out.sampled_token_ids[0] == int(np.argmax(want))


def test_min_tokens_masks_real_eos_and_stop_ids():
    eos = 2
    logits = torch.zeros(1, V)
    logits[0, eos] = 50.0  # EOS is overwhelmingly likely
    logits[0, 9] = 40.0  # then a stop token
    logits[0, 30] = 30.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9], ignore_eos=True, max_tokens=10)
    s, ids = make_sampler([p], eos=[eos])
    seen = []
    for _ in range(4):
        out = s(logits, ids)
        seen.append(int(out.sampled_token_ids[0]))
        s.append_output_tokens(ids, out.sampled_token_ids)
    assert seen == [30, 30, 30, eos]  # masked for min_tokens steps, then EOS comes back
    # the mask hits exactly EOS and the stop ids, not the last vocabulary token (TRT-LLM #12324)
    s2, ids2 = make_sampler([p], eos=[eos])
    got = s2.processed_logits(fixed_logits(1, seed=8), ids2)[0]
    assert set(np.flatnonzero(~torch.isfinite(got).numpy())) == {eos, 9}


# ---------------------------------------------------------------- draws
def test_chi_square_10000_draws():
    vocab = 12
    base = torch.tensor([[2.0, 1.5, 1.2, 1.0, 0.6, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0]])
    p = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, min_p=0.02)
    n = 10_000
    s = Sampler(vocab, seed=1234, capacity=n)
    for i in range(n):
        s.add_sequence(i, p)
    out = s(base.expand(n, vocab).contiguous(), np.arange(n))
    want = ref_top_p(ref_top_k(ref_min_p(base[0].double().numpy() / 0.8, 0.02), 9), 0.95)
    probs = softmax(want)
    counts = np.bincount(out.sampled_token_ids, minlength=vocab)
    assert counts[probs == 0].sum() == 0, "a masked token was drawn"
    support = probs > 0
    assert support.sum() >= 5  # a real distribution, not a near-greedy one
    chi2, pvalue = stats.chisquare(counts[support], n * probs[support])
    assert pvalue > 1e-3, (chi2, pvalue, counts, probs)


def test_seeded_chi_square_over_seeds():
    """The seeded path (one generator per sequence) also draws from the right distribution."""
    vocab = 6
    base = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    n = 3000
    s = Sampler(vocab, capacity=n)
    for i in range(n):
        s.add_sequence(i, SamplingParams(seed=10_000 + i))
    out = s(base.expand(n, vocab).contiguous(), np.arange(n))
    probs = softmax(base[0].numpy())
    counts = np.bincount(out.sampled_token_ids, minlength=vocab)
    _, pvalue = stats.chisquare(counts, n * probs)
    assert pvalue > 1e-3


def run_steps(sampler, seq_ids, logits_per_step):
    toks = []
    for logits in logits_per_step:
        out = sampler(logits, seq_ids)
        sampler.append_output_tokens(seq_ids, out.sampled_token_ids)
        toks.append(out.sampled_token_ids.copy())
    return np.stack(toks)


def test_seed_reproducible_across_batch_compositions():
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    steps = 25
    target_logits = [fixed_logits(1, seed=100 + i) for i in range(steps)]

    def run(batch_before: int, batch_after: int, other_seed):
        s = Sampler(V, seed=other_seed)
        rows = batch_before + 1 + batch_after
        for i in range(rows):
            if i == batch_before:
                s.add_sequence(42, target)
            else:
                seeded = SamplingParams(temperature=0.7, seed=i) if i % 2 else SamplingParams(top_k=5)
                s.add_sequence(1000 + i, seeded)
        ids = np.array([42 if i == batch_before else 1000 + i for i in range(rows)])
        per_step = []
        for i in range(steps):
            l = fixed_logits(rows, seed=500 + i + 17 * other_seed)
            l[batch_before] = target_logits[i][0]
            per_step.append(l)
        return run_steps(s, ids, per_step)[:, batch_before]

    alone = run(0, 0, 0)
    assert np.array_equal(alone, run(0, 0, 1))
    assert np.array_equal(alone, run(3, 5, 2))
    assert np.array_equal(alone, run(8, 0, 3))
    assert len(set(alone.tolist())) > 3  # it really sampled


def test_n_greater_than_one_gives_distinct_draws():
    logits = [fixed_logits(4, seed=200 + i) * 0.2 for i in range(20)]  # flat: many likely tokens
    for params in (SamplingParams(n=4, seed=7), SamplingParams(n=4)):
        s = Sampler(V)
        for index in range(4):
            s.add_sequence(50 + index, params, (), index)
        seqs = run_steps(s, np.arange(50, 54), [l[0:1].expand(4, V).contiguous() for l in logits]).T
        assert len({tuple(x) for x in seqs}) == 4, seqs
    # the seeded children are reproducible
    s1, s2 = Sampler(V), Sampler(V)
    for s in (s1, s2):
        for index in range(4):
            s.add_sequence(50 + index, SamplingParams(n=4, seed=7), (), index)
    same_logits = [l[0:1].expand(4, V).contiguous() for l in logits]
    assert np.array_equal(run_steps(s1, np.arange(50, 54), same_logits), run_steps(s2, np.arange(50, 54), same_logits))


def test_near_greedy_settings_equal_greedy():
    """C17: temperature 1e-4 / 1e-6, top_k=1 and top_p=1e-9 pick the argmax; C16: a huge top_k is
    exactly top_k off for the same seed; a greedy row in a mixed batch is its solo argmax."""
    steps = [fixed_logits(1, seed=300 + i) for i in range(20)]
    greedy = [int(l.argmax()) for l in steps]

    def tokens(params):
        s, ids = make_sampler([params])
        return run_steps(s, ids, steps)[:, 0].tolist()

    assert tokens(SamplingParams(temperature=0)) == greedy
    assert tokens(SamplingParams(temperature=1e-4, seed=1)) == greedy
    assert tokens(SamplingParams(temperature=1e-6, seed=1)) == greedy
    assert tokens(SamplingParams(temperature=1.0, top_k=1)) == greedy
    assert tokens(SamplingParams(temperature=0.7, top_p=1e-9)) == greedy
    assert tokens(SamplingParams(temperature=0, top_p=0.1, top_k=50)) == greedy
    off = tokens(SamplingParams(temperature=1.0, seed=3))
    assert off != greedy
    for k in (V, V + 1, 9_999_999, -1, 0):
        assert tokens(SamplingParams(temperature=1.0, seed=3, top_k=k)) == off
    s, ids = make_sampler([SamplingParams(temperature=0), SamplingParams(top_k=5, seed=3)])
    mixed = run_steps(s, ids, [torch.cat([l, fixed_logits(1, seed=900 + i)]) for i, l in enumerate(steps)])
    assert mixed[:, 0].tolist() == greedy


def test_tiny_temperature_logprobs_finite():
    s, ids = make_sampler([SamplingParams(temperature=1e-4, seed=0, logprobs=3)])
    out = s(fixed_logits(1, seed=11) * 10, ids)
    assert np.isfinite(out.logprobs.logprobs).all()


# ---------------------------------------------------------------- logprobs
def test_logprobs_from_raw_logits():
    logits = fixed_logits(3, seed=12)
    params = [
        SamplingParams(logprobs=4, temperature=0.5, repetition_penalty=1.5, top_k=3),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
    ]
    s, ids = make_sampler(params, prompts=[[1, 2], [], []])
    out = s(logits, ids)
    ref = torch.log_softmax(logits.double(), dim=-1).numpy()
    lt = out.logprobs
    assert lt.token_ids.shape == (3, 5) and lt.num_logprobs.tolist() == [4, -1, 0]
    for r in (0, 2):
        tok = int(out.sampled_token_ids[r])
        assert lt.token_ids[r, 0] == tok
        np.testing.assert_allclose(lt.logprobs[r, 0], ref[r, tok], atol=1e-5)
        assert lt.ranks[r] == 1 + int((ref[r] > ref[r, tok]).sum())
    top = np.argsort(-ref[0])[:4]
    assert lt.token_ids[0, 1:].tolist() == top.tolist()
    np.testing.assert_allclose(lt.logprobs[0, 1:], ref[0, top], atol=1e-5)
    d = logprob_dict(lt, 0, decode=lambda t: f"<{t}>")
    assert int(out.sampled_token_ids[0]) in d and set(top.tolist()) <= set(d)
    assert [d[int(t)].rank for t in top] == [1, 2, 3, 4]
    assert d[int(top[0])].decoded_token == f"<{int(top[0])}>"
    assert logprob_dict(lt, 1) is None
    assert list(logprob_dict(lt, 2)) == [int(out.sampled_token_ids[2])]
    assert logprob_dict(lt, 2)[int(out.sampled_token_ids[2])].rank == 1  # greedy token is rank 1


def test_logprobs_whole_vocab_and_prompt_logprobs():
    logits = fixed_logits(4, seed=13)
    s, ids = make_sampler([SamplingParams(logprobs=-1)])
    out = s(logits[:1], ids)
    assert out.logprobs.token_ids.shape == (1, V + 1)
    assert len(logprob_dict(out.logprobs, 0)) == V
    targets = [5, 0, 63, 17]
    pl = compute_prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits.double(), dim=-1).numpy()
    for r, t in enumerate(targets):
        d = logprob_dict(pl, r)
        np.testing.assert_allclose(d[t].logprob, ref[r, t], atol=1e-5)
        assert d[t].rank == 1 + int((ref[r] > ref[r, t]).sum())
        assert len(d) in (2, 3)


# ---------------------------------------------------------------- dtypes, bookkeeping, errors
def test_bf16_and_padded_vocab():
    s, ids = make_sampler([SamplingParams(temperature=0)] * 2)
    logits = torch.cat([fixed_logits(2, seed=14), torch.full((2, 16), 1e4)], dim=1)  # padded columns
    out = s(logits.to(torch.bfloat16), ids)
    assert (out.sampled_token_ids < V).all()
    assert out.sampled_token_ids.tolist() == logits[:, :V].to(torch.bfloat16).float().argmax(-1).tolist()


def test_caller_logits_untouched():
    logits = fixed_logits(2, seed=15)
    before = logits.clone()
    s, ids = make_sampler([SamplingParams(top_k=3, repetition_penalty=1.2, logit_bias={1: 3.0})] * 2, [[1], [2]])
    s(logits, ids)
    assert torch.equal(logits, before)


def test_slots_reused_and_errors():
    s = Sampler(V, capacity=1)
    for i in range(10):
        s.add_sequence(i, SamplingParams())
    assert s.num_sequences == 10
    with pytest.raises(ValueError, match="already"):
        s.add_sequence(3, SamplingParams())
    for i in range(0, 10, 2):
        s.remove_sequence(i)
    s.remove_sequence(12345)  # unknown: ignored
    with pytest.raises(ValueError, match=r"seq_ids \[4\]"):
        s(fixed_logits(2), np.array([3, 4]))
    with pytest.raises(ValueError, match="logit_bias"):
        s.add_sequence(99, SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match="eos_token_ids"):
        s.add_sequence(99, SamplingParams(), (), 0, [V + 3])
    with pytest.raises(ValueError, match="rows"):
        s(fixed_logits(3), np.array([1, 3]))
    with pytest.raises(ValueError, match="vocab_size"):
        s(fixed_logits(2, vocab=V - 1), np.array([1, 3]))
    assert s.num_sequences == 5
    # a slot freed by a seeded greedy-free sequence does not leak its state into the next one
    s.add_sequence(200, SamplingParams(temperature=0))
    out = s(fixed_logits(1, seed=16), np.array([200]))
    assert out.sampled_token_ids[0] == int(fixed_logits(1, seed=16).argmax())


@pytest.mark.cuda
def test_cuda_matches_contract():
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    logits = fixed_logits(5, seed=17)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=5, top_k=10, top_p=0.9, logprobs=2),
        SamplingParams(repetition_penalty=1.3, min_p=0.1),
        SamplingParams(logit_bias={3: 2.0}, min_tokens=2),
        SamplingParams(),
    ]
    s_cpu, ids = make_sampler(params, prompts=[[1]] * 5, eos=[2])
    s_gpu, _ = make_sampler(params, prompts=[[1]] * 5, eos=[2])
    got = s_gpu.processed_logits(logits.cuda(), ids).cpu()
    want = s_cpu.processed_logits(logits, ids)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    f = torch.isfinite(want)
    torch.testing.assert_close(got[f], want[f], atol=1e-5, rtol=1e-5)
    out = s_gpu(logits.cuda(), ids)
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
    # the seeded row is the same alone and in the batch on the GPU
    s_alone = Sampler(V)
    s_alone.add_sequence(107, params[1])
    alone = s_alone(logits[1:2].cuda(), np.array([107]))
    assert alone.sampled_token_ids[0] == out.sampled_token_ids[1]


def test_top_k_top_p_routes_in_one_batch():
    """Rows of one batch take different exact routes (top-k only, pass-through, top-k then top-p,
    top-p over the top candidates, full sort): each row still matches the reference."""
    from pagedllm.sample import ops

    vocab = 4096
    g = torch.Generator().manual_seed(21)
    peaked = torch.randn(1, vocab, generator=g) * 4.0
    flat = torch.randn(1, vocab, generator=g) * 0.05
    rows = [  # (logits, k, p)
        (peaked, 30, 1.0), (peaked, vocab, 1.0), (peaked, 5, 0.9), (peaked, vocab, 0.9),
        (flat, vocab, 0.999), (flat, 2000, 0.5), (peaked, 2000, 0.95),
    ]
    logits = torch.cat([r[0] for r in rows])
    k = torch.tensor([r[1] for r in rows])
    p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    got = ops.apply_top_k_top_p(logits.clone(), k, p)
    for i, (l, kk, pp) in enumerate(rows):
        want = ref_top_p(ref_top_k(l[0].double().numpy(), kk), pp) if pp < 1 else ref_top_k(l[0].double().numpy(), kk)
        assert_same_survivors(got[i], want)
    # the routes really differ: the flat top-p row keeps far more than the candidate window
    assert int(torch.isfinite(got[4]).sum()) > ops._TOPP_CANDIDATES
    assert int(torch.isfinite(got[3]).sum()) < ops._TOPP_CANDIDATES


@pytest.mark.cuda
def test_cuda_plain_greedy_uses_the_native_argmax(gen):
    """All-greedy steps on CUDA take pagedllm.ops.argmax_rows (no copy, no transform): the
    sampled ids equal the CPU sampler's on the same float32 / bfloat16 / float16 logits."""
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    V = 128256
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(6, V + 8, generator=gen).to(dtype)  # padded vocabulary columns
        logits[:, V:] = 100.0  # never chosen: outside vocab_size
        s_gpu = Sampler(V)
        s_cpu = Sampler(V)
        for i in range(6):
            s_gpu.add_sequence(i, SamplingParams(temperature=0))
            s_cpu.add_sequence(i, SamplingParams(temperature=0))
        got = s_gpu(logits.cuda(), np.arange(6)).sampled_token_ids
        want = s_cpu(logits.float(), np.arange(6)).sampled_token_ids
        assert got.dtype == np.int32
        assert np.array_equal(got, want)
        assert np.array_equal(got, logits[:, :V].float().argmax(-1).numpy())


def test_argmax_suffices_only_for_plain_greedy_rows_without_logprobs():
    """The engine lets the model take the argmax itself (no logits written) only when the sampler
    would return the argmax of the raw logits: every row greedy, no logit_bias, no penalty, no
    active min_tokens, no logprobs; from_argmax wraps the ids as the sampler would."""
    plain = SamplingParams(temperature=0, seed=7)  # a seed does not matter to a greedy row
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=0, logit_bias={3: 1.0}), SamplingParams(temperature=0, presence_penalty=0.5),
              SamplingParams(temperature=0, min_tokens=2)]
    s, all_ids = make_sampler([plain, plain] + others, eos=(0,))
    ids = all_ids[:2]
    assert s.argmax_suffices(ids)
    for i in range(len(others)):
        assert not s.argmax_suffices(np.array([100, 100 + 7 * (2 + i)])), others[i]
    logits = fixed_logits(2)
    assert np.array_equal(s.from_argmax(torch.argmax(logits, dim=1)).sampled_token_ids,
                          s(logits, ids).sampled_token_ids)
    s.append_output_tokens(np.array([100 + 7 * 6] * 2), np.array([5, 6]))  # min_tokens reached
    assert s.argmax_suffices(np.array([100, 100 + 7 * 6]))
    assert not s.argmax_suffices(np.zeros(0, dtype=np.int64))
