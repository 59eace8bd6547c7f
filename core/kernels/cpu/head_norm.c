/* Per-head RMSNorm of queries and keys in place, fp32 (launcher: tightfit.kernels.head_norm).
     tf_rms_norm_heads_f32   x[t, h] <- x[t, h] / sqrt(mean(x[t, h]^2) + eps) * (offset + w)
   with w = w1 for heads h < split and w2 for the rest (queries, then keys, in a fused QKV output). Contract:
   T tokens t_stride floats apart, each H heads of D contiguous floats; one thread. */
#include <math.h>
#include <stdint.h>

/* x: T tokens t_stride floats apart, each H heads of D contiguous floats; heads < split take w1, the rest w2. */
void tf_rms_norm_heads_f32(float *x, int64_t t_stride, int64_t T, int64_t H, int64_t D, int64_t split, const float *w1,
                           const float *w2, float eps, float offset) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            float *r = x + t * t_stride + h * D, ss = 0.f;
            const float *w = h < split ? w1 : w2;
            for (int64_t i = 0; i < D; i++) ss += r[i] * r[i];
            const float inv = 1.f / sqrtf(ss / (float)D + eps);
            for (int64_t i = 0; i < D; i++) r[i] = r[i] * inv * (offset + w[i]);
        }
}
