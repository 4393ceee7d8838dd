// CpuDecoderStack (pagedllm/cpu_decoder.h): the Llama decoder layers of one step, natively.
#include "pagedllm/cpu_decoder.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "kernel_checks.h"
#include "pagedllm/attention.h"
#include "pagedllm/cache_ops.h"
#include "pagedllm/cpu_linear.h"
#include "pagedllm/layer_ops.h"

namespace pagedllm {

namespace {

constexpr const char* kOp = "CpuDecoderStack";

/// A bfloat16 CPU view of `data` with the given shape and strides (elements).
TensorView bf16_view(void* data, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides) {
  TensorView v;
  v.data = data;
  v.dtype = DType::kBFloat16;
  v.device = DeviceType::kCPU;
  v.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) v.shape[d++] = s;
  d = 0;
  for (int64_t s : strides) v.strides[d++] = s;
  return v;
}

TensorView rows_view(std::vector<uint16_t>& buf, int64_t rows, int64_t cols) {
  return TensorView::contiguous(buf.data(), DType::kBFloat16, {rows, cols});
}

void check_vector(const std::string& where, const TensorView& t, int64_t n) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCPU && t.dtype == DType::kBFloat16 && t.ndim == 1 && t.size(0) == n &&
                     t.is_contiguous(),
                 kOp, ": ", where, " must be a contiguous bfloat16 [", n, "] cpu tensor, got ", t.describe());
}

void check_bias(const std::string& where, const std::optional<TensorView>& t, int64_t n) {
  if (!t) return;
  PAGEDLLM_CHECK(t->device == DeviceType::kCPU && t->ndim == 1 && t->size(0) == n && t->is_contiguous() &&
                     (t->dtype == DType::kFloat32 || t->dtype == DType::kBFloat16),
                 kOp, ": ", where, " must be a contiguous float32 or bfloat16 [", n, "] cpu tensor, got ",
                 t->describe());
}

/// A packed weight of a [n, k] projection: [n / 32, k / 32, 2, 16, 32] bfloat16.
void check_packed(const std::string& where, const TensorView& t, int64_t n, int64_t k) {
  const std::vector<int64_t> want = amx_packed_weight_shape(n, k);
  bool ok = t.device == DeviceType::kCPU && t.dtype == DType::kBFloat16 && t.ndim == 5 && t.is_contiguous();
  for (int d = 0; ok && d < 5; ++d) ok = t.size(d) == want[d];
  PAGEDLLM_CHECK(ok, kOp, ": ", where, " must be a packed bfloat16 weight of shape [", detail::join(want),
                 "] (amx_pack_linear_weight of [", n, ", ", k, "]), got ", t.describe());
}

const TensorView* opt(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

}  // namespace

CpuDecoderStack::CpuDecoderStack(const CpuDecoderConfig& cfg, std::vector<CpuDecoderLayer> layers,
                                 const TensorView& cos_sin_cache)
    : cfg_(cfg), layers_(std::move(layers)), cos_sin_cache_(cos_sin_cache) {
  PAGEDLLM_CHECK(amx_linear_supported(), kOp, ": Intel AMX-BF16 is not available on this machine or build");
  PAGEDLLM_CHECK(cfg.hidden_size > 0 && cfg.intermediate_size > 0 && cfg.num_heads > 0 && cfg.num_kv_heads > 0 &&
                     cfg.head_dim > 0 && cfg.num_heads % cfg.num_kv_heads == 0,
                 kOp, ": invalid config: hidden_size ", cfg.hidden_size, ", intermediate_size ",
                 cfg.intermediate_size, ", num_heads ", cfg.num_heads, ", num_kv_heads ", cfg.num_kv_heads,
                 ", head_dim ", cfg.head_dim);
  PAGEDLLM_CHECK(cos_sin_cache.device == DeviceType::kCPU && cos_sin_cache.dtype == DType::kBFloat16 &&
                     cos_sin_cache.ndim == 2 && cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) % 2 == 0 &&
                     cos_sin_cache.size(1) <= cfg.head_dim,
                 kOp, ": cos_sin_cache must be a contiguous bfloat16 [max_position, rotary_dim] cpu tensor with an "
                 "even rotary_dim <= head_dim ", cfg.head_dim, ", got ", cos_sin_cache.describe());
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim;
  const int64_t q_size = cfg.num_heads * D, qkv_size = q_size + 2 * cfg.num_kv_heads * D;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const CpuDecoderLayer& l = layers_[i];
    const std::string at = "layer " + std::to_string(i) + " ";
    check_vector(at + "input_norm", l.input_norm, H);
    check_packed(at + "qkv", l.qkv, qkv_size, H);
    check_bias(at + "qkv_bias", l.qkv_bias, qkv_size);
    PAGEDLLM_CHECK(l.q_norm.has_value() == l.k_norm.has_value(), kOp, ": ", at,
                   "q_norm and k_norm must be given together");
    if (l.q_norm) {
      check_vector(at + "q_norm", *l.q_norm, D);
      check_vector(at + "k_norm", *l.k_norm, D);
    }
    check_packed(at + "o", l.o, H, q_size);
    check_vector(at + "post_norm", l.post_norm, H);
    check_packed(at + "gate_up", l.gate_up, 2 * I, H);
    check_bias(at + "gate_up_bias", l.gate_up_bias, 2 * I);
    check_packed(at + "down", l.down, H, I);
    check_bias(at + "down_bias", l.down_bias, H);
    for (const TensorView* c : {&l.key_cache, &l.value_cache})
      PAGEDLLM_CHECK(c->device == DeviceType::kCPU && (c->dtype == DType::kBFloat16 || is_fp8(c->dtype)) &&
                         c->ndim == 4 && c->size(1) == cfg.num_kv_heads && c->size(3) == D && c->is_contiguous(),
                     kOp, ": ", at, "KV cache must be a contiguous bfloat16 or fp8 [num_blocks, ", cfg.num_kv_heads,
                     ", block_size, ", D, "] cpu tensor, got ", c->describe());
    bool same = true;
    for (int d = 0; d < 4; ++d) same = same && l.key_cache.size(d) == l.value_cache.size(d);
    PAGEDLLM_CHECK(same, kOp, ": ", at, "key_cache ", l.key_cache.describe(), " and value_cache ",
                   l.value_cache.describe(), " differ in shape");
    PAGEDLLM_CHECK(l.sliding_window >= 0, kOp, ": ", at, "sliding_window must be >= 0, got ", l.sliding_window);
  }
  const int64_t T = kCpuDecoderMaxTokens;
  qkv_.resize(T * qkv_size);
  attn_.resize(T * q_size);
  act_.resize(T * I);
  if (std::any_of(layers_.begin(), layers_.end(), [](const CpuDecoderLayer& l) { return l.q_norm.has_value(); })) {
    q_.resize(T * q_size);
    k_.resize(T * cfg.num_kv_heads * D);
  }
}

void CpuDecoderStack::forward(int64_t start, int64_t end, const TensorView& hidden, const TensorView& residual,
                              bool has_residual, const CpuDecoderStep& step) {
  std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
  PAGEDLLM_CHECK(lock.owns_lock(), kOp, ": forward called while another forward of this stack runs (its scratch "
                 "activations are shared); use one stack per thread");
  PAGEDLLM_CHECK(0 <= start && start <= end && end <= num_layers(), kOp, ": layers [", start, ", ", end,
                 ") out of range for ", num_layers(), " layers");
  const int64_t H = cfg_.hidden_size, I = cfg_.intermediate_size, D = cfg_.head_dim;
  const int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
  const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
  for (auto [name, t] : {std::pair{"hidden", &hidden}, std::pair{"residual", &residual}})
    PAGEDLLM_CHECK(t->device == DeviceType::kCPU && t->dtype == DType::kBFloat16 && t->ndim == 2 &&
                       t->size(1) == H && t->is_contiguous(),
                   kOp, ": ", name, " must be a contiguous bfloat16 [T, ", H, "] cpu tensor, got ", t->describe());
  const int64_t T = hidden.size(0);
  PAGEDLLM_CHECK(residual.size(0) == T, kOp, ": residual has ", residual.size(0), " rows, hidden ", T);
  PAGEDLLM_CHECK(!detail::overlaps(hidden, residual), kOp, ": hidden and residual must not overlap, got hidden ",
                 hidden.describe(), " and residual ", residual.describe());
  PAGEDLLM_CHECK(T <= kCpuDecoderMaxTokens, kOp, ": a step of ", T, " tokens exceeds kCpuDecoderMaxTokens (",
                 kCpuDecoderMaxTokens, ")");
  if (T == 0 || start == end) return;
  if (!has_residual) std::memcpy(residual.data, hidden.data, static_cast<size_t>(T * H) * sizeof(uint16_t));

  const TensorView qkv = rows_view(qkv_, T, qkv_size);
  uint16_t* qkv_data = qkv_.data();
  const TensorView q = bf16_view(qkv_data, {T, Hq, D}, {qkv_size, D, 1});
  const TensorView k = bf16_view(qkv_data + q_size, {T, Hkv, D}, {qkv_size, D, 1});
  const TensorView v = bf16_view(qkv_data + q_size + kv_size, {T, Hkv, D}, {qkv_size, D, 1});
  const TensorView attn3 = bf16_view(attn_.data(), {T, Hq, D}, {q_size, D, 1});
  const TensorView attn2 = rows_view(attn_, T, q_size);
  const TensorView act = rows_view(act_, T, I);

  for (int64_t i = start; i < end; ++i) {
    const CpuDecoderLayer& l = layers_[i];
    if (i == start && !has_residual)
      rms_norm(hidden, residual, l.input_norm, cfg_.rms_norm_eps);
    else
      fused_add_rms_norm(hidden, residual, l.input_norm, cfg_.rms_norm_eps);
    amx_linear(qkv, hidden, l.qkv, opt(l.qkv_bias));
    TensorView qr = q, kr = k;
    if (l.q_norm) {  // Qwen3: RMSNorm per head, on contiguous copies (as the Python path's reshape)
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(q_.data() + t * q_size, qkv_data + t * qkv_size, q_size * sizeof(uint16_t));
        std::memcpy(k_.data() + t * kv_size, qkv_data + t * qkv_size + q_size, kv_size * sizeof(uint16_t));
      }
      const TensorView q_rows = rows_view(q_, T * Hq, D), k_rows = rows_view(k_, T * Hkv, D);
      rms_norm(q_rows, q_rows, *l.q_norm, cfg_.rms_norm_eps);
      rms_norm(k_rows, k_rows, *l.k_norm, cfg_.rms_norm_eps);
      qr = bf16_view(q_.data(), {T, Hq, D}, {q_size, D, 1});
      kr = bf16_view(k_.data(), {T, Hkv, D}, {kv_size, D, 1});
    }
    rotary_embedding(step.positions, qr, kr, cos_sin_cache_);
    reshape_and_cache(kr, v, l.key_cache, l.value_cache, step.slot_mapping, l.kv_scales);
    AttentionOptions options;
    options.sliding_window = l.sliding_window;
    options.kv_scales = l.kv_scales;
    if (step.decode_only)
      paged_attention(attn3, qr, l.key_cache, l.value_cache, step.block_tables, step.seq_lens, cfg_.scale, options);
    else
      paged_prefill_attention(attn3, qr, l.key_cache, l.value_cache, step.block_tables, step.seq_lens,
                              step.query_start_loc, cfg_.scale, options);
    amx_linear(hidden, attn2, l.o, nullptr);
    fused_add_rms_norm(hidden, residual, l.post_norm, cfg_.rms_norm_eps);
    amx_linear_silu_mul(act, hidden, l.gate_up, opt(l.gate_up_bias));  // = amx_linear, then silu_and_mul
    amx_linear(hidden, act, l.down, opt(l.down_bias));
  }
}

}  // namespace pagedllm
