"""UniprocExecutor: one ModelRunner in this process (tensor_parallel_size 1)."""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.executor.abstract import Executor, ExecutorConfig
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput


class UniprocExecutor(Executor):
    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.driver_runner = ModelRunner(config.model_path, config.model_config, device=config.device,
                                         **config.runner_kwargs())

    def execute_model(self, sched, greedy_vocab: int = 0,
                      prev_sampled: Optional[torch.Tensor] = None) -> ModelRunnerOutput:
        return self.driver_runner.execute_model(sched, greedy_vocab=greedy_vocab, prev_sampled=prev_sampled)

    def shutdown(self) -> None:
        if self.driver_runner is not None:
            self.driver_runner.shutdown()
            self.driver_runner = None
