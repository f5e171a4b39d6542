// Causal attention of prefill chunks over their request's KV, read from the token-slot cache
// (``--attention_backend cpp``, chunks longer than the slot kernel's few queries).  Built with
// cpp_slot_attention.cpp into one library by cpp_kernel_build.py, loaded through ctypes.
//
// Why a tiled kernel: a long prefill chunk is arithmetic, not memory traffic (every key meets
// every later query), so it has to run at the FMA units' speed.  torch's flash SDPA for CPU
// measured 37-47 GFLOP/s on one core with head_dim 32 (small inner products), behind a
// gather that copies the context out of the cache first.  Here a tile of queries (all query
// heads of one KV head, so grouped-query heads share each key) meets a block of keys at a time:
// the context is gathered through the slot table once per request and KV head (keys transposed
// per block), and the scores come from a register-blocked product (ROW_STEP rows x two vectors
// of keys, one broadcast per row and two vector loads per head_dim step); an online softmax per
// row; then the values through another register-blocked product (ROW_STEP rows x two vectors of
// dims).  Blocks past the diagonal are skipped.  The vectors and blocks follow the build: with
// AVX-512, 16 floats and 8 rows (16 accumulators; with 8-float vectors a machine with
// full-width AVX-512 units ran them at half speed: a 2048-token prefill of the medium demo
// model, two threads, attention 364 -> 228 ms, 190 -> 300 GFLOP/s; small demo model 56 -> 35
// ms); otherwise 8 floats and 6 rows (12 accumulators, which fit AVX2's 16 registers).
//
// Layouts (all contiguous, row-major):
//   q       [tokens, H_kv, G, D] float32   the chunks' new tokens, request after request
//   k, v    [rows, H_kv, D]      float32 or bfloat16 (uint16 bits): a layer is rows slot_base + slot
//   slots   [B, L] int64         slot of each context position of each request
//   token_starts, new_lens, cached_lens  [B] int64: request b's chunk is q rows
//           token_starts[b] ..+ new_lens[b], at positions cached_lens[b] ..; it sees positions
//           0 .. its own (cached_lens[b] + new_lens[b] <= L)
//   out     [tokens, H_kv, G, D] float32

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpp_kernel_vector.h"

namespace {

using lightllm_kernels::exp_nonpositive;
using lightllm_kernels::float8;
using lightllm_kernels::load8;
using lightllm_kernels::to_float;

// Keys per tile.  Each block costs every row a softmax step (its maximum, the rescale of the
// row's running output), so a longer block spends less of the tile on that bookkeeping: one
// thread, one 2048-token prefill's attention, 128 against 64 keys: 61.5-63.0 against 67.6-70.2
// ms on the small demo model (head_dim 32), 428-430 against 439-452 ms on the medium one (64);
// 256 was no faster than 128 on the small model and slower on the medium one.
constexpr int KEY_BLOCK = 128;
constexpr int ROW_TARGET = 64;   // query rows (queries x grouped heads) per tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The register blocks follow the build.  With AVX-512 (32 registers of 16 floats): 16-float
// vectors, 8 rows x 2 vectors = 16 accumulators.  Otherwise 8-float vectors and 6 rows x 2
// vectors = 12 accumulators, which with the two loaded vectors and a broadcast fit AVX2's 16
// registers of 8 floats.  The 16-float blocks split there into twice the registers and spilled
// in every step of the inner loop: a -march=haswell build ran 19-29x slower than torch's gather
// + SDPA (one thread, one layer of a 2048-token prefill, small demo model: 1010 against 41 ms);
// on 8-float blocks it takes 0.59-0.81x torch's time, 4-14% more than the AVX-512 build.
#if defined(__AVX512F__)
constexpr int ROW_STEP = 8;      // rows per register block
constexpr int LANES = 16;        // floats per vector
using lanes_t = lightllm_kernels::float_x16;
inline lanes_t load_lanes(const float* p) { return lightllm_kernels::load16(p); }
inline void store_lanes(float* p, const lanes_t& x) { lightllm_kernels::store16(p, x); }
#else
constexpr int ROW_STEP = 6;
constexpr int LANES = 8;
using lanes_t = float8;
inline lanes_t load_lanes(const float* p) { return load8(p); }
inline void store_lanes(float* p, const lanes_t& x) { lightllm_kernels::store8(p, x); }
#endif

// Keeps a loaded vector in a register: without it GCC folded the load into every FMA that uses
// it (one load per row instead of one per block), and the loops ran at the load ports' speed.
#if defined(__AVX512F__)
inline void in_register(lanes_t& x) { asm("" : "+v"(x)); }
#elif defined(__AVX__)
inline void in_register(lanes_t& x) { asm("" : "+x"(x)); }
#else
inline void in_register(lanes_t&) {}  // no x86 vector registers to name
#endif

// scores[rows, KEY_BLOCK] = qs[rows, D] . kt[D, KEY_BLOCK] for the first `keys` columns (a
// multiple of 2 x LANES); rows is a multiple of ROW_STEP.  Register block: ROW_STEP rows x
// 2 x LANES keys, 2 x ROW_STEP accumulators, two vector loads and ROW_STEP broadcasts per
// head_dim step.
template <int D>
void block_scores(const float* __restrict__ qs, const float* __restrict__ kt, int rows, int keys,
                  float* __restrict__ scores) {
  for (int m = 0; m < rows; m += ROW_STEP) {
    const float* q0 = qs + m * D;
    for (int j = 0; j < keys; j += 2 * LANES) {
      lanes_t acc[ROW_STEP][2] = {};
      for (int d = 0; d < D; ++d) {
        lanes_t k_lo = load_lanes(kt + d * KEY_BLOCK + j);
        lanes_t k_hi = load_lanes(kt + d * KEY_BLOCK + j + LANES);
        in_register(k_lo);
        in_register(k_hi);
        for (int r = 0; r < ROW_STEP; ++r) {
          const float qv = q0[r * D + d];
          acc[r][0] += qv * k_lo;
          acc[r][1] += qv * k_hi;
        }
      }
      for (int r = 0; r < ROW_STEP; ++r) {
        store_lanes(scores + (m + r) * KEY_BLOCK + j, acc[r][0]);
        store_lanes(scores + (m + r) * KEY_BLOCK + j + LANES, acc[r][1]);
      }
    }
  }
}

// acc[rows, D] += probs[rows, KEY_BLOCK] . values[keys, D]: ROW_STEP rows x 2 x LANES dims per
// register block, then ROW_STEP x LANES for a head_dim that is an odd multiple of LANES (every
// supported head_dim is a multiple of 16, so that happens only with 16-float vectors).
template <int D>
void block_values(const float* __restrict__ probs, const float* __restrict__ values, int rows, int keys,
                  float* __restrict__ acc) {
  static_assert(D % LANES == 0, "head_dim must be a whole number of vectors");
  for (int m = 0; m < rows; m += ROW_STEP) {
    int d0 = 0;
    for (; d0 + 2 * LANES <= D; d0 += 2 * LANES) {
      lanes_t sum[ROW_STEP][2];
      for (int r = 0; r < ROW_STEP; ++r) {
        sum[r][0] = load_lanes(acc + (m + r) * D + d0);
        sum[r][1] = load_lanes(acc + (m + r) * D + d0 + LANES);
      }
      for (int j = 0; j < keys; ++j) {
        lanes_t v_lo = load_lanes(values + j * D + d0);
        lanes_t v_hi = load_lanes(values + j * D + d0 + LANES);
        in_register(v_lo);
        in_register(v_hi);
        for (int r = 0; r < ROW_STEP; ++r) {
          const float p = probs[(m + r) * KEY_BLOCK + j];
          sum[r][0] += p * v_lo;
          sum[r][1] += p * v_hi;
        }
      }
      for (int r = 0; r < ROW_STEP; ++r) {
        store_lanes(acc + (m + r) * D + d0, sum[r][0]);
        store_lanes(acc + (m + r) * D + d0 + LANES, sum[r][1]);
      }
    }
    if (d0 < D) {  // D % (2 * LANES) == LANES
      lanes_t sum[ROW_STEP];
      for (int r = 0; r < ROW_STEP; ++r) sum[r] = load_lanes(acc + (m + r) * D + d0);
      for (int j = 0; j < keys; ++j) {
        lanes_t vv = load_lanes(values + j * D + d0);
        in_register(vv);
        for (int r = 0; r < ROW_STEP; ++r) sum[r] += probs[(m + r) * KEY_BLOCK + j] * vv;
      }
      for (int r = 0; r < ROW_STEP; ++r) store_lanes(acc + (m + r) * D + d0, sum[r]);
    }
  }
}

// Per-thread buffers.  kt and values hold one (request, KV head)'s whole visible context,
// gathered through the slot table and widened to float32 once and shared by all its query tiles.
// kt is block-major ([blocks, D, KEY_BLOCK]) so that a block's transposed keys are one
// contiguous 16 KB (at D=32): as one [D, positions] matrix its rows were a power of two apart
// and fell into the same L1 sets.
struct Scratch {
  std::vector<float> qs, acc, scores, kt, values, row_max, row_sum;
  Scratch(int max_rows, int d) : qs(max_rows * d), acc(max_rows * d), scores(max_rows * KEY_BLOCK),
                                 row_max(max_rows), row_sum(max_rows) {}
};

struct Tile {
  int64_t request, head, first_query, queries;
};

// kt (keys transposed per block, zero past `positions` to the block's end) and values[positions, D]
// of one request's first `positions` positions for KV head `head`.
template <typename KV, int D>
void gather_context(const KV* k, const KV* v, const int64_t* request_slots, int64_t slot_base, int64_t kv_heads,
                    int64_t head, int64_t positions, Scratch& s) {
  const int64_t padded = (positions + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  if (static_cast<int64_t>(s.kt.size()) < padded * D) {
    s.kt.resize(padded * D);
    s.values.resize(padded * D);
  }
  float* kt = s.kt.data();
  float* values = s.values.data();
  for (int64_t j = 0; j < positions; ++j) {
    const int64_t row = (slot_base + request_slots[j]) * kv_heads * D + head * D;
    float* kt_column = kt + (j / KEY_BLOCK) * D * KEY_BLOCK + j % KEY_BLOCK;
    for (int d = 0; d < D; ++d) {
      kt_column[d * KEY_BLOCK] = to_float(k[row + d]);
      values[j * D + d] = to_float(v[row + d]);
    }
  }
  for (int64_t j = positions; j < padded; ++j) {
    float* kt_column = kt + (j / KEY_BLOCK) * D * KEY_BLOCK + j % KEY_BLOCK;
    for (int d = 0; d < D; ++d) kt_column[d * KEY_BLOCK] = 0.f;
  }
}

// One tile: `tile.queries` queries of one request (from its `first_query`th new token) with all
// G query heads of KV head `tile.head`.  Row m is query m / G, grouped head m % G.
template <int D>
void attend_tile(const Tile& tile, const float* q, const int64_t* token_starts,
                 const int64_t* cached_lens, int64_t kv_heads, int64_t group, float scale, Scratch& s, float* out) {
  const int rows = static_cast<int>(tile.queries * group);
  const int padded_rows = (rows + ROW_STEP - 1) / ROW_STEP * ROW_STEP;
  const int64_t q_heads = kv_heads * group;
  const int64_t first_token = token_starts[tile.request] + tile.first_query;
  const int64_t first_pos = cached_lens[tile.request] + tile.first_query;
  const int64_t last_pos = first_pos + tile.queries - 1;
  float* qs = s.qs.data();
  float* acc = s.acc.data();
  for (int m = 0; m < padded_rows; ++m) {
    float* dst = qs + m * D;
    if (m < rows) {
      const float* src = q + ((first_token + m / group) * q_heads + tile.head * group + m % group) * D;
      for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
    } else {
      std::memset(dst, 0, sizeof(float) * D);
    }
    std::memset(acc + m * D, 0, sizeof(float) * D);
    s.row_max[m] = NEG_INF;
    s.row_sum[m] = 0.f;
  }
  for (int64_t key0 = 0; key0 <= last_pos; key0 += KEY_BLOCK) {
    const int keys = static_cast<int>(std::min<int64_t>(KEY_BLOCK, last_pos + 1 - key0));
    const int padded_keys = (keys + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
    float* scores = s.scores.data();
    block_scores<D>(qs, s.kt.data() + key0 * D, padded_rows, padded_keys, scores);
    for (int m = 0; m < padded_rows; ++m) {
      float* sm = scores + m * KEY_BLOCK;
      // Keys after the row's own position are masked; padding rows see nothing.
      const int64_t own = m < rows ? first_pos + m / group : -1;
      const int visible = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(keys, own - key0 + 1)));
      if (visible == 0) {
        std::memset(sm, 0, sizeof(float) * keys);
        continue;
      }
      float block_max = NEG_INF;
      int j0 = 0;
      if (visible >= 8) {
        float8 lanes = load8(sm);
        for (j0 = 8; j0 + 8 <= visible; j0 += 8) {
          const float8 x = load8(sm + j0);
          lanes = x > lanes ? x : lanes;
        }
        for (int lane = 0; lane < 8; ++lane) block_max = lanes[lane] > block_max ? lanes[lane] : block_max;
      }
      for (int j = j0; j < visible; ++j) block_max = sm[j] > block_max ? sm[j] : block_max;
      const float old_max = s.row_max[m];
      const float new_max = block_max > old_max ? block_max : old_max;
      // Nothing accumulated before the first visible block: any finite factor is right.
      const float rescale = old_max == NEG_INF ? 0.f : exp_nonpositive(old_max - new_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < visible; ++j) {
        const float p = exp_nonpositive(sm[j] - new_max);
        sm[j] = p;
        sum += p;
      }
      for (int j = visible; j < keys; ++j) sm[j] = 0.f;
      s.row_max[m] = new_max;
      s.row_sum[m] = s.row_sum[m] * rescale + sum;
      if (rescale != 1.f) {
        float* am = acc + m * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) am[d] *= rescale;
      }
    }
    block_values<D>(scores, s.values.data() + key0 * D, padded_rows, keys, acc);
  }
  for (int m = 0; m < rows; ++m) {
    const float inv = s.row_sum[m] > 0.f ? 1.f / s.row_sum[m] : 0.f;
    float* dst = out + ((first_token + m / group) * q_heads + tile.head * group + m % group) * D;
    const float* am = acc + m * D;
    for (int d = 0; d < D; ++d) dst[d] = am[d] * inv;
  }
}

template <typename KV, int D>
void attend_chunks(const float* q, const KV* k, const KV* v, const int64_t* slots, int64_t slot_base,
                   int64_t context, const int64_t* token_starts, const int64_t* new_lens, const int64_t* cached_lens,
                   int64_t batch, int64_t kv_heads, int64_t group, float scale, int threads, float* out) {
  const int64_t tile_queries = std::max<int64_t>(1, ROW_TARGET / group);
  const int max_rows = static_cast<int>((tile_queries * group + ROW_STEP - 1) / ROW_STEP * ROW_STEP);
  const int64_t work = batch * kv_heads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(max_rows, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      if (new_lens[b] == 0) continue;
      gather_context<KV, D>(k, v, slots + b * context, slot_base, kv_heads, h, cached_lens[b] + new_lens[b],
                            scratch);
      for (int64_t first = 0; first < new_lens[b]; first += tile_queries) {
        const Tile tile{b, h, first, std::min(tile_queries, new_lens[b] - first)};
        attend_tile<D>(tile, q, token_starts, cached_lens, kv_heads, group, scale, scratch, out);
      }
    }
  }
}

template <typename KV>
int dispatch(int64_t head_dim, const float* q, const KV* k, const KV* v, const int64_t* slots, int64_t slot_base,
             int64_t context, const int64_t* token_starts, const int64_t* new_lens, const int64_t* cached_lens,
             int64_t batch, int64_t kv_heads, int64_t group, float scale, int threads, float* out) {
  switch (head_dim) {
#define LIGHTLLM_HEAD_DIM(d)                                                                                  \
  case d:                                                                                                     \
    attend_chunks<KV, d>(q, k, v, slots, slot_base, context, token_starts, new_lens, cached_lens, batch,      \
                         kv_heads, group, scale, threads, out);                                               \
    return 0;
    LIGHTLLM_FOR_EACH_HEAD_DIM(LIGHTLLM_HEAD_DIM)
#undef LIGHTLLM_HEAD_DIM
    default:
      return 1;
  }
}

}  // namespace

extern "C" {

// Floats per vector in this build's register-blocked products: 16 with AVX-512, 8 otherwise.
int lightllm_prefill_attention_lanes() { return LANES; }

// Returns 0 on success, 1 for an unsupported head_dim, 2 for a group below 1, 3 for a bad dtype,
// 4 when a request's chunk ends past its slot row (cached_lens + new_lens > context).
// kv_dtype: 0 float32, 1 bfloat16.
int lightllm_prefill_attention(const float* q, const void* k, const void* v, const int64_t* slots, int64_t slot_base,
                               int64_t context, const int64_t* token_starts, const int64_t* new_lens,
                               const int64_t* cached_lens, int64_t batch, int64_t kv_heads, int64_t group,
                               int64_t head_dim, int kv_dtype, float scale, int threads, float* out) {
  if (group < 1) return 2;
  for (int64_t b = 0; b < batch; ++b)
    if (cached_lens[b] < 0 || new_lens[b] < 0 || cached_lens[b] + new_lens[b] > context) return 4;
  if (kv_dtype == 0) {
    return dispatch<float>(head_dim, q, static_cast<const float*>(k), static_cast<const float*>(v), slots, slot_base,
                           context, token_starts, new_lens, cached_lens, batch, kv_heads, group, scale, threads, out);
  }
  if (kv_dtype == 1) {
    return dispatch<uint16_t>(head_dim, q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), slots,
                              slot_base, context, token_starts, new_lens, cached_lens, batch, kv_heads, group, scale,
                              threads, out);
  }
  return 3;
}

}  // extern "C"
