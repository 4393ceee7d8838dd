"""Chat prompts -> token ids, shared by ``LLM.chat`` and the server's /v1/chat/completions, so both
paths give the same prompt (vLLM PR #55288: offline and online chat tokenized differently).

The chat template is rendered to text by ``transformers`` (``apply_chat_template``) and tokenized
*without* the tokenizer's default special tokens: a template that writes BOS itself gets exactly
one BOS (vLLM PRs #16976, #27517: doubled BOS); a tokenizer that starts every sequence with BOS
gets it added once when the template did not write it.
"""

from __future__ import annotations

import json
from typing import Any, Optional


def chat_prompt_token_ids(
    tokenizer,
    conversation: list[dict],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
    tools: Optional[list[dict]] = None,
) -> list[int]:
    """Token ids of `conversation` (list of {"role", "content", ...}) rendered by the tokenizer's
    chat template (or `chat_template`, a Jinja string), with `tools` (OpenAI's tool objects) for
    templates that describe them. Errors: ValueError when the tokenizer has no chat template or the
    template rejects the conversation."""
    conversation = _arguments_as_objects(conversation)
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
    except ValueError:
        raise
    except Exception as exc:  # jinja2 TemplateError, KeyError... -> a client error
        raise ValueError(f"the chat template failed on these messages: {exc}") from None
    if not isinstance(text, str):
        raise ValueError("the chat template did not render to text")
    ids = list(tokenizer.encode(text, add_special_tokens=False))  # the template writes BOS itself (or not)
    bos = tokenizer.bos_token_id
    if bos is not None:
        adds_bos = tokenizer.encode("a")[:1] == [bos]  # does this tokenizer start sequences with BOS?
        if adds_bos and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        while len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids.pop(0)
    return ids


def _arguments_as_objects(conversation: list[dict]) -> list[dict]:
    """Assistant messages' tool_calls with their function arguments as objects: OpenAI's messages
    carry them as JSON text, chat templates (Hermes, Qwen, Llama 3.1) expect objects, as vLLM
    hands them over. ValueError naming the message when the text is not JSON."""
    out = []
    for i, m in enumerate(conversation):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for k, call in enumerate(calls):
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        raise ValueError(f"messages[{i}].tool_calls[{k}].function.arguments is not JSON: "
                                         f"{fn['arguments'][:80]!r}") from None
                fixed.append({**call, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


__all__ = ["chat_prompt_token_ids"]
