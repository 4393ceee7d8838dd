// Launcher and CPU kernel of pagedllm/sampling_ops.h.
//
// argmax_rows: CUDA tensors go to cuda/sampling_ops.cu. CPU: one row per OpenMP iteration (rows are 32K-256K wide); within a row 16 lanes keep
// their running maximum and its index (strictly-greater updates keep the first index), then the
// lanes are merged taking the smaller index on equal values — the result torch.argmax gives.
#include "pagedllm/sampling_ops.h"

#include <omp.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "cpu_vec.h"
#include "kernel_checks.h"
#include "pagedllm/attention.h"

#ifdef PAGEDLLM_WITH_CUDA
#include "sampling_ops_cuda.h"
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm {

namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = -1;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i vidx = _mm512_set1_epi32(-1);
    __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= n; i += 16) {
      __m512 v;
      if constexpr (std::is_same_v<T, float>) {
        v = _mm512_loadu_ps(x + i);
      } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // NaN compares false
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
      cur = _mm512_add_epi32(cur, step);
    }
    alignas(64) float m[16];
    alignas(64) int32_t ix[16];
    _mm512_store_ps(m, vmax);
    _mm512_store_si512(ix, vidx);
    for (int l = 0; l < 16; ++l)
      if (ix[l] >= 0 && (m[l] > best || (m[l] == best && ix[l] < best_i))) {
        best = m[l];
        best_i = ix[l];
      }
  }
#endif
  for (; i < n; ++i) {
    const float v = cpu::to_float(x[i]);
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  if (best_i >= 0) return best_i;
  // Nothing above -inf (rare): the first -inf, or 0 for a row of NaN only.
  for (int64_t j = 0; j < n; ++j)
    if (cpu::to_float(x[j]) == best) return j;
  return 0;
}

}  // namespace

void argmax_rows(const TensorView& out, const TensorView& logits, int64_t vocab, std::uintptr_t stream) {
  const char* op = "argmax_rows";
  detail::check_ndim(op, "logits", logits, 2, "[num_rows, vocab]");
  const bool cuda = logits.device == DeviceType::kCUDA;
  PAGEDLLM_CHECK(out.device == logits.device && out.device_index == logits.device_index, op,
                 ": out must be on the logits' device (", detail::device_str(logits), "), got ",
                 detail::device_str(out));
  PAGEDLLM_CHECK(logits.dtype == DType::kFloat32 || logits.dtype == DType::kBFloat16 ||
                     (cuda && logits.dtype == DType::kFloat16),
                 op, ": logits dtype ", dtype_name(logits.dtype), " is not supported; supported dtypes on ",
                 cuda ? "cuda: float32, bfloat16, float16" : "cpu: float32, bfloat16");
  PAGEDLLM_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1, op,
                 ": logits must have a contiguous last dimension, got ", logits.describe());
  detail::check_ndim(op, "out", out, 1, "[num_rows]");
  detail::check_dtype(op, "out", out, DType::kInt64);
  detail::check_contiguous(op, "out", out);
  detail::check_dim(op, "out", out, 0, logits.size(0), "num_rows, must match logits");
  const int64_t V = logits.size(1);
  const int64_t n = vocab == 0 ? V : vocab;
  PAGEDLLM_CHECK(n >= 1 && n <= V, op, ": vocab = ", vocab, " must be in [1, ", V, "] (0 = all columns)");
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  if (cuda) {
#ifdef PAGEDLLM_WITH_CUDA
    cuda::argmax_rows(out, logits, n, stream);
    return;
#else
    (void)stream;
    throw InvalidArgument(std::string(op) + ": got CUDA tensors but pagedllm was built without CUDA");
#endif
  }
  int64_t* o = out.ptr<int64_t>();
  const int threads = rows * n >= (1 << 18) ? get_num_threads() : 1;
  auto run = [&]<typename T>() {
    const T* base = logits.ptr<const T>();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row<T>(base + r * logits.stride(0), n);
  };
  if (logits.dtype == DType::kFloat32)
    run.template operator()<float>();
  else
    run.template operator()<cpu::bf16>();
}

void fill_placeholder_ids(const TensorView& input_ids, const TensorView& prev_rows, const TensorView& sampled,
                          std::uintptr_t stream) {
  const char* op = "fill_placeholder_ids";
  detail::check_ndim(op, "input_ids", input_ids, 1, "[num_tokens]");
  detail::check_ndim(op, "prev_rows", prev_rows, 1, "[num_tokens]");
  detail::check_ndim(op, "sampled", sampled, 1, "[num_sampled]");
  detail::check_dtype(op, "input_ids", input_ids, DType::kInt32);
  detail::check_dtype(op, "prev_rows", prev_rows, DType::kInt32);
  detail::check_dtype(op, "sampled", sampled, DType::kInt64);
  detail::check_contiguous(op, "input_ids", input_ids);
  detail::check_contiguous(op, "prev_rows", prev_rows);
  detail::check_contiguous(op, "sampled", sampled);
  detail::check_dim(op, "prev_rows", prev_rows, 0, input_ids.size(0), "num_tokens, must match input_ids");
  for (const TensorView* t : {&prev_rows, &sampled})
    PAGEDLLM_CHECK(t->device == input_ids.device && t->device_index == input_ids.device_index, op,
                   ": every tensor must be on input_ids' device (", detail::device_str(input_ids), "), got ",
                   detail::device_str(*t));
  const int64_t n = input_ids.size(0);
  if (n == 0) return;
  if (input_ids.device == DeviceType::kCUDA) {
#ifdef PAGEDLLM_WITH_CUDA
    cuda::fill_placeholder_ids(input_ids, prev_rows, sampled, stream);
    return;
#else
    (void)stream;
    throw InvalidArgument(std::string(op) + ": got CUDA tensors but pagedllm was built without CUDA");
#endif
  }
  int32_t* ids = input_ids.ptr<int32_t>();
  const int32_t* rows = prev_rows.ptr<const int32_t>();
  const int64_t* src = sampled.ptr<const int64_t>();
  const int64_t num_sampled = sampled.size(0);
  for (int64_t t = 0; t < n; ++t)
    PAGEDLLM_CHECK(rows[t] < num_sampled, op, ": prev_rows[", t, "] = ", rows[t], " but sampled has ",
                   num_sampled, " rows");
  for (int64_t t = 0; t < n; ++t)
    if (rows[t] >= 0) ids[t] = static_cast<int32_t>(src[rows[t]]);
}

}  // namespace pagedllm
