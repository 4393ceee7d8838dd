"""Shared engines for the sampling / detokenization end-to-end tests: one LLM over the bundled
SmolLM2-135M-Instruct (fp32) and one over a random-weight Llama with SmolLM2's tokenizer, each
built once per pytest process (threads pinned to 1)."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import torch

EOS = 2  # <|im_end|>


def _pin_threads() -> None:
    torch.set_num_threads(1)
    from pagedllm import ops

    ops.set_num_threads(1)


@functools.lru_cache(maxsize=1)
def bundled_llm():
    _pin_threads()
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048)


@functools.lru_cache(maxsize=1)
def random_llm():
    """A 2-layer random Llama (hidden 256, head_dim 64) with SmolLM2's vocabulary and tokenizer:
    its random tokens often are partial UTF-8 byte tokens."""
    _pin_threads()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedllm import LLM
    from pagedllm.model_executor.loader import resolve_model

    folder = Path(tempfile.mkdtemp(prefix="pagedllm-random-llama-"))
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=len(tok), max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=True, initializer_range=0.5)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=128 << 20, max_model_len=1024)
    llm._test_folder = folder
    return llm


def greedy(max_tokens: int = 32, **kw):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def chat_ids(llm, text: str) -> dict:
    """A TokensPrompt of one user message through the chat template (the template writes BOS)."""
    tok = llm.get_tokenizer()
    s = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tok.encode(s, add_special_tokens=False)}


def stream_texts(llm, prompt: dict, params) -> list[str]:
    """The cumulative text after every engine step of one request run alone (LLMEngine.step)."""
    engine = llm.llm_engine
    request_id = engine.new_request_id()
    engine.add_request(request_id, None, list(prompt["prompt_token_ids"]), params)
    texts = []
    while True:
        outs = [o for o in engine.step() if o.request_id == request_id]
        for o in outs:
            texts.append(o.outputs[0].text)
            if o.finished:
                return texts
