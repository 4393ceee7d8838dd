"""Prompt forms accepted by ``LLM.generate`` (vLLM's names)."""

from __future__ import annotations

from typing import Union

try:  # Python >= 3.11
    from typing import NotRequired, TypedDict
except ImportError:  # Python 3.10: typing_extensions comes with transformers' dependencies
    from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt given as text: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids: ``{"prompt_token_ids": [int, ...]}`` (no tokenization).

    prompt: optional text of the same prompt, echoed back in RequestOutput.prompt.
    """

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]

__all__ = ["TextPrompt", "TokensPrompt", "PromptType"]
