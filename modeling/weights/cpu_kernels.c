/* Matrix products on GGUF blocks as they are stored, on an x86-64 CPU with AVX2 and FMA
 * (modeling/weights/cpu_kernels.py builds this file with the machine's C compiler and
 * calls it through ctypes).
 *
 *     y[i, n] = sum_k x[i, k] * w[n, k]      i < M <= SPECD_MAX_ROWS, n < N, k < K
 *
 * w is never materialised: each group of 32 weights is decoded into four registers and
 * used by every row of x before the next group is read, so a token reads the file's
 * bytes once (a 4-bit file: 0.56-0.63 bytes a weight, where rebuilding the float matrix
 * and multiplying it wrote and read 8).
 *
 * Each weight is computed with the very operations, in the very order, of the reference
 * decoders (modeling/weights/gguf_blocks.py, which equal gguf-py's and llama.cpp's bit for
 * bit): integer codes, then the scale products, each rounded as there, e.g. Q4_1 is
 * (q * d) + m and Q4_K is q * (d * sc) - (dmin * m). This file is compiled with
 * -ffp-contract=off so that no multiply and add of a weight are fused into one rounding.
 * Only the order of the sum over k differs from a dense product (as between two BLAS
 * libraries): 8 lanes, then across them.
 *
 * Block layouts: ../shared/models/gguf/README.md and gguf_blocks.py's decoders.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SPECD_KERNELS_VERSION 1
#define SPECD_MAX_ROWS 8

int specd_kernels_version(void) { return SPECD_KERNELS_VERSION; }
int specd_max_rows(void) { return SPECD_MAX_ROWS; }

/* An IEEE half at p (little-endian) as a float, exactly: its magnitude's bits moved to a
 * float's places and scaled by 2^112 (exact for normal and subnormal halves alike). */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t bits = ((uint32_t)(h & 0x7fff) << 13) | ((uint32_t)(h & 0x8000) << 16);
    float f;
    memcpy(&f, &bits, 4);
    return f * 0x1p112f;
}

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* 8 unsigned bytes / 8 int32 lanes as floats (exact). */
static inline __m256 u8_float(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256i u8_int(__m128i v) { return _mm256_cvtepu8_epi32(v); }

/* Low and high nibbles of 16 bytes: elements 0-15 and 16-31 of a 32-run (every 4-bit type
 * stores the low nibbles first). */
static inline void nibbles(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i mask = _mm_set1_epi8(15);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    *lo = _mm_and_si128(q, mask);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
}

/* Bits j0 .. j0+7 of a little-endian u32 as 8 int32 lanes of 0 or 16 (Q5's fifth bits). */
static inline __m256i fifth_bits(uint32_t bits, int j0) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i b = _mm256_srlv_epi32(_mm256_set1_epi32((int)(bits >> j0)), lanes);
    return _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(1)), 4);
}

/* ---- the decoders: group g (32 weights) of one block into w[0..3] ---- */

static inline void dec_q8_0(const uint8_t *b, int g, __m256 w[4]) { /* d, qs i8[32] */
    (void)g;
    __m256 d = _mm256_set1_ps(half_at(b));
    for (int v = 0; v < 4; v++) {
        __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * v));
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
}

static inline void dec_q4_0(const uint8_t *b, int g, __m256 w[4]) { /* d, qs[16] */
    (void)g;
    __m256 d = _mm256_set1_ps(half_at(b));
    __m128i lo, hi;
    nibbles(b + 2, &lo, &hi);
    const __m256i eight = _mm256_set1_epi32(8);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++)
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u8_int(parts[v]), eight)), d);
}

static inline void dec_q4_1(const uint8_t *b, int g, __m256 w[4]) { /* d, m, qs[16] */
    (void)g;
    __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    __m128i lo, hi;
    nibbles(b + 4, &lo, &hi);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++) w[v] = _mm256_add_ps(_mm256_mul_ps(u8_float(parts[v]), d), m);
}

/* Q5_0 / Q5_1: the nibbles plus 16 x bit j of the u32 at byte `qh`. */
static inline void q5_codes(const uint8_t *b, int qh, int qs, __m256i c[4]) {
    uint32_t bits;
    memcpy(&bits, b + qh, 4);
    __m128i lo, hi;
    nibbles(b + qs, &lo, &hi);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++) c[v] = _mm256_add_epi32(u8_int(parts[v]), fifth_bits(bits, 8 * v));
}

static inline void dec_q5_0(const uint8_t *b, int g, __m256 w[4]) { /* d, qh[4], qs[16] */
    (void)g;
    __m256 d = _mm256_set1_ps(half_at(b));
    __m256i c[4];
    q5_codes(b, 2, 6, c);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int v = 0; v < 4; v++)
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c[v], sixteen)), d);
}

static inline void dec_q5_1(const uint8_t *b, int g, __m256 w[4]) { /* d, m, qh[4], qs[16] */
    (void)g;
    __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    __m256i c[4];
    q5_codes(b, 4, 8, c);
    for (int v = 0; v < 4; v++)
        w[v] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c[v]), d), m);
}

/* Q4_K / Q5_K: group g's 6-bit scale and min from the 12 bytes at `s`. */
static inline void k_scale_min(const uint8_t *s, int g, int *sc, int *mn) {
    if (g < 4) {
        *sc = s[g] & 63;
        *mn = s[g + 4] & 63;
    } else {
        *sc = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
        *mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
}

/* Q4_K's and Q5_K's codes of group g (low nibbles of qs[32 (g/2) ..] for even g, high for
 * odd) times (d * sc), minus (dmin * m): each product rounded as the reference does. */
static inline void k_apply(const uint8_t *b, int g, __m256i c[4], __m256 w[4]) {
    int sc, mn;
    k_scale_min(b + 4, g, &sc, &mn);
    float ds = half_at(b) * (float)sc, dm = half_at(b + 2) * (float)mn;
    __m256 vd = _mm256_set1_ps(ds), vm = _mm256_set1_ps(dm);
    for (int v = 0; v < 4; v++) w[v] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c[v]), vd), vm);
}

static inline void k_nibbles(const uint8_t *qs, int g, __m256i c[4]) {
    const __m128i mask = _mm_set1_epi8(15);
    for (int h = 0; h < 2; h++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * (g / 2) + 16 * h));
        __m128i n = (g & 1) ? _mm_and_si128(_mm_srli_epi16(q, 4), mask) : _mm_and_si128(q, mask);
        c[2 * h] = u8_int(n);
        c[2 * h + 1] = u8_int(_mm_srli_si128(n, 8));
    }
}

static inline void dec_q4_k(const uint8_t *b, int g, __m256 w[4]) { /* d, dmin, scales[12], qs[128] */
    __m256i c[4];
    k_nibbles(b + 16, g, c);
    k_apply(b, g, c, w);
}

static inline void dec_q5_k(const uint8_t *b, int g, __m256 w[4]) { /* d, dmin, scales[12], qh[32], qs[128] */
    __m256i c[4];
    k_nibbles(b + 48, g, c);
    /* element 32g + l gains 16 x bit g of qh[l] */
    for (int v = 0; v < 4; v++) {
        __m256i h = u8_int(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * v)));
        h = _mm256_and_si256(_mm256_srli_epi32(h, g), _mm256_set1_epi32(1));
        c[v] = _mm256_add_epi32(c[v], _mm256_slli_epi32(h, 4));
    }
    k_apply(b, g, c, w);
}

static inline void dec_q6_k(const uint8_t *b, int g, __m256 w[4]) { /* ql[128], qh[64], scales i8[16], d */
    /* Element e = 128 h + 32 k + l (group g = 4 h + k): low 4 bits from ql[64 h + 32 (k % 2) + l]
     * (its high nibble when k >= 2), high 2 bits from qh[32 h + l] >> 2k; minus 32; times
     * (d * scale[e / 16]). */
    int h = g / 4, k = g % 4;
    const uint8_t *ql = b + 64 * h + 32 * (k % 2), *qh = b + 128 + 32 * h;
    float d = half_at(b + 208);
    const __m256i mask = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
    const __m256i thirty_two = _mm256_set1_epi32(32);
    for (int v = 0; v < 4; v++) {
        __m256i lo = u8_int(_mm_loadl_epi64((const __m128i *)(ql + 8 * v)));
        lo = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * (k / 2)), mask);
        __m256i hi = u8_int(_mm_loadl_epi64((const __m128i *)(qh + 8 * v)));
        hi = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * k), three);
        __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), thirty_two);
        float scale = d * (float)(int8_t)b[192 + 2 * g + v / 2];
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale));
    }
}

static inline __m256 iq4_values(__m128i codes) { /* 8 nibbles → the IQ4 code book's values */
    const __m128i book = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                       53, 69, 89, 113);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(book, codes)));
}

static inline void dec_iq4_nl(const uint8_t *b, int g, __m256 w[4]) { /* d, qs[16] */
    (void)g;
    __m256 d = _mm256_set1_ps(half_at(b));
    __m128i lo, hi;
    nibbles(b + 2, &lo, &hi);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(iq4_values(parts[v]), d);
}

static inline void dec_iq4_xs(const uint8_t *b, int g, __m256 w[4]) { /* d, scales_h u16, scales_l[4], qs[128] */
    int low = (b[4 + g / 2] >> (4 * (g % 2))) & 15;
    int high = (b[2 + g / 4] >> (2 * (g % 4))) & 3;
    float scale = half_at(b) * (float)((low | (high << 4)) - 32);
    __m256 d = _mm256_set1_ps(scale);
    __m128i lo, hi;
    nibbles(b + 8 + 16 * g, &lo, &hi);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(iq4_values(parts[v]), d);
}

/* ---- the product, one function per type ----
 * x: (M, K) rows ldx apart; blocks: (N, row_bytes); y: (M, N) rows ldy apart. One row of x
 * keeps four accumulators (four independent chains of fused multiply-adds); several rows
 * keep one each. */
#define GEMV(NAME, BLOCK_BYTES, GROUPS)                                                        \
    void specd_gemv_##NAME(const float *x, int64_t ldx, const uint8_t *blocks,               \
                           int64_t row_bytes, float *y, int64_t ldy, int64_t M, int64_t N,    \
                           int64_t K) {                                                       \
        const int64_t nblocks = K / (32 * (GROUPS));                                          \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const uint8_t *row = blocks + n * row_bytes;                                      \
            __m256 w[4];                                                                      \
            if (M == 1) {                                                                     \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                   \
                for (int64_t blk = 0; blk < nblocks; blk++)                                   \
                    for (int g = 0; g < (GROUPS); g++) {                                      \
                        dec_##NAME(row + blk * (BLOCK_BYTES), g, w);                          \
                        const float *xk = x + (blk * (GROUPS) + g) * 32;                      \
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xk), w[0], a0);                  \
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), w[1], a1);              \
                        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), w[2], a2);             \
                        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), w[3], a3);             \
                    }                                                                         \
                y[n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));     \
                continue;                                                                     \
            }                                                                                 \
            __m256 acc[SPECD_MAX_ROWS];                                                       \
            for (int64_t i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();                     \
            for (int64_t blk = 0; blk < nblocks; blk++)                                       \
                for (int g = 0; g < (GROUPS); g++) {                                          \
                    dec_##NAME(row + blk * (BLOCK_BYTES), g, w);                              \
                    const int64_t k = (blk * (GROUPS) + g) * 32;                              \
                    for (int64_t i = 0; i < M; i++) {                                         \
                        const float *xk = x + i * ldx + k;                                    \
                        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xk), w[0]);                  \
                        s = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), w[1], s);                \
                        s = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), w[2], s);               \
                        s = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), w[3], s);               \
                        acc[i] = _mm256_add_ps(acc[i], s);                                    \
                    }                                                                         \
                }                                                                             \
            for (int64_t i = 0; i < M; i++) y[i * ldy + n] = hsum(acc[i]);                    \
        }                                                                                     \
    }

GEMV(q8_0, 34, 1)
GEMV(q4_0, 18, 1)
GEMV(q4_1, 20, 1)
GEMV(q5_0, 22, 1)
GEMV(q5_1, 24, 1)
GEMV(q4_k, 144, 8)
GEMV(q5_k, 176, 8)
GEMV(q6_k, 210, 8)
GEMV(iq4_nl, 18, 1)
GEMV(iq4_xs, 136, 8)
