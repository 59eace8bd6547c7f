/* Part of quant_linear.c (included at its end, after job_t, run and the fp32 kernels): the int8-activation kernels
   of tightfit.kernels.quant_linear_a8, sharing quant_linear.c's threads and job_t. Entry points: tf_a8_linear_f32,
   tf_a8_available, tf_a8_set_rows. */

/* ------------------------------------------------------------------ int8 activations (AVX-512 VNNI)
   x is quantised per row and block of 32 inputs (d = amax / 127, xq = round(x / d)), then every 64 inputs of a
   row meet 64 weights in one vpdpbusd (unsigned 8-bit weights times signed 8-bit inputs, sums of four in 16
   int32 lanes: lanes 0-7 hold block 2c, lanes 8-15 block 2c + 1), converted and scaled by d per lane.
   int8 weights are made unsigned by w ^ 0x80 (= w + 128): the 128 * sum(xq) that adds is taken off per row
   (corr). int4 weights are 0..15 already: W = q s + (zero - 8 s); the second term meets the fp32 x's group sums.
   int8 with K % 128 == 0 and int4 with groups of 128 or a multiple of 256 quantise x per block of 128 instead
   (a8_quantize_b128): a block's two vpdpbusd then add in int32 and are converted and scaled once, and int4 holds
   no per-group partial sums. From a8t_min_rows rows on, int4 per block of 128 goes 16 features at a time with the
   block's weights transposed (a8_i4t): a row's 16 sums come out in one vector. Weights in tile_int4's order
   (job_t.tiled) are so already: a8_i4t_rows splits each run in registers for groups of four rows, a8_i4t (from
   a8t_tiled_block_rows rows) splits each block once for all rows. int8 weights in tile_int8's order (the same
   16-feature tiles) go through a8_i8t at every row count: a block's 32 loads made unsigned once, met by every row. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TF_A8 1
#else
#define TF_A8 0
#endif
/* AVX2 without AVX-512 VNNI: tiled int4 in groups of 128 or a multiple of 256 only (quant_a8_avx2.h) */
#if !TF_A8 && defined(__AVX2__) && defined(__FMA__)
#define TF_A8V 1
#else
#define TF_A8V 0
#endif
#define A8T_MAX_ROWS 32

/* 1: every layout below (AVX-512 VNNI); 2: the AVX2 kernel's (tiled int4 per block of 128); 0: none. */
int tf_a8_available(void) { return TF_A8 ? 1 : TF_A8V ? 2 : 0; }

/* Row thresholds of the int4 kernels per block of 128 (groups of 128 or a multiple of 256), turned by the tests
   to check every kernel (above A8T_MAX_ROWS: never). which 0: rows from which row-order weights take the
   16-feature transposed tiles (a8_i4t; fewer: the 4 x 4 tiles, the transpose costing more than it saves);
   which 1: rows from which tiled weights (tile_int4) take a8_i4t, each block split once and kept for all rows
   (fewer: a8_i4t_rows, groups of four rows splitting each run in registers). a8_i4t_rows splits a block once per
   four rows, a8_i4t once for all rows: the split it repeats only pays for itself at many rows, hence the higher
   threshold for tiled weights. Returns the old value; rows < 0 only asks. */
static int a8t_min_rows = 4, a8t_tiled_block_rows = 32;
int tf_a8_set_rows(int which, int rows) {
    int *v = which == 0 ? &a8t_min_rows : &a8t_tiled_block_rows;
    const int old = *v;
    if (rows >= 0) *v = rows;
    return old;
}

#if TF_A8 || TF_A8V
#include <string.h>
/* Features n .. n + w - 1's scales and zero points of int4 group g, side by side (one vector's lanes). */
static inline __attribute__((always_inline)) void a8_group_scales(const job_t *j, int64_t n, int64_t g, const int w,
                                                                  float *sb, float *zb) {
    const int64_t ng = j->K / j->G;
    for (int f = 0; f < w; f++) {
        sb[f] = j->scale[(n + f) * ng + g];
        zb[f] = j->zero[(n + f) * ng + g];
    }
}
/* 127 / amax (0 for amax 0) rounded once, as the reference computes it: under -ffast-math `127.f / amax` may
   become 127 * (1 / amax), an ulp away, which flips x / d where it lies within an ulp of a rounding tie. */
static inline float a8_inv(float amax) {
    return amax > 0.f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.f), _mm_set_ss(amax))) : 0.f;
}
#endif

#if TF_A8

/* Per call, on the caller: xq (M x K int8), dv (M x K/4: 16 floats per 64 inputs), corr (M), xsum (M x K/G). */
static void a8_quantize(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, int8_t *xq, float *dv, float *corr,
                        float *xsum) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs;
        float c = 0.f;
        for (int64_t b = 0; b < K / 32; b++) {
            const __m512 u = _mm512_loadu_ps(xr + 32 * b), v = _mm512_loadu_ps(xr + 32 * b + 16);
            const float amax =
                _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(u, absmask), _mm512_and_ps(v, absmask)));
            const float d = amax / 127.f, inv = a8_inv(amax);
            const __m512i qu = _mm512_cvtps_epi32(_mm512_mul_ps(u, _mm512_set1_ps(inv)));
            const __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(xq + m * K + 32 * b), _mm512_cvtsepi32_epi8(qu));
            _mm_storeu_si128((__m128i *)(xq + m * K + 32 * b + 16), _mm512_cvtsepi32_epi8(qv));
            const __m256 dd = _mm256_set1_ps(d);
            _mm256_storeu_ps(dv + m * (K / 4) + 8 * b, dd);
            c += d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qu, qv));
        }
        corr[m] = 128.f * c;
        if (G > 0)
            for (int64_t g = 0; g < K / G; g++) {
                __m512 s = _mm512_setzero_ps();
                for (int64_t i = 0; i < G; i += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(xr + g * G + i));
                xsum[m * (K / G) + g] = _mm512_reduce_add_ps(s);
            }
    }
}

#define A8_ZERO _mm512_setzero_si512()
/* acc[r][f] += d * (w[f] . xq[r]) over one 64-input chunk at input offset o. */
#define A8_CHUNK(ACC, W, o)                                                                                          \
    do {                                                                                                             \
        for (int r_ = 0; r_ < R; r_++) {                                                                             \
            const __m512i xv_ = _mm512_loadu_si512(j->xq + (m + r_) * K + (o));                                      \
            const __m512 dv_ = _mm512_loadu_ps(j->dv + (m + r_) * (K / 4) + (o) / 4);                                \
            for (int f_ = 0; f_ < F; f_++)                                                                           \
                ACC[r_][f_] =                                                                                        \
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(A8_ZERO, W[f_], xv_)), dv_, ACC[r_][f_]); \
        }                                                                                                            \
    } while (0)

/* Rows m..m+R-1 by features n..n+F-1 (R <= 4, F <= 4, R * F <= 8), int8 weights. */
static inline __attribute__((always_inline)) void a8_i8(const job_t *j, int64_t n, int64_t m, const int R,
                                                        const int F) {
    const int64_t K = j->K, N = j->N;
    const int8_t *q = (const int8_t *)j->w + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) acc[r][f] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 64) {
        __m512i w[4];
        for (int f = 0; f < F; f++) w[f] = _mm512_xor_si512(_mm512_loadu_si512(q + f * K + c), flip);
        A8_CHUNK(acc, w, c);
    }
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) {
            const float b = j->bias ? j->bias[n + f] : 0.f;
            j->y[(m + r) * N + n + f] = j->scale[n + f] * (_mm512_reduce_add_ps(acc[r][f]) - j->corr[m + r]) + b;
        }
}

/* The int4 tiles' outputs: y = sum of acc's lanes + bias + sum_g (zero - 8 scale) xsum_g (the zero-point term
   on the fp32 x's group sums). */
static inline __attribute__((always_inline)) void a8_i4_store(const job_t *j, int64_t n, int64_t m, const int R,
                                                              const int F, __m512 acc[4][4]) {
    const int64_t N = j->N, ng = j->K / j->G;
    for (int f = 0; f < F; f++) {
        const float *sc = j->scale + (n + f) * ng, *zc = j->zero + (n + f) * ng;
        const float b = j->bias ? j->bias[n + f] : 0.f;
        for (int r = 0; r < R; r++) {
            const float *xs = j->xsum + (m + r) * ng;
            float e = b;
            for (int64_t g = 0; g < ng; g++) e += (zc[g] - 8.f * sc[g]) * xs[g];
            j->y[(m + r) * N + n + f] = _mm512_reduce_add_ps(acc[r][f]) + e;
        }
    }
}

/* The same for int4 weights with G == 64 (x per block of 32): per group one chunk, then times its scale. */
static inline __attribute__((always_inline)) void a8_i4(const job_t *j, int64_t n, int64_t m, const int R,
                                                        const int F) {
    const int64_t K = j->K, ng = K / 64;
    const uint8_t *p = (const uint8_t *)j->w + n * (K / 2);
    const __m256i l4 = _mm256_set1_epi8(15);
    __m512 acc[4][4], ga[4][4];
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) acc[r][f] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        for (int r = 0; r < R; r++)
            for (int f = 0; f < F; f++) ga[r][f] = _mm512_setzero_ps();
        __m512i w[4]; /* 32 bytes: low nibbles are inputs 0-31, high 32-63 */
        for (int f = 0; f < F; f++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + f * (K / 2) + g * 32));
            w[f] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, l4)),
                                      _mm256_and_si256(_mm256_srli_epi16(v, 4), l4), 1);
        }
        A8_CHUNK(ga, w, g * 64);
        for (int f = 0; f < F; f++) {
            const __m512 s = _mm512_set1_ps(j->scale[(n + f) * ng + g]);
            for (int r = 0; r < R; r++) acc[r][f] = _mm512_fmadd_ps(ga[r][f], s, acc[r][f]);
        }
    }
    a8_i4_store(j, n, m, R, F, acc);
}

/* x quantised per row and block of 128 inputs (the int4 kernel for G == 128 or G % 256 == 0): d per row and
   block in d128 (M x K/128), the fp32 group sums in xsum as above. */
static void a8_quantize_b128(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, int8_t *xq, float *d128,
                             float *corr, float *xsum) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs;
        float c = 0.f;
        for (int64_t b = 0; b < K / 128; b++) {
            __m512 v[8], mx = _mm512_setzero_ps();
            for (int i = 0; i < 8; i++) {
                v[i] = _mm512_loadu_ps(xr + 128 * b + 16 * i);
                mx = _mm512_max_ps(mx, _mm512_and_ps(v[i], absmask));
            }
            const float amax = _mm512_reduce_max_ps(mx), inv = a8_inv(amax);
            __m512i qs = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
                _mm_storeu_si128((__m128i *)(xq + m * K + 128 * b + 16 * i), _mm512_cvtsepi32_epi8(qi));
                qs = _mm512_add_epi32(qs, qi);
            }
            d128[m * (K / 128) + b] = amax / 127.f;
            c += amax / 127.f * (float)_mm512_reduce_add_epi32(qs);
        }
        corr[m] = 128.f * c;
        for (int64_t g = 0; G > 0 && g < K / G; g++) {
            __m512 sm = _mm512_setzero_ps();
            for (int64_t i = 0; i < G; i += 16) sm = _mm512_add_ps(sm, _mm512_loadu_ps(xr + g * G + i));
            xsum[m * (K / G) + g] = _mm512_reduce_add_ps(sm);
        }
    }
}

/* One block of 128 inputs at input offset o (block index b): its two 64-weight halves WA, WB meet the block's
   two 64-byte runs of xq in two vpdpbusd (int32 lanes, no rounding), converted once, times the block's d and the
   group's scale. */
#define A8_BLOCK128(WA, WB, o, b, DS)                                                                           \
    do {                                                                                                        \
        for (int r_ = 0; r_ < R; r_++) {                                                                        \
            const __m512i x0_ = _mm512_loadu_si512(j->xq + (m + r_) * K + (o));                                 \
            const __m512i x1_ = _mm512_loadu_si512(j->xq + (m + r_) * K + (o) + 64);                            \
            const __m512 d_ = _mm512_set1_ps(j->dv[(m + r_) * nb + (b)]);                                       \
            for (int f_ = 0; f_ < F; f_++) {                                                                    \
                const __m512i s_ = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(A8_ZERO, WA[f_], x0_), WB[f_], x1_); \
                acc[r_][f_] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_), DS(d_, f_), acc[r_][f_]);                 \
            }                                                                                                   \
        }                                                                                                       \
    } while (0)
#define A8_DS_GROUP(d, f) _mm512_mul_ps(d, sf[f]) /* int4: the block's d times the feature's group scale */
#define A8_DS_ROW(d, f) (d)                       /* int8: the row scale comes at the end */

/* int4 weights with x per block of 128 (G == 128 or G % 256 == 0), rows m..m+R-1 by features n..n+F-1
   (R, F <= 4). G == 128: one 64-byte load holds a feature's whole group (low nibbles inputs 0-63, high
   64-127), one block. G % 256 == 0: bytes c .. c + 127 of a group (c = 0, 128, ...) hold in their low nibbles
   the block of inputs c .. c + 127 and in their high nibbles the block H + c .. H + c + 127. */
static inline __attribute__((always_inline)) void a8_i4b(const job_t *j, int64_t n, int64_t m, const int R,
                                                         const int F) {
    const int64_t K = j->K, G = j->G, H = G / 2, ng = K / G, nb = K / 128;
    const uint8_t *p = (const uint8_t *)j->w + n * (K / 2);
    const __m512i lo = _mm512_set1_epi8(15);
    __m512 acc[4][4], sf[4];
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) acc[r][f] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        for (int f = 0; f < F; f++) sf[f] = _mm512_set1_ps(j->scale[(n + f) * ng + g]);
        if (G == 128) {
            __m512i wl[4], wh[4];
            for (int f = 0; f < F; f++) {
                const __m512i v = _mm512_loadu_si512(p + f * (K / 2) + g * 64);
                wl[f] = _mm512_and_si512(v, lo);
                wh[f] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
            }
            A8_BLOCK128(wl, wh, g * 128, g, A8_DS_GROUP);
        } else {
            for (int64_t c = 0; c < H; c += 128) {
                __m512i wa[4], wb[4];
                for (int f = 0; f < F; f++) {
                    wa[f] = _mm512_and_si512(_mm512_loadu_si512(p + f * (K / 2) + g * H + c), lo);
                    wb[f] = _mm512_and_si512(_mm512_loadu_si512(p + f * (K / 2) + g * H + c + 64), lo);
                }
                A8_BLOCK128(wa, wb, g * G + c, (g * G + c) / 128, A8_DS_GROUP);
                for (int f = 0; f < F; f++) {
                    wa[f] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + f * (K / 2) + g * H + c), 4), lo);
                    wb[f] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + f * (K / 2) + g * H + c + 64), 4),
                                             lo);
                }
                A8_BLOCK128(wa, wb, g * G + H + c, (g * G + H + c) / 128, A8_DS_GROUP);
            }
        }
    }
    a8_i4_store(j, n, m, R, F, acc);
}

/* A tiled weight is read as one stream per thread, a tile after another; once the weights outgrow the last-level
   cache, the hardware prefetchers alone leave those loads waiting on memory (row-order 4 x 4 tiles read four
   streams a thread and hide more of it). So a8_i8t asks for the bytes A8_AHEAD KiB ahead of those it loads, 1 KiB
   (16 lines) at a time. Past a chunk's end it asks for the next chunk's, which another thread reads: harmless.
   a8_i4t and a8_i4t_rows ask too: in a model the KV cache and activations share the cache with the weights. */
#define A8_AHEAD 8
static inline __attribute__((always_inline)) void a8_prefetch_kib(const void *at) {
    for (int i = 0; i < 16; i++) _mm_prefetch((const char *)at + A8_AHEAD * 1024 + 64 * i, _MM_HINT_T0);
}

/* Sixteen features' 64-byte runs as 16 vectors, vector i holding in 32-bit lane f the bytes 4i .. 4i + 3 of
   feature f's run; the low nibbles go to lo[i], the high ones to hi[i]. tiled: the runs are stored so already
   (tile_int4), 1 KiB at src. Else feature f's run is at src + f * stride and is transposed here (16 x 16 32-bit
   words: within 128-bit lanes, then the lanes). */
static inline __attribute__((always_inline)) void a8_t16(const uint8_t *src, int64_t stride, int tiled, __m512i *lo,
                                                         __m512i *hi) {
    const __m512i l4 = _mm512_set1_epi8(15);
    if (tiled) {
        for (int i = 0; i < 16; i++) {
            const __m512i w = _mm512_loadu_si512(src + 64 * i);
            lo[i] = _mm512_and_si512(w, l4);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(w, 4), l4);
        }
        return;
    }
    __m512i r[16], t[16];
    for (int f = 0; f < 16; f++) r[f] = _mm512_loadu_si512(src + f * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int q = 0; q < 16; q += 4) { /* r[q + c]: in 128-bit lane L, word 4L + c of features q .. q + 3 */
        r[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
        r[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
        r[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
        r[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44),
                      v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        const __m512i w[4] = {_mm512_shuffle_i32x4(v0, v2, 0x88), _mm512_shuffle_i32x4(v0, v2, 0xDD),
                              _mm512_shuffle_i32x4(v1, v3, 0x88), _mm512_shuffle_i32x4(v1, v3, 0xDD)};
        for (int L = 0; L < 4; L++) { /* word 4L + c */
            lo[4 * L + c] = _mm512_and_si512(w[L], l4);
            hi[4 * L + c] = _mm512_and_si512(_mm512_srli_epi16(w[L], 4), l4);
        }
    }
}

/* One block of 128 inputs (index b) of rows m .. m + R - 1 against 16 features' transposed weights wt[0..31]
   (wt[i]: inputs 4i .. 4i + 3 of the block, lane f feature f): per row one broadcast of four int8 inputs per
   vpdpbusd, sums in int32 lanes (one per feature), converted once and scaled by the block's d times the group's
   scales (sv, per lane). */
static inline __attribute__((always_inline)) void a8_t_block(const job_t *j, const __m512i *wt, int64_t b, int64_t m,
                                                             const int R, __m512 sv, __m512 *acc) {
    const int64_t K = j->K, nb = K / 128;
    const int P = R == 1 ? 4 : 2; /* partial sums a row: several vpdpbusd chains in flight (one waits on its latency) */
    __m512i s[4][8];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) s[r][q] = _mm512_setzero_si512();
    const int8_t *xb = j->xq + m * K + b * 128;
    for (int i = 0; i < 32; i += P)
        for (int q = 0; q < P; q++)
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, xb + r * K + 4 * (i + q), 4);
                s[r][q] = _mm512_dpbusd_epi32(s[r][q], wt[i + q], _mm512_set1_epi32(x4));
            }
    for (int r = 0; r < R; r++) {
        for (int q = 1; q < P; q++) s[r][0] = _mm512_add_epi32(s[r][0], s[r][q]);
        acc[m + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]),
                                     _mm512_mul_ps(sv, _mm512_set1_ps(j->dv[(m + r) * nb + b])), acc[m + r]);
    }
}

/* Features n .. n + 15's scales of group g (sv) and zero-point terms zero - 8 scale (zc), one lane each. */
static inline __attribute__((always_inline)) void a8_t_scales(const job_t *j, int64_t n, int64_t g, __m512 *sv,
                                                              __m512 *zc) {
    float sb[16], zb[16];
    a8_group_scales(j, n, g, 16, sb, zb);
    *sv = _mm512_loadu_ps(sb);
    *zc = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), *sv, _mm512_loadu_ps(zb));
}

/* int4 weights with x per block of 128 (G == 128 or G % 256 == 0), features n .. n + 15 by all M rows
   (M <= A8T_MAX_ROWS): each block's weights are transposed once (a8_t16) and meet every row, so the 16 sums
   of a row come out in one vector: no per-feature horizontal sums, and the zero-point term is one FMA per row
   and group. */
static void a8_i4t(const job_t *j, int64_t n) {
    const int64_t K = j->K, N = j->N, M = j->M, G = j->G, H = G / 2, ng = K / G, st = K / 2;
    const uint8_t *p = (const uint8_t *)j->w + n * st;
    /* byte offset c of every row's packed weight: at p + c * 16 in a tile (runs of 64 bytes, 1 KiB each) */
    const int64_t rs = j->tiled ? 16 : 1;
    __m512 acc[A8T_MAX_ROWS];
    __m512i wa[32], wb[32];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 sv, zc;
        a8_t_scales(j, n, g, &sv, &zc);
        for (int64_t c = 0; c < (G == 128 ? 64 : H); c += 128) {
            int64_t b0, b1 = -1;
            if (G == 128) { /* one block: low nibbles inputs 0-63, high 64-127 */
                if (j->tiled) a8_prefetch_kib(p + g * 64 * rs);
                a8_t16(p + g * 64 * rs, st, j->tiled, wa, wa + 16);
                b0 = g;
            } else { /* bytes c .. c + 127: low nibbles block g G + c, high block g G + H + c */
                if (j->tiled) {
                    a8_prefetch_kib(p + (g * H + c) * rs);
                    a8_prefetch_kib(p + (g * H + c + 64) * rs);
                }
                a8_t16(p + (g * H + c) * rs, st, j->tiled, wa, wb);
                a8_t16(p + (g * H + c + 64) * rs, st, j->tiled, wa + 16, wb + 16);
                b0 = (g * G + c) / 128;
                b1 = (g * G + H + c) / 128;
            }
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) {
                a8_t_block(j, wa, b0, m, 4, sv, acc);
                if (b1 >= 0) a8_t_block(j, wb, b1, m, 4, sv, acc);
            }
            for (; m < M; m++) {
                a8_t_block(j, wa, b0, m, 1, sv, acc);
                if (b1 >= 0) a8_t_block(j, wb, b1, m, 1, sv, acc);
            }
        }
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(zc, _mm512_set1_ps(j->xsum[m * ng + g]), acc[m]);
    }
    const __m512 bias = j->bias ? _mm512_loadu_ps(j->bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(j->y + m * N + n, _mm512_add_ps(acc[m], bias));
}

/* int8 weights with x per block of 128 (K % 128 == 0): per block two vpdpbusd in int32, converted and scaled by
   the block's d once; the row's weight scale and the w ^ 0x80 correction at the end. */
static inline __attribute__((always_inline)) void a8_i8b(const job_t *j, int64_t n, int64_t m, const int R,
                                                         const int F) {
    const int64_t K = j->K, N = j->N, nb = K / 128;
    const int8_t *q = (const int8_t *)j->w + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) acc[r][f] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i wa[4], wb[4];
        for (int f = 0; f < F; f++) {
            wa[f] = _mm512_xor_si512(_mm512_loadu_si512(q + f * K + 128 * b), flip);
            wb[f] = _mm512_xor_si512(_mm512_loadu_si512(q + f * K + 128 * b + 64), flip);
        }
        A8_BLOCK128(wa, wb, 128 * b, b, A8_DS_ROW);
    }
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) {
            const float bi = j->bias ? j->bias[n + f] : 0.f;
            j->y[(m + r) * N + n + f] = j->scale[n + f] * (_mm512_reduce_add_ps(acc[r][f]) - j->corr[m + r]) + bi;
        }
}

/* Tiled int8 (tile_int8: tile_int4's byte order on the int8 rows; K % 128 == 0), features n .. n + 15 by all M
   rows (M <= A8T_MAX_ROWS): a block of 128 inputs is the tile's next two 64-byte runs, 2 KiB in a row, loaded once
   as 32 vectors (each the 16 features' next four weights, made unsigned by ^ 0x80) and met by every row
   (a8_t_block): a row's 16 sums come out in one vector, and the row's weight scales and w ^ 0x80 correction are one
   FMA per row at the end, where the 4 x 4 tiles (a8_i8b) spend a conversion and an FMA per output and block and a
   horizontal sum per output. */
static void a8_i8t(const job_t *j, int64_t n) {
    const int64_t K = j->K, N = j->N, M = j->M, nb = K / 128;
    const int8_t *p = (const int8_t *)j->w + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512 one = _mm512_set1_ps(1.f);
    __m512 acc[A8T_MAX_ROWS];
    __m512i wt[32];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        a8_prefetch_kib(p + b * 2048);
        a8_prefetch_kib(p + b * 2048 + 1024);
        for (int i = 0; i < 32; i++) wt[i] = _mm512_xor_si512(_mm512_loadu_si512(p + b * 2048 + 64 * i), flip);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) a8_t_block(j, wt, b, m, 4, one, acc);
        for (; m < M; m++) a8_t_block(j, wt, b, m, 1, one, acc);
    }
    const __m512 sc = _mm512_loadu_ps(j->scale + n);
    const __m512 bias = j->bias ? _mm512_loadu_ps(j->bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; m++)
        _mm512_storeu_ps(j->y + m * N + n,
                         _mm512_fmadd_ps(sc, _mm512_sub_ps(acc[m], _mm512_set1_ps(j->corr[m])), bias));
}

/* Tiled int4 (tile_int4): one 64-byte run of 16 features (run) against rows m .. m + R - 1 (R <= 4). The run is
   split in registers and meets the rows' inputs at once: no transposed block is kept in memory. Its low nibbles
   are inputs ol .. ol + 63 of block bl, its high nibbles oh .. oh + 63 of block bh; 8 vpdpbusd chains are in
   flight (P partial sums a row and nibble half). */
static inline __attribute__((always_inline)) void a8_i4t_run(const job_t *j, const uint8_t *run, int64_t m, const int R,
                                                             int64_t bl, int64_t bh, int64_t ol, int64_t oh, __m512 sv,
                                                             __m512 *acc) {
    const int64_t K = j->K, nb = K / 128;
    const int P = 4 / R;
    const __m512i l4 = _mm512_set1_epi8(15);
    __m512i sl[4][4], sh[4][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) sl[r][q] = sh[r][q] = _mm512_setzero_si512();
    for (int i = 0; i < 16; i++) {
        const __m512i w = _mm512_loadu_si512(run + 64 * i);
        const __m512i lo = _mm512_and_si512(w, l4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), l4);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = j->xq + (m + r) * K;
            int32_t a, b;
            memcpy(&a, xr + ol + 4 * i, 4);
            memcpy(&b, xr + oh + 4 * i, 4);
            sl[r][i % P] = _mm512_dpbusd_epi32(sl[r][i % P], lo, _mm512_set1_epi32(a));
            sh[r][i % P] = _mm512_dpbusd_epi32(sh[r][i % P], hi, _mm512_set1_epi32(b));
        }
    }
    for (int r = 0; r < R; r++) {
        for (int q = 1; q < P; q++) {
            sl[r][0] = _mm512_add_epi32(sl[r][0], sl[r][q]);
            sh[r][0] = _mm512_add_epi32(sh[r][0], sh[r][q]);
        }
        const float *dr = j->dv + (m + r) * nb;
        __m512 *a = acc + m + r;
        if (bl == bh) { /* G == 128: one block, one conversion */
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sl[r][0], sh[r][0])),
                                 _mm512_mul_ps(sv, _mm512_set1_ps(dr[bl])), *a);
        } else {
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sl[r][0]), _mm512_mul_ps(sv, _mm512_set1_ps(dr[bl])), *a);
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sh[r][0]), _mm512_mul_ps(sv, _mm512_set1_ps(dr[bh])), *a);
        }
    }
}

/* Tiled int4, fewer rows than a8t_tiled_block_rows (M <= A8T_MAX_ROWS): features n .. n + 15 by all rows, the
   rows in groups of four per run, so a group's scales are gathered once and its runs (1 KiB each) stay in L1
   while the row groups pass over them. */
static void a8_i4t_rows(const job_t *j, int64_t n) {
    const int64_t K = j->K, N = j->N, M = j->M, G = j->G, H = G / 2, ng = K / G;
    const uint8_t *p = (const uint8_t *)j->w + n * (K / 2);
    __m512 acc[A8T_MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 sv, zc;
        a8_t_scales(j, n, g, &sv, &zc);
        for (int64_t c = 0; c < H; c += 64) {
            const uint8_t *run = p + (g * H + c) * 16;
            a8_prefetch_kib(run);
            const int64_t half = c % 128, base = g * G + c - half;
            const int64_t bl = G == 128 ? g : base / 128, bh = G == 128 ? g : (base + H) / 128;
            const int64_t ol = bl * 128 + (G == 128 ? 0 : half), oh = bh * 128 + (G == 128 ? 64 : half);
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) a8_i4t_run(j, run, m, 4, bl, bh, ol, oh, sv, acc);
            for (; m < M; m++) a8_i4t_run(j, run, m, 1, bl, bh, ol, oh, sv, acc);
        }
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(zc, _mm512_set1_ps(j->xsum[m * ng + g]), acc[m]);
    }
    const __m512 bias = j->bias ? _mm512_loadu_ps(j->bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(j->y + m * N + n, _mm512_add_ps(acc[m], bias));
}

/* A chunk's features in tiles: FW == 4, four features by four rows (int4 / int8 per block of 128: 16
   accumulators, no per-group partial sums to hold); FW == 2, pairs of features by four rows (per block of 32),
   fours by one row where M < 4; then the features and rows left. */
#define A8_RANGE(NAME, TILE, FW)                                           \
    static void NAME(const job_t *j) {                                     \
        const int64_t M = j->M;                                            \
        int64_t n = j->n0;                                                 \
        if (FW == 4 || M < 4)                                              \
            for (; n + 4 <= j->n1; n += 4) {                               \
                int64_t m = 0;                                             \
                for (; FW == 4 && m + 4 <= M; m += 4) TILE(j, n, m, 4, 4); \
                for (; m < M; m++) TILE(j, n, m, 1, 4);                    \
            }                                                              \
        for (; n + 2 <= j->n1; n += 2) {                                   \
            int64_t m = 0;                                                 \
            for (; m + 4 <= M; m += 4) TILE(j, n, m, 4, 2);                \
            for (; m < M; m++) TILE(j, n, m, 1, 2);                        \
        }                                                                  \
        for (; n < j->n1; n++) {                                           \
            int64_t m = 0;                                                 \
            for (; m + 4 <= M; m += 4) TILE(j, n, m, 4, 1);                \
            for (; m < M; m++) TILE(j, n, m, 1, 1);                        \
        }                                                                  \
    }
A8_RANGE(a8_int4b_tiles, a8_i4b, 4)
A8_RANGE(a8_int8b_tiles, a8_i8b, 4)
A8_RANGE(a8_int8_range, a8_i8, 2)
A8_RANGE(a8_int4_range, a8_i4, 2)

/* int8 per block of 128: tiled weights (tile_int8) 16 features at a time (a8_i8t), the row order in 4 x 4 tiles. */
static void a8_int8b_range(const job_t *j) {
    if (j->tiled) { /* every feature is in a tile (N % 16 == 0): the tiles that start in [n0, n1) */
        for (int64_t n = (j->n0 + 15) / 16 * 16; n < j->n1; n += 16) a8_i8t(j, n);
        return;
    }
    a8_int8b_tiles(j);
}

/* int4 per block of 128: tiles of 16 features by all rows (a8_i4t), the features left in 4 x 4 tiles. */
static void a8_int4b_range(const job_t *j) {
    if (j->tiled) { /* every feature is in a tile (N % 16 == 0): the tiles that start in [n0, n1) */
        for (int64_t n = (j->n0 + 15) / 16 * 16; n < j->n1; n += 16) {
            if (j->M >= a8t_tiled_block_rows)
                a8_i4t(j, n);
            else
                a8_i4t_rows(j, n);
        }
        return;
    }
    job_t rest = *j;
    if (j->M <= A8T_MAX_ROWS && j->M >= a8t_min_rows)
        for (; rest.n0 + 16 <= j->n1; rest.n0 += 16) a8_i4t(j, rest.n0);
    a8_int4b_tiles(&rest);
}

#endif

#include "quant_a8_avx2.h"

#if TF_A8 || TF_A8V
static __thread void *a8_buf = NULL; /* per calling thread, grown, never shrunk: no allocation per call */
static __thread size_t a8_cap = 0;
static pthread_key_t a8_key; /* its destructor frees a thread's buffer when the thread exits */
static pthread_once_t a8_once = PTHREAD_ONCE_INIT;
static void a8_key_init(void) { pthread_key_create(&a8_key, free); }
#endif

/* y = x W^T + b with x quantised to int8 per row and block of 32; G == 0: int8 weights (q, scale; tiled: in
   tile_int8's order, K % 128 == 0), else int4 (pack_int4 order, G == 64: x per block of 32; G == 128 or
   G % 256 == 0: x per block of 128; tiled: in tile_int4's order). Needs K % 64 == 0. Returns -2 for a call this CPU's
   kernel does not take (none without AVX2; with AVX2 but not AVX-512 VNNI all but tiled int4 per block of 128), -1 on
   no memory. */
int tf_a8_linear_f32(const float *x, int64_t xs, const void *q, const float *scale, const float *zero,
                     const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t tiled,
                     int64_t threads) {
#if TF_A8 || TF_A8V
    if (K % 64 != 0 || (G != 0 && G != 64 && G != 128 && G % 256 != 0)) return -2; /* other G: not these layouts */
    if (tiled && ((G > 0 && G < 128) || (G == 0 && K % 128 != 0) || N % 16 != 0 || M > A8T_MAX_ROWS))
        return -2;                               /* not a tiled layout's call */
    if (TF_A8V && (!tiled || G == 0)) return -2; /* the AVX2 kernel's: tiled int4 */
    const int64_t ng = G > 0 ? K / G : 0;
    const size_t need = (size_t)(M * K) + sizeof(float) * (size_t)(M * (K / 4) + M + M * ng) + 64;
    if (need > a8_cap) {
        void *nb = realloc(a8_buf, need);
        if (nb == NULL) return -1;
        a8_buf = nb;
        a8_cap = need;
        pthread_once(&a8_once, a8_key_init);
        pthread_setspecific(a8_key, nb);
    }
    float *dv = a8_buf, *corr = dv + M * (K / 4), *xsum = corr + M;
    int8_t *xqb = (int8_t *)(xsum + M * ng);
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
    j.xq = xqb;
    j.dv = dv;
    j.corr = corr;
    j.tiled = (int)tiled;
#if TF_A8
    /* int8 with K % 128 == 0 and int4 with G == 128 or G % 256 == 0: x per block of 128, d in dv */
    const int b128 = G >= 128 || (G == 0 && K % 128 == 0);
    if (b128)
        a8_quantize_b128(x, xs, M, K, G, xqb, dv, corr, xsum);
    else
        a8_quantize(x, xs, M, K, G, xqb, dv, corr, xsum);
    return run(G == 0 ? (b128 ? a8_int8b_range : a8_int8_range) : b128 ? a8_int4b_range : a8_int4_range, j, threads);
#else
    a8v_quantize_b128(x, xs, M, K, G, xqb, dv, xsum);
    return run(a8v_int4t_range, j, threads);
#endif
#else
    (void)x;
    (void)xs;
    (void)q;
    (void)scale;
    (void)zero;
    (void)bias;
    (void)y;
    (void)M;
    (void)N;
    (void)K;
    (void)G;
    (void)tiled;
    (void)threads;
    return -2;
#endif
}
