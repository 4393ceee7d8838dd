"""Fault: the chat path adds a second BOS token — the chat template already writes BOS and the
tokenization of the rendered text adds the tokenizer's default special tokens on top (public case
C23: vLLM PRs #16976, #27517, #55288). A random-weight Llama with SmolLM2's tokenizer set to add
BOS by default (as Llama tokenizers do) and a Gemma/Llama-3-style template that writes
``{{ bos_token }}`` itself; for contrast the bundled SmolLM2 (ChatML: no BOS written). The prompt
of LLM.chat must equal the tokenizer's apply_chat_template (generation prompt, tokenized): BOS
exactly once, at position 0, and ending with the assistant header; the server's
usage.prompt_tokens must equal that length."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bundled_llm import _pin_threads, bundled_llm, greedy  # noqa: E402
from server_utils import RemoteServer, tiny_model_dir  # noqa: E402

BOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who are you?"}]
BOS = 1


def _template_ids(tok, messages=MESSAGES) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


@pytest.fixture(scope="module")
def bos_folder(tmp_path_factory) -> Path:
    """The tiny random Llama of the server tests with a BOS-adding tokenizer and a BOS template."""
    import shutil

    from transformers import AutoTokenizer

    src = tiny_model_dir()
    folder = tmp_path_factory.mktemp("bos-template-llama")
    for f in src.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer") and f.name != "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_bos_token = True
    tok.chat_template = BOS_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def bos_llm(bos_folder):
    from pagedllm import LLM

    _pin_threads()
    llm = LLM(str(bos_folder), dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512)
    yield llm
    llm.shutdown()


def test_bos_template_gets_exactly_one_bos(bos_llm):
    tok = bos_llm.get_tokenizer()
    # preconditions: the failure path is live — the tokenizer adds BOS by default, the template
    # writes it too, so a naive encode of the rendered text starts with two BOS ids
    assert tok.encode("a")[0] == BOS
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(tok.bos_token)
    assert tok.encode(rendered)[:2] == [BOS, BOS]
    expected = _template_ids(tok)
    assert expected[0] == BOS and expected.count(BOS) == 1
    out = bos_llm.chat(MESSAGES, greedy(2), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected
    assert out.prompt_token_ids.count(BOS) == 1 and out.prompt_token_ids[0] == BOS
    assert tok.decode(out.prompt_token_ids).endswith("<end_of_turn>\n<start_of_turn>model\n")
    # the offline generate path with the rendered text as a TextPrompt: BOS is not doubled either
    # when the caller tokenizes without special tokens (vLLM PR #27517's situation)
    gen = bos_llm.generate({"prompt_token_ids": tok.encode(rendered, add_special_tokens=False)}, greedy(1),
                           use_tqdm=False)[0]
    assert gen.prompt_token_ids == expected


def test_chatml_template_gets_no_added_bos():
    llm = bundled_llm()
    tok = llm.get_tokenizer()
    expected = _template_ids(tok)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert not rendered.startswith(tok.bos_token * 2)
    out = llm.chat(MESSAGES, greedy(1), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected
    # ChatML's <|im_start|> (this tokenizer's bos_token) appears once per message + the
    # generation prompt, exactly as the template wrote it: nothing added
    assert out.prompt_token_ids.count(BOS) == rendered.count("<|im_start|>") == 3
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert out.prompt == rendered  # the rendered conversation, as vLLM's LLM.chat reports it


def test_server_counts_the_same_prompt(bos_folder, bos_llm):
    server = RemoteServer(str(bos_folder), ["--dtype", "float32", "--max-model-len", "512",
                                            "--kv-cache-memory-bytes", "32MiB", "--served-model-name", "bos"])
    try:
        expected = _template_ids(bos_llm.get_tokenizer())
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "bos", "messages": MESSAGES, "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        tok = httpx.post(server.url + "/tokenize", json={"model": "bos", "messages": MESSAGES}, timeout=30).json()
        assert tok["tokens"] == expected
        # and offline / online agree (vLLM PR #55288)
        assert bos_llm.chat(MESSAGES, greedy(1), use_tqdm=False)[0].prompt_token_ids == tok["tokens"]
    finally:
        server.stop()
