"""The sampler's structured-output mask (Sampler._apply_grammar, start_grammar) against a float64
reference: for fresh random logits and matchers advanced to random grammar states, the processed
logits of each constrained row are the row's logits where the grammar allows the token (a
per-token check through GrammarMatcher.accept_token/rollback's bitmask, unpacked bit by bit in
Python) and -inf elsewhere; unconstrained rows are untouched; start_grammar (the bitmask filled on
a thread during the forward pass) changes nothing; on CUDA the same as on the CPU."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tokenizers import smollm2_tokenizer  # noqa: E402

from pagedllm.sample import Sampler  # noqa: E402
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputManager  # noqa: E402

V = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(smollm2_tokenizer(), V)
    yield m
    m.shutdown()


def reference_mask(matcher) -> np.ndarray:
    """Allowed tokens as bool [V], from the matcher's own bitmask read bit by bit."""
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(1, V)
    matcher.fill_next_token_bitmask(bm, 0)
    words = bm[0].tolist()
    return np.array([(words[t // 32] >> (t % 32)) & 1 == 1 for t in range(V)])


def advance(matcher, rng: random.Random, steps: int) -> None:
    """Move the matcher to a random state by accepting random allowed tokens."""
    for _ in range(steps):
        if matcher.is_terminated():  # took its stop token: nothing more to fill
            return
        allowed = np.nonzero(reference_mask(matcher))[0]
        if allowed.size == 0:
            return
        assert matcher.accept_token(int(rng.choice(allowed.tolist())))


def build(manager, rows: int, constrained: list[int], seed: int):
    """A Sampler with `rows` greedy sequences (seq ids 100 + r), the `constrained` ones under SCHEMA
    or a regex, advanced to random states; returns (sampler, seq_ids, {row: matcher})."""
    rng = random.Random(seed)
    sampler = Sampler(V, seed=seed)
    matchers = {}
    for r in range(rows):
        so = None
        if r in constrained:
            so = (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if r % 2
                  else StructuredOutputsParams(regex=r"[a-z]{2,6}-\d{1,4}"))
        params = SamplingParams(temperature=0.0, structured_outputs=so)
        matcher = manager.matcher(so) if so is not None else None
        if matcher is not None:
            advance(matcher, rng, rng.randint(0, 6))
            if not matcher.is_terminated():  # a finished grammar constrains nothing (add_sequence drops it)
                matchers[r] = matcher
        sampler.add_sequence(100 + r, params, [1, 2, 3], 0, [2], matcher)
    return sampler, np.arange(100, 100 + rows), matchers


@pytest.mark.parametrize("rows, constrained", [(5, [0, 1, 2, 3, 4]), (7, [1, 4, 5]), (3, [2])])
def test_mask_matches_the_reference(manager, rows, constrained):
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    sampler, seq_ids, matchers = build(manager, rows, constrained, seed)
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))
    got = sampler.processed_logits(logits, seq_ids).to(torch.float64).numpy()
    ref = logits.to(torch.float64).numpy().copy()
    for r, m in matchers.items():
        ref[r, ~reference_mask(m)] = -np.inf
    assert np.array_equal(got, ref)
    # the draw picks the best allowed token, and the matcher takes it
    out = sampler(logits, seq_ids)
    assert out.sampled_token_ids.tolist() == np.argmax(ref, axis=1).tolist()


def test_a_grammar_that_took_its_stop_token_leaves_the_row_free(manager):
    """ignore_eos: the EOS the grammar ends with does not end the sequence; what follows is free."""
    m = manager.matcher(StructuredOutputsParams(choice=["yes"]))
    sampler = Sampler(V)
    sampler.add_sequence(7, SamplingParams(temperature=0.0, ignore_eos=True), [1], 0, [2], m)
    for tok in smollm2_tokenizer().encode("yes") + [2]:
        sampler.append_output_tokens(np.array([7]), np.array([tok]))
    logits = torch.randn(1, V)
    assert torch.equal(sampler.processed_logits(logits, [7]), logits)


def twins(manager, rows: int, constrained: list[int]):
    """Two samplers in the same random state, their seq ids and random logits (fresh seed, printed)."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))
    a, seq_ids, _ = build(manager, rows, constrained, seed)
    b, _, _ = build(manager, rows, constrained, seed)
    return a, b, seq_ids, logits


def test_start_grammar_changes_nothing(manager):
    a, b, seq_ids, logits = twins(manager, 6, [0, 2, 3, 5])
    a.start_grammar(seq_ids)
    assert np.array_equal(a(logits, seq_ids).sampled_token_ids, b(logits, seq_ids).sampled_token_ids)
    a.start_grammar(seq_ids[:3])  # the call then asks for other rows: filled there instead
    assert np.array_equal(a.processed_logits(logits, seq_ids), b.processed_logits(logits, seq_ids))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mask_equals_the_cpu_mask(manager):
    cpu, gpu, seq_ids, logits = twins(manager, 9, [0, 1, 4, 8])
    ref = cpu.processed_logits(logits, seq_ids)
    gpu.start_grammar(seq_ids)
    got = gpu.processed_logits(logits.cuda(), seq_ids).cpu()
    assert torch.equal(got, ref)
    assert json.dumps(gpu(logits.cuda(), seq_ids).sampled_token_ids.tolist()) == json.dumps(
        cpu(logits, seq_ids).sampled_token_ids.tolist())
