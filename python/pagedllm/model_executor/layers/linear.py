"""Linear layers of a tensor-parallel decoder (Megatron-LM's split: Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", section 3).

With tp ranks (a GroupCoordinator) and W [out, in]:

- ColumnParallelLinear: rank r holds rows [r * out / tp, (r + 1) * out / tp) of W (and of the
  bias); y_r = x W_r^T needs no communication, the next layer takes the split output.
- MergedColumnParallelLinear: several column-parallel outputs stacked in one matrix (a Llama MLP's
  [gate; up]); each part is split on its own, so rank r holds [gate_r; up_r].
- QKVParallelLinear: the fused q, k, v projection split by attention head. Query heads
  num_heads / tp per rank; key/value heads num_kv_heads / tp per rank, or, with fewer KV heads than
  ranks, one per rank, replicated over tp / num_kv_heads ranks (rank r holds KV head
  r // (tp / num_kv_heads), the one its query heads attend to).
- RowParallelLinear: rank r holds columns [r * in / tp, (r + 1) * in / tp); y = all_reduce(x_r W_r^T)
  plus the bias, added once (by rank 0, before the sum).
- ReplicatedLinear: every rank holds all of W.

Each layer computes through its ``quant_method`` (linear_method.py: UnquantizedLinearMethod for
16/32-bit weights, the CPU's packed methods, quantized formats), so the model file says which
layers exist and in what order, not how a product is computed. ``layer(x, **fusion)`` returns
this rank's output (all-reduced for RowParallelLinear); fusion keywords go to the method where
``fusions_apply(tokens)`` (on a RowParallelLinear only with tp == 1: a residual epilogue must see
the sum).

Loading: every parameter has a ``weight_loader(param, loaded, shard_id=None)`` that copies this
rank's slice of the checkpoint tensor ``loaded`` (a torch.Tensor or a lazily read
loader.CheckpointTensor, of which only the slice is read). ValueError names a shape mismatch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod, gemv_max_tokens

ShardId = Union[int, str, None]


def narrow(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[..., start:start + size, ...] along `dim` as a tensor (a CheckpointTensor reads only that)."""
    if loaded.shape[dim] == size and start == 0:
        return loaded if isinstance(loaded, torch.Tensor) else loaded.narrow(dim, 0, size)
    return loaded.narrow(dim, start, size)


def _materialize(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded.full()


def _check_shape(loaded, expected: Sequence[int], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    """param <- the whole checkpoint tensor (same shape: ValueError naming both otherwise): what a
    replicated parameter (a norm, a replicated linear layer, a row-parallel bias) loads."""
    _check_shape(loaded, param.shape, "the tensor")
    param.data.copy_(_materialize(loaded))


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's partition (see the module docstring)."""

    def __init__(self, input_size: int, output_size: int, input_size_per_partition: int,
                 output_size_per_partition: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 tp_group: Optional[GroupCoordinator] = None, quant_method: Optional[LinearMethodBase] = None):
        super().__init__()
        self.tp = tp_group if tp_group is not None else GroupCoordinator.single(device)
        self.input_size, self.output_size = int(input_size), int(output_size)
        self.input_size_per_partition = int(input_size_per_partition)
        self.output_size_per_partition = int(output_size_per_partition)
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod(
            gemv_max_tokens(device, dtype))
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_size_per_partition, bias,
                                         dtype, device)

    def apply_bias(self) -> Optional[torch.Tensor]:
        """The bias this rank adds (all of it but on RowParallelLinear's ranks > 0)."""
        return self.bias

    def fusions_apply(self, tokens: int) -> bool:
        """Whether forward() takes fusion keywords (ops.gemv's) for a step of `tokens` rows."""
        return self.quant_method.fusions_apply(self, tokens)

    def forward(self, x: torch.Tensor, **fusion) -> torch.Tensor:
        return self.quant_method.apply(self, x, **fusion)

    def set_quant_method(self, method: LinearMethodBase, **kwargs) -> None:
        """Compute through `method` from now on (after loading: it re-lays the weights out)."""
        self.quant_method = method
        method.process_weights_after_loading(self, **kwargs)

    @torch.inference_mode()
    def permute_rows(self, rows: torch.Tensor) -> None:
        """Output row i <- row rows[i] of weight and bias (int64 [output_size_per_partition])."""
        rows = rows.to(self.weight.device)
        for t in (self.weight, self.bias):
            if t is not None:
                t.copy_(t.index_select(0, rows))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}/{self.input_size}, out={self.output_size_per_partition}/"
                f"{self.output_size}, tp={self.tp.rank}/{self.tp.world_size}, "
                f"method={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 tp_group: Optional[GroupCoordinator] = None, quant_method: Optional[LinearMethodBase] = None):
        super().__init__(input_size, output_size, input_size, output_size, bias, dtype, device, tp_group, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 tp_group: Optional[GroupCoordinator] = None, quant_method: Optional[LinearMethodBase] = None):
        tp = tp_group.world_size if tp_group is not None else 1
        super().__init__(input_size, output_size, input_size, divide(output_size, tp, "output_size"), bias, dtype,
                         device, tp_group, quant_method)

    def _copy_rows(self, param: nn.Parameter, loaded, src_start: int, dst_start: int, size: int,
                   src_rows: int) -> None:
        """param[dst_start:dst_start + size] <- loaded[src_start:src_start + size] where the
        checkpoint tensor has src_rows rows (its other dimensions those of param)."""
        _check_shape(loaded, (src_rows, *param.shape[1:]), "the tensor")
        param.data.narrow(0, dst_start, size).copy_(narrow(loaded, 0, src_start, size))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        size = self.output_size_per_partition
        self._copy_rows(param, loaded, self.tp.rank * size, 0, size, self.output_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """output_sizes: the stacked parts (gate_up: [intermediate, intermediate]); shard_id = part index."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 device: torch.device, tp_group: Optional[GroupCoordinator] = None,
                 quant_method: Optional[LinearMethodBase] = None):
        tp = tp_group.world_size if tp_group is not None else 1
        self.output_sizes = [int(s) for s in output_sizes]
        for s in self.output_sizes:
            divide(s, tp, "output_size")
        super().__init__(input_size, sum(self.output_sizes), bias, dtype, device, tp_group, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        if shard_id is None:  # the whole stacked matrix
            raise ValueError(f"{type(self).__name__} loads its parts one by one (shard_id 0..{len(self.output_sizes) - 1})")
        tp = self.tp.world_size
        size = self.output_sizes[shard_id] // tp
        dst = sum(self.output_sizes[:shard_id]) // tp
        self._copy_rows(param, loaded, self.tp.rank * size, dst, size, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """The fused [q; k; v] projection of num_heads query and num_kv_heads key/value heads of
    head_dim features; shard_id "q", "k" or "v". num_heads must be divisible by tp, and
    num_kv_heads divisible by tp or tp by num_kv_heads (ValueError otherwise)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, device: torch.device, tp_group: Optional[GroupCoordinator] = None,
                 quant_method: Optional[LinearMethodBase] = None):
        tp = tp_group.world_size if tp_group is not None else 1
        self.head_dim = int(head_dim)
        self.total_num_heads, self.total_num_kv_heads = int(num_heads), int(num_kv_heads)
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = partition_heads(num_heads, num_kv_heads, tp)
        rank = tp_group.rank if tp_group is not None else 0
        #: the first KV head (of the checkpoint's) that this rank holds
        self.kv_head_start = (rank // self.num_kv_head_replicas) * self.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        total = (num_heads + 2 * num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, total, hidden_size, self.q_size + 2 * self.kv_size, bias, dtype,
                            device, tp_group, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        shard = {0: "q", 1: "k", 2: "v"}.get(shard_id, shard_id)
        d = self.head_dim
        if shard == "q":
            self._copy_rows(param, loaded, self.tp.rank * self.q_size, 0, self.q_size, self.total_num_heads * d)
        elif shard in ("k", "v"):
            dst = self.q_size + (0 if shard == "k" else self.kv_size)
            self._copy_rows(param, loaded, self.kv_head_start * d, dst, self.kv_size, self.total_num_kv_heads * d)
        else:
            raise ValueError(f"QKVParallelLinear: shard_id {shard_id!r} is not 'q', 'k' or 'v'")


def partition_heads(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int, int]:
    """(query heads per rank, KV heads per rank, ranks holding each KV head) for tp ranks; ValueError
    naming both numbers when tp does not divide num_heads, or neither of tp and num_kv_heads
    divides the other."""
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's num_attention_heads={num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads={num_kv_heads}: one must "
                         "divide the other (KV heads are split across ranks, or replicated when fewer than ranks)")
    if num_kv_heads >= tp:
        return num_heads // tp, num_kv_heads // tp, 1
    return num_heads // tp, 1, tp // num_kv_heads


class RowParallelLinear(LinearBase):
    """reduce_results: all-reduce the output (False: the caller sums the partial outputs)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 tp_group: Optional[GroupCoordinator] = None, quant_method: Optional[LinearMethodBase] = None,
                 reduce_results: bool = True):
        tp = tp_group.world_size if tp_group is not None else 1
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, divide(input_size, tp, "input_size"), output_size, bias, dtype,
                         device, tp_group, quant_method)

    def apply_bias(self) -> Optional[torch.Tensor]:
        return self.bias if self.tp.rank == 0 else None

    def fusions_apply(self, tokens: int) -> bool:
        return self.tp.world_size == 1 and super().fusions_apply(tokens)

    def forward(self, x: torch.Tensor, **fusion) -> torch.Tensor:
        y = self.quant_method.apply(self, x, **fusion)
        if self.reduce_results and self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        return y

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: ShardId = None) -> None:
        if param.dim() == 1:  # the bias: every rank holds all of it (rank 0 adds it)
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]  # this rank's columns (inputs; or input groups of a quantized weight's scales)
        _check_shape(loaded, (param.shape[0], size * self.tp.world_size), "the tensor")
        param.data.copy_(narrow(loaded, 1, self.tp.rank * size, size))
