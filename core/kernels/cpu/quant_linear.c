/* Linear layers on weight-only quantized weights, fp32 activations (launchers: tightfit.kernels.quant_linear and
   tightfit.kernels.quant_linear_a8).
     tf_int8_linear_f32   y = x (q * scale)^T + b                   q (N, K) int8, one scale per output row
     tf_int4_linear_f32   y = x ((q - 8) * scale + zero)^T + b      q (N, K/2) two nibbles a byte (pack_int4's
                                                                  order), scale and zero per row and group of G
     tf_dequantize_f32    the fp32 (N, K) weight of either format (zero NULL: int8), in row order
     tf_a8_linear_f32     y = x W^T + b with x quantised to int8 (quant_a8.h)
   Each weight byte is read once per call and dequantised in registers; with AVX2 and FMA the loops are intrinsics
   and the scalar loops stay as their reference (tf_quant_set_simd). Output features are split over at most
   `threads` threads: the process's OpenMP team where built with it, else a pool started once per process; calls
   under min_work multiply-adds stay on the caller. Contract: rows of x lie xs floats apart; y is M x N,
   contiguous. Returns 0, or -1 where a buffer could not be allocated. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_THREADS 64
#define MAX_CHUNKS 256

typedef struct {
    const float *x, *scale, *zero, *bias, *xsum;
    const void *w;
    float *y;
    int64_t xs, M, N, K, G, n0, n1;
    const int8_t *xq; /* the int8-activation kernels (quant_a8.h): quantised x, its scales */
    const float *dv, *corr;
    int tiled; /* weights in 16-feature tiles (tightfit.kernels.weight_tiles: tile_int8, tile_int4) */
} job_t;

typedef void (*range_fn)(const job_t *);

/* Settings the tests turn: SIMD on/off (the scalar loops stay the reference of the intrinsics) and the
   multiply-adds below which a call stays on the calling thread. */
static int use_simd = 1;
static int64_t min_work = 262144;

/* Whether the SIMD loops were in use (0 on a build without AVX2); on < 0 only asks. */
int tf_quant_set_simd(int on) {
#ifdef __AVX2__
    const int old = use_simd;
#else
    const int old = 0;
#endif
    if (on >= 0) use_simd = on;
    return old;
}

int64_t tf_quant_set_min_work(int64_t work) {
    int64_t old = min_work;
    if (work >= 0) min_work = work;
    return old;
}

/* ------------------------------------------------------------------ scalar loops (any CPU, any shape) */

/* int8: y[m, n] = scale[n] * sum_k x[m, k] q[n, k] + bias[n]; four rows share each pass over q[n]. */
static void int8_scalar(const job_t *j) {
    const int8_t *W = j->w;
    const int64_t K = j->K, N = j->N, M = j->M, xs = j->xs;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const int8_t *q = W + n * K;
        const float s = j->scale[n], b = j->bias ? j->bias[n] : 0.f;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *x0 = j->x + m * xs, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const float w = (float)q[k];
                a0 += x0[k] * w;
                a1 += x1[k] * w;
                a2 += x2[k] * w;
                a3 += x3[k] * w;
            }
            j->y[m * N + n] = a0 * s + b;
            j->y[(m + 1) * N + n] = a1 * s + b;
            j->y[(m + 2) * N + n] = a2 * s + b;
            j->y[(m + 3) * N + n] = a3 * s + b;
        }
        for (; m < M; m++) {
            const float *x0 = j->x + m * xs;
            float a0 = 0.f;
            for (int64_t k = 0; k < K; k++) a0 += x0[k] * (float)q[k];
            j->y[m * N + n] = a0 * s + b;
        }
    }
}

/* int4: W[n, k] = (q - 8) * scale[n, g] + zero[n, g] = q * s + (zero - 8 s), so per group
   y += s * dot(x_g, q_g) + (zero - 8 s) * sum(x_g), with sum(x_g) = xsum[m, g] computed once per call.
   Byte j of a group holds element j (low nibble) and element j + G/2 (high nibble). */
static void int4_scalar(const job_t *j) {
    const uint8_t *W = j->w;
    const int64_t K = j->K, N = j->N, M = j->M, xs = j->xs, G = j->G, H = G / 2, ng = K / G;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const uint8_t *row = W + n * (K / 2);
        const float *sc = j->scale + n * ng, *zc = j->zero + n * ng;
        const float b = j->bias ? j->bias[n] : 0.f;
        for (int64_t m = 0; m < M; m++) {
            const float *x0 = j->x + m * xs, *s0 = j->xsum + m * ng;
            float y0 = b;
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *p = row + g * H;
                const int64_t o = g * G;
                float a0 = 0.f;
                for (int64_t i = 0; i < H; i++)
                    a0 += x0[o + i] * (float)(p[i] & 15) + x0[o + H + i] * (float)(p[i] >> 4);
                const float s = sc[g];
                y0 += a0 * s + (zc[g] - 8.f * s) * s0[g];
            }
            j->y[m * N + n] = y0;
        }
    }
}

/* ------------------------------------------------------------------ AVX2 + FMA */
#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int8 weights at q -> 8 floats (sign-extend, convert). */
static inline __m256 i8x8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* Rows [m0, M) of output features [n0, n1). */
static void int8_rows(const job_t *j, int64_t n0, int64_t n1, int64_t m0) {
    const int8_t *W = j->w;
    const int64_t K = j->K, N = j->N, M = j->M, xs = j->xs;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *q = W + n * K;
        const float s = j->scale[n], b = j->bias ? j->bias[n] : 0.f;
        int64_t m = m0;
        for (; m + 4 <= M; m += 4) { /* four rows: each weight vector feeds four FMAs, two chains per row */
            const float *x0 = j->x + m * xs, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                const __m256 w = i8x8(q + k), v = i8x8(q + k + 8);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), w, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), w, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k), w, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k), w, a3);
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), v, c0);
                c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), v, c1);
                c2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k + 8), v, c2);
                c3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k + 8), v, c3);
            }
            float r0 = hsum8(_mm256_add_ps(a0, c0)), r1 = hsum8(_mm256_add_ps(a1, c1));
            float r2 = hsum8(_mm256_add_ps(a2, c2)), r3 = hsum8(_mm256_add_ps(a3, c3));
            for (; k < K; k++) {
                const float w = (float)q[k];
                r0 += x0[k] * w;
                r1 += x1[k] * w;
                r2 += x2[k] * w;
                r3 += x3[k] * w;
            }
            j->y[m * N + n] = r0 * s + b;
            j->y[(m + 1) * N + n] = r1 * s + b;
            j->y[(m + 2) * N + n] = r2 * s + b;
            j->y[(m + 3) * N + n] = r3 * s + b;
        }
        for (; m < M; m++) { /* one row: four chains over 32 weights hide the FMA latency */
            const float *x0 = j->x + m * xs;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), i8x8(q + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), i8x8(q + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 16), i8x8(q + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 24), i8x8(q + k + 24), a3);
            }
            for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), i8x8(q + k), a0);
            float r = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            for (; k < K; k++) r += x0[k] * (float)q[k];
            j->y[m * N + n] = r * s + b;
        }
    }
}

/* Output features n and n + 1, rows [0, M4) four at a time (each input vector feeds two FMAs, each weight
   vector four); K % 8 tails in scalar. */
static void int8_pair(const job_t *j, int64_t n, int64_t M4) {
    const int64_t K = j->K, N = j->N, xs = j->xs, K8 = K / 8 * 8;
    const int8_t *q0 = (const int8_t *)j->w + n * K, *q1 = q0 + K;
    const float s0 = j->scale[n], s1 = j->scale[n + 1];
    const float b0 = j->bias ? j->bias[n] : 0.f, b1 = j->bias ? j->bias[n + 1] : 0.f;
    for (int64_t m = 0; m < M4; m += 4) {
        const float *x0 = j->x + m * xs, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        for (int64_t k = 0; k < K8; k += 8) {
            const __m256 p = i8x8(q0 + k), r = i8x8(q1 + k);
            __m256 x = _mm256_loadu_ps(x0 + k);
            a0 = _mm256_fmadd_ps(x, p, a0);
            c0 = _mm256_fmadd_ps(x, r, c0);
            x = _mm256_loadu_ps(x1 + k);
            a1 = _mm256_fmadd_ps(x, p, a1);
            c1 = _mm256_fmadd_ps(x, r, c1);
            x = _mm256_loadu_ps(x2 + k);
            a2 = _mm256_fmadd_ps(x, p, a2);
            c2 = _mm256_fmadd_ps(x, r, c2);
            x = _mm256_loadu_ps(x3 + k);
            a3 = _mm256_fmadd_ps(x, p, a3);
            c3 = _mm256_fmadd_ps(x, r, c3);
        }
        const __m256 t0[4] = {a0, a1, a2, a3}, t1[4] = {c0, c1, c2, c3};
        for (int64_t i = 0; i < 4; i++) {
            const float *xr = j->x + (m + i) * xs;
            float e0 = hsum8(t0[i]), e1 = hsum8(t1[i]);
            for (int64_t k = K8; k < K; k++) {
                e0 += xr[k] * (float)q0[k];
                e1 += xr[k] * (float)q1[k];
            }
            j->y[(m + i) * N + n] = e0 * s0 + b0;
            j->y[(m + i) * N + n + 1] = e1 * s1 + b1;
        }
    }
}

static void int8_avx2(const job_t *j) {
    int64_t n = j->n0;
    const int64_t M4 = j->M / 4 * 4;
    if (M4 > 0) {
        for (; n + 2 <= j->n1; n += 2) int8_pair(j, n, M4);
        int8_rows(j, j->n0, n, M4); /* the paired features' last M % 4 rows */
    }
    int8_rows(j, n, j->n1, 0);
}

/* int4 without shuffles: a 32-byte block of a row's packed weights is eight 32-bit lanes; nibble j of every
   lane is (v >> 4j) & 15, eight weights in one shift and one mask. Their inputs are not contiguous in x, so
   each call first permutes x once (M x K floats, shared by every output row) into that order: xp[64 b + 8 j + l]
   is the input of nibble j of lane l of block b (see permute_x). Needs K % 64 == 0 and G % 64 == 0 (a block
   within one group) or G == 32 (a block spans two groups: lanes 0-3 and 4-7). */
/* Nibble j < 7 is read as (v & (15 << 4j)), i.e. q * 16^j: its input carries 16^-j (exact: a power of two). */
static const float scale_of[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f};

static void permute_x(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, float *xp) {
    const int64_t H = G / 2, ng = K / G;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs;
        float *o = xp + m * K;
        for (int64_t g = 0; g < ng; g++)
            for (int64_t r = 0; r < H; r++) {
                const int64_t i = g * H + r, base = 64 * (i >> 5), l = (i & 31) >> 2, c = i & 3;
                o[base + 8 * (2 * c) + l] = xr[g * G + r] * scale_of[2 * c];
                o[base + 8 * (2 * c + 1) + l] = xr[g * G + H + r] * scale_of[2 * c + 1];
            }
    }
}

#define NIB(v, j)                                            \
    ((j) == 7 ? _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28)) \
              : _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * ((j) % 7))))))

/* Block scale: one group's scale, or two groups' (lanes 0-3, 4-7) when G == 32. */
static inline __m256 block_scale(const float *sc, int64_t blk, int64_t bpg) {
    if (bpg > 0) return _mm256_set1_ps(sc[blk / bpg]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sc[2 * blk])), _mm_set1_ps(sc[2 * blk + 1]), 1);
}

/* Rows [m0, M) of output features [n0, n1). */
static void int4_rows(const job_t *j, int64_t n0, int64_t n1, int64_t m0) {
    const uint8_t *W = j->w;
    const int64_t K = j->K, N = j->N, M = j->M, G = j->G, ng = K / G, nb = K / 64;
    const int64_t bpg = G / 64, step = bpg > 0 ? bpg : 1; /* blocks per group (0: G == 32) */
    const float *xp = j->x;                               /* permuted, rows K apart */
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = W + n * (K / 2);
        const float *sc = j->scale + n * ng, *zc = j->zero + n * ng;
        const float b = j->bias ? j->bias[n] : 0.f;
        float e = b;
        int64_t m = m0;
        for (; m + 4 <= M; m += 4) {
            const float *x0 = xp + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
            for (int64_t blk = 0; blk < nb; blk += step) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
                for (int64_t u = blk; u < blk + step; u++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 32 * u));
                    const int64_t o = 64 * u;
#define ROW4(J, A0, A1, A2, A3)                                          \
    do {                                                                 \
        const __m256 w_ = NIB(v, J);                                     \
        A0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + o + 8 * (J)), w_, A0); \
        A1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + o + 8 * (J)), w_, A1); \
        A2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + o + 8 * (J)), w_, A2); \
        A3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + o + 8 * (J)), w_, A3); \
    } while (0)
                    ROW4(0, a0, a1, a2, a3);
                    ROW4(1, c0, c1, c2, c3);
                    ROW4(2, a0, a1, a2, a3);
                    ROW4(3, c0, c1, c2, c3);
                    ROW4(4, a0, a1, a2, a3);
                    ROW4(5, c0, c1, c2, c3);
                    ROW4(6, a0, a1, a2, a3);
                    ROW4(7, c0, c1, c2, c3);
#undef ROW4
                }
                const __m256 sv = block_scale(sc, blk, bpg);
                t0 = _mm256_fmadd_ps(sv, _mm256_add_ps(a0, c0), t0);
                t1 = _mm256_fmadd_ps(sv, _mm256_add_ps(a1, c1), t1);
                t2 = _mm256_fmadd_ps(sv, _mm256_add_ps(a2, c2), t2);
                t3 = _mm256_fmadd_ps(sv, _mm256_add_ps(a3, c3), t3);
            }
            for (int64_t r = 0; r < 4; r++) {
                const float *s0 = j->xsum + (m + r) * ng;
                e = b;
                for (int64_t g = 0; g < ng; g++) e += (zc[g] - 8.f * sc[g]) * s0[g];
                const __m256 t = r == 0 ? t0 : r == 1 ? t1 : r == 2 ? t2 : t3;
                j->y[(m + r) * N + n] = hsum8(t) + e;
            }
        }
        for (; m < M; m++) { /* one row: four chains */
            const float *x0 = xp + m * K, *s0 = j->xsum + m * ng;
            __m256 t = _mm256_setzero_ps();
            for (int64_t blk = 0; blk < nb; blk += step) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t u = blk; u < blk + step; u++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 32 * u));
                    const float *xb = x0 + 64 * u;
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb), NIB(v, 0), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), NIB(v, 1), a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), NIB(v, 2), a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), NIB(v, 3), a3);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 32), NIB(v, 4), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 40), NIB(v, 5), a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 48), NIB(v, 6), a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 56), NIB(v, 7), a3);
                }
                t = _mm256_fmadd_ps(block_scale(sc, blk, bpg),
                                    _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), t);
            }
            e = b;
            for (int64_t g = 0; g < ng; g++) e += (zc[g] - 8.f * sc[g]) * s0[g];
            j->y[m * N + n] = hsum8(t) + e;
        }
    }
}

/* Output features n and n + 1, rows [0, M4) four at a time: each input vector feeds two FMAs and each weight
   vector four. The group's scale multiplies the weights (once per vector, for four rows), so the eight
   accumulators run over the whole row without per-group partial sums. */
static void int4_pair(const job_t *j, int64_t n, int64_t M4) {
    const int64_t K = j->K, N = j->N, G = j->G, ng = K / G, nb = K / 64;
    const int64_t bpg = G / 64, step = bpg > 0 ? bpg : 1;
    const uint8_t *r0 = (const uint8_t *)j->w + n * (K / 2), *r1 = r0 + K / 2;
    const float *sc0 = j->scale + n * ng, *sc1 = sc0 + ng, *zc0 = j->zero + n * ng, *zc1 = zc0 + ng;
    const float b0 = j->bias ? j->bias[n] : 0.f, b1 = j->bias ? j->bias[n + 1] : 0.f;
    for (int64_t m = 0; m < M4; m += 4) {
        const float *x0 = j->x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        for (int64_t blk = 0; blk < nb; blk += step) {
            const __m256 s0 = block_scale(sc0, blk, bpg), s1 = block_scale(sc1, blk, bpg);
            for (int64_t u = blk; u < blk + step; u++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(r0 + 32 * u));
                const __m256i w = _mm256_loadu_si256((const __m256i *)(r1 + 32 * u));
                const int64_t o = 64 * u;
#define PAIR(J)                                                                            \
    do {                                                                                   \
        const __m256 p_ = _mm256_mul_ps(NIB(v, J), s0), q_ = _mm256_mul_ps(NIB(w, J), s1); \
        __m256 x_ = _mm256_loadu_ps(x0 + o + 8 * (J));                                     \
        a0 = _mm256_fmadd_ps(x_, p_, a0);                                                  \
        c0 = _mm256_fmadd_ps(x_, q_, c0);                                                  \
        x_ = _mm256_loadu_ps(x1 + o + 8 * (J));                                            \
        a1 = _mm256_fmadd_ps(x_, p_, a1);                                                  \
        c1 = _mm256_fmadd_ps(x_, q_, c1);                                                  \
        x_ = _mm256_loadu_ps(x2 + o + 8 * (J));                                            \
        a2 = _mm256_fmadd_ps(x_, p_, a2);                                                  \
        c2 = _mm256_fmadd_ps(x_, q_, c2);                                                  \
        x_ = _mm256_loadu_ps(x3 + o + 8 * (J));                                            \
        a3 = _mm256_fmadd_ps(x_, p_, a3);                                                  \
        c3 = _mm256_fmadd_ps(x_, q_, c3);                                                  \
    } while (0)
                PAIR(0);
                PAIR(1);
                PAIR(2);
                PAIR(3);
                PAIR(4);
                PAIR(5);
                PAIR(6);
                PAIR(7);
#undef PAIR
            }
        }
        const __m256 t0[4] = {a0, a1, a2, a3}, t1[4] = {c0, c1, c2, c3};
        for (int64_t r = 0; r < 4; r++) {
            const float *xs = j->xsum + (m + r) * ng;
            float e0 = b0, e1 = b1;
            for (int64_t g = 0; g < ng; g++) {
                e0 += (zc0[g] - 8.f * sc0[g]) * xs[g];
                e1 += (zc1[g] - 8.f * sc1[g]) * xs[g];
            }
            j->y[(m + r) * N + n] = hsum8(t0[r]) + e0;
            j->y[(m + r) * N + n + 1] = hsum8(t1[r]) + e1;
        }
    }
}

static void int4_avx2(const job_t *j) {
    int64_t n = j->n0;
    const int64_t M4 = j->M / 4 * 4;
    if (M4 > 0) {
        for (; n + 2 <= j->n1; n += 2) int4_pair(j, n, M4);
        int4_rows(j, j->n0, n, M4); /* the paired features' last M % 4 rows */
    }
    int4_rows(j, n, j->n1, 0);
}
#endif

/* ------------------------------------------------------------------ threads
   Built with OpenMP (where PyTorch's own OpenMP runtime is in the process: tightfit.kernels.native), a call runs on
   that runtime's team, the threads PyTorch's own ops run on: they are awake from the ops around the call, and
   no second set of threads competes with them for the cores. In a child forked from a process that ran a
   parallel region, GNU OpenMP's team does not exist and a region would wait for it forever: such a child (and
   every build without OpenMP) uses the pool below. */
#include "tf_fork.h"

/* 1 where calls run on the process's OpenMP team, 0 where on the pool below. */
int tf_quant_threading(void) {
#ifdef _OPENMP
    return !tf_forked;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ a persistent pool
   Workers are started once (per process: a forked child starts its own) and wait for a generation number.
   A call splits its output features into chunks that the caller and the workers claim from one counter, so a
   worker that is slow to wake (a busy machine) costs nothing: the caller takes its chunks. Between calls a
   worker sleeps on a condition variable: spinning after each call for the next one gains nothing a step's
   matmuls can see and takes a core from other work. */

static struct {
    pthread_mutex_t call, mu;
    pthread_cond_t cv;
    pid_t pid;
    int workers, sleeping;
    int64_t gen;   /* bumped per call (atomic) */
    uint64_t next; /* (generation << 32) | next chunk: claims of a stale generation fail */
    int64_t done;  /* chunks finished in this call (atomic) */
    int64_t chunks;
    range_fn fn;
    job_t jobs[MAX_CHUNKS];
} pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, {{0}}};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run chunks of generation gen until none is left. */
static void work(int64_t gen) {
    for (;;) {
        uint64_t v = __atomic_load_n(&pool.next, __ATOMIC_ACQUIRE);
        if ((int64_t)(v >> 32) != (gen & 0xffffffff) || (int64_t)(v & 0xffffffff) >= pool.chunks) return;
        if (!__atomic_compare_exchange_n(&pool.next, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        pool.fn(&pool.jobs[v & 0xffffffff]);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_RELEASE);
    }
}

static void *worker(void *arg) {
    (void)arg;
    int64_t seen = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE);
    for (;;) {
        int64_t gen = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE);
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            __atomic_add_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
            while ((gen = __atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            __atomic_sub_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        work(gen);
    }
    return NULL;
}

/* Start workers up to want (once per process); how many there are. */
static int ensure_workers(int want) {
    const pid_t pid = getpid();
    if (pool.pid != pid) { /* first call, or a forked child: the parent's workers do not exist here */
        pool.pid = pid;
        pool.workers = 0;
        pool.sleeping = 0;
        pthread_mutex_init(&pool.mu, NULL);
        pthread_cond_init(&pool.cv, NULL);
    }
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &a, worker, NULL);
        pthread_attr_destroy(&a);
        if (rc != 0) break;
        pool.workers++;
    }
    return pool.workers;
}

static int run(range_fn fn, job_t base, int64_t threads) {
    /* A second thread pays off from ~min_work multiply-adds (waking a sleeping worker takes some us):
       below that the call stays on the caller. */
    const int64_t N = base.N, enough = 1 + base.M * N * base.K / (min_work > 0 ? min_work : 1);
    if (threads > enough) threads = enough;
    if (threads > N) threads = N;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* One call at a time uses the pool (a second Python thread's call runs on its own thread). */
    if (threads <= 1 || pthread_mutex_trylock(&pool.call) != 0) {
        fn(&base);
        return 0;
    }
#ifdef _OPENMP
    if (!tf_forked) { /* the process's OpenMP team (PyTorch's own, see tightfit.kernels.native) */
        int64_t chunks = threads * 2;
        if (chunks > N) chunks = N;
        int64_t next = 0;
#pragma omp parallel num_threads((int)threads)
        for (;;) {
            const int64_t c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (c >= chunks) break;
            job_t jc = base;
            jc.n0 = N * c / chunks;
            jc.n1 = N * (c + 1) / chunks;
            fn(&jc);
        }
        pthread_mutex_unlock(&pool.call);
        return 0;
    }
#endif
    const int have = ensure_workers((int)threads - 1);
    if (have < 1) {
        pthread_mutex_unlock(&pool.call);
        fn(&base);
        return 0;
    }
    if (threads > have + 1) threads = have + 1;
    int64_t chunks = threads * 2; /* a slow worker's share can still be split */
    if (chunks > N) chunks = N;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
    for (int64_t c = 0; c < chunks; c++) {
        pool.jobs[c] = base;
        pool.jobs[c].n0 = N * c / chunks;
        pool.jobs[c].n1 = N * (c + 1) / chunks;
    }
    pool.fn = fn;
    pool.chunks = chunks;
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    const int64_t gen = __atomic_add_fetch(&pool.gen, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&pool.next, (uint64_t)(gen & 0xffffffff) << 32, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleeping, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    work(gen);
    for (int i = 1; __atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < chunks; i++) {
        relax();
        if ((i & 1023) == 0) sched_yield(); /* a worker preempted mid-chunk: let it run */
    }
    pthread_mutex_unlock(&pool.call);
    return 0;
}

/* Dequantise rows [n0, n1) into out (N, K) fp32: the prefill path (many rows) multiplies that with BLAS. A tiled
   weight (tile_int8 / tile_int4) is read a 64-byte run at a time: byte 4i + b of row n's run u lies at
   u * 1024 + i * 64 + (n % 16) * 4 + b of its tile (a run never straddles two groups: G / 2 % 64 == 0). */
static void dequant_range(const job_t *j) {
    const int64_t K = j->K, G = j->G;
    for (int64_t n = j->n0; n < j->n1; n++) {
        float *o = j->y + n * K;
        if (G == 0) {
            const float s = j->scale[n];
            if (j->tiled) { /* tile_int8: byte 4i + b of row n's run u at u * 1024 + i * 64 + (n % 16) * 4 + b */
                const int8_t *row = (const int8_t *)j->w + (n - n % 16) * K + (n % 16) * 4;
                for (int64_t u = 0; u < K / 64; u++)
                    for (int i = 0; i < 16; i++)
                        for (int b = 0; b < 4; b++) o[64 * u + 4 * i + b] = (float)row[u * 1024 + i * 64 + b] * s;
                continue;
            }
            const int8_t *q = (const int8_t *)j->w + n * K;
            for (int64_t k = 0; k < K; k++) o[k] = (float)q[k] * s;
            continue;
        }
        const int64_t H = G / 2, ng = K / G, run = j->tiled ? 64 : H;
        const uint8_t *row = (const uint8_t *)j->w + (j->tiled ? (n - n % 16) * (K / 2) + (n % 16) * 4 : n * (K / 2));
        uint8_t buf[64];
        for (int64_t c = 0; c < K / 2; c += run) { /* bytes c .. c + run - 1 of the row: one group's, from i0 */
            const int64_t g = c / H, i0 = c % H;
            const uint8_t *p = row + c;
            if (j->tiled) {
                for (int i = 0; i < 16; i++) memcpy(buf + 4 * i, row + c * 16 + 64 * i, 4);
                p = buf;
            }
            const float s = j->scale[n * ng + g], z = j->zero[n * ng + g] - 8.f * s;
            float *og = o + g * G + i0;
            for (int64_t i = 0; i < run; i++) {
                og[i] = (float)(p[i] & 15) * s + z;
                og[H + i] = (float)(p[i] >> 4) * s + z;
            }
        }
    }
}

int tf_dequantize_f32(const void *q, const float *scale, const float *zero, float *out, int64_t N, int64_t K, int64_t G,
                      int64_t tiled, int64_t threads) {
    job_t j = {.scale = scale, .zero = zero, .w = q, .y = out, .M = 1, .N = N, .K = K, .G = G, .n1 = N};
    j.tiled = (int)tiled;
    return run(dequant_range, j, threads);
}

int tf_int8_linear_f32(const float *x, int64_t xs, const int8_t *q, const float *scale, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t threads) {
    job_t j = {.x = x, .scale = scale, .bias = bias, .w = q, .y = y, .xs = xs, .M = M, .N = N, .K = K, .n1 = N};
#ifdef __AVX2__
    if (use_simd) return run(int8_avx2, j, threads);
#endif
    return run(int8_scalar, j, threads);
}

/* xsum[m, g] = sum of row m's inputs in group g, computed here once per call (and, for the SIMD loop, the
   permuted copy of x). */
int tf_int4_linear_f32(const float *x, int64_t xs, const uint8_t *q, const float *scale, const float *zero,
                       const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t threads) {
    const int64_t ng = K / G;
    int simd = 0;
#ifdef __AVX2__
    simd = use_simd && K % 64 == 0 && (G % 64 == 0 || G == 32);
#endif
    const int64_t need = M * ng + (simd ? M * K : 0);
    float local[16384], *buf = need <= 16384 ? local : malloc(sizeof(float) * need);
    if (buf == NULL) return -1;
    float *xsum = buf;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const float *p = x + m * xs + g * G;
            float s = 0.f;
            for (int64_t i = 0; i < G; i++) s += p[i];
            xsum[m * ng + g] = s;
        }
    job_t j = {.x = x,
               .scale = scale,
               .zero = zero,
               .bias = bias,
               .xsum = xsum,
               .w = q,
               .y = y,
               .xs = xs,
               .M = M,
               .N = N,
               .K = K,
               .G = G,
               .n1 = N};
    range_fn fn = int4_scalar;
#ifdef __AVX2__
    if (simd) {
        permute_x(x, xs, M, K, G, buf + M * ng);
        j.x = buf + M * ng;
        j.xs = K;
        fn = int4_avx2;
    }
#endif
    run(fn, j, threads);
    if (buf != local) free(buf);
    return 0;
}
#include "quant_a8.h"
