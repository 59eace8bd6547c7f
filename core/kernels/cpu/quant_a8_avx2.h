/* Part of quant_a8.h (included before tf_a8_linear_f32): the int8-activation kernel for CPUs with AVX2 but not
   AVX-512 VNNI. It takes int4 weights held tiled (tile_int4) in groups of 128 or a multiple of 256, x quantised per
   block of 128 as the AVX-512 kernel does (same xq and d, so the same reference); tf_a8_linear_f32 returns -2 for
   every other call here, which then keeps the fp32-activation kernels. */

#if TF_A8V
/* ------------------------------------------------------------------ int8 activations (AVX2, no VNNI)
   There is no vpdpbusd: vpmaddubsw multiplies 32 unsigned weight bytes (int4: 0..15) by 32 signed input bytes and
   adds them in pairs to int16, vpmaddwd by ones adds those pairs to int32. A pair is at most 2 * 15 * 127 = 3810
   in magnitude, so eight of them add in int16 without overflow before one vpmaddwd widens them (A8V_FLUSH steps
   of a run, each adding one or two pairs a lane). A tile's 64-byte line holds 16 features' next four bytes; this
   kernel takes it as two halves of eight features (32 bytes, 8 int32 lanes). */

/* Per call, on the caller: xq (M x K int8, per block of 128: d in d128, M x K/128) and xsum (M x K/G). */
static void a8v_quantize_b128(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, int8_t *xq, float *d128,
                              float *xsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs;
        for (int64_t b = 0; b < K / 128; b++) {
            __m256 v[16], mx = _mm256_setzero_ps();
            for (int i = 0; i < 16; i++) {
                v[i] = _mm256_loadu_ps(xr + 128 * b + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const __m256 inv = _mm256_set1_ps(a8_inv(amax));
            for (int t = 0; t < 4; t++) { /* 32 inputs: four vectors of int32, packed to bytes in order */
                __m256i q[4];
                for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[4 * t + i], inv));
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                _mm256_storeu_si256((__m256i *)(xq + m * K + 128 * b + 32 * t), _mm256_permutevar8x32_epi32(p, order));
            }
            d128[m * (K / 128) + b] = amax / 127.f;
        }
        for (int64_t g = 0; g < K / G; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t i = 0; i < G; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + g * G + i));
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            xsum[m * (K / G) + g] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        }
    }
}

/* Eight features' scales of group g (sv) and zero-point terms zero - 8 scale (zc), one lane each. */
static inline __attribute__((always_inline)) void a8v_scales(const job_t *j, int64_t n, int64_t g, __m256 *sv,
                                                             __m256 *zc) {
    float sb[8], zb[8];
    a8_group_scales(j, n, g, 8, sb, zb);
    *sv = _mm256_loadu_ps(sb);
    *zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), *sv, _mm256_loadu_ps(zb));
}

#define A8V_FLUSH(S) ((S) ? 8 : 4) /* steps a run's int16 sums take before widening (at most 8 pairs a lane) */

/* Half a tile's run (32 bytes of each of its 16 lines: eight features) against rows m .. m + R - 1: the low
   nibbles are inputs ol .. ol + 63 of block bl, the high ones oh .. oh + 63 of block bh. S: two blocks (groups
   of a multiple of 256), kept apart to their conversion; else one (groups of 128: both halves add in int16). */
static inline __attribute__((always_inline)) void a8v_run(const job_t *j, const uint8_t *run, int64_t m, const int R,
                                                          const int S, int64_t bl, int64_t bh, int64_t ol, int64_t oh,
                                                          __m256 sv, __m256 *acc) {
    const int64_t K = j->K, nb = K / 128;
    const __m256i l4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i sl[4], sh[4], wl[4], wh[4]; /* int16 sums, int32 sums (low / high nibbles; S == 0: sl, wl only) */
    for (int r = 0; r < R; r++) sl[r] = sh[r] = wl[r] = wh[r] = _mm256_setzero_si256();
    for (int i = 0; i < 16; i++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(run + 64 * i));
        const __m256i lo = _mm256_and_si256(w, l4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), l4);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = j->xq + (m + r) * K;
            int32_t a, b;
            memcpy(&a, xr + ol + 4 * i, 4);
            memcpy(&b, xr + oh + 4 * i, 4);
            const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a));
            const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b));
            if (S) {
                sl[r] = _mm256_add_epi16(sl[r], pl);
                sh[r] = _mm256_add_epi16(sh[r], ph);
            } else {
                sl[r] = _mm256_add_epi16(sl[r], _mm256_add_epi16(pl, ph));
            }
        }
        if (i % A8V_FLUSH(S) == A8V_FLUSH(S) - 1)
            for (int r = 0; r < R; r++) {
                wl[r] = _mm256_add_epi32(wl[r], _mm256_madd_epi16(sl[r], ones));
                sl[r] = _mm256_setzero_si256();
                if (S) {
                    wh[r] = _mm256_add_epi32(wh[r], _mm256_madd_epi16(sh[r], ones));
                    sh[r] = _mm256_setzero_si256();
                }
            }
    }
    for (int r = 0; r < R; r++) {
        const float *dr = j->dv + (m + r) * nb;
        __m256 *a = acc + m + r;
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wl[r]), _mm256_mul_ps(sv, _mm256_set1_ps(dr[bl])), *a);
        if (S) *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wh[r]), _mm256_mul_ps(sv, _mm256_set1_ps(dr[bh])), *a);
    }
}

/* Features n .. n + 15 (one tile) by all M rows (M <= A8T_MAX_ROWS), eight features at a time: per group the
   scales are gathered once and its runs meet the rows in groups (4 rows; 2 where S keeps two sets of sums). */
static void a8v_tile(const job_t *j, int64_t n) {
    const int64_t K = j->K, N = j->N, M = j->M, G = j->G, H = G / 2, ng = K / G;
    const int S = G != 128;
    const uint8_t *p = (const uint8_t *)j->w + n * (K / 2);
    for (int h = 0; h < 2; h++) {
        const int64_t nh = n + 8 * h;
        __m256 acc[A8T_MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            __m256 sv, zc;
            a8v_scales(j, nh, g, &sv, &zc);
            for (int64_t c = 0; c < H; c += 64) {
                const uint8_t *run = p + (g * H + c) * 16 + 32 * h;
                const int64_t half = c % 128, base = g * G + c - half;
                const int64_t bl = S ? base / 128 : g, bh = S ? (base + H) / 128 : g;
                const int64_t ol = bl * 128 + (S ? half : 0), oh = bh * 128 + (S ? half : 64);
                int64_t m = 0;
                if (S) {
                    for (; m + 2 <= M; m += 2) a8v_run(j, run, m, 2, 1, bl, bh, ol, oh, sv, acc);
                    for (; m < M; m++) a8v_run(j, run, m, 1, 1, bl, bh, ol, oh, sv, acc);
                } else {
                    for (; m + 4 <= M; m += 4) a8v_run(j, run, m, 4, 0, bl, bh, ol, oh, sv, acc);
                    for (; m < M; m++) a8v_run(j, run, m, 1, 0, bl, bh, ol, oh, sv, acc);
                }
            }
            for (int64_t m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(zc, _mm256_set1_ps(j->xsum[m * ng + g]), acc[m]);
        }
        const __m256 bias = j->bias ? _mm256_loadu_ps(j->bias + nh) : _mm256_setzero_ps();
        for (int64_t m = 0; m < M; m++) _mm256_storeu_ps(j->y + m * N + nh, _mm256_add_ps(acc[m], bias));
    }
}

/* The tiles that start in [n0, n1) (N % 16 == 0: every feature is in one). */
static void a8v_int4t_range(const job_t *j) {
    for (int64_t n = (j->n0 + 15) / 16 * 16; n < j->n1; n += 16) a8v_tile(j, n);
}
#endif
