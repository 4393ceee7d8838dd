"""reshape_and_cache, copy_blocks, swap_blocks, kv_cache_shape / allocate_kv_cache.

Caches start NaN-filled so a write to a wrong slot, or a missing write, shows; expected caches are
computed with plain torch indexing on CPU copies. CUDA cases carry the `cuda` marker.
"""

from __future__ import annotations

import pytest
import torch

import pagedllm.ops as ops
from kernel_reference import DEVICE_DTYPES, DEVICES

torch.set_num_threads(2)


def nan_cache(num_blocks, num_kv_heads, block_size, head_size, dtype):
    return torch.full((num_blocks, num_kv_heads, block_size, head_size), float("nan"), dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN == NaN (a copy must be exact)."""
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.bfloat16 else a.view(torch.int16),
                                               b.view(torch.uint8) if b.dtype != torch.bfloat16 else b.view(torch.int16))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_exactly_the_mapped_slots(device, dtype, head_size, block_size, gen):
    num_blocks, hkv, T = 7, 3, 40
    key = torch.randn(T, hkv, head_size, generator=gen).to(dtype)
    value = torch.randn(T, hkv, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(torch.int64)
    slots[torch.randperm(T, generator=gen)[:5]] = -1  # padding tokens are skipped
    kc, vc = nan_cache(num_blocks, hkv, block_size, head_size, dtype), None
    vc = kc.clone()
    expected_k, expected_v = kc.clone(), vc.clone()
    keep = slots >= 0
    s = slots[keep]
    expected_k[s // block_size, :, s % block_size, :] = key[keep]
    expected_v[s // block_size, :, s % block_size, :] = value[keep]
    kc_d, vc_d = kc.to(device), vc.to(device)
    ops.reshape_and_cache(key.to(device), value.to(device), kc_d, vc_d, slots.to(device))
    assert same_bits(kc_d, expected_k)
    assert same_bits(vc_d, expected_v)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_empty_is_a_noop(device):
    kc, vc = ops.allocate_kv_cache(2, 16, 2, 64, torch.float32, device)
    ops.reshape_and_cache(torch.empty(0, 2, 64, device=device), torch.empty(0, 2, 64, device=device),
                          kc, vc, torch.empty(0, dtype=torch.int64, device=device))
    assert not kc.any() and not vc.any()


def test_reshape_and_cache_errors_name_values_and_leave_cache_untouched():
    kc = nan_cache(2, 2, 16, 64, torch.float32)
    vc = kc.clone()
    key = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 32 is out of range.*32 slots"):
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 5, 32]))
    assert torch.isnan(kc).all() and torch.isnan(vc).all()  # nothing written
    with pytest.raises(ValueError, match="slot_mapping must be int64, got int32"):
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="key dimension 1.*must be 2, got 3"):
        ops.reshape_and_cache(torch.randn(3, 3, 64), torch.randn(3, 3, 64), kc, vc, torch.arange(3))
    with pytest.raises(ValueError, match="key must be float32, got bfloat16"):
        ops.reshape_and_cache(key.bfloat16(), key.bfloat16(), kc, vc, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping dimension 0.*must be 3, got 2"):
        ops.reshape_and_cache(key, key, kc, vc, torch.arange(2))
    with pytest.raises(ValueError, match="float16 is not supported on cpu.*float32, bfloat16"):
        ops.reshape_and_cache(key.half(), key.half(), kc.half(), vc.half(), torch.arange(3))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_copy_blocks_copies_every_layer(device, dtype, gen):
    layers, num_blocks = 3, 10
    shape = (num_blocks, 2, 16, 64)
    kcs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    vcs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    mapping = torch.tensor([[0, 5], [3, 7], [3, 8], [9, 1]], dtype=torch.int64)
    exp_k, exp_v = [k.clone() for k in kcs], [v.clone() for v in vcs]
    for src, dst in mapping.tolist():
        for e in exp_k + exp_v:
            e[dst] = e[src]
    kd, vd = [k.to(device) for k in kcs], [v.to(device) for v in vcs]
    ops.copy_blocks(kd, vd, mapping.to(device))
    for got, exp in zip(kd + vd, exp_k + exp_v):
        assert same_bits(got, exp)


def test_copy_blocks_errors():
    kc = [torch.zeros(4, 2, 16, 64)]
    vc = [torch.zeros(4, 2, 16, 64)]
    with pytest.raises(ValueError, match=r"block_mapping\[1\]\[1\] \(dst block\) = 4 is out of range \[0, 4\)"):
        ops.copy_blocks(kc, vc, torch.tensor([[0, 1], [2, 4]]))
    with pytest.raises(ValueError, match="2 key caches but 1 value caches"):
        ops.copy_blocks(kc * 2, vc, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="block_mapping must be int64, got int32"):
        ops.copy_blocks(kc, vc, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_mapping dimension 1.*must be 2, got 3"):
        ops.copy_blocks(kc, vc, torch.tensor([[0, 1, 2]]))
    ops.copy_blocks(kc, vc, torch.empty(0, 2, dtype=torch.int64))  # no copies: no-op


@pytest.mark.parametrize("src_device,dst_device", [
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cpu", "cuda", id="cpu-cuda", marks=pytest.mark.cuda),
    pytest.param("cuda", "cpu", id="cuda-cpu", marks=pytest.mark.cuda),
    pytest.param("cuda", "cuda", id="cuda-cuda", marks=pytest.mark.cuda),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_blocks_between_devices(src_device, dst_device, dtype, gen):
    src = torch.randn(6, 2, 16, 64, generator=gen).to(dtype)
    dst = torch.full((9, 2, 16, 64), float("nan"), dtype=dtype)
    mapping = torch.tensor([[0, 8], [5, 0], [2, 3]], dtype=torch.int64)
    expected = dst.clone()
    for s, d in mapping.tolist():
        expected[d] = src[s]
    src_d = src.pin_memory() if src_device == "cpu" and dst_device == "cuda" else src.to(src_device)
    dst_d = dst.to(dst_device)
    ops.swap_blocks(src_d, dst_d, mapping)
    if "cuda" in (src_device, dst_device):
        torch.cuda.synchronize()
    assert same_bits(dst_d, expected)


def test_swap_blocks_errors():
    src = torch.zeros(4, 2, 16, 64)
    with pytest.raises(ValueError, match=r"block_mapping\[0\]\[0\] \(src block\) = 4 is out of range \[0, 4\)"):
        ops.swap_blocks(src, torch.zeros(8, 2, 16, 64), torch.tensor([[4, 0]]))
    with pytest.raises(ValueError, match="src dtype float32 differs from dst dtype bfloat16"):
        ops.swap_blocks(src, torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="dimensions 1-3 must match"):
        ops.swap_blocks(src, torch.zeros(4, 2, 32, 64), torch.tensor([[0, 0]]))


def test_kv_cache_shape_and_allocate():
    assert ops.kv_cache_shape(5, 16, 3, 64) == (5, 3, 16, 64)
    assert ops.SUPPORTED_BLOCK_SIZES == (16, 32)
    assert ops.SUPPORTED_HEAD_SIZES == (32, 64, 80, 96, 128, 256)
    k, v = ops.allocate_kv_cache(5, 32, 3, 128, torch.bfloat16, "cpu")
    assert k.shape == v.shape == (5, 3, 32, 128) and k.dtype == torch.bfloat16
    assert k.is_contiguous() and not k.any() and k.data_ptr() != v.data_ptr()
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        ops.kv_cache_shape(0, 16, 3, 64)
    with pytest.raises(ValueError, match="block size 8 is not supported; supported block sizes: 16, 32"):
        ops.allocate_kv_cache(4, 8, 3, 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_argument_errors_raise_after_cuda_init():
    """Bad arguments on CUDA tensors raise ValueError naming the value, numbers included. On the
    H200 image, messages formatted through an ostringstream crashed the process (segfault) once
    PyTorch had initialised CUDA; pagedllm::detail::concat no longer uses iostreams."""
    k = torch.randn(3, 2, 64, device="cuda")
    kc = torch.zeros(4, 2, 16, 64, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"slot_mapping must be int64, got int32 \(\[3\] int32 cuda:0\)"):
        ops.reshape_and_cache(k, k, kc, kc.clone(), torch.zeros(3, dtype=torch.int32, device="cuda"))
    k3 = torch.randn(3, 3, 64, device="cuda")
    with pytest.raises(ValueError, match=r"key dimension 1 \(num_kv_heads, must match key_cache\) must be 2, got 3 "
                                         r"\(key is \[3, 3, 64\] float32 cuda:0\)"):
        ops.reshape_and_cache(k3, k3, kc, kc.clone(), torch.zeros(3, dtype=torch.int64, device="cuda"))
    ops.reshape_and_cache(k, k, kc, kc.clone(), torch.arange(3, device="cuda"))  # still serving
    torch.cuda.synchronize()
    assert torch.equal(kc[0, :, :3], k.transpose(0, 1))
