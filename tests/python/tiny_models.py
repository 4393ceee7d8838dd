"""Helpers for model tests: random tiny Hugging Face models of every supported architecture and a
harness that runs pagedllm's model over hand-built paged batches (no engine)."""

from __future__ import annotations

from pathlib import Path

import torch

# head_dim 64, hidden >= 256, as the model tests require; initializer_range large enough that the
# logits are far from uniform (so greedy argmax is well defined).
TINY_CONFIGS = {
    "llama": dict(
        cls="LlamaConfig", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "llama3": dict(
        cls="LlamaConfig", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=768,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
        max_position_embeddings=1024, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "mistral": dict(
        cls="MistralConfig", architectures=["MistralForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=1024,
        max_position_embeddings=512, rope_theta=10000.0, sliding_window=40, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        cls="Qwen2Config", architectures=["Qwen2ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
        max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        cls="Qwen3Config", architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
        max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
}


def build_tiny_model(name: str, folder: Path, seed: int = 0, dtype=torch.float32, **overrides):
    """Random HF model `name` of TINY_CONFIGS (fields replaced by `overrides`) saved (safetensors)
    to `folder`; returns the HF model."""
    import transformers

    spec = {**TINY_CONFIGS[name], **overrides}
    cls = getattr(transformers, spec.pop("cls"))
    config = cls(initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():  # RMSNorm weights of 1.0 hide weight-loading mistakes: randomise them
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(folder)
    return model


def build_tiny_engine_folder(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """build_tiny_model plus pagedllm's synthetic tokenizer of 1024 ids saved beside it: a folder
    the engine (LLM / LLMEngine) loads as it is. Returns `folder`."""
    from pagedllm.model_executor.dummy import synthetic_tokenizer

    build_tiny_model(name, folder, seed=seed, **overrides)
    synthetic_tokenizer(1024).save_pretrained(folder)
    return folder


def load_pagedllm(folder, dtype=torch.float32):
    """pagedllm's LlamaForCausalLM (on the CPU, in `dtype`) with the weights of the HF folder."""
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import load_safetensors
    from pagedllm.model_executor.models import LlamaForCausalLM

    model = LlamaForCausalLM(ModelConfig.from_pretrained(folder), dtype, torch.device("cpu"))
    model.load_weights(load_safetensors(folder))
    return model


class PagedHarness:
    """Runs a pagedllm LlamaForCausalLM over hand-built paged batches, on the model's device.

    Each sequence gets its own shuffled physical blocks (drawn on the CPU from `seed`); the KV
    caches (one per layer, num_seqs * ceil(max_len / block_size) + 3 blocks) are on model.device.
    `step(chunks)` runs one batch where chunks is a list of (seq index, token ids): each sequence's
    tokens continue where its previous chunk ended. The batch's input ids, positions, slot mapping,
    block tables, seq lens and query_start_loc are built on model.device; returns the float32
    logits of every token row ([tokens, vocab], on model.device)."""

    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 16, seed: int = 0):
        from pagedllm import ops

        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * self.blocks_per_seq + 3
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=g)[: num_seqs * self.blocks_per_seq]
        self.block_tables = perm.view(num_seqs, self.blocks_per_seq).to(torch.int32)
        kv_heads = model.num_kv_heads_per_rank  # this tensor-parallel rank's (all of them on one rank)
        self.kv_caches = [
            ops.allocate_kv_cache(num_blocks, block_size, kv_heads, cfg.head_dim, model.dtype, model.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.lens = [0] * num_seqs

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        from pagedllm.model_executor.layers.attention import AttentionMetadata

        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for s, toks in chunks:
            start = self.lens[s]
            for i, t in enumerate(toks):
                p = start + i
                ids.append(t)
                positions.append(p)
                slots.append(int(self.block_tables[s, p // self.block_size]) * self.block_size + p % self.block_size)
            self.lens[s] += len(toks)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(self.lens[s])
            tables.append(self.block_tables[s])
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.stack(tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            decode_only=all(len(t) == 1 for _, t in chunks),
        )
        T = len(ids)
        return self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                          torch.tensor(positions, dtype=torch.int64, device=dev),
                          self.kv_caches, meta, torch.arange(T, dtype=torch.int64, device=dev))
