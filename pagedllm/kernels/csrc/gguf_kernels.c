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
