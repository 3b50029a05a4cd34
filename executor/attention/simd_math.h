/* What the CPU attention kernels share below the level of attention: the forced-inline marker, the polynomial of
 * their e^x (any vector width), on AVX2 + FMA the 8-wide cache load and e^x of non-positive arguments, and on AVX-512
 * the 16-wide cache load.
 */
#ifndef AGENTSERVE_SIMD_MATH_H
#define AGENTSERVE_SIMD_MATH_H

#define INLINE static inline __attribute__((always_inline))

/* 2^f for |f| <= 0.5 in any vector width (`fmadd`, `set1` its intrinsics): a degree-6 fit by Horner's rule,
 * relative error ~1e-7, exactly 1 at f = 0.  The kernels' e^x = 2^n * 2^f with n = round(x log2 e). */
#define EXP2_FRACTION(fmadd, set1, f)                                                                             \
    fmadd(fmadd(fmadd(fmadd(fmadd(fmadd(set1(1.5353362e-4f), f, set1(1.3398874e-3f)), f, set1(9.6184875e-3f)), f, \
                            set1(5.5503324e-2f)),                                                                 \
                      f, set1(2.4022652e-1f)),                                                                    \
                f, set1(6.9314718e-1f)),                                                                          \
          f, set1(1.0f))

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 cache elements from p as floats: fp16 when `f16` (a constant at every call; needs F16C), else fp32. */
INLINE __m256 load8(const void *p, const int f16) {
#ifdef __F16C__
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    (void)f16;
#endif
    return _mm256_loadu_ps((const float *)p);
}

/* e^x for x <= 0 (lanes far below give 0 or a negligible positive; exactly 1 at 0): 2^n * 2^f. */
INLINE __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    const __m256 p = EXP2_FRACTION(_mm256_fmadd_ps, _mm256_set1_ps, f);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 cache elements from p as floats: fp16 when `f16` (a constant at every call), else fp32. */
INLINE __m512 load16(const void *p, const int f16) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps((const float *)p);
}
#endif

#endif
