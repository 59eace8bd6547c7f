"""C source of the int8-activation kernels (:mod:`tightfit.cuda.quant_linear_a8`), appended to
:mod:`tightfit.cuda.quant_linear`'s library so they share its thread pool (``run``) and ``job_t``."""

SOURCE = r"""
/* ------------------------------------------------------------------ int8 activations (AVX-512 VNNI)
   x is quantised per row and block of 32 inputs (d = amax / 127, xq = round(x / d)), then every 64 inputs of a
   row meet 64 weights in one vpdpbusd (unsigned 8-bit weights times signed 8-bit inputs, sums of four in 16
   int32 lanes: lanes 0-7 hold block 2c, lanes 8-15 block 2c + 1), converted and scaled by d per lane.
   int8 weights are made unsigned by w ^ 0x80 (= w + 128): the 128 * sum(xq) that adds is taken off per row
   (corr). int4 weights are 0..15 already: W = q s + (zero - 8 s); the second term meets the fp32 x's group sums.
   int8 with K % 128 == 0 and int4 with groups of 128 or a multiple of 256 quantise x per block of 128 instead
   (a8_quantize_b128): a block's two vpdpbusd then add in int32 and are converted and scaled once, and int4 holds
   no per-group partial sums. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TF_A8 1
#else
#define TF_A8 0
#endif

int tf_a8_available(void) { return TF_A8; }

#if TF_A8
/* Per call, on the caller: xq (M x K int8), dv (M x K/4: 16 floats per 64 inputs), corr (M), xsum (M x K/G). */
static void a8_quantize(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, int8_t *xq, float *dv,
                        float *corr, float *xsum) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs;
        float c = 0.f;
        for (int64_t b = 0; b < K / 32; b++) {
            const __m512 u = _mm512_loadu_ps(xr + 32 * b), v = _mm512_loadu_ps(xr + 32 * b + 16);
            const float amax =
                _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(u, absmask), _mm512_and_ps(v, absmask)));
            const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
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
#define A8_CHUNK(ACC, W, o)                                                                                  \
    do {                                                                                                     \
        for (int r_ = 0; r_ < R; r_++) {                                                                     \
            const __m512i xv_ = _mm512_loadu_si512(j->xq + (m + r_) * K + (o));                              \
            const __m512 dv_ = _mm512_loadu_ps(j->dv + (m + r_) * (K / 4) + (o) / 4);                        \
            for (int f_ = 0; f_ < F; f_++)                                                                   \
                ACC[r_][f_] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(A8_ZERO, W[f_], xv_)),   \
                                              dv_, ACC[r_][f_]);                                             \
        }                                                                                                    \
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

/* The same for int4 weights with G == 64 (x per block of 32): per group one chunk, then times its scale. */
static inline __attribute__((always_inline)) void a8_i4(const job_t *j, int64_t n, int64_t m, const int R,
                                                        const int F) {
    const int64_t K = j->K, N = j->N, ng = K / 64;
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
            const float amax = _mm512_reduce_max_ps(mx), inv = amax > 0.f ? 127.f / amax : 0.f;
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
#define A8_BLOCK128(WA, WB, o, b)                                                                            \
    do {                                                                                                     \
        for (int r_ = 0; r_ < R; r_++) {                                                                     \
            const __m512i x0_ = _mm512_loadu_si512(j->xq + (m + r_) * K + (o));                              \
            const __m512i x1_ = _mm512_loadu_si512(j->xq + (m + r_) * K + (o) + 64);                         \
            const __m512 d_ = _mm512_set1_ps(j->dv[(m + r_) * nb + (b)]);                                    \
            for (int f_ = 0; f_ < F; f_++) {                                                                 \
                const __m512i s_ = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(A8_ZERO, WA[f_], x0_), WB[f_], x1_); \
                acc[r_][f_] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s_), d_), sf[f_], acc[r_][f_]);  \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

/* int4 weights with x per block of 128 (G == 128 or G % 256 == 0), rows m..m+R-1 by features n..n+F-1
   (R, F <= 4). G == 128: one 64-byte load holds a feature's whole group (low nibbles inputs 0-63, high
   64-127), one block. G % 256 == 0: bytes c .. c + 127 of a group (c = 0, 128, ...) hold in their low nibbles
   the block of inputs c .. c + 127 and in their high nibbles the block H + c .. H + c + 127. */
static inline __attribute__((always_inline)) void a8_i4b(const job_t *j, int64_t n, int64_t m, const int R,
                                                         const int F) {
    const int64_t K = j->K, N = j->N, G = j->G, H = G / 2, ng = K / G, nb = K / 128;
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
            A8_BLOCK128(wl, wh, g * 128, g);
        } else {
            for (int64_t c = 0; c < H; c += 128) {
                __m512i wa[4], wb[4];
                for (int f = 0; f < F; f++) {
                    wa[f] = _mm512_and_si512(_mm512_loadu_si512(p + f * (K / 2) + g * H + c), lo);
                    wb[f] = _mm512_and_si512(_mm512_loadu_si512(p + f * (K / 2) + g * H + c + 64), lo);
                }
                A8_BLOCK128(wa, wb, g * G + c, (g * G + c) / 128);
                for (int f = 0; f < F; f++) {
                    wa[f] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + f * (K / 2) + g * H + c), 4), lo);
                    wb[f] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + f * (K / 2) + g * H + c + 64), 4),
                                             lo);
                }
                A8_BLOCK128(wa, wb, g * G + H + c, (g * G + H + c) / 128);
            }
        }
    }
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

/* int8 weights with x per block of 128 (K % 128 == 0): per block two vpdpbusd in int32, converted and scaled by
   the block's d once; the row's weight scale and the w ^ 0x80 correction at the end. */
static inline __attribute__((always_inline)) void a8_i8b(const job_t *j, int64_t n, int64_t m, const int R,
                                                         const int F) {
    const int64_t K = j->K, N = j->N, nb = K / 128;
    const int8_t *q = (const int8_t *)j->w + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512 one = _mm512_set1_ps(1.f);
    __m512 acc[4][4], sf[4];
    for (int f = 0; f < F; f++) sf[f] = one;
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) acc[r][f] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i wa[4], wb[4];
        for (int f = 0; f < F; f++) {
            wa[f] = _mm512_xor_si512(_mm512_loadu_si512(q + f * K + 128 * b), flip);
            wb[f] = _mm512_xor_si512(_mm512_loadu_si512(q + f * K + 128 * b + 64), flip);
        }
        A8_BLOCK128(wa, wb, 128 * b, b);
    }
    for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) {
            const float bi = j->bias ? j->bias[n + f] : 0.f;
            j->y[(m + r) * N + n + f] = j->scale[n + f] * (_mm512_reduce_add_ps(acc[r][f]) - j->corr[m + r]) + bi;
        }
}

/* Four features by four rows (16 accumulators: no per-group partial sums to hold), then the tails. */
#define A8_RANGE44(NAME, TILE)                                                                               \
    static void NAME(const job_t *j) {                                                                       \
        const int64_t M = j->M;                                                                              \
        int64_t n = j->n0;                                                                                   \
        for (; n + 4 <= j->n1; n += 4) {                                                                     \
            int64_t m = 0;                                                                                   \
            for (; m + 4 <= M; m += 4) TILE(j, n, m, 4, 4);                                                  \
            for (; m < M; m++) TILE(j, n, m, 1, 4);                                                          \
        }                                                                                                    \
        for (; n < j->n1; n++) {                                                                             \
            int64_t m = 0;                                                                                   \
            for (; m + 4 <= M; m += 4) TILE(j, n, m, 4, 1);                                                  \
            for (; m < M; m++) TILE(j, n, m, 1, 1);                                                          \
        }                                                                                                    \
    }
A8_RANGE44(a8_int4b_range, a8_i4b)
A8_RANGE44(a8_int8b_range, a8_i8b)

#define A8_RANGE(NAME, TILE)                                                                                 \
    static void NAME(const job_t *j) {                                                                       \
        const int64_t M = j->M;                                                                              \
        int64_t n = j->n0;                                                                                   \
        if (M < 4)                                                                                           \
            for (; n + 4 <= j->n1; n += 4)                                                                   \
                for (int64_t m = 0; m < M; m++) TILE(j, n, m, 1, 4);                                         \
        for (; n + 2 <= j->n1; n += 2) {                                                                     \
            int64_t m = 0;                                                                                   \
            for (; m + 4 <= M; m += 4) TILE(j, n, m, 4, 2);                                                  \
            for (; m < M; m++) TILE(j, n, m, 1, 2);                                                          \
        }                                                                                                    \
        for (; n < j->n1; n++) {                                                                             \
            int64_t m = 0;                                                                                   \
            for (; m + 4 <= M; m += 4) TILE(j, n, m, 4, 1);                                                  \
            for (; m < M; m++) TILE(j, n, m, 1, 1);                                                          \
        }                                                                                                    \
    }
A8_RANGE(a8_int8_range, a8_i8)
A8_RANGE(a8_int4_range, a8_i4)

static __thread void *a8_buf = NULL; /* per calling thread, grown, never shrunk: no allocation per call */
static __thread size_t a8_cap = 0;
static pthread_key_t a8_key; /* its destructor frees a thread's buffer when the thread exits */
static pthread_once_t a8_once = PTHREAD_ONCE_INIT;
static void a8_key_init(void) { pthread_key_create(&a8_key, free); }
#endif

/* y = x W^T + b with x quantised to int8 per row and block of 32; G == 0: int8 weights (q, scale), else int4
   (pack_int4 order, G == 64: x per block of 32; G == 128 or G % 256 == 0: x per block of 128). Needs K % 64 == 0. Returns -2 where the CPU lacks AVX-512 VNNI, -1 on no memory. */
int tf_a8_linear_f32(const float *x, int64_t xs, const void *q, const float *scale, const float *zero,
                     const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t threads) {
#if TF_A8
    if (K % 64 != 0 || (G != 0 && G != 64 && G != 128 && G % 256 != 0)) return -2; /* other G: not these layouts */
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
    /* int8 with K % 128 == 0 and int4 with G == 128 or G % 256 == 0: x per block of 128, d in dv */
    const int b128 = G >= 128 || (G == 0 && K % 128 == 0);
    if (b128) a8_quantize_b128(x, xs, M, K, G, xqb, dv, corr, xsum);
    else a8_quantize(x, xs, M, K, G, xqb, dv, corr, xsum);
    job_t j = {x, scale, zero, bias, xsum, q, y, xs, M, N, K, G, 0, N};
    j.xq = xqb;
    j.dv = dv;
    j.corr = corr;
    return run(G == 0 ? (b128 ? a8_int8b_range : a8_int8_range) : b128 ? a8_int4b_range : a8_int4_range, j, threads);
#else
    (void)x; (void)xs; (void)q; (void)scale; (void)zero; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)G;
    (void)threads;
    return -2;
#endif
}
"""
