// cuda/quant_gemv.cu — fp8_gemv and int4_dequantize (pagedllm/quant_ops.h).
//
// fp8_gemv: one warp per output row, 8 warps per block. Each lane takes 16-byte chunks of the
// row (16 e4m3 weights), four chunks per iteration with all four loads issued first (streamed:
// not kept in L1; L2 fetches 256-byte blocks), converts pairs with the hardware's e4m3x2 -> f16x2
// conversion, and for each of the M (<= 8) activation rows FMAs them with the matching 16
// activations (read through L1: every warp of the block reads the same x) into a float32 sum. A
// warp reduction gives the row's dot products; lane t writes out[t, row] = sum * scale + bias.
//
// int4_dequantize: each thread expands 8 bytes (16 weights of one row, inside one group) into
// 16 bfloat16: (q - 8) * scale + zero in float32 (product and sum each rounded, as PyTorch's), then
// rounded to bfloat16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <stdexcept>

#include "layer_ops_common.cuh"
#include "pagedllm/quant_ops.h"
#include "pdl.cuh"
#include "quant_ops_cuda.h"

namespace pagedllm::cuda {
namespace {

using namespace layer_ops;

constexpr int kWarps = 8;
constexpr int kChunks = 4;  // 16-byte chunks per lane per iteration

/// 16 e4m3 weights (a uint4) -> 16 floats.
__device__ __forceinline__ void e4m3x16_to_float(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[i] & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[i] >> 16), __NV_E4M3);
    const float2 a = __half22float2(__half2(lo));
    const float2 b = __half22float2(__half2(hi));
    f[4 * i] = a.x;
    f[4 * i + 1] = a.y;
    f[4 * i + 2] = b.x;
    f[4 * i + 3] = b.y;
  }
}

/// 16 activations at p (16-byte aligned) -> 16 floats.
template <typename T>
__device__ __forceinline__ void act16_to_float(const T* p, float* f) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const uint4 b = *reinterpret_cast<const uint4*>(p + 8);
  const T* ta = reinterpret_cast<const T*>(&a);
  const T* tb = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = to_float(ta[i]);
    f[8 + i] = to_float(tb[i]);
  }
}

template <typename T, int M>
__global__ void __launch_bounds__(kWarps * 32) fp8_gemv_kernel(T* __restrict__ out, int64_t ldo,
                                                               const T* __restrict__ x, int64_t ldx,
                                                               const uint8_t* __restrict__ w,
                                                               const float* __restrict__ scale,
                                                               const T* __restrict__ bias, int n_rows, int k) {
  detail::pdl_launch_dependents();
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  detail::pdl_wait();
  if (row >= n_rows) return;
  const uint8_t* wr = w + static_cast<int64_t>(row) * k;
  const int chunks = k / 16;
  float acc[M];
#pragma unroll
  for (int t = 0; t < M; ++t) acc[t] = 0.f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kChunks) {
    uint4 wv[kChunks];
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int c = c0 + 32 * u;
      wv[u] = c < chunks ? ld_weight16(wr + 16 * c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float wf[16];
      e4m3x16_to_float(wv[u], wf);
#pragma unroll
      for (int t = 0; t < M; ++t) {
        float xf[16];
        act16_to_float(x + t * ldx + 16 * c, xf);
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[t] = fmaf(wf[i], xf[i], acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < M; ++t)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
  if (lane < M) {
    float v = acc[0];
#pragma unroll
    for (int t = 1; t < M; ++t)
      if (lane == t) v = acc[t];
    v *= scale[row];
    if (bias != nullptr) v += to_float(bias[row]);
    out[lane * ldo + row] = from_float<T>(v);
  }
}

template <typename T, int M>
void launch_fp8(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& scale,
                const TensorView* bias, cudaStream_t stream) {
  const int n = static_cast<int>(weight.size(0));
  const dim3 grid(static_cast<unsigned>((n + kWarps - 1) / kWarps));
  detail::launch_dependent(fp8_gemv_kernel<T, M>, grid, dim3(kWarps * 32), 0, stream, out.ptr<T>(), out.stride(0),
                           static_cast<const T*>(x.ptr<T>()), x.stride(0), weight.ptr<const uint8_t>(),
                           scale.ptr<const float>(), bias ? static_cast<const T*>(bias->ptr<T>()) : nullptr, n,
                           static_cast<int>(weight.size(1)));
}

template <typename T>
void dispatch_fp8(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& scale,
                  const TensorView* bias, cudaStream_t stream) {
  switch (x.size(0)) {
    case 1: return launch_fp8<T, 1>(out, x, weight, scale, bias, stream);
    case 2: return launch_fp8<T, 2>(out, x, weight, scale, bias, stream);
    case 3: return launch_fp8<T, 3>(out, x, weight, scale, bias, stream);
    case 4: return launch_fp8<T, 4>(out, x, weight, scale, bias, stream);
    case 5: return launch_fp8<T, 5>(out, x, weight, scale, bias, stream);
    case 6: return launch_fp8<T, 6>(out, x, weight, scale, bias, stream);
    case 7: return launch_fp8<T, 7>(out, x, weight, scale, bias, stream);
    default: return launch_fp8<T, 8>(out, x, weight, scale, bias, stream);
  }
}

__global__ void int4_dequantize_kernel(__nv_bfloat16* __restrict__ out, const uint8_t* __restrict__ nibbles,
                                       const __nv_bfloat16* __restrict__ scale_zero, int64_t n_rows, int k,
                                       int group) {
  detail::pdl_launch_dependents();
  detail::pdl_wait();
  const int per_row = k / 16;  // 16-weight pieces per row
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_rows * per_row) return;
  const int64_t row = i / per_row;
  const int k0 = static_cast<int>(i % per_row) * 16;
  const uint2 packed = *reinterpret_cast<const uint2*>(nibbles + row * (k / 2) + k0 / 2);
  const int64_t sz = (static_cast<int64_t>(k0 / group) * n_rows + row) * 2;
  const float s = __bfloat162float(scale_zero[sz]);
  const float z = __bfloat162float(scale_zero[sz + 1]);
  const uint32_t words[2] = {packed.x, packed.y};
  __align__(16) __nv_bfloat16 y[16];
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const uint32_t byte = (words[b / 4] >> (8 * (b % 4))) & 0xffu;
    // a product then a sum, each rounded (no FMA): the bits of PyTorch's (q - 8) * scale + zero
    y[2 * b] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(static_cast<float>(static_cast<int>(byte >> 4) - 8), s), z));
    y[2 * b + 1] =
        __float2bfloat16_rn(__fadd_rn(__fmul_rn(static_cast<float>(static_cast<int>(byte & 0xfu) - 8), s), z));
  }
  uint4* dst = reinterpret_cast<uint4*>(out + row * k + k0);
  dst[0] = *reinterpret_cast<const uint4*>(y);
  dst[1] = *reinterpret_cast<const uint4*>(y + 8);
}

}  // namespace

void fp8_gemv(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& scale,
              const TensorView* bias, std::uintptr_t stream) {
  layer_ops::DeviceGuard guard(x.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (x.dtype == DType::kBFloat16)
    dispatch_fp8<__nv_bfloat16>(out, x, weight, scale, bias, s);
  else
    dispatch_fp8<__half>(out, x, weight, scale, bias, s);
}

void int4_dequantize(const TensorView& out, const TensorView& nibbles, const TensorView& scale_zero,
                     int64_t group_size, std::uintptr_t stream) {
  layer_ops::DeviceGuard guard(nibbles.device_index);
  const int64_t n = nibbles.size(0);
  const int k = static_cast<int>(out.size(1));
  const int64_t pieces = n * (k / 16);
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>((pieces + kThreads - 1) / kThreads));
  detail::launch_dependent(int4_dequantize_kernel, grid, dim3(kThreads), 0, reinterpret_cast<cudaStream_t>(stream),
                           out.ptr<__nv_bfloat16>(), nibbles.ptr<const uint8_t>(),
                           static_cast<const __nv_bfloat16*>(scale_zero.ptr<__nv_bfloat16>()), n, k,
                           static_cast<int>(group_size));
}

}  // namespace pagedllm::cuda
