"""Shared pieces of the end-to-end tests: the prompt set and Hugging Face greedy references."""

from __future__ import annotations

import functools

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "Here is a story. A farmer planted a single apple seed in spring. For years nothing grew, and the "
    "neighbours laughed at him, but he watered the spot every morning. In the tenth year a tree appeared "
    "and gave more apples than the whole village could eat. What is the moral of this story?",
    "What is 17 times 3?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Paris is a city that",
    "In machine learning, overfitting means",
    "import numpy as np\n",
    "My favourite recipe for pancakes starts with",
]


@functools.lru_cache(maxsize=1)
def bundled_folder():
    from pagedllm.model_executor.loader import resolve_model

    return resolve_model(None)


@functools.lru_cache(maxsize=1)
def bundled_prompt_ids() -> tuple[tuple[int, ...], ...]:
    """16 prompts: 8 chat-formatted questions (BOS once) and 8 plain texts, as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_folder()))
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    ids = [tok.encode(c, add_special_tokens=False) for c in chats] + [tok.encode(t) for t in TEXTS]
    return tuple(tuple(i) for i in ids)


def hf_greedy(model, prompts, max_new_tokens: int, eos_token_id=None, pad_token_id: int = 0):
    """HF generate (greedy, one left-padded batch). Returns per prompt (tokens, raw logits [n, V]),
    cut after the first EOS when eos_token_id is given (EOS disabled otherwise)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos_token_id  # None: never stop early
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad_token_id, output_logits=True,
                                 return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    finally:
        model.generation_config.eos_token_id = saved
    logits = torch.stack(out.logits, dim=1).float()  # [B, steps, V]
    results = []
    for i in range(len(prompts)):
        toks = out.sequences[i, width:].tolist()
        if eos_token_id is not None and eos_token_id in toks:
            toks = toks[: toks.index(eos_token_id) + 1]
        results.append((toks, logits[i, : len(toks)]))
    return results


def first_mismatch(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))
