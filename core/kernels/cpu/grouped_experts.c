/* A Mixture-of-Experts layer's routed experts in fp32 (launcher: tightfit.kernels.grouped_experts).
     tf_grouped_experts_f32   out[t] = sum over token t's routed experts e (first <= e < first + E) of
                              weights[t, s] * down_e(act(gate_up_e(x[t])))
   The (token, expert) pairs are counting-sorted by expert; each expert's tokens then run in units of up to CHUNK
   rows, both products tiled RB rows by 2 NB columns, and each token's rows are summed in expert order, so the
   result does not depend on the number of threads. Contract: weights are input-major (gu[e]: H x 2I, dn[e]: I x H),
   biases optional (NULL); experts outside [first, first + E) are skipped. Returns 0, or -1 where its buffers could
   not be allocated. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "tf_fork.h"

#define RB 6               /* token rows of a tile: each weight vector loaded feeds RB FMAs */
#define NB 8               /* columns of each of a tile's two column segments (one 8-float vector) */
#define CHUNK 64           /* rows of one unit of work: up to CHUNK of one expert's tokens */
#define PACK_ROWS (2 * RB) /* rows above which a unit copies each weight panel before its tiles run over it */
#define MIN_WORK 262144    /* multiply-adds below which a call stays on the calling thread */

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* unaligned loads and stores */

/* A macro, not a function: a function returning a vector type warns (-Wpsabi) on targets without AVX. */
#define splat(a) ((v8){(a), (a), (a), (a), (a), (a), (a), (a)})

/* acc[r][s] = sum_k x[r][k] * w[k * ld + off_s .. + NB) for the RB rows x[r] and the segments off_0, off_1; written
   out for RB = 6: twelve accumulators, two weight vectors and a broadcast fit AVX2's sixteen registers. */
static inline void tile(const float *const *x, const float *w, int64_t ld, int64_t K, int64_t off0, int64_t off1,
                        v8 acc[RB][2]) {
    v8 a00 = splat(0.f), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    v8 a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5];
    for (int64_t k = 0; k < K; k++) {
        const v8 w0 = *(const v8 *)(w + k * ld + off0), w1 = *(const v8 *)(w + k * ld + off1);
        __builtin_prefetch(w + (k + 8) * ld + off0);
        __builtin_prefetch(w + (k + 8) * ld + off1);
        v8 b = splat(x0[k]);
        a00 += b * w0;
        a01 += b * w1;
        b = splat(x1[k]);
        a10 += b * w0;
        a11 += b * w1;
        b = splat(x2[k]);
        a20 += b * w0;
        a21 += b * w1;
        b = splat(x3[k]);
        a30 += b * w0;
        a31 += b * w1;
        b = splat(x4[k]);
        a40 += b * w0;
        a41 += b * w1;
        b = splat(x5[k]);
        a50 += b * w0;
        a51 += b * w1;
    }
    acc[0][0] = a00;
    acc[0][1] = a01;
    acc[1][0] = a10;
    acc[1][1] = a11;
    acc[2][0] = a20;
    acc[2][1] = a21;
    acc[3][0] = a30;
    acc[3][1] = a31;
    acc[4][0] = a40;
    acc[4][1] = a41;
    acc[5][0] = a50;
    acc[5][1] = a51;
}

/* The K x 2 NB panel of w's columns off0 .. + NB and off1 .. + NB, copied contiguous into panel where the unit has
   more than PACK_ROWS rows to run over it (returns panel), else w itself. The weights' rows lie a power-of-two
   apart at the usual widths, so a tile walking down them strided would keep evicting its own lines from the L1
   cache; a copied panel is read sequentially and stays there for all the unit's row tiles. */
static inline const float *pack(const float *w, int64_t ld, int64_t K, int64_t off0, int64_t off1, int64_t n,
                                float *panel) {
    if (n <= PACK_ROWS) return w;
    for (int64_t k = 0; k < K; k++) {
        memcpy(panel + k * 2 * NB, w + k * ld + off0, NB * sizeof(float));
        memcpy(panel + k * 2 * NB + NB, w + k * ld + off1, NB * sizeof(float));
    }
    return panel;
}

/* One column c of x[r] . w: the columns a tile's vectors do not cover. */
static inline float column(const float *x, const float *w, int64_t ld, int64_t K, int64_t c) {
    float a = 0.f;
    for (int64_t k = 0; k < K; k++) a += x[k] * w[k * ld + c];
    return a;
}

/* SwiGLU, or with limit != 0 gpt-oss's clamped SwiGLU. */
static inline float act(float g, float u, float limit, float alpha) {
    if (limit == 0.f) return g / (1.f + expf(-g)) * u;
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : u > limit ? limit : u;
    return (u + 1.f) * (g / (1.f + expf(-g * alpha)));
}

typedef struct {
    const float *x;
    int64_t xs, H, I;
    const float *const *gu, *const *dn, *const *gub, *const *dnb;
    float limit, alpha;
    const int64_t *tok; /* token of each expert-sorted pair */
    const float *scale; /* routing weight of each pair */
    float *ys;          /* each pair's scaled output row (H floats) */
} job_t;

/* y[0 .. N) += a * w[0 .. N) */
static inline void axpy(float a, const float *w, float *y, int64_t N) {
    for (int64_t c = 0; c < N; c++) y[c] += a * w[c];
}

/* unit() for n <= RB rows, the few a decode step gives an expert: each weight row is read once, in order (a stream
   the hardware prefetches), into accumulator rows that stay in the L1 cache. g: n x 2I floats, h: n x I, d: n x H. */
static void unit_few(const job_t *j, int64_t e, int64_t p0, int64_t n, float *g, float *h, float *d) {
    const int64_t H = j->H, I = j->I;
    const float *W1 = j->gu[e], *W2 = j->dn[e];
    const float *b1 = j->gub ? j->gub[e] : NULL, *b2 = j->dnb ? j->dnb[e] : NULL;
    const float *x[RB];
    for (int64_t r = 0; r < n; r++) x[r] = j->x + j->tok[p0 + r] * j->xs;
    memset(g, 0, (size_t)(n * 2 * I) * sizeof(float));
    for (int64_t k = 0; k < H; k++)
        for (int64_t r = 0; r < n; r++) axpy(x[r][k], W1 + k * 2 * I, g + r * 2 * I, 2 * I);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < I; c++)
            h[r * I + c] = act(g[r * 2 * I + c] + (b1 ? b1[c] : 0.f), g[r * 2 * I + I + c] + (b1 ? b1[I + c] : 0.f),
                               j->limit, j->alpha);
    memset(d, 0, (size_t)(n * H) * sizeof(float));
    for (int64_t k = 0; k < I; k++)
        for (int64_t r = 0; r < n; r++) axpy(h[r * I + k], W2 + k * H, d + r * H, H);
    for (int64_t r = 0; r < n; r++) {
        float *y = j->ys + (p0 + r) * H;
        const float s = j->scale[p0 + r];
        for (int64_t c = 0; c < H; c++) y[c] = (b2 ? d[r * H + c] + b2[c] : d[r * H + c]) * s;
    }
}

/* The pairs [p0, p1) of local expert e (p1 - p0 <= CHUNK): ys[p] = scale[p] * down(act(gate_up(x[tok[p]]))). h holds
   CHUNK x I floats, panel max(H, I) x 2 NB. */
static void unit(const job_t *j, int64_t e, int64_t p0, int64_t p1, float *h, float *panel) {
    const int64_t H = j->H, I = j->I, n = p1 - p0;
    if (n <= RB) {
        unit_few(j, e, p0, n, h, h + RB * 2 * I, panel);
        return;
    }
    const float *W1 = j->gu[e], *W2 = j->dn[e];
    const float *b1 = j->gub ? j->gub[e] : NULL, *b2 = j->dnb ? j->dnb[e] : NULL;
    const float *rows[RB];
    v8 acc[RB][2];
    /* h[r] = act(x[tok[p0 + r]] . W1 + b1): gate columns c .. c + NB beside up columns I + c .. */
    for (int64_t c = 0; c + NB <= I; c += NB) {
        const float *w = pack(W1, 2 * I, H, c, I + c, n, panel);
        const int64_t ld = w == panel ? 2 * NB : 2 * I, o0 = w == panel ? 0 : c, o1 = w == panel ? NB : I + c;
        for (int64_t r0 = 0; r0 < n; r0 += RB) {
            for (int r = 0; r < RB; r++) rows[r] = j->x + j->tok[p0 + (r0 + r < n ? r0 + r : r0)] * j->xs;
            tile(rows, w, ld, H, o0, o1, acc);
            for (int r = 0; r < RB && r0 + r < n; r++)
                for (int i = 0; i < NB; i++) {
                    float g = acc[r][0][i], u = acc[r][1][i];
                    if (b1) {
                        g += b1[c + i];
                        u += b1[I + c + i];
                    }
                    h[(r0 + r) * I + c + i] = act(g, u, j->limit, j->alpha);
                }
        }
    }
    for (int64_t c = I - I % NB; c < I; c++)
        for (int64_t r = 0; r < n; r++) {
            const float *xr = j->x + j->tok[p0 + r] * j->xs;
            float g = column(xr, W1, 2 * I, H, c), u = column(xr, W1, 2 * I, H, I + c);
            if (b1) {
                g += b1[c];
                u += b1[I + c];
            }
            h[r * I + c] = act(g, u, j->limit, j->alpha);
        }
    /* ys[p] = (h[r] . W2 + b2) * scale[p], 2 NB columns a tile */
    for (int64_t c = 0; c + 2 * NB <= H; c += 2 * NB) {
        const float *w = pack(W2, H, I, c, c + NB, n, panel);
        const int64_t ld = w == panel ? 2 * NB : H, o0 = w == panel ? 0 : c, o1 = w == panel ? NB : c + NB;
        for (int64_t r0 = 0; r0 < n; r0 += RB) {
            for (int r = 0; r < RB; r++) rows[r] = h + (r0 + r < n ? r0 + r : r0) * I;
            tile(rows, w, ld, I, o0, o1, acc);
            for (int r = 0; r < RB && r0 + r < n; r++) {
                const int64_t p = p0 + r0 + r;
                float *y = j->ys + p * H + c;
                for (int i = 0; i < NB; i++) {
                    y[i] = ((b2 ? acc[r][0][i] + b2[c + i] : acc[r][0][i])) * j->scale[p];
                    y[NB + i] = ((b2 ? acc[r][1][i] + b2[c + NB + i] : acc[r][1][i])) * j->scale[p];
                }
            }
        }
    }
    for (int64_t c = H - H % (2 * NB); c < H; c++)
        for (int64_t r = 0; r < n; r++) {
            const float d = column(h + r * I, W2, H, I, c);
            j->ys[(p0 + r) * H + c] = (b2 ? d + b2[c] : d) * j->scale[p0 + r];
        }
}

/* out[t] = the sum of its pairs' rows, in expert order (0 where it has none here). */
static void gather_sums(const job_t *j, const int64_t *slots, const int *fill, int64_t k, int64_t t, float *out) {
    float *o = out + t * j->H;
    memset(o, 0, (size_t)j->H * sizeof(float));
    for (int s = 0; s < fill[t]; s++) {
        const float *y = j->ys + slots[t * k + s] * j->H;
        for (int64_t c = 0; c < j->H; c++) o[c] += y[c];
    }
}

/* The routed experts of T tokens (see tightfit.kernels.grouped_experts): chosen and weights (T, k), local experts
   first .. first + E - 1 with input-major weights gu[e] (H x 2I) and dn[e] (I x H), optional biases; writes the fp32
   (T, H) sums to out. Returns 0, or -1 where its buffers could not be allocated. */
int64_t tf_grouped_experts_f32(const float *x, int64_t xs, const int64_t *chosen, const float *weights, int64_t T,
                               int64_t k, int64_t H, int64_t I, int64_t first, int64_t E, const float *const *gu,
                               const float *const *dn, const float *const *gub, const float *const *dnb, float limit,
                               float alpha, float *out, int64_t threads) {
    const int64_t P = T * k;
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t)), *tok = malloc((size_t)(P + 1) * sizeof(int64_t));
    int64_t *slots = malloc((size_t)(P + 1) * sizeof(int64_t));
    int64_t *units = malloc((size_t)(3 * (P + E) + 3) * sizeof(int64_t));
    int *fill = calloc((size_t)T + 1, sizeof(int));
    float *scale = malloc((size_t)(P + 1) * sizeof(float)), *ys = malloc((size_t)(P * H + 1) * sizeof(float));
    int64_t rc = -1, nu = 0, used = 0;
    if (!count || !tok || !slots || !units || !fill || !scale || !ys) goto done;
    /* counting sort of the local pairs by expert, token order kept within an expert */
    for (int64_t f = 0; f < P; f++) {
        const int64_t e = chosen[f] - first;
        if (e >= 0 && e < E) count[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    for (int64_t f = 0; f < P; f++) {
        const int64_t e = chosen[f] - first;
        if (e < 0 || e >= E) continue;
        const int64_t p = count[e]++, t = f / k;
        tok[p] = t;
        scale[p] = weights[f];
        used++;
    }
    /* count[e] is now expert e's end; its pairs start at count[e - 1] (0 for the first) */
    for (int64_t e = 0; e < E; e++)
        for (int64_t p = e ? count[e - 1] : 0; p < count[e]; p += CHUNK) {
            units[3 * nu] = e;
            units[3 * nu + 1] = p;
            units[3 * nu + 2] = p + CHUNK < count[e] ? p + CHUNK : count[e];
            nu++;
        }
    for (int64_t p = 0; p < used; p++) slots[tok[p] * k + fill[tok[p]]++] = p; /* ascending p: expert order */
    job_t j = {x, xs, H, I, gu, dn, gub, dnb, limit, alpha, tok, scale, ys};
    int64_t n = used * H * 3 * I / MIN_WORK;
    n = n < threads ? n : threads;
    n = n < nu ? n : nu;
#ifdef _OPENMP
    if (tf_forked) n = 1;
#else
    n = 1;
#endif
    if (n > 1) {
#ifdef _OPENMP
        int failed = 0;
#pragma omp parallel num_threads((int)n)
        {
            float *h = malloc(((size_t)CHUNK * (size_t)I + (size_t)(H > I ? H : I) * 2 * NB) * sizeof(float));
            if (!h) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < nu; u++)
                if (h) unit(&j, units[3 * u], units[3 * u + 1], units[3 * u + 2], h, h + CHUNK * I);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) gather_sums(&j, slots, fill, k, t, out);
            free(h);
        }
        if (failed) goto done;
#endif
    } else {
        float *h = malloc(((size_t)CHUNK * (size_t)I + (size_t)(H > I ? H : I) * 2 * NB) * sizeof(float));
        if (!h) goto done;
        for (int64_t u = 0; u < nu; u++) unit(&j, units[3 * u], units[3 * u + 1], units[3 * u + 2], h, h + CHUNK * I);
        for (int64_t t = 0; t < T; t++) gather_sums(&j, slots, fill, k, t, out);
        free(h);
    }
    rc = 0;
done:
    free(count);
    free(tok);
    free(slots);
    free(units);
    free(fill);
    free(scale);
    free(ys);
    return rc;
}
