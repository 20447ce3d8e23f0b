/* bfloat16 <-> float32 and fp16 -> float32 conversions shared by the native CPU kernels. */
#ifndef PAGEDLLM_CPU_BF16_H
#define PAGEDLLM_CPU_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline uint16_t load_u16(const uint8_t* p) { /* p need not be aligned */
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

/* The IEEE half at p -> float (normals, subnormals, inf, NaN), exactly. */
static inline float fp16_at(const uint8_t* p) {
  const uint16_t h = load_u16(p);
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else { /* subnormal: normalise */
    exp = 113u;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 float32 -> 16 bf16, rounded as f32_to_bf16 (nearest even, NaN kept quiet, denormals kept,
   unlike vcvtneps2bf16). */
static inline __m256i bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                                   _mm512_set1_epi32(0x7fff)));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_or_si512(hi, _mm512_set1_epi32(64)));
  return _mm512_cvtepi32_epi16(r);
}
#endif

#endif
