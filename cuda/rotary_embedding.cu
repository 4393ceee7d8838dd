// cuda/rotary_embedding.cu — rotary position embeddings (GPT-NeoX "rotate half" layout), in
// place or fused with the paged KV-cache write (pagedllm/layer_ops.h).
//
// One CTA per token. Thread i of the CTA takes the pairs (x[j], x[j + r]) of head h
// (i = h * r + j) for every query head, then every key head; each pair is read and written by one
// thread, so the in-place form needs no barrier. Products are rounded to T before the add, as
// PyTorch's q * cos + rotate_half(q) * sin in dtype T (no fused multiply-add: __fmul_rn).
// Fused form: the rotated query goes to a contiguous query_out; the rotated key and the value
// go to row slot % block_size of block slot / block_size of the caches
// ([num_blocks, Hkv, block_size, D]); features beyond rotary_dim are copied unchanged. With
// paired_rows (fused form, full rotary) query and key are read in layer_ops.h's rotary_paired_row
// order — the output of a qkv projection whose weight rows were permuted for the GEMV's rope
// epilogue — and written in the standard order. An FP8 cache gets the rotated key and the value
// rounded to T as above, then quantized (fp8_kv.cuh).
#include <algorithm>

#include "fp8_kv.cuh"
#include "layer_ops_common.cuh"
#include "pagedllm/layer_ops.h"
#include "layer_ops_cuda.h"
#include "pdl.cuh"

namespace pagedllm::cuda {
namespace {

using namespace layer_ops;

struct RotaryParams {
  const int64_t* positions;
  void* query;            // [T, Hq, D], token stride query_stride
  void* key;              // [T, Hkv, D], token stride key_stride
  const void* value;      // fused form only; token stride value_stride
  const void* cos_cache;  // [max_positions, rot_half]
  const void* sin_cache;
  void* query_out;        // fused form: [T, Hq, D] contiguous; in place: nullptr
  void* key_cache;        // fused form: [num_blocks, Hkv, block_size, D]
  void* value_cache;
  const int64_t* slot_mapping;
  int64_t query_stride, key_stride, value_stride;
  int64_t num_slots;
  int num_heads, num_kv_heads, head_size, rot_half, block_size;
  int paired_rows;        // fused form: query and key in the rotary_paired_row order (rot_half * 2 == D)
  int kv_fp8;             // fused form: 0, or an FP8 cache (fp8_kv.cuh's kind) storing key / k_scale, value / v_scale
  const float* k_scale;   // nullptr: 1.0
  const float* v_scale;
};

/// Where rotate_heads writes: elements of T, or an FP8 cache's codes of value / scale.
template <typename T>
struct HeadStore {
  void* base;
  int kind;     // 0: T; else the FP8 kind
  float scale;  // FP8 only
  __device__ __forceinline__ void put(int64_t i, T v) const {
    if (kind == 0) static_cast<T*>(base)[i] = v;
    else static_cast<uint8_t*>(base)[i] = fp8::encode(to_float(v), scale, kind);
  }
};

/// Rotate num_heads heads of `src` (token row) into `dst`; dst may equal src. When copy_rest,
/// features [2 * rot_half, D) are copied from src to dst too. paired: src heads in the
/// rotary_paired_row order (then 2 * rot_half == D: nothing to copy), dst in the standard order.
template <typename T>
__device__ __forceinline__ void rotate_heads(const T* src, const HeadStore<T>& dst, int64_t dst_head_stride,
                                             const T* cos_row, const T* sin_row, int num_heads, int head_size,
                                             int rot_half, bool copy_rest, bool paired = false) {
  const int pairs = num_heads * rot_half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int h = i / rot_half, j = i % rot_half;
    const T* x = src + h * head_size;
    const int64_t y = h * dst_head_stride;
    const int j1 = paired ? rotary_paired_row(j, rot_half) : j;
    const int j2 = paired ? j1 + 8 : j + rot_half;
    T y1, y2;
    rotate_pair<T>(x[j1], x[j2], to_float(cos_row[j]), to_float(sin_row[j]), y1, y2);
    dst.put(y + j, y1);
    dst.put(y + j + rot_half, y2);
  }
  const int rest = head_size - 2 * rot_half;
  if (copy_rest && rest > 0) {
    for (int i = threadIdx.x; i < num_heads * rest; i += blockDim.x) {
      const int h = i / rest, j = 2 * rot_half + i % rest;
      dst.put(h * dst_head_stride + j, src[h * head_size + j]);
    }
  }
}

template <typename T, bool kFused>
__global__ void rotary_kernel(const RotaryParams p) {
  detail::pdl_launch_dependents();  // cuda/pdl.cuh
  detail::pdl_wait();
  const int64_t token = blockIdx.x;
  const int64_t pos = p.positions[token];
  const T* cos_row = static_cast<const T*>(p.cos_cache) + pos * p.rot_half;
  const T* sin_row = static_cast<const T*>(p.sin_cache) + pos * p.rot_half;
  T* q = static_cast<T*>(p.query) + token * p.query_stride;
  T* k = static_cast<T*>(p.key) + token * p.key_stride;
  const int D = p.head_size;
  if constexpr (!kFused) {
    rotate_heads<T>(q, HeadStore<T>{q, 0, 1.f}, D, cos_row, sin_row, p.num_heads, D, p.rot_half, false);
    rotate_heads<T>(k, HeadStore<T>{k, 0, 1.f}, D, cos_row, sin_row, p.num_kv_heads, D, p.rot_half, false);
  } else {
    T* qo = static_cast<T*>(p.query_out) + token * static_cast<int64_t>(p.num_heads) * D;
    rotate_heads<T>(q, HeadStore<T>{qo, 0, 1.f}, D, cos_row, sin_row, p.num_heads, D, p.rot_half, true,
                    p.paired_rows != 0);
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0 || slot >= p.num_slots) return;
    const int64_t block = slot / p.block_size, row = slot % p.block_size;
    // head h of this token: cache + ((block * Hkv + h) * block_size + row) * D (elements of T or codes)
    const int64_t head_stride = static_cast<int64_t>(p.block_size) * D;
    const int64_t base = (block * p.num_kv_heads * p.block_size + row) * D;
    const int64_t elem = p.kv_fp8 ? 1 : sizeof(T);
    const HeadStore<T> kst{static_cast<char*>(p.key_cache) + base * elem, p.kv_fp8, fp8::load_scale(p.k_scale)};
    const HeadStore<T> vst{static_cast<char*>(p.value_cache) + base * elem, p.kv_fp8, fp8::load_scale(p.v_scale)};
    rotate_heads<T>(k, kst, head_stride, cos_row, sin_row, p.num_kv_heads, D, p.rot_half, true, p.paired_rows != 0);
    const T* v = static_cast<const T*>(p.value) + token * p.value_stride;
    for (int i = threadIdx.x; i < p.num_kv_heads * D; i += blockDim.x) {
      const int h = i / D, j = i % D;
      vst.put(h * head_stride + j, v[h * D + j]);
    }
  }
}

template <typename T>
void launch(const RotaryParams& p, int64_t num_tokens, bool fused, cudaStream_t stream) {
  const int work = std::max(p.num_heads * p.rot_half, p.num_kv_heads * p.head_size);
  const int threads = round_up_warps(work, 64, 512);
  const auto grid = static_cast<unsigned>(num_tokens);
  if (fused) detail::launch_dependent(rotary_kernel<T, true>, dim3(grid), dim3(threads), 0, stream, p);
  else detail::launch_dependent(rotary_kernel<T, false>, dim3(grid), dim3(threads), 0, stream, p);
}

}  // namespace

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView* value, const TensorView& cos_cache, const TensorView& sin_cache,
                      const TensorView* query_out, const TensorView* key_cache, const TensorView* value_cache,
                      const TensorView* slot_mapping, std::uintptr_t stream, bool paired_rows,
                      const KVCacheScales* scales) {
  layer_ops::DeviceGuard guard(query.device_index);
  const bool fused = query_out != nullptr;
  RotaryParams p{};
  p.paired_rows = fused && paired_rows ? 1 : 0;
  p.positions = positions.ptr<int64_t>();
  p.query = query.data;
  p.key = key.data;
  p.cos_cache = cos_cache.data;
  p.sin_cache = sin_cache.data;
  p.query_stride = query.stride(0);
  p.key_stride = key.stride(0);
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(query.size(2));
  p.rot_half = static_cast<int>(cos_cache.size(1));
  if (fused) {
    p.value = value->data;
    p.value_stride = value->stride(0);
    p.query_out = query_out->data;
    p.key_cache = key_cache->data;
    p.value_cache = value_cache->data;
    p.slot_mapping = slot_mapping->ptr<int64_t>();
    p.block_size = static_cast<int>(key_cache->size(2));
    p.num_slots = key_cache->size(0) * key_cache->size(2);
    p.kv_fp8 = fp8::kind_of(key_cache->dtype);
    if (scales != nullptr) {
      p.k_scale = fp8::scale_ptr(scales->k_scale);
      p.v_scale = fp8::scale_ptr(scales->v_scale);
    }
  }
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t num_tokens = query.size(0);
  switch (query.dtype) {
    case DType::kFloat32: return launch<float>(p, num_tokens, fused, s);
    case DType::kBFloat16: return launch<__nv_bfloat16>(p, num_tokens, fused, s);
    case DType::kFloat16: return launch<__half>(p, num_tokens, fused, s);
    default: throw std::runtime_error("CUDA rotary_embedding: unsupported dtype");
  }
}

}  // namespace pagedllm::cuda
