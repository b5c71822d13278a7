/*
 * Prefill attention on bf16 KV caches with bf16 products summed in fp32: the chunks of a
 * step that have at least min_rows query rows, on AMX tiles (TDPBF16PS) where
 * gemm_bf16_amx_chosen(), else on AVX512-BF16 register tiles (VDPBF16PS). Decode rows and
 * short chunks go to cpu_attention_decode_bf16.c (same contract) or paged_attention_kv;
 * paged_attention_bf16kv_rows (cpu_kernels.c) calls this first.
 *
 * Why: a prefill chunk's attention is two matrix products per KV head (Q K^T and P V) of
 * chunk x context, and on the AVX512 kernel they ran at ~45 GFLOP/s on the 2-core Xeon
 * (the kernel reads each K/V row once per query row); AMX does 16 x 16 x 32 bf16 products
 * per instruction, VDPBF16PS 16 x 2 per instruction on operands held in registers.
 *
 * Method (the two passes of cpu_kernels.c, on tiles). A task is (sequence, KV head, block of
 * QB query rows). It copies the keys its rows see out of the paged cache into two scratch
 * layouts, so the tile loads need no block table: K^T as TDPBF16PS B tiles (pair row kk of
 * key group g = dimensions 2kk, 2kk+1 of its 16 keys) and V as B tiles of key pairs (pair
 * row kk = keys 2kk, 2kk+1 of a group of 32, interleaved per dimension). Then per query head
 * of the group and 16-row tile: pass 1, S = Q K^T (Q rounded to bf16, round to nearest
 * even; fp32 sums); the softmax per row over the keys its position sees (the causal
 * limit), in fp32, with exp by Cephes' polynomial, and P = bf16(exp(s - max)) (zero past
 * the limit); pass 2, O = P V, divided by the fp32 sum of the unrounded exps. So the
 * products are bf16 x bf16 summed in fp32, as FlashAttention-2 does on GPUs (Dao, 2023) and
 * as vLLM's CPU backend does through oneDNN's AMX kernels for bf16 prefill; scores, softmax
 * and sums stay fp32. A row's result depends only on its sequence's data (not on the batch
 * or the task split), but differs from the AVX512 kernel's (Q and P rounded to bf16), so a
 * chunk's rows take this path by the chunk's length only.
 *
 * The passes come in two variants that share the layouts, the softmax and the task loop.
 * AMX: pass 1 holds 4 key groups per round in 4 C tiles, pass 2 64 dimensions (4 C tiles).
 * AVX512-BF16: the layouts are VDPBF16PS's operands as they are: a kt row kk holds, for 16
 * keys, the pair (dimensions 2kk, 2kk+1) in 16 words, so S[r, 16 keys] += dpbf16(broadcast
 * of q_r's pair kk, kt row kk); a vt row kk holds, for 16 dimensions, the pair (keys 2kk,
 * 2kk+1), so O[r, 16 dimensions] += dpbf16(broadcast of P_r's key pair kk, vt row kk). Pass
 * 1 keeps S1_ROWS rows x S1_GROUPS key groups of accumulators in zmm registers, pass 2
 * S2_ROWS rows x S2_TILES dimension tiles; each accumulator is one row's, summed over
 * the pairs in order, so a row's bits do not depend on the rows blocked with it. The two
 * variants' bits differ (the order of the sums inside an instruction).
 *
 * Built where the compiler targets AVX512F and AVX512-BF16 (-march=native on such a CPU),
 * the AMX variant where it also targets AMX-TILE and AMX-BF16; elsewhere the entry point
 * returns -2 and paged_attention_kv does all. PAGEDSERVE_CPU_AMX_ATTENTION=0 turns the path
 * off; N > 0 sets min_rows (default 16). PAGEDSERVE_CPU_AMX=0 (gemm_bf16_amx_chosen() == 0)
 * picks the AVX512-BF16 variant on an AMX CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

int64_t gemm_bf16_amx_chosen(void); /* cpu_gemm_bf16.c: AMX granted and not turned off */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATTN_AMX 1 /* the AMX variant is built */
#else
#define ATTN_AMX 0
#endif

#define TR 16           /* rows of a tile; keys of a key group */
#define QB 64           /* query rows per task */
#define MAX_HEAD_DIM 256
#define DEFAULT_MIN_ROWS 16
/* AVX512-BF16 register blocks, accumulators in zmm registers (on the 2-core EPYC, Zen 4,
 * these ran prefill 8 x 512 ~10% faster than 4 rows x 4 groups and 4 rows x 4 tiles) */
#define S1_ROWS 8   /* pass 1: query rows per block (divides TR) */
#define S1_GROUPS 3 /* and key groups: 24 accumulators, 3 kt rows and a broadcast */
#define S2_ROWS 8   /* pass 2: query rows per block (divides TR) */
#define S2_TILES 2  /* and dimension tiles of 16 (divides head_dim / 16): 16 accumulators */

static pthread_once_t amx_attn_once = PTHREAD_ONCE_INIT;
static int64_t amx_attn_rows;

static void amx_attn_init(void) {
    const char *env = getenv("PAGEDSERVE_CPU_AMX_ATTENTION");
    int64_t rows = DEFAULT_MIN_ROWS;
    if (env != NULL && env[0] != '\0') {
        char *end = NULL;
        const long v = strtol(env, &end, 10);
        if (end != env && *end == '\0') {
            rows = v > 0 ? (int64_t)v : 0;
        } else if (env_off("PAGEDSERVE_CPU_AMX_ATTENTION")) {
            rows = 0;
        }
    }
    amx_attn_rows = rows;
}

/* Chunks of at least this many query rows take the tile path (AMX or AVX512-BF16); 0: the
 * path is off. */
int64_t attention_amx_min_rows(void) {
    pthread_once(&amx_attn_once, amx_attn_init);
    return amx_attn_rows;
}

/* A key row (head_dim bf16 of KV head kvh) of key j of a sequence, through its table. */
static inline const uint16_t *key_row(const uint16_t *cache, const int32_t *table, int64_t j,
                                      int64_t block_size, int64_t row, int64_t off) {
    const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
    return cache + slot * row + off;
}

/* Rows first .. first + count of a sequence's cache (keys past n_keys as zeros) into dst,
 * head_dim bf16 each, contiguous. */
static inline void copy_rows(uint16_t *dst, const uint16_t *cache, const int32_t *table,
                             int64_t first, int64_t count, int64_t n_keys, int64_t block_size,
                             int64_t row, int64_t off, int64_t head_dim) {
    for (int64_t n = 0; n < count; ++n) {
        const int64_t j = first + n;
        if (j < n_keys)
            memcpy(dst + n * head_dim, key_row(cache, table, j, block_size, row, off),
                   sizeof(uint16_t) * head_dim);
        else
            memset(dst + n * head_dim, 0, sizeof(uint16_t) * head_dim);
    }
}

/*
 * Scratch of one thread, in uint32 words: kt (K^T tiles), vt (V pair tiles), rows (32 copied
 * cache rows), q (the task's queries in bf16), s (16 score rows), p (16 bf16 probability
 * rows), o (one 16 x 64 fp32 output block), inv (16 fp32).
 */
typedef struct {
    uint32_t *kt, *vt, *rows, *q;
    float *s, *o, *inv;
    uint16_t *p;
} scratch_t;

static size_t scratch_words(int64_t keys_pad, int64_t head_dim, int64_t group) {
    return (size_t)(keys_pad * head_dim / 2) * 2 /* kt, vt */ + 32 * head_dim / 2 +
           (size_t)(group * QB * head_dim / 2) + 16 * keys_pad /* s */ + 8 * keys_pad /* p */ +
           16 * 64 + 16 + 64 /* alignment slack */;
}

static scratch_t scratch_at(uint32_t *base, int64_t keys_pad, int64_t head_dim, int64_t group) {
    scratch_t sc;
    uint32_t *w = base;
    sc.kt = w;
    w += keys_pad * head_dim / 2;
    sc.vt = w;
    w += keys_pad * head_dim / 2;
    sc.rows = w;
    w += 32 * head_dim / 2;
    sc.q = w;
    w += group * QB * head_dim / 2;
    sc.s = (float *)w;
    w += 16 * keys_pad;
    sc.p = (uint16_t *)w;
    w += 8 * keys_pad;
    sc.o = (float *)w;
    w += 16 * 64;
    sc.inv = (float *)w;
    return sc;
}

/*
 * Keys [0, n_keys) of one (sequence, KV head) into sc.kt and sc.vt, zero up to keys_pad
 * (a multiple of 32). kt: for key group g (16 keys) and dimension block b (32 values), a
 * 16 x 16-word tile whose row kk, word n = key 16g + n's dimensions 32b + 2kk, +1.
 * vt: for key pair group g (32 keys) and dimension tile t (16 values), a 16 x 16-word tile
 * whose row kk, word n = (V[32g + 2kk][16t + n], V[32g + 2kk + 1][16t + n]).
 */
static void prepare_kv(const scratch_t *sc, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *table, int64_t n_keys, int64_t keys_pad,
                       int64_t block_size, int64_t row, int64_t off, int64_t head_dim) {
    const int64_t hw = head_dim / 2; /* words per row */
    const int64_t nb = head_dim / 32, nt = head_dim / 16;
    uint16_t *rows = (uint16_t *)sc->rows;
    __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                     _mm512_set1_epi32((int)hw));
    for (int64_t g = 0; g < keys_pad / TR; ++g) {
        copy_rows(rows, k_cache, table, g * TR, TR, n_keys, block_size, row, off, head_dim);
        for (int64_t b = 0; b < nb; ++b) {
            uint32_t *tile = sc->kt + (g * nb + b) * 256;
            for (int64_t kk = 0; kk < 16; ++kk) {
                const __m512i v = _mm512_i32gather_epi32(
                    _mm512_add_epi32(idx, _mm512_set1_epi32((int)(b * 16 + kk))), rows, 4);
                _mm512_store_si512((void *)(tile + kk * 16), v);
            }
        }
    }
    for (int64_t g = 0; g < keys_pad / 32; ++g) {
        copy_rows(rows, v_cache, table, g * 32, 32, n_keys, block_size, row, off, head_dim);
        for (int64_t t = 0; t < nt; ++t) {
            uint32_t *tile = sc->vt + (g * nt + t) * 256;
            for (int64_t kk = 0; kk < 16; ++kk) {
                const __m512i lo = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(rows + (2 * kk) * head_dim + 16 * t)));
                const __m512i hi = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(rows + (2 * kk + 1) * head_dim + 16 * t)));
                _mm512_store_si512((void *)(tile + kk * 16),
                                   _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }
}

#if ATTN_AMX
/* AMX pass 1: S (16 rows, row stride lds) = Q K^T over key groups [0, groups), 4 groups per
 * round in C tiles 0-3; every row of the tile, those past the chunk's zero queries too. */
static void scores_amx(const scratch_t *sc, const uint16_t *qb, int64_t groups,
                       int64_t head_dim, int64_t lds) {
    const int64_t nb = head_dim / 32;
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        const int64_t gn = groups - g0 < 4 ? groups - g0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < nb; ++b) {
            _tile_loadd(4, qb + 32 * b, head_dim * 2);
            const uint32_t *kt = sc->kt + (g0 * nb + b) * 256;
            _tile_loadd(5, kt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (gn > 1) {
                _tile_loadd(6, kt + nb * 256, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (gn > 2) {
                _tile_loadd(7, kt + 2 * nb * 256, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (gn > 3) {
                _tile_loadd(5, kt + 3 * nb * 256, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        float *s = sc->s + g0 * TR;
        _tile_stored(0, s, lds * 4);
        if (gn > 1) _tile_stored(1, s + TR, lds * 4);
        if (gn > 2) _tile_stored(2, s + 2 * TR, lds * 4);
        if (gn > 3) _tile_stored(3, s + 3 * TR, lds * 4);
    }
}

/* AMX pass 2: rows r < valid of out (row stride out_stride) = (P V) * inv[r], P over key
 * pairs [0, pairs), 64 dimensions (4 C tiles) per round. */
static void weighted_sum_amx(const scratch_t *sc, int64_t pairs, int64_t valid,
                             int64_t head_dim, int64_t lds, float *out, int64_t out_stride) {
    const int64_t nt = head_dim / 16;
    for (int64_t t0 = 0; t0 < nt; t0 += 4) {
        const int64_t tn = nt - t0 < 4 ? nt - t0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < pairs; ++g) {
            _tile_loadd(4, sc->p + 32 * g, lds * 2);
            const uint32_t *vt = sc->vt + (g * nt + t0) * 256;
            _tile_loadd(5, vt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (tn > 1) {
                _tile_loadd(6, vt + 256, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (tn > 2) {
                _tile_loadd(7, vt + 512, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (tn > 3) {
                _tile_loadd(5, vt + 768, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, sc->o, 256);
        if (tn > 1) _tile_stored(1, sc->o + 16, 256);
        if (tn > 2) _tile_stored(2, sc->o + 32, 256);
        if (tn > 3) _tile_stored(3, sc->o + 48, 256);
        for (int64_t r = 0; r < valid; ++r) {
            const __m512 inv = _mm512_set1_ps(sc->inv[r]);
            for (int64_t t = 0; t < tn; ++t)
                _mm512_storeu_ps(out + r * out_stride + 16 * (t0 + t),
                                 _mm512_mul_ps(_mm512_load_ps(sc->o + r * 64 + 16 * t), inv));
        }
    }
}
#endif

/* AVX512-BF16 pass 1 on a register block: S rows 0 .. S1_ROWS - 1 (row stride lds), keys of
 * groups 0 .. gn - 1 of kt (each group hw pair rows of 16 words); q: the rows' bf16 pairs,
 * row stride hw words. gn is a constant at each call, so acc stays in registers. */
static inline __attribute__((always_inline)) void scores_block(const uint32_t *q, int64_t hw,
                                                               const uint32_t *kt, float *s,
                                                               int64_t lds, const int gn) {
    __m512 acc[S1_ROWS][S1_GROUPS];
#pragma GCC unroll 16
    for (int r = 0; r < S1_ROWS; ++r)
#pragma GCC unroll 16
        for (int g = 0; g < gn; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < hw; ++kk) {
        __m512bh b[S1_GROUPS];
#pragma GCC unroll 16
        for (int g = 0; g < gn; ++g)
            b[g] = (__m512bh)_mm512_load_si512((const void *)(kt + (g * hw + kk) * 16));
#pragma GCC unroll 16
        for (int r = 0; r < S1_ROWS; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[r * hw + kk]);
#pragma GCC unroll 16
            for (int g = 0; g < gn; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, b[g]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < S1_ROWS; ++r)
#pragma GCC unroll 16
        for (int g = 0; g < gn; ++g) _mm512_storeu_ps(s + r * lds + 16 * g, acc[r][g]);
}

/* AVX512-BF16 pass 1: rows r < valid (rounded up to S1_ROWS: the padding rows' queries are
 * zeros) of S = Q K^T over key groups [0, groups). */
static void scores_avx512(const scratch_t *sc, const uint16_t *qb, int64_t valid,
                          int64_t groups, int64_t head_dim, int64_t lds) {
    const int64_t hw = head_dim / 2;
    for (int64_t r0 = 0; r0 < valid; r0 += S1_ROWS) {
        const uint32_t *q = (const uint32_t *)qb + r0 * hw;
        float *s = sc->s + r0 * lds;
        int64_t g = 0;
        for (; g + S1_GROUPS <= groups; g += S1_GROUPS)
            scores_block(q, hw, sc->kt + g * hw * 16, s + 16 * g, lds, S1_GROUPS);
        const uint32_t *kt = sc->kt + g * hw * 16;
        switch (groups - g) { /* the last 1 .. S1_GROUPS - 1 groups */
        case 2: scores_block(q, hw, kt, s + 16 * g, lds, 2); break;
        case 1: scores_block(q, hw, kt, s + 16 * g, lds, 1); break;
        default: break;
        }
    }
}

/* AVX512-BF16 pass 2 on a register block: rows r < rn (of S2_ROWS) of out (row stride
 * out_stride), dimension tiles 0 .. tn - 1 of vt (tile t of key pair group g at
 * vt + (g * nt + t) * 256) = (P V) * inv[r], P over key pair groups [0, pairs); p: the rows'
 * key pairs, row stride ldp words. tn is a constant at each call. */
static inline __attribute__((always_inline)) void weighted_sum_block(
    const uint32_t *p, int64_t ldp, const uint32_t *vt, int64_t nt, int64_t pairs,
    const float *inv, int64_t rn, float *out, int64_t out_stride, const int tn) {
    __m512 acc[S2_ROWS][S2_TILES];
#pragma GCC unroll 16
    for (int r = 0; r < S2_ROWS; ++r)
#pragma GCC unroll 16
        for (int t = 0; t < tn; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < pairs; ++g) {
        const uint32_t *v = vt + g * nt * 256;
        const uint32_t *pg = p + 16 * g;
        for (int64_t kk = 0; kk < 16; ++kk) {
            __m512bh b[S2_TILES];
#pragma GCC unroll 16
            for (int t = 0; t < tn; ++t)
                b[t] = (__m512bh)_mm512_load_si512((const void *)(v + t * 256 + kk * 16));
#pragma GCC unroll 16
            for (int r = 0; r < S2_ROWS; ++r) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pg[r * ldp + kk]);
#pragma GCC unroll 16
                for (int t = 0; t < tn; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, b[t]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < S2_ROWS; ++r) {
        if (r >= rn) break;
        const __m512 iv = _mm512_set1_ps(inv[r]);
#pragma GCC unroll 16
        for (int t = 0; t < tn; ++t)
            _mm512_storeu_ps(out + r * out_stride + 16 * t, _mm512_mul_ps(acc[r][t], iv));
    }
}

/* AVX512-BF16 pass 2: rows r < valid of out = (P V) * inv[r], P over key pairs
 * [0, pairs) (rows past valid are zeros). */
static void weighted_sum_avx512(const scratch_t *sc, int64_t pairs, int64_t valid,
                                int64_t head_dim, int64_t lds, float *out,
                                int64_t out_stride) {
    const int64_t nt = head_dim / 16, ldp = lds / 2;
    for (int64_t r0 = 0; r0 < valid; r0 += S2_ROWS) {
        const uint32_t *p = (const uint32_t *)sc->p + r0 * ldp;
        const int64_t rn = valid - r0 < S2_ROWS ? valid - r0 : S2_ROWS;
        float *o = out + r0 * out_stride;
        for (int64_t t = 0; t < nt; t += S2_TILES)
            weighted_sum_block(p, ldp, sc->vt + t * 256, nt, pairs, sc->inv + r0, rn,
                               o + 16 * t, out_stride, S2_TILES);
    }
}

/* The softmax of rows r < TR of S (row stride lds) over keys [0, pos + r] (up to lim): P in
 * bf16 up to lim32 (zero past the row's limit, whole rows r >= valid zero), inv[r] = 1 / the
 * fp32 sum of the unrounded exps. */
static void softmax_rows(const scratch_t *sc, int64_t valid, int64_t pos, int64_t lim,
                         int64_t lim32, int64_t lds, float scale) {
    for (int64_t r = 0; r < TR; ++r) {
        const int64_t len = r < valid ? (pos + r + 1 < lim ? pos + r + 1 : lim) : 0;
        sc->inv[r] = softmax_row_bf16(sc->s + r * lds, sc->p + r * lds, len,
                                      len > 0 ? lim32 : lds, scale);
    }
}

/* One query head's 16-row tile: rows r < valid at positions pos + r, queries qb (bf16, row
 * stride head_dim, zeros past valid up to TR), output rows out + r * out_stride; on AMX
 * tiles when amx, else on AVX512-BF16 registers. */
static void tile_attention(const scratch_t *sc, const uint16_t *qb, int64_t valid, int64_t pos,
                           int64_t n_keys, int64_t head_dim, float scale, float *out,
                           int64_t out_stride, int amx) {
    int64_t lim = pos + TR; /* keys the tile's last row could see */
    if (lim > n_keys) lim = n_keys;
    if (lim < 0) lim = 0;
    const int64_t groups = (lim + TR - 1) / TR;
    const int64_t lim32 = (lim + 31) / 32 * 32;
    const int64_t lds = lim32 > 0 ? lim32 : 32; /* row stride of s and p */
#if ATTN_AMX
    if (amx) {
        scores_amx(sc, qb, groups, head_dim, lds);
        softmax_rows(sc, valid, pos, lim, lim32, lds, scale);
        weighted_sum_amx(sc, lim32 / 32, valid, head_dim, lds, out, out_stride);
        return;
    }
#else
    (void)amx;
#endif
    scores_avx512(sc, qb, valid, groups, head_dim, lds);
    softmax_rows(sc, valid, pos, lim, lim32, lds, scale);
    weighted_sum_avx512(sc, lim32 / 32, valid, head_dim, lds, out, out_stride);
}

/*
 * The chunks of at least min_rows query rows, as paged_attention_bf16kv's arguments
 * describe them (cpu_kernels.c); other chunks are not touched. Returns 0 when done, -2
 * when the path does not apply (head_dim not a multiple of 32 up to 256, min_rows < 1) and
 * -1 when the scratch cannot be allocated; out is untouched unless it returns 0.
 */
int64_t paged_attention_amx_bf16kv(const float *q, int64_t q_token_stride,
                                   const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, float scale, float *out,
                                   int64_t num_threads, int64_t min_rows) {
    if (min_rows < 1 || head_dim % 32 != 0 || head_dim > MAX_HEAD_DIM) return -2;
    const int amx = ATTN_AMX && gemm_bf16_amx_chosen();
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    int64_t any = 0; /* a decode-only step returns here, before any allocation */
    for (int64_t s = 0; s < num_seqs && !any; ++s)
        any = cu_seqlens_q[s + 1] - cu_seqlens_q[s] >= min_rows;
    if (!any) return 0;
    int64_t *task_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    if (task_start == NULL) return -1;
    int64_t max_keys = 0;
    task_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        const int64_t blocks = q_len >= min_rows ? (q_len + QB - 1) / QB : 0;
        task_start[s + 1] = task_start[s] + blocks * num_kv_heads;
        if (blocks > 0 && seq_lens[s] > max_keys) max_keys = seq_lens[s];
    }
    const int64_t num_tasks = task_start[num_seqs];
    if (num_tasks == 0) {
        free(task_start);
        return 0;
    }
    const int64_t keys_pad = (max_keys + 31) / 32 * 32;
    const size_t words = (scratch_words(keys_pad, head_dim, group) + 15) / 16 * 16;
    uint32_t *pool = aligned_alloc(64, words * sizeof(uint32_t) * (size_t)threads);
    if (pool == NULL) {
        free(task_start);
        return -1;
    }
#if ATTN_AMX
    tile_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TR;
    }
#endif
#pragma omp parallel num_threads(threads) if (num_tasks > 1)
    {
        const int tid = omp_get_thread_num();
        const scratch_t sc = scratch_at(pool + words * (size_t)tid, keys_pad, head_dim, group);
#if ATTN_AMX
        if (amx) _tile_loadconfig(&cfg);
#endif
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            attn_task_seq(task_start, task, &s);
            const attn_heads_t hd = attn_heads(task - task_start[s], 1, group, group, num_kv_heads);
            const int64_t kvh = hd.kvh;
            const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
            /* a sequence's last rows (the most keys) first: the longest tasks start early */
            const attn_q_tile_t qt =
                attn_q_tile(cu_seqlens_q, seq_lens, s, (q_len + QB - 1) / QB - 1 - hd.tile, QB);
            const int64_t q0 = qt.q0, first = qt.first, rows = qt.rows;
            const int64_t pos0 = qt.pos0, n_keys = qt.n_keys;
            const int64_t pad = (n_keys + 31) / 32 * 32;
            prepare_kv(&sc, k_cache, v_cache, block_tables + s * bt_stride, n_keys, pad,
                       block_size, row, kvh * head_dim, head_dim);
            /* the task's queries in bf16: head g, row r at sc.q + (g * QB + r) * head_dim */
            uint16_t *qb = (uint16_t *)sc.q;
            const int64_t tiles = (rows + TR - 1) / TR;
            for (int64_t g = 0; g < group; ++g)
                for (int64_t r = 0; r < tiles * TR; ++r) {
                    uint16_t *dst = qb + (g * QB + r) * head_dim;
                    if (r >= rows) {
                        memset(dst, 0, sizeof(uint16_t) * head_dim);
                        continue;
                    }
                    const float *src =
                        q + (q0 + first + r) * q_token_stride + (kvh * group + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d += 16) {
                        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + d));
                        memcpy(dst + d, &h, sizeof(h));
                    }
                }
            for (int64_t g = 0; g < group; ++g)
                for (int64_t t = 0; t < tiles; ++t) {
                    const int64_t r0 = t * TR;
                    const int64_t valid = rows - r0 < TR ? rows - r0 : TR;
                    float *o = out + ((q0 + first + r0) * num_heads + kvh * group + g) * head_dim;
                    tile_attention(&sc, qb + (g * QB + r0) * head_dim, valid, pos0 + r0, n_keys,
                                   head_dim, scale, o, num_heads * head_dim, amx);
                }
        }
#if ATTN_AMX
        if (amx) _tile_release();
#endif
    }
    free(pool);
    free(task_start);
    return 0;
}

#else /* no AVX512-BF16 in this build: no tile path */

int64_t attention_amx_min_rows(void) { return 0; }

int64_t paged_attention_amx_bf16kv(const float *q, int64_t q_token_stride,
                                   const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, float scale, float *out,
                                   int64_t num_threads, int64_t min_rows) {
    (void)q, (void)q_token_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)bt_stride, (void)seq_lens, (void)cu_seqlens_q, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)out;
    (void)num_threads, (void)min_rows;
    return -2;
}

#endif
