"""Incremental detokenization with stop strings, for one output sequence.

Text is produced with the prefix-window method of TGI / vLLM (vLLM PR #984,
"Use TGI-like incremental detokenization"): the new text of a step is
``decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])``, where the window
starts at the tokens of the last emitted piece. Decoding a window instead of single tokens
keeps tokenizer-specific spacing (SentencePiece's leading "▁", byte-level BPE) right, and a
window whose text ends in U+FFFD (an incomplete multi-byte UTF-8 character) is held back until
the character completes. When the sequence finishes, whatever is held back is flushed, so that

    output_text == tokenizer.decode(token_ids, skip_special_tokens=...)

(with the final EOS / stop token's own text left out unless include_stop_str_in_output, and the
text cut at a matched stop string) — except after a prompt that ends inside a UTF-8 character,
whose output text starts with that whole character (``prompt_token_ids``).

Stop strings are searched in the text added by each step plus the len(stop)-1 characters
before it, so a stop string is found anywhere, also across token boundaries and inside a
token (vLLM #3572). Before min_tokens output tokens no stop string ends the sequence. For
streaming, ``get_next_output_text`` holds back the longest suffix of the text that could be
the start of a stop string, so a client never sees text that is later cut.

A request that reports only its final output and has no stop strings (``defer_text``; the
offline ``LLM.generate`` path) needs no text before it finishes: its tokens are only collected
and decoded once, with the same flush, when the sequence finishes. That is the text the
incremental path promises to equal, at one decode per sequence instead of two per token (the
host's largest cost per decode step after the model at a batch of 256).
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagedllm.sampling_params import SamplingParams

#: Prompt tokens kept in front of the output when the prompt ends inside a UTF-8 character (a
#: character has at most 4 bytes; a byte-level token holds at least one)
_MAX_CHAR_TOKENS = 4


def _decoder_for(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """A ``decode(ids) -> str`` equal to ``tokenizer.decode(ids, skip_special_tokens=...)``.

    Uses the Rust backend of a fast tokenizer directly (the same call transformers makes)
    when no post-processing (clean_up_tokenization_spaces) is configured.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "is_fast", False) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        decode = backend.decode

        def fast(ids: Sequence[int]) -> str:
            return decode(ids, skip_special_tokens=skip_special_tokens)

        return fast
    kwargs = {"skip_special_tokens": skip_special_tokens}
    if not getattr(tokenizer, "is_fast", True):
        kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens

    def slow(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), **kwargs)

    return slow


def byte_fallback_token_ids(tokenizer) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens ("<0xNN>") when the decoder has ByteFallback.

    Hugging Face's ByteFallback decoder turns a run of such tokens into text jointly (an invalid
    run becomes one U+FFFD per token, even for bytes that are valid ASCII on their own), so the
    text of a run is only final once a non-byte token follows it. Empty for other tokenizers.
    Cached on the tokenizer object.
    """
    cached = getattr(tokenizer, "_pagedllm_byte_fallback_ids", None)
    if cached is not None:
        return cached
    ids: frozenset[int] = frozenset()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteFallback" in str(backend.decoder):
        vocab = tokenizer.get_vocab()
        ids = frozenset(
            i for tok, i in vocab.items() if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">")
        )
    try:
        tokenizer._pagedllm_byte_fallback_ids = ids
    except AttributeError:
        pass
    return ids


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops (special added tokens), cached."""
    cached = getattr(tokenizer, "_pagedllm_special_ids", None)
    if cached is not None:
        return cached
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    out = frozenset(ids)
    try:
        tokenizer._pagedllm_special_ids = out
    except AttributeError:
        pass
    return out


def find_stop_string(text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool):
    """Find the earliest stop string that ends within the last ``new_char_count`` characters.

    Returns None, or (stop_str, truncate_to): the text must be cut to ``text[:truncate_to]``
    (before the stop string, or after it when include_in_output).
    """
    best: Optional[tuple[int, str]] = None
    for s in stop:
        start = max(0, len(text) - new_char_count - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return s, (i + len(s) if include_in_output else i)


def partial_stop_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class IncrementalDetokenizer:
    """Text of one output sequence, built token by token.

    tokenizer: a transformers tokenizer (fast or slow). params: the request's SamplingParams
    (skip_special_tokens, spaces_between_special_tokens, stop, include_stop_str_in_output,
    min_tokens are used). defer_text: decode only when the sequence finishes (see the module
    doc); ValueError with stop strings, which need the text of every step.

    Per engine step, for the tokens the engine appended to this sequence::

        stop_str = detok.update(new_token_ids, stop_terminated, finished)
        # stop_terminated: the last new token is an EOS / stop_token_ids token (the engine
        #   finished the sequence with "stop"); its text is left out unless
        #   include_stop_str_in_output.
        # finished: the sequence ends with this step ("length" or "stop"): held-back bytes are
        #   flushed.
        # stop_str (not None): a stop string matched; output_text is already cut; the caller
        #   finishes the sequence (core.finish_sequence(seq_id, stop_str), finish_reason "stop",
        #   stop_reason stop_str, also overriding a "length" finish of the same step) and stops
        #   calling update.
        delta = detok.get_next_output_text(finished, delta=True)   # for streaming

    Attributes: token_ids (all output ids), output_text (the text so far, never broken UTF-8
    except at a flush), stop_reason (the matched stop string or None).
    """

    def __init__(self, tokenizer, params: SamplingParams, defer_text: bool = False,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop: list[str] = list(params.stop or [])
        if defer_text and self.stop:
            raise ValueError(f"defer_text needs a request without stop strings, got stop={self.stop!r}")
        self.defer_text = defer_text
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._decode = _decoder_for(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        self._byte_tokens = byte_fallback_token_ids(tokenizer)
        self._skipped = special_token_ids(tokenizer) if params.skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        self.output_text = ""
        # A prompt that ends inside a UTF-8 character (its last bytes start a character the output
        # completes): the prompt's last tokens stay in front of the window, so that the output text
        # starts with that whole character, cleanly after the prompt's complete characters (decoding
        # the output alone would start with U+FFFD; vLLM's window over the prompt drops it).
        carry = self._incomplete_tail([int(t) for t in prompt_token_ids[-2 * _MAX_CHAR_TOKENS:]])
        self._carry_len = len(carry)
        self._carry_text = self._decode(carry).rstrip("\ufffd") if carry else ""  # its complete characters
        self._decoded_ids: list[int] = list(carry)  # carry + token_ids minus a left-out final stop token
        self.prefix_offset = 0
        self.read_offset = len(carry)
        self.stop_reason: Optional[str] = None
        self._sent = 0  # characters already handed out by get_next_output_text(delta=True)
        self._hold_partial_stops = bool(self.stop) and not self.include_stop_str_in_output
        self.num_held_back_utf8 = 0  # steps at which an incomplete character was held back

    # ------------------------------------------------------------------ decoding
    def _decode_next(self) -> None:
        """Advance output_text over _decoded_ids[read_offset:], holding back an incomplete char."""
        ids = self._decoded_ids
        if self._byte_tokens:
            last = len(ids) - 1
            while last > self.read_offset and ids[last] in self._skipped:
                last -= 1  # skipped special tokens do not end a byte run
            if ids[last] in self._byte_tokens:
                self.num_held_back_utf8 += 1
                return
        prefix_text = self._prefix_text(ids)
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.output_text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
        elif new_text.endswith("\ufffd"):
            self.num_held_back_utf8 += 1

    def _incomplete_tail(self, tail: list[int]) -> list[int]:
        """The fewest last prompt tokens (at most _MAX_CHAR_TOKENS) after which the rest of `tail`
        decodes without a trailing incomplete character; [] when the prompt ends on a character
        boundary. (Byte-fallback decoders turn a whole run of byte tokens into U+FFFDs when the run
        is not valid UTF-8, so the run must be cut where the incomplete character starts.)"""
        if not tail or not self._decode(tail).endswith("\ufffd"):
            return []
        for j in range(1, min(_MAX_CHAR_TOKENS, len(tail)) + 1):
            if not self._decode(tail[:-j]).endswith("\ufffd"):
                return tail[-j:]
        return tail[-_MAX_CHAR_TOKENS:]

    def _prefix_text(self, ids: list[int]) -> str:
        """The window's text before read_offset; while the window still starts with the carried
        prompt tokens, only their complete characters (the incomplete one belongs to the output)."""
        if self._carry_len and self.prefix_offset == 0 and self.read_offset == self._carry_len:
            return self._carry_text
        return self._decode(ids[self.prefix_offset : self.read_offset])

    def _flush(self) -> None:
        """Emit held-back text (a trailing incomplete character decodes to U+FFFD, as decode does)."""
        ids = self._decoded_ids
        if self.read_offset < len(ids):
            prefix_text = self._prefix_text(ids)
            new_text = self._decode(ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text):
                self.output_text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(ids)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False, finished: bool = False) -> Optional[str]:
        """Add the tokens of one step; returns the matched stop string or None (see class doc)."""
        if self.stop_reason is not None:
            raise RuntimeError("update() after a stop string matched: the sequence is finished")
        new_token_ids = [int(t) for t in new_token_ids]
        if not new_token_ids:
            if finished:
                self._flush()
            return None
        self.token_ids.extend(new_token_ids)
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        check_from = len(self.output_text)
        if self.defer_text:  # the flush below decodes them all at once
            self._decoded_ids.extend(to_decode)
        else:
            for t in to_decode:
                self._decoded_ids.append(t)
                self._decode_next()
        if finished:
            self._flush()
        if self.stop and len(self.token_ids) > self.min_tokens:
            found = find_stop_string(
                self.output_text, len(self.output_text) - check_from, self.stop, self.include_stop_str_in_output
            )
            if found is not None:
                self.stop_reason, cut = found
                self.output_text = self.output_text[:cut]
                return self.stop_reason
        return None

    # ------------------------------------------------------------------ streaming
    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now: all of it (delta=False) or what is new since the last delta call.

        Unless finished (or a stop string matched), the longest suffix that could start a stop
        string is held back. The pieces returned with delta=True concatenate to output_text.
        """
        text = self.output_text
        end = len(text)
        if self._hold_partial_stops and not finished and self.stop_reason is None:
            end -= partial_stop_suffix(text, self.stop)
        if not delta:
            return text[:end]
        if end <= self._sent:
            return ""
        piece = text[self._sent : end]
        self._sent = end
        return piece


__all__ = ["IncrementalDetokenizer", "find_stop_string", "partial_stop_suffix"]
