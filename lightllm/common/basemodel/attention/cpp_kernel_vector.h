// Helpers shared by the C++ CPU kernels (cpp_slot_attention.cpp, cpp_prefill_attention.cpp,
// ../cpp_layer_ops.cpp): eight-float vectors through GCC/Clang vector extensions, bfloat16 widened
// to float32, an exp that the compiler vectorises, and the head_dim variants the kernels build.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace lightllm_kernels {

// Eight floats in one vector (AVX on x86, two NEON registers on ARM).  Every supported head_dim
// is a multiple of 8.  Written out rather than left to the auto-vectoriser, which kept
// accumulators on the stack and reduced dot products lane by lane.
typedef float float8 __attribute__((vector_size(32)));
typedef uint16_t half8 __attribute__((vector_size(16)));
typedef uint32_t uint8x32 __attribute__((vector_size(32)));

inline float8 load8(const float* p) {
  float8 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}

inline float8 load8(const uint16_t* p) {
  // bfloat16 is the top half of a float32.
  half8 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const uint8x32 wide = __builtin_convertvector(bits, uint8x32) << 16;
  float8 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline void store8(float* p, float8 x) { std::memcpy(p, &x, sizeof(x)); }

// Sixteen floats: one AVX-512 register.  The kernels use it only where the build has AVX-512
// (__AVX512F__), where 8-float vectors ran the products at half the FMA units' width.  Without
// it the compiler splits each operation in two and GCC kept these vectors on the stack (the
// kernels ran several times slower than on 8-float vectors), so they take float8 there.
typedef float float_x16 __attribute__((vector_size(64)));
#if defined(__GNUC__) && !defined(__clang__)
// Without AVX-512 GCC notes that such a value would be passed differently across an ABI
// boundary; every use here is inlined, so there is no boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

inline float_x16 load16(const float* p) {
  float_x16 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}

inline void store16(float* p, const float_x16& x) { std::memcpy(p, &x, sizeof(x)); }

// Sixteen bfloat16 values widened to float32 (two eight-lane widenings side by side).
inline float_x16 load16(const uint16_t* p) {
  const float8 lo = load8(p), hi = load8(p + 8);
  float_x16 out;
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
}

inline float sum8(float8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// The two halves added lane by lane, then those eight.
inline float sum16(const float_x16& x) {
  float8 lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  return sum8(lo + hi);
}

// One element widened to float32: float as is, bfloat16 as the top half of a float32.  Plain
// scalar code, which the compiler vectorises inside ``omp simd`` loops.
inline float to_float(float value) { return value; }

inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// exp(x) for x <= 0 (scores minus their running maximum, or -|x| inside silu), written so that
// the compiler vectorises it (the libm call does not vectorise without -ffast-math, which would
// also drop the infinities the kernels rely on).  Cody-Waite range reduction and a degree-6
// polynomial: relative error about 2e-7, i.e. float precision.  Below -87 the result would leave
// the normal range, so it is 0 there (also for -inf).
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

}  // namespace lightllm_kernels

// The head_dim variants the attention kernels are built for: X(d) once per supported value.
#define LIGHTLLM_FOR_EACH_HEAD_DIM(X) X(16) X(32) X(64) X(80) X(96) X(128) X(256)
