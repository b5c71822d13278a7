/*
 * Fused fp32 CPU kernels of the serving path: paged attention (decode and chunked
 * prefill in one kernel), K/V store, rotary embedding, (residual-add +) RMSNorm, SiLU*mul.
 * Attention and the K/V store also come for bf16 KV caches (the *_bf16kv entry points) and
 * fp8 e4m3fn ones (*_fp8kv): queries, scores, softmax and sums stay fp32, a bf16 or fp8 K/V
 * element is widened to fp32 in registers (exact), and rope_store rounds K/V to bf16
 * (nearest even), or quantises x / scale to fp8 (saturated to +-448, nearest even), when it
 * stores them. An fp8 cache's per-tensor k_scale folds into the softmax scale and its
 * v_scale multiplies the output. int8 caches (*_int8kv) hold each (slot, KV head) as
 * head_dim int8 elements followed by its fp32 scale (absmax / 127, stored by rope_store):
 * an element reads as (float)q * scale, in registers.
 *
 * Compiled on first use by pagedserve/kernels/cpu_native.py (gcc -O3 -march=native
 * -fopenmp -ffp-contract=off) and called through ctypes; the torch reference
 * (pagedserve/kernels/reference.py, worker/layers.py) is the fallback and the ground truth.
 * OpenMP: the library links libgomp.so.1, which resolves to the copy torch has already
 * loaded, so these loops share torch's thread pool and its torch.set_num_threads value.
 *
 * Layouts (see pagedserve.kernels):
 *   caches  [num_blocks, block_size, num_kv_heads, head_dim], contiguous fp32 or bf16;
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

#include "cpu_common.h"

#define QTILE 16 /* query rows of one chunk processed per task (prefill) */
#define VGROUP 8  /* query heads of a KV group accumulated together in pass 2 */
#define MIN_TASKS_PER_THREAD 4 /* below this, a KV group's query heads become separate tasks */
#define PREFETCH_KEYS 16      /* how far ahead pass 1 prefetches K rows */

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16sb __attribute__((vector_size(16)));
typedef int16_t v16s __attribute__((vector_size(32)));
typedef uint16_t v16us __attribute__((vector_size(32)));

static inline v16 splat16(float a) {
    return (v16){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
}

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof(v)); }

/* Lane-wise mask ? a : b, for a mask from a vector comparison (all ones or all zeros). */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/*
 * KV cache elements, by kvt: KV_F32, KV_BF16 (the top 16 bits of an fp32) or KV_FP8
 * (e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff NaN) or KV_INT8
 * (int8, times the head's scale: kv_scale_at). The attention
 * code below takes `const int kvt` and is always inlined into one entry point per element
 * type with a constant there, so each entry point compiles to straight-line loads of its
 * type; with KV_F32 the operations are exactly the fp32-only kernel's.
 */
#define KV_F32 0
#define KV_BF16 1
#define KV_FP8 2
#define KV_INT8 3 /* int8 elements; each head's D of them followed by its fp32 scale */

static inline const void *kv_elem(const void *base, int64_t i, const int kvt) {
    return (const char *)base + i * (kvt == KV_F32 ? 4 : (kvt == KV_BF16 ? 2 : 1));
}

/* 16 e4m3fn bytes as fp32, exactly: exponent >= 1 rebased from bias 7 to 127 in the
 * integer bits, exponent 0 as mantissa * 2^-9 (no float op on a denormal), NaN kept. */
static inline v16 fp8_widen16(v16b b) {
    /* bytes -> 16 bits -> 32 bits: gcc 12 turns a direct 8 -> 32-bit vector conversion
     * into 16 scalar ones, the two steps into vpmovzxbw + vpmovzxwd (the same values) */
    const v16i x = __builtin_convertvector(__builtin_convertvector(b, v16us), v16i);
    const v16i em = x & 0x7f;
    const v16 normal = (v16)((em << 20) + (120 << 23));
    const v16 sub = __builtin_convertvector(em, v16) * splat16(0x1p-9f);
    v16 v = select16(em < 8, sub, normal);
    v = select16(em == 0x7f, splat16(NAN), v);
    return (v16)((v16i)v | ((x & 0x80) << 24));
}

static inline float fp8_widen1(uint8_t b) {
    const uint32_t em = b & 0x7fu;
    float f;
    if (em == 0x7fu) {
        f = NAN;
    } else if (em < 8u) {
        f = (float)em * 0x1p-9f;
    } else {
        const uint32_t bits = (em << 20) + (120u << 23);
        memcpy(&f, &bits, sizeof(f));
    }
    return (b & 0x80u) ? -f : f;
}

/* fp32 x / scale -> e4m3fn bits: saturated to +-448, round to nearest even, NaN -> 0x7f
 * with its sign; torch's (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn). Below 2^-6
 * the result is a multiple of 2^-9, rounded by the fp32 add/subtract of 2^23; from 2^-6 up
 * the mantissa is rounded to 3 bits on the integer bits and the exponent rebased to 7. */
static inline uint8_t f32_to_fp8(float x, float scale) {
    const float y = x / scale;
    uint32_t u;
    memcpy(&u, &y, sizeof(u));
    const uint32_t sign = (u >> 24) & 0x80u;
    if (y != y) return (uint8_t)(sign | 0x7fu);
    float a = fabsf(y);
    a = a < 448.0f ? a : 448.0f;
    uint32_t mag;
    if (a < 0x1p-6f) {
        mag = (uint32_t)((a * 512.0f + 8388608.0f) - 8388608.0f);
    } else {
        uint32_t b;
        memcpy(&b, &a, sizeof(b));
        const uint32_t r = b + 0x7ffffu + ((b >> 20) & 1u);
        mag = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
    }
    return (uint8_t)(sign | mag);
}

/* Elements p[i .. i+16) as fp32 (bf16 widened exactly: its bits << 16; fp8 as above). */
static inline v16 kv_load16(const void *p, int64_t i, const int kvt) {
    if (kvt == KV_BF16) {
        v16h h;
        memcpy(&h, kv_elem(p, i, kvt), sizeof(h));
        return (v16)(__builtin_convertvector(h, v16i) << 16);
    }
    if (kvt == KV_FP8) {
        v16b b;
        memcpy(&b, kv_elem(p, i, kvt), sizeof(b));
        return fp8_widen16(b);
    }
    if (kvt == KV_INT8) { /* unscaled: the caller multiplies by kv_scale_at */
        v16sb b;
        memcpy(&b, kv_elem(p, i, kvt), sizeof(b));
        /* via 16 and 32 bits, as fp8_widen16 (a direct conversion is scalar in gcc 12) */
        const v16i x = __builtin_convertvector(__builtin_convertvector(b, v16s), v16i);
        return __builtin_convertvector(x, v16);
    }
    return load16((const float *)p + i);
}

/* The fp32 scale of an int8 head vector, off bytes from p (1 for the other types). */
static inline float kv_scale_at(const void *p, int64_t off, const int kvt) {
    if (kvt != KV_INT8) return 1.0f;
    float sc;
    memcpy(&sc, (const char *)p + off, sizeof(sc));
    return sc;
}

static inline float kv_load1(const void *p, int64_t i, const int kvt) {
    if (kvt == KV_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof(f));
        return f;
    }
    if (kvt == KV_FP8) return fp8_widen1(((const uint8_t *)p)[i]);
    if (kvt == KV_INT8) return (float)((const int8_t *)p)[i];
    return ((const float *)p)[i];
}

/* KV elements per 64-byte cache line: the step of the prefetch loops. */
#define KV_LINE(kvt) ((kvt) == KV_F32 ? 16 : ((kvt) == KV_BF16 ? 32 : 64))

/* fp32 -> bf16, round to nearest even, NaN -> 0x7fc0: c10::BFloat16's
 * round_to_nearest_even, the bits of torch's x.to(torch.bfloat16). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7fc0 : rounded;
}

/* Sum of the 16 lanes as a fixed tree: (i + i+8), then + i+4, then pairs. */
static inline float hsum16(v16 v) {
    v8 lo, hi;
    memcpy(&lo, &v, sizeof(lo));
    memcpy(&hi, (const char *)&v + sizeof(lo), sizeof(hi));
    const v8 s8 = lo + hi;
    v4 l4, h4;
    memcpy(&l4, &s8, sizeof(l4));
    memcpy(&h4, (const char *)&s8 + sizeof(l4), sizeof(h4));
    const v4 s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

/* Lane i: q . k[i] for 16 key rows, head_dim a positive multiple of 16. Per key: lane l
 * of a partial sums q[d] k[d] over d = l (mod 16) in order, then transpose_sum16. */
static inline v16 dot16x16(const float *q, const float *const *k, int64_t head_dim) {
    v16 part[16];
    for (int i = 0; i < 16; ++i) {
        v16 acc = load16(q) * load16(k[i]);
        for (int64_t d = 16; d < head_dim; d += 16) acc = acc + load16(q + d) * load16(k[i] + d);
        part[i] = acc;
    }
    return transpose_sum16(part);
}

/* dot16x16 for gn query heads at once (head g at q + g * 16 * ns), head_dim = 16 * ns with
 * gn * ns <= 16: the heads' query vectors stay in registers and each K row is loaded once
 * for all of them (dot16x16 loads q and k per product: twice the loads, and pass 1 of a
 * prefill is bound by them). Per (head, key) the same operations in the same order as
 * dot16x16: the same bits. gn and ns are compile-time constants at every call site. */
static inline __attribute__((always_inline)) void dot16x16_heads(const int gn, const int ns,
                                                                 const float *q,
                                                                 const float *const *k,
                                                                 v16 *res) {
    v16 qv[4][8];
    for (int g = 0; g < gn; ++g)
        for (int s = 0; s < ns; ++s) qv[g][s] = load16(q + (g * ns + s) * 16);
    v16 part[4][16];
    for (int i = 0; i < 16; ++i) {
        v16 kv[8];
        for (int s = 0; s < ns; ++s) kv[s] = load16(k[i] + 16 * s);
        for (int g = 0; g < gn; ++g) {
            v16 acc = qv[g][0] * kv[0];
            for (int s = 1; s < ns; ++s) acc = acc + qv[g][s] * kv[s];
            part[g][i] = acc;
        }
    }
    for (int g = 0; g < gn; ++g) res[g] = transpose_sum16(part[g]);
}

/*
 * exp(x) for x in [-87, 88] (clamped), Cephes' expf: x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by a degree-6 polynomial, times 2^n built in the exponent bits; ~1-2 ulp.
 * exp16 below is the same computation on 16 lanes, operation for operation (the build
 * has no FMA contraction), so both give the same bits for the same input.
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
    const int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale)); /* 2^n */
    return p * scale;
}

static inline v16 exp16(v16 x) {
    x = select16(x < splat16(-87.0f), splat16(-87.0f), x);
    x = select16(x > splat16(88.0f), splat16(88.0f), x);
    const v16 t = x * splat16(1.44269504088896341f);
    const v16i n = __builtin_convertvector(
        t + select16(t >= splat16(0.0f), splat16(0.5f), splat16(-0.5f)), v16i);
    const v16 fn = __builtin_convertvector(n, v16);
    v16 r = x - fn * splat16(0.693359375f);
    r = r - fn * splat16(-2.12194440e-4f);
    v16 p = splat16(1.9875691500e-4f);
    p = p * r + splat16(1.3981999507e-3f);
    p = p * r + splat16(8.3334519073e-3f);
    p = p * r + splat16(4.1665795894e-2f);
    p = p * r + splat16(1.6666665459e-1f);
    p = p * r + splat16(5.0000001201e-1f);
    p = p * r * r + r + splat16(1.0f);
    const v16i bits = (n + 127) << 23;
    return p * (v16)bits;
}

/* In place: sc[j] = exp(sc[j] - max) / sum over j < len (len >= 1). */
static void softmax_inplace(float *sc, int64_t len) {
    v16 vmax = splat16(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
        const v16 v = load16(sc + j);
        vmax = select16(v > vmax, v, vmax);
    }
    float m = -INFINITY;
    for (int i = 0; i < 16; ++i) m = vmax[i] > m ? vmax[i] : m;
    for (; j < len; ++j) m = sc[j] > m ? sc[j] : m;
    v16 vsum = splat16(0.0f);
    j = 0;
    for (; j + 16 <= len; j += 16) {
        const v16 e = exp16(load16(sc + j) - splat16(m));
        store16(sc + j, e);
        vsum = vsum + e;
    }
    float sum = hsum16(vsum);
    for (; j < len; ++j) {
        sc[j] = exp_f32(sc[j] - m);
        sum += sc[j];
    }
    const float inv = 1.0f / sum;
    for (j = 0; j < len; ++j) sc[j] *= inv;
}

/* acc[g] = sum over keys j < len (in order) of p[g * p_stride + j] * V_j[0:16], for gn
 * query heads at once, V_j read through the block table; written to out + g * head_dim.
 * gn is a compile-time constant at each call site, so the accumulators stay in registers.
 */
static inline __attribute__((always_inline)) void pv_slice(
    const int gn, const float *p, int64_t p_stride, int64_t len, const void *v_base,
    const int32_t *table, int64_t block_size, int64_t row, float *out, int64_t head_dim,
    const int kvt, int64_t sc_off) {
    v16 acc[VGROUP];
    for (int g = 0; g < gn; ++g) acc[g] = splat16(0.0f);
    for (int64_t b = 0, j0 = 0; j0 < len; ++b, j0 += block_size) {
        const void *vb = kv_elem(v_base, (int64_t)table[b] * block_size * row, kvt);
        const int64_t jn = (len - j0) < block_size ? (len - j0) : block_size;
        for (int64_t o = 0; o < jn; ++o) {
            v16 v = kv_load16(vb, o * row, kvt);
            if (kvt == KV_INT8) v = v * splat16(kv_scale_at(vb, o * row + sc_off, kvt));
            for (int g = 0; g < gn; ++g)
                acc[g] = acc[g] + splat16(p[g * p_stride + j0 + o]) * v;
        }
    }
    for (int g = 0; g < gn; ++g) store16(out + g * head_dim, acc[g]);
}

/* pv_slice over the whole head for head_dim = 16 * ns, for nr consecutive query rows of a
 * tile at once (row r sees keys < len + r; its weights at p + r * p_row, its output at
 * out + r * out_row): each V row is read once for all its slices, the task's gn heads and
 * the nr rows (nr * gn * ns <= 24 accumulators in registers), and the rows pf_blocks
 * blocks ahead are prefetched. The same operations per output element, in the same key
 * order, as pv_slice: the same bits. nr, gn and ns are compile-time constants at every
 * call site. */
static inline __attribute__((always_inline)) void pv_rows(
    const int nr, const int gn, const int ns, const float *p, int64_t p_stride, int64_t p_row,
    int64_t len, const void *v_base, const int32_t *table, int64_t block_size, int64_t row,
    int64_t pf_blocks, float *out, int64_t out_row, int64_t head_dim, const int kvt) {
    v16 acc[2][6][8];
    for (int r = 0; r < nr; ++r)
        for (int g = 0; g < gn; ++g)
            for (int s = 0; s < ns; ++s) acc[r][g][s] = splat16(0.0f);
    const int64_t last = len + nr - 1; /* keys the last row sees */
    for (int64_t b = 0, j0 = 0; j0 < last; ++b, j0 += block_size) {
        const void *vb = kv_elem(v_base, (int64_t)table[b] * block_size * row, kvt);
        const void *vn =
            j0 + pf_blocks * block_size < last
                ? kv_elem(v_base, (int64_t)table[b + pf_blocks] * block_size * row, kvt)
                : NULL;
        const int64_t jn = (last - j0) < block_size ? (last - j0) : block_size;
        for (int64_t o = 0; o < jn; ++o) {
            if (vn != NULL)
                for (int s = 0; s < ns; s += KV_LINE(kvt) / 16)
                    __builtin_prefetch(kv_elem(vn, o * row + 16 * s, kvt), 0, 3);
            v16 v[8];
            for (int s = 0; s < ns; ++s) v[s] = kv_load16(vb, o * row + 16 * s, kvt);
            if (kvt == KV_INT8) {
                const v16 sc = splat16(kv_scale_at(vb, o * row + head_dim, kvt));
                for (int s = 0; s < ns; ++s) v[s] = v[s] * sc;
            }
            for (int r = 0; r < nr; ++r) {
                if (r < nr - 1 && j0 + o >= len + r) continue; /* the last row sees them all */
                for (int g = 0; g < gn; ++g) {
                    const v16 w = splat16(p[r * p_row + g * p_stride + j0 + o]);
                    for (int s = 0; s < ns; ++s) acc[r][g][s] = acc[r][g][s] + w * v[s];
                }
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int g = 0; g < gn; ++g)
            for (int s = 0; s < ns; ++s)
                store16(out + r * out_row + g * head_dim + 16 * s, acc[r][g][s]);
}

/*
 * Causal attention of ragged query chunks over the paged cache (decode = chunk of 1).
 * Chunk s has rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]; its query i sits at position
 * seq_lens[s] - q_len + i and attends keys 0 .. that position. Softmax in two passes
 * (scores, max, exp, sum, then the weighted V sum), as softmax(q k^T * scale) v.
 * q: [T, q_token_stride] fp32, head h at q + t*q_token_stride + h*head_dim.
 * out: [T, num_heads, head_dim] contiguous. num_threads: OpenMP threads (torch's count:
 * the calling thread's own OpenMP setting may differ, e.g. in a Ray actor's task thread).
 *
 * Tasks are (sequence, KV head, tile of QTILE query rows, subgroup of the KV head's query
 * heads). The query heads of a group are split into subgroups only when there would
 * otherwise be fewer than MIN_TASKS_PER_THREAD tasks per thread (a decode of one sequence
 * with 3 KV heads is 3 tasks: 2 : 1 on 2 threads). Every query head's result is computed
 * by the same operations whatever its task holds, so the split changes no bits and a
 * sequence's output does not depend on the rest of the batch.
 *
 * k_cache, v_cache: KV_F32, KV_BF16, KV_FP8 or KV_INT8 elements (kvt); see kv_load16.
 * KV_INT8 slots are num_kv_heads * (head_dim + 4) bytes (each head's scale after it).
 * Only the chunks with take_lo <= q_len < take_hi (the others' rows are left untouched).
 */
static inline __attribute__((always_inline)) void paged_attention_kv(
    const float *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *out, int64_t num_threads,
    const int kvt, int64_t take_lo, int64_t take_hi) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t hstride = kvt == KV_INT8 ? head_dim + 4 : head_dim; /* elements per head */
    const int64_t row = num_kv_heads * hstride; /* elements per token slot */
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    int64_t *task_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    int64_t base_tasks = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        if (q_len < take_lo || q_len >= take_hi) continue;
        base_tasks += (q_len + QTILE - 1) / QTILE * num_kv_heads;
    }
    int64_t sub = group; /* query heads per task */
    if (base_tasks < MIN_TASKS_PER_THREAD * threads && group > 1) {
        int64_t splits = (MIN_TASKS_PER_THREAD * threads + base_tasks - 1) /
                         (base_tasks > 0 ? base_tasks : 1);
        splits = splits < group ? splits : group;
        sub = (group + splits - 1) / splits;
    }
    const int64_t splits = (group + sub - 1) / sub;
    task_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        const int64_t tiles =
            q_len < take_lo || q_len >= take_hi ? 0 : (q_len + QTILE - 1) / QTILE;
        task_start[s + 1] = task_start[s] + tiles * num_kv_heads * splits;
    }
    const int64_t num_tasks = task_start[num_seqs];
    int64_t max_seq_len = 1; /* sizes the per-thread score scratch */
    for (int64_t s = 0; s < num_seqs; ++s)
        if (task_start[s + 1] > task_start[s] && seq_lens[s] > max_seq_len)
            max_seq_len = seq_lens[s];
    const int vec = head_dim % 16 == 0;
    const int64_t pf_blocks = (PREFETCH_KEYS + block_size - 1) / block_size;
    /* head_dim in 16-float slices for the whole-row pass-2 paths (pv_rows), else 0 */
    const int64_t ns = (head_dim == 64 || head_dim == 128) ? head_dim / 16 : 0;
#pragma omp parallel if (num_tasks > 1) num_threads(threads)
    {
        float *scores = (float *)malloc(sizeof(float) * QTILE * sub * (max_seq_len + 1));
        float *acc = (float *)malloc(sizeof(float) * head_dim);
        /* bf16, fp8, int8: the 16 K rows of a key group widened once for all the task's query rows */
        float *kwide = kvt ? (float *)malloc(sizeof(float) * 16 * head_dim) : NULL;
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            const attn_task_t at = attn_task(task_start, task, &s, splits, sub, group,
                                             num_kv_heads, cu_seqlens_q, seq_lens, QTILE);
            const int64_t g_lo = at.h.g_lo, gs = at.h.gs, kvh = at.h.kvh, q0 = at.q.q0;
            const int64_t first = at.q.first, rows = at.q.rows, pos0 = at.q.pos0;
            const int64_t n_keys = at.q.n_keys;
            const int32_t *table = block_tables + s * bt_stride;
            const float *q_head0 = q + (q0 + first) * q_token_stride + (kvh * group + g_lo) * head_dim;
            /* pass 1: scores[r][g][j] for the task's heads g < gs. Keys go in groups of
             * 16 (the last group padded with its last row), walking the block table: each
             * score is the same operations whatever group it falls in, so a query's
             * scores do not depend on the batch, the tile or the split of heads. Rows
             * that do not see a key get a score they never read. K rows PREFETCH_KEYS
             * keys ahead are prefetched (one KV head's rows are strided in the cache, and
             * a row missed is a stall), and V rows of the first blocks for pass 2. */
            const void *krows[16];
            const int64_t k_off = kvh * hstride;
            int64_t cb = 0, co = 0;                          /* current key: block, offset */
            int64_t pb = pf_blocks, po = 0, pj = pf_blocks * block_size; /* prefetch walker */
            for (int64_t j = 0; j < n_keys;) {
                int cnt = 0;
                for (; cnt < 16 && j + cnt < n_keys; ++cnt) {
                    const int64_t slot = (int64_t)table[cb] * block_size + co;
                    krows[cnt] = kv_elem(k_cache, slot * row + k_off, kvt);
                    if (pj < n_keys) {
                        const int64_t kp = ((int64_t)table[pb] * block_size + po) * row + k_off;
                        for (int64_t l = 0; l < head_dim; l += KV_LINE(kvt))
                            __builtin_prefetch(kv_elem(k_cache, kp + l, kvt), 0, 3);
                        ++pj;
                        if (++po == block_size) {
                            po = 0;
                            ++pb;
                        }
                    }
                    if (ns == 0 || cb < pf_blocks)
                        for (int64_t l = 0; l < head_dim; l += KV_LINE(kvt))
                            __builtin_prefetch(kv_elem(v_cache, slot * row + k_off + l, kvt), 0, 3);
                    if (++co == block_size) {
                        co = 0;
                        ++cb;
                    }
                }
                for (int c = cnt; c < 16; ++c) krows[c] = krows[cnt - 1];
                if (kvt) { /* exact: the same scores as the fp32 kernel on the fp32 rows */
                    for (int c = 0; c < 16; ++c) {
                        float *w = kwide + c * head_dim;
                        int64_t d = 0;
                        for (; d + 16 <= head_dim; d += 16) store16(w + d, kv_load16(krows[c], d, kvt));
                        for (; d < head_dim; ++d) w[d] = kv_load1(krows[c], d, kvt);
                        if (kvt == KV_INT8) {
                            const float ks = kv_scale_at(krows[c], head_dim, kvt);
                            for (d = 0; d < head_dim; ++d) w[d] = w[d] * ks;
                        }
                        krows[c] = w;
                    }
                }
                /* row r sees keys 0 .. pos0 + r */
                for (int64_t r = (j > pos0 ? j - pos0 : 0); r < rows; ++r) {
                    const float *qr = q_head0 + r * q_token_stride;
                    float *sr = scores + r * gs * n_keys + j;
                    int64_t g = 0;
                    if (ns == 4 || ns == 8) { /* up to 4 (head_dim 64) or 2 (128) heads a call */
                        const int64_t gmax = ns == 4 ? 4 : 2;
                        for (; g < gs; g += gmax) {
                            const int64_t gn = (gs - g) < gmax ? (gs - g) : gmax;
                            v16 sc[4];
                            const float *qg = qr + g * head_dim;
                            const float *const *kr = (const float *const *)krows;
#define DH(G, S) dot16x16_heads(G, S, qg, kr, sc)
                            if (ns == 4) {
                                switch (gn) {
                                case 1: DH(1, 4); break;
                                case 2: DH(2, 4); break;
                                case 3: DH(3, 4); break;
                                default: DH(4, 4); break;
                                }
                            } else if (gn == 1) {
                                DH(1, 8);
                            } else {
                                DH(2, 8);
                            }
#undef DH
                            for (int64_t h = 0; h < gn; ++h) {
                                const v16 sh = sc[h] * splat16(scale);
                                memcpy(sr + (g + h) * n_keys, &sh, sizeof(float) * cnt);
                            }
                        }
                    }
                    for (; g < gs; ++g) {
                        if (vec) {
                            const v16 sc = dot16x16(qr + g * head_dim, (const float *const *)krows, head_dim) * splat16(scale);
                            memcpy(sr + g * n_keys, &sc, sizeof(float) * cnt);
                        } else {
                            for (int c = 0; c < cnt; ++c)
                                sr[g * n_keys + c] = dot(qr + g * head_dim, (const float *)krows[c], head_dim) * scale;
                        }
                    }
                }
                j += cnt;
            }
            /* softmax per (r, g) over keys 0..pos0+r */
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t len = pos0 + r + 1;
                if (len <= 0) continue; /* no keys (malformed chunk): pass 2 writes zeros */
                for (int64_t g = 0; g < gs; ++g) softmax_inplace(scores + (r * gs + g) * n_keys, len);
            }
            /* pass 2: out[r][g] = sum_j p[r][g][j] v_j. head_dim 64 or 128: whole V rows
             * at a time for up to 6 (3) heads (pv_rows, V prefetched ahead); otherwise one
             * 16-float slice of the head at a time for up to VGROUP heads (pv_slice) and a
             * scalar tail. Either way each output element is the same in-order sum. */
            /* head_dim 64 with up to 3 heads, or 128 with 1: two rows at a time */
            const int pair = (ns == 4 && gs <= 3) || (ns == 8 && gs == 1);
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t len = pos0 + r + 1;
                float *orow = out + ((q0 + first + r) * num_heads + kvh * group + g_lo) * head_dim;
                if (pair && r + 1 < rows) {
                    const float *p = scores + r * gs * n_keys;
                    const void *vhead = kv_elem(v_cache, kvh * hstride, kvt);
#define PV2(G, S)                                                                              \
    pv_rows(2, G, S, p, n_keys, gs * n_keys, len, vhead, table, block_size, row, pf_blocks, \
            orow, num_heads * head_dim, head_dim, kvt)
                    if (ns == 8) PV2(1, 8);
                    else if (gs == 1) PV2(1, 4);
                    else if (gs == 2) PV2(2, 4);
                    else PV2(3, 4);
#undef PV2
                    ++r;
                    continue;
                }
                const int64_t gstep = ns == 4 ? 6 : (ns == 8 ? 3 : VGROUP);
                for (int64_t g0 = 0; g0 < gs; g0 += gstep) {
                    const int64_t gn = (gs - g0) < gstep ? (gs - g0) : gstep;
                    const float *p = scores + (r * gs + g0) * n_keys;
                    float *og = orow + g0 * head_dim;
                    const void *vhead = kv_elem(v_cache, kvh * hstride, kvt);
#define PVR(G, S) \
    pv_rows(1, G, S, p, n_keys, 0, len, vhead, table, block_size, row, pf_blocks, og, 0, head_dim, \
            kvt)
                    if (ns == 4) {
                        switch (gn) {
                        case 1: PVR(1, 4); break;
                        case 2: PVR(2, 4); break;
                        case 3: PVR(3, 4); break;
                        case 4: PVR(4, 4); break;
                        case 5: PVR(5, 4); break;
                        default: PVR(6, 4); break;
                        }
                        continue;
                    }
                    if (ns == 8) {
                        switch (gn) {
                        case 1: PVR(1, 8); break;
                        case 2: PVR(2, 8); break;
                        default: PVR(3, 8); break;
                        }
                        continue;
                    }
#undef PVR
                    int64_t d0 = 0;
                    for (; d0 + 16 <= head_dim; d0 += 16) {
                        const void *vbase = kv_elem(v_cache, kvh * hstride + d0, kvt);
#define PV(G) \
    pv_slice(G, p, n_keys, len, vbase, table, block_size, row, og + d0, head_dim, kvt, head_dim - d0)
                        switch (gn) {
                        case 1: PV(1); break;
                        case 2: PV(2); break;
                        case 3: PV(3); break;
                        case 4: PV(4); break;
                        case 5: PV(5); break;
                        case 6: PV(6); break;
                        case 7: PV(7); break;
                        default: PV(8); break;
                        }
#undef PV
                    }
                    if (d0 < head_dim) { /* a head_dim that is not a multiple of 16 */
                        for (int64_t g = 0; g < gn; ++g) {
                            memset(acc, 0, sizeof(float) * head_dim);
                            for (int64_t j = 0; j < len; ++j) {
                                const int64_t slot =
                                    (int64_t)table[j / block_size] * block_size + j % block_size;
                                const void *vrow = kv_elem(v_cache, slot * row + kvh * hstride, kvt);
                                const float w = p[g * n_keys + j];
                                const float vs = kv_scale_at(vrow, head_dim, kvt);
                                for (int64_t d = d0; d < head_dim; ++d)
                                    acc[d] += w * (kvt == KV_INT8 ? kv_load1(vrow, d, kvt) * vs
                                                                  : kv_load1(vrow, d, kvt));
                            }
                            memcpy(og + g * head_dim + d0, acc + d0,
                                   sizeof(float) * (head_dim - d0));
                        }
                    }
                }
            }
        }
        free(kwide);
        free(acc);
        free(scores);
    }
    free(task_start);
}

/* paged_attention_kv on fp32 caches. */
void paged_attention_f32(const float *q, int64_t q_token_stride, const float *k_cache,
                         const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *seq_lens, const int32_t *cu_seqlens_q, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, float *out, int64_t num_threads) {
    paged_attention_kv(q, q_token_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens,
                       cu_seqlens_q, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                       scale, out, num_threads, KV_F32, 0, INT64_MAX);
}

int64_t attention_amx_min_rows(void); /* cpu_attention_amx.c */
int64_t paged_attention_amx_bf16kv(const float *q, int64_t q_token_stride,
                                   const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, float scale, float *out,
                                   int64_t num_threads, int64_t min_rows);

int64_t paged_attention_decode_bf16kv(const float *q, int64_t q_token_stride,
                                      const uint16_t *k_cache, const uint16_t *v_cache,
                                      const int32_t *block_tables, int64_t bt_stride,
                                      const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t block_size, float scale,
                                      float *out, int64_t num_threads,
                                      int64_t min_rows); /* cpu_attention_decode_bf16.c */

/* paged_attention_kv on bf16 caches (uint16_t bit patterns); q and out fp32. min_rows > 0
 * turns on the bf16-product attention (Q and P rounded to bf16, fp32 sums): chunks of at
 * least min_rows query rows run on cpu_attention_amx.c's tiles, the shorter ones (decode
 * rows, short chunks) on cpu_attention_decode_bf16.c's VDPBF16PS kernel, where the build
 * has them and head_dim is a multiple of 32 up to 256; here whatever they refuse. min_rows
 * 0: all here (fp32 arithmetic on the widened elements). */
void paged_attention_bf16kv_rows(const float *q, int64_t q_token_stride, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *block_tables,
                                 int64_t bt_stride, const int32_t *seq_lens,
                                 const int32_t *cu_seqlens_q, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, float *out,
                                 int64_t num_threads, int64_t min_rows) {
    int64_t lo = 0, hi = INT64_MAX; /* the chunk lengths left to paged_attention_kv */
    if (min_rows > 0) {
        if (paged_attention_amx_bf16kv(q, q_token_stride, k_cache, v_cache, block_tables,
                                       bt_stride, seq_lens, cu_seqlens_q, num_seqs, num_heads,
                                       num_kv_heads, head_dim, block_size, scale, out,
                                       num_threads, min_rows) == 0)
            hi = min_rows;
        if (paged_attention_decode_bf16kv(q, q_token_stride, k_cache, v_cache, block_tables,
                                          bt_stride, seq_lens, cu_seqlens_q, num_seqs,
                                          num_heads, num_kv_heads, head_dim, block_size, scale,
                                          out, num_threads, min_rows) == 0)
            lo = min_rows;
    }
    if (lo < hi)
        paged_attention_kv(q, q_token_stride, k_cache, v_cache, block_tables, bt_stride,
                           seq_lens, cu_seqlens_q, num_seqs, num_heads, num_kv_heads, head_dim,
                           block_size, scale, out, num_threads, KV_BF16, lo, hi);
}

/* paged_attention_bf16kv_rows with the process's min_rows (attention_amx_min_rows()). */
void paged_attention_bf16kv(const float *q, int64_t q_token_stride, const uint16_t *k_cache,
                            const uint16_t *v_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, float *out, int64_t num_threads) {
    paged_attention_bf16kv_rows(q, q_token_stride, k_cache, v_cache, block_tables, bt_stride,
                                seq_lens, cu_seqlens_q, num_seqs, num_heads, num_kv_heads,
                                head_dim, block_size, scale, out, num_threads,
                                attention_amx_min_rows());
}

/* paged_attention_kv on fp8 e4m3fn caches (bytes) of per-tensor scales k_scale, v_scale:
 * k_scale folds into the softmax scale, v_scale multiplies the output; q and out fp32. */
void paged_attention_fp8kv(const float *q, int64_t q_token_stride, const uint8_t *k_cache,
                           const uint8_t *v_cache, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *seq_lens,
                           const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, float k_scale, float v_scale, float *out,
                           int64_t num_threads) {
    paged_attention_kv(q, q_token_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens,
                       cu_seqlens_q, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                       scale * k_scale, out, num_threads, KV_FP8, 0, INT64_MAX);
    if (v_scale != 1.0f) {
        const int64_t n = cu_seqlens_q[num_seqs] * num_heads * head_dim;
#pragma omp parallel for if (n > 65536) num_threads(num_threads > 0 ? num_threads : 1)
        for (int64_t i = 0; i < n; ++i) out[i] *= v_scale;
    }
}

/* One head vector x[0 .. d) as int8 at dst[0 .. d) and its fp32 scale at dst + d:
 * scale = absmax / 127, q = clamp(rne(x / scale), -127, 127), q = 0 where scale is 0 (a
 * NaN absmax is kept as the scale); pagedserve.kernels.int8.quantize, the same bytes. */
static void store_int8_head(const float *x, int64_t d, int8_t *dst) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
        const float a = fabsf(x[i]);
        amax = (a > amax || a != a) ? a : amax;
    }
    const float sc = amax / 127.0f;
    for (int64_t i = 0; i < d; ++i) {
        float r = sc > 0.0f ? nearbyintf(x[i] / sc) : 0.0f;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        dst[i] = (int8_t)r;
    }
    memcpy(dst + d, &sc, sizeof(sc));
}

/* paged_attention_kv on int8 caches ([.., num_kv_heads, head_dim + 4] bytes: each head's
 * elements, then its fp32 scale), read as (float)q * scale; q and out fp32. */
void paged_attention_int8kv(const float *q, int64_t q_token_stride, const int8_t *k_cache,
                            const int8_t *v_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, float *out, int64_t num_threads) {
    paged_attention_kv(q, q_token_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens,
                       cu_seqlens_q, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                       scale, out, num_threads, KV_INT8, 0, INT64_MAX);
}

/* One head vector x[0 .. d) as int8 on the q and k heads of a fused qkv row,
 * then the K and V rows stored into their cache slots (slot < 0: not stored).
 * qkv: [T, qkv_stride] with q heads at 0, k heads at num_heads*head_dim, v heads after;
 * cos/sin tables: [max_positions, head_dim] fp32; positions int64 [T].
 * out = x*cos + rotate_half(x)*sin, rounded after each multiply and the add (no FMA), as
 * in HF transformers' apply_rotary_pos_emb. kvt KV_BF16: the caches are bf16 and the stored
 * K/V rows are the fp32 ones rounded by f32_to_bf16; KV_FP8: f32_to_fp8 of K / k_scale and
 * V / v_scale (qkv itself stays fp32); KV_INT8: each head by store_int8_head.
 */
static void rope_store_kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                          const float *sin_table, const int64_t *positions,
                          const int64_t *slots, void *k_cache, void *v_cache, const int kvt,
                          float k_scale, float v_scale) {
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
        const float *k = x + num_heads * head_dim, *v = k + kv_row;
        if (slot >= 0 && kvt == KV_INT8) {
            const int64_t hs = head_dim + 4; /* bytes per head: elements, then the scale */
            int8_t *kd = (int8_t *)k_cache + slot * num_kv_heads * hs;
            int8_t *vd = (int8_t *)v_cache + slot * num_kv_heads * hs;
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                store_int8_head(k + h * head_dim, head_dim, kd + h * hs);
                store_int8_head(v + h * head_dim, head_dim, vd + h * hs);
            }
        } else if (slot >= 0 && kvt == KV_FP8) {
            uint8_t *kd = (uint8_t *)k_cache + slot * kv_row;
            uint8_t *vd = (uint8_t *)v_cache + slot * kv_row;
            for (int64_t d = 0; d < kv_row; ++d) kd[d] = f32_to_fp8(k[d], k_scale);
            for (int64_t d = 0; d < kv_row; ++d) vd[d] = f32_to_fp8(v[d], v_scale);
        } else if (slot >= 0 && kvt == KV_BF16) {
            uint16_t *kd = (uint16_t *)k_cache + slot * kv_row;
            uint16_t *vd = (uint16_t *)v_cache + slot * kv_row;
            for (int64_t d = 0; d < kv_row; ++d) kd[d] = f32_to_bf16(k[d]);
            for (int64_t d = 0; d < kv_row; ++d) vd[d] = f32_to_bf16(v[d]);
        } else if (slot >= 0) {
            memcpy((float *)k_cache + slot * kv_row, k, sizeof(float) * kv_row);
            memcpy((float *)v_cache + slot * kv_row, v, sizeof(float) * kv_row);
        }
    }
}

void rope_store_f32(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                    const float *sin_table, const int64_t *positions, const int64_t *slots,
                    float *k_cache, float *v_cache) {
    rope_store_kv(qkv, qkv_stride, num_tokens, num_heads, num_kv_heads, head_dim, cos_table,
                  sin_table, positions, slots, k_cache, v_cache, KV_F32, 1.0f, 1.0f);
}

/* rope_store_f32 into bf16 caches (uint16_t bit patterns). */
void rope_store_bf16kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                       const float *sin_table, const int64_t *positions, const int64_t *slots,
                       uint16_t *k_cache, uint16_t *v_cache) {
    rope_store_kv(qkv, qkv_stride, num_tokens, num_heads, num_kv_heads, head_dim, cos_table,
                  sin_table, positions, slots, k_cache, v_cache, KV_BF16, 1.0f, 1.0f);
}

/* rope_store_f32 into fp8 e4m3fn caches (bytes): f32_to_fp8 of K / k_scale, V / v_scale. */
void rope_store_fp8kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                      const float *sin_table, const int64_t *positions, const int64_t *slots,
                      uint8_t *k_cache, uint8_t *v_cache, float k_scale, float v_scale) {
    rope_store_kv(qkv, qkv_stride, num_tokens, num_heads, num_kv_heads, head_dim, cos_table,
                  sin_table, positions, slots, k_cache, v_cache, KV_FP8, k_scale, v_scale);
}

/* rope_store_f32 into int8 caches ([.., num_kv_heads, head_dim + 4] bytes): each K and V
 * head vector with its own scale (store_int8_head). */
void rope_store_int8kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                       const float *sin_table, const int64_t *positions, const int64_t *slots,
                       int8_t *k_cache, int8_t *v_cache) {
    rope_store_kv(qkv, qkv_stride, num_tokens, num_heads, num_kv_heads, head_dim, cos_table,
                  sin_table, positions, slots, k_cache, v_cache, KV_INT8, 1.0f, 1.0f);
}

/*
 * RMSNorm of each row: out = w * (x / sqrt(mean(x^2) + eps)). With residual != NULL the
 * residual is added first and the sum written back to residual (vLLM's
 * fused_add_rms_norm): residual += x; out = norm(residual).
 */
/* Row i's residual add (when residual != NULL) and 1 / rms; *src: the row to normalise.
 * One compiled copy (noinline) serves both outputs below, so their sums are the same. */
static __attribute__((noinline)) float rms_row(const float *x, float *residual, int64_t i,
                                               int64_t hidden, float eps, const float **src) {
    const float *xi = x + i * hidden;
    *src = xi;
    if (residual != NULL) {
        float *ri = residual + i * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) ri[d] = ri[d] + xi[d];
        *src = ri;
    }
    const float *v = *src;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < hidden; ++d) ss += v[d] * v[d];
    return 1.0f / sqrtf(ss / (float)hidden + eps);
}

void rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                  int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for if (num_rows > 64)
    for (int64_t i = 0; i < num_rows; ++i) {
        const float *src;
        const float r = rms_row(x, residual, i, hidden, eps, &src);
        float *oi = out + i * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) oi[d] = weight[d] * (src[d] * r);
    }
}

/* rms_norm_f32 with each output rounded to bf16 (f32_to_bf16: what a bf16 GEMM does to an
 * fp32 input), for the fused decoder's bf16 layers. */
void rms_norm_f32_to_bf16(const float *x, float *residual, const float *weight, uint16_t *out,
                          int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for if (num_rows > 64)
    for (int64_t i = 0; i < num_rows; ++i) {
        const float *src;
        const float r = rms_row(x, residual, i, hidden, eps, &src);
        uint16_t *oi = out + i * hidden;
        for (int64_t d = 0; d < hidden; ++d) oi[d] = f32_to_bf16(weight[d] * (src[d] * r));
    }
}

#if defined(__AVX512F__)
/* exp512 (cpu_common.h) on one float, operation for operation: the same fused multiply-adds
 * (fmaf), round to nearest even (nearbyintf under the default rounding mode, as
 * roundscale), and 2^n by ldexpf (exact here: the clamped range keeps results normal). */
static inline float exp_fma1(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    const float fn = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-fn, 0.693359375f, x);
    r = fmaf(-fn, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r + 1.0f);
    return ldexpf(p, (int)fn);
}

/* o[d] = silu(g[d]) * u[d] = g[d] / (1 + exp(-g[d])) * u[d]: 16 lanes at a time on exp512,
 * the tail on exp_fma1 (the same bits per element). */
static void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t d = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; d + 16 <= n; d += 16) {
        const __m512 x = _mm512_loadu_ps(g + d);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + d, _mm512_mul_ps(s, _mm512_loadu_ps(u + d)));
    }
    for (; d < n; ++d) {
        const float s = g[d] / (1.0f + exp_fma1(-g[d]));
        o[d] = s * u[d];
    }
}
#else /* no AVX512: exp16 on 16 lanes gives exp_f32's bits (the same separate operations) */
static void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        const v16 x = load16(g + d);
        const v16 s = x / (splat16(1.0f) + exp16(-x));
        store16(o + d, s * load16(u + d));
    }
    for (; d < n; ++d) {
        const float s = g[d] / (1.0f + exp_f32(-g[d]));
        o[d] = s * u[d];
    }
}
#endif

/* out[i, d] = silu(g[i, d]) * u[i, d] for rows of stride ld (g, u) and ldo (out): the bits
 * of silu_mul_f32 (the epilogue of linear_packed_bf16_silu_mul_amx, one thread each). */
void silu_mul_rows_f32(const float *g, const float *u, int64_t ld, float *out, int64_t ldo,
                       int64_t rows, int64_t n) {
    for (int64_t i = 0; i < rows; ++i) silu_mul_row(g + i * ld, u + i * ld, out + i * ldo, n);
}

/* x[i] = (float)bf16(x[i]) in place for n floats: f32_to_bf16's round to nearest even (a NaN
 * becomes the quiet NaN 0x7fc0; torch's conversion may give another NaN pattern), the value
 * of torch's x.to(torch.bfloat16).float(). */
void round_f32_to_bf16(float *x, int64_t n) {
#pragma omp parallel for if (n > (1 << 20))
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t b = (uint32_t)f32_to_bf16(x[i]) << 16;
        memcpy(x + i, &b, sizeof(b));
    }
}

/* out[i, d] = silu(x[i, d]) * x[i, inter + d] for x [num_rows, 2 * inter]. */
void silu_mul_f32(const float *x, float *out, int64_t num_rows, int64_t inter) {
#pragma omp parallel for if (num_rows > 16)
    for (int64_t i = 0; i < num_rows; ++i)
        silu_mul_row(x + i * 2 * inter, x + i * 2 * inter + inter, out + i * inter, inter);
}

/* silu_mul_f32 of bf16 gate_up rows (each element widened exactly), each output rounded by
 * f32_to_bf16: the bits of silu_mul_f32(x.float()).to(torch.bfloat16), without the fp32
 * copies of x and out. The row goes through the fp32 arithmetic in pieces of SILU_PIECE
 * elements (a multiple of 16, so the vector/tail split inside silu_mul_row gives the same
 * bits per element as one call over the whole row). */
#define SILU_PIECE 512
void silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t num_rows, int64_t inter) {
#pragma omp parallel for if (num_rows > 16)
    for (int64_t i = 0; i < num_rows; ++i) {
        float g[SILU_PIECE], u[SILU_PIECE], o[SILU_PIECE];
        const uint16_t *gi = x + i * 2 * inter, *ui = gi + inter;
        uint16_t *oi = out + i * inter;
        for (int64_t d0 = 0; d0 < inter; d0 += SILU_PIECE) {
            const int64_t n = inter - d0 < SILU_PIECE ? inter - d0 : SILU_PIECE;
            for (int64_t d = 0; d < n; ++d) {
                const uint32_t gb = (uint32_t)gi[d0 + d] << 16, ub = (uint32_t)ui[d0 + d] << 16;
                memcpy(g + d, &gb, sizeof(float));
                memcpy(u + d, &ub, sizeof(float));
            }
            silu_mul_row(g, u, o, n);
            for (int64_t d = 0; d < n; ++d) oi[d0 + d] = f32_to_bf16(o[d]);
        }
    }
}

/*
 * out[i] = the index of the first maximum of row i of x (row stride ld), as torch.argmax:
 * ties go to the lowest index, a NaN counts as the maximum (the first NaN wins).
 * One pass: lane l keeps the first maximum among indices = l (mod 16); the lanes holding
 * the row's maximum then give the lowest index; the tail (n mod 16) comes last.
 */
static int64_t argmax_row(const float *x, int64_t n) {
    v16 best = splat16(-INFINITY);
    v16i chunk = (v16i){0};
    v16i nan = (v16i){0};
    int64_t c = 0;
    for (; (c + 1) * 16 <= n; ++c) {
        const v16 v = load16(x + c * 16);
        const v16i gt = v > best;
        best = select16(gt, v, best);
        chunk = (chunk & ~gt) | (((v16i){0} + (int32_t)c) & gt);
        nan |= v != v;
    }
    int any_nan = 0;
    for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0;
    float m = -INFINITY;
    for (int l = 0; l < 16 && c > 0; ++l) m = best[l] > m ? best[l] : m;
    int64_t idx = -1;
    if (!any_nan && c > 0 && m > -INFINITY) {
        for (int l = 0; l < 16; ++l) {
            const int64_t j = (int64_t)chunk[l] * 16 + l;
            if (best[l] == m && (idx < 0 || j < idx)) idx = j;
        }
        for (int64_t j = c * 16; j < n; ++j) {
            if (x[j] != x[j]) {
                any_nan = 1;
                break;
            }
            if (x[j] > m) {
                m = x[j];
                idx = j;
            }
        }
    }
    if (idx < 0 || any_nan) { /* a NaN, a row of -inf, or a row shorter than 16: scalar */
        idx = 0;
        float bm = x[0];
        for (int64_t j = 0; j < n; ++j) {
            if (x[j] != x[j]) return j;
            if (x[j] > bm) {
                bm = x[j];
                idx = j;
            }
        }
    }
    return idx;
}

void argmax_rows_f32(const float *x, int64_t num_rows, int64_t n, int64_t ld, int64_t *out,
                     int64_t num_threads) {
#pragma omp parallel for if (num_rows >= 4) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t i = 0; i < num_rows; ++i) out[i] = n > 0 ? argmax_row(x + i * ld, n) : 0;
}
