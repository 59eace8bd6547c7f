/* Fused element-wise ops of a decoder block in fp32 (launchers: tightfit.kernels.elementwise).
     tf_silu_mul_f32   out[t, i] = silu(x[t, i]) * x[t, I + i]                (SwiGLU; out is T x I, contiguous)
     tf_rms_norm_f32   out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w         (w NULL: no weight; out is T x N)
     tf_rotary_f32     x[t, h] <- x * cos[t] + rotate_half(x) * sin[t]     (in place; rotate_half as in HF)
   Contract: the launcher has checked shapes and dtypes; rows of x lie x_stride (x_row, x_head) floats apart and do
   not overlap out; `threads` bounds the threads a call may use. Each row is computed the same way on any number of
   threads, so results do not depend on it. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include "tf_fork.h"

/* Rows of a call are split over PyTorch's OpenMP team where the library is built with it (tightfit.kernels.native)
   and the call has PARALLEL_MIN elements a thread at least; smaller calls (decode steps), forked children and builds
   without OpenMP run on the calling thread. Each row is computed the same way either way. */
#define PARALLEL_MIN 16384
static int64_t team(int64_t threads, int64_t elements) {
    const int64_t most = elements / PARALLEL_MIN;
#ifdef _OPENMP
    if (tf_forked) return 1;
#else
    return 1;
#endif
    return threads < most ? threads : most < 1 ? 1 : most;
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i]; rows of x are x_stride apart. */
static void silu_mul_rows(const float *x, int64_t x_stride, float *out, int64_t t0, int64_t t1, int64_t I) {
    for (int64_t t = t0; t < t1; t++) {
        const float *g = x + t * x_stride, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w (w may be NULL); rows of x are x_stride apart. */
static void rms_norm_rows(const float *x, int64_t x_stride, const float *w, float *out, int64_t t0, int64_t t1,
                          int64_t N, float eps) {
    for (int64_t t = t0; t < t1; t++) {
        const float *r = x + t * x_stride;
        float *o = out + t * N, ss = 0.f;
        for (int64_t i = 0; i < N; i++) ss += r[i] * r[i];
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
        if (w)
            for (int64_t i = 0; i < N; i++) o[i] = r[i] * inv * w[i];
        else
            for (int64_t i = 0; i < N; i++) o[i] = r[i] * inv;
    }
}

/* x[t, h, :] <- x * cos[t] + rotate_half(x) * sin[t], in place; rotate_half(x) = (-x[D/2:], x[:D/2]). */
static void rotary_rows(float *x, int64_t x_row, int64_t x_head, const float *cos, const float *sin, int64_t cs_row,
                        int64_t t0, int64_t t1, int64_t H, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (int64_t h = 0; h < H; h++) {
            float *v = x + t * x_row + h * x_head;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* Runs BODY(t0, t1) over rows [0, T) in n contiguous runs, on the OpenMP team where n > 1. */
#ifdef _OPENMP
#define OVER_ROWS(T, n, BODY)                                                                                       \
    do {                                                                                                            \
        if ((n) > 1) {                                                                                              \
            _Pragma("omp parallel for schedule(static, 1) num_threads((int)(n))") for (int64_t k = 0; k < (n); k++) \
                BODY((T) * k / (n), (T) * (k + 1) / (n));                                                           \
        } else                                                                                                      \
            BODY(0, (T));                                                                                           \
    } while (0)
#else
#define OVER_ROWS(T, n, BODY) \
    do {                      \
        (void)(n);            \
        BODY(0, (T));         \
    } while (0)
#endif

void tf_silu_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t I, int64_t threads) {
    const int64_t n = team(threads, T * I);
#define SILU(a, b) silu_mul_rows(x, x_stride, out, a, b, I)
    OVER_ROWS(T, n, SILU);
}

void tf_rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t T, int64_t N, float eps,
                     int64_t threads) {
    const int64_t n = team(threads, T * N);
#define RMS(a, b) rms_norm_rows(x, x_stride, w, out, a, b, N, eps)
    OVER_ROWS(T, n, RMS);
}

void tf_rotary_f32(float *x, int64_t x_row, int64_t x_head, const float *cos, const float *sin, int64_t cs_row,
                   int64_t T, int64_t H, int64_t D, int64_t threads) {
    const int64_t n = team(threads, T * H * D);
#define ROT(a, b) rotary_rows(x, x_row, x_head, cos, sin, cs_row, a, b, H, D)
    OVER_ROWS(T, n, ROT);
}
