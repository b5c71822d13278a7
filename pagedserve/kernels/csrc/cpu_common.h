/*
 * Helpers shared by the CPU kernel sources (cpu_kernels.c, cpu_gemm_bf16.c,
 * cpu_attention_amx.c, cpu_attention_decode_bf16.c): the 16-lane vector types, the
 * fixed-tree 16 x 16 transpose-sum, the AVX512 exp, the AMX tile configuration, the env
 * switch, and the paged-attention kernels' task walk.
 * Everything is static inline: each source gets its own copy, so no symbol is shared.
 */
#ifndef PAGEDSERVE_CPU_COMMON_H
#define PAGEDSERVE_CPU_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle((a), (b), (v16i){__VA_ARGS__})
#endif

/* Lane i of the result: the sum of the 16 lanes of p[i], all 16 sums in one vector. Every
 * lane goes through the same tree: ((l0 + l8) + (l4 + l12)) + ((l2 + l10) + (l6 + l14)),
 * plus the same for the odd lanes, odd last; so a sum does not depend on its lane. */
static inline v16 transpose_sum16(const v16 *p) {
    v16 s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; ++i)
        s8[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                SHUF(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        s4[i] = SHUF(s8[2 * i], s8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                SHUF(s8[2 * i], s8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        s2[i] = SHUF(s4[2 * i], s4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                SHUF(s4[2 * i], s4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(s2[0], s2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(s2[0], s2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* 1 when the environment variable name is 0/false/off/no (any case), else 0. */
static inline int env_off(const char *name) {
    const char *env = getenv(name);
    if (env == NULL) return 0;
    char low[8] = {0};
    for (int i = 0; i < 7 && env[i] != '\0'; ++i)
        low[i] = (char)(env[i] >= 'A' && env[i] <= 'Z' ? env[i] + 32 : env[i]);
    return !strcmp(low, "0") || !strcmp(low, "false") || !strcmp(low, "off") ||
           !strcmp(low, "no");
}

/* The 64-byte operand of LDTILECFG (palette 1). */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) on 16 lanes, x clamped to [-87, 88]: Cephes' expf, x = n ln2 + r,
 * degree-6 polynomial in r (fused multiply-adds), times 2^n (scalef). ~1-2 ulp. A NaN
 * lane stays NaN (VMAXPS/VMINPS return their second operand when either is NaN, so x goes
 * second): a softmax over a NaN score comes out NaN, not exp(-87). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
    const __m512 fn = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, fn);
}

#if defined(__AVX512BF16__)
#include <math.h>

/* The softmax of one attention row for the bf16-product paths (cpu_attention_amx.c,
 * cpu_attention_decode_bf16.c): s (unscaled fp32 scores of keys [0, len)) into p, bf16 of
 * exp((s - max) * scale) rounded to nearest even, zero from len up to pad (a multiple of
 * 16); returns 1 / the fp32 sum of the unrounded exps (0 when len <= 0: the row's output is
 * zeros). */
static inline float softmax_row_bf16(const float *s, uint16_t *p, int64_t len, int64_t pad,
                                float scale) {
    if (len <= 0) {
        memset(p, 0, sizeof(uint16_t) * pad);
        return 0.0f;
    }
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 m = (__mmask16)(len - j >= 16 ? 0xffff : (1u << (len - j)) - 1);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < len; j += 16) {
        const int64_t left = len - j;
        const __mmask16 m = (__mmask16)(left >= 16 ? 0xffff : (1u << left) - 1);
        const __m512 e =
            _mm512_maskz_mov_ps(m, exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx), vs)));
        sum = _mm512_add_ps(sum, e);
        const __m256bh h = _mm512_cvtneps_pbh(e);
        memcpy(p + j, &h, sizeof(h));
    }
    if (j < pad) memset(p + j, 0, sizeof(uint16_t) * (pad - j));
    return 1.0f / _mm512_reduce_add_ps(sum);
}
#endif
#endif

/* The paged-attention kernels' task walk (cpu_kernels.c, cpu_attention_amx.c,
 * cpu_attention_decode_bf16.c): tasks are numbered sequence by sequence, sequence s owning
 * task_start[s] .. task_start[s + 1] - 1. attn_task_seq returns the task's sequence; *s is
 * where the search starts and is left there (a thread's tasks mostly increase under a
 * dynamic schedule; a smaller task restarts it from 0). */
static inline int64_t attn_task_seq(const int64_t *task_start, int64_t task, int64_t *s) {
    if (task < task_start[*s]) *s = 0;
    while (task_start[*s + 1] <= task) ++*s;
    return *s;
}

/* Query-row tile `tile` (of tile_rows rows) of sequence s: its rows q0 + first .. q0 +
 * first + rows - 1 of the flat batch, the position of its row 0, and the keys its last row
 * sees (causal; clamped to 0 .. seq_len). */
typedef struct {
    int64_t q0, q_len, seq_len, first, rows, pos0, n_keys;
} attn_q_tile_t;

static inline attn_q_tile_t attn_q_tile(const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                                        int64_t s, int64_t tile, int64_t tile_rows) {
    attn_q_tile_t t;
    t.q0 = cu_seqlens_q[s];
    t.q_len = cu_seqlens_q[s + 1] - t.q0;
    t.seq_len = seq_lens[s];
    t.first = tile * tile_rows;
    t.rows = (t.q_len - t.first < tile_rows) ? t.q_len - t.first : tile_rows;
    t.pos0 = t.seq_len - t.q_len + t.first;
    t.n_keys = t.pos0 + t.rows;
    if (t.n_keys < 0) t.n_keys = 0;
    if (t.n_keys > t.seq_len) t.n_keys = t.seq_len;
    return t;
}

/* A sequence's task `local` as (tile, KV head, head split): local = (tile * num_kv_heads +
 * kvh) * splits + split; the split's query heads of the KV head's group are g_lo .. g_lo +
 * gs - 1 (sub a split, the last split shorter). */
typedef struct {
    int64_t tile, kvh, g_lo, gs;
} attn_heads_t;

static inline attn_heads_t attn_heads(int64_t local, int64_t splits, int64_t sub, int64_t group,
                                      int64_t num_kv_heads) {
    attn_heads_t h;
    h.g_lo = (local % splits) * sub;
    h.gs = (group - h.g_lo) < sub ? (group - h.g_lo) : sub;
    h.kvh = (local / splits) % num_kv_heads;
    h.tile = local / (splits * num_kv_heads);
    return h;
}

/* A split-head kernel's task (cpu_kernels.c, cpu_attention_decode_bf16.c): its sequence
 * (attn_task_seq, *s as there), heads (attn_heads) and query tile (attn_q_tile). */
typedef struct {
    attn_heads_t h;
    attn_q_tile_t q;
} attn_task_t;

static inline attn_task_t attn_task(const int64_t *task_start, int64_t task, int64_t *s,
                                    int64_t splits, int64_t sub, int64_t group,
                                    int64_t num_kv_heads, const int32_t *cu_seqlens_q,
                                    const int32_t *seq_lens, int64_t tile_rows) {
    attn_task_t t;
    attn_task_seq(task_start, task, s);
    t.h = attn_heads(task - task_start[*s], splits, sub, group, num_kv_heads);
    t.q = attn_q_tile(cu_seqlens_q, seq_lens, *s, t.h.tile, tile_rows);
    return t;
}

#endif
