"""Random weights with real shapes (``LLM(..., load_format="dummy")``), as vLLM's dummy loader.

For benchmarks on a config-only folder (config.json alone): the weights are drawn directly on
the model's device (no CPU copy, no checkpoint), so an 8B model is ready in seconds on a GPU.
Speed does not depend on the values; outputs are meaningless.

- ``init_dummy_weights(model, seed)``: every matrix and embedding ~ N(0, std^2) (std 0.02, HF's
  ``initializer_range`` default), norm weights 1, biases 0; deterministic for a seed.
- ``synthetic_tokenizer(vocab_size)``: a word-level fast tokenizer whose token i is the text
  ``"<i>"`` (words separated by spaces), for folders that ship no tokenizer files.
"""

from __future__ import annotations

import torch
from torch import nn

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill `model`'s parameters in place on their device (see the module docstring)."""
    devices = {p.device for p in model.parameters()}
    gens = {d: torch.Generator(device=d) for d in devices}
    for i, g in enumerate(gens.values()):
        g.manual_seed(int(seed) + i)
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            param.normal_(0.0, std, generator=gens[param.device])
        elif name.endswith("bias"):
            param.zero_()
        else:  # RMSNorm weights
            param.fill_(1.0)


def synthetic_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` over ``vocab_size`` tokens ``"<0>" .. "<V-1>"`` (word level,
    whitespace pre-tokenizer; decode joins with spaces). No special tokens, no EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(int(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
