"""The token embedding and the LM head split over the vocabulary (Megatron-LM: Shoeybi et al.
2019, section 3).

With tp ranks, each rank holds num_embeddings_per_partition = ceil(V / tp) rounded up to a
multiple of 64 rows (rows past the vocabulary are zero padding); rank r holds token ids
[r * per, r * per + per) ∩ [0, V). With tp == 1 the table is exactly [V, D] (no padding).

- VocabParallelEmbedding(ids): each rank looks up the ids it holds (others give zero rows), then
  an all-reduce sums the ranks' rows: every rank gets the full embedding.
- ParallelLMHead.compute_logits(hidden): each rank's float32 logits of its vocabulary rows,
  gathered along the vocabulary (all-gather) and cut to [R, V]. The product runs through the
  head's linear method (linear_method.py), as a linear layer's does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model_executor.layers.linear import _check_shape, narrow
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod, gemv_max_tokens

#: rows per rank are rounded up to a multiple of this when the vocabulary is split (vLLM's
#: DEFAULT_VOCAB_PADDING_SIZE)
VOCAB_PADDING = 64


def vocab_partition(vocab_size: int, tp: int) -> int:
    """Rows per rank of a vocabulary of vocab_size split over tp ranks (vocab_size itself for tp 1)."""
    if tp == 1:
        return vocab_size
    per = -(-vocab_size // tp)
    return -(-per // VOCAB_PADDING) * VOCAB_PADDING


class VocabParallelEmbedding(nn.Module):
    """ids int [T] -> [T, embedding_dim] in the model dtype (module docstring)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device,
                 tp_group: Optional[GroupCoordinator] = None, tied_to: Optional["VocabParallelEmbedding"] = None):
        super().__init__()
        self.tp = tp_group if tp_group is not None else GroupCoordinator.single(device)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.num_embeddings_per_partition = vocab_partition(self.num_embeddings, self.tp.world_size)
        # (with a small vocabulary the last ranks may hold padding only: start == end == V)
        self.vocab_start_index = min(self.num_embeddings, self.tp.rank * self.num_embeddings_per_partition)
        self.vocab_end_index = min(self.num_embeddings, self.vocab_start_index + self.num_embeddings_per_partition)
        if tied_to is not None:  # share the table (tie_word_embeddings): same partition on every rank
            self.weight = tied_to.weight
        else:
            weight = torch.empty((self.num_embeddings_per_partition, embedding_dim), dtype=dtype, device=device)
            self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.vocab_start_index) & (ids < self.vocab_end_index)
        local = (ids - self.vocab_start_index) * inside
        rows = F.embedding(local, self.weight)
        rows.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """This rank's vocabulary rows of the checkpoint's [V, D] table; padding rows zero."""
        _check_shape(loaded, (self.num_embeddings, self.embedding_dim), "the tensor")
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(narrow(loaded, 0, self.vocab_start_index, rows))
        param.data[rows:].zero_()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings_per_partition}/{self.num_embeddings}, {self.embedding_dim}, "
                f"tp={self.tp.rank}/{self.tp.world_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head: logits = hidden @ weight^T over this rank's vocabulary rows, gathered. With
    tied embeddings (tied_to=the embedding) it shares the embedding's weight. Computes through
    quant_method, as a LinearBase does (same interface: apply_bias, fusions_apply)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device,
                 tp_group: Optional[GroupCoordinator] = None, tied_to: Optional[VocabParallelEmbedding] = None,
                 quant_method: Optional[LinearMethodBase] = None):
        super().__init__(num_embeddings, embedding_dim, dtype, device, tp_group, tied_to)
        self.bias = None
        self.tied = tied_to is not None
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod(
            gemv_max_tokens(device, dtype))

    def apply_bias(self) -> None:
        return None

    def fusions_apply(self, tokens: int) -> bool:
        return self.quant_method.fusions_apply(self, tokens)

    def set_quant_method(self, method: LinearMethodBase, **kwargs) -> None:
        self.quant_method = method
        method.process_weights_after_loading(self, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits (compute_logits), not embeddings")

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None, **fusion) -> torch.Tensor:
        """hidden [R, D] (after the final norm, unless fusion has the norm) -> float32 logits [R, V]
        (written into `out` when given): each element the model-dtype product widened, as
        .float() of it."""
        rows = hidden.shape[0]
        local = out if self.tp.world_size == 1 else None
        if local is None and self.quant_method.writes_float32(self, rows):  # float32 in the same pass
            local = torch.empty((rows, self.num_embeddings_per_partition), dtype=torch.float32, device=hidden.device)
        if local is not None:
            local = self.quant_method.apply(self, hidden, out=local, **fusion)
        else:
            local = self.quant_method.apply(self, hidden, **fusion).float()
        if self.tp.world_size == 1:
            return local
        logits = self.tp.all_gather(local, dim=-1)[:, : self.num_embeddings]
        return logits.contiguous() if out is None else out.copy_(logits)
