"""Structured output (vLLM's ``StructuredOutputsParams``): output constrained to a JSON schema, any
JSON object, a regex, one of several strings, or an EBNF grammar, through xgrammar (Dong et al.
2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models";
vLLM's, SGLang's and TensorRT-LLM's grammar engine).

``StructuredOutputManager(tokenizer, vocab_size)`` turns a request's constraint into a grammar
when the request is added (parsing only, well under a millisecond; an invalid schema, regex or
grammar is a ValueError naming the field, nothing queued) and compiles it against the tokenizer
on a background thread (tens of milliseconds for a schema; xgrammar releases the GIL), so the
step loop goes on meanwhile: the engine holds the request back until its grammar is compiled
(LLMEngine.add_request). Compiled grammars are cached by kind and text (the most recent
``CACHE_SIZE``). Each sequence gets its own ``xgrammar.GrammarMatcher``; the Sampler
(sample/sampler.py) fills a token bitmask from each constrained sequence's matcher before
sampling, so that only tokens the grammar can continue with keep their logits (EOS only where the
grammar may end), and advances the matcher with each token the engine appends.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from pagedllm.sampling_params import StructuredOutputsParams

__all__ = ["GrammarError", "StructuredOutputManager", "StructuredOutputsParams", "grammar_of"]

#: compiled grammars kept per tokenizer (the least recently used go first)
CACHE_SIZE = 256


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[10:40:14] /project/cpp/x.cc:4944: ")."""
    return re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", str(exc)).strip()


class GrammarError(ValueError):
    """A constraint xgrammar cannot parse; the message names the field, ``reason`` is xgrammar's
    own (without its log prefix)."""

    def __init__(self, kind: str, reason: str):
        self.reason = reason
        super().__init__(f"structured_outputs.{kind}: cannot compile it: {reason}")


def grammar_of(params: StructuredOutputsParams):
    """xgrammar's Grammar of a constraint: parsing only, no tokenizer (well under a millisecond).
    GrammarError (a ValueError naming the field) when it does not parse."""
    import xgrammar as xgr

    kind, text = params.key()
    G = xgr.Grammar
    kind, compact = kind.removesuffix("-compact"), kind.endswith("-compact")
    try:
        if kind == "json":
            return G.from_json_schema(text, any_whitespace=not compact)
        if kind == "json_object":  # an object (OpenAI's JSON mode), not any JSON value
            return G.from_json_schema('{"type": "object"}', any_whitespace=not compact)
        if kind == "regex":
            return G.from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            return G.from_ebnf("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices))
        return G.from_ebnf(text)
    except Exception as exc:  # xgrammar's parse errors
        raise GrammarError(kind, clean_error(exc)) from None


class StructuredOutputManager:
    """Compiled grammars of one tokenizer (xgrammar's TokenizerInfo / GrammarCompiler)."""

    def __init__(self, tokenizer, vocab_size: int):
        try:
            import xgrammar as xgr
        except ImportError as exc:  # a dependency: a broken install
            raise ValueError(f"structured_outputs needs the xgrammar package ({exc}); pip install xgrammar") from None
        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        # our own cache (bounded, of futures); xgrammar's would keep every grammar ever compiled
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) // 2)),
                                        thread_name_prefix="pagedllm-grammar")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of params as a Future (cached; compiled on a background thread).
        Errors: ValueError naming the field, raised here, when the constraint does not parse."""
        key = params.key()
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        grammar = grammar_of(params)
        future = self._pool.submit(self._compiler.compile_grammar, grammar)
        self._compiled[key] = future
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params, waiting for it. ValueError naming the field when invalid."""
        return self.submit(params).result()

    def matcher(self, params: StructuredOutputsParams, compiled=None):
        """A fresh GrammarMatcher for one sequence constrained by params (of `compiled`, its
        compiled grammar, when the caller holds it)."""
        return self._xgr.GrammarMatcher(compiled if compiled is not None else self.compile(params))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
