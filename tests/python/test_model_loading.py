"""Model resolution (bundled GGUF, folders, hub cache misses) and config parsing (RoPE keys of
transformers 4 and 5, supported architectures)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.model_executor.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig, resolve_dtype
from pagedllm.model_executor.loader import DEFAULT_MODEL, resolve_model
from pagedllm.model_executor.layers.rotary_embedding import inverse_frequencies

BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=100)


def test_rope_theta_from_old_top_level_key():
    cfg = ModelConfig.from_hf_config({**BASE, "rope_theta": 500000.0})
    assert cfg.rope.theta == 500000.0 and cfg.rope.rope_type == "default"


def test_rope_theta_from_transformers5_rope_parameters():
    cfg = ModelConfig.from_hf_config({**BASE, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert cfg.rope.theta == 100000.0


def test_llama3_scaling_from_old_rope_scaling_and_new_keys_agree():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = ModelConfig.from_hf_config({**BASE, "rope_theta": 500000.0, "rope_scaling": scaling}).rope
    new = ModelConfig.from_hf_config({**BASE, "rope_parameters": {**scaling, "rope_theta": 500000.0}}).rope
    assert old == new and old.rope_type == "llama3" and old.factor == 8.0 and old.theta == 500000.0


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
])
def test_inverse_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=131072,
                         rope_parameters=dict(rope))
    ours = inverse_frequencies(RopeConfig.from_hf(hf_cfg.to_dict()), 128)
    if rope["rope_type"] == "default":
        ref = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        ref, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
        assert scale == 1.0
    assert torch.equal(ours, ref)


def test_unsupported_architecture_names_the_supported_list():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_architecture_flags():
    assert ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    q3 = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128})
    assert q3.qk_norm and q3.head_dim == 128 and not q3.attention_bias
    m = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert m.sliding_windows == (4096, 4096)
    q2 = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                     "use_sliding_window": False})
    assert q2.sliding_windows == (0, 0)


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", None, cpu) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, cpu) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", None, cpu)
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", None, cpu)


def test_missing_path_and_hub_miss_are_clear(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(empty))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as err:
        resolve_model("some-org/some-model-that-is-not-cached")
    assert "some-org/some-model-that-is-not-cached" in str(err.value)
    assert str(tmp_path / "hub") in str(err.value)


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert resolve_model(str(tmp_path)) == tmp_path


def test_bundled_model_resolves_to_a_converted_folder():
    """None and the hub id both give the bundled SmolLM2-135M-Instruct (models.md's facts)."""
    folder = resolve_model(None)
    assert resolve_model(DEFAULT_MODEL) == folder
    cfg = ModelConfig.from_pretrained(folder)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers) == ("LlamaForCausalLM", 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope.theta == 100000.0 and cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").is_file()


def test_gguf_cache_key_follows_content_not_place(tmp_path):
    """The conversion cache key of a GGUF file: the same bytes at another path with another mtime
    share one conversion; a change in its first or last MiB, or in its size, is a new key."""
    import os
    import random

    from pagedllm.model_executor.loader import gguf_cache_key

    data = bytearray(random.Random(0).randbytes(3 << 20))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    os.utime(b, (1_000_000, 1_000_000))
    assert gguf_cache_key(a) == gguf_cache_key(b)
    for where in (10, len(data) - 10):
        changed = bytearray(data)
        changed[where] ^= 1
        b.write_bytes(changed)
        assert gguf_cache_key(b) != gguf_cache_key(a), where
    b.write_bytes(data + b"x")
    assert gguf_cache_key(b) != gguf_cache_key(a)
    small = tmp_path / "small.gguf"  # shorter than the span read from each end
    small.write_bytes(b"GGUF" + bytes(100))
    assert len(gguf_cache_key(small)) == 16


def test_stale_conversion_folders_are_removed(tmp_path):
    """A killed conversion leaves <name>.tmp-* behind: removed once older than an hour; a recent one
    (maybe another process converting right now) and finished entries are kept."""
    import os
    import time

    from pagedllm.model_executor.loader import _remove_stale_conversions

    old, fresh, done = tmp_path / "m-abc.tmp-111", tmp_path / "m-abc.tmp-222", tmp_path / "m-abc"
    for d in (old, fresh, done):
        d.mkdir()
        (d / "config.json").write_text("{}")
    past = time.time() - 2 * 3600
    os.utime(old, (past, past))
    os.utime(done, (past, past))
    _remove_stale_conversions(tmp_path)
    assert not old.exists() and fresh.is_dir() and done.is_dir()
