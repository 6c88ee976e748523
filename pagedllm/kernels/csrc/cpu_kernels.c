/* Paged decode attention for the CPU, float32 (pagedllm/kernels/cpu_kernels.py builds and
 * calls it).
 *
 * One query token per request. Each (request, kv head) pair is one unit of work: the query
 * rows of that head's group (G = hq / hkv of them) walk the request's blocks through its block
 * table, reading K and V straight from the paged cache (no gathered copy), with the softmax
 * kept online per block (running max m, running sum l, unnormalized accumulator acc).
 *
 *   cache layout  [num_blocks, block_size, hkv, D]
 *   token t of request s  ->  block block_tables[s * bt_stride + t / block_size], slot t % block_size
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* e^x for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the
 * exponent bits); written out so that the compiler vectorizes the loops that call it, which it
 * does not do for libm's expf without -ffast-math (whose crtfastmath would set flush-to-zero
 * for the whole process). Within about 2 ulp; inputs below -87 give e^-87 (~1.6e-38). */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    /* n = round(x / ln2): adding and taking away 1.5 * 2^23 rounds to an integer (floorf
     * would keep the loop scalar unless traps are off) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

void paged_decode_attention_f32(
    const float *q,             /* [nd, hq, D]; rows q_stride apart, heads D apart */
    int64_t q_stride,
    const float *k_cache,       /* [num_blocks, bs, hkv, D], contiguous */
    const float *v_cache,
    const int32_t *block_tables, /* rows bt_stride apart */
    int64_t bt_stride,
    const int32_t *seq_lens,    /* [nd] context length, the new token included */
    float *out,                 /* [nd, hq, D], contiguous */
    int nd, int hq, int hkv, int D, int bs, float scale, int num_threads)
{
    const int G = hq / hkv;
    const int64_t tok_stride = (int64_t)hkv * D;

#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int s = 0; s < nd; ++s) {
        for (int h = 0; h < hkv; ++h) {
            float m[G], l[G], acc[G * D], sc[G * bs];
            const float *qs = q + s * q_stride + (int64_t)h * G * D;
            const int32_t *bt = block_tables + s * bt_stride;
            const int len = seq_lens[s];
            for (int g = 0; g < G; ++g) {
                m[g] = -FLT_MAX; /* not -inf: finite under any math flags */
                l[g] = 0.0f;
                for (int d = 0; d < D; ++d)
                    acc[g * D + d] = 0.0f;
            }
            for (int start = 0; start < len; start += bs) {
                const int ntok = len - start < bs ? len - start : bs;
                const int64_t base = (int64_t)bt[start / bs] * bs * tok_stride + (int64_t)h * D;
                const float *kb = k_cache + base;
                const float *vb = v_cache + base;
                for (int t = 0; t < ntok; ++t) {
                    const float *kt = kb + t * tok_stride;
                    for (int g = 0; g < G; ++g) {
                        const float *qg = qs + g * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < D; ++d)
                            dot += qg[d] * kt[d];
                        sc[g * bs + t] = dot * scale;
                    }
                }
                for (int g = 0; g < G; ++g) {
                    float bm = m[g];
#pragma omp simd reduction(max : bm)
                    for (int t = 0; t < ntok; ++t)
                        bm = sc[g * bs + t] > bm ? sc[g * bs + t] : bm;
                    const float corr = exp_nonpositive(m[g] - bm); /* ~0 on the first block */
                    float *ag = acc + g * D;
#pragma omp simd
                    for (int d = 0; d < D; ++d)
                        ag[d] *= corr;
                    float *sg = sc + g * bs, sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < ntok; ++t) {
                        const float p = exp_nonpositive(sg[t] - bm);
                        sg[t] = p;
                        sum += p;
                    }
                    l[g] = l[g] * corr + sum;
                    m[g] = bm;
                }
                for (int t = 0; t < ntok; ++t) {
                    const float *vt = vb + t * tok_stride;
                    for (int g = 0; g < G; ++g) {
                        const float p = sc[g * bs + t];
                        float *ag = acc + g * D;
#pragma omp simd
                        for (int d = 0; d < D; ++d)
                            ag[d] += p * vt[d];
                    }
                }
            }
            float *os = out + ((int64_t)s * hq + (int64_t)h * G) * D;
            for (int g = 0; g < G; ++g) {
                const float inv = 1.0f / l[g];
#pragma omp simd
                for (int d = 0; d < D; ++d)
                    os[g * D + d] = acc[g * D + d] * inv;
            }
        }
    }
}

/* The index of each row's largest value, the first one on ties, like torch.argmax; a row
 * holding NaN gives its first NaN (torch's too). Two vectorized passes over a row: its max,
 * then the first index holding it. */
void argmax_rows_f32(const float *x, int64_t row_stride, int64_t rows, int64_t cols, int64_t *out,
                     int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * row_stride;
        float mx = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t c = 0; c < cols; ++c) {
            mx = xr[c] > mx ? xr[c] : mx;
            nan |= xr[c] != xr[c];
        }
        int64_t idx = 0;
        if (nan) {
            while (xr[idx] == xr[idx])
                ++idx;
        } else {
            while (idx < cols - 1 && xr[idx] != mx)
                ++idx;
        }
        out[r] = idx;
    }
}
