// The elementwise parts of a decoder layer, fused (``--attention_backend cpp``): the residual add
// with the RMSNorm after it, rotary embedding of q and k, and SwiGLU's silu(gate) * up.  Built
// into the same library as the attention kernels by attention/cpp_kernel_build.py (-O3
// -march=native, no fast-math), loaded through ctypes by cpp_layer_ops.py.
//
// Why: in torch each of these is several passes over [tokens, width] tensors (add, cast, square,
// mean, scale, cast, multiply; two multiplies and two multiply-adds per rotary half; silu then
// multiply), each with its own temporary.  Here every row is read and written once.
//
// Numerics follow the torch path of layer_ops.py operation by operation, so a bfloat16
// model rounds where that path rounds: the residual sum to bf16, the normalised value to bf16
// before the weight multiplies it, silu(gate) to bf16 before up multiplies it.  Arithmetic is
// float32 throughout.
//
// Layouts: rows are [rows, width] with a row stride and contiguous elements; activations are
// float32 or bfloat16 (uint16 bits, dtype code 1); cos/sin tables are float32 [tokens, rot_dim]
// whose two halves are equal, so only the first half is read.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/cpp_kernel_vector.h"

namespace {

using lightllm_kernels::exp_nonpositive;
using lightllm_kernels::to_float;

constexpr int DTYPE_FLOAT32 = 0;
constexpr int DTYPE_BFLOAT16 = 1;

template <typename T>
inline T from_float(float value);

template <>
inline float from_float<float>(float value) {
  return value;
}

// Round to nearest even, NaN to the canonical quiet NaN: what torch's float -> bfloat16 cast does.
template <>
inline uint16_t from_float<uint16_t>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return value != value ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
}

// Rounds a float32 result the way storing it in T and reading it back would.
template <typename T>
inline float round_to(float value) {
  return to_float(from_float<T>(value));
}

// silu(x) = x * sigmoid(x).  The exponential only ever sees -|x|, so it cannot overflow: for
// x >= 0 sigmoid is 1 / (1 + e), for x < 0 it is e / (1 + e) with e = exp(-|x|).  Large |x| give
// x and -0 as torch does; NaN stays NaN.
inline float silu(float x) {
  const float e = exp_nonpositive(x < 0.f ? x : -x);
  const float sigmoid = (x < 0.f ? e : 1.f) / (1.f + e);
  return x * sigmoid;
}

template <typename T>
void add_rms_norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden,
                       int64_t residual_stride, int64_t delta_stride, int64_t out_stride, float eps, int threads) {
  const float inverse_hidden = 1.f / static_cast<float>(hidden);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    T* __restrict__ x = residual + row * residual_stride;
    T* __restrict__ y = out + row * out_stride;
    const T* __restrict__ w = weight;
    float sum_squares = 0.f;
    if (delta != nullptr) {
      const T* __restrict__ d = delta + row * delta_stride;
#pragma omp simd reduction(+ : sum_squares)
      for (int64_t i = 0; i < hidden; ++i) {
        // The residual stream is stored in T, so the sum is rounded before it is normalised.
        const T sum = from_float<T>(to_float(x[i]) + to_float(d[i]));
        x[i] = sum;
        const float value = to_float(sum);
        sum_squares += value * value;
      }
    } else {
#pragma omp simd reduction(+ : sum_squares)
      for (int64_t i = 0; i < hidden; ++i) {
        const float value = to_float(x[i]);
        sum_squares += value * value;
      }
    }
    const float inverse_rms = 1.f / std::sqrt(sum_squares * inverse_hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
      const float normed = round_to<T>(to_float(x[i]) * inverse_rms);
      y[i] = from_float<T>(to_float(w[i]) * normed);
    }
  }
}

template <typename T>
void rotary_rows(T* x, const float* cos, const float* sin, int64_t tokens, int64_t heads, int64_t half,
                 int64_t token_stride, int64_t head_stride, int64_t cos_stride, int64_t sin_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* __restrict__ c = cos + t * cos_stride;
    const float* __restrict__ s = sin + t * sin_stride;
    for (int64_t h = 0; h < heads; ++h) {
      T* first = x + t * token_stride + h * head_stride;
      T* second = first + half;
      // The two halves do not overlap, so iterations are independent.
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(first[i]);
        const float x2 = to_float(second[i]);
        first[i] = from_float<T>(x1 * c[i] - x2 * s[i]);
        second[i] = from_float<T>(x2 * c[i] + x1 * s[i]);
      }
    }
  }
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width, int64_t in_stride, int64_t out_stride,
                       int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    // out may be the gate half itself (in place): element i is read before it is written.
    const T* gate = gate_up + row * in_stride;
    const T* __restrict__ up = gate + width;
    T* y = out + row * out_stride;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float activated = round_to<T>(silu(to_float(gate[i])));
      y[i] = from_float<T>(activated * to_float(up[i]));
    }
  }
}

}  // namespace

extern "C" {

// Return codes of every entry point: 0 success, 3 unsupported dtype code, 4 bad shape.

// residual[r] += delta[r] (when delta is not null), then out[r] = weight * RMSNorm(residual[r]).
int lightllm_add_rms_norm(void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                          int64_t hidden, int64_t residual_stride, int64_t delta_stride, int64_t out_stride,
                          float eps, int dtype, int threads) {
  if (rows < 0 || hidden <= 0) return 4;
  if (dtype == DTYPE_FLOAT32) {
    add_rms_norm_rows<float>(static_cast<float*>(residual), static_cast<const float*>(delta),
                             static_cast<const float*>(weight), static_cast<float*>(out), rows, hidden,
                             residual_stride, delta_stride, out_stride, eps, threads);
    return 0;
  }
  if (dtype == DTYPE_BFLOAT16) {
    add_rms_norm_rows<uint16_t>(static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(delta),
                                static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, hidden,
                                residual_stride, delta_stride, out_stride, eps, threads);
    return 0;
  }
  return 3;
}

// Rotates the first rot_dim elements of every head of x [tokens, heads, head_dim] in place
// (NeoX halves: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)); the rest of each head is left alone.
int lightllm_rotary_embedding(void* x, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                              int64_t rot_dim, int64_t token_stride, int64_t head_stride, int64_t cos_stride,
                              int64_t sin_stride, int dtype, int threads) {
  if (tokens < 0 || heads < 0 || rot_dim <= 0 || rot_dim % 2 != 0) return 4;
  const int64_t half = rot_dim / 2;
  if (dtype == DTYPE_FLOAT32) {
    rotary_rows<float>(static_cast<float*>(x), cos, sin, tokens, heads, half, token_stride, head_stride, cos_stride,
                       sin_stride, threads);
    return 0;
  }
  if (dtype == DTYPE_BFLOAT16) {
    rotary_rows<uint16_t>(static_cast<uint16_t*>(x), cos, sin, tokens, heads, half, token_stride, head_stride,
                          cos_stride, sin_stride, threads);
    return 0;
  }
  return 3;
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i]; out may be gate_up (the gate half).
int lightllm_silu_and_mul(const void* gate_up, void* out, int64_t rows, int64_t width, int64_t in_stride,
                          int64_t out_stride, int dtype, int threads) {
  if (rows < 0 || width <= 0) return 4;
  if (dtype == DTYPE_FLOAT32) {
    silu_and_mul_rows<float>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, width, in_stride,
                             out_stride, threads);
    return 0;
  }
  if (dtype == DTYPE_BFLOAT16) {
    silu_and_mul_rows<uint16_t>(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, width,
                                in_stride, out_stride, threads);
    return 0;
  }
  return 3;
}

}  // extern "C"
