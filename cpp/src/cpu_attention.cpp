// CPU paged attention: decode (with flash-decoding split-K) and varlen causal prefill.
//
// Both kernels cut the batch into work items of query rows — all G = Hq / Hkv query heads of one
// KV head (GQA), times a few query tokens for prefill — and run cpu_attention_tiles.h on each:
// the rows walk the (block, kv head) tiles of their context once, so each contiguous K/V tile is
// read from memory once per item and reused from L1 by every row (online softmax, fp32).
// Split-K (flash-decoding) partitions a sequence's context; the partial (m, l, acc) triples are
// combined by a log-sum-exp reduction. Work items are spread over OpenMP threads. bfloat16 caches
// of head size 64 or 128 take cpu_attention_amx.h's AMX tile version of the same walk instead
// (up to 64 rows per call), where the CPU has AMX (cpu_attention_uses_amx()). FP8 caches: each
// K / V tile is decoded exactly into the query's dtype as the walk reaches it (cpu_fp8.h), k_scale
// joins the softmax scale and v_scale the output; they take the AVX-512 walk.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_amx.h"
#include "cpu_attention_tiles.h"
#include "cpu_kernels.h"

namespace pagedllm::cpu {

namespace {

using namespace tiles;

/// Launches with less work than this (multiply-adds of QK^T per query head group) run on the
/// calling thread only.
constexpr int64_t kMinParallelElements = 1 << 16;

/// The AMX path (cpu_attention_amx.h) applies: a bfloat16 cache of head size 64 or 128 on a CPU
/// with AMX (unless PAGEDLLM_CPU_ATTENTION_AMX=0).
template <typename T, int D>
constexpr bool kAmxShape = std::is_same_v<T, bf16> && (D == 64 || D == 128);

template <typename T, int D>
bool use_amx() {
  if constexpr (kAmxShape<T, D>) return amx_attention_enabled();
  return false;
}

template <typename T>
Context<T> make_context(const TensorView& key_cache, const TensorView& value_cache,
                        const TensorView& block_tables, const AttentionOptions& o) {
  const bool fp8 = is_fp8(key_cache.dtype);
  Context<T> c{fp8 ? nullptr : key_cache.ptr<const T>(), fp8 ? nullptr : value_cache.ptr<const T>(),
               block_tables.ptr<const int32_t>(), block_tables.size(1), key_cache.size(1),
               static_cast<int>(key_cache.size(2)), o.sliding_window, o.soft_cap};
  if (fp8) {
    c.key8 = static_cast<const uint8_t*>(key_cache.data);
    c.value8 = static_cast<const uint8_t*>(value_cache.data);
    c.fp8 = key_cache.dtype == DType::kFloat8E4M3FN ? 1 : 2;
  }
  return c;
}

/// The scale a KVCacheScales view holds (1.0 when unset).
float scale_of(const TensorView& t) { return t.data == nullptr ? 1.0f : *static_cast<const float*>(t.data); }

template <typename T, int D>
void decode(const TensorView& out, const TensorView& query, const TensorView& key_cache,
            const TensorView& value_cache, const TensorView& block_tables,
            const TensorView& seq_lens, float scale, const AttentionOptions& o, int nt) {
  const Context<T> c = make_context<T>(key_cache, value_cache, block_tables, o);
  // An FP8 cache: k_scale joins the softmax scale, v_scale the output (cpu_attention_tiles.h).
  const float v_scale = c.fp8 ? scale_of(o.kv_scales.v_scale) : 1.0f;
  if (c.fp8) scale *= scale_of(o.kv_scales.k_scale);
  const int64_t B = query.size(0), Hq = query.size(1), Hkv = key_cache.size(1);
  const int G = static_cast<int>(Hq / Hkv);
  const int32_t* sl = seq_lens.ptr<const int32_t>();
  const T* qp = query.ptr<const T>();
  T* op = out.ptr<T>();
  const int64_t max_len = *std::max_element(sl, sl + B);
  int64_t total_len = 0;
  for (int64_t b = 0; b < B; ++b) total_len += sl[b];
  // Below ~64K K elements (e.g. 1 sequence x 1K tokens x 1 KV head x d64) the work is a few
  // microseconds: waking other threads would cost more than it saves.
  if (total_len * Hkv * D < kMinParallelElements) nt = 1;
  const int S = decode_num_splits(B, max_len, o.split_k, nt);
  // Split-K partials, [B][Hq][S] (m, l) and [B][Hq][S][D] (acc); unused when S == 1.
  std::vector<float> pm, pl, pacc;
  if (S > 1) {
    pm.resize(size_t(B) * Hq * S);
    pl.resize(pm.size());
    pacc.resize(pm.size() * D);
  }
  // A work item is one partition of one sequence, all its KV heads: a block's heads are one
  // contiguous [Hkv, block_size, D] run of the cache (6 KB for SmolLM2's 3 heads of d64 in 16-token
  // blocks), and random 2 KB pieces stream from DRAM at ~2/3 the rate of 6-12 KB ones (the dev VM:
  // 15 against 16-21 GB/s). The AMX walk of the first head prefetches every head's rows. With fewer
  // such items than threads (a few short sequences on a many-core host) each head is an item.
  const int64_t heads_per_item = (B * S < nt) ? 1 : Hkv;
  const int64_t items = B * S * (Hkv / heads_per_item);
  [[maybe_unused]] const bool amx_decode = use_amx<T, D>() && G <= 16 && !c.fp8;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, items)))
  {
    Workspace w(G, D, c.block_size, c.fp8 != 0);
#if PAGEDLLM_HAVE_AMX
    AmxThread amx(amx_decode);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq_part = item / (Hkv / heads_per_item);
      const int64_t b = seq_part / S;
      const int split = static_cast<int>(seq_part % S);
      const int64_t kv0 = (item % (Hkv / heads_per_item)) * heads_per_item;
      const int64_t len = sl[b];
      const int64_t p = len - 1;  // the query's position
      const int64_t start = (c.sliding_window > 0) ? std::max<int64_t>(0, p - c.sliding_window + 1) : 0;
      const int64_t span = std::max<int64_t>(0, len - start);
      const int64_t part = (span + S - 1) / S;
      const int64_t lo = start + split * part;
      const int64_t hi = std::min<int64_t>(len, lo + part);
      for (int64_t kvh = kv0; kvh < kv0 + heads_per_item; ++kvh) {
        for (int g = 0; g < G; ++g) {
          load_query<T, D>(qp + b * query.stride(0) + (kvh * G + g) * D, scale, w.q.data() + g * D,
                           w.qb.data() + g * D);
          w.pos[g] = static_cast<int32_t>(p);
        }
        reset_rows(w, G, D);
        if (lo < hi) {
          bool done = false;
#if PAGEDLLM_HAVE_AMX
          if constexpr (kAmxShape<T, D>) {
            if (amx_decode) {
              const int prefetch_heads = kvh == kv0 ? static_cast<int>(heads_per_item) : 1;
              attend_blocks_amx<D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, G, scale, w.qb.data(),
                                   w.pos.data(), w.m.data(), w.l.data(), w.acc.data(), *amx.scratch, prefetch_heads);
              done = true;
            }
          }
#endif
          if (!done) attend_blocks<T, D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, G, scale, w);
        }
        for (int g = 0; g < G; ++g) {
          const int64_t h = kvh * G + g;
          if (S == 1) {
            store_row<T, D>(w.acc.data() + g * D, w.l[g], op + (b * Hq + h) * D, v_scale);
          } else {
            const size_t idx = (size_t(b) * Hq + h) * S + split;
            pm[idx] = w.m[g];
            pl[idx] = w.l[g];
            std::copy_n(w.acc.data() + g * D, D, pacc.data() + idx * D);
          }
        }
      }
    }
    // (implicit barrier) Flash-decoding reduction, in the same parallel region:
    // out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s.
    if (S > 1) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < B * Hq; ++row) {
        const float* m = pm.data() + row * S;
        const float* l = pl.data() + row * S;
        float M = kNegInf;
        for (int s = 0; s < S; ++s) M = std::max(M, m[s]);
        float a[D] = {};
        float L = 0.0f;
        if (M != kNegInf) {
          for (int s = 0; s < S; ++s) {
            if (m[s] == kNegInf) continue;
            const float f = exp_neg(m[s] - M);
            L += f * l[s];
            const float* ps = pacc.data() + (size_t(row) * S + s) * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += f * ps[d];
          }
        }
        store_row<T, D>(a, L, op + row * D, v_scale);
      }
    }
  }
}

/// One prefill work item: query rows [q0, q1) of sequence b, all heads of KV head kvh.
struct PrefillTile {
  int64_t b, q0, q1, cost;
};

template <typename T, int D>
void prefill(const TensorView& out, const TensorView& query, const TensorView& key_cache,
             const TensorView& value_cache, const TensorView& block_tables,
             const TensorView& seq_lens, const TensorView& query_start_loc, float scale,
             const AttentionOptions& o, int nt) {
  const Context<T> c = make_context<T>(key_cache, value_cache, block_tables, o);
  const float v_scale = c.fp8 ? scale_of(o.kv_scales.v_scale) : 1.0f;  // as in decode
  if (c.fp8) scale *= scale_of(o.kv_scales.k_scale);
  const int64_t B = seq_lens.size(0), Hq = query.size(1), Hkv = key_cache.size(1);
  const int G = static_cast<int>(Hq / Hkv);
  const int32_t* sl = seq_lens.ptr<const int32_t>();
  const int32_t* qsl = query_start_loc.ptr<const int32_t>();
  const T* qp = query.ptr<const T>();
  T* op = out.ptr<T>();
  // Query tile: about 64 rows (query tokens x G heads) share each K/V tile.
  const int QT = std::max(1, 64 / G);
  std::vector<PrefillTile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    for (int64_t q0 = 0; q0 < q_len; q0 += QT) {
      const int64_t q1 = std::min<int64_t>(q_len, q0 + QT);
      const int64_t hi = sl[b] - q_len + q1;  // one past the last position this tile sees
      const int64_t lo = o.sliding_window > 0
                             ? std::max<int64_t>(0, sl[b] - q_len + q0 - o.sliding_window + 1)
                             : 0;
      tiles.push_back({b, q0, q1, (hi - lo) * (q1 - q0)});
    }
  }
  // Most expensive first, so that dynamic scheduling balances the causal triangle.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const PrefillTile& x, const PrefillTile& y) { return x.cost > y.cost; });
  const int64_t items = static_cast<int64_t>(tiles.size()) * Hkv;
  const int R = QT * G;
  int64_t work = 0;  // query rows x visible tokens per KV head, in tiles
  for (const PrefillTile& t : tiles) work += t.cost;
  if (work * Hkv * D < kMinParallelElements) nt = 1;
  [[maybe_unused]] const bool amx_prefill = use_amx<T, D>() && !c.fp8;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, std::max<int64_t>(items, 1))))
  {
    Workspace w(R, D, c.block_size, c.fp8 != 0);
#if PAGEDLLM_HAVE_AMX
    AmxThread amx(amx_prefill);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const PrefillTile& tile = tiles[item / Hkv];
      const int64_t kvh = item % Hkv;
      const int64_t b = tile.b;
      const int64_t q_len = qsl[b + 1] - qsl[b];
      const int64_t first_pos = sl[b] - q_len;  // position of query row 0
      const int rows = static_cast<int>(tile.q1 - tile.q0) * G;
      for (int64_t i = tile.q0; i < tile.q1; ++i)
        for (int g = 0; g < G; ++g) {
          const int r = static_cast<int>(i - tile.q0) * G + g;
          load_query<T, D>(qp + (qsl[b] + i) * query.stride(0) + (kvh * G + g) * D, scale, w.q.data() + r * D,
                           w.qb.data() + r * D);
          w.pos[r] = static_cast<int32_t>(first_pos + i);
        }
      reset_rows(w, rows, D);
      const int64_t hi = first_pos + tile.q1;
      const int64_t lo = c.sliding_window > 0
                             ? std::max<int64_t>(0, first_pos + tile.q0 - c.sliding_window + 1)
                             : 0;
      bool done = false;
#if PAGEDLLM_HAVE_AMX
      if constexpr (kAmxShape<T, D>) {
        if (amx_prefill) {  // up to kAmxMaxRows rows per call
          for (int r0 = 0; r0 < rows; r0 += kAmxMaxRows) {
            const int n = std::min(kAmxMaxRows, rows - r0);
            const auto [pmin, pmax] = std::minmax_element(w.pos.data() + r0, w.pos.data() + r0 + n);
            const int64_t ghi = int64_t{*pmax} + 1;
            const int64_t glo = c.sliding_window > 0 ? std::max<int64_t>(0, *pmin - c.sliding_window + 1) : 0;
            attend_blocks_amx<D>(c, c.block_tables + b * c.max_blocks, kvh, glo, ghi, n, scale,
                                 w.qb.data() + r0 * D, w.pos.data() + r0, w.m.data() + r0, w.l.data() + r0,
                                 w.acc.data() + size_t(r0) * D, *amx.scratch);
          }
          done = true;
        }
      }
#endif
      if (!done) {
#if defined(__AVX512F__)
        if (rows >= 16)
          attend_blocks_rows16<T, D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, rows, scale, w);
        else
#endif
          attend_blocks<T, D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, rows, scale, w);
      }
      for (int64_t i = tile.q0; i < tile.q1; ++i)
        for (int g = 0; g < G; ++g) {
          const int r = static_cast<int>(i - tile.q0) * G + g;
          store_row<T, D>(w.acc.data() + r * D, w.l[r], op + ((qsl[b] + i) * Hq + kvh * G + g) * D, v_scale);
        }
    }
  }
}

/// Calls f.template operator()<T, D>() for the runtime query dtype (float32 or bfloat16; with a
/// 16/32-bit cache the cache's) and head size.
template <typename F>
void dispatch(DType dtype, int64_t head_size, F&& f) {
  auto by_size = [&]<typename T>() {
    switch (head_size) {
      case 32: return f.template operator()<T, 32>();
      case 64: return f.template operator()<T, 64>();
      case 80: return f.template operator()<T, 80>();
      case 96: return f.template operator()<T, 96>();
      case 128: return f.template operator()<T, 128>();
      case 256: return f.template operator()<T, 256>();
    }
  };
  if (dtype == DType::kFloat32)
    by_size.template operator()<float>();
  else
    by_size.template operator()<bf16>();
}

}  // namespace

int decode_num_splits(int64_t batch, int64_t max_seq_len, int split_k, int num_threads) {
  if (split_k > 0) return split_k;
  if (split_k == 0) return 1;
  // Auto: split only when the sequences (one work item each, all KV heads) cannot keep every
  // thread busy, into partitions of at least 256 tokens; aim for ~8 items per thread to balance
  // uneven lengths.
  const int64_t items = std::max<int64_t>(1, batch);
  if (items >= 8LL * num_threads) return 1;
  const int64_t want = (8LL * num_threads + items - 1) / items;
  const int64_t most = std::max<int64_t>(1, max_seq_len / 256);
  return static_cast<int>(std::max<int64_t>(1, std::min(want, most)));
}

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, float scale, const AttentionOptions& options,
                     int num_threads) {
  dispatch(query.dtype, key_cache.size(3), [&]<typename T, int D>() {
    decode<T, D>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, options,
                 num_threads);
  });
}

void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, float scale,
                             const AttentionOptions& options, int num_threads) {
  dispatch(query.dtype, key_cache.size(3), [&]<typename T, int D>() {
    prefill<T, D>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                  scale, options, num_threads);
  });
}

}  // namespace pagedllm::cpu

namespace pagedllm {

bool cpu_attention_uses_amx() { return cpu::tiles::amx_attention_enabled(); }

}  // namespace pagedllm
