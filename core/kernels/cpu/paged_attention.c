/* Paged, variable-length attention over a block-table KV cache in fp32 (launcher:
   tightfit.kernels.varlen_attention_cpu).
     tf_store_kv_f32          copy T rows of k and v into the cache slots slots[t]
     tf_paged_attention_f32   out = softmax(scale * q k^T (causal; optional window, softcap, sinks)) v per
                              sequence b, its new tokens' queries cu[b] .. cu[b + 1] against its kv_lens[b] keys,
                              read in place from the cache pages bt[b, :]
     tf_attention_threading   1 where calls run on the process's OpenMP team, 0 where on threads of their own
   Contract: Hq query heads over Hk KV heads (grouped-query attention; Hk divides Hq), D floats a head, BS tokens a
   page. Returns 0, 1 when memory could not be had, 2 when Hk does not divide Hq. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *kc, *vc, *sinks; /* sinks: one logit per query head, or NULL */
    float *out;
    const int32_t *bt, *cu, *kv_lens;
    int64_t bt_stride, q_row, B, Hq, Hk, D, BS, max_q, max_kv;
    int64_t begin, row0, end, row1; /* rows from (sequence begin, its row row0) up to, not with, (end, row1) */
    int64_t window;                 /* a query at position p sees keys p - window + 1 .. p; 0: every key up to p */
    float scale, softcap;           /* softcap > 0: scores become softcap * tanh(score / softcap) */
    int failed;
} job_t;

/* The first key a query at position pos sees: 0, or its window's first. */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

/* One query head's n scaled scores -> its probabilities: soft-capped first where softcap > 0, then an exact
   softmax (max, exp and sum in fp32). A sink logit joins the max and the sum as one more key and its share is
   dropped, so the probabilities over the keys sum to less than one. */
static inline __attribute__((always_inline)) void softmax(float *sc, int64_t n, float softcap, const float *sink) {
    if (softcap > 0.f) {
        const float inv_cap = 1.f / softcap;
        for (int64_t p = 0; p < n; p++) sc[p] = softcap * tanhf(sc[p] * inv_cap);
    }
    float mx = sink ? *sink : -INFINITY, sum = 0.f;
    for (int64_t p = 0; p < n; p++) mx = sc[p] > mx ? sc[p] : mx;
    for (int64_t p = 0; p < n; p++) {
        sc[p] = expf(sc[p] - mx);
        sum += sc[p];
    }
    if (sink) sum += expf(*sink - mx);
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < n; p++) sc[p] *= inv;
}

/* One sequence: every new token's Hq query heads against the keys it sees (from its window's first key, or
   0, up to its own position: pages wholly before the window are never read, and may be holes). Keys and values
   are walked page by page in memory order (a token's row holds all Hk heads, so a page is read front to back; a
   walk per head would read a quarter of each row at a time), with no division per key, and each row is read once for
   all query heads. */
static inline __attribute__((always_inline)) void attend(const job_t *j, int64_t b, int64_t i0, int64_t i1,
                                                         float *scores, float *acc, const int64_t D) {
    const int64_t q0 = j->cu[b], qlen = j->cu[b + 1] - q0;
    if (qlen <= 0 || qlen > j->max_q) return;
    if (i1 > qlen) i1 = qlen;
    const int64_t kv = j->kv_lens[b], Hq = j->Hq, Hk = j->Hk, G = Hq / Hk, BS = j->BS, row = Hk * D;
    const int32_t *table = j->bt + b * j->bt_stride;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t pos = kv - qlen + i, lo = first_key(pos, j->window), seen = pos + 1 - lo; /* keys lo .. pos */
        const float *qrow = j->q + (q0 + i) * j->q_row;
        for (int64_t p0 = lo; p0 <= pos;) { /* p0 .. p0 + n - 1: the rest of p0's page, or of the keys */
            const int64_t off = p0 % BS, n = pos + 1 - p0 < BS - off ? pos + 1 - p0 : BS - off;
            const float *k = j->kc + ((int64_t)table[p0 / BS] * BS + off) * row;
            for (int64_t s = 0; s < n; s++, k += row) {
                for (int64_t hq = 0; hq < Hq; hq++) {
                    const float *qq = qrow + hq * D, *kk = k + (hq / G) * D;
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; d++) dot += qq[d] * kk[d];
                    scores[hq * seen + p0 - lo + s] = dot * j->scale;
                }
            }
            p0 += n;
        }
        for (int64_t hq = 0; hq < Hq; hq++) softmax(scores + hq * seen, seen, j->softcap, j->sinks ? j->sinks + hq : 0);
        memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
        for (int64_t p0 = lo; p0 <= pos;) {
            const int64_t off = p0 % BS, n = pos + 1 - p0 < BS - off ? pos + 1 - p0 : BS - off;
            const float *v = j->vc + ((int64_t)table[p0 / BS] * BS + off) * row;
            for (int64_t s = 0; s < n; s++, v += row) {
                for (int64_t hq = 0; hq < Hq; hq++) {
                    const float w = scores[hq * seen + p0 - lo + s], *vv = v + (hq / G) * D;
                    float *o = acc + hq * D;
                    for (int64_t d = 0; d < D; d++) o[d] += w * vv[d];
                }
            }
            p0 += n;
        }
        memcpy(j->out + (q0 + i) * Hq * D, acc, sizeof(float) * (size_t)(Hq * D));
    }
}

/* The usual head widths get a copy of the loop with the width known, so the compiler unrolls the dot
   products and the value updates into whole vector registers: prefix_32, _64, _128 and, for any other
   width, prefix_any, each calling body with its width. */
#define WIDTH(prefix, body, name, width)                                                                 \
    static void prefix##_##name(const job_t *j, int64_t b, int64_t i0, int64_t i1, float *s, float *a) { \
        body(j, b, i0, i1, s, a, width);                                                                 \
    }
#define WIDTHS(prefix, body) \
    WIDTH(prefix, body, any, j->D) WIDTH(prefix, body, 32, 32) WIDTH(prefix, body, 64, 64) WIDTH(prefix, body, 128, 128)

#if defined(__AVX2__) && defined(__FMA__)
/* Built with -march=native for this CPU (the library's cache key holds its instruction-set flags), so
   this branch is the CPU's own: AVX2 + FMA. Head widths that are a multiple of 8 score a tile of 8 keys
   at once: 8 accumulators of D / 8 FMAs each, then one hadd tree gives the 8 dot products in one
   register, instead of a horizontal sum per key and head. */
#include <immintrin.h>
#define TILE 8
#define HAVE_TILED 1

/* The lane sums of a[0..7], in order: two rounds of hadd within 128-bit halves, then the halves added. */
static inline __attribute__((always_inline)) __m256 sum8(const __m256 *a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* Row offsets (in floats) of keys p0 .. p0 + n - 1 of a sequence, walking its table page by page; the
   unused tail of a short tile repeats the first key (its scores are never read). */
static inline __attribute__((always_inline)) int64_t tile_rows(const int32_t *table, int64_t BS, int64_t row, int64_t n,
                                                               int64_t *pg, int64_t *off, int64_t *rows) {
    for (int64_t s = 0; s < n; s++) {
        rows[s] = ((int64_t)table[*pg] * BS + *off) * row;
        if (++*off == BS) {
            *off = 0;
            ++*pg;
        }
    }
    for (int64_t s = n; s < TILE; s++) rows[s] = rows[0];
    return n;
}

static inline __attribute__((always_inline)) void attend_tiled(const job_t *j, int64_t b, int64_t i0, int64_t i1,
                                                               float *scores, float *acc, const int64_t D) {
    const int64_t q0 = j->cu[b], qlen = j->cu[b + 1] - q0;
    if (qlen <= 0 || qlen > j->max_q) return;
    if (i1 > qlen) i1 = qlen;
    const int64_t kv = j->kv_lens[b], Hq = j->Hq, G = Hq / j->Hk, BS = j->BS, row = j->Hk * D;
    const int64_t stride = j->max_kv + TILE; /* a head's scores, room for a whole last tile */
    const int32_t *table = j->bt + b * j->bt_stride;
    const __m256 scale = _mm256_set1_ps(j->scale);
    int64_t rows[TILE];
    for (int64_t i = i0; i < i1; i++) {
        const int64_t pos = kv - qlen + i, lo = first_key(pos, j->window), seen = pos + 1 - lo; /* keys lo .. pos */
        const float *qrow = j->q + (q0 + i) * j->q_row;
        int64_t pg = lo / BS, off = lo % BS; /* p0 counts from key lo */
        for (int64_t p0 = 0; p0 < seen; p0 += TILE) {
            tile_rows(table, BS, row, seen - p0 < TILE ? seen - p0 : TILE, &pg, &off, rows);
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float *qq = qrow + hq * D, *k = j->kc + (hq / G) * D;
                __m256 a[TILE];
                for (int s = 0; s < TILE; s++) a[s] = _mm256_setzero_ps();
                for (int64_t c = 0; c < D; c += 8) {
                    const __m256 qv = _mm256_loadu_ps(qq + c);
                    for (int s = 0; s < TILE; s++) a[s] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + rows[s] + c), a[s]);
                }
                _mm256_storeu_ps(scores + hq * stride + p0, _mm256_mul_ps(sum8(a), scale));
            }
        }
        for (int64_t hq = 0; hq < Hq; hq++)
            softmax(scores + hq * stride, seen, j->softcap, j->sinks ? j->sinks + hq : 0);
        memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
        pg = lo / BS, off = lo % BS;
        for (int64_t p0 = 0; p0 < seen; p0 += TILE) {
            const int64_t n = tile_rows(table, BS, row, seen - p0 < TILE ? seen - p0 : TILE, &pg, &off, rows);
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float *w = scores + hq * stride + p0, *v = j->vc + (hq / G) * D;
                float *o = acc + hq * D;
                if (n == TILE) { /* a whole tile: the loop over its keys unrolls, two chains per chunk */
                    for (int64_t c = 0; c < D; c += 8) {
                        __m256 x = _mm256_loadu_ps(o + c), y = _mm256_setzero_ps();
                        for (int s = 0; s < TILE; s += 2) {
                            x = _mm256_fmadd_ps(_mm256_set1_ps(w[s]), _mm256_loadu_ps(v + rows[s] + c), x);
                            y = _mm256_fmadd_ps(_mm256_set1_ps(w[s + 1]), _mm256_loadu_ps(v + rows[s + 1] + c), y);
                        }
                        _mm256_storeu_ps(o + c, _mm256_add_ps(x, y));
                    }
                    continue;
                }
                for (int64_t c = 0; c < D; c += 8) {
                    __m256 x = _mm256_loadu_ps(o + c);
                    for (int64_t s = 0; s < n; s++)
                        x = _mm256_fmadd_ps(_mm256_set1_ps(w[s]), _mm256_loadu_ps(v + rows[s] + c), x);
                    _mm256_storeu_ps(o + c, x);
                }
            }
        }
        memcpy(j->out + (q0 + i) * Hq * D, acc, sizeof(float) * (size_t)(Hq * D));
    }
}

WIDTHS(tiled, attend_tiled)
#else
#define TILE 1
#define HAVE_TILED 0
#endif

WIDTHS(attend, attend)

static void *run_range(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t per = j->Hq * j->D > j->Hq ? j->Hq * j->D : j->Hq;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(j->Hq * (j->max_kv + TILE) + per));
    if (!scores) {
        j->failed = 1;
        return NULL;
    }
    void (*fn)(const job_t *, int64_t, int64_t, int64_t, float *, float *) = j->D == 32    ? attend_32
                                                                             : j->D == 64  ? attend_64
                                                                             : j->D == 128 ? attend_128
                                                                                           : attend_any;
#if HAVE_TILED
    if (j->D % 8 == 0) fn = j->D == 32 ? tiled_32 : j->D == 64 ? tiled_64 : j->D == 128 ? tiled_128 : tiled_any;
#endif
    for (int64_t t = j->begin; t <= j->end && t < j->B; t++)
        fn(j, t, t == j->begin ? j->row0 : 0, t == j->end ? j->row1 : INT64_MAX, scores + per, scores);
    free(scores);
    return NULL;
}

/* Rows t of k and v (row strides k_row, v_row; width floats each) to cache slots slots[t]. */
void tf_store_kv_f32(const float *k, int64_t k_row, const float *v, int64_t v_row, float *kc, float *vc,
                     const int64_t *slots, int64_t T, int64_t width) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(kc + slots[t] * width, k + t * k_row, sizeof(float) * (size_t)width);
        memcpy(vc + slots[t] * width, v + t * v_row, sizeof(float) * (size_t)width);
    }
}

#define MAX_THREADS 256

/* Built with OpenMP (where PyTorch's runtime is in the process, tightfit.kernels.native) the runs go to its team;
   a child forked from a process that ran a parallel region (GNU OpenMP's team is gone there) and builds without
   OpenMP start POSIX threads per call. */
#include "tf_fork.h"

int tf_attention_threading(void) {
#ifdef _OPENMP
    return !tf_forked;
#else
    return 0;
#endif
}

/* The keys row i of a sequence of qlen new tokens and kv keys sees (causal, within the window). */
static inline int64_t row_keys(int64_t kv, int64_t qlen, int64_t i, int64_t window) {
    const int64_t pos = kv - qlen + i;
    return pos + 1 - first_key(pos, window);
}

/* Returns 0 on success, 1 when memory could not be had, 2 when Hk does not divide Hq. window, softcap and sinks
   (NULL: none) as job_t's. */
int tf_paged_attention_f32(const float *q, int64_t q_row, const float *kc, const float *vc, float *out,
                           const int32_t *bt, int64_t bt_stride, const int32_t *cu, const int32_t *kv_lens, int64_t B,
                           int64_t Hq, int64_t Hk, int64_t D, int64_t BS, float scale, int64_t window, float softcap,
                           const float *sinks, int64_t max_q, int64_t threads) {
    if (Hq % Hk) return 2;
    int64_t max_kv = 0, work = 0, total = 0;
    /* Work per row: the keys it sees, +8; a sequence the kernel leaves to sdpa costs 1 (see the split below). */
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = cu[b + 1] - cu[b];
        if (kv_lens[b] > max_kv) max_kv = kv_lens[b];
        if (qlen > max_q)
            total += 1;
        else
            for (int64_t i = 0; i < qlen; i++) {
                const int64_t keys = row_keys(kv_lens[b], qlen, i, window);
                work += keys;
                total += keys + 8;
            }
    }
    job_t base = {q, kc, vc,    sinks,  out, bt, cu, kv_lens, bt_stride, q_row, B,       Hq, Hk,
                  D, BS, max_q, max_kv, 0,   0,  B,  0,       window,    scale, softcap, 0};
    const int64_t tasks = cu[B] > B ? cu[B] : B, enough = 1 + work * Hq * D / 200000; /* ~200k multiply-adds a thread */
    if (threads > enough) threads = enough;
    if (threads > tasks) threads = tasks;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        run_range(&base);
        return base.failed;
    }
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    /* Contiguous runs of rows with about equal work each (total, above). Not equal counts of sequences: the
       lengths of a batch differ by 10x and more, and a lone prompt's rows are split too, so that every thread has
       a share of it. */
    int64_t b = 0, i = 0, done = 0;
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].begin = b;
        jobs[t].row0 = i;
        const int64_t goal = t == threads - 1 ? total : total * (t + 1) / threads;
        while (b < B && done < goal) {
            const int64_t qlen = cu[b + 1] - cu[b];
            if (qlen > max_q || qlen <= 0) { /* not ours: past it whole */
                done += qlen > max_q ? 1 : 0;
                b++, i = 0;
                continue;
            }
            done += row_keys(kv_lens[b], qlen, i, window) + 8;
            if (++i == qlen) b++, i = 0;
        }
        jobs[t].end = b;
        jobs[t].row1 = i;
    }
#ifdef _OPENMP
    if (!tf_forked) { /* the process's OpenMP team (PyTorch's): awake from the ops around, no thread started */
#pragma omp parallel for schedule(static, 1) num_threads((int)threads)
        for (int64_t t = 0; t < threads; t++) run_range(&jobs[t]);
        int failed = 0;
        for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
        return failed;
    }
#endif
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, run_range, &jobs[t]) == 0;
    run_range(&jobs[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run_range(&jobs[t]); /* could not start it: do its share here */
    }
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed;
}
