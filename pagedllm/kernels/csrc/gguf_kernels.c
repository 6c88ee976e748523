/* GGUF quantized weights on the CPU (pagedllm/kernels/gguf_kernels.py builds and calls it).
 *
 * A weight is a [N, K] matrix kept in its GGUF blocks, row after row (row_bytes apart). Types,
 * with ggml's ids, elements per block and bytes per block:
 *
 *   Q4_0 (2)   32 / 18    d f16, 16 bytes of nibbles           w = d * (q - 8)
 *   Q4_1 (3)   32 / 20    d f16, m f16, 16 bytes of nibbles    w = d * q + m
 *   Q8_0 (8)   32 / 34    d f16, 32 int8                       w = d * q
 *   Q4_K (12) 256 / 144   d, dmin f16, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
 *                         of nibbles                           w = d * sc[j] * q - dmin * m[j]
 *   Q5_K (13) 256 / 176   Q4_K's plus 32 bytes of fifth bits
 *   Q6_K (14) 256 / 210   128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d f16
 *                                                              w = d * sc[j] * (q - 32)
 *
 * (The element order inside a block is ggml's, the one the `gguf` package's dequantize follows.)
 *
 * Every type is decoded 8 elements at a time by one helper, `dq8` (AVX2, or scalar C), from a
 * low-bits source (nibbles, or int8 for Q8_0) and an optional high-bits source, times a scale
 * plus an offset. Two entry points:
 *
 * - gguf_dequantize_rows: rows (all, or those an index lists: an embedding lookup) to float32;
 * - gguf_matmul_f32: y[M, N] = x[M, K] @ W^T with float32 activations. Work items are (a tile
 *   of up to 64 activation rows) x (4 weight rows): a thread decodes its 4 weight rows into a
 *   float buffer once (L1/L2 resident) and multiplies every activation row of the tile by them
 *   in a register-blocked kernel (4 activation rows x 2 weight rows of vector accumulators along
 *   K, summed across lanes at the end). So a decode step's few rows share one decode of each
 *   weight row, and the weight bytes are read once per tile.
 *
 * Vector width: AVX-512F (16 lanes) where the compiler targets it, else AVX2 + FMA (8 lanes),
 * else scalar C; the decode helpers are AVX2 or scalar (AVX-512 machines have AVX2).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline float f16_to_f32(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exp == 0x1F) {
        v.u = sign | 0x7F800000u | (man << 13); /* inf / nan */
    } else if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
#endif
}

/* out[i] = s * q_i + b for i < 8, with q_i = ((lo[i] >> lo_shift) & 15) | (((hi[i] >> hi_shift) & hi_mask) << 4)
 * (hi NULL: no high bits); signed: q_i = (int8)lo[i] instead (Q8_0). */
static inline void dq8(const uint8_t *lo, int lo_shift, const uint8_t *hi, int hi_shift, int hi_mask, int is_signed,
                       float s, float b, float *out)
{
#if defined(__AVX2__) && defined(__FMA__)
    __m128i raw = _mm_loadl_epi64((const __m128i *)lo);
    __m256i q;
    if (is_signed) {
        q = _mm256_cvtepi8_epi32(raw);
    } else {
        q = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(raw), lo_shift), _mm256_set1_epi32(15));
        if (hi) {
            __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)hi));
            h = _mm256_and_si256(_mm256_srli_epi32(h, hi_shift), _mm256_set1_epi32(hi_mask));
            q = _mm256_or_si256(q, _mm256_slli_epi32(h, 4));
        }
    }
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s), _mm256_set1_ps(b)));
#else
    for (int i = 0; i < 8; ++i) {
        int q;
        if (is_signed) {
            q = (int8_t)lo[i];
        } else {
            q = (lo[i] >> lo_shift) & 15;
            if (hi)
                q |= ((hi[i] >> hi_shift) & hi_mask) << 4;
        }
        out[i] = s * (float)q + b;
    }
#endif
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void k4_scale_min(const uint8_t *sc, int j, int *d, int *m)
{
    if (j < 4) {
        *d = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *d = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* One row of K elements (K a multiple of the type's block) to float32. */
static void dequantize_row(int type, const uint8_t *row, int64_t K, float *out)
{
    switch (type) {
    case Q4_0:
    case Q4_1:
        for (int64_t i = 0; i < K / 32; ++i, out += 32) {
            const uint8_t *blk = row + i * (type == Q4_0 ? 18 : 20);
            const float d = f16_to_f32(blk), m = type == Q4_0 ? -8.0f * d : f16_to_f32(blk + 2);
            const uint8_t *qs = blk + (type == Q4_0 ? 2 : 4);
            for (int c = 0; c < 4; ++c) /* elements 0..15: low nibbles of the 16 bytes; 16..31: high */
                dq8(qs + 8 * (c & 1), 4 * (c >> 1), NULL, 0, 0, 0, d, m, out + 8 * c);
        }
        break;
    case Q8_0:
        for (int64_t i = 0; i < K / 32; ++i, out += 32) {
            const uint8_t *blk = row + i * 34;
            const float d = f16_to_f32(blk);
            for (int c = 0; c < 4; ++c)
                dq8(blk + 2 + 8 * c, 0, NULL, 0, 0, 1, d, 0.0f, out + 8 * c);
        }
        break;
    case Q4_K:
    case Q5_K:
        for (int64_t i = 0; i < K / 256; ++i) {
            const uint8_t *blk = row + i * (type == Q4_K ? 144 : 176);
            const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
            const uint8_t *scales = blk + 4, *qh = type == Q5_K ? blk + 16 : NULL;
            const uint8_t *qs = blk + (type == Q4_K ? 16 : 48);
            for (int j = 0; j < 8; ++j, out += 32) { /* sub-block j: nibbles (j & 1) of bytes 32 (j / 2).. */
                int sc, mn;
                k4_scale_min(scales, j, &sc, &mn);
                for (int c = 0; c < 4; ++c)
                    dq8(qs + 32 * (j >> 1) + 8 * c, 4 * (j & 1), qh ? qh + 8 * c : NULL, j, 1, 0, d * (float)sc,
                        -dmin * (float)mn, out + 8 * c);
            }
        }
        break;
    case Q6_K:
        for (int64_t i = 0; i < K / 256; ++i) {
            const uint8_t *blk = row + i * 210, *ql = blk, *qh = blk + 128;
            const int8_t *scales = (const int8_t *)(blk + 192);
            const float d = f16_to_f32(blk + 208);
            for (int g = 0; g < 8; ++g, out += 32) { /* group g of 32: half h = g / 4, quarter k = g % 4 */
                const int h = g >> 2, k = g & 3;
                for (int c = 0; c < 4; ++c) {
                    const float s = d * (float)scales[2 * g + (c >> 1)]; /* one scale per 16 elements */
                    dq8(ql + 64 * h + 32 * (k & 1) + 8 * c, 4 * (k >> 1), qh + 32 * h + 8 * c, 2 * k, 3, 0, s,
                        -32.0f * s, out + 8 * c);
                }
            }
        }
        break;
    default:
        abort(); /* the caller checks the type */
    }
}

void gguf_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t K, const int64_t *ids, int64_t rows,
                          float *out, int64_t out_stride, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * K >= 65536)
    for (int64_t r = 0; r < rows; ++r)
        dequantize_row(type, w + (ids ? ids[r] : r) * row_bytes, K, out + r * out_stride);
}

/* ---- the product ------------------------------------------------------------------------- */
#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(vf v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
typedef float vf;
#define VW 1
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
static inline float vsum(vf v) { return v; }
#endif

#define NB 4  /* weight rows decoded together */
#define MT 64 /* activation rows per work item */
#define MR 4  /* activation rows of the register block */
#define NR 2  /* weight rows of the register block */

/* y[r, n] = x[r, :] . wf[n, :] for r < mr, n < nr (mr <= MR, nr <= NR; constants once inlined). */
static inline __attribute__((always_inline)) void block_dot(int mr, int nr, const float *x, int64_t x_stride,
                                                            const float *wf, int64_t K, float *y, int64_t y_stride)
{
    vf acc[MR][NR];
    for (int r = 0; r < mr; ++r)
        for (int n = 0; n < nr; ++n)
            acc[r][n] = VZERO();
    for (int64_t k = 0; k < K; k += VW) {
        vf w[NR];
        for (int n = 0; n < nr; ++n)
            w[n] = VLOAD(wf + n * K + k);
        for (int r = 0; r < mr; ++r) {
            const vf xv = VLOAD(x + r * x_stride + k);
            for (int n = 0; n < nr; ++n)
                acc[r][n] = VFMA(xv, w[n], acc[r][n]);
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int n = 0; n < nr; ++n)
            y[r * y_stride + n] = vsum(acc[r][n]);
}

#define BLOCK_CASE(m, n) \
    case (m) * 8 + (n): \
        block_dot(m, n, x, x_stride, wf, K, y, y_stride); \
        break;

static void block_dispatch(int mr, int nr, const float *x, int64_t x_stride, const float *wf, int64_t K, float *y,
                           int64_t y_stride)
{
    switch (mr * 8 + nr) {
        BLOCK_CASE(1, 1) BLOCK_CASE(1, 2) BLOCK_CASE(2, 1) BLOCK_CASE(2, 2)
        BLOCK_CASE(3, 1) BLOCK_CASE(3, 2) BLOCK_CASE(4, 1) BLOCK_CASE(4, 2)
    }
}

/* y[M, N] (rows y_stride apart) = x[M, K] (rows x_stride apart) @ W[N, K]^T, W in GGUF blocks. */
void gguf_matmul_f32(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                     int64_t x_stride, int64_t M, float *y, int64_t y_stride, int num_threads)
{
    const int64_t nblocks = (N + NB - 1) / NB, mtiles = (M + MT - 1) / MT;
#pragma omp parallel num_threads(num_threads)
    {
        float *wf = aligned_alloc(64, (size_t)(NB * K * sizeof(float) + 63) / 64 * 64);
#pragma omp for collapse(2) schedule(static)
        for (int64_t mt = 0; mt < mtiles; ++mt) {
            for (int64_t nb = 0; nb < nblocks; ++nb) {
                const int64_t n0 = nb * NB, nrows = N - n0 < NB ? N - n0 : NB;
                for (int64_t i = 0; i < nrows; ++i)
                    dequantize_row(type, w + (n0 + i) * row_bytes, K, wf + i * K);
                const int64_t m_end = (mt + 1) * MT < M ? (mt + 1) * MT : M;
                for (int64_t m = mt * MT; m < m_end; m += MR) {
                    const int mr = m_end - m < MR ? (int)(m_end - m) : MR;
                    for (int64_t n = 0; n < nrows; n += NR) {
                        const int nr = nrows - n < NR ? (int)(nrows - n) : NR;
                        block_dispatch(mr, nr, x + m * x_stride, x_stride, wf + n * K, K, y + m * y_stride + n0 + n,
                                       y_stride);
                    }
                }
            }
        }
        free(wf);
    }
}

/* ---- the product with int8 activations (Q4_0, Q4_1, Q8_0) ---------------------------------
 *
 * gguf_matmul_q8: the activation rows are quantized once per call to int8 in blocks of 32 (one
 * float scale dx = max|x| / 127 per block, codes round(x / dx) in -127..127, and xs = dx times
 * the block's sum of codes), then every (activation row, weight block) pair is an integer dot
 * product of 32 codes:
 *
 *   Q4_0, Q4_1, Q8_0 are all w = d * u + m for an unsigned code u (Q4_0: u = q, m = -8 d;
 *   Q4_1: u = q; Q8_0 with VNNI: u = q + 128, m = -128 d), so
 *   block dot = d * dx * sum(u * xq) + m * xs.
 *   (Q8_0 without VNNI keeps u = q signed, m = 0: maddubs's int16 pairs would saturate on q + 128.)
 *
 * Work items are (a tile of up to QMT activation rows) x (a group of QW weight rows). A thread
 * repacks its group's blocks into a scratch buffer where 32-bit lane j of vector t holds four
 * consecutive codes of weight row j (the nibbles still packed for Q4: the low and high halves
 * are split as they are used), so one u8 x s8 dot instruction (VPDPBUSD, 4 products per lane)
 * advances QW weight rows at once against 4 codes of one activation row broadcast to every
 * lane, and a row group's output is one vector, stored as it is (no horizontal sums). The
 * integer sums of a block become float once, scaled by the QW weight rows' d (a vector) times
 * the activation row's dx (a broadcast). Register block: QMR activation rows.
 *
 * Instruction sets: AVX512-VNNI (QW 16, QMR 8) where the compiler targets it (AVX512F + BW +
 * VNNI); else AVX2 (QW 8, QMR 4) with AVX-VNNI's 256-bit VPDPBUSD where targeted, or
 * VPMADDUBSW + VPMADDWD; else scalar C (QW 8). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q_AVX512 1
#define QW 16
#define QMR 8
#define Q8_BIAS 1
#elif defined(__AVX2__) && defined(__FMA__)
#define Q_AVX2 1
#define QW 8
#define QMR 4
#if defined(__AVXVNNI__)
#define Q8_BIAS 1
#else
#define Q8_BIAS 0
#endif
#else
#define QW 8
#define QMR 4
#define Q8_BIAS 0
#endif
#define QMT 128 /* activation rows per work item */

/* One activation row of K (a multiple of 32) to codes q in -127..127 and scale d = max|x| / 127
 * per block of 32 (x ~ d * q); with r (two passes), also the residual's codes r = round((x - d * q)
 * * 254 / d) (x ~ d * q + d / 254 * r: what the first pass rounded off, at 254 times the scale).
 * xs = each block's d * sum(q) (+ d / 254 * sum(r)), d / 254 stored in place of d with r. */
static void quantize_row_q8(const float *x, int64_t K, int8_t *q, int8_t *r, float *d, float *xs)
{
    for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i)
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax; /* (vectorized by the compiler) */
        const float s = amax / 127.0f, inv = amax > 0.0f ? 1.0f / s : 0.0f, inv2 = 254.0f * inv;
        int sum = 0, sum2 = 0;
#if defined(Q_AVX512)
        const __m512 iv = _mm512_set1_ps(inv), sv = _mm512_set1_ps(s), iv2 = _mm512_set1_ps(inv2);
        for (int i = 0; i < 32; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v, iv));
            _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(c));
            sum += _mm512_reduce_add_epi32(c);
            if (r) {
                const __m512 res = _mm512_sub_ps(v, _mm512_mul_ps(sv, _mm512_cvtepi32_ps(c)));
                const __m512i c2 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(res, iv2)),
                                                                     _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                _mm_storeu_si128((__m128i *)(r + b * 32 + i), _mm512_cvtsepi32_epi8(c2));
                sum2 += _mm512_reduce_add_epi32(c2);
            }
        }
#elif defined(Q_AVX2)
        const __m256 iv = _mm256_set1_ps(inv), sv = _mm256_set1_ps(s), iv2 = _mm256_set1_ps(inv2);
        __m256i acc = _mm256_setzero_si256(), acc2 = _mm256_setzero_si256();
        for (int i = 0; i < 32; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v, iv));
            acc = _mm256_add_epi32(acc, c);
            __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(c16, c16));
            if (r) {
                const __m256 res = _mm256_sub_ps(v, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(c)));
                const __m256i c2 = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(res, iv2)),
                                                                     _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
                acc2 = _mm256_add_epi32(acc2, c2);
                c16 = _mm_packs_epi32(_mm256_castsi256_si128(c2), _mm256_extracti128_si256(c2, 1));
                _mm_storel_epi64((__m128i *)(r + b * 32 + i), _mm_packs_epi16(c16, c16));
            }
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        sum = _mm_cvtsi128_si32(s4);
        s4 = _mm_add_epi32(_mm256_castsi256_si128(acc2), _mm256_extracti128_si256(acc2, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        sum2 = _mm_cvtsi128_si32(s4);
#else
        for (int i = 0; i < 32; ++i) {
            const int c = (int)nearbyintf(x[i] * inv); /* round half to even, as cvtps2dq */
            q[i] = (int8_t)c;
            sum += c;
            if (r) {
                int c2 = (int)nearbyintf((x[i] - s * (float)c) * inv2);
                c2 = c2 > 127 ? 127 : c2 < -127 ? -127 : c2;
                r[b * 32 + i] = (int8_t)c2;
                sum2 += c2;
            }
        }
#endif
        if (r) {
            d[b] = s / 254.0f;
            xs[b] = s * (float)sum + d[b] * (float)sum2;
        } else {
            d[b] = s;
            xs[b] = s * (float)sum;
        }
    }
}

/* r: NULL (one pass) or the residual codes, [M, K] like q (see quantize_row_q8). */
void gguf_quantize_rows_q8(const float *x, int64_t x_stride, int64_t M, int64_t K, int8_t *q, int8_t *r, float *d,
                           float *xs)
{
    for (int64_t i = 0; i < M; ++i)
        quantize_row_q8(x + i * x_stride, K, q + i * K, r ? r + i * K : NULL, d + i * (K / 32), xs + i * (K / 32));
}

/* 16 bytes of each of 4 rows -> dword t of the 4 rows at out + 16 * QW * t (a 4x4 dword transpose). */
static inline void transpose4(const uint8_t *r0, const uint8_t *r1, const uint8_t *r2, const uint8_t *r3,
                              int flip, uint8_t *out)
{
#if defined(Q_AVX512) || defined(Q_AVX2)
    const __m128i a = _mm_loadu_si128((const __m128i *)r0), b = _mm_loadu_si128((const __m128i *)r1);
    const __m128i c = _mm_loadu_si128((const __m128i *)r2), e = _mm_loadu_si128((const __m128i *)r3);
    const __m128i t0 = _mm_unpacklo_epi32(a, b), t1 = _mm_unpacklo_epi32(c, e);
    const __m128i t2 = _mm_unpackhi_epi32(a, b), t3 = _mm_unpackhi_epi32(c, e);
    const __m128i f = _mm_set1_epi8(flip ? (char)0x80 : 0);
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(_mm_unpacklo_epi64(t0, t1), f));
    _mm_storeu_si128((__m128i *)(out + 4 * QW), _mm_xor_si128(_mm_unpackhi_epi64(t0, t1), f));
    _mm_storeu_si128((__m128i *)(out + 8 * QW), _mm_xor_si128(_mm_unpacklo_epi64(t2, t3), f));
    _mm_storeu_si128((__m128i *)(out + 12 * QW), _mm_xor_si128(_mm_unpackhi_epi64(t2, t3), f));
#else
    const uint8_t *rows[4] = {r0, r1, r2, r3};
    for (int t = 0; t < 4; ++t)
        for (int j = 0; j < 4; ++j)
            for (int e = 0; e < 4; ++e)
                out[4 * QW * t + 4 * j + e] = rows[j][4 * t + e] ^ (flip ? 0x80 : 0);
#endif
}

/* Repack weight rows (rows <= QW of them; the rest of the group repeats the last) into codes
 * ([nb][T][QW][4] bytes, T = 4 dwords of packed nibbles for Q4, 8 of int8 for Q8_0), d and m
 * ([nb][QW] floats). */
static void pack_group(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb, uint8_t *codes,
                       float *dsc, float *msc)
{
    const uint8_t *rp[QW];
    for (int j = 0; j < QW; ++j)
        rp[j] = w + (j < rows ? j : rows - 1) * row_bytes;
    const int q8 = type == Q8_0, bsize = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34, T = q8 ? 8 : 4;
    const int qoff = type == Q4_1 ? 4 : 2;
    for (int64_t b = 0; b < nb; ++b) {
        uint8_t *cb = codes + b * T * QW * 4;
        for (int j = 0; j < QW; j += 4) {
            const uint8_t *s0 = rp[j] + b * bsize + qoff, *s1 = rp[j + 1] + b * bsize + qoff;
            const uint8_t *s2 = rp[j + 2] + b * bsize + qoff, *s3 = rp[j + 3] + b * bsize + qoff;
            transpose4(s0, s1, s2, s3, q8 && Q8_BIAS, cb + 4 * j);
            if (q8)
                transpose4(s0 + 16, s1 + 16, s2 + 16, s3 + 16, Q8_BIAS, cb + 16 * QW + 4 * j);
        }
        for (int j = 0; j < QW; ++j) {
            const uint8_t *blk = rp[j] + b * bsize;
            const float d = f16_to_f32(blk);
            dsc[b * QW + j] = d;
            msc[b * QW + j] = type == Q4_1 ? f16_to_f32(blk + 2) : type == Q4_0 ? -8.0f * d
                              : (Q8_BIAS ? -128.0f * d : 0.0f);
        }
    }
}

#if defined(Q_AVX512)
typedef __m512i qvi;
typedef __m512 qvf;
#define QLOAD(p) _mm512_loadu_si512((const void *)(p))
#define QBCAST(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define QDOT(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define QDOTS(acc, w, s) _mm512_dpbusd_epi32(acc, w, s) /* w is q + 128 (Q8_BIAS) */
#define QZERO_I() _mm512_setzero_si512()
#define QZERO_F() _mm512_setzero_ps()
#define QLO(v) _mm512_and_si512(v, _mm512_set1_epi8(15))
#define QHI(v) _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15))
#define QCVT(v) _mm512_cvtepi32_ps(v)
#define QADD_I(a, b) _mm512_add_epi32(a, b)
#define QLOADF(p) _mm512_loadu_ps(p)
#define QSET1F(f) _mm512_set1_ps(f)
#define QMUL(a, b) _mm512_mul_ps(a, b)
#define QFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define QSTOREF(p, v) _mm512_storeu_ps(p, v)
#elif defined(Q_AVX2)
typedef __m256i qvi;
typedef __m256 qvf;
#define QLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define QBCAST(p) _mm256_set1_epi32(*(const int32_t *)(p))
#if defined(__AVXVNNI__)
#define QDOT(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define QDOTS(acc, w, s) _mm256_dpbusd_avx_epi32(acc, w, s)
#else
#define QDOT(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define QDOTS(acc, w, s) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w)), \
                                            _mm256_set1_epi16(1)))
#endif
#define QZERO_I() _mm256_setzero_si256()
#define QZERO_F() _mm256_setzero_ps()
#define QLO(v) _mm256_and_si256(v, _mm256_set1_epi8(15))
#define QHI(v) _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15))
#define QCVT(v) _mm256_cvtepi32_ps(v)
#define QADD_I(a, b) _mm256_add_epi32(a, b)
#define QLOADF(p) _mm256_loadu_ps(p)
#define QSET1F(f) _mm256_set1_ps(f)
#define QMUL(a, b) _mm256_mul_ps(a, b)
#define QFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define QSTOREF(p, v) _mm256_storeu_ps(p, v)
#endif

#if defined(Q_AVX512)
#define QMUL254(v) _mm512_sub_epi32(_mm512_slli_epi32(v, 8), _mm512_slli_epi32(v, 1))
#elif defined(Q_AVX2)
#define QMUL254(v) _mm256_sub_epi32(_mm256_slli_epi32(v, 8), _mm256_slli_epi32(v, 1))
#endif

/* y[r, 0..nvalid) = the group's QW weight rows . activation row r, for r < mr (mr <= QMR); two:
 * the residual codes xr too (each block's integer sum is 254 * sum(u * q) + sum(u * r)). */
static inline __attribute__((always_inline)) void qblock(int mr, int q8, int two, const uint8_t *codes,
                                                         const float *dsc, const float *msc, int64_t nb,
                                                         const int8_t *xq, const int8_t *xr, int64_t K, const float *xd,
                                                         const float *xs, float *y, int64_t y_stride, int nvalid)
{
#if defined(Q_AVX512) || defined(Q_AVX2)
    qvf accf[QMR];
    for (int r = 0; r < mr; ++r)
        accf[r] = QZERO_F();
    for (int64_t b = 0; b < nb; ++b) {
        qvi acc[QMR], acc2[QMR];
        for (int r = 0; r < mr; ++r) {
            acc[r] = QZERO_I();
            if (two)
                acc2[r] = QZERO_I();
        }
        const int8_t *xb = xq + b * 32, *rb = two ? xr + b * 32 : NULL;
        if (q8) {
            const uint8_t *cb = codes + b * 32 * QW;
            for (int t = 0; t < 8; ++t) {
                const qvi v = QLOAD(cb + t * 4 * QW);
                for (int r = 0; r < mr; ++r) {
                    acc[r] = QDOTS(acc[r], v, QBCAST(xb + r * K + 4 * t));
                    if (two)
                        acc2[r] = QDOTS(acc2[r], v, QBCAST(rb + r * K + 4 * t));
                }
            }
        } else {
            const uint8_t *cb = codes + b * 16 * QW;
            for (int t = 0; t < 4; ++t) {
                const qvi v = QLOAD(cb + t * 4 * QW), lo = QLO(v), hi = QHI(v);
                for (int r = 0; r < mr; ++r) {
                    acc[r] = QDOT(acc[r], lo, QBCAST(xb + r * K + 4 * t));
                    acc[r] = QDOT(acc[r], hi, QBCAST(xb + r * K + 16 + 4 * t));
                    if (two) {
                        acc2[r] = QDOT(acc2[r], lo, QBCAST(rb + r * K + 4 * t));
                        acc2[r] = QDOT(acc2[r], hi, QBCAST(rb + r * K + 16 + 4 * t));
                    }
                }
            }
        }
        const qvf dv = QLOADF(dsc + b * QW), mv = QLOADF(msc + b * QW);
        for (int r = 0; r < mr; ++r) {
            const qvi sum = two ? QADD_I(QMUL254(acc[r]), acc2[r]) : acc[r];
            accf[r] = QFMA(QCVT(sum), QMUL(dv, QSET1F(xd[r * nb + b])), accf[r]);
            accf[r] = QFMA(mv, QSET1F(xs[r * nb + b]), accf[r]);
        }
    }
    for (int r = 0; r < mr; ++r) {
        if (nvalid == QW) {
            QSTOREF(y + r * y_stride, accf[r]);
        } else {
            float tmp[QW];
            QSTOREF(tmp, accf[r]);
            memcpy(y + r * y_stride, tmp, (size_t)nvalid * sizeof(float));
        }
    }
#else
    for (int r = 0; r < mr; ++r) {
        float out[QW] = {0};
        for (int64_t b = 0; b < nb; ++b) {
            const int8_t *xb = xq + r * K + b * 32, *rb = two ? xr + r * K + b * 32 : NULL;
            for (int j = 0; j < QW; ++j) {
                int s = 0, s2 = 0;
                for (int t = 0; t < (q8 ? 8 : 4); ++t) {
                    const uint8_t *c = codes + b * (q8 ? 32 : 16) * QW + t * 4 * QW + 4 * j;
                    for (int e = 0; e < 4; ++e) {
                        if (q8) {
                            s += (int)(int8_t)c[e] * xb[4 * t + e];
                            if (two)
                                s2 += (int)(int8_t)c[e] * rb[4 * t + e];
                        } else {
                            s += (c[e] & 15) * xb[4 * t + e] + (c[e] >> 4) * xb[16 + 4 * t + e];
                            if (two)
                                s2 += (c[e] & 15) * rb[4 * t + e] + (c[e] >> 4) * rb[16 + 4 * t + e];
                        }
                    }
                }
                if (two)
                    s = 254 * s + s2;
                out[j] += (float)s * (dsc[b * QW + j] * xd[r * nb + b]) + msc[b * QW + j] * xs[r * nb + b];
            }
        }
        memcpy(y + r * y_stride, out, (size_t)nvalid * sizeof(float));
    }
#endif
}

#define QCASE(m) \
    case (m) * 4 + 0: \
        qblock(m, 0, 0, codes, dsc, msc, nb, xq, xr, K, xd, xs, y, y_stride, nvalid); \
        break; \
    case (m) * 4 + 1: \
        qblock(m, 1, 0, codes, dsc, msc, nb, xq, xr, K, xd, xs, y, y_stride, nvalid); \
        break; \
    case (m) * 4 + 2: \
        qblock(m, 0, 1, codes, dsc, msc, nb, xq, xr, K, xd, xs, y, y_stride, nvalid); \
        break; \
    case (m) * 4 + 3: \
        qblock(m, 1, 1, codes, dsc, msc, nb, xq, xr, K, xd, xs, y, y_stride, nvalid); \
        break;

static void qblock_dispatch(int mr, int q8, int two, const uint8_t *codes, const float *dsc, const float *msc,
                            int64_t nb, const int8_t *xq, const int8_t *xr, int64_t K, const float *xd,
                            const float *xs, float *y, int64_t y_stride, int nvalid)
{
    switch (mr * 4 + two * 2 + q8) {
        QCASE(1) QCASE(2) QCASE(3) QCASE(4)
#if QMR > 4
        QCASE(5) QCASE(6) QCASE(7) QCASE(8)
#endif
    }
}

/* y[M, N] = x[M, K] @ W[N, K]^T for W in Q4_0 / Q4_1 / Q8_0 blocks, the activations quantized to
 * int8 first (see above) in `passes` (1: codes; 2: codes and the residual's codes). Returns -1
 * (nothing done) for another type. */
int gguf_matmul_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                   int64_t x_stride, int64_t M, float *y, int64_t y_stride, int passes, int num_threads)
{
    if (type != Q4_0 && type != Q4_1 && type != Q8_0)
        return -1;
    const int64_t nb = K / 32, ngroups = (N + QW - 1) / QW, mtiles = (M + QMT - 1) / QMT;
    const int q8 = type == Q8_0, two = passes == 2;
    int8_t *xq = malloc((size_t)(M * K) * (two ? 2 : 1)), *xr = two ? xq + M * K : NULL;
    float *xd = malloc((size_t)(M * nb) * sizeof(float)), *xs = malloc((size_t)(M * nb) * sizeof(float));
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            quantize_row_q8(x + r * x_stride, K, xq + r * K, two ? xr + r * K : NULL, xd + r * nb, xs + r * nb);
        uint8_t *codes = aligned_alloc(64, (size_t)(nb * 32 * QW + 63) / 64 * 64);
        float *dsc = aligned_alloc(64, (size_t)(nb * QW * sizeof(float) + 63) / 64 * 64);
        float *msc = aligned_alloc(64, (size_t)(nb * QW * sizeof(float) + 63) / 64 * 64);
#pragma omp for collapse(2) schedule(static)
        for (int64_t mt = 0; mt < mtiles; ++mt) {
            for (int64_t g = 0; g < ngroups; ++g) {
                const int64_t n0 = g * QW;
                const int nvalid = N - n0 < QW ? (int)(N - n0) : QW;
                pack_group(type, w + n0 * row_bytes, row_bytes, nvalid, nb, codes, dsc, msc);
                const int64_t m_end = (mt + 1) * QMT < M ? (mt + 1) * QMT : M;
                for (int64_t m = mt * QMT; m < m_end; m += QMR) {
                    const int mr = m_end - m < QMR ? (int)(m_end - m) : QMR;
                    qblock_dispatch(mr, q8, two, codes, dsc, msc, nb, xq + m * K, two ? xr + m * K : NULL, K,
                                    xd + m * nb, xs + m * nb, y + m * y_stride + n0, y_stride, nvalid);
                }
            }
        }
        free(codes);
        free(dsc);
        free(msc);
    }
    free(xq);
    free(xd);
    free(xs);
    return 0;
}
