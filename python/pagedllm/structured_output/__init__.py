"""Structured output (vLLM's ``StructuredOutputsParams``): output constrained to a JSON schema, any
JSON object, a regex, one of several strings, or an EBNF grammar, through xgrammar (Dong et al.
2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models";
vLLM's, SGLang's and TensorRT-LLM's grammar engine).

``StructuredOutputManager(tokenizer, vocab_size)`` compiles a request's constraint once (cached by
its kind and text; an invalid one is a ValueError naming the field) and gives each sequence its
own ``xgrammar.GrammarMatcher``. The Sampler (sample/sampler.py) fills a token bitmask from each
constrained sequence's matcher before sampling, so that only tokens the grammar can continue
with keep their logits (EOS only where the grammar may end), and advances the matcher with each
token the engine appends.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputManager", "StructuredOutputsParams"]


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
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[tuple[str, str], Any] = {}

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params (cached). ValueError naming the field when invalid."""
        kind, text = params.key()
        key = (kind, text)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(kind, text)
            self._compiled[key] = compiled
        return compiled

    def matcher(self, params: StructuredOutputsParams):
        """A fresh GrammarMatcher for one sequence constrained by params."""
        return self._xgr.GrammarMatcher(self.compile(params))

    def _compile(self, kind: str, text: str):
        c = self._compiler
        kind, compact = kind.removesuffix("-compact"), kind.endswith("-compact")
        try:
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=not compact)
            if kind == "json_object":
                if compact:
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                choices = json.loads(text)
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices))
            return c.compile_grammar(text)
        except Exception as exc:  # xgrammar's parse / compile errors
            raise ValueError(f"structured_outputs.{kind}: cannot compile it: {exc}") from None
