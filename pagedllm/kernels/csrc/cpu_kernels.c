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
 *
 * window > 0: only the last `window` tokens are attended (a sliding-window layer; the blocks
 * before them are not read). softcap > 0: scores become softcap * tanh(score / softcap).
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
    int nd, int hq, int hkv, int D, int bs, float scale, int window, float softcap, int num_threads)
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
            const int first = window > 0 && len > window ? len - window : 0;
            for (int start = first - first % bs; start < len; start += bs) {
                const int ntok = len - start < bs ? len - start : bs;
                /* tokens [t0, ntok) of this block are in the window (t0 = 0 without one) */
                const int t0 = first > start ? first - start : 0;
                const int64_t base = (int64_t)bt[start / bs] * bs * tok_stride + (int64_t)h * D;
                const float *kb = k_cache + base;
                const float *vb = v_cache + base;
                for (int t = t0; t < ntok; ++t) {
                    const float *kt = kb + t * tok_stride;
                    for (int g = 0; g < G; ++g) {
                        const float *qg = qs + g * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < D; ++d)
                            dot += qg[d] * kt[d];
                        sc[g * bs + t] = softcap > 0.0f ? softcap * tanhf(dot * scale / softcap) : dot * scale;
                    }
                }
                for (int g = 0; g < G; ++g) {
                    float bm = m[g];
#pragma omp simd reduction(max : bm)
                    for (int t = t0; t < ntok; ++t)
                        bm = sc[g * bs + t] > bm ? sc[g * bs + t] : bm;
                    const float corr = exp_nonpositive(m[g] - bm); /* ~0 on the first block */
                    float *ag = acc + g * D;
#pragma omp simd
                    for (int d = 0; d < D; ++d)
                        ag[d] *= corr;
                    float *sg = sc + g * bs, sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int t = t0; t < ntok; ++t) {
                        const float p = exp_nonpositive(sg[t] - bm);
                        sg[t] = p;
                        sum += p;
                    }
                    l[g] = l[g] * corr + sum;
                    m[g] = bm;
                }
                for (int t = t0; t < ntok; ++t) {
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

/* Structured outputs' grammar bitmask, in place: row rows[g] of x keeps the tokens that bitmask
 * row g allows (bit b of word w allows token 32 w + b) and gets -inf elsewhere. A word of all
 * ones (most of them inside a JSON string) costs one compare. */
void bitmask_fill_rows_f32(float *x, int64_t row_stride, int64_t cols, const int32_t *bitmask, int64_t words,
                           const int64_t *rows, int64_t g, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (g >= 8)
    for (int64_t i = 0; i < g; ++i) {
        float *xr = x + rows[i] * row_stride;
        const int32_t *bm = bitmask + i * words;
        for (int64_t w = 0; w < words; ++w) {
            uint32_t bits = (uint32_t)bm[w];
            if (bits == 0xffffffffu)
                continue;
            int64_t base = 32 * w;
            int64_t n = cols - base < 32 ? cols - base : 32;
            for (int64_t b = 0; b < n; ++b)
                if (!((bits >> b) & 1u))
                    xr[base + b] = -INFINITY;
        }
    }
}

/* RMSNorm of each row, optionally after adding the residual (HF Llama's order in float32:
 * r = x + residual; out = w * (r * (1 / sqrt(mean(r^2) + eps)))). With residual != NULL the
 * sum r is written to sum_out. x, residual: rows x_stride / res_stride apart; out, sum_out:
 * contiguous [rows, H]. */
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                      const float *w, float *out, float *sum_out, int64_t rows, int64_t H, float eps,
                      int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * H >= 16384)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xr = x + t * x_stride;
        const float *r = xr;
        if (residual) {
            const float *rr = residual + t * res_stride;
            float *sr = sum_out + t * H;
#pragma omp simd
            for (int64_t i = 0; i < H; ++i)
                sr[i] = xr[i] + rr[i];
            r = sr;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; ++i)
            ss += r[i] * r[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        float *o = out + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i)
            o[i] = w[i] * (r[i] * inv);
    }
}

/* Rotary embedding (rotate-half layout) of q and k into one output [T, hq + hkv, D]:
 * out = x * cos + swap_halves(x) * folded_sin, where folded_sin is sin with its first half
 * negated (so that swap_halves(x) * folded_sin == rotate_half(x) * sin exactly). cos/sin:
 * [max_pos, D] caches, row positions[t]. q, k: head rows D apart, token rows q_stride /
 * k_stride apart. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FMA __attribute__((optimize("fp-contract=off"))) /* the same bits as torch's mul, mul, add */
#else
#define NO_FMA
#endif
NO_FMA void rotary_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const int64_t *positions,
                const float *cos_cache, const float *sin_cache, float *out, int64_t T, int hq, int hkv, int D,
                int num_threads)
{
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * (hq + hkv) * D >= 16384)
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_cache + positions[t] * D;
        const float *s = sin_cache + positions[t] * D;
        for (int h = 0; h < hq + hkv; ++h) {
            const float *x = h < hq ? q + t * q_stride + (int64_t)h * D : k + t * k_stride + (int64_t)(h - hq) * D;
            float *o = out + (t * (hq + hkv) + h) * (int64_t)D;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                o[i] = x[i] * c[i] + x[i + half] * -s[i];
                o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
        }
    }
}
