"""Where the members of a JSON object that is still being generated begin and end.

Tool-call parsers stream a call's arguments while the model writes them: they need the text span
of each top-level member's value of an object that may be cut anywhere (``{"name": "f",
"arguments": {"city": "Par``). ``scan_object`` finds those spans without parsing the values, so
that a value's text so far is a prefix of its final text (what streaming sends as argument deltas).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

_WS = " \t\n\r"


@dataclass
class Member:
    """One top-level member: its key, and its value's text span [start, end) in the scanned text;
    end None: the value is not complete yet (start None: not begun)."""

    key: str
    start: Optional[int]
    end: Optional[int]


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def string_end(s: str, i: int) -> Optional[int]:
    """Index after the closing quote of the JSON string starting at s[i] == '"'; None: cut off."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(s: str, i: int) -> Optional[int]:
    """Index after the JSON value starting at s[i]; None: cut off (a number or literal that
    reaches the end of the text counts as cut off: more digits may follow)."""
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in _WS + ",}]":
        j += 1
    return j if j < len(s) else None


def scan_object(s: str, i: int) -> tuple[list[Member], Optional[int]]:
    """Members of the JSON object starting at s[i] == '{' and the index after its closing brace
    (None while it is cut off). ValueError when the text cannot be the start of an object."""
    if i >= len(s) or s[i] != "{":
        raise ValueError("not a JSON object")
    members: list[Member] = []
    i += 1
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            return members, None
        c = s[i]
        if c == "}":
            return members, i + 1
        if c == ",":
            i += 1
            continue
        if c != '"':
            raise ValueError(f"unexpected {c!r} in a JSON object")
        kend = string_end(s, i)
        if kend is None:
            return members, None
        key = json.loads(s[i:kend])
        i = skip_ws(s, kend)
        if i >= len(s):
            members.append(Member(key, None, None))
            return members, None
        if s[i] != ":":
            raise ValueError(f"expected ':' after the key {key!r}")
        i = skip_ws(s, i + 1)
        if i >= len(s):
            members.append(Member(key, None, None))
            return members, None
        end = value_end(s, i)
        members.append(Member(key, i, end))
        if end is None:
            return members, None
        i = end


def member(members: list[Member], *keys: str) -> Optional[Member]:
    """The first member named one of keys."""
    for m in members:
        if m.key in keys:
            return m
    return None


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (text that may still
    become the tag, held back from content)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
