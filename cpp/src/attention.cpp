// Launchers of pagedllm/attention.h: validate, then dispatch to the CPU kernels (cpu_attention.cpp)
// or the CUDA ones (cuda/, declared in cuda/kernels.h).
#include "pagedllm/attention.h"

#include <cmath>
#include <stdexcept>

#include "cpu_kernels.h"
#include "kernel_checks.h"
#ifdef PAGEDLLM_WITH_CUDA
#include "kernels.h"
#endif

namespace pagedllm {

const std::vector<int64_t>& supported_head_sizes() {
  static const std::vector<int64_t> sizes = {32, 64, 80, 96, 128, 256};
  return sizes;
}

const std::vector<int64_t>& supported_block_sizes() {
  static const std::vector<int64_t> sizes = {16, 32};
  return sizes;
}

std::vector<DType> supported_cache_dtypes(DeviceType device) {
  if (device == DeviceType::kCPU) return {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3FN, DType::kFloat8E5M2};
  return {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3FN, DType::kFloat8E5M2};
}

std::vector<DType> fp8_query_dtypes(DeviceType device) {
  if (device == DeviceType::kCPU) return {DType::kFloat32, DType::kBFloat16};
  return {DType::kBFloat16, DType::kFloat16};
}

namespace {

using detail::check_contiguous;
using detail::check_dim;
using detail::check_dtype;
using detail::check_ndim;
using detail::check_same_device;
using detail::no_cuda;


void check_options(const char* op, double scale, const AttentionOptions& o) {
  PAGEDLLM_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  PAGEDLLM_CHECK(o.sliding_window >= 0, op, ": sliding_window must be >= 0 (0 = none), got ",
                 o.sliding_window);
  PAGEDLLM_CHECK(std::isfinite(o.soft_cap) && o.soft_cap >= 0.0f, op,
                 ": soft_cap must be finite and >= 0 (0 = none), got ", o.soft_cap);
  PAGEDLLM_CHECK(o.split_k >= -1, op, ": split_k must be -1 (auto), 0 (single pass) or > 0, got ",
                 o.split_k);
}

/// out / query [N, Hq, D] against the caches: dtype, device, shape, GQA ratio.
void check_query_out(const char* op, const TensorView& out, const TensorView& query,
                     const TensorView& key_cache, const char* rows) {
  std::string layout = std::string("[") + rows + ", num_heads, head_size]";
  check_ndim(op, "query", query, 3, layout.c_str());
  check_ndim(op, "out", out, 3, layout.c_str());
  check_same_device(op, "query", query, "key_cache", key_cache);
  check_same_device(op, "out", out, "key_cache", key_cache);
  detail::check_compute_dtype(op, "query", query, key_cache);
  check_dtype(op, "out", out, query.dtype);
  detail::check_token_rows(op, "query", query);
  check_contiguous(op, "out", out);
  for (int d = 0; d < 3; ++d)
    PAGEDLLM_CHECK(out.size(d) == query.size(d), op, ": out shape ", out.describe(),
                   " differs from query shape ", query.describe());
  check_dim(op, "query", query, 2, key_cache.size(3), "head_size, must match key_cache");
  const int64_t hq = query.size(1), hkv = key_cache.size(1);
  PAGEDLLM_CHECK(hq > 0 && hq % hkv == 0, op, ": num_heads ", hq,
                 " (query dimension 1) must be a positive multiple of num_kv_heads ", hkv,
                 " (GQA/MQA)");
  if (query.size(0) > 0)
    PAGEDLLM_CHECK(query.data != nullptr && out.data != nullptr, op, ": null data pointer");
}

/// block_tables int32 [B, M], seq_lens int32 [B], same device as the caches.
void check_tables(const char* op, const TensorView& block_tables, const TensorView& seq_lens,
                  const TensorView& key_cache, int64_t batch) {
  check_ndim(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]");
  check_ndim(op, "seq_lens", seq_lens, 1, "[num_seqs]");
  check_dtype(op, "block_tables", block_tables, DType::kInt32);
  check_dtype(op, "seq_lens", seq_lens, DType::kInt32);
  check_same_device(op, "block_tables", block_tables, "key_cache", key_cache);
  check_same_device(op, "seq_lens", seq_lens, "key_cache", key_cache);
  check_contiguous(op, "block_tables", block_tables);
  check_contiguous(op, "seq_lens", seq_lens);
  check_dim(op, "block_tables", block_tables, 0, batch, "num_seqs");
  check_dim(op, "seq_lens", seq_lens, 0, batch, "num_seqs");
}

/// CPU only (values are host-readable): 0 <= seq_len <= M * block_size, used block ids in range.
void check_table_values(const char* op, const TensorView& block_tables, const TensorView& seq_lens,
                        const TensorView& key_cache) {
  const int64_t batch = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t block_size = key_cache.size(2), num_blocks = key_cache.size(0);
  const int32_t* sl = seq_lens.ptr<int32_t>();
  const int32_t* bt = block_tables.ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    PAGEDLLM_CHECK(sl[b] >= 0 && sl[b] <= max_blocks * block_size, op, ": seq_lens[", b, "] = ",
                   sl[b], " is out of range [0, ", max_blocks * block_size,
                   "] (max_blocks_per_seq ", max_blocks, " x block_size ", block_size, ")");
    const int64_t used = (sl[b] + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t id = bt[b * max_blocks + i];
      PAGEDLLM_CHECK(id >= 0 && id < num_blocks, op, ": block_tables[", b, "][", i, "] = ", id,
                     " is out of range [0, ", num_blocks, ") (num_blocks of the cache)");
    }
  }
}

}  // namespace

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, double scale, const AttentionOptions& options,
                     std::uintptr_t stream) {
  const char* op = "paged_attention";
  detail::check_kv_caches(op, key_cache, value_cache);
  check_query_out(op, out, query, key_cache, "num_seqs");
  check_tables(op, block_tables, seq_lens, key_cache, query.size(0));
  check_options(op, scale, options);
  detail::check_kv_scales(op, options.kv_scales, key_cache);
  if (query.size(0) == 0) return;
  if (key_cache.device == DeviceType::kCPU) {
    check_table_values(op, block_tables, seq_lens, key_cache);
    cpu::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                         static_cast<float>(scale), options, get_num_threads());
    return;
  }
#ifdef PAGEDLLM_WITH_CUDA
  cuda::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                        static_cast<float>(scale), options, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

DecodePlanInfo last_cuda_decode_plan() {
#ifdef PAGEDLLM_WITH_CUDA
  return cuda::last_decode_plan();
#else
  return {};
#endif
}

void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, double scale,
                             const AttentionOptions& options, std::uintptr_t stream) {
  const char* op = "paged_prefill_attention";
  detail::check_kv_caches(op, key_cache, value_cache);
  check_query_out(op, out, query, key_cache, "num_tokens");
  const int64_t batch = seq_lens.ndim == 1 ? seq_lens.size(0) : -1;
  check_tables(op, block_tables, seq_lens, key_cache, batch);
  check_ndim(op, "query_start_loc", query_start_loc, 1, "[num_seqs + 1]");
  check_dtype(op, "query_start_loc", query_start_loc, DType::kInt32);
  check_same_device(op, "query_start_loc", query_start_loc, "key_cache", key_cache);
  check_contiguous(op, "query_start_loc", query_start_loc);
  check_dim(op, "query_start_loc", query_start_loc, 0, batch + 1, "num_seqs + 1");
  check_options(op, scale, options);
  detail::check_kv_scales(op, options.kv_scales, key_cache);
  if (batch == 0 || query.size(0) == 0) return;
  if (key_cache.device == DeviceType::kCPU) {
    check_table_values(op, block_tables, seq_lens, key_cache);
    const int32_t* qsl = query_start_loc.ptr<int32_t>();
    const int32_t* sl = seq_lens.ptr<int32_t>();
    PAGEDLLM_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
    PAGEDLLM_CHECK(qsl[batch] == query.size(0), op, ": query_start_loc[", batch, "] = ", qsl[batch],
                   " must equal the number of query tokens ", query.size(0));
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t q_len = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
      PAGEDLLM_CHECK(q_len >= 0, op, ": query_start_loc must be non-decreasing, got query_start_loc[",
                     b, "] = ", qsl[b], " > query_start_loc[", b + 1, "] = ", qsl[b + 1]);
      PAGEDLLM_CHECK(q_len <= sl[b], op, ": sequence ", b, " has ", q_len,
                     " query tokens but seq_lens[", b, "] = ", sl[b],
                     " (the context must include the query chunk)");
    }
    cpu::paged_prefill_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                 query_start_loc, static_cast<float>(scale), options,
                                 get_num_threads());
    return;
  }
#ifdef PAGEDLLM_WITH_CUDA
  cuda::paged_prefill_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                query_start_loc, static_cast<float>(scale), options, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

}  // namespace pagedllm
