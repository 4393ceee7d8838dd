"""Model implementations (one class covers the Llama family: Llama, Mistral, Qwen2, Qwen3)."""

from pagedllm.model_executor.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
