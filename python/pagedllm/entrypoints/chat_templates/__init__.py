"""Chat templates shipped with pagedllm, and ``--chat-template`` / ``LLM.chat(chat_template=)``
values resolved to template text.

``hermes_tools``: ChatML (the bundled SmolLM2's own format, with its default system prompt)
extended for tools the way Hermes 2 Pro and Qwen2.5 describe them: the tools' JSON schemas in
``<tools></tools>`` in the system turn, calls written as ``<tool_call>{"name", "arguments"}</tool_call>``
(read back by ``--tool-call-parser hermes``), tool results as ``<tool_response>`` blocks in a user
turn.
"""

from __future__ import annotations

import os
from importlib import resources

BUNDLED = ("hermes_tools",)


def load_chat_template(value: str) -> str:
    """Template text of `value`: a bundled template's name, a file path, or the template itself
    (text with Jinja tags). ValueError naming the value otherwise."""
    if value in BUNDLED:
        return resources.files(__name__).joinpath(f"{value}.jinja").read_text(encoding="utf-8")
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a bundled template ({', '.join(BUNDLED)}), a file, "
                     "nor Jinja text")


__all__ = ["BUNDLED", "load_chat_template"]
