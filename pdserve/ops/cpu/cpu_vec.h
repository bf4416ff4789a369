// Numerics shared by the CPU kernels (cpu_ops.cpp, cpu_attention.cpp, the paged-attention kernels,
// cpu_gemv.cpp): e^x by Cephes' polynomial and bf16 <-> fp32, in scalar, 8-lane and 16-lane forms
// that do the same operations in the same order. Each caller keeps its own range handling (softmax
// needs x <= 0 with -inf giving 0; silu the whole finite range), not the polynomial.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pdserve_vec {

// e^x = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2, ln 2 split in two so that r is
// exact; e^r = 1 + r + r^2 P(r) (Cephes' expf, ~1 ulp for |r| <= ln 2 / 2).
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float EXP_P0 = 1.9875691500e-4f, EXP_P1 = 1.3981999507e-3f, EXP_P2 = 8.3334519073e-3f;
constexpr float EXP_P3 = 4.1665795894e-2f, EXP_P4 = 1.6666665459e-1f, EXP_P5 = 5.0000001201e-1f;

// e^r for r = x - n ln 2: the polynomial part of e^x, before the scaling by 2^n.
inline float exp_reduced(float x, float n) {
  float r = x - n * LN2_HI;
  r = r - n * LN2_LO;
  float p = EXP_P0;
  p = p * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  return p * (r * r) + r + 1.0f;
}

inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// fp32 -> bf16: round to nearest even, NaN kept (quiet), as c10::BFloat16 does; in integer
// arithmetic so that gcc vectorizes the loops that call it.
inline uint16_t bf16_bits(float f) {
  const uint32_t u = to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float from_bf16_bits(uint16_t b) { return from_bits(static_cast<uint32_t>(b) << 16); }

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_reduced(__m256 x, __m256 n) {
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
  return _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

// 8 bf16 -> 8 fp32 (a bf16 is the top half of an fp32).
inline __m256 from_bf16x8(const void* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp_reduced(__m512 x, __m512 n) {
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
  return _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}

// 16 bf16 <-> 16 fp32; to_bf16x16 rounds as bf16_bits does.
inline __m512 from_bf16x16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }
inline __m512 from_bf16x16(const void* p) { return from_bf16x16(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }

inline __m256i to_bf16x16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
      16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, is_nan, nan));
}
#endif

#if defined(__AVX512BF16__)
// The bf16 pair type of the dot-product instructions, to and from its bits (same 64 bytes).
inline __m512bh as_bh(__m512i v) {
  __m512bh b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

inline __m512i bh_bits(__m512bh b) {
  __m512i v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}
#endif

}  // namespace pdserve_vec
