// Attention of a few queries per request over the request's KV, read in place from the token-slot
// cache (``--attention_backend cpp``).  Built on first use by cpp_kernel_build.py with the
// system C++ compiler for the machine it runs on (-O3 -march=native), loaded through ctypes.
//
// Why a hand-written loop: decode reads every cached key and value once and does two short dot
// products per position, so its speed is the memory traffic.  The gather + SDPA path copies the
// context out of the cache first (three times the traffic); the inductor kernel reads in place but
// reduces each head_dim dot product horizontally in its innermost loop and materialises the
// scores, which measured 6x below the machine's bandwidth.  Here each (request, KV head) walks its
// positions in blocks: scores for a block, one max and rescale per block (online softmax), then
// the block's values, with head_dim a compile-time constant so every row is a few vector FMAs.
//
// Layouts (all contiguous, row-major):
//   q      [B, T, H_kv, G, D] float32   G query heads share one KV head
//   k, v   [rows, H_kv, D]    float32 or bfloat16 (uint16 bits): a layer is rows slot_base + slot
//   slots  [B, L] int64       slot of each context position of each request
//   q_pos  [B, T] int64       a query at position p sees context positions 0..p (p < L)
//   out    [B, T, H_kv, G, D] float32

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpp_kernel_vector.h"

namespace {

using lightllm_kernels::exp_nonpositive;

constexpr int BLOCK = 32;  // positions per online-softmax block

// The vectors the dot products and value sums run on, as wide as the build's registers.  With
// AVX-512, sixteen floats: half the loads, FMAs and lane reductions of eight-float ones (one
// thread over 64 x 1,024 positions ran 4-8% faster; two threads are bound by the KV reads either
// way).  Without it, eight: the compiler splits each sixteen-float operation in two and GCC kept
// the 64-byte accumulators and query vectors on the stack, and a -march=haswell (AVX2 + FMA)
// build ran 3-9x slower than the AVX-512 one and up to 2.7x slower than torch's gather + SDPA;
// on eight-float vectors it takes 0.98-1.20x the AVX-512 build's time.  Every supported head_dim is a
// multiple of 16, so either width divides it.
#if defined(__AVX512F__)
constexpr int LANES = 16;
using lanes_t = lightllm_kernels::float_x16;
template <typename T>
inline lanes_t load_lanes(const T* p) { return lightllm_kernels::load16(p); }
inline void store_lanes(float* p, const lanes_t& x) { lightllm_kernels::store16(p, x); }
inline float sum_lanes(const lanes_t& x) { return lightllm_kernels::sum16(x); }
#else
constexpr int LANES = 8;
using lanes_t = lightllm_kernels::float8;
template <typename T>
inline lanes_t load_lanes(const T* p) { return lightllm_kernels::load8(p); }
inline void store_lanes(float* p, const lanes_t& x) { lightllm_kernels::store8(p, x); }
inline float sum_lanes(const lanes_t& x) { return lightllm_kernels::sum8(x); }
#endif

// One (request, query): every KV head at once, so that each cached row (all heads of a
// position, contiguous) is read from memory once.
template <typename KV, int D, int G>
void attend_query(const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v,
                  const int64_t* __restrict__ slots, int64_t slot_base, int64_t positions, int64_t kv_heads,
                  float scale, float* __restrict__ work, float* __restrict__ out) {
  // __restrict__: with float K/V, stores to the scores and sums could otherwise alias the cache
  // rows, and the compiler reloaded rows after every store (fp32 ran 3x slower than bf16).
  const int64_t row_stride = kv_heads * D;
  const int64_t heads = kv_heads * G;  // query heads, KV head major
  float* qs = work;                        // [heads, D]
  float* acc = qs + heads * D;             // [heads, D]
  float* scores = acc + heads * D;         // [heads, BLOCK]
  float* running_max = scores + heads * BLOCK;
  float* running_sum = running_max + heads;
  for (int64_t i = 0; i < heads; ++i) {
    running_max[i] = -std::numeric_limits<float>::infinity();
    running_sum[i] = 0.f;
  }
  for (int64_t i = 0; i < heads * D; ++i) {
    acc[i] = 0.f;
    qs[i] = q[i] * scale;
  }
  for (int64_t first = 0; first < positions; first += BLOCK) {
    const int n = static_cast<int>(positions - first < BLOCK ? positions - first : BLOCK);
    // Row pointers of the block: the slot table is read once per block, not once per head.
    const KV* __restrict__ key_rows[BLOCK];
    const KV* __restrict__ value_rows[BLOCK];
    for (int j = 0; j < n; ++j) {
      const int64_t row = (slot_base + slots[first + j]) * row_stride;
      key_rows[j] = k + row;
      value_rows[j] = v + row;
    }
    // Rows of the next block are fetched while this one computes: with K and V in separate
    // buffers and the slot table between them, the hardware prefetcher alone left the loop
    // waiting on memory.  The requests are spread over the block's dot products (each head's pass
    // asks for its share of every next row's cache lines): issued all at once at the block's
    // start they overflowed the core's outstanding-miss slots and most were dropped (one thread,
    // 64 rows over 1,024 positions of the small demo model: 8.3 -> 14.1 GB/s of KV).
    const int64_t after = positions - (first + BLOCK);
    const int next_n = static_cast<int>(after <= 0 ? 0 : (after < BLOCK ? after : BLOCK));
    int64_t next_rows[BLOCK];  // element offsets, read from the slot table once per block
    for (int j = 0; j < next_n; ++j) next_rows[j] = (slot_base + slots[first + BLOCK + j]) * row_stride;
    const int64_t lines = (row_stride * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
    // Head outer, position inner: a block's rows (BLOCK x all heads) stay in L1 across heads,
    // and each query head's dot products run back to back.
    static_assert(D % LANES == 0, "every head_dim variant is a whole number of vectors");
    constexpr int V = D / LANES;  // vectors per head_dim row
    for (int64_t h = 0; h < kv_heads; ++h) {
      lanes_t qv[G][V];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < V; ++c) qv[g][c] = load_lanes(qs + (h * G + g) * D + LANES * c);
      float* __restrict__ sh = scores + h * G * BLOCK;
      const int64_t line_lo = lines * h / kv_heads, line_hi = lines * (h + 1) / kv_heads;
      for (int j = 0; j < n; ++j) {
        if (j < next_n) {
          const char* key_bytes = reinterpret_cast<const char*>(k + next_rows[j]);
          const char* value_bytes = reinterpret_cast<const char*>(v + next_rows[j]);
          for (int64_t line = line_lo; line < line_hi; ++line) {
            __builtin_prefetch(key_bytes + 64 * line);
            __builtin_prefetch(value_bytes + 64 * line);
          }
        }
        const KV* __restrict__ key = key_rows[j] + h * D;
        lanes_t dot[G] = {};
        for (int c = 0; c < V; ++c) {
          const lanes_t kc = load_lanes(key + LANES * c);
          for (int g = 0; g < G; ++g) dot[g] += qv[g][c] * kc;
        }
        for (int g = 0; g < G; ++g) sh[g * BLOCK + j] = sum_lanes(dot[g]);
      }
    }
    for (int64_t i = 0; i < heads; ++i) {
      float* si = scores + i * BLOCK;
      float block_max = si[0];
      for (int j = 1; j < n; ++j) block_max = si[j] > block_max ? si[j] : block_max;
      const float new_max = block_max > running_max[i] ? block_max : running_max[i];
      // exp(-inf) on the first block: nothing accumulated yet, any finite factor is right.
      const float rescale = running_max[i] == -std::numeric_limits<float>::infinity()
                                ? 0.f
                                : exp_nonpositive(running_max[i] - new_max);
      running_max[i] = new_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) {
        const float p = exp_nonpositive(si[j] - new_max);
        si[j] = p;
        sum += p;
      }
      running_sum[i] = running_sum[i] * rescale + sum;
      float* ai = acc + i * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ai[d] *= rescale;
    }
    // A head's weighted values accumulate in vectors that stay in registers over the block.
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* __restrict__ ph = scores + h * G * BLOCK;
      lanes_t sum[G][V] = {};
      for (int j = 0; j < n; ++j) {
        const KV* __restrict__ value = value_rows[j] + h * D;
        for (int c = 0; c < V; ++c) {
          const lanes_t vc = load_lanes(value + LANES * c);
          for (int g = 0; g < G; ++g) sum[g][c] += ph[g * BLOCK + j] * vc;
        }
      }
      float* __restrict__ ah = acc + h * G * D;
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < V; ++c) {
          float* __restrict__ a = ah + g * D + LANES * c;
          store_lanes(a, load_lanes(a) + sum[g][c]);
        }
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    const float inv = running_sum[i] > 0.f ? 1.f / running_sum[i] : 0.f;
    for (int d = 0; d < D; ++d) out[i * D + d] = acc[i * D + d] * inv;
  }
}

template <typename KV, int D, int G>
void attend_all(const float* q, const KV* k, const KV* v, const int64_t* slots, int64_t slot_base,
                const int64_t* q_pos, int64_t batch, int64_t queries, int64_t context, int64_t kv_heads,
                float scale, int threads, float* out) {
  const int64_t work = batch * queries;
  const int64_t heads = kv_heads * G;
  const int64_t work_floats = heads * (2 * D + BLOCK + 2);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scratch(static_cast<size_t>(work_floats));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bt = 0; bt < work; ++bt) {
      const int64_t b = bt / queries;
      int64_t positions = q_pos[bt] + 1;
      if (positions > context) positions = context;
      const int64_t offset = bt * heads * D;
      attend_query<KV, D, G>(q + offset, k, v, slots + b * context, slot_base, positions, kv_heads, scale,
                             scratch.data(), out + offset);
    }
  }
}

template <typename KV, int D>
int dispatch_group(int64_t group, const float* q, const KV* k, const KV* v, const int64_t* slots,
                   int64_t slot_base, const int64_t* q_pos, int64_t batch, int64_t queries, int64_t context,
                   int64_t kv_heads, float scale, int threads, float* out) {
  switch (group) {
#define LIGHTLLM_GROUP(g)                                                                                  \
  case g:                                                                                                  \
    attend_all<KV, D, g>(q, k, v, slots, slot_base, q_pos, batch, queries, context, kv_heads, scale, threads, \
                         out);                                                                             \
    return 0;
    LIGHTLLM_GROUP(1)
    LIGHTLLM_GROUP(2)
    LIGHTLLM_GROUP(3)
    LIGHTLLM_GROUP(4)
    LIGHTLLM_GROUP(5)
    LIGHTLLM_GROUP(6)
    LIGHTLLM_GROUP(7)
    LIGHTLLM_GROUP(8)
    LIGHTLLM_GROUP(16)
#undef LIGHTLLM_GROUP
    default:
      return 2;
  }
}

template <typename KV>
int dispatch(int64_t head_dim, int64_t group, const float* q, const KV* k, const KV* v, const int64_t* slots,
             int64_t slot_base, const int64_t* q_pos, int64_t batch, int64_t queries, int64_t context,
             int64_t kv_heads, float scale, int threads, float* out) {
  switch (head_dim) {
#define LIGHTLLM_HEAD_DIM(d)                                                                                \
  case d:                                                                                                   \
    return dispatch_group<KV, d>(group, q, k, v, slots, slot_base, q_pos, batch, queries, context, kv_heads, \
                                 scale, threads, out);
    LIGHTLLM_FOR_EACH_HEAD_DIM(LIGHTLLM_HEAD_DIM)
#undef LIGHTLLM_HEAD_DIM
    default:
      return 1;
  }
}

}  // namespace

extern "C" {

// Floats per vector in this build's dot products and value sums: 16 with AVX-512, 8 otherwise.
int lightllm_slot_attention_lanes() { return LANES; }

// Supported shapes: head_dim in {16, 32, 64, 80, 96, 128, 256}, group in 1..8 or 16.
int lightllm_slot_attention_supports(int64_t head_dim, int64_t group) {
  bool dim_ok = false;
#define LIGHTLLM_HEAD_DIM_MATCHES(d) dim_ok = dim_ok || head_dim == d;
  LIGHTLLM_FOR_EACH_HEAD_DIM(LIGHTLLM_HEAD_DIM_MATCHES)
#undef LIGHTLLM_HEAD_DIM_MATCHES
  const bool group_ok = (group >= 1 && group <= 8) || group == 16;
  return dim_ok && group_ok;
}

// Returns 0 on success, 1 for an unsupported head_dim, 2 for an unsupported group, 3 for a bad dtype.
// kv_dtype: 0 float32, 1 bfloat16.
int lightllm_slot_attention(const float* q, const void* k, const void* v, const int64_t* slots, int64_t slot_base,
                            const int64_t* q_pos, int64_t batch, int64_t queries, int64_t context, int64_t kv_heads,
                            int64_t group, int64_t head_dim, int kv_dtype, float scale, int threads, float* out) {
  if (kv_dtype == 0) {
    return dispatch<float>(head_dim, group, q, static_cast<const float*>(k), static_cast<const float*>(v), slots,
                           slot_base, q_pos, batch, queries, context, kv_heads, scale, threads, out);
  }
  if (kv_dtype == 1) {
    return dispatch<uint16_t>(head_dim, group, q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
                              slots, slot_base, q_pos, batch, queries, context, kv_heads, scale, threads, out);
  }
  return 3;
}

}  // extern "C"
