"""Model execution per engine step (the model runner)."""

from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput

__all__ = ["ModelRunner", "ModelRunnerOutput"]
