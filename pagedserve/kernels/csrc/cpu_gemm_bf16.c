/*
 * bf16-weight GEMM for the bf16 CPU path's linear layers: out[M, N] (fp32) = x[M, K] @ W[N, K]^T
 * (+ bias), x fp32 or bf16, W packed once into column panels of bf16 pairs, products of bf16
 * values summed in fp32 with AVX512-BF16's VDPBF16PS (_mm512_dpbf16_ps).
 *
 * Why: a decode step streams every weight from memory once; bf16 weights halve those bytes
 * against the fp32 kernel (cpu_gemm.c), and VDPBF16PS does two multiply-adds per fp32 lane
 * per instruction. The blocking is cpu_gemm.c's (Goto and van de Geijn, ACM TOMS 2008):
 * panels of NR columns split over the threads, each streamed once per block of MC rows.
 *
 * Packed layout: K is padded to an even KP = 2 * ceil(K / 2); panel p holds columns
 * [p * NR, p * NR + NR) as packed[p][kk][j][e] = bf16(W[p * NR + j][2 * kk + e]) for
 * kk < KP / 2, e in {0, 1} (zero past N and past K): ceil(N / NR) * (KP / 2) * NR * 2 bf16
 * values. One k pair of a panel is 3 vectors of 32 bf16 = 16 fp32 lanes each.
 *
 * Activations are rounded to bf16 per call, round to nearest even with NaN kept NaN (as
 * torch's x.to(torch.bfloat16)); a bf16 x is used as is (the AVX512-BF16 kernels read
 * bf16 rows of even K in place, see x_pairs).
 *
 * Two kernels read that layout. linear_packed_bf16_avx512: VDPBF16PS on 16-lane vectors
 * (each output element starts from 0 and takes, for kk = 0 .. KP/2 - 1 in order, the two
 * exact bf16 x bf16 products of pair kk, each added with one fp32 rounding, the
 * instruction's order). linear_packed_bf16_amx: AMX tiles, TDPBF16PS (A = up to 16 rows of
 * x x 32 K values, B = 16 pairs x 16 columns, which is a panel's rows kk .. kk + 15 read
 * with a 192-byte row stride, so both kernels share the one packed copy; C = 16 x 16 fp32;
 * up to 16 rows 1 A x 3 B tiles per panel, from 17 rows 2 A x 2 B tiles per 32 x 32 block;
 * each element takes one TDPBF16PS step per 32 K values, in order, the hardware's sum
 * within a step). In both the bias is added last, and a row's result depends only on that
 * row and W, not on M or on the other rows: batch invariant by construction. Both treat
 * denormal inputs as zero and flush denormal results (they ignore MXCSR). linear_packed_bf16
 * runs AMX where gemm_bf16_amx_chosen(), else AVX512-BF16.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU defines
 * __AVX512BF16__); elsewhere this file gives gemm_bf16_supported() == 0 and stubs that do
 * nothing, so the library still builds and its fp32 kernels still run. The AMX kernel is
 * built where it also targets AMX-TILE and AMX-BF16 (__AMX_TILE__, __AMX_BF16__); it runs
 * once Linux grants the process the tile state (asked once, see amx_init).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define NR 48  /* output columns per panel: 3 vectors of 16 fp32 lanes */
#define MR 8   /* rows of x per micro-kernel call */
#define MC 256 /* rows of x per outer block */

int64_t gemm_bf16_panel_width(void) { return NR; }

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define GEMM_BF16_BUILT 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GEMM_AMX_BUILT 1
#endif
#endif

/* The AVX512-BF16 kernels and the AMX ones: where GEMM_BF16_BUILT / GEMM_AMX_BUILT, else
 * stubs that decline (all defined below; the dispatchers at the end call them). */
int64_t linear_packed_bf16_avx512(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                  int64_t ldx, const uint16_t *packed, int64_t n,
                                  const float *bias, float *out, int64_t ldo,
                                  int64_t num_threads);
int64_t linear_packed_bf16_silu_mul_avx512(const void *x, int64_t x_bf16, int64_t m,
                                           int64_t k, int64_t ldx, const uint16_t *packed,
                                           int64_t inter, const float *bias, uint16_t *act,
                                           int64_t ldo, int64_t num_threads);
int64_t gemm_bf16_amx_supported(void);
int64_t gemm_bf16_amx_chosen(void);
int64_t linear_packed_bf16_amx(const void *x, int64_t x_bf16, int64_t m, int64_t k, int64_t ldx,
                               const uint16_t *packed, int64_t n, const float *bias, float *out,
                               int64_t ldo, int64_t num_threads);
int64_t linear_packed_bf16_silu_mul_amx(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                        int64_t ldx, const uint16_t *packed, int64_t inter,
                                        const float *bias, uint16_t *act, int64_t ldo,
                                        int64_t num_threads);

#if defined(GEMM_BF16_BUILT)
#include <immintrin.h>

int64_t gemm_bf16_supported(void) { return 1; }

/* torch's c10::BFloat16 rounding: nearest even, any NaN -> 0x7fc0. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 fp32 -> 16 bf16 bit patterns, the same rounding as to_bf16. */
static inline __m256i to_bf16_x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* packed as described above, from w (fp32, or bf16 bits when w_bf16), row stride ldw. */
void pack_weight_bf16(const void *w, int64_t w_bf16, int64_t n, int64_t k, int64_t ldw,
                      uint16_t *packed, int64_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t kp2 = (k + 1) / 2;
    const float *wf = (const float *)w;
    const uint16_t *wb = (const uint16_t *)w;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) if (panels > 1)
    for (int64_t p = 0; p < panels; ++p) {
        uint16_t *dst = packed + p * kp2 * NR * 2;
        const int64_t cols = (n - p * NR) < NR ? (n - p * NR) : NR;
        for (int64_t kk = 0; kk < kp2; ++kk) {
            uint16_t *row = dst + kk * NR * 2;
            for (int64_t j = 0; j < NR; ++j) {
                for (int64_t e = 0; e < 2; ++e) {
                    const int64_t c = 2 * kk + e;
                    uint16_t v = 0;
                    if (j < cols && c < k) {
                        const int64_t at = (p * NR + j) * ldw + c;
                        v = w_bf16 ? wb[at] : to_bf16(wf[at]);
                    }
                    row[2 * j + e] = v;
                }
            }
        }
    }
}

/*
 * The calling thread's activation scratch of at least `words` 32-bit words (64-byte aligned),
 * kept between calls and grown as needed (freed at thread exit): a prefill's bf16 rows are
 * megabytes, which malloc would map fresh and the kernel fault in page by page on every call.
 * The buffer is valid until the thread's next call; NULL when it cannot be allocated.
 */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

typedef struct {
    uint32_t *data;
    size_t words;
} scratch_t;

static void scratch_free(void *p) {
    scratch_t *s = (scratch_t *)p;
    free(s->data);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static uint32_t *thread_scratch(size_t words) {
    pthread_once(&scratch_once, scratch_init);
    scratch_t *s = (scratch_t *)pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = (scratch_t *)calloc(1, sizeof(scratch_t));
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->words < words) {
        const size_t want = (words * sizeof(uint32_t) + 63) / 64 * 64;
        uint32_t *data = aligned_alloc(64, want);
        if (data == NULL) return NULL;
        free(s->data);
        s->data = data;
        s->words = want / sizeof(uint32_t);
    }
    return s->data;
}

/* Row r of x as kp2 bf16 pairs (zero-padded when k is odd) into dst. */
static void convert_row(const void *x, int64_t x_bf16, int64_t k, uint16_t *dst, int64_t kp2) {
    if (x_bf16) {
        memcpy(dst, x, sizeof(uint16_t) * k);
    } else {
        const float *xf = (const float *)x;
        int64_t c = 0;
        for (; c + 16 <= k; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c), to_bf16_x16(_mm512_loadu_ps(xf + c)));
        for (; c < k; ++c) dst[c] = to_bf16(xf[c]);
    }
    if (k < 2 * kp2) dst[k] = 0;
}

/*
 * x as the micro-kernels read it: rows of bf16 pairs, row stride *ldxb pairs. bf16 rows of
 * even K at a 4-byte-aligned address with an even row stride are read in place (*scratch =
 * NULL: no copy, the same values); other x are converted by convert_row into the calling
 * thread's scratch (*scratch: where the caller's threads write them, rows padded to whole
 * 64-byte lines). NULL when the scratch cannot be allocated.
 */
static const uint32_t *x_pairs(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                               int64_t ldx, int64_t *ldxb, uint32_t **scratch) {
    if (x_bf16 && k % 2 == 0 && ldx % 2 == 0 && ((uintptr_t)x & 3u) == 0) {
        *ldxb = ldx / 2;
        *scratch = NULL;
        return (const uint32_t *)x;
    }
    *ldxb = ((k + 1) / 2 + 15) / 16 * 16;
    *scratch = thread_scratch((size_t)(m * *ldxb));
    return *scratch;
}

/*
 * One micro-tile: mr rows of bf16-pair x (row stride ldxb pairs) times np consecutive
 * panels, into out (row stride ldo), writing cols (<= np * NR) columns. mr and np are
 * compile-time constants at every call site, so the accumulators live in registers.
 */
static inline __attribute__((always_inline)) void micro(const int mr, const int np,
                                                        const uint32_t *xb, int64_t ldxb,
                                                        const uint16_t *panel, int64_t kp2,
                                                        const float *bias, float *out,
                                                        int64_t ldo, int64_t cols,
                                                        const char *pf, int64_t pf_lines) {
    __m512 acc[MR][12];
    for (int r = 0; r < mr; ++r)
        for (int v = 0; v < 3 * np; ++v) acc[r][v] = _mm512_setzero_ps();
    const int64_t stride = kp2 * NR * 2; /* bf16 values between consecutive panels */
    const int64_t pf_step = (pf_lines + kp2 - 1) / (kp2 > 0 ? kp2 : 1);
    for (int64_t kk = 0; kk < kp2; ++kk) {
        if (kk * pf_step < pf_lines)
            for (int64_t l = 0; l < pf_step && kk * pf_step + l < pf_lines; ++l)
                __builtin_prefetch(pf + (kk * pf_step + l) * 64, 0, 2);
        __m512bh b[12];
        for (int q = 0; q < np; ++q) {
            const __m512i *bp = (const __m512i *)(panel + q * stride + kk * NR * 2);
            b[3 * q] = (__m512bh)_mm512_loadu_si512(bp);
            b[3 * q + 1] = (__m512bh)_mm512_loadu_si512(bp + 1);
            b[3 * q + 2] = (__m512bh)_mm512_loadu_si512(bp + 2);
        }
        for (int r = 0; r < mr; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[r * ldxb + kk]);
            for (int v = 0; v < 3 * np; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
    float bb[4 * NR];
    if (bias != NULL) {
        memcpy(bb, bias, sizeof(float) * cols);
        for (int64_t j = cols; j < np * NR; ++j) bb[j] = 0.0f;
        for (int r = 0; r < mr; ++r)
            for (int v = 0; v < 3 * np; ++v)
                acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bb + 16 * v));
    }
    if (cols == np * NR) {
        for (int r = 0; r < mr; ++r)
            for (int v = 0; v < 3 * np; ++v) _mm512_storeu_ps(out + r * ldo + 16 * v, acc[r][v]);
    } else {
        for (int r = 0; r < mr; ++r) {
            for (int v = 0; v < 3 * np; ++v) _mm512_storeu_ps(bb + 16 * v, acc[r][v]);
            memcpy(out + r * ldo, bb, sizeof(float) * cols);
        }
    }
}

static void tile(int64_t mr, int64_t np, const uint32_t *xb, int64_t ldxb,
                 const uint16_t *panel, int64_t kp2, const float *bias, float *out,
                 int64_t ldo, int64_t cols, const char *pf, int64_t pf_lines) {
    if (np == 4) {
        micro(1, 4, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines);
        return;
    }
    if (np == 2) {
        if (mr == 4)
            micro(4, 2, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines);
        else if (mr == 3)
            micro(3, 2, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines);
        else if (mr == 2)
            micro(2, 2, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines);
        else
            micro(1, 2, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines);
        return;
    }
    switch (mr) {
    case 8: micro(8, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    case 7: micro(7, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    case 6: micro(6, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    case 5: micro(5, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    case 4: micro(4, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    case 3: micro(3, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    case 2: micro(2, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    default: micro(1, 1, xb, ldxb, panel, kp2, bias, out, ldo, cols, pf, pf_lines); break;
    }
}

/*
 * out[M, N] (row stride ldo, fp32) = x[M, K] (row stride ldx elements; fp32, or bf16 bits
 * when x_bf16) @ W^T + bias (fp32 or NULL), W packed by pack_weight_bf16. Returns 0, or -1
 * when the activation scratch cannot be allocated (out is then untouched).
 */
int64_t linear_packed_bf16_avx512(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                  int64_t ldx, const uint16_t *packed, int64_t n,
                                  const float *bias, float *out, int64_t ldo,
                                  int64_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t kp2 = (k + 1) / 2;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    int64_t ldxb;
    uint32_t *fill;
    const uint32_t *xb = x_pairs(x, x_bf16, m, k, ldx, &ldxb, &fill);
    if (xb == NULL) return -1;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    int64_t group = m == 1 ? 4 : (m <= 4 ? 2 : 1);
    while (group > 1) { /* as in linear_packed_f32: never leave a thread idle */
        const int64_t busiest = ((panels + group - 1) / group + threads - 1) / threads * group;
        const int64_t half = group / 2;
        const int64_t busiest_half = ((panels + half - 1) / half + threads - 1) / threads * half;
        if (busiest_half >= busiest) break;
        group = half;
    }
    const int64_t groups = (panels + group - 1) / group;
    const int64_t panel_size = kp2 * NR * 2;
#pragma omp parallel num_threads(threads) if (threads > 1 && (groups > 1 || m > 1))
    {
        if (fill != NULL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r)
                convert_row((const char *)x + (size_t)(r * ldx) * elem, x_bf16, k,
                            (uint16_t *)(fill + r * ldxb), kp2);
        }
        /* One task per (block of MC rows, group of panels), handed out in that order as
         * threads ask: a thread delayed by another process (a serving CPU is shared with
         * the frontend and the scheduler) leaves its tasks to the others instead of
         * holding them at a barrier. Each output element is one task's, whichever thread
         * runs it: the bits do not depend on the split. */
        const int64_t mblocks = (m + MC - 1) / MC;
        /* consecutive groups per hand-out, so the group a task prefetches is mostly the
         * same thread's next one: a quarter of a thread's share of a row block */
        const int64_t chunk = groups / (4 * threads) > 1 ? groups / (4 * threads) : 1;
#pragma omp for schedule(dynamic, chunk)
        for (int64_t task = 0; task < mblocks * groups; ++task) {
            const int64_t m0 = task / groups * MC, g = task % groups;
            const int64_t mc = (m - m0) < MC ? (m - m0) : MC;
            const int64_t p = g * group;
            const int64_t np = (panels - p) < group ? (panels - p) : group;
            const uint16_t *panel = packed + p * panel_size;
            const int64_t cols = (n - p * NR) < np * NR ? (n - p * NR) : np * NR;
            const float *bp = bias == NULL ? NULL : bias + p * NR;
            if (np == group) {
                /* the next group is brought into L2 a slice per row block */
                const int64_t blocks = (mc + MR - 1) / MR;
                const int64_t next_lines = (p + np < panels) ? np * panel_size * 2 / 64 : 0;
                const int64_t slice = (next_lines + blocks - 1) / blocks;
                const char *next = (const char *)(packed + (p + np) * panel_size);
                for (int64_t r0 = 0, j = 0; r0 < mc; r0 += MR, ++j) {
                    const int64_t mr = (mc - r0) < MR ? (mc - r0) : MR;
                    int64_t lines = next_lines - j * slice;
                    lines = lines < 0 ? 0 : (lines < slice ? lines : slice);
                    tile(mr, np, xb + (m0 + r0) * ldxb, ldxb, panel, kp2, bp,
                         out + (m0 + r0) * ldo + p * NR, ldo, cols, next + j * slice * 64,
                         lines);
                }
            } else { /* the last, short group: one panel at a time */
                for (int64_t q = 0; q < np; ++q) {
                    const int64_t c = (n - (p + q) * NR) < NR ? (n - (p + q) * NR) : NR;
                    for (int64_t r0 = 0; r0 < mc; r0 += MR) {
                        const int64_t mr = (mc - r0) < MR ? (mc - r0) : MR;
                        tile(mr, 1, xb + (m0 + r0) * ldxb, ldxb, panel + q * panel_size,
                             kp2, bias == NULL ? NULL : bp + q * NR,
                             out + (m0 + r0) * ldo + (p + q) * NR, ldo, c, NULL, 0);
                    }
                }
            }
        }
    }
    return 0;
}

/* cpu_kernels.c: out[i, d] = silu(g[i, d]) * u[i, d] (silu_mul_f32's bits), rows of stride ld
 * (g, u) and ldo (out), n a multiple of 16. */
void silu_mul_rows_f32(const float *g, const float *u, int64_t ld, float *out, int64_t ldo,
                       int64_t rows, int64_t n);

/* PAGEDSERVE_CPU_FUSED_MLP=0/false/off/no: the fused gate_up + SiLU calls decline (-3), so
 * the decoder runs gate_up, silu_mul and down as three calls (same bits; for A/B runs). */
static pthread_once_t fused_mlp_once = PTHREAD_ONCE_INIT;
static int fused_mlp_off;

static void fused_mlp_init(void) { fused_mlp_off = env_off("PAGEDSERVE_CPU_FUSED_MLP"); }

static int fused_mlp_declined(void) {
    pthread_once(&fused_mlp_once, fused_mlp_init);
    return fused_mlp_off;
}

#define SMR 4 /* rows of x per fused gate_up micro-kernel call */
/* Fewer rows decline: there the three calls are as fast or faster (a unit's 6 accumulators
 * a row leave the VDPBF16PS chains latency-bound; the split GEMM groups up to 4 panels for
 * small M), measured by benchmarks/kernels/cpu_mlp_bf16.py on the EPYC VM: fused / three
 * calls 0.51x at 1 row, 0.94x at 32, 1.00x at 64, 1.03x at 128, 1.12-1.15x from 256. */
#define SILU_MIN_ROWS 65
#define SNV 3 /* 16-column vectors of act per unit: 3 gate + 3 up accumulators a row */

/*
 * One fused micro-tile: mr rows of bf16-pair x times nv gate column vectors (gv[v]: the
 * first pair row of 16 columns inside their panel; consecutive pair rows NR * 2 bf16 apart)
 * and the nv up vectors of the same act columns (uv[v]), each element summed as
 * linear_packed_bf16_avx512 sums it (from 0, pair kk = 0 .. kp2 - 1 in order, then the
 * bias); then silu(gate) * up by silu_mul_rows_f32 and the bf16 rounding of convert_row,
 * 16 * nv bf16 act values per row at act (row stride ldo). mr and nv are compile-time
 * constants at every call site.
 */
static inline __attribute__((always_inline)) void micro_silu(
    const int mr, const int nv, const uint32_t *xb, int64_t ldxb, const uint16_t *const *gv,
    const uint16_t *const *uv, int64_t kp2, const float *gbias, const float *ubias,
    uint16_t *act, int64_t ldo, const char *pf, int64_t pf_lines) {
    __m512 g[SMR][SNV], u[SMR][SNV];
    for (int r = 0; r < mr; ++r)
        for (int v = 0; v < nv; ++v) {
            g[r][v] = _mm512_setzero_ps();
            u[r][v] = _mm512_setzero_ps();
        }
    const int64_t pf_step = (pf_lines + kp2 - 1) / (kp2 > 0 ? kp2 : 1);
    for (int64_t kk = 0; kk < kp2; ++kk) {
        if (kk * pf_step < pf_lines)
            for (int64_t l = 0; l < pf_step && kk * pf_step + l < pf_lines; ++l)
                __builtin_prefetch(pf + (kk * pf_step + l) * 64, 0, 2);
        __m512bh gb[SNV], ub[SNV];
        for (int v = 0; v < nv; ++v) {
            gb[v] = (__m512bh)_mm512_loadu_si512((const void *)(gv[v] + kk * NR * 2));
            ub[v] = (__m512bh)_mm512_loadu_si512((const void *)(uv[v] + kk * NR * 2));
        }
        for (int r = 0; r < mr; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[r * ldxb + kk]);
            for (int v = 0; v < nv; ++v) {
                g[r][v] = _mm512_dpbf16_ps(g[r][v], a, gb[v]);
                u[r][v] = _mm512_dpbf16_ps(u[r][v], a, ub[v]);
            }
        }
    }
    float c[SMR][2 * 16 * SNV] __attribute__((aligned(64))); /* [row][gate | up] */
    float o[SMR][16 * SNV] __attribute__((aligned(64)));
    for (int r = 0; r < mr; ++r)
        for (int v = 0; v < nv; ++v) {
            __m512 gg = g[r][v], uu = u[r][v];
            if (gbias != NULL) {
                gg = _mm512_add_ps(gg, _mm512_loadu_ps(gbias + 16 * v));
                uu = _mm512_add_ps(uu, _mm512_loadu_ps(ubias + 16 * v));
            }
            _mm512_store_ps(&c[r][16 * v], gg);
            _mm512_store_ps(&c[r][16 * (SNV + v)], uu);
        }
    silu_mul_rows_f32(&c[0][0], &c[0][16 * SNV], 2 * 16 * SNV, &o[0][0], 16 * SNV, mr, 16 * nv);
    for (int r = 0; r < mr; ++r)
        for (int v = 0; v < nv; ++v)
            _mm256_storeu_si256((__m256i *)(act + r * ldo + 16 * v),
                                to_bf16_x16(_mm512_load_ps(&o[r][16 * v])));
}

static void tile_silu(int64_t mr, int64_t nv, const uint32_t *xb, int64_t ldxb,
                      const uint16_t *const *gv, const uint16_t *const *uv, int64_t kp2,
                      const float *gbias, const float *ubias, uint16_t *act, int64_t ldo,
                      const char *pf, int64_t pf_lines) {
#define MS(R, V) micro_silu(R, V, xb, ldxb, gv, uv, kp2, gbias, ubias, act, ldo, pf, pf_lines)
    if (nv == 3) {
        switch (mr) {
        case 4: MS(4, 3); break;
        case 3: MS(3, 3); break;
        case 2: MS(2, 3); break;
        default: MS(1, 3); break;
        }
    } else if (nv == 2) {
        switch (mr) {
        case 4: MS(4, 2); break;
        case 3: MS(3, 2); break;
        case 2: MS(2, 2); break;
        default: MS(1, 2); break;
        }
    } else {
        switch (mr) {
        case 4: MS(4, 1); break;
        case 3: MS(3, 1); break;
        case 2: MS(2, 1); break;
        default: MS(1, 1); break;
        }
    }
#undef MS
}

/*
 * act[M, inter] (bf16 bits, row stride ldo) = bf16(silu(gate) * up), [gate | up] = x @ Wgu^T
 * (+ bias), Wgu the [2 * inter, K] gate_up weight packed by pack_weight_bf16: the bits of
 * linear_packed_bf16_avx512, then silu_mul_f32, then the rounding linear_packed_bf16
 * applies to an fp32 x, with the [M, 2 * inter] fp32 product never written to memory (at
 * 2,048 rows of SmolLM2 it is 25 MB stored, read back by silu_mul, whose 12 MB result the
 * down GEMM reads again). A unit is SNV column vectors (48 act columns) of gate beside
 * the same of up: the column vector t (16 columns) of the packed weight is panel t / 3's
 * 32 bf16 at (t % 3) * 32 of each pair row, so the up columns need not start a panel.
 * Tasks (block of MC rows, run of units) are handed out as in linear_packed_bf16_avx512,
 * and a row's result depends only on that row. Returns -3 where it does not apply (fewer
 * than SILU_MIN_ROWS rows, inter not a positive multiple of 16, PAGEDSERVE_CPU_FUSED_MLP
 * off), -1 when the activation scratch cannot be allocated, else 0.
 */
int64_t linear_packed_bf16_silu_mul_avx512(const void *x, int64_t x_bf16, int64_t m,
                                           int64_t k, int64_t ldx, const uint16_t *packed,
                                           int64_t inter, const float *bias, uint16_t *act,
                                           int64_t ldo, int64_t num_threads) {
    if (fused_mlp_declined() || inter <= 0 || inter % 16 != 0 || m < SILU_MIN_ROWS) return -3;
    const int64_t kp2 = (k + 1) / 2;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    int64_t ldxb;
    uint32_t *fill;
    const uint32_t *xb = x_pairs(x, x_bf16, m, k, ldx, &ldxb, &fill);
    if (xb == NULL) return -1;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t panel_size = kp2 * NR * 2;
    const int64_t vecs = inter / 16;             /* act column vectors */
    const int64_t units = (vecs + SNV - 1) / SNV;
    const int64_t mblocks = (m + MC - 1) / MC;
    const int64_t chunk = units / (4 * threads) > 1 ? units / (4 * threads) : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (fill != NULL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r)
                convert_row((const char *)x + (size_t)(r * ldx) * elem, x_bf16, k,
                            (uint16_t *)(fill + r * ldxb), kp2);
        }
#pragma omp for schedule(dynamic, chunk)
        for (int64_t task = 0; task < mblocks * units; ++task) {
            const int64_t m0 = task / units * MC, un = task % units;
            const int64_t mc = (m - m0) < MC ? (m - m0) : MC;
            const int64_t t0 = un * SNV;
            const int64_t nv = (vecs - t0) < SNV ? (vecs - t0) : SNV;
            const uint16_t *gv[SNV], *uv[SNV];
            for (int64_t v = 0; v < nv; ++v) {
                const int64_t tg = t0 + v, tu = vecs + t0 + v;
                gv[v] = packed + (tg / 3) * panel_size + (tg % 3) * 32;
                uv[v] = packed + (tu / 3) * panel_size + (tu % 3) * 32;
            }
            const float *gbias = bias == NULL ? NULL : bias + 16 * t0;
            const float *ubias = bias == NULL ? NULL : bias + inter + 16 * t0;
            /* the next unit's gate panel, then its up panel, are brought into L2 a slice
             * per row block (a slice that would cross from one to the other stops short) */
            const int64_t blocks = (mc + SMR - 1) / SMR;
            const int64_t panel_lines = panel_size * 2 / 64;
            const int64_t next_lines = un + 1 < units ? 2 * panel_lines : 0;
            const int64_t slice = (next_lines + blocks - 1) / blocks;
            const char *next_g = (const char *)(packed + ((t0 + SNV) / 3) * panel_size);
            const char *next_u = (const char *)(packed + ((vecs + t0 + SNV) / 3) * panel_size);
            for (int64_t r0 = 0, j = 0; r0 < mc; r0 += SMR, ++j) {
                const int64_t mr = (mc - r0) < SMR ? (mc - r0) : SMR;
                const int64_t first = j * slice;
                const char *pf = NULL;
                int64_t lines = 0;
                if (first < panel_lines) {
                    pf = next_g + first * 64;
                    lines = panel_lines - first < slice ? panel_lines - first : slice;
                } else if (first < next_lines) {
                    pf = next_u + (first - panel_lines) * 64;
                    lines = next_lines - first < slice ? next_lines - first : slice;
                }
                tile_silu(mr, nv, xb + (m0 + r0) * ldxb, ldxb, gv, uv, kp2, gbias, ubias,
                          act + (m0 + r0) * ldo + 16 * t0, ldo, pf, lines);
            }
        }
    }
    return 0;
}

#if defined(GEMM_AMX_BUILT)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TM 16 /* rows of an A / C tile */

/* Set once by amx_init (pthread_once): AMX granted to the process, and chosen. */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_granted;
static int amx_chosen;

/* Linux hands the tile data state to a process only on request; the grant covers every
 * thread of the process, those created later included. PAGEDSERVE_CPU_AMX=0/false/off/no
 * keeps linear_packed_bf16 on the AVX512-BF16 kernel (env_off: cpu_common.h). */
static void amx_init(void) {
    amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    amx_chosen = amx_granted && !env_off("PAGEDSERVE_CPU_AMX");
}

int64_t gemm_bf16_amx_supported(void) {
    pthread_once(&amx_once, amx_init);
    return amx_granted;
}

int64_t gemm_bf16_amx_chosen(void) {
    pthread_once(&amx_once, amx_init);
    return amx_chosen;
}

/*
 * C[rows, 48] (fp32, into c, row stride 48) = A @ B for one panel: A = rows of bf16 pairs
 * (row stride lda bytes, zero past K), B = the panel's kp2 pair rows, the last partial group
 * of 16 read from tail (zero-padded to 16 rows) when kp2 % 16 != 0. Tiles: 0-2 C (one per
 * 16 columns), 3 A, 4-6 B.
 */
static inline void amx_panel(const uint16_t *a, int64_t lda, const uint16_t *panel,
                             int64_t full, const uint16_t *tail, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t s = 0; s < full; ++s) {
        const uint16_t *b = panel + s * TM * NR * 2;
        _tile_loadd(3, a + s * 32, lda);
        _tile_loadd(4, b, NR * 4);
        _tile_loadd(5, b + 32, NR * 4);
        _tile_loadd(6, b + 64, NR * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    if (tail != NULL) {
        _tile_loadd(3, a + full * 32, lda);
        _tile_loadd(4, tail, NR * 4);
        _tile_loadd(5, tail + 32, NR * 4);
        _tile_loadd(6, tail + 64, NR * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, c, NR * 4);
    _tile_stored(1, c + 16, NR * 4);
    _tile_stored(2, c + 32, NR * 4);
}

/*
 * C[32, 32] (fp32; column tile 0 at c, column tile 1 at c + c1, row stride ldc bytes: a
 * 32 x 32 scratch, or the output itself) = A @ B for two 16-row tiles of A (a0, a1; row
 * stride lda bytes) and two 16-column tiles of B (b0, b1: a panel's pair rows, stride 192
 * bytes), the partial last group of pairs read from t0 / t1 (16 rows of 64 bytes, zero past
 * the pairs) when tails is set. Tiles: 0-3 C, 4-5 A, 6-7 B. Each C element takes the same
 * TDPBF16PS steps as in amx_panel, so the same bits.
 */
static inline void amx_2x2(const uint16_t *a0, const uint16_t *a1, int64_t lda,
                           const uint16_t *b0, const uint16_t *b1, int64_t full, int tails,
                           const uint16_t *t0, const uint16_t *t1, float *c, int64_t c1,
                           int64_t ldc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < full; ++s) {
        _tile_loadd(4, a0 + s * 32, lda);
        _tile_loadd(6, b0 + s * TM * NR * 2, NR * 4);
        _tile_loadd(7, b1 + s * TM * NR * 2, NR * 4);
        _tile_loadd(5, a1 + s * 32, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (tails) {
        _tile_loadd(4, a0 + full * 32, lda);
        _tile_loadd(6, t0, 64);
        _tile_loadd(7, t1, 64);
        _tile_loadd(5, a1 + full * 32, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const int64_t row16 = 16 * (ldc / 4); /* 16 rows of c, in floats */
    _tile_stored(0, c, ldc);
    _tile_stored(1, c + c1, ldc);
    _tile_stored(2, c + row16, ldc);
    _tile_stored(3, c + row16 + c1, ldc);
}

/*
 * Where the A tiles of a row block are read: a bf16 x itself when its rows need no padding
 * (K a multiple of 32: whole tiles), for the rows of whole 32-row blocks, else the scratch
 * of bf16 pairs (row r at xb + (r - direct_rows) * ldxb). Reading x in place saves a copy of
 * M x K bf16 per call (megabytes in a prefill); the tiles hold the same values either way.
 */
typedef struct {
    const uint16_t *direct; /* x, or NULL */
    int64_t direct_lda;     /* bytes between x's rows */
    int64_t direct_rows;    /* rows [0, direct_rows) are read from x: a multiple of 32 */
    const uint32_t *xb;
    int64_t ldxb; /* pairs per scratch row */
} amx_a_t;

/* The A rows from r0 (a multiple of 16) and their row stride in bytes. */
static inline const uint16_t *amx_a_rows(const amx_a_t *a, int64_t r0, int64_t *lda) {
    if (r0 < a->direct_rows) {
        *lda = a->direct_lda;
        return (const uint16_t *)((const char *)a->direct + r0 * a->direct_lda);
    }
    *lda = a->ldxb * 4;
    return (const uint16_t *)(a->xb + (r0 - a->direct_rows) * a->ldxb);
}

/* Fill in a's sources for x (see amx_a_t) and return the first row the scratch holds. */
static int64_t amx_a_init(amx_a_t *a, const void *x, int64_t x_bf16, int64_t m, int64_t k,
                          int64_t ldx, const uint32_t *xb, int64_t ldxb) {
    const int whole = x_bf16 && k % 32 == 0;
    a->direct = whole ? (const uint16_t *)x : NULL;
    a->direct_lda = ldx * (int64_t)sizeof(uint16_t);
    a->direct_rows = whole ? m / 32 * 32 : 0;
    a->xb = xb;
    a->ldxb = ldxb;
    return a->direct_rows;
}

/*
 * Over 16 rows: the 1 x 3 tiles of amx_panel per 48-column panel. From 32 rows: 2 x 2 tiles
 * (32 rows x 32 columns, column tile t = columns 16 t .. 16 t + 15, possibly straddling two
 * panels), which loads 4 tiles per 4 TDPBF16PS instead of per 3.
 */
static void amx_large(const amx_a_t *xa, int64_t m, int64_t mpad, const uint16_t *packed,
                      int64_t n, int64_t kp2, int64_t full, int64_t rest, const float *bias,
                      float *out, int64_t ldo) {
    const int64_t panel_size = kp2 * NR * 2;
    const int64_t ctiles = (n + 15) / 16;
    const int64_t units = (ctiles + 1) / 2;
    uint16_t tail[2][TM * 32] __attribute__((aligned(64)));
    float c[32 * 32] __attribute__((aligned(64)));
    memset(tail, 0, sizeof(tail));
    for (int64_t m0 = 0; m0 < mpad; m0 += MC) {
        const int64_t mc = (mpad - m0) < MC ? (mpad - m0) : MC;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t t[2] = {2 * u, 2 * u + 1 < ctiles ? 2 * u + 1 : 2 * u};
            const uint16_t *b[2];
            __mmask16 mask[2];
            /* no bias and both column tiles whole (or one tile, written twice) */
            const int direct = bias == NULL && n - 16 * t[0] >= 16 && (t[1] == t[0] || n - 16 * t[1] >= 16);
            __m512 bv[2];
            for (int q = 0; q < 2; ++q) {
                b[q] = packed + (t[q] / 3) * panel_size + (t[q] % 3) * 32;
                const int64_t cols = q == 1 && t[1] == t[0] ? 0 : n - 16 * t[q];
                mask[q] = (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1);
                bv[q] = bias == NULL ? _mm512_setzero_ps()
                                     : _mm512_maskz_loadu_ps(mask[q], bias + 16 * t[q]);
                for (int64_t r = 0; r < rest; ++r)
                    memcpy(tail[q] + r * 32, b[q] + (full * TM + r) * NR * 2, 64);
            }
            for (int64_t r0 = m0; r0 < m0 + mc; r0 += 32) {
                int64_t lda;
                const uint16_t *a0 = amx_a_rows(xa, r0, &lda);
                const uint16_t *a1 = r0 + 16 < mpad ? a0 + 16 * (lda / 2) : a0;
                const int64_t valid = (m - r0) < 32 ? (m - r0) : 32;
                if (direct && valid == 32) { /* the C tiles straight into out: same values */
                    amx_2x2(a0, a1, lda, b[0], b[1], full, rest != 0, tail[0], tail[1],
                            out + r0 * ldo + 16 * t[0], 16 * (t[1] - t[0]), ldo * 4);
                    continue;
                }
                amx_2x2(a0, a1, lda, b[0], b[1], full, rest != 0, tail[0], tail[1], c, 16, 128);
                for (int64_t i = 0; i < valid; ++i)
                    for (int q = 0; q < 2; ++q) {
                        __m512 acc = _mm512_load_ps(c + i * 32 + 16 * q);
                        if (bias != NULL) acc = _mm512_add_ps(acc, bv[q]);
                        _mm512_mask_storeu_ps(out + (r0 + i) * ldo + 16 * t[q], mask[q], acc);
                    }
            }
        }
    }
}

/* Rows of x (fp32, or bf16 bits when x_bf16; elem bytes each, row stride ldx) as bf16 pairs
 * into the scratch xb (mpad rows of ldxb pairs: zero past K and past m), shared among the
 * threads of the enclosing parallel region. */
static void amx_convert_rows(const void *x, size_t elem, int64_t x_bf16, int64_t m, int64_t mpad,
                             int64_t k, int64_t ldx, int64_t kp2, uint32_t *xb, int64_t ldxb) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < mpad; ++r) {
        uint16_t *dst = (uint16_t *)(xb + r * ldxb);
        if (r < m) {
            convert_row((const char *)x + (size_t)(r * ldx) * elem, x_bf16, k, dst, kp2);
            memset(dst + 2 * kp2, 0, sizeof(uint32_t) * (size_t)(ldxb - kp2));
        } else {
            memset(dst, 0, sizeof(uint32_t) * (size_t)ldxb);
        }
    }
}

/*
 * linear_packed_bf16 on AMX tiles (TDPBF16PS). Each output element: 0, then per group of 16
 * K pairs (32 K values) in order one TDPBF16PS step, then the bias. Rows are padded with
 * zeros to a multiple of the tile height in the scratch and computed independently, so a
 * row's bits do not depend on M or on the other rows. Returns -1 when the scratch cannot be
 * allocated, -2 when AMX is not available (out untouched in both cases).
 */
int64_t linear_packed_bf16_amx(const void *x, int64_t x_bf16, int64_t m, int64_t k, int64_t ldx,
                               const uint16_t *packed, int64_t n, const float *bias, float *out,
                               int64_t ldo, int64_t num_threads) {
    if (!gemm_bf16_amx_supported()) return -2;
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t kp2 = (k + 1) / 2;
    const int64_t full = kp2 / TM;
    const int64_t rest = kp2 - full * TM;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    const int64_t ldxb = (kp2 + TM - 1) / TM * TM; /* pairs per scratch row: whole A tiles */
    const int64_t rows = m < TM ? m : TM;          /* tile height */
    const int64_t mpad = (m + rows - 1) / rows * rows;
    amx_a_t xa = {0};
    const int64_t from = m > TM ? amx_a_init(&xa, x, x_bf16, m, k, ldx, NULL, ldxb) : 0;
    uint32_t *xb = thread_scratch((size_t)((mpad - from) * ldxb) + 1);
    if (xb == NULL) return -1;
    xa.xb = xb;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t panel_size = kp2 * NR * 2;
    tile_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t < 4 || m > TM ? rows : TM);
    }
#pragma omp parallel num_threads(threads) if (threads > 1 && (panels > 1 || m > 1))
    {
        amx_convert_rows((const char *)x + (size_t)(from * ldx) * elem, elem, x_bf16, m - from,
                         mpad - from, k, ldx, kp2, xb, ldxb);
        _tile_loadconfig(&cfg);
        if (m > TM) {
            amx_large(&xa, m, mpad, packed, n, kp2, full, rest, bias, out, ldo);
            _tile_release();
        } else {
            uint16_t tail[TM * NR * 2] __attribute__((aligned(64)));
            float c[TM * NR] __attribute__((aligned(64)));
            memset(tail, 0, sizeof(tail));
            for (int64_t m0 = 0; m0 < mpad; m0 += MC) {
                const int64_t mc = (mpad - m0) < MC ? (mpad - m0) : MC;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; ++p) {
                    const uint16_t *panel = packed + p * panel_size;
                    const int64_t cols = (n - p * NR) < NR ? (n - p * NR) : NR;
                    const __mmask16 mask[3] = {
                        (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1),
                        (__mmask16)(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1),
                        (__mmask16)(cols >= 48 ? 0xffff : cols <= 32 ? 0 : (1u << (cols - 32)) - 1),
                    };
                    __m512 bv[3];
                    for (int v = 0; v < 3; ++v)
                        bv[v] = bias == NULL ? _mm512_setzero_ps()
                                             : _mm512_maskz_loadu_ps(mask[v], bias + p * NR + 16 * v);
                    if (rest)
                        memcpy(tail, panel + full * TM * NR * 2, sizeof(uint16_t) * rest * NR * 2);
                    for (int64_t r0 = m0; r0 < m0 + mc; r0 += rows) {
                        amx_panel((const uint16_t *)(xb + r0 * ldxb), ldxb * 4, panel, full,
                                  rest ? tail : NULL, c);
                        const int64_t valid = (m - r0) < rows ? (m - r0) : rows;
                        for (int64_t i = 0; i < valid; ++i) {
                            float *o = out + (r0 + i) * ldo + p * NR;
                            for (int v = 0; v < 3; ++v) {
                                __m512 acc = _mm512_load_ps(c + i * NR + 16 * v);
                                if (bias != NULL) acc = _mm512_add_ps(acc, bv[v]);
                                _mm512_mask_storeu_ps(o + 16 * v, mask[v], acc);
                            }
                        }
                    }
                }
            }
            _tile_release();
        }
    }
    return 0;
}

/*
 * act[M, inter] (bf16 bits, row stride ldo) = bf16(silu(gate) * up), [gate | up] = x @ Wgu^T
 * (+ bias), Wgu the [2 * inter, K] gate_up weight packed by pack_weight_bf16: the bits of
 * linear_packed_bf16_amx, then silu_mul_f32, then the rounding linear_packed_bf16 applies to
 * an fp32 x, with the [M, 2 * inter] fp32 intermediate never written to memory. A unit is 32
 * rows x 32 act columns: two 2 x 2 tile products (gate tiles j, j + 1 beside up tiles j,
 * j + 1) into an L1 scratch, the SiLU and product there, 64-byte bf16 rows out. Returns -3
 * where it does not apply (m <= 16 rows, inter not a multiple of 32, AMX not chosen,
 * PAGEDSERVE_CPU_FUSED_MLP off: the caller runs the two calls), -1 when the scratch cannot
 * be allocated, else 0.
 */
int64_t linear_packed_bf16_silu_mul_amx(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                        int64_t ldx, const uint16_t *packed, int64_t inter,
                                        const float *bias, uint16_t *act, int64_t ldo,
                                        int64_t num_threads) {
    if (!gemm_bf16_amx_chosen() || fused_mlp_declined() || m <= TM || inter % 32 != 0 || inter <= 0)
        return -3;
    const int64_t kp2 = (k + 1) / 2;
    const int64_t full = kp2 / TM;
    const int64_t rest = kp2 - full * TM;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    const int64_t ldxb = (kp2 + TM - 1) / TM * TM;
    const int64_t mpad = (m + TM - 1) / TM * TM;
    amx_a_t xa = {0};
    const int64_t from = amx_a_init(&xa, x, x_bf16, m, k, ldx, NULL, ldxb);
    uint32_t *xb = thread_scratch((size_t)((mpad - from) * ldxb) + 1);
    if (xb == NULL) return -1;
    xa.xb = xb;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t panel_size = kp2 * NR * 2;
    const int64_t units = inter / 32;
    const int64_t up0 = inter / 16; /* the column tile of up's first column */
    tile_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TM;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        amx_convert_rows((const char *)x + (size_t)(from * ldx) * elem, elem, x_bf16, m - from,
                         mpad - from, k, ldx, kp2, xb, ldxb);
        _tile_loadconfig(&cfg);
        uint16_t tail[4][TM * 32] __attribute__((aligned(64)));
        float c[32 * 64] __attribute__((aligned(64))); /* [row][gate 32 | up 32] */
        float a[32 * 32] __attribute__((aligned(64)));
        memset(tail, 0, sizeof(tail));
        for (int64_t m0 = 0; m0 < mpad; m0 += MC) {
            const int64_t mc = (mpad - m0) < MC ? (mpad - m0) : MC;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; ++u) {
                /* tiles: gate 2u, up 2u, gate 2u + 1, up 2u + 1 */
                const int64_t t[4] = {2 * u, up0 + 2 * u, 2 * u + 1, up0 + 2 * u + 1};
                const uint16_t *b[4];
                __m512 bv[4];
                for (int q = 0; q < 4; ++q) {
                    b[q] = packed + (t[q] / 3) * panel_size + (t[q] % 3) * 32;
                    bv[q] = bias == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + 16 * t[q]);
                    for (int64_t r = 0; r < rest; ++r)
                        memcpy(tail[q] + r * 32, b[q] + (full * TM + r) * NR * 2, 64);
                }
                for (int64_t r0 = m0; r0 < m0 + mc; r0 += 32) {
                    int64_t lda;
                    const uint16_t *a0 = amx_a_rows(&xa, r0, &lda);
                    const uint16_t *a1 = r0 + 16 < mpad ? a0 + 16 * (lda / 2) : a0;
                    const int64_t valid = (m - r0) < 32 ? (m - r0) : 32;
                    amx_2x2(a0, a1, lda, b[0], b[1], full, rest != 0, tail[0], tail[1], c, 32,
                            256);
                    amx_2x2(a0, a1, lda, b[2], b[3], full, rest != 0, tail[2], tail[3], c + 16,
                            32, 256);
                    if (bias != NULL)
                        for (int64_t i = 0; i < valid; ++i) {
                            float *ci = c + i * 64;
                            _mm512_store_ps(ci, _mm512_add_ps(_mm512_load_ps(ci), bv[0]));
                            _mm512_store_ps(ci + 16, _mm512_add_ps(_mm512_load_ps(ci + 16), bv[2]));
                            _mm512_store_ps(ci + 32, _mm512_add_ps(_mm512_load_ps(ci + 32), bv[1]));
                            _mm512_store_ps(ci + 48, _mm512_add_ps(_mm512_load_ps(ci + 48), bv[3]));
                        }
                    silu_mul_rows_f32(c, c + 32, 64, a, 32, valid, 32);
                    for (int64_t i = 0; i < valid; ++i) {
                        const __m256i lo = to_bf16_x16(_mm512_load_ps(a + i * 32));
                        const __m256i hi = to_bf16_x16(_mm512_load_ps(a + i * 32 + 16));
                        _mm512_storeu_si512((void *)(act + (r0 + i) * ldo + 32 * u),
                                            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}

#endif /* the AMX kernels */

#else /* no AVX512-BF16: callers check gemm_bf16_supported() first */

int64_t gemm_bf16_supported(void) { return 0; }

void pack_weight_bf16(const void *w, int64_t w_bf16, int64_t n, int64_t k, int64_t ldw,
                      uint16_t *packed, int64_t num_threads) {
    (void)w; (void)w_bf16; (void)n; (void)k; (void)ldw; (void)packed; (void)num_threads;
}

int64_t linear_packed_bf16_avx512(const void *x, int64_t x_bf16, int64_t m, int64_t k, int64_t ldx,
        const uint16_t *packed, int64_t n, const float *bias, float *out, int64_t ldo,
        int64_t num_threads) {
    (void)x; (void)x_bf16; (void)m; (void)k; (void)ldx; (void)packed; (void)n; (void)bias;
    (void)out; (void)ldo; (void)num_threads;
    return -1;
}

int64_t linear_packed_bf16_silu_mul_avx512(const void *x, int64_t x_bf16, int64_t m,
                                           int64_t k, int64_t ldx, const uint16_t *packed,
                                           int64_t inter, const float *bias, uint16_t *act,
                                           int64_t ldo, int64_t num_threads) {
    (void)x; (void)x_bf16; (void)m; (void)k; (void)ldx; (void)packed; (void)inter; (void)bias;
    (void)act; (void)ldo; (void)num_threads;
    return -3;
}

#endif

#if !defined(GEMM_AMX_BUILT) /* no AMX in this build: its entry points decline */

int64_t gemm_bf16_amx_supported(void) { return 0; }

int64_t gemm_bf16_amx_chosen(void) { return 0; }

int64_t linear_packed_bf16_amx(const void *x, int64_t x_bf16, int64_t m, int64_t k, int64_t ldx,
                               const uint16_t *packed, int64_t n, const float *bias, float *out,
                               int64_t ldo, int64_t num_threads) {
    (void)x; (void)x_bf16; (void)m; (void)k; (void)ldx; (void)packed; (void)n; (void)bias;
    (void)out; (void)ldo; (void)num_threads;
    return -2;
}

int64_t linear_packed_bf16_silu_mul_amx(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                        int64_t ldx, const uint16_t *packed, int64_t inter,
                                        const float *bias, uint16_t *act, int64_t ldo,
                                        int64_t num_threads) {
    (void)x; (void)x_bf16; (void)m; (void)k; (void)ldx; (void)packed; (void)inter; (void)bias;
    (void)act; (void)ldo; (void)num_threads;
    return -3;
}

#endif

/*
 * The fused gate_up + SiLU of the kernel linear_packed_bf16 runs: with AMX chosen,
 * linear_packed_bf16_silu_mul_amx (it declines 16 rows or fewer, whose two calls run on
 * AMX's bits); else linear_packed_bf16_silu_mul_avx512. Returns as they do.
 */
int64_t linear_packed_bf16_silu_mul(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                    int64_t ldx, const uint16_t *packed, int64_t inter,
                                    const float *bias, uint16_t *act, int64_t ldo,
                                    int64_t num_threads) {
    if (gemm_bf16_amx_chosen())
        return linear_packed_bf16_silu_mul_amx(x, x_bf16, m, k, ldx, packed, inter, bias, act,
                                               ldo, num_threads);
    return linear_packed_bf16_silu_mul_avx512(x, x_bf16, m, k, ldx, packed, inter, bias, act,
                                              ldo, num_threads);
}

/*
 * out[M, N] (row stride ldo, fp32) = x[M, K] (row stride ldx elements; fp32, or bf16 bits
 * when x_bf16) @ W^T + bias (fp32 or NULL), W packed by pack_weight_bf16: on AMX tiles
 * where gemm_bf16_amx_chosen(), else the AVX512-BF16 kernel. Returns 0, or -1 when the
 * activation scratch cannot be allocated (out is then untouched).
 */
int64_t linear_packed_bf16(const void *x, int64_t x_bf16, int64_t m, int64_t k, int64_t ldx,
                           const uint16_t *packed, int64_t n, const float *bias, float *out,
                           int64_t ldo, int64_t num_threads) {
    if (gemm_bf16_amx_chosen())
        return linear_packed_bf16_amx(x, x_bf16, m, k, ldx, packed, n, bias, out, ldo,
                                      num_threads);
    return linear_packed_bf16_avx512(x, x_bf16, m, k, ldx, packed, n, bias, out, ldo,
                                     num_threads);
}
