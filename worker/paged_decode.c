/* Decode attention over a paged KV cache, read in place: the CPU kernel of
 * kvpool.worker.attention_cpu (built there with the system's C compiler, loaded with ctypes).
 *
 * One query token per row. Each (row, KV head) walks its row's block table, one cache block
 * at a time, and keeps an online softmax (running max, running sum, weighted sum of values)
 * for the query heads that share the KV head (grouped-query attention: query head i reads KV
 * head i / group). Nothing of the context is copied: K and V are read where they lie, so a
 * step costs what its rows' KV bytes cost to read. Rows and KV heads run on OpenMP threads.
 *
 * Layouts (all contiguous):
 *   q      [rows, heads, dim]                   float32
 *   k, v   [num_blocks, block_size, kv_heads, dim]  float32, or bfloat16 / float16 as uint16
 *   tables [rows, width] int32: each row's blocks, in order
 *   lens   [rows] int32: each row's context length (this step's token included)
 *   out    [rows, heads, dim] float32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One token's key or value for one KV head, as float32: the cache itself when it is float32,
 * else converted into ``buf`` (dim values, in the L1 cache). */
static inline const float *token_row(const void *cache, long at, int dim, int kind, float *buf) {
    if (kind == KV_F32) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
    if (kind == KV_BF16)
        for (int d = 0; d < dim; d++) buf[d] = bf16_to_f32(src[d]);
    else
        for (int d = 0; d < dim; d++) buf[d] = f16_to_f32(src[d]);
    return buf;
}

int kvpool_paged_decode(const float *q, const void *k, const void *v, int kind,
                        const int32_t *tables, const int32_t *lens, float *out, int rows,
                        int heads, int kv_heads, int dim, int block_size, int width,
                        int num_blocks, float scale, int threads) {
    if (rows <= 0) return 0;
    if (kv_heads <= 0 || heads <= 0 || dim <= 0 || block_size <= 0 || heads % kv_heads)
        return -1;
    for (int r = 0; r < rows; r++) { /* check every block id before reading any */
        int len = lens[r];
        if (len < 1 || len > width * block_size) return -2;
        int used = (len + block_size - 1) / block_size;
        for (int b = 0; b < used; b++)
            if (tables[(long)r * width + b] < 0 || tables[(long)r * width + b] >= num_blocks)
                return -3;
    }
    const int group = heads / kv_heads;
    const long token_stride = (long)kv_heads * dim, block_stride = token_stride * block_size;
    /* each task's scratch, on the heap (its size follows the model's shapes) */
    const size_t scratch = (size_t)group * (dim + 2 + block_size) + 2 * (size_t)dim;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < kv_heads; h++) {
            float *acc = malloc(scratch * sizeof(float));
            if (acc == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *best = acc + (size_t)group * dim, *total = best + group;
            float *scores = total + group, *kbuf = scores + (size_t)group * block_size;
            float *vbuf = kbuf + dim;
            const float *qh = q + ((long)r * heads + (long)h * group) * dim;
            for (int g = 0; g < group; g++) {
                best[g] = -INFINITY;
                total[g] = 0.0f;
            }
            memset(acc, 0, (size_t)group * dim * sizeof(float));
            const int len = lens[r], used = (len + block_size - 1) / block_size;
            for (int b = 0; b < used; b++) {
                const long base = tables[(long)r * width + b] * block_stride + (long)h * dim;
                const int n = b == used - 1 ? len - b * block_size : block_size;
                for (int t = 0; t < n; t++) {
                    const float *kt = token_row(k, base + t * token_stride, dim, kind, kbuf);
                    for (int g = 0; g < group; g++) {
                        const float *qg = qh + (long)g * dim;
                        float s = 0.0f;
                        for (int d = 0; d < dim; d++) s += qg[d] * kt[d];
                        scores[g * block_size + t] = s * scale;
                    }
                }
                for (int g = 0; g < group; g++) {
                    float m = best[g];
                    for (int t = 0; t < n; t++)
                        if (scores[g * block_size + t] > m) m = scores[g * block_size + t];
                    const float shrink = expf(best[g] - m); /* 0 at the first block */
                    total[g] *= shrink;
                    for (int d = 0; d < dim; d++) acc[g * dim + d] *= shrink;
                    best[g] = m;
                    for (int t = 0; t < n; t++)
                        scores[g * block_size + t] = expf(scores[g * block_size + t] - m);
                }
                for (int t = 0; t < n; t++) {
                    const float *vt = token_row(v, base + t * token_stride, dim, kind, vbuf);
                    for (int g = 0; g < group; g++) {
                        const float p = scores[g * block_size + t];
                        float *ag = acc + (long)g * dim;
                        total[g] += p;
                        for (int d = 0; d < dim; d++) ag[d] += p * vt[d];
                    }
                }
            }
            float *oh = out + ((long)r * heads + (long)h * group) * dim;
            for (int g = 0; g < group; g++)
                for (int d = 0; d < dim; d++) oh[g * dim + d] = acc[g * dim + d] / total[g];
            free(acc);
        }
    }
    return failed ? -4 : 0;
}
