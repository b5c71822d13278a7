/*
 * Fused fp32 CPU kernels of the serving path: paged attention (decode and chunked
 * prefill in one kernel), K/V store, rotary embedding, (residual-add +) RMSNorm, SiLU*mul.
 *
 * Compiled on first use by pagedserve/kernels/cpu_native.py (gcc -O3 -march=native
 * -fopenmp -ffp-contract=off) and called through ctypes; the torch reference
 * (kernels/reference.py, worker/layers.py) is the fallback and the ground truth.
 * OpenMP: the library links libgomp.so.1, which resolves to the copy torch has already
 * loaded, so these loops share torch's thread pool and its torch.set_num_threads value.
 *
 * Layouts (see pagedserve.kernels):
 *   caches  [num_blocks, block_size, num_kv_heads, head_dim], contiguous fp32;
 *   slot = block_id * block_size + offset; block_tables int32 [num_seqs, bt_stride];
 *   query head h reads KV head h / (num_heads / num_kv_heads) (GQA).
 *
 * The ideas are vLLM's CPU backend (csrc/cpu/attention.cpp: one task per (sequence,
 * KV head) reading each K/V row once for all query heads of the group;
 * csrc/cpu/layernorm.cpp: fused_add_rms_norm; pos_encoding.cpp: in-place rotary).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QTILE 16 /* query rows of one chunk processed per task (prefill) */
#define MAX_GROUP 64
#define VGROUP 8 /* query heads of a KV group accumulated together in pass 2 */

typedef float v16 __attribute__((vector_size(64)));

static inline v16 splat16(float a) {
    return (v16){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

/*
 * exp(x) for x in [-87, 88] (clamped), Cephes' expf: x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by a degree-6 polynomial, times 2^n built in the exponent bits; ~1-2 ulp.
 * Branch-free so `omp simd` loops calling it vectorize (glibc's expf would not).
 */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f;
    const int32_t n = (int32_t)(t + (t >= 0.0f ? 0.5f : -0.5f));
    const float fn = (float)n;
    float r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = (n + 127) << 23;
    return p * scale.f;
}

/*
 * Causal attention of ragged query chunks over the paged cache (decode = chunk of 1).
 * Chunk s has rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]; its query i sits at position
 * seq_lens[s] - q_len + i and attends keys 0 .. that position. Softmax in two passes
 * (scores, max, exp, sum, then the weighted V sum), as softmax(q k^T * scale) v.
 * q: [T, q_token_stride] fp32, head h at q + t*q_token_stride + h*head_dim.
 * out: [T, num_heads, head_dim] contiguous. num_threads: OpenMP threads (torch's count:
 * the calling thread's own OpenMP setting may differ, e.g. in a Ray actor's task thread).
 */
void paged_attention_f32(const float *q, int64_t q_token_stride, const float *k_cache,
                         const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *seq_lens, const int32_t *cu_seqlens_q, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, float *out, int64_t num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per token slot */
    /* tasks: (sequence, kv head, query tile) */
    int64_t *task_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    task_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        int64_t tiles = (q_len + QTILE - 1) / QTILE;
        task_start[s + 1] = task_start[s] + tiles * num_kv_heads;
    }
    const int64_t num_tasks = task_start[num_seqs];
    int64_t max_seq_len = 1; /* sizes the per-thread score scratch */
    for (int64_t s = 0; s < num_seqs; ++s)
        if (seq_lens[s] > max_seq_len) max_seq_len = seq_lens[s];
#pragma omp parallel if (num_tasks > 1) num_threads(num_threads > 0 ? num_threads : 1)
    {
        float *scores = (float *)malloc(sizeof(float) * QTILE * group * (max_seq_len + 1));
        float *acc = (float *)malloc(sizeof(float) * head_dim);
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            while (task_start[s + 1] <= task) ++s; /* tasks of a thread only increase */
            if (task < task_start[s]) {            /* restarted search (dynamic schedule) */
                s = 0;
                while (task_start[s + 1] <= task) ++s;
            }
            const int64_t local = task - task_start[s];
            const int64_t kvh = local % num_kv_heads;
            const int64_t tile = local / num_kv_heads;
            const int64_t q0 = cu_seqlens_q[s];
            const int64_t q_len = cu_seqlens_q[s + 1] - q0;
            const int64_t seq_len = seq_lens[s];
            const int64_t first = tile * QTILE;
            const int64_t rows = (q_len - first < QTILE) ? q_len - first : QTILE;
            const int64_t pos0 = seq_len - q_len + first; /* position of the tile's row 0 */
            int64_t n_keys = pos0 + rows; /* keys the last row sees */
            if (n_keys < 0) n_keys = 0;
            const int32_t *table = block_tables + s * bt_stride;
            /* pass 1: scores[r][g][j] */
            for (int64_t j = 0; j < n_keys; ++j) {
                const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
                const float *krow = k_cache + slot * row + kvh * head_dim;
                /* row r sees keys 0 .. pos0 + r */
                for (int64_t r = (j > pos0 ? j - pos0 : 0); r < rows; ++r) {
                    const float *qr = q + (q0 + first + r) * q_token_stride;
                    for (int64_t g = 0; g < group; ++g) {
                        const float *qh = qr + (kvh * group + g) * head_dim;
                        scores[(r * group + g) * n_keys + j] = dot(qh, krow, head_dim) * scale;
                    }
                }
            }
            /* softmax per (r, g) over keys 0..pos0+r */
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t len = pos0 + r + 1;
                if (len <= 0) continue; /* no keys (malformed chunk): pass 2 writes zeros */
                for (int64_t g = 0; g < group; ++g) {
                    float *sc = scores + (r * group + g) * n_keys;
                    float m = -INFINITY;
#pragma omp simd reduction(max : m)
                    for (int64_t j = 0; j < len; ++j) m = sc[j] > m ? sc[j] : m;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < len; ++j) {
                        sc[j] = exp_f32(sc[j] - m);
                        sum += sc[j];
                    }
                    const float inv = 1.0f / sum;
#pragma omp simd
                    for (int64_t j = 0; j < len; ++j) sc[j] *= inv;
                }
            }
            /* pass 2: out[r][g] = sum_j p[r][g][j] v_j, one 16-float slice of head_dim at a
             * time with up to VGROUP heads' accumulators in registers, so each V row is
             * read once per slice for the whole group (same operations per element, in
             * the same key order, as one head at a time) */
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t len = pos0 + r + 1;
                float *orow = out + ((q0 + first + r) * num_heads + kvh * group) * head_dim;
                for (int64_t g0 = 0; g0 < group; g0 += VGROUP) {
                    const int64_t gn = (group - g0) < VGROUP ? (group - g0) : VGROUP;
                    const float *p = scores + (r * group + g0) * n_keys;
                    int64_t d0 = 0;
                    for (; d0 + 16 <= head_dim; d0 += 16) {
                        v16 vacc[VGROUP];
                        for (int64_t g = 0; g < gn; ++g) vacc[g] = (v16){0};
                        for (int64_t j = 0; j < len; ++j) { /* len <= 0: no iterations */
                            const int64_t slot =
                                (int64_t)table[j / block_size] * block_size + j % block_size;
                            v16 v;
                            memcpy(&v, v_cache + slot * row + kvh * head_dim + d0, sizeof(v));
                            for (int64_t g = 0; g < gn; ++g)
                                vacc[g] = vacc[g] + splat16(p[g * n_keys + j]) * v;
                        }
                        for (int64_t g = 0; g < gn; ++g)
                            memcpy(orow + (g0 + g) * head_dim + d0, &vacc[g], sizeof(v16));
                    }
                    if (d0 < head_dim) { /* a head_dim that is not a multiple of 16 */
                        for (int64_t g = 0; g < gn; ++g) {
                            memset(acc, 0, sizeof(float) * head_dim);
                            for (int64_t j = 0; j < len; ++j) {
                                const int64_t slot =
                                    (int64_t)table[j / block_size] * block_size + j % block_size;
                                const float *vrow = v_cache + slot * row + kvh * head_dim;
                                const float w = p[g * n_keys + j];
                                for (int64_t d = d0; d < head_dim; ++d) acc[d] += w * vrow[d];
                            }
                            memcpy(orow + (g0 + g) * head_dim + d0, acc + d0,
                                   sizeof(float) * (head_dim - d0));
                        }
                    }
                }
            }
        }
        free(acc);
        free(scores);
    }
    free(task_start);
}

/*
 * Rotary embedding (rotate-half form) in place on the q and k heads of a fused qkv row,
 * then the K and V rows stored into their cache slots (slot < 0: not stored).
 * qkv: [T, qkv_stride] with q heads at 0, k heads at num_heads*head_dim, v heads after;
 * cos/sin tables: [max_positions, head_dim] fp32; positions int64 [T].
 * out = x*cos + rotate_half(x)*sin, rounded after each multiply and the add (no FMA), as
 * in HF transformers' apply_rotary_pos_emb.
 */
void rope_store_f32(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                    const float *sin_table, const int64_t *positions, const int64_t *slots,
                    float *k_cache, float *v_cache) {
    const int64_t half = head_dim / 2;
    const int64_t kv_row = num_kv_heads * head_dim;
#pragma omp parallel for if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        float *x = qkv + t * qkv_stride;
        const float *c = cos_table + positions[t] * head_dim;
        const float *sn = sin_table + positions[t] * head_dim;
        float tmp[512];
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
            float *v = x + h * head_dim;
            for (int64_t d = 0; d < half; ++d) {
                float a = v[d] * c[d];
                float b = -v[d + half] * sn[d];
                tmp[d] = a + b;
            }
            for (int64_t d = half; d < head_dim; ++d) {
                float a = v[d] * c[d];
                float b = v[d - half] * sn[d];
                tmp[d] = a + b;
            }
            memcpy(v, tmp, sizeof(float) * head_dim);
        }
        const int64_t slot = slots[t];
        if (slot >= 0) {
            memcpy(k_cache + slot * kv_row, x + num_heads * head_dim, sizeof(float) * kv_row);
            memcpy(v_cache + slot * kv_row, x + (num_heads + num_kv_heads) * head_dim,
                   sizeof(float) * kv_row);
        }
    }
}

/*
 * RMSNorm of each row: out = w * (x / sqrt(mean(x^2) + eps)). With residual != NULL the
 * residual is added first and the sum written back to residual (vLLM's
 * fused_add_rms_norm): residual += x; out = norm(residual).
 */
void rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                  int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for if (num_rows > 64)
    for (int64_t i = 0; i < num_rows; ++i) {
        const float *xi = x + i * hidden;
        float *oi = out + i * hidden;
        const float *src = xi;
        if (residual != NULL) {
            float *ri = residual + i * hidden;
#pragma omp simd
            for (int64_t d = 0; d < hidden; ++d) ri[d] = ri[d] + xi[d];
            src = ri;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < hidden; ++d) ss += src[d] * src[d];
        const float r = 1.0f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) oi[d] = weight[d] * (src[d] * r);
    }
}

/* out[i, d] = silu(x[i, d]) * x[i, inter + d] for x [num_rows, 2 * inter]. */
void silu_mul_f32(const float *x, float *out, int64_t num_rows, int64_t inter) {
#pragma omp parallel for if (num_rows > 16)
    for (int64_t i = 0; i < num_rows; ++i) {
        const float *g = x + i * 2 * inter;
        const float *u = g + inter;
        float *o = out + i * inter;
#pragma omp simd
        for (int64_t d = 0; d < inter; ++d) {
            const float s = g[d] / (1.0f + exp_f32(-g[d]));
            o[d] = s * u[d];
        }
    }
}
