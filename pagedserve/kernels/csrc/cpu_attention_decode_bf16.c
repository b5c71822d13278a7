/*
 * Decode and short-chunk attention on bf16 KV caches with AVX512-BF16 dot products
 * (VDPBF16PS): the chunks of a step with fewer than min_rows query rows, when the prefill
 * path (cpu_attention_amx.c, chunks of at least min_rows rows) is on. Same contract as that
 * path: Q and P rounded to bf16 (round to nearest even), fp32 sums of bf16 products, the
 * softmax in fp32 (scores unscaled, exp((s - max) * scale) by exp512, Cephes' polynomial),
 * the output divided (multiplied by the inverse) by the fp32 sum of the unrounded exps;
 * probabilities past a row's causal limit are zero. paged_attention_bf16kv_rows
 * (cpu_kernels.c) calls this; paged_attention_kv takes what it refuses.
 *
 * Why: decode attention on a bf16 cache ran at ~21% of a SmolLM2 decode step; the fp32
 * kernel widens every K and V element to fp32 and does a separate multiply and add per
 * element (the build has no FMA contraction). VDPBF16PS does 32 bf16 products summed in
 * pairs into 16 fp32 lanes per instruction, straight from the cache's bytes.
 *
 * Tasks and memory are paged_attention_kv's: a task is (sequence, KV head, tile of DQT
 * query rows, subgroup of the KV head's query heads), scheduled dynamically; each K and V
 * row is read once for all the task's query heads and rows, walking the block table, with
 * the K rows PF_KEYS keys ahead and each V row prefetched when its K row is read (pass 2
 * then finds V in cache). The prefetches go to L2 (prefetcht1): prefetcht0's fills hold
 * L1 miss buffers, few enough on Zen 4 that with them the 30-layer decode of 32 sequences
 * at 160 keys read ~7 GB/s on one core and took 2.5x as long (measured: 17.8 vs 7 ms).
 *
 * Pass 1 (scores): per key, lane l of dpbf16(q, k) chained over the head's 32-dimension
 * slices holds the sum of the products of pairs l, l + 16, ...; 16 keys' partial vectors
 * reduce in transpose_sum16's fixed tree to 16 scores. Pass 2 (weighted sum): two V rows
 * (keys 2m, 2m + 1; past the task's keys a zero row) are interleaved per dimension
 * (vpunpck{l,h}wd) into key pairs and acc += dpbf16(broadcast of the row's P pair m, pairs)
 * per query head and row, for the pairs up to the block's last row's limit (a row's P is
 * zero past its own limit, and adding a zero product leaves an fp32 sum that was never -0
 * unchanged); the accumulators' dimension order is undone once at the end.
 *
 * A row's operations depend only on its own sequence's data (its query, its keys and
 * values, its causal limit): not on the batch, the thread count or the task split, bit for
 * bit. The bits differ from the fp32 kernel's (Q and P in bf16) and from the prefill path's
 * (the order of the fp32 sums).
 *
 * Built where the compiler targets AVX512F and AVX512-BF16 (-march=native on such a CPU);
 * elsewhere the entry point returns -2 and paged_attention_kv does all. Refused (-2) for
 * head_dim not a multiple of 32 or above 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#define DQT 16                 /* query rows per task */
#define MAX_HEAD_DIM 256       /* head_dim / 32 <= 8 zmm per row */
#define MIN_TASKS_PER_THREAD 4 /* below this, a KV group's query heads become separate tasks */
#ifndef PF_KEYS
#define PF_KEYS 32 /* how far ahead pass 1 prefetches K rows */
#endif
#ifndef PF_HINT_K
#define PF_HINT_K _MM_HINT_T1
#endif
#ifndef PF_HINT_V
#define PF_HINT_V _MM_HINT_T1
#endif
#define MAX_ACC 24             /* pass 2 accumulators held in registers */

static const uint16_t zero_row[MAX_HEAD_DIM] __attribute__((aligned(64)));

/* Lane i: the sum over dimensions of q * k[i] for 16 key rows, nv = head_dim / 32. Lane l
 * of key i's partial vector sums dpbf16 over slices 0 .. nv - 1 in order (each the pair
 * 2l, 2l + 1 of its slice), then transpose_sum16. */
static inline __attribute__((always_inline)) __m512 dot16_keys(const int nv,
                                                                const uint16_t *q,
                                                                const uint16_t *const *k) {
    __m512bh qv[8];
    for (int v = 0; v < nv; ++v) qv[v] = (__m512bh)_mm512_loadu_si512((const void *)(q + 32 * v));
    v16 part[16];
    for (int c = 0; c < 16; ++c) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                      (__m512bh)_mm512_loadu_si512((const void *)k[c]));
        for (int v = 1; v < nv; ++v)
            acc = _mm512_dpbf16_ps(acc, qv[v],
                                   (__m512bh)_mm512_loadu_si512((const void *)(k[c] + 32 * v)));
        part[c] = (v16)acc;
    }
    return (__m512)transpose_sum16(part);
}

/* Pass 2 for nc (row, head) combinations at once: out[c] = inv[c] * sum over key pairs
 * m < npairs of dpbf16(P pair m of p[c], V pair m); V rows of keys [0, n_keys) through the
 * block table, a zero row past them. nc and nv are compile-time constants at each call. */
static inline __attribute__((always_inline)) void pv_block(
    const int nc, const int nv, const uint16_t *const *p, const float *inv, float *const *out,
    int64_t npairs, int64_t n_keys, const uint16_t *v_cache, const int32_t *table,
    int64_t block_size, int64_t row, int64_t off) {
    __m512 acc[MAX_ACC];
    for (int i = 0; i < 2 * nv * nc; ++i) acc[i] = _mm512_setzero_ps();
    int64_t b = 0, o = 0; /* key 2m: block b, offset o */
    for (int64_t m = 0; m < npairs; ++m) {
        const uint16_t *v0 = v_cache + ((int64_t)table[b] * block_size + o) * row + off;
        if (++o == block_size) {
            o = 0;
            ++b;
        }
        const uint16_t *v1 = zero_row;
        if (2 * m + 1 < n_keys) {
            v1 = v_cache + ((int64_t)table[b] * block_size + o) * row + off;
            if (++o == block_size) {
                o = 0;
                ++b;
            }
        }
        __m512bh w[8];
        for (int c = 0; c < nc; ++c) {
            uint32_t pw;
            memcpy(&pw, p[c] + 2 * m, sizeof(pw));
            w[c] = (__m512bh)_mm512_set1_epi32((int)pw);
        }
        for (int v = 0; v < nv; ++v) {
            const __m512i a = _mm512_loadu_si512((const void *)(v0 + 32 * v));
            const __m512i bb = _mm512_loadu_si512((const void *)(v1 + 32 * v));
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, bb);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, bb);
            for (int c = 0; c < nc; ++c) {
                acc[(c * nv + v) * 2] = _mm512_dpbf16_ps(acc[(c * nv + v) * 2], w[c], lo);
                acc[(c * nv + v) * 2 + 1] = _mm512_dpbf16_ps(acc[(c * nv + v) * 2 + 1], w[c], hi);
            }
        }
    }
    /* lo lane 4L + i holds dimension 8L + i of its slice, hi lane 4L + i dimension 8L + 4 + i */
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < nc; ++c) {
        const __m512 sc = _mm512_set1_ps(inv[c]);
        for (int v = 0; v < nv; ++v) {
            const __m512 lo = acc[(c * nv + v) * 2], hi = acc[(c * nv + v) * 2 + 1];
            _mm512_storeu_ps(out[c] + 32 * v,
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx0, hi), sc));
            _mm512_storeu_ps(out[c] + 32 * v + 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx1, hi), sc));
        }
    }
}

/* (row, head) combinations pass 2 holds at once for nv = head_dim / 32 */
static inline int combos_per_block(int64_t nv) {
    return nv == 1 ? 8 : (nv == 2 ? 6 : (nv == 3 ? 4 : (nv == 4 ? 3 : (nv <= 6 ? 2 : 1))));
}

/*
 * Chunks with 0 < q_len < min_rows of a paged_attention_kv call on bf16 caches (see
 * cpu_kernels.c for the arguments). Returns 0 (done), -2 (refused: min_rows < 1, head_dim
 * not a multiple of 32 or above 256; out untouched) or -1 (scratch allocation failed).
 */
int64_t paged_attention_decode_bf16kv(const float *q, int64_t q_token_stride,
                                      const uint16_t *k_cache, const uint16_t *v_cache,
                                      const int32_t *block_tables, int64_t bt_stride,
                                      const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t block_size, float scale,
                                      float *out, int64_t num_threads, int64_t min_rows) {
    if (min_rows < 1 || head_dim % 32 != 0 || head_dim > MAX_HEAD_DIM) return -2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* elements per token slot */
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    const int64_t nv = head_dim / 32;
    int64_t base_tasks = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        if (q_len < min_rows) base_tasks += (q_len + DQT - 1) / DQT * num_kv_heads;
    }
    if (base_tasks == 0) return 0; /* nothing here: a prefill-only step */
    int64_t sub = group; /* query heads per task */
    if (base_tasks < MIN_TASKS_PER_THREAD * threads && group > 1) {
        int64_t splits = (MIN_TASKS_PER_THREAD * threads + base_tasks - 1) / base_tasks;
        splits = splits < group ? splits : group;
        sub = (group + splits - 1) / splits;
    }
    const int64_t splits = (group + sub - 1) / sub;
    int64_t *task_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    if (task_start == NULL) return -1;
    int64_t max_keys = 1;
    task_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        const int64_t tiles = q_len < min_rows ? (q_len + DQT - 1) / DQT : 0;
        task_start[s + 1] = task_start[s] + tiles * num_kv_heads * splits;
        if (tiles > 0 && seq_lens[s] > max_keys) max_keys = seq_lens[s];
    }
    const int64_t num_tasks = task_start[num_seqs];
    const int64_t kmax = (max_keys + 31) / 32 * 32; /* score / weight row stride bound */
    const int64_t combos = DQT * sub;
    /* per thread, 64-byte aligned parts: q (bf16), scores (fp32), p (bf16), inv */
    const size_t q_bytes = ((size_t)combos * head_dim * 2 + 63) / 64 * 64;
    const size_t s_bytes = ((size_t)combos * kmax * 4 + 63) / 64 * 64;
    const size_t p_bytes = ((size_t)combos * kmax * 2 + 63) / 64 * 64;
    const size_t i_bytes = ((size_t)combos * 4 + 63) / 64 * 64;
    const size_t per_thread = q_bytes + s_bytes + p_bytes + i_bytes;
    char *pool = aligned_alloc(64, per_thread * (size_t)threads);
    if (pool == NULL) {
        free(task_start);
        return -1;
    }
    const int64_t pf_blocks = (PF_KEYS + block_size - 1) / block_size;
    const int cpb = combos_per_block(nv);
#pragma omp parallel if (num_tasks > 1) num_threads(threads)
    {
        const int tid = omp_get_thread_num();
        char *mine = pool + per_thread * (size_t)tid;
        uint16_t *qb = (uint16_t *)mine;
        float *scores = (float *)(mine + q_bytes);
        uint16_t *pw = (uint16_t *)(mine + q_bytes + s_bytes);
        float *inv = (float *)(mine + q_bytes + s_bytes + p_bytes);
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            const attn_task_t at = attn_task(task_start, task, &s, splits, sub, group,
                                             num_kv_heads, cu_seqlens_q, seq_lens, DQT);
            const int64_t g_lo = at.h.g_lo, gs = at.h.gs, kvh = at.h.kvh, q0 = at.q.q0;
            const int64_t first = at.q.first, rows = at.q.rows, pos0 = at.q.pos0;
            const int64_t n_keys = at.q.n_keys;
            const int64_t kst = (n_keys + 31) / 32 * 32 > 0 ? (n_keys + 31) / 32 * 32 : 32;
            const int32_t *table = block_tables + s * bt_stride;
            const int64_t off = kvh * head_dim;
            /* the first K rows now (the walker below prefetches PF_KEYS ahead) */
            for (int64_t j = 0; j < n_keys && j < pf_blocks * block_size; ++j) {
                const uint16_t *kr =
                    k_cache + ((int64_t)table[j / block_size] * block_size + j % block_size) * row + off;
                for (int64_t l = 0; l < head_dim; l += 32) _mm_prefetch((const char *)(kr + l), PF_HINT_K);
            }
            /* the queries in bf16: combination (r, g) at qb + (r * gs + g) * head_dim */
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t g = 0; g < gs; ++g) {
                    const float *src =
                        q + (q0 + first + r) * q_token_stride + (kvh * group + g_lo + g) * head_dim;
                    uint16_t *dst = qb + (r * gs + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d += 16) {
                        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + d));
                        memcpy(dst + d, &h, sizeof(h));
                    }
                }
            /* pass 1: unscaled scores of (r, g) at scores + (r * gs + g) * kst, 16 keys a
             * group (the last padded with its last row); row r sees keys 0 .. pos0 + r */
            const uint16_t *krows[16];
            int64_t cb = 0, co = 0;                                     /* current key */
            int64_t pb = pf_blocks, po = 0, pj = pf_blocks * block_size; /* prefetch walker */
            for (int64_t j = 0; j < n_keys;) {
                int cnt = 0;
                for (; cnt < 16 && j + cnt < n_keys; ++cnt) {
                    const int64_t slot = (int64_t)table[cb] * block_size + co;
                    krows[cnt] = k_cache + slot * row + off;
                    for (int64_t l = 0; l < head_dim; l += 32)
                        _mm_prefetch((const char *)(v_cache + slot * row + off + l), PF_HINT_V);
                    if (pj < n_keys) {
                        const uint16_t *kp =
                            k_cache + ((int64_t)table[pb] * block_size + po) * row + off;
                        for (int64_t l = 0; l < head_dim; l += 32)
                            _mm_prefetch((const char *)(kp + l), PF_HINT_K);
                        ++pj;
                        if (++po == block_size) {
                            po = 0;
                            ++pb;
                        }
                    }
                    if (++co == block_size) {
                        co = 0;
                        ++cb;
                    }
                }
                for (int c = cnt; c < 16; ++c) krows[c] = krows[cnt - 1];
                for (int64_t r = (j > pos0 ? j - pos0 : 0); r < rows; ++r)
                    for (int64_t g = 0; g < gs; ++g) {
                        const uint16_t *qr = qb + (r * gs + g) * head_dim;
                        __m512 sc;
                        switch (nv) {
                        case 1: sc = dot16_keys(1, qr, krows); break;
                        case 2: sc = dot16_keys(2, qr, krows); break;
                        case 3: sc = dot16_keys(3, qr, krows); break;
                        case 4: sc = dot16_keys(4, qr, krows); break;
                        case 5: sc = dot16_keys(5, qr, krows); break;
                        case 6: sc = dot16_keys(6, qr, krows); break;
                        case 7: sc = dot16_keys(7, qr, krows); break;
                        default: sc = dot16_keys(8, qr, krows); break;
                        }
                        _mm512_storeu_ps(scores + (r * gs + g) * kst + j, sc);
                    }
                j += cnt;
            }
            /* softmax per (r, g): P in bf16, zero from the row's limit up to kst */
            for (int64_t r = 0; r < rows; ++r) {
                int64_t len = pos0 + r + 1;
                if (len > n_keys) len = n_keys;
                for (int64_t g = 0; g < gs; ++g)
                    inv[r * gs + g] = softmax_row_bf16(scores + (r * gs + g) * kst,
                                                  pw + (r * gs + g) * kst, len, kst, scale);
            }
            /* pass 2: the (r, g) combinations in blocks of cpb, each block over the key
             * pairs its last row sees */
            const int64_t nc_all = rows * gs;
            for (int64_t c0 = 0; c0 < nc_all; c0 += cpb) {
                const int64_t nc = nc_all - c0 < cpb ? nc_all - c0 : cpb;
                const uint16_t *pp[8];
                float *op[8];
                for (int64_t c = 0; c < nc; ++c) {
                    const int64_t r = (c0 + c) / gs, g = (c0 + c) % gs;
                    pp[c] = pw + (c0 + c) * kst;
                    op[c] = out + ((q0 + first + r) * num_heads + kvh * group + g_lo + g) * head_dim;
                }
                int64_t len = pos0 + (c0 + nc - 1) / gs + 1; /* the block's last row */
                if (len > n_keys) len = n_keys;
                const int64_t npairs = len > 0 ? (len + 1) / 2 : 0;
                const float *iv = inv + c0;
#define PVB(NC, NV)                                                                        \
    pv_block(NC, NV, pp, iv, op, npairs, n_keys, v_cache, table, block_size, row, off)
                switch (nv) {
                case 1:
                    switch (nc) {
                    case 1: PVB(1, 1); break;
                    case 2: PVB(2, 1); break;
                    case 3: PVB(3, 1); break;
                    case 4: PVB(4, 1); break;
                    case 5: PVB(5, 1); break;
                    case 6: PVB(6, 1); break;
                    case 7: PVB(7, 1); break;
                    default: PVB(8, 1); break;
                    }
                    break;
                case 2:
                    switch (nc) {
                    case 1: PVB(1, 2); break;
                    case 2: PVB(2, 2); break;
                    case 3: PVB(3, 2); break;
                    case 4: PVB(4, 2); break;
                    case 5: PVB(5, 2); break;
                    default: PVB(6, 2); break;
                    }
                    break;
                case 3:
                    switch (nc) {
                    case 1: PVB(1, 3); break;
                    case 2: PVB(2, 3); break;
                    case 3: PVB(3, 3); break;
                    default: PVB(4, 3); break;
                    }
                    break;
                case 4:
                    switch (nc) {
                    case 1: PVB(1, 4); break;
                    case 2: PVB(2, 4); break;
                    default: PVB(3, 4); break;
                    }
                    break;
                case 5:
                    if (nc == 1) PVB(1, 5);
                    else PVB(2, 5);
                    break;
                case 6:
                    if (nc == 1) PVB(1, 6);
                    else PVB(2, 6);
                    break;
                case 7: PVB(1, 7); break;
                default: PVB(1, 8); break;
                }
#undef PVB
            }
        }
    }
    free(pool);
    free(task_start);
    return 0;
}

#else /* no AVX512-BF16 in this build */

int64_t paged_attention_decode_bf16kv(const float *q, int64_t q_token_stride,
                                      const uint16_t *k_cache, const uint16_t *v_cache,
                                      const int32_t *block_tables, int64_t bt_stride,
                                      const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t block_size, float scale,
                                      float *out, int64_t num_threads, int64_t min_rows) {
    (void)q, (void)q_token_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)bt_stride, (void)seq_lens, (void)cu_seqlens_q, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)out;
    (void)num_threads, (void)min_rows;
    return -2;
}

#endif
