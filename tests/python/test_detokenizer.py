"""IncrementalDetokenizer against tokenizer.decode: random token streams, multi-byte UTF-8 split
across tokens, stop strings across token boundaries and inside tokens, partial-stop hold-back,
include_stop_str_in_output, min_tokens, stop tokens and skip_special_tokens."""

import random

import pytest

from _tokenizers import smollm2_tokenizer, spm_tokenizer
from pagedllm.detokenizer import IncrementalDetokenizer, find_stop_string, partial_stop_suffix
from pagedllm.sampling_params import SamplingParams

TOKENIZERS = {"smollm2": smollm2_tokenizer, "spm": spm_tokenizer}

TEXTS = [
    "A 世ab 😀 café ďábel",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1,  2))",
    "Repeat exactly: a    b  c\t\td. Then stop.",
    "猫はかわいいです。小猫很可爱。 done 🎉❤️👍🚀🇯🇵",
]


def stream(tok, ids, params=None, stop_terminated=False):
    """Feed ids one per step like the engine loop; returns (detokenizer, deltas, matched stop)."""
    params = params or SamplingParams()
    d = IncrementalDetokenizer(tok, params)
    deltas = []
    matched = None
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        matched = d.update([t], stop_terminated and last, finished=last)
        finished = last or matched is not None
        deltas.append(d.get_next_output_text(finished, delta=True))
        assert d.get_next_output_text(finished, delta=False).startswith("".join(deltas))
        if matched is not None:
            break
    return d, deltas, matched


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_random_token_streams_equal_decode(name, skip):
    tok = TOKENIZERS[name]()
    rng = random.Random(1234 + skip)
    special = sorted(set(tok.all_special_ids))
    held = 0
    with_fffd = 0
    for trial in range(60):
        n = rng.randint(1, 80)
        ids = [rng.randrange(len(tok)) if rng.random() > 0.05 else rng.choice(special) for _ in range(n)]
        params = SamplingParams(skip_special_tokens=skip)
        d, deltas, _ = stream(tok, ids, params)
        want = tok.decode(ids, skip_special_tokens=skip)
        assert d.output_text == want, (ids, d.output_text, want)
        assert "".join(deltas) == want
        assert d.token_ids == ids
        held += d.num_held_back_utf8
        with_fffd += "\ufffd" in want
    assert held > 0, "no stream held back an incomplete character: the UTF-8 path never ran"
    assert with_fffd > 0  # random byte tokens leave broken UTF-8 that decode shows as U+FFFD


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_multibyte_characters_split_across_tokens(name):
    tok = TOKENIZERS[name]()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        d, deltas, _ = stream(tok, ids)
        assert d.output_text == tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == d.output_text
        assert all("\ufffd" not in x for x in deltas), deltas  # never a broken character mid-stream
        if any(ord(c) > 0x7FF for c in text):
            # some token alone is an incomplete character: the split path ran and held it back
            assert any("\ufffd" in tok.decode([i]) for i in ids)
            assert d.num_held_back_utf8 > 0


def test_spm_leading_space_kept_between_tokens():
    tok = spm_tokenizer()
    ids = tok.encode("a    b c", add_special_tokens=False)
    d, deltas, _ = stream(tok, ids)
    assert d.output_text == tok.decode(ids) == "a    b c"
    assert any(tok.decode([i]) != tok.convert_ids_to_tokens(i).replace("▁", " ") for i in ids)  # stripping ran


def test_special_tokens_rendered_as_decode_does():
    tok = smollm2_tokenizer()
    ids = tok.encode("Hi there", add_special_tokens=False) + [2, 1] + tok.encode(" next", add_special_tokens=False)
    for skip in (True, False):
        d, _, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|><|im_start|>" in d.output_text


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_deferred_text_equals_incremental(name):
    """defer_text (FINAL_ONLY without stop strings): the tokens are collected and decoded once at
    the finish; the text equals the incremental path's and decode's, with special and byte
    tokens, both skip settings, a final stop token left out or kept, and 1 to 80 tokens a step."""
    tok = TOKENIZERS[name]()
    rng = random.Random(99)
    special = sorted(set(tok.all_special_ids))
    for trial in range(60):
        n = rng.randint(1, 80)
        ids = [rng.randrange(len(tok)) if rng.random() > 0.05 else rng.choice(special) for _ in range(n)]
        skip, stop_terminated, include = rng.random() < 0.5, rng.random() < 0.3, rng.random() < 0.5
        params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
        inc, _, _ = stream(tok, ids, params, stop_terminated=stop_terminated)
        d = IncrementalDetokenizer(tok, params, defer_text=True)
        i = 0
        while i < n:  # steps of several tokens, as with speculative or multi-token steps
            step = ids[i:i + rng.randint(1, 5)]
            i += len(step)
            last = i == n
            assert d.update(step, stop_terminated and last, finished=last) is None
            if not last:
                assert d.output_text == ""  # nothing decoded before the finish
        assert d.token_ids == ids
        assert d.output_text == inc.output_text, (ids, d.output_text, inc.output_text)
        want_ids = ids[:-1] if stop_terminated and not include else ids
        assert d.output_text == tok.decode(want_ids, skip_special_tokens=skip)
        assert d.get_next_output_text(True, delta=False) == d.output_text


def test_deferred_text_refuses_stop_strings():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(smollm2_tokenizer(), SamplingParams(stop=["x"]), defer_text=True)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_left_out(include):
    """C11(d): stopping on an EOS / stop_token_ids token: text is decode(ids) minus that token's
    own text (unless include_stop_str_in_output), both skip_special_tokens settings."""
    tok = smollm2_tokenizer()
    body = tok.encode("The answer is 42.", add_special_tokens=False)
    plain_stop = tok.encode(" Done", add_special_tokens=False)[0]  # a normal-text stop token id
    for stop_id in (2, plain_stop):
        for skip in (True, False):
            ids = body + [stop_id]
            params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include, stop_token_ids=[stop_id])
            d, deltas, _ = stream(tok, ids, params, stop_terminated=True)
            want = tok.decode(ids if include else body, skip_special_tokens=skip)
            assert d.output_text == want
            assert "".join(deltas) == want
            assert d.token_ids == ids  # the stop token id is still returned


def _stop_cases(tok, text):
    """Stop strings that start inside a token, span a token boundary, or are a whole token."""
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    bounds = [len(p) for p in pieces]
    cases = []
    for i in range(1, len(ids) - 1):
        start, end = bounds[i - 1], bounds[i]
        piece = text[start:end]
        if len(piece.strip()) >= 3:
            cases.append(("inside", text[start + 1 : start + 3]))  # the first letters after the 1st char
            cases.append(("span", text[end - 2 : end + 2]))  # crosses into the next token
    return ids, cases


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_anywhere(include):
    tok = smollm2_tokenizer()
    text = "The alphabet with no spaces: ABCDEFGHIJKLMNOPQRSTUVWXYZ and then some words follow here."
    ids, cases = _stop_cases(tok, text)
    full = tok.decode(ids)
    assert full == text
    kinds = set()
    for kind, stop in cases:
        if stop not in full:
            continue
        d, deltas, matched = stream(tok, ids, SamplingParams(stop=[stop, "ZZZZ"], include_stop_str_in_output=include))
        i = full.find(stop)
        want = full[: i + len(stop)] if include else full[:i]
        assert matched == stop and d.stop_reason == stop
        assert d.output_text == want, (stop, d.output_text)
        assert "".join(deltas) == want
        if include:
            assert d.output_text.endswith(stop)
        # the stop string was found although it does not end at a token boundary
        kinds.add(kind)
    assert kinds == {"inside", "span"}


def test_stop_string_inside_single_token_alphabet():
    """C07: "DE" inside a token like "DEF" stops the sequence."""
    tok = smollm2_tokenizer()
    ids = tok.encode("ABC DEFGHIJ", add_special_tokens=False)
    tokens = [tok.decode([i]) for i in ids]
    holder = next(t for t in tokens if "DE" in t)
    assert holder.strip() != "DE"  # the stop string ends inside the token
    d, _, matched = stream(tok, ids, SamplingParams(stop="DE"))
    assert matched == "DE" and d.output_text == "ABC "


def test_earliest_of_several_stop_strings_wins():
    tok = smollm2_tokenizer()
    ids = tok.encode("one two three four", add_special_tokens=False)
    d, _, matched = stream(tok, ids, SamplingParams(stop=["four", "two", "three"]))
    assert matched == "two" and d.output_text == "one "


def test_partial_stop_string_held_back_while_streaming():
    tok = smollm2_tokenizer()
    ids = tok.encode("Hello world, wonderful world!", add_special_tokens=False)
    params = SamplingParams(stop=["world!"])
    d = IncrementalDetokenizer(tok, params)
    seen = ""
    held_once = False
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        matched = d.update([t], finished=last)
        seen += d.get_next_output_text(last or matched is not None, delta=True)
        assert d.output_text.startswith(seen)
        tail = d.output_text[len(seen):]
        if tail and matched is None:
            assert "world!".startswith(tail) or any("world!".startswith(tail[j:]) for j in range(len(tail)))
            held_once = True
        if matched:
            break
    assert held_once
    assert matched == "world!" and seen == d.output_text == "Hello world, wonderful "


def test_min_tokens_defers_stop_strings():
    """C14: a stop string inside the first min_tokens tokens does not end the sequence; after
    min_tokens, stop strings work again."""
    tok = smollm2_tokenizer()
    ids = tok.encode("path/\nmore\ntext\nend", add_special_tokens=False)
    first_nl = next(i for i in range(len(ids)) if "\n" in tok.decode(ids[: i + 1]))
    min_tokens = first_nl + 1  # the first "\n" arrives within min_tokens
    d, _, matched = stream(tok, ids, SamplingParams(stop="\n", min_tokens=min_tokens, max_tokens=100))
    assert matched == "\n"
    assert d.output_text == "path/\nmore"
    assert len(d.token_ids) > min_tokens
    d2, _, matched2 = stream(tok, ids, SamplingParams(stop="\n"))
    assert matched2 == "\n" and d2.output_text == "path/"


def test_non_delta_output_and_update_after_stop():
    tok = smollm2_tokenizer()
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, SamplingParams(stop="STOP"))
    for t in ids:
        if d.update([t]):
            break
    assert d.get_next_output_text(True, delta=False) == "abc "
    with pytest.raises(RuntimeError):
        d.update([ids[-1]])


def test_helpers():
    assert find_stop_string("abcXYdef", 3, ["XY"], False) is None  # ended before the new text
    assert find_stop_string("abcXYdef", 4, ["XY"], False) == ("XY", 3)
    assert find_stop_string("abcXYdef", 4, ["XY"], True) == ("XY", 5)
    assert partial_stop_suffix("hello wo", ["world", "x"]) == 2
    assert partial_stop_suffix("hello world", ["world"]) == 0  # a full match is not partial
    assert partial_stop_suffix("aaa", ["aab"]) == 2


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=80, deadline=None)
@given(
    text_index=st.integers(0, len(TEXTS) - 1),
    start=st.integers(0, 60),
    length=st.integers(1, 6),
    include=st.booleans(),
    tokenizer=st.sampled_from(sorted(TOKENIZERS)),
)
def test_stop_string_property(text_index, start, length, include, tokenizer):
    """For any substring used as the stop string: text == full text cut at its first occurrence,
    and every streamed piece was a prefix of the final text (nothing later retracted)."""
    tok = TOKENIZERS[tokenizer]()
    text = TEXTS[text_index] + " and " + TEXTS[(text_index + 1) % len(TEXTS)]
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    start = min(start, len(full) - 1)
    stop = full[start : start + length]
    d, deltas, matched = stream(tok, ids, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    i = full.find(stop)
    assert matched == stop and d.stop_reason == stop
    assert d.output_text == (full[: i + len(stop)] if include else full[:i])
    assert "".join(deltas) == d.output_text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("defer", [False, True], ids=["incremental", "deferred"])
def test_prompt_ending_inside_a_character_gives_output_starting_with_that_character(name, defer):
    """A prompt whose last token(s) hold the first bytes of a multi-byte character and an output
    that completes it: the output text starts with the whole character (not U+FFFD, not dropped),
    cleanly after the prompt's complete characters; a prompt that ends on a character boundary
    changes nothing."""
    tok = TOKENIZERS[name]()
    for text, cut in (("hello é world", "hello é".encode()[:-1]), ("日本語です", "日本".encode()[:-2])):
        whole = tok.encode(text, add_special_tokens=False)
        # the prompt: the tokens of the text's bytes up to inside a character, one token per byte
        # after the last whole character (byte-level / byte-fallback tokens)
        prompt, out = _split_inside_char(tok, text, cut)
        if prompt is None:
            pytest.skip(f"{name} has no byte tokens for {text!r}")
        params = SamplingParams(max_tokens=64)
        d = IncrementalDetokenizer(tok, params, defer_text=defer, prompt_token_ids=prompt)
        deltas = []
        for i, t in enumerate(out):
            d.update([t], finished=i == len(out) - 1)
            deltas.append(d.get_next_output_text(i == len(out) - 1, delta=True))
        # the text of prompt + output after the prompt's whole characters (its tokens before the
        # character's first bytes)
        head = tok.decode(prompt[: len(prompt) - (len(cut) - len(cut.decode("utf-8", errors="ignore").encode()))])
        expected = tok.decode(prompt + out)[len(head):]
        assert expected.startswith(text[len(cut.decode("utf-8", errors="ignore")):][:1])  # the split character
        assert d.output_text == expected, (name, text, d.output_text)
        assert "\ufffd" not in d.output_text and "".join(deltas) == expected
        assert whole  # (the text itself tokenizes)
        plain = IncrementalDetokenizer(tok, params, defer_text=defer, prompt_token_ids=tok.encode("hello"))
        plain.update(out[-2:], finished=True)
        assert plain.output_text == tok.decode(out[-2:])


def _split_inside_char(tok, text: str, cut: bytes):
    """(prompt ids, output ids): text's bytes as tokens, split after `cut` (inside a character);
    the bytes around the split as single-byte tokens. None where the tokenizer has no such tokens."""
    data = text.encode()
    start = len(cut.decode("utf-8", errors="ignore").encode())  # the last whole character's end
    end = start + len(data[start:].decode("utf-8", errors="ignore")[:1].encode())  # the split character
    byte_ids = []
    for b in data[start:end]:
        ids = _byte_token(tok, b)
        if ids is None:
            return None, None
        byte_ids.append(ids)
    k = len(cut) - start
    prompt = tok.encode(data[:start].decode(), add_special_tokens=False) + byte_ids[:k]
    out = byte_ids[k:] + tok.encode(data[end:].decode(), add_special_tokens=False)
    return prompt, out


def _byte_token(tok, b: int):
    from pagedllm.entrypoints.openai.serving import _bytes_to_unicode

    for piece in (_bytes_to_unicode()[b], f"<0x{b:02X}>"):
        tid = tok.convert_tokens_to_ids(piece)
        if isinstance(tid, int) and tid != tok.unk_token_id and tok.convert_ids_to_tokens(tid) == piece:
            return tid
    return None
