/* Gumbel-max sampling with counter-based noise in fp32 (launcher: tightfit.kernels.gumbel).
     tf_gumbel_argmax_f32   out[b] = argmax_j scores[b, j] - log(-log(u(seeds[b], positions[b], j)))
   u(seed, position, column) is a 31-bit integer hash mapped to (k + 1/2) / 2^23, the same uniforms as the PyTorch
   reference's; the logs are the C library's, so a draw can differ from the reference's only where two columns'
   noisy scores tie to the last bit. Contract: rows of scores lie `stride` floats apart; `work` holds V floats of
   scratch; a NaN score is the maximum, as in PyTorch. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define M31 0x7FFFFFFFu

static inline uint32_t mix(uint32_t x) {
    x = ((x ^ (x >> 16)) * 0x45D9F3Bu) & M31;
    x = ((x ^ (x >> 16)) * 0x45D9F3Bu) & M31;
    return x ^ (x >> 16);
}

/* out[b] = the first j maximising scores[b, j] - log(-log(u[b, j])) (a NaN is the maximum, as in PyTorch);
   rows of scores are stride apart; work holds V floats. */
void tf_gumbel_argmax_f32(const float *scores, int64_t stride, const int64_t *seeds, const int64_t *positions,
                          int64_t B, int64_t V, float *work, int64_t *out) {
    for (int64_t b = 0; b < B; b++) {
        const uint64_t s = (uint64_t)seeds[b];
        uint32_t key = mix((uint32_t)((s ^ (s >> 31)) & M31));
        key = mix(key ^ mix(((uint32_t)positions[b] * 0x2545F491u) & M31));
        const float *r = scores + b * stride;
        for (int64_t j = 0; j < V; j++) {
            const uint32_t col = ((uint32_t)j * 0x9E3779B1u) & M31;
            const uint32_t x = mix(mix((key ^ col) & M31) ^ key);
            const float u = ((float)(x >> 8) + 0.5f) * 0x1p-23f;
            work[j] = r[j] - logf(-logf(u));
        }
        int64_t best = 0;
        float top = work[0];
        for (int64_t j = 0; j < V; j++) {
            uint32_t bits;
            memcpy(&bits, work + j, 4);
            if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
                best = j;
                break;
            } /* NaN */
            if (work[j] > top) {
                top = work[j];
                best = j;
            }
        }
        out[b] = best;
    }
}
