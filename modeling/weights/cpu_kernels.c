/* Matrix products on GGUF blocks as they are stored, on an x86-64 CPU with AVX2 and FMA
 * (modeling/weights/cpu_kernels.py builds this file with the machine's C compiler and
 * calls it through ctypes).
 *
 *     y[i, n] = sum_k x[i, k] * w[n, k]      i < M <= SPECD_MAX_PRODUCT_ROWS, n < N, k < K
 *
 * w is never materialised: each group of 32 weights is decoded into four registers and
 * used by every row of x before the next group is read, so a token reads the file's
 * bytes once (a 4-bit file: 0.56-0.63 bytes a weight, where rebuilding the float matrix
 * and multiplying it wrote and read 8).
 *
 * Every reference decoder (modeling/weights/gguf_blocks.py, equal to gguf-py's and
 * llama.cpp's bit for bit) computes a weight as fl(fl(c * s) + o): exact integer codes c
 * (offsets such as -8 applied), the group's scale s and offset o as products rounded as
 * there (Q4_1: s = d, o = m; Q4_K: s = d * sc, o = -(dmin * m)). The product factors the
 * scale and offset out of the group: sum(x c) s + o sum(x). That rounds as a different
 * summation order would (as between two BLAS libraries), and for a one-hot x it is the
 * weight itself bit for bit, which the tests check for every type. The scales are
 * computed with -ffp-contract=off, as the reference's separate roundings.
 *
 * Block layouts: ../shared/models/gguf/README.md and gguf_blocks.py's decoders.
 */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define SPECD_KERNELS_VERSION 11
#define SPECD_MAX_ROWS 8          /* a norm's or an attention's rows; a product's chunk */
#define SPECD_MAX_PRODUCT_ROWS 72 /* a product's rows (a budget-64 tree and its root), in chunks of SPECD_MAX_ROWS */

int specd_kernels_version(void) { return SPECD_KERNELS_VERSION; }
int specd_max_rows(void) { return SPECD_MAX_ROWS; }
int specd_max_product_rows(void) { return SPECD_MAX_PRODUCT_ROWS; }

/* An IEEE half at p (little-endian) as a float, exactly (F16C's conversion, which every
 * AVX2 CPU has). */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A bfloat16 at p as a float, exactly (its bits are a float's top half). */
static inline float bf16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
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

/* ---- the decoders: group g (32 weights) of one block ----
 * Each gives the group's codes as exact floats c[0..3] (8 weights each, offsets such as -8
 * applied), the scale of c[0..1] and of c[2..3] (s[0], s[1]; equal but for Q6_K, whose
 * scales cover 16 weights) and the group's offset o, such that the reference decoder's
 * weight is fl(fl(c * s) + o): one rounding for the product, one for the offset (none
 * where o is 0). */

typedef struct {
    __m256 c[4];
    float s[2];
    float o;
    float o2; /* Q2_K alone: the offset of c[2..3] (o is then c[0..1]'s), see SCALES 5 */
} group_t;

static inline void dec_q8_0(const uint8_t *b, int g, group_t *q) { /* d, qs i8[32] */
    (void)g;
    for (int v = 0; v < 4; v++) {
        __m128i x = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * v));
        q->c[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    }
    q->s[0] = q->s[1] = half_at(b);
    q->o = 0.0f;
}

/* The 32 codes of 16 bytes of nibbles as int32 lanes, minus `offset`: each 8 bytes widened
 * once give 8 low nibbles (elements j..j+7) and 8 high ones (elements 16+j..16+j+7). */
static inline void nibble_ints(const uint8_t *qs, int offset, __m256i c[4]) {
    const __m256i mask = _mm256_set1_epi32(15), off = _mm256_set1_epi32(offset);
    for (int h = 0; h < 2; h++) {
        __m256i v = u8_int(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
        c[h] = _mm256_sub_epi32(_mm256_and_si256(v, mask), off);
        c[2 + h] = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), off);
    }
}

static inline void nibble_codes(const uint8_t *qs, int offset, __m256 c[4]) {
    __m256i n[4];
    nibble_ints(qs, offset, n);
    for (int v = 0; v < 4; v++) c[v] = _mm256_cvtepi32_ps(n[v]);
}

static inline void dec_q4_0(const uint8_t *b, int g, group_t *q) { /* d, qs[16] */
    (void)g;
    nibble_codes(b + 2, 8, q->c);
    q->s[0] = q->s[1] = half_at(b);
    q->o = 0.0f;
}

/* Q4_Z, specd's own (gguf_blocks.py): Q4_0's nibbles less the block's own zero point z,
 * for AWQ's and asymmetric GPTQ's and compressed-tensors' 4-bit weights (c = q - z). */
static inline void dec_q4_z(const uint8_t *b, int g, group_t *q) { /* d, z u8, qs[16] */
    (void)g;
    nibble_codes(b + 3, b[2], q->c);
    q->s[0] = q->s[1] = half_at(b);
    q->o = 0.0f;
}

/* Q4_0B, Q8_0B, Q4_ZB (specd's own): Q4_0, Q8_0 and Q4_Z with a bf16 scale. */
static inline void dec_q4_0b(const uint8_t *b, int g, group_t *q) {
    dec_q4_0(b, g, q);
    q->s[0] = q->s[1] = bf16_at(b);
}

static inline void dec_q8_0b(const uint8_t *b, int g, group_t *q) {
    dec_q8_0(b, g, q);
    q->s[0] = q->s[1] = bf16_at(b);
}

static inline void dec_q4_zb(const uint8_t *b, int g, group_t *q) {
    dec_q4_z(b, g, q);
    q->s[0] = q->s[1] = bf16_at(b);
}

static inline void dec_q4_1(const uint8_t *b, int g, group_t *q) { /* d, m, qs[16] */
    (void)g;
    nibble_codes(b + 4, 0, q->c);
    q->s[0] = q->s[1] = half_at(b);
    q->o = half_at(b + 2);
}

/* Q5_0 / Q5_1: the nibbles plus 16 x bit j of the u32 at byte `qh`, minus `offset`. */
static inline void q5_codes(const uint8_t *b, int qh, int qs, int offset, __m256 c[4]) {
    /* The 32 codes as bytes in element order, then widened 8 at a time: the nibbles (low
     * ones elements 0-15, high ones 16-31) plus 16 where bit e of the u32 at `qh` is set,
     * the bits spread to one byte each (byte e of a broadcast's shuffle, masked by its bit). */
    uint32_t bits;
    memcpy(&bits, b + qh, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + qs)), low = _mm_set1_epi8(15);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                         3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
    const __m256i codes = _mm256_add_epi8(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    const __m128i first = _mm256_castsi256_si128(codes), second = _mm256_extracti128_si256(codes, 1);
    const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
    const __m256i off = _mm256_set1_epi32(offset);
    for (int v = 0; v < 4; v++) c[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(u8_int(parts[v]), off));
}

static inline void dec_q5_0(const uint8_t *b, int g, group_t *q) { /* d, qh[4], qs[16] */
    (void)g;
    q5_codes(b, 2, 6, 16, q->c);
    q->s[0] = q->s[1] = half_at(b);
    q->o = 0.0f;
}

static inline void dec_q5_1(const uint8_t *b, int g, group_t *q) { /* d, m, qh[4], qs[16] */
    (void)g;
    q5_codes(b, 4, 8, 0, q->c);
    q->s[0] = q->s[1] = half_at(b);
    q->o = half_at(b + 2);
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

/* Q4_K's and Q5_K's weight: q * (d * sc) - (dmin * m), each product rounded. */
static inline void k_scales(const uint8_t *b, int g, group_t *q) {
    int sc, mn;
    k_scale_min(b + 4, g, &sc, &mn);
    q->s[0] = q->s[1] = half_at(b) * (float)sc;
    q->o = -(half_at(b + 2) * (float)mn);
}

/* Group g's codes: low nibbles of qs[32 (g / 2) ..] for even g, high ones for odd. */
static inline void k_nibbles(const uint8_t *qs, int g, __m256i c[4]) {
    const __m256i mask = _mm256_set1_epi32(15);
    const int shift = 4 * (g & 1);
    for (int v = 0; v < 4; v++) {
        __m256i x = u8_int(_mm_loadl_epi64((const __m128i *)(qs + 32 * (g / 2) + 8 * v)));
        c[v] = _mm256_and_si256(_mm256_srli_epi32(x, shift), mask);
    }
}

static inline void dec_q4_k(const uint8_t *b, int g, group_t *q) { /* d, dmin, scales[12], qs[128] */
    __m256i c[4];
    k_nibbles(b + 16, g, c);
    for (int v = 0; v < 4; v++) q->c[v] = _mm256_cvtepi32_ps(c[v]);
    k_scales(b, g, q);
}

static inline void dec_q5_k(const uint8_t *b, int g, group_t *q) { /* d, dmin, scales[12], qh[32], qs[128] */
    __m256i c[4];
    k_nibbles(b + 48, g, c);
    /* element 32g + l gains 16 x bit g of qh[l] */
    for (int v = 0; v < 4; v++) {
        __m256i h = u8_int(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * v)));
        h = _mm256_and_si256(_mm256_srli_epi32(h, g), _mm256_set1_epi32(1));
        q->c[v] = _mm256_cvtepi32_ps(_mm256_add_epi32(c[v], _mm256_slli_epi32(h, 4)));
    }
    k_scales(b, g, q);
}

/* Groups g and g + 1 (g even) of a Q4_K / Q5_K block: the low and the high nibbles of the
 * same 32 bytes, widened once for both. */
static inline void k_nibble_pair(const uint8_t *qs, int g, __m256i lo[4], __m256i hi[4]) {
    const __m256i mask = _mm256_set1_epi32(15);
    for (int v = 0; v < 4; v++) {
        __m256i x = u8_int(_mm_loadl_epi64((const __m128i *)(qs + 32 * (g / 2) + 8 * v)));
        lo[v] = _mm256_and_si256(x, mask);
        hi[v] = _mm256_srli_epi32(x, 4);
    }
}

static inline void pair_q4_k(const uint8_t *b, int g, group_t *q, group_t *r) {
    __m256i lo[4], hi[4];
    k_nibble_pair(b + 16, g, lo, hi);
    for (int v = 0; v < 4; v++) {
        q->c[v] = _mm256_cvtepi32_ps(lo[v]);
        r->c[v] = _mm256_cvtepi32_ps(hi[v]);
    }
    k_scales(b, g, q);
    k_scales(b, g + 1, r);
}

static inline void pair_q5_k(const uint8_t *b, int g, group_t *q, group_t *r) {
    __m256i lo[4], hi[4];
    k_nibble_pair(b + 48, g, lo, hi);
    const __m256i one = _mm256_set1_epi32(1);
    for (int v = 0; v < 4; v++) {
        __m256i h = u8_int(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * v)));
        __m256i hq = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, g), one), 4);
        __m256i hr = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, g + 1), one), 4);
        q->c[v] = _mm256_cvtepi32_ps(_mm256_add_epi32(lo[v], hq));
        r->c[v] = _mm256_cvtepi32_ps(_mm256_add_epi32(hi[v], hr));
    }
    k_scales(b, g, q);
    k_scales(b, g + 1, r);
}

static inline void dec_q6_k(const uint8_t *b, int g, group_t *q) { /* ql[128], qh[64], scales i8[16], d */
    /* Element e = 128 h + 32 k + l (group g = 4 h + k): low 4 bits from ql[64 h + 32 (k % 2) + l]
     * (its high nibble when k >= 2), high 2 bits from qh[32 h + l] >> 2k; minus 32; times
     * (d * scale[e / 16]). */
    int h = g / 4, k = g % 4;
    const uint8_t *ql = b + 64 * h + 32 * (k % 2), *qh = b + 128 + 32 * h;
    /* The 6-bit codes assembled 16 at a time in bytes, then widened 8 at a time. */
    const __m128i low = _mm_set1_epi8(15), three = _mm_set1_epi8(3);
    const __m128i lshift = _mm_cvtsi32_si128(4 * (k / 2)), hshift = _mm_cvtsi32_si128(2 * k);
    const __m256i thirty_two = _mm256_set1_epi32(32);
    for (int half = 0; half < 2; half++) {
        __m128i l = _mm_loadu_si128((const __m128i *)(ql + 16 * half));
        __m128i u = _mm_loadu_si128((const __m128i *)(qh + 16 * half));
        l = _mm_and_si128(_mm_srl_epi16(l, lshift), low);
        u = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(u, hshift), three), 4);
        __m128i code = _mm_or_si128(l, u); /* 16 codes 0..63, each in its byte */
        q->c[2 * half] = _mm256_cvtepi32_ps(_mm256_sub_epi32(u8_int(code), thirty_two));
        q->c[2 * half + 1] =
            _mm256_cvtepi32_ps(_mm256_sub_epi32(u8_int(_mm_srli_si128(code, 8)), thirty_two));
    }
    float d = half_at(b + 208);
    q->s[0] = d * (float)(int8_t)b[192 + 2 * g];
    q->s[1] = d * (float)(int8_t)b[192 + 2 * g + 1];
    q->o = 0.0f;
}

static inline __m256 iq4_values(__m128i codes) { /* 8 nibbles → the IQ4 code book's values */
    const __m128i book = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                       53, 69, 89, 113);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(book, codes)));
}

static inline void iq4_codes(const uint8_t *qs, __m256 c[4]) {
    __m128i lo, hi;
    nibbles(qs, &lo, &hi);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++) c[v] = iq4_values(parts[v]);
}

static inline void dec_iq4_nl(const uint8_t *b, int g, group_t *q) { /* d, qs[16] */
    (void)g;
    iq4_codes(b + 2, q->c);
    q->s[0] = q->s[1] = half_at(b);
    q->o = 0.0f;
}

static inline void dec_iq4_xs(const uint8_t *b, int g, group_t *q) { /* d, scales_h u16, scales_l[4], qs[128] */
    int low = (b[4 + g / 2] >> (4 * (g % 2))) & 15;
    int high = (b[2 + g / 4] >> (2 * (g % 4))) & 3;
    iq4_codes(b + 8 + 16 * g, q->c);
    q->s[0] = q->s[1] = half_at(b) * (float)((low | (high << 4)) - 32);
    q->o = 0.0f;
}

static inline void dec_q3_k(const uint8_t *b, int g, group_t *q) { /* hmask[32], qs[64], scales[12], d */
    /* Element 32 g + l: 2 bits from qs[32 (g / 4) + l] >> 2 (g % 4), and 4 below unless bit
     * g of hmask[l] is set; times d x (its 6-bit scale - 32), one scale per 16 elements.
     * The 32 codes are assembled as bytes at once, then widened 8 at a time. */
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (g / 4)));
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    const __m256i low = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * (g % 4))),
                                         _mm256_set1_epi8(3));
    const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8((char)(1 << g))),
                                            _mm256_setzero_si256());
    const __m256i codes = _mm256_sub_epi8(low, _mm256_and_si256(clear, _mm256_set1_epi8(4)));
    const __m128i first = _mm256_castsi256_si128(codes), second = _mm256_extracti128_si256(codes, 1);
    const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
    for (int v = 0; v < 4; v++) q->c[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[v]));
    const uint8_t *s = b + 96;
    const float d = half_at(b + 108);
    for (int j = 0; j < 2; j++) {
        const int i = 2 * g + j;
        const int sc = ((s[i % 8] >> (4 * (i / 8))) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
        q->s[j] = d * (float)(sc - 32);
    }
    q->o = 0.0f;
}

/* Q2_K: element 32 g + l (g = 4 h + j) is bits 2j of qs[32 h + l]; each 16 has its own
 * 4-bit scale and 4-bit min in scales[2 g + (l >= 16)]: weight fl(dl q) - ml, with
 * dl = d x (sc & 15) and ml = dmin x (sc >> 4), so the group has two offsets. */
static inline void dec_q2_k(const uint8_t *b, int g, group_t *q) { /* scales[16], qs[64], d, dmin */
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g / 4)));
    const __m256i codes = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * (g % 4))),
                                           _mm256_set1_epi8(3)); /* 32 codes as bytes */
    const __m128i first = _mm256_castsi256_si128(codes), second = _mm256_extracti128_si256(codes, 1);
    const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
    for (int v = 0; v < 4; v++) q->c[v] = u8_float(parts[v]);
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    const int s0 = b[2 * g], s1 = b[2 * g + 1];
    q->s[0] = d * (float)(s0 & 15);
    q->s[1] = d * (float)(s1 & 15);
    q->o = -(dmin * (float)(s0 >> 4));
    q->o2 = -(dmin * (float)(s1 >> 4));
}

/* MXFP4 (gpt-oss's experts): 32 e2m1 codes, IQ4's nibble order, from a doubled code book,
 * times 2^(e - 128) built from its bits as ggml builds it (subnormal for e < 2). */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void dec_mxfp4(const uint8_t *b, int g, group_t *q) { /* e, qs[16] */
    (void)g;
    const __m128i book = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i lo, hi;
    nibbles(b + 1, &lo, &hi);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; v++)
        q->c[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(book, parts[v])));
    q->s[0] = q->s[1] = e8m0_half(b[0]);
    q->o = 0.0f;
}

/* ---- the product, one function per type ----
 * x: (M, K) rows ldx apart; xsum: room for (M, K / 32), filled here with each group's sum
 * of x (for the offsets);
 * blocks: (N, row_bytes); y: (M, N) rows ldy apart. Per group and row, the codes' products
 * with x are summed per scale (c x, exact codes), scaled once (s), and the offset is
 * o x sum(x): the weight's own operations factored out of the group, which changes the
 * rounding as a different summation order would, and for a one-hot x is the weight itself
 * bit for bit: fl(fl(c s) + o). */
static void group_sums(const float *x, int64_t ldx, float *xsum, int64_t M, int64_t ngroups) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < ngroups; k++) {
            const float *xk = x + i * ldx + 32 * k;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xk), _mm256_loadu_ps(xk + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xk + 16), _mm256_loadu_ps(xk + 24)));
            xsum[i * ngroups + k] = hsum(s);
        }
}

/* For SCALES 5 (Q2_K, an offset per 16): the sums of each half group, (M, 2 ngroups), at
 * xsum + M ngroups (the room cpu_kernels.py gives is 3 M ngroups). */
static void half_sums(const float *x, int64_t ldx, float *xsum, int64_t M, int64_t ngroups) {
    float *halves = xsum + M * ngroups;
    for (int64_t i = 0; i < M; i++)
        for (int64_t h = 0; h < 2 * ngroups; h++) {
            const float *xh = x + i * ldx + 16 * h;
            halves[i * 2 * ngroups + h] = hsum(_mm256_add_ps(_mm256_loadu_ps(xh), _mm256_loadu_ps(xh + 8)));
        }
}

/* Two consecutive groups k, k + 1 (k even): decoded together where a type shares their
 * bytes (PAIRED), else one after the other. */
#define PAIRED(NAME, BLOCK_BYTES, GROUPS)                                                      \
    static inline void two_##NAME(const uint8_t *row, int64_t k, group_t *q, group_t *r) {    \
        pair_##NAME(row + (k / (GROUPS)) * (BLOCK_BYTES), (int)(k % (GROUPS)), q, r);         \
    }
#define UNPAIRED(NAME, BLOCK_BYTES, GROUPS)                                                    \
    static inline void two_##NAME(const uint8_t *row, int64_t k, group_t *q, group_t *r) {    \
        dec_##NAME(row + (k / (GROUPS)) * (BLOCK_BYTES), (int)(k % (GROUPS)), q);             \
        dec_##NAME(row + ((k + 1) / (GROUPS)) * (BLOCK_BYTES), (int)((k + 1) % (GROUPS)), r); \
    }

/* SCALES 1 and 2: the one-row path's scales of two consecutive 32-blocks whose fp16 scale d leads them
 * (SCALES 1: Q4_0, Q5_0, Q8_0, IQ4_NL, Q4_Z) and fp16 offset m follows it (SCALES 2: Q4_1, Q5_1):
 * both blocks' (d, m) converted in one instruction, (d0, m0, d1, m1), where converting
 * each half alone made these types' products a third slower. The same values as the
 * decoders' `half_at`, and the same sums for finite x (SCALES 1 adds no 0 x sum(x) for
 * the offset it does not have: an infinite x gives inf, not NaN); SCALES 0: the decoders'
 * s and o (every other type). */
static inline __m128 two_scales(const uint8_t *b0, const uint8_t *b1) {
    uint32_t u0, u1;
    memcpy(&u0, b0, 4);
    memcpy(&u1, b1, 4);
    return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)u0), (int)u1, 1));
}

/* SCALES 3 (Q4_K, Q5_K): the one-row path's scales and offsets of a 256-block's eight
 * groups at once, when it enters the block: the twelve 6-bit pairs unpacked four bytes at a
 * time and converted as one vector (per group, as `k_scales` does it, they cost a third of
 * the product). s[g] = d sc_g exactly as there; the offsets -(dmin mn_g) come back as a
 * vector, summed against the groups' sums of x in lanes (another order of the same sum). */
static inline __m256 k_block_scales(const uint8_t *b, float s[8]) {
    uint32_t lo, mid, hi; /* scale bytes 0-3, 4-7, 8-11 */
    memcpy(&lo, b + 4, 4);
    memcpy(&mid, b + 8, 4);
    memcpy(&hi, b + 12, 4);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc_hi = (hi & four) | (((lo >> 6) & two) << 4);
    const uint32_t mn_hi = ((hi >> 4) & four) | (((mid >> 6) & two) << 4);
    const __m256 sc = u8_float(_mm_setr_epi32((int)(lo & six), (int)sc_hi, 0, 0));
    const __m256 mn = u8_float(_mm_setr_epi32((int)(mid & six), (int)mn_hi, 0, 0));
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(half_at(b)), sc));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mn), sign);
}

/* SCALES 4 (Q6_K): a 256-block's sixteen scales (one per 16 weights), d * scale each as
 * `dec_q6_k` makes them, converted as two vectors when the one-row path enters the block. */
static inline void q6_block_scales(const uint8_t *b, float s[16]) {
    const __m256 d = _mm256_set1_ps(half_at(b + 208));
    for (int h = 0; h < 2; h++) {
        const __m128i raw = _mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h));
        _mm256_storeu_ps(s + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw))));
    }
}

/* SCALES 6 (Q3_K): a 256-block's sixteen scales d x (6-bit scale - 32), as `dec_q3_k`
 * makes them, once when the one-row path enters the block. */
static inline void q3_block_scales(const uint8_t *b, float s[16]) {
    const uint8_t *raw = b + 96;
    const float d = half_at(b + 108);
    for (int i = 0; i < 16; i++) {
        const int sc = ((raw[i % 8] >> (4 * (i / 8))) & 15) | (((raw[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
        s[i] = d * (float)(sc - 32);
    }
}

/* SCALES 5 (Q2_K): a 256-block's sixteen scales d (sc & 15), and its sixteen offsets
 * -(dmin (sc >> 4)) as two vectors (summed against x's half sums in lanes), as `dec_q2_k`
 * makes each. */
static inline void q2_block_scales(const uint8_t *b, float s[16], __m256 off[2]) {
    const __m256 d = _mm256_set1_ps(half_at(b + 80)), dmin = _mm256_set1_ps(half_at(b + 82));
    const __m128i raw = _mm_loadu_si128((const __m128i *)b), low = _mm_set1_epi8(15);
    const __m128i sc = _mm_and_si128(raw, low), mn = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < 2; h++) {
        _mm256_storeu_ps(s + 8 * h, _mm256_mul_ps(d, u8_float(h ? _mm_srli_si128(sc, 8) : sc)));
        off[h] = _mm256_xor_ps(_mm256_mul_ps(dmin, u8_float(h ? _mm_srli_si128(mn, 8) : mn)), sign);
    }
}

#define PREFETCH_GROUPS 64

#define GEMV(NAME, BLOCK_BYTES, GROUPS, SCALES)                                                \
    static inline void group_##NAME(const uint8_t *row, int64_t k, group_t *q) {              \
        dec_##NAME(row + (k / (GROUPS)) * (BLOCK_BYTES), (int)(k % (GROUPS)), q);             \
    }                                                                                         \
    static void rows_##NAME(const float *x, int64_t ldx, const float *xsum,                  \
                            const uint8_t *blocks, int64_t row_bytes, float *y, int64_t ldy,  \
                            int64_t M, int64_t N, int64_t K) {                                \
        const int64_t ngroups = K / 32;                                                       \
        const float *halves = xsum + M * ngroups; /* SCALES 5: (M, 2 ngroups) */             \
        group_t q, r;                                                                         \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const uint8_t *row = blocks + n * row_bytes;                                      \
            if (M == 1) { /* four independent chains: two groups a step, two scales each */  \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                   \
                float o0 = 0.0f, o1 = 0.0f;                                                   \
                __m128 offsets = _mm_setzero_ps(); /* SCALES 2: lanes 1 and 3 are o0, o1 */   \
                __m256 koffsets = _mm256_setzero_ps(); /* SCALES 3: per group of a block */  \
                float ks[16]; /* SCALES 3 and 4: the current 256-block's scales */           \
                int64_t k = 0;                                                                \
                for (; k + 1 < ngroups; k += 2) {                                             \
                    /* the bytes a few groups on: they arrive while these are computed */    \
                    _mm_prefetch((const char *)row + (k + PREFETCH_GROUPS) * (BLOCK_BYTES) /  \
                                 (GROUPS), _MM_HINT_T0);                                      \
                    two_##NAME(row, k, &q, &r);                                               \
                    const float *xk = x + 32 * k;                                             \
                    __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(xk), q.c[0]);                   \
                    __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(xk + 16), q.c[2]);              \
                    __m256 p2 = _mm256_mul_ps(_mm256_loadu_ps(xk + 32), r.c[0]);              \
                    __m256 p3 = _mm256_mul_ps(_mm256_loadu_ps(xk + 48), r.c[2]);              \
                    p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), q.c[1], p0);                \
                    p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), q.c[3], p1);               \
                    p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 40), r.c[1], p2);               \
                    p3 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 56), r.c[3], p3);               \
                    if (SCALES == 3) {                                                        \
                        const int g = (int)(k % 8);                                           \
                        if (g == 0) {                                                         \
                            const __m256 o = k_block_scales(row + (k / 8) * (BLOCK_BYTES), ks); \
                            koffsets = _mm256_add_ps(koffsets,                                \
                                                     _mm256_mul_ps(o, _mm256_loadu_ps(xsum + k))); \
                        }                                                                     \
                        const __m256 sq = _mm256_set1_ps(ks[g]), sr = _mm256_set1_ps(ks[g + 1]); \
                        a0 = _mm256_fmadd_ps(p0, sq, a0);                                     \
                        a1 = _mm256_fmadd_ps(p1, sq, a1);                                     \
                        a2 = _mm256_fmadd_ps(p2, sr, a2);                                     \
                        a3 = _mm256_fmadd_ps(p3, sr, a3);                                     \
                    } else if (SCALES == 4 || SCALES == 5 || SCALES == 6) {                   \
                        const int g = (int)(k % 8);                                           \
                        if (g == 0) {                                                         \
                            const uint8_t *blk = row + (k / 8) * (BLOCK_BYTES);               \
                            if (SCALES == 4) q6_block_scales(blk, ks);                        \
                            if (SCALES == 6) q3_block_scales(blk, ks);                        \
                            if (SCALES == 5) { /* offsets: against the 16 half sums */        \
                                __m256 off[2];                                                \
                                q2_block_scales(blk, ks, off);                                \
                                koffsets = _mm256_fmadd_ps(off[0], _mm256_loadu_ps(halves + 2 * k), koffsets); \
                                koffsets = _mm256_fmadd_ps(off[1], _mm256_loadu_ps(halves + 2 * k + 8), koffsets); \
                            }                                                                 \
                        }                                                                     \
                        a0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(ks[2 * g]), a0);              \
                        a1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(ks[2 * g + 1]), a1);          \
                        a2 = _mm256_fmadd_ps(p2, _mm256_set1_ps(ks[2 * g + 2]), a2);          \
                        a3 = _mm256_fmadd_ps(p3, _mm256_set1_ps(ks[2 * g + 3]), a3);          \
                    } else if (SCALES == 1 || SCALES == 2) {                                  \
                        const uint8_t *b = row + k * (BLOCK_BYTES);                           \
                        const __m128 dm = two_scales(b, b + (BLOCK_BYTES));                   \
                        const __m256 sq = _mm256_broadcastss_ps(dm);                          \
                        const __m256 sr = _mm256_broadcastss_ps(_mm_movehl_ps(dm, dm));       \
                        a0 = _mm256_fmadd_ps(p0, sq, a0);                                     \
                        a1 = _mm256_fmadd_ps(p1, sq, a1);                                     \
                        a2 = _mm256_fmadd_ps(p2, sr, a2);                                     \
                        a3 = _mm256_fmadd_ps(p3, sr, a3);                                     \
                        if (SCALES == 2) { /* (0, xsum[k], 0, xsum[k + 1]) */                 \
                            const __m128 pair = _mm_castsi128_ps(                             \
                                _mm_loadl_epi64((const __m128i *)(xsum + k)));                \
                            const __m128 xs = _mm_unpacklo_ps(_mm_setzero_ps(), pair);        \
                            offsets = _mm_add_ps(offsets, _mm_mul_ps(dm, xs));                \
                        }                                                                     \
                    } else {                                                                  \
                        a0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(q.s[0]), a0);                 \
                        a1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(q.s[1]), a1);                 \
                        a2 = _mm256_fmadd_ps(p2, _mm256_set1_ps(r.s[0]), a2);                 \
                        a3 = _mm256_fmadd_ps(p3, _mm256_set1_ps(r.s[1]), a3);                 \
                        o0 += q.o * xsum[k];                                                  \
                        o1 += r.o * xsum[k + 1];                                              \
                    }                                                                         \
                }                                                                             \
                if (SCALES == 2) {                                                            \
                    o0 = _mm_cvtss_f32(_mm_movehdup_ps(offsets));                             \
                    o1 = _mm_cvtss_f32(_mm_shuffle_ps(offsets, offsets, 3));                  \
                }                                                                             \
                if (SCALES == 3 || SCALES == 5) o0 = hsum(koffsets); /* (256-blocks: none left) */ \
                for (; k < ngroups; k++) {                                                    \
                    group_##NAME(row, k, &q);                                                 \
                    const float *xk = x + 32 * k;                                             \
                    __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(xk), q.c[0]);                   \
                    __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(xk + 16), q.c[2]);              \
                    p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), q.c[1], p0);                \
                    p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), q.c[3], p1);               \
                    a0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(q.s[0]), a0);                     \
                    a1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(q.s[1]), a1);                     \
                    if (SCALES == 5)                                                          \
                        o0 += q.o * halves[2 * k] + q.o2 * halves[2 * k + 1];                 \
                    else                                                                      \
                        o0 += q.o * xsum[k];                                                  \
                }                                                                             \
                __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));     \
                y[n] = hsum(sum) + (o0 + o1);                                                 \
                continue;                                                                     \
            }                                                                                 \
            /* Several rows: each group decoded once for a chunk of up to SPECD_MAX_ROWS of   \
             * them; further chunks decode this output row's blocks again from the cache      \
             * (a row's blocks are a few KB), so the weights come from memory once for        \
             * every row of the call. The 256-block types (SCALES 3-6) take their scales      \
             * (and offsets, as vectors against the sums) once per block, as the one-row      \
             * path does; the others per group. */                                            \
            for (int64_t i0 = 0; i0 < M; i0 += SPECD_MAX_ROWS) {                              \
                const int64_t m = M - i0 < SPECD_MAX_ROWS ? M - i0 : SPECD_MAX_ROWS;          \
                const float *xc = x + i0 * ldx, *sc = xsum + i0 * ngroups;                    \
                const float *hc = halves + i0 * 2 * ngroups;                                  \
                __m256 acc[SPECD_MAX_ROWS], koff[SPECD_MAX_ROWS];                             \
                float off[SPECD_MAX_ROWS];                                                    \
                for (int64_t i = 0; i < m; i++) {                                             \
                    acc[i] = koff[i] = _mm256_setzero_ps();                                   \
                    off[i] = 0.0f;                                                            \
                }                                                                             \
                float ks[16];                                                                 \
                for (int64_t k = 0; k < ngroups; k++) {                                       \
                    group_##NAME(row, k, &q);                                                 \
                    __m256 s0, s1;                                                            \
                    if (SCALES >= 3) {                                                        \
                        const int g = (int)(k % 8);                                           \
                        if (g == 0) {                                                         \
                            const uint8_t *blk = row + (k / 8) * (BLOCK_BYTES);               \
                            if (SCALES == 3) {                                                \
                                const __m256 o = k_block_scales(blk, ks);                     \
                                for (int64_t i = 0; i < m; i++)                               \
                                    koff[i] = _mm256_fmadd_ps(o, _mm256_loadu_ps(sc + i * ngroups + k), koff[i]);\
                            }                                                                 \
                            if (SCALES == 4) q6_block_scales(blk, ks);                        \
                            if (SCALES == 6) q3_block_scales(blk, ks);                        \
                            if (SCALES == 5) {                                                \
                                __m256 o[2];                                                  \
                                q2_block_scales(blk, ks, o);                                  \
                                for (int64_t i = 0; i < m; i++) {                             \
                                    const float *hk = hc + i * 2 * ngroups + 2 * k;           \
                                    koff[i] = _mm256_fmadd_ps(o[0], _mm256_loadu_ps(hk), koff[i]);\
                                    koff[i] = _mm256_fmadd_ps(o[1], _mm256_loadu_ps(hk + 8), koff[i]);\
                                }                                                             \
                            }                                                                 \
                        }                                                                     \
                        s0 = _mm256_set1_ps(SCALES == 3 ? ks[g] : ks[2 * g]);                 \
                        s1 = _mm256_set1_ps(SCALES == 3 ? ks[g] : ks[2 * g + 1]);             \
                    } else {                                                                  \
                        s0 = _mm256_set1_ps(q.s[0]);                                          \
                        s1 = _mm256_set1_ps(q.s[1]);                                          \
                    }                                                                         \
                    for (int64_t i = 0; i < m; i++) {                                         \
                        const float *xk = xc + i * ldx + 32 * k;                              \
                        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xk), q.c[0]);                \
                        __m256 b = _mm256_mul_ps(_mm256_loadu_ps(xk + 16), q.c[2]);           \
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), q.c[1], a);              \
                        b = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), q.c[3], b);             \
                        acc[i] = _mm256_fmadd_ps(a, s0, acc[i]);                              \
                        acc[i] = _mm256_fmadd_ps(b, s1, acc[i]);                              \
                        if (SCALES < 3) off[i] += q.o * sc[i * ngroups + k];                  \
                    }                                                                         \
                }                                                                             \
                for (int64_t i = 0; i < m; i++)                                               \
                    y[(i0 + i) * ldy + n] = hsum(acc[i]) + (SCALES == 3 || SCALES == 5 ? hsum(koff[i]) : off[i]);\
            }                                                                                 \
        }                                                                                     \
    }

UNPAIRED(q8_0, 34, 1)
UNPAIRED(q4_0, 18, 1)
UNPAIRED(q4_1, 20, 1)
UNPAIRED(q5_0, 22, 1)
UNPAIRED(q5_1, 24, 1)
PAIRED(q4_k, 144, 8)
PAIRED(q5_k, 176, 8)
UNPAIRED(q6_k, 210, 8)
UNPAIRED(iq4_nl, 18, 1)
UNPAIRED(iq4_xs, 136, 8)
UNPAIRED(mxfp4, 17, 1)
UNPAIRED(q3_k, 110, 8)
UNPAIRED(q4_z, 19, 1)
UNPAIRED(q2_k, 84, 8)
UNPAIRED(q4_0b, 18, 1)
UNPAIRED(q8_0b, 34, 1)
UNPAIRED(q4_zb, 19, 1)

GEMV(q8_0, 34, 1, 1)
GEMV(q4_0, 18, 1, 1)
GEMV(q4_1, 20, 1, 2)
GEMV(q5_0, 22, 1, 1)
GEMV(q5_1, 24, 1, 2)
GEMV(q4_k, 144, 8, 3)
GEMV(q5_k, 176, 8, 3)
GEMV(q6_k, 210, 8, 4)
GEMV(iq4_nl, 18, 1, 1)
GEMV(iq4_xs, 136, 8, 0)
GEMV(mxfp4, 17, 1, 0)
GEMV(q3_k, 110, 8, 6)
GEMV(q4_z, 19, 1, 1)
GEMV(q2_k, 84, 8, 5)
GEMV(q4_0b, 18, 1, 0)
GEMV(q8_0b, 34, 1, 0)
GEMV(q4_zb, 19, 1, 0)

typedef void (*rows_fn)(const float *, int64_t, const float *, const uint8_t *, int64_t, float *,
                        int64_t, int64_t, int64_t, int64_t);

/* By the type index cpu_kernels.py names (its TYPES order). */
static const rows_fn ROWS[] = {rows_q8_0, rows_q4_0, rows_q4_1, rows_q5_0, rows_q5_1,
                               rows_q4_k, rows_q5_k, rows_q6_k, rows_iq4_nl, rows_iq4_xs,
                               rows_mxfp4, rows_q3_k, rows_q4_z, rows_q2_k,
                               rows_q4_0b, rows_q8_0b, rows_q4_zb};
#define TYPE_COUNT ((int)(sizeof(ROWS) / sizeof(ROWS[0])))
int specd_type_count(void) { return TYPE_COUNT; }

/* ---- threads ----
 * A product's rows n are split among `threads` threads: this one and up to
 * SPECD_MAX_THREADS - 1 workers of a pool kept between calls (started by
 * specd_set_threads, never stopped; a forked child computes alone). A job's items are cut
 * into a few chunks per thread, which the threads claim one at a time, the caller too, so a
 * worker that is not running (its core busy with another program, or asleep) costs nothing:
 * the caller computes the chunks nobody else took, and waits only for a chunk a worker has
 * begun. (A job split once, in equal parts, waited for its slowest thread: with one of two
 * cores busy elsewhere, two threads decoded ~10x slower than one.) A worker spins for a short
 * while after each job (the next product comes within microseconds during a pass), then
 * sleeps on a condition variable (an idle daemon costs no CPU). Every row is computed the
 * same way whichever thread computes it: the result does not depend on the thread count. */
#define SPECD_MAX_THREADS 16
#define SPIN_ROUNDS 20000 /* pauses before a worker sleeps: 0.1-1 ms, by the CPU's pause */
#define MIN_PARALLEL_WEIGHTS (1 << 16) /* smaller products stay on one thread */
#define CHUNKS_PER_THREAD 4
#define WAIT_SPINS 256 /* pauses before the caller, waiting for a chunk, yields its core */

/* A job: items [0, items) in `chunks` runs, run(ctx, start, end, part) each; `part` is the
 * index of the thread that computes it (< parts), for its own scratch. */
typedef void (*task_fn)(const void *ctx, int64_t start, int64_t end, int part);

typedef struct {
    task_fn run;
    const void *ctx;
    int64_t items;
    int chunks;
} job_t;

/* The ticket says what can be claimed: the job's sequence number (bits 40-63), the threads
 * that may take part (32-39), its chunks (16-31) and the next unclaimed one (0-15). A thread
 * claims chunk k by moving the ticket from exactly (job, k) to (job, k + 1), so a claim can
 * only succeed on the job it read; and a claimed chunk keeps its job current (the caller
 * publishes the next only after every chunk is done), so `pool.job` is read after a claim. */
#define TICKET(seq, parts, chunks) (((seq) << 40) | ((uint64_t)(parts) << 32) | ((uint64_t)(chunks) << 16))
#define TICKET_NEXT(t) ((int)((t) & 0xffff))
#define TICKET_CHUNKS(t) ((int)(((t) >> 16) & 0xffff))
#define TICKET_PARTS(t) ((int)(((t) >> 32) & 0xff))

static struct {
    pthread_mutex_t lock;
    pthread_mutex_t busy; /* held by the one product that uses the workers */
    pthread_cond_t wake;
    pthread_t workers[SPECD_MAX_THREADS];
    int workers_started;
    atomic_int threads; /* this one and the workers a product uses (read without `busy`) */
    uint64_t seq; /* jobs published (written by the thread holding `busy`) */
    job_t job;
    _Atomic uint64_t ticket;
    atomic_int done; /* chunks of the current job computed */
    atomic_int sleepers;
    atomic_int stop;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER,
          .busy = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .threads = 1};

/* Whether thread `index` can claim a chunk under ticket t. */
static int claimable(uint64_t t, int index) {
    return index < TICKET_PARTS(t) && TICKET_NEXT(t) < TICKET_CHUNKS(t);
}

/* Claims and computes chunks of the current job until none is left for thread `index`. */
static void take_chunks(int index) {
    uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    while (claimable(t, index)) {
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* t was reloaded: another thread claimed, or a new job came */
        const job_t *job = &pool.job;
        const int k = TICKET_NEXT(t);
        const int64_t start = job->items * k / job->chunks, end = job->items * (k + 1) / job->chunks;
        if (end > start) job->run(job->ctx, start, end, index);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
}

/* Runs `run` over items [0, items) on up to `parts` threads (this one and the pool's
 * workers; parts <= 1, or the workers busy with another thread's job: this one alone). */
static void run_job(task_fn run, const void *ctx, int64_t items, int parts) {
    const int threads = atomic_load_explicit(&pool.threads, memory_order_relaxed);
    if (parts > threads) parts = threads;
    if (parts > items) parts = (int)items;
    if (parts <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        if (items > 0) run(ctx, 0, items, 0);
        return;
    }
    int64_t chunks = (int64_t)parts * CHUNKS_PER_THREAD;
    if (chunks > items) chunks = items;
    pool.job = (job_t){run, ctx, items, (int)chunks};
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    pool.seq = (pool.seq + 1) & 0xffffff;
    /* sequentially consistent with `sleepers`: a worker going to sleep sees the job, or is
     * counted and woken */
    atomic_store(&pool.ticket, TICKET(pool.seq, parts, chunks));
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    take_chunks(0);
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks;) {
        if (++spins < WAIT_SPINS) {
            _mm_pause();
        } else {
            sched_yield(); /* a worker mid-chunk may be waiting for this core */
            spins = 0;
        }
    }
    pthread_mutex_unlock(&pool.busy);
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1 .. SPECD_MAX_THREADS - 1 */
    for (;;) {
        int spins = 0;
        while (!claimable(atomic_load_explicit(&pool.ticket, memory_order_acquire), index)) {
            if (atomic_load(&pool.stop)) return NULL;
            if (++spins < SPIN_ROUNDS) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while (!claimable(atomic_load(&pool.ticket), index) && !atomic_load(&pool.stop))
                pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
            spins = 0;
        }
        take_chunks(index);
    }
}

/* The threads products use from now on (1 .. SPECD_MAX_THREADS): workers are started as
 * needed and stay (idle ones sleep). Returns the count in effect; a product running
 * meanwhile uses the count it read. */
static void forgotten_in_a_child(void) {
    /* A forked child has none of the workers: it computes alone until it asks for threads
     * again, with the pool's state as new (the parent's locks may have been held at the
     * fork, its condition variable counts waiters the child does not have, and its
     * `sleepers` would make every job broadcast to them: the child hung). */
    pool.workers_started = 0;
    atomic_store(&pool.threads, 1);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.ticket, 0);
    atomic_store(&pool.done, 0);
}

/* Workers asleep on the condition variable now (the tests fork while they sleep). */
int specd_sleeping_workers(void) { return atomic_load(&pool.sleepers); }

int specd_set_threads(int threads) {
    static int registered = 0;
    if (!registered) registered = pthread_atfork(NULL, NULL, forgotten_in_a_child) == 0;
    if (threads < 1) threads = 1;
    if (threads > SPECD_MAX_THREADS) threads = SPECD_MAX_THREADS;
    pthread_mutex_lock(&pool.busy); /* no product is using the workers meanwhile */
    while (pool.workers_started < threads - 1) {
        int index = pool.workers_started + 1;
        if (pthread_create(&pool.workers[index], NULL, worker, (void *)(intptr_t)index) != 0) break;
        pool.workers_started++;
    }
    const int in_effect = pool.workers_started + 1 < threads ? pool.workers_started + 1 : threads;
    atomic_store(&pool.threads, in_effect);
    pthread_mutex_unlock(&pool.busy);
    return in_effect;
}

/* One product on already summed groups (xsum), its rows split among the pool's threads. */
typedef struct {
    rows_fn fn;
    const float *x, *xsum;
    const uint8_t *blocks;
    float *y;
    int64_t ldx, row_bytes, ldy, M, K;
} product_t;

static void product_rows(const void *ctx, int64_t start, int64_t end, int part) {
    const product_t *p = ctx;
    (void)part;
    p->fn(p->x, p->ldx, p->xsum, p->blocks + start * p->row_bytes, p->row_bytes, p->y + start,
          p->ldy, p->M, end - start, p->K);
}

static void product(int type, const float *x, int64_t ldx, const float *xsum, const uint8_t *blocks,
                    int64_t row_bytes, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const product_t p = {ROWS[type], x, xsum, blocks, y, ldx, row_bytes, ldy, M, K};
    int64_t parts = (N * K) / MIN_PARALLEL_WEIGHTS; /* small products stay on one thread */
    run_job(product_rows, &p, N, parts > SPECD_MAX_THREADS ? SPECD_MAX_THREADS : (int)parts);
}

/* y = x W^T for blocks of type `type` (the ROWS index), as the rows_* functions say; xsum is
 * room for 3 (M, K / 32) floats (the group sums, then Q2_K's half sums), filled here. Returns 0, or -1 for an unknown type. */
int specd_gemv(int type, const float *x, int64_t ldx, float *xsum, const uint8_t *blocks,
               int64_t row_bytes, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (type < 0 || type >= TYPE_COUNT) return -1;
    group_sums(x, ldx, xsum, M, K / 32);
    if (ROWS[type] == rows_q2_k) half_sums(x, ldx, xsum, M, K / 32);
    product(type, x, ldx, xsum, blocks, row_bytes, y, ldy, M, N, K);
    return 0;
}

/* The products of one input x (M, K), contiguous, by several matrices ("parts": a layer's
 * q/k/v, its gate/up), their outputs side by side in y (M, N0 + N1 + ...), contiguous: one
 * call, x's groups summed once. `plan`: parts, K, then per part its type (the ROWS index),
 * blocks' address, row bytes and N; made once per projection by cpu_kernels.py, which has
 * checked every extent. Returns 0, or -1 for an unknown type (nothing computed). */
int specd_products(const int64_t *plan, const float *x, float *xsum, float *y, int64_t M) {
    const int64_t parts = plan[0], K = plan[1];
    int64_t width = 0;
    int halves = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t type = plan[2 + 4 * p];
        if (type < 0 || type >= TYPE_COUNT) return -1;
        width += plan[2 + 4 * p + 3];
        halves |= ROWS[type] == rows_q2_k;
    }
    group_sums(x, K, xsum, M, K / 32);
    if (halves) half_sums(x, K, xsum, M, K / 32);
    int64_t column = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t *part = plan + 2 + 4 * p;
        const uint8_t *blocks = (const uint8_t *)(intptr_t)part[1];
        product((int)part[0], x, K, xsum, blocks, part[2], y + column, width, M, part[3], K);
        column += part[3];
    }
    return 0;
}

/* ---- a few rows' RMS norm and attention, fp32 ----
 * A decode step's norms and attention are a few hundred floats each: as PyTorch operators
 * they cost a token more than their arithmetic (six operators a norm, ten an attention, each
 * dispatched apart). Here each is one call, for the passes whose products the kernels
 * above compute (a few rows, cpu_kernels.py decides); the values are the operators', rounded
 * as another summation order would. */

/* e^x for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 minimax polynomial
 * (relative error about 1e-7, as libm's expf within 2 ulp); below -87.3 it is 0, above 88.7
 * inf; a NaN stays NaN. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228391f), lo = _mm256_set1_ps(-87.3365479f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 t = _mm256_min_ps(hi, x); /* (a NaN x passes both: min/max return it) */
    t = _mm256_max_ps(lo, t);
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504f)),
                                                   _mm256_set1_ps(0.5f)));
    /* r = t - n ln2, ln2 in two parts so that n * the first is exact */
    __m256 r = _mm256_sub_ps(t, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    /* times 2^n (n in [-126, 128]: 2^n as two halves, so that 2^128 needs no inf exponent) */
    const __m256i e = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(e, 1);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), _mm256_set1_epi32(127)), 23));
    p = _mm256_mul_ps(_mm256_mul_ps(p, a), b);
    return _mm256_andnot_ps(under, p);
}

static inline float exp1(float x) {
    float out[8];
    _mm256_storeu_ps(out, exp8(_mm256_set1_ps(x)));
    return out[0];
}

/* x's rows (A, B, d), row (a, b) at a * sa + b * sb (elements; each row contiguous), normalised
 * as RMSNorm does: y = x / sqrt(mean(x^2) + eps) * (offset + w), into y (A, B, d)
 * contiguous. */
void specd_rms_norm(const float *x, int64_t sa, int64_t sb, int64_t A, int64_t B, int64_t d,
                    const float *w, float offset, float eps, float *y) {
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++) {
            const float *xr = x + a * sa + b * sb;
            float *yr = y + (a * B + b) * d;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0;
            int64_t j = 0;
            for (; j + 16 <= d; j += 16) {
                const __m256 u = _mm256_loadu_ps(xr + j), v = _mm256_loadu_ps(xr + j + 8);
                s0 = _mm256_add_ps(s0, _mm256_mul_ps(u, u));
                s1 = _mm256_add_ps(s1, _mm256_mul_ps(v, v));
            }
            float ss = hsum(_mm256_add_ps(s0, s1));
            for (; j < d; j++) ss += xr[j] * xr[j];
            const float r = 1.0f / sqrtf(ss / (float)d + eps);
            const __m256 rv = _mm256_set1_ps(r), off = _mm256_set1_ps(offset);
            j = 0;
            for (; j + 8 <= d; j += 8) {
                const __m256 scale = _mm256_add_ps(off, _mm256_loadu_ps(w + j));
                _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), rv), scale));
            }
            for (; j < d; j++) yr[j] = (xr[j] * r) * (offset + w[j]);
        }
}

/* Grouped-query attention of T query rows over S keys (cpu_kernels.py packs this from the
 * tensors it has checked; every field 8 bytes, in this order). q (H, T, hd), k and v
 * (Hkv, S, hd), strides in elements, rows contiguous; mask (T, S) bytes, 0 = hidden, or
 * NULL; sinks (H,) or NULL; out (H, T, hd) contiguous; scratch: parts x (H / Hkv) x S
 * floats; (H / Hkv) x hd <= 16384. */
typedef struct {
    const float *q, *k, *v, *sinks;
    const uint8_t *mask;
    float *out, *scratch;
    int64_t q_h, q_t, k_h, k_s, v_h, v_s, m_t, H, Hkv, T, S, hd, parts;
    double scale, softcap; /* softcap 0: none */
} attention_t;

static inline float dot(const float *a, const float *b, int64_t n) { /* n % 8 == 0 */
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
    }
    if (j < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    return hsum(_mm256_add_ps(s0, s1));
}

/* q's products with 8 keys `stride` apart (n % 8 == 0): eight independent sums, reduced
 * together into one vector, key i in lane i. */
static inline __m256 dot8(const float *q, const float *key, int64_t stride, int64_t n) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 qv = _mm256_loadu_ps(q + j);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key + i * stride + j), a[i]);
    }
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: keys 0-3 of each 128-bit half; u1: keys 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Items (kv head, query row): the group's query heads read each key and value once, while
 * it is in the first-level cache. */
static void attention_rows(const void *ctx, int64_t start, int64_t end, int part) {
    const attention_t *a = ctx;
    const int64_t group = a->H / a->Hkv, S = a->S, hd = a->hd;
    const float scale = (float)a->scale, cap = (float)a->softcap;
    float *scores = a->scratch + (int64_t)part * group * S;
    /* each query head's output while the values are summed: group x hd <= 16384 floats
     * (cpu_kernels.py checks) */
    float acc[16384] __attribute__((aligned(32)));
    for (int64_t item = start; item < end; item++) {
        const int64_t kv = item / a->T, t = item % a->T;
        const uint8_t *m = a->mask ? a->mask + t * a->m_t : NULL;
        int64_t seen = S; /* keys past the last one this row sees are not read */
        if (m)
            while (seen > 0 && !m[seen - 1]) seen--;
        const float *kbase = a->k + kv * a->k_h, *vbase = a->v + kv * a->v_h;
        const float *q0 = a->q + kv * group * a->q_h + t * a->q_t;
        int64_t s = 0;
        for (; s + 8 <= seen; s += 8)
            for (int64_t g = 0; g < group; g++)
                _mm256_storeu_ps(scores + g * S + s,
                                 _mm256_mul_ps(dot8(q0 + g * a->q_h, kbase + s * a->k_s, a->k_s, hd),
                                               _mm256_set1_ps(scale)));
        for (; s < seen; s++)
            for (int64_t g = 0; g < group; g++)
                scores[g * S + s] = dot(q0 + g * a->q_h, kbase + s * a->k_s, hd) * scale;
        for (int64_t g = 0; g < group; g++) {
            float *sc = scores + g * S;
            if (cap != 0.0f)
                for (s = 0; s < seen; s++) sc[s] = cap * tanhf(sc[s] / cap);
            if (m)
                for (s = 0; s < seen; s++)
                    if (!m[s]) sc[s] = -INFINITY;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            for (s = 0; s + 8 <= seen; s += 8) mx = _mm256_max_ps(_mm256_loadu_ps(sc + s), mx);
            float hi[8];
            _mm256_storeu_ps(hi, mx);
            float most = -INFINITY;
            for (int i = 0; i < 8; i++) most = hi[i] > most ? hi[i] : most;
            for (; s < seen; s++) most = sc[s] > most ? sc[s] : most;
            float sink = 0.0f;
            if (a->sinks) {
                sink = a->sinks[kv * group + g];
                most = sink > most ? sink : most;
            }
            if (most == -INFINITY) { /* every key hidden, no sink: NaN, as softmax gives */
                for (s = 0; s < seen; s++) sc[s] = 0.0f;
                for (int64_t j = 0; j < hd; j += 8) _mm256_store_ps(acc + g * hd + j, _mm256_set1_ps(NAN));
                continue;
            }
            const __m256 mv = _mm256_set1_ps(most);
            __m256 sum = _mm256_setzero_ps();
            for (s = 0; s + 8 <= seen; s += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + s), mv));
                _mm256_storeu_ps(sc + s, e);
                sum = _mm256_add_ps(sum, e);
            }
            float tot = hsum(sum);
            for (; s < seen; s++) {
                sc[s] = exp1(sc[s] - most);
                tot += sc[s];
            }
            if (a->sinks) tot += exp1(sink - most);
            const __m256 tv = _mm256_set1_ps(tot); /* the weights: e / total */
            for (s = 0; s + 8 <= seen; s += 8) _mm256_storeu_ps(sc + s, _mm256_div_ps(_mm256_loadu_ps(sc + s), tv));
            for (; s < seen; s++) sc[s] /= tot;
            for (int64_t j = 0; j < hd; j += 8) _mm256_store_ps(acc + g * hd + j, _mm256_setzero_ps());
        }
        for (s = 0; s < seen; s++) {
            const float *value = vbase + s * a->v_s;
            for (int64_t g = 0; g < group; g++) {
                const float w = scores[g * S + s];
                if (w == 0.0f) continue; /* hidden (or vanished) keys add nothing */
                const __m256 wv = _mm256_set1_ps(w);
                float *ag = acc + g * hd;
                for (int64_t j = 0; j < hd; j += 8)
                    _mm256_store_ps(ag + j, _mm256_fmadd_ps(wv, _mm256_loadu_ps(value + j), _mm256_load_ps(ag + j)));
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *out = a->out + ((kv * group + g) * a->T + t) * hd;
            for (int64_t j = 0; j < hd; j += 8) _mm256_storeu_ps(out + j, _mm256_load_ps(acc + g * hd + j));
        }
    }
}

void specd_attention(const attention_t *a) {
    const int64_t work = a->H * a->T * a->S * a->hd;
    int64_t parts = work / MIN_PARALLEL_WEIGHTS;
    if (parts > a->parts) parts = a->parts;
    run_job(attention_rows, a, a->Hkv * a->T, (int)parts);
}
