/* fp32 -> bf16 rounding as PyTorch's cast does it: to nearest, ties to even; a NaN becomes 0xffff, as PyTorch's
 * vectorised casts make it (its scalar cast writes 0x7fc0).  Every value's bits otherwise equal PyTorch's, fp32
 * subnormals included (no flush to zero, unlike AVX512-BF16's conversion instruction).
 *
 * bf16_of: one value; bf16_of16 (AVX-512): 16 values packed into 16-bit lanes; bf16_of8 (AVX2): 8 values.
 * Needs <stdint.h>, <string.h> and, for the vector forms, <immintrin.h> included first. */
#ifndef AGENTSERVE_BF16_ROUND_H
#define AGENTSERVE_BF16_ROUND_H

static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
static inline __m256i bf16_of16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0xffff));
    return _mm512_cvtepi32_epi16(r);
}
#endif

#if defined(__AVX2__)
static inline __m128i bf16_of8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), nan);
    /* every lane fits 16 bits: the unsigned saturation never acts */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

#endif
