"""Model execution: configuration, weight loading, model code and the model runner."""

from pagedllm.model_executor.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedllm.model_executor.loader import DEFAULT_MODEL, resolve_model

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "DEFAULT_MODEL", "resolve_model"]
