"""The Python engine loop around the native EngineCore (LLMEngine)."""

from pagedllm.engine.llm_engine import EngineArgs, LLMEngine

__all__ = ["EngineArgs", "LLMEngine"]
