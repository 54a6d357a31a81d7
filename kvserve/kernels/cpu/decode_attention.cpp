// Decode attention over the paged KV cache (the reference: kernels/attention_ref.py).
#include "decode_attention.h"
#include "decode_attention_key_split.h"
#include "ops.h"
#include "work_claims.h"

#include <atomic>

namespace kvserve {

namespace {
std::atomic<bool> key_split_enabled{true};
}  // namespace

bool set_attention_key_split(bool enabled) { return key_split_enabled.exchange(enabled); }

// Tiled attention (FlashAttention's online softmax) for sequences with few new tokens, reading K/V
// straight from the paged cache. One work item is one sequence (or, with few sequences, one sequence
// and one KV head): it holds the softmax state (m, l, acc) of every query row that reads its heads --
// each new token times the query heads of each group -- and folds in one tile of kTile keys at a
// time, so each K/V row is read once and no score matrix or gathered copy exists. Causal: the query
// at position p sees keys 0..p, or with a sliding window (DecodeProblem::window) keys p - window + 1 .. p:
// tiles before the item's earliest such key -- whole cache blocks of them -- are not read at all, and
// in the tile where a row's window starts its earlier keys are masked.
//
// q: [T, Hq, D], last dim contiguous (any row stride). caches: [num_blocks, block_size, Hkv, D]
// contiguous. block_tables [B, W], seq_lens [B], cu_seqlens_q [B+1]: int64 (kernels/metadata.py).
// seq_ids: which sequences to process. out: [>= T, Hq, D] contiguous; only their rows are written.
// bf16 caches go to the AMX kernel (decode_attention_amx.cpp) where the CPU has it and the shapes fit,
// else to the AVX512-BF16 one (decode_attention_bf16.cpp) where the build has it, else on the avx2 path's
// build to the AVX2 one (decode_attention_avx2.cpp); this kernel takes the rest (plain builds, float32 caches
// on AVX-512, bf16 on AVX-512 without AVX512-BF16, head dims the AVX2 kernel does not take), its products in
// float32 over widened tiles. Few decode rows on the vector kernels are split by keys among the threads
// (decode_attention_key_split.h).

#ifdef __AVX2__
// Lane j of the result is the sum of the 8 lanes of v[j]: 6 horizontal adds, 2 lane swaps and an add.
inline __m256 sum_lanes_of_each(const __m256 (&v)[8]) {
  // per 128-bit half: the half-sums of v[0..3] (from `low`) and of v[4..7] (from `high`), in order
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

// Whether float_tile_scores runs on vectors for this head dim (else on scalar loops).
inline bool tile_scores_vectorized([[maybe_unused]] int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  return dim % 8 == 0;
#else
  return false;
#endif
}

// scores[j] = q . k_j for the first nkeys keys of a tile of float32 keys `dim` apart. With AVX2, eight
// keys at a time, their sums reduced together: a separate horizontal sum per key (GCC finishes a
// vectorized reduction with dependent scalar adds) cost as much as its products.
inline void float_tile_scores(const float* __restrict q, const float* __restrict k, int64_t nkeys, int64_t dim,
                              float* __restrict scores) {
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(kTile % 8 == 0, "a tile is whole groups of eight keys");
  if (tile_scores_vectorized(dim)) {
    // All eight keys of a group are read even past nkeys: the tile buffer holds kTile keys, and
    // softmax_tile ignores the scores past `visible`.
    for (int64_t j0 = 0; j0 < nkeys; j0 += 8) {
      __m256 acc[8];
      for (int64_t j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 qi = _mm256_loadu_ps(q + i);
        for (int64_t j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (j0 + j) * dim + i), acc[j]);
      }
      _mm256_storeu_ps(scores + j0, sum_lanes_of_each(acc));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < nkeys; ++j) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += q[i] * k[j * dim + i];
    scores[j] = sum;
  }
}

// V rows and the accumulators are padded to a multiple of this many floats (one AVX-512 register)
// with zeros, so the loops below run over whole registers with constant trip counts.
constexpr int64_t kLanes = 16;

inline int64_t padded_width(int64_t dim) { return (dim + kLanes - 1) / kLanes * kLanes; }

// Prefetches of the next tile asked for after V's regrouping and before each head's rows (PacedPrefetch);
// the rest after the tile's last head. 16 was the best batch size measured
// (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
constexpr int64_t kPrefetchBatch = 16;

// row_acc[:Parts * lanes] = row_acc * alpha + sum_j p[j] v[j][:Parts * lanes] over `visible` keys
// (V rows `width` floats apart), the slice held in Parts registers across the keys.
template <int64_t Parts>
inline void accumulate_slice(const float* __restrict p, float alpha, int64_t visible, const float* __restrict v,
                             int64_t width, float* __restrict row_acc) {
  using V = WideLanes;
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  V a[Parts];
  for (int64_t i = 0; i < Parts; ++i) a[i] = lanes_load(row_acc + i * lanes, V{}) * splat<V>(alpha);
  for (int64_t j = 0; j < visible; ++j) {
    const V pj = splat<V>(p[j]);
    for (int64_t i = 0; i < Parts; ++i) a[i] = lanes_fma(pj, lanes_load(v + j * width + i * lanes, V{}), a[i]);
  }
  for (int64_t i = 0; i < Parts; ++i) lanes_store(row_acc + i * lanes, a[i]);
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v[j] for every row that sees the tile; V widened to
// float32 [kTile, width]. The products are fused into the sums (one rounding, where the file's
// -ffp-contract=off would round twice): attention is compared with the float64 oracle within a
// tolerance, not with a torch op bit for bit, and the fused form is faster. A row is
// taken kRowBlock floats at a time, held in registers across the tile's keys: that many floats are
// independent chains of multiply-adds (8 AVX2 registers), so a key's products need not wait for the
// previous key's; with one 16-float slice per row at a time, two AVX2 chains each waited on the last.
constexpr int64_t kRowBlock = 64;
inline void accumulate_tile(const float* __restrict probs, const float* __restrict alpha, const int64_t* visible,
                            const float* __restrict v, int64_t nrows, int64_t width, float* __restrict acc) {
  constexpr int64_t lanes = sizeof(WideLanes) / sizeof(float);
  static_assert(kRowBlock % kLanes == 0 && kLanes % lanes == 0, "blocks and slices are whole registers");
  for (int64_t r = 0; r < nrows; ++r) {
    if (visible[r] <= 0) continue;
    const float* p = probs + r * kTile;
    float* row_acc = acc + r * width;
    int64_t slice = 0;
    for (; slice + kRowBlock <= width; slice += kRowBlock) {
      accumulate_slice<kRowBlock / lanes>(p, alpha[r], visible[r], v + slice, width, row_acc + slice);
    }
    for (; slice < width; slice += kLanes) {
      accumulate_slice<kLanes / lanes>(p, alpha[r], visible[r], v + slice, width, row_acc + slice);
    }
  }
}

// dst[h][j][:dim] = src[j][h][:dim] for `heads` heads of nkeys keys (src keys `key_stride` apart, dst
// rows `width` apart), widened to float32 or copied as they are. One pass in the cache's own order
// (all heads of a key side by side), so a whole-sequence item streams the tile as one contiguous run,
// and the score and value loops then read it from L1.
template <typename Src, typename Dst>
void regroup_tile(const Src* __restrict src, int64_t key_stride, int64_t nkeys, int64_t heads, int64_t dim,
                  int64_t width, Dst* __restrict dst) {
  for (int64_t j = 0; j < nkeys; ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      const Src* s = src + j * key_stride + h * dim;
      Dst* d = dst + (h * kTile + j) * width;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        if constexpr (std::is_same_v<Dst, float>) {
          d[i] = to_float(s[i]);
        } else {
          d[i] = s[i];
        }
      }
    }
  }
}

template <typename T>
void decode_attention_kernel(const DecodeProblem& p, const T* q, const T* k_cache, const T* v_cache, T* out) {
  const int64_t dim = p.dim, hq = p.hq, hkv = p.hkv, group = hq / hkv, key_len = hkv * dim;
  const int64_t width = padded_width(dim);
  const int64_t heads = heads_per_item(p);
  const int64_t items_per_seq = hkv / heads;
  parallel_claims(0, p.num_seqs * items_per_seq, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    // This item's tile, regrouped [head][key][d] and widened (V's padding stays 0).
    std::vector<float> qf, acc, m, l, kf(heads * kTile * dim), vf(heads * kTile * width, 0.f);
    std::vector<const T*> q_rows;
    // per row: first and last key it may see; of this tile's keys, the first it sees and one past its last
    std::vector<int64_t> first_key, last_key, tile_first, visible;
    std::vector<float> probs, alpha;         // per row: [kTile] scores, then probabilities; rescale factor
    PacedPrefetch<T, _MM_HINT_T0> prefetch;  // the next tile's K/V rows
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = p.seq_ids[item / items_per_seq], first_head = item % items_per_seq * heads;
      const int64_t row0 = p.cu_seqlens_q[seq], qlen = p.cu_seqlens_q[seq + 1] - row0, slen = p.seq_lens[seq];
      // Row r: row r % head_rows (query_row) of KV head first_head + r / head_rows.
      const int64_t head_rows = qlen * group, nrows = heads * head_rows;
      q_rows.resize(nrows);
      qf.resize(nrows * dim);
      acc.assign(nrows * width, 0.f);
      m.assign(nrows, -1e30f);  // a finite floor: exp(m_old - m_new) never sees (-inf) - (-inf)
      l.assign(nrows, 0.f);
      first_key.resize(nrows);
      last_key.resize(nrows);
      tile_first.resize(nrows);
      visible.resize(nrows);
      probs.resize(nrows * kTile);
      alpha.resize(nrows);
      for (int64_t r = 0; r < nrows; ++r) {
        const QueryRow row = query_row(r % head_rows, first_head + r / head_rows, group);
        q_rows[r] = q + (row0 + row.token) * p.q_row_stride + row.q_head * p.q_head_stride;
        regroup_tile(q_rows[r], 0, 1, 1, dim, dim, &qf[r * dim]);
        last_key[r] = slen - qlen + row.token;  // causal: the row sees keys up to its own position
        first_key[r] = first_visible_key(last_key[r], p.window);
      }
      const int64_t* table = p.tables + seq * p.table_width;
      for (int64_t kv_start = first_tile_key(p, slen - qlen), nkeys; kv_start < slen; kv_start += nkeys) {
        nkeys = tile_keys(p, kv_start, slen);
        prefetch.plan(p, table, kv_start + nkeys, kTile, slen, k_cache, v_cache, first_head, heads);
        const int64_t tile_at = cache_row(p, table, kv_start, first_head);
        regroup_tile(v_cache + tile_at, key_len, nkeys, heads, dim, width, vf.data());
        prefetch.issue(kPrefetchBatch);
        regroup_tile(k_cache + tile_at, key_len, nkeys, heads, dim, dim, kf.data());
        for (int64_t head = 0; head < heads; ++head) {
          prefetch.issue(kPrefetchBatch);
          const int64_t r0 = head * head_rows, k0 = head * kTile * dim;
          for (int64_t r = r0; r < r0 + head_rows; ++r) {
            visible[r] = std::min(nkeys, last_key[r] - kv_start + 1);
            tile_first[r] = std::max<int64_t>(0, first_key[r] - kv_start);
            if (visible[r] <= tile_first[r]) {  // the tile lies wholly outside the row's keys
              visible[r] = 0;
              continue;
            }
            float* scores = &probs[r * kTile];
            float_tile_scores(&qf[r * dim], &kf[k0], visible[r], dim, scores);
            alpha[r] = softmax_tile(scores, tile_first[r], visible[r], p.scale, m[r], l[r]);
          }
          accumulate_tile(&probs[r0 * kTile], &alpha[r0], &visible[r0], &vf[head * kTile * width], head_rows, width,
                          &acc[r0 * width]);
        }
        prefetch.issue(-1);
      }
      for (int64_t r = 0; r < nrows; ++r) {
        const QueryRow row = query_row(r % head_rows, first_head + r / head_rows, group);
        store_row(p, out, (row0 + row.token) * hq + row.q_head, &acc[r * width], m[r], l[r]);
      }
    }
  });
}

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, at::Tensor cu_seqlens_q, at::Tensor seq_ids, double scale, int64_t window) {
  RECORD_FUNCTION("kvserve::decode_attention", {});  // named in torch profiler traces
  TORCH_CHECK(window >= 0, "window must be a number of keys, or 0 for none");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(
      k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
      "caches must be contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, caches and out must share one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head counts or dims disagree");
  TORCH_CHECK(out.is_contiguous() && out.size(1) == q.size(1) && out.size(2) == q.size(2) && out.size(0) >= q.size(0),
              "out must be contiguous [>= T, Hq, D]");
  for (const auto& t : {block_tables, seq_lens, cu_seqlens_q, seq_ids}) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "index tensors must be contiguous int64");
  }
  const DecodeProblem problem{q.size(1),
                              k_cache.size(2),
                              q.size(2),
                              k_cache.size(1),
                              q.stride(0),
                              q.stride(1),
                              block_tables.size(1),
                              block_tables.data_ptr<int64_t>(),
                              seq_lens.data_ptr<int64_t>(),
                              cu_seqlens_q.data_ptr<int64_t>(),
                              seq_ids.data_ptr<int64_t>(),
                              seq_ids.size(0),
                              static_cast<float>(scale),
                              window};
  KVSERVE_DISPATCH(q.scalar_type(), [&] {
    if (amx_decode_supported(problem) && decode_attention_amx(problem, raw<scalar_t>(q), raw<scalar_t>(k_cache),
                                                              raw<scalar_t>(v_cache), raw<scalar_t>(out))) {
      return;
    }
    const auto vector_kernel = [&](const DecodeProblem& p, const raw_t<scalar_t>* q_rows, raw_t<scalar_t>* out_rows) {
      const auto* k_rows = raw<scalar_t>(k_cache);
      const auto* v_rows = raw<scalar_t>(v_cache);
      if (!decode_attention_bf16(p, q_rows, k_rows, v_rows, out_rows) &&
          !decode_attention_avx2(p, q_rows, k_rows, v_rows, out_rows)) {
        decode_attention_kernel(p, q_rows, k_rows, v_rows, out_rows);
      }
    };
    const int64_t part_keys =
        key_split_enabled.load() ? key_split_part_keys(problem, at::get_num_threads(), sizeof(scalar_t)) : 0;
    if (part_keys > 0) {
      decode_attention_key_split(problem, part_keys, raw<scalar_t>(q), raw<scalar_t>(out), vector_kernel);
    } else {
      vector_kernel(problem, raw<scalar_t>(q), raw<scalar_t>(out));
    }
  });
}

bool amx_attention_applies(at::Tensor q, at::Tensor k_cache, int64_t window) {
  DecodeProblem shape{};
  shape.dim = q.size(-1);
  shape.block_size = k_cache.size(1);
  shape.window = window;
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && amx_decode_supported(shape);
}

bool widened_attention_vectorized(at::Tensor q) { return tile_scores_vectorized(q.size(-1)); }

}  // namespace kvserve
