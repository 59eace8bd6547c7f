/* GeGLU's gated activation in fp32 (launcher: tightfit.kernels.gelu_mul).
     tf_gelu_tanh_mul_f32   out[t, i] = gelu_tanh(x[t, i]) * x[t, I + i]   (out is T x I, contiguous)
   Contract: rows of x lie x_stride floats apart and do not overlap out; `threads` bounds the threads a call may
   use; a row's result does not depend on it. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include "tf_fork.h"

/* Calls of PARALLEL_MIN elements a thread or more split their rows over PyTorch's OpenMP team (where the library
   is built with it, tightfit.kernels.native); decode steps, forked children and builds without OpenMP run on the
   calling thread. A row is computed the same way either way. */
#define PARALLEL_MIN 16384

/* out[t, i] = gelu_tanh(x[t, i]) * x[t, I + i]; rows of x are x_stride apart. */
static void gelu_mul_rows(const float *x, int64_t x_stride, float *out, int64_t t0, int64_t t1, int64_t I) {
    const float k = 1.5957691216057308f; /* 2 * sqrt(2 / pi) */
    for (int64_t t = t0; t < t1; t++) {
        const float *g = x + t * x_stride, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float v = g[i], e = -k * (v + 0.044715f * v * v * v);
            /* capped below expf's overflow: built with -ffast-math, an infinity is not handled (the result is
               x / 5.5e34 there, 0 in fp32 terms for every x that reaches it) */
            o[i] = v / (1.f + expf(e < 80.f ? e : 80.f)) * u[i];
        }
    }
}

void tf_gelu_tanh_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t I, int64_t threads) {
    int64_t n = T * I / PARALLEL_MIN;
    if (n > threads) n = threads;
    if (n > T) n = T;
#ifdef _OPENMP
    if (n > 1 && !tf_forked) {
#pragma omp parallel for schedule(static, 1) num_threads((int)n)
        for (int64_t r = 0; r < n; r++) gelu_mul_rows(x, x_stride, out, T * r / n, T * (r + 1) / n, I);
        return;
    }
#endif
    gelu_mul_rows(x, x_stride, out, 0, T, I);
}
