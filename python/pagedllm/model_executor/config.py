"""Model configuration: the parts of a Hugging Face ``config.json`` that pagedllm's model code uses.

`ModelConfig.from_hf_config` reads a transformers config (dict or ``PretrainedConfig``) of one of the
supported decoder-only architectures and normalises version differences, notably RoPE settings:
transformers < 5 writes ``rope_theta`` / ``rope_scaling`` at the top level, transformers 5 writes
``rope_parameters`` (with ``rope_theta`` inside). Both are read; a missing theta falls back to the
architecture's documented default (10,000) only when neither place has one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

#: architecture name (config.json "architectures") -> (qkv bias, q/k RMSNorm) of that family.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclasses.dataclass
class RopeConfig:
    """Rotary position embedding settings (Su et al. 2021, "RoFormer", section 3.4).

    rope_type: "default", "linear" (position interpolation, Chen et al. 2023) or "llama3"
    (Meta's Llama 3.1 frequency-dependent scaling); factor and the llama3 fields as in HF configs.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "RopeConfig":
        params = cfg.get("rope_parameters")
        scaling = cfg.get("rope_scaling")
        # transformers 5 may nest per-layer-type parameters ({"full_attention": {...}}).
        if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
            params = params.get("full_attention") or next(iter(params.values()))
        merged: dict[str, Any] = {}
        if isinstance(scaling, dict):
            merged.update(scaling)
        if isinstance(params, dict):
            merged.update(params)
        theta = merged.get("rope_theta", cfg.get("rope_theta"))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"unsupported RoPE type {rope_type!r}: pagedllm supports 'default', 'linear' and 'llama3'"
            )
        return cls(
            theta=float(theta) if theta is not None else 10000.0,
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0) or 1.0),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=merged.get("original_max_position_embeddings"),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0)) or 1.0),
        )


@dataclasses.dataclass
class ModelConfig:
    """Shapes and options of a decoder-only transformer (Llama family).

    All sizes are element counts; ``dtype`` is the checkpoint's dtype (``torch_dtype``/``dtype``
    in config.json, None when absent).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    mlp_bias: bool = False
    sliding_windows: tuple[int, ...] = ()  # per layer, 0 = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    hidden_act: str = "silu"
    #: config.json's quantization_config.quant_method (a quantized checkpoint), None for 16/32-bit
    quantization: str | None = None
    #: config.json's whole quantization_config (None for 16/32-bit)
    quantization_config: dict | None = None

    @classmethod
    def from_hf_config(cls, hf: Any) -> "ModelConfig":
        """Build from a config dict or a transformers PretrainedConfig. Raises ValueError for an
        unsupported architecture (naming the supported list) or inconsistent head shapes."""
        cfg = hf if isinstance(hf, dict) else hf.to_dict()
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}: pagedllm supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias_default, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ValueError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}: pagedllm's MLP is SwiGLU ('silu')")
        n_layers = int(cfg["num_hidden_layers"])
        attention_bias = bool(cfg.get("attention_bias", qkv_bias_default))
        if arch == "Qwen2ForCausalLM":
            attention_bias = True  # Qwen2 always has q/k/v biases (no config key)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else ((int(eos),) if eos is not None else ())
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
        dtype = _DTYPES.get(str(dtype_name).replace("torch.", "")) if dtype_name else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(arch, cfg, n_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
            hidden_act=act,
            quantization=(cfg.get("quantization_config") or {}).get("quant_method"),
            quantization_config=dict(cfg["quantization_config"]) if cfg.get("quantization_config") else None,
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ModelConfig":
        """Read ``folder/config.json``."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {folder}")
        return cls.from_hf_config(json.loads(path.read_text()))


def _sliding_windows(arch: str, cfg: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    """Per-layer sliding-window sizes (0 = full attention), as transformers applies them."""
    window = cfg.get("sliding_window")
    if not window:
        return (0,) * n_layers
    window = int(window)
    if arch == "MistralForCausalLM":
        return (window,) * n_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return (0,) * n_layers
        layer_types = cfg.get("layer_types")
        if layer_types:
            return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        max_window_layers = int(cfg.get("max_window_layers", n_layers))
        return tuple(window if i >= max_window_layers else 0 for i in range(n_layers))
    return (0,) * n_layers


def resolve_dtype(dtype: str | torch.dtype | None, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute/cache dtype: "auto" takes the checkpoint's (float32 when unknown); fp16 on CPU
    becomes bf16 for "auto" and is refused when asked for. Raises ValueError naming the bad value."""
    if dtype is None or dtype == "auto":
        chosen = config_dtype or torch.float32
        if chosen == torch.float16 and device.type == "cpu":
            chosen = torch.bfloat16
        return chosen
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    else:
        if str(dtype) not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16' (CUDA)")
        chosen = _DTYPES[str(dtype)]
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {chosen}: use float32, bfloat16 or float16 (CUDA)")
    if chosen == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 is not supported on CPU: use 'float32' or 'bfloat16'")
    return chosen
