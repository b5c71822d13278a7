/*
 * fp32 GEMM for the serving path's linear layers: out[M, N] = x[M, K] @ W[N, K]^T (+ bias),
 * with W packed once at load time into column panels.
 *
 * Why: a decode step multiplies a few to a few dozen token rows by every weight matrix, so
 * the step is bound by streaming the weights from memory. A general BLAS sgemm re-packs W
 * on every call at these shapes (measured on the 2-core Xeon: MKL's sgemm at M = 8 takes
 * 2.6x its M = 1 time for the same weights). Here W is packed once, each panel is read from
 * memory once per call, and every row block of x reuses it from cache. This is the idea of
 * vLLM's CPU backend (oneDNN matmuls on prepacked weights, csrc/cpu/dnnl_kernels.cpp) and
 * of the BLIS/GotoBLAS micro-kernel design (Goto and van de Geijn, "Anatomy of
 * high-performance matrix multiplication", ACM TOMS 2008).
 *
 * Packed layout: panel p holds columns [p * NR, p * NR + NR) of the output as
 * packed[p][k][j] = W[p * NR + j][k] (zero where p * NR + j >= N), panels contiguous:
 * ceil(N / NR) * K * NR floats.
 *
 * Numerics: each output element is a sum over k = 0 .. K-1 in order, one fused multiply-add
 * per term, started from 0 (bias added last). A row's result depends only on that row and
 * W, not on M or on the other rows: the kernel is batch invariant by construction.
 */
#include <stdint.h>
#include <string.h>

/*
 * The register tile follows the vector ISA the compiler targets: VL floats per vector, NR =
 * 3 vectors of output columns per panel, MR rows per micro-kernel call, so that the
 * MR x 3 accumulators, 3 weight vectors and a broadcast fit the register file (AVX-512:
 * 32 zmm, 8 x 3 accumulators; AVX2: 16 ymm, 4 x 3). panel_width() reports NR to the packer.
 */
#if defined(__AVX512F__)
#define VL 16
#define MR 8
#elif defined(__AVX__)
#define VL 8
#define MR 4
#else
#define VL 4
#define MR 4
#endif
#define NR (3 * VL) /* output columns per panel */
#define MC 256 /* rows of x per outer block (kept in L2 while the panels stream past) */
#define MAX_VECS 12 /* accumulators per row of one micro call: 3 vectors x up to 4 panels */

typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));

#if defined(__AVX512F__)
#include <immintrin.h>
#define VFMA(acc, a, b) ((acc) = _mm512_fmadd_ps((a), (b), (acc)))
#elif defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#define VFMA(acc, a, b) ((acc) = _mm256_fmadd_ps((a), (b), (acc)))
#else /* a multiply and an add (-ffp-contract=off keeps them apart) */
#define VFMA(acc, a, b) ((acc) = (acc) + (a) * (b))
#endif

int64_t gemm_panel_width(void) { return NR; }

/* packed[p][k][j] = w[(p * NR + j) * ldw + k]; zero padding past n. */
void pack_weight_f32(const float *w, int64_t n, int64_t k, int64_t ldw, float *packed,
                     int64_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) if (panels > 1)
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * k * NR;
        const int64_t cols = (n - p * NR) < NR ? (n - p * NR) : NR;
        for (int64_t kk = 0; kk < k; ++kk) {
            float *row = dst + kk * NR;
            int64_t j = 0;
            for (; j < cols; ++j) row[j] = w[(p * NR + j) * ldw + kk];
            for (; j < NR; ++j) row[j] = 0.0f;
        }
    }
}

/* every lane a, as one broadcast: GCC turns a per-lane fill loop into one masked
 * broadcast per lane (16 under AVX-512), which starved the FMA loop of issue slots. */
static inline vf splat(float a) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(a);
#elif defined(__AVX__) && defined(__FMA__)
    return (vf)_mm256_set1_ps(a);
#else
    return a - (vf){0}; /* a - (+0) is a for every a, -0 and NaN included */
#endif
}

/*
 * One micro-tile: rows [0, mr) of x (row stride ldx) times `np` consecutive panels (each
 * k x NR), into out (row stride ldo), writing `cols` (<= np * NR) columns. `mr` and `np`
 * are compile-time constants at every call site (the switch below), so the mr x 3 * np
 * accumulators live in registers. Several panels at once give a one- to three-row call
 * enough independent FMA chains to hide the FMA latency; every output element is still
 * one in-order sum over k, whatever mr and np are.
 */
static inline __attribute__((always_inline)) void micro(const int mr, const int np,
                                                        const float *x, int64_t ldx,
                                                        const float *panel, int64_t k,
                                                        const float *bias, float *out,
                                                        int64_t ldo, int64_t cols,
                                                        const float *pf, int64_t pf_lines) {
    vf acc[MR][MAX_VECS];
    for (int r = 0; r < mr; ++r)
        for (int v = 0; v < 3 * np; ++v) acc[r][v] = (vf){0};
    const int64_t stride = k * NR; /* floats between consecutive panels */
    /* prefetch pf_lines cache lines from pf into L2, spread over the k loop */
    const int64_t pf_step = (pf_lines + k - 1) / (k > 0 ? k : 1);
    for (int64_t kk = 0; kk < k; ++kk) {
        if (kk * pf_step < pf_lines)
            for (int64_t l = 0; l < pf_step; ++l) __builtin_prefetch(pf + (kk * pf_step + l) * 16, 0, 2) /* 16 floats: a line */;
        vf b[MAX_VECS];
        for (int q = 0; q < np; ++q) {
            const vf *bp = (const vf *)(panel + q * stride + kk * NR);
            b[3 * q] = bp[0];
            b[3 * q + 1] = bp[1];
            b[3 * q + 2] = bp[2];
        }
        for (int r = 0; r < mr; ++r) {
            const vf a = splat(x[r * ldx + kk]);
            for (int v = 0; v < 3 * np; ++v) VFMA(acc[r][v], a, b[v]);
        }
    }
    float bb[4 * NR];
    if (bias != NULL) {
        memcpy(bb, bias, sizeof(float) * cols);
        for (int64_t j = cols; j < np * NR; ++j) bb[j] = 0.0f;
        const vfu *bv = (const vfu *)bb;
        for (int r = 0; r < mr; ++r)
            for (int v = 0; v < 3 * np; ++v) acc[r][v] = acc[r][v] + bv[v];
    }
    if (cols == np * NR) {
        for (int r = 0; r < mr; ++r) {
            vfu *o = (vfu *)(out + r * ldo);
            for (int v = 0; v < 3 * np; ++v) o[v] = acc[r][v];
        }
    } else {
        for (int r = 0; r < mr; ++r) {
            memcpy(bb, acc[r], sizeof(float) * np * NR);
            memcpy(out + r * ldo, bb, sizeof(float) * cols);
        }
    }
}

static void tile(int64_t mr, int64_t np, const float *x, int64_t ldx, const float *panel,
                 int64_t k, const float *bias, float *out, int64_t ldo, int64_t cols,
                 const float *pf, int64_t pf_lines) {
    if (np == 4) {
        micro(1, 4, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines);
        return;
    }
    if (np == 2) {
        if (mr == 4)
            micro(4, 2, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines);
        else if (mr == 3)
            micro(3, 2, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines);
        else if (mr == 2)
            micro(2, 2, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines);
        else
            micro(1, 2, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines);
        return;
    }
    switch (mr) {
#if MR >= 8
    case 8: micro(8, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    case 7: micro(7, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    case 6: micro(6, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    case 5: micro(5, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
#endif
    case 4: micro(4, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    case 3: micro(3, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    case 2: micro(2, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    default: micro(1, 1, x, ldx, panel, k, bias, out, ldo, cols, pf, pf_lines); break;
    }
}

/*
 * out[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ W^T + bias, W packed by
 * pack_weight_f32. Work is split by panels over the threads; each thread walks its panels
 * for one block of MC rows, so a panel leaves memory once per block.
 */
void linear_packed_f32(const float *x, int64_t m, int64_t k, int64_t ldx,
                       const float *packed, int64_t n, const float *bias, float *out,
                       int64_t ldo, int64_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    /* Panels per micro call: more when there are too few rows for enough FMA chains, but
     * never so many that the static split leaves a thread idle (12 panels in groups of 4
     * over 2 threads would be 8 : 4; in groups of 2, 6 : 6). */
    int64_t group = m == 1 ? 4 : (m <= MR / 2 ? 2 : 1);
    while (group > 1) {
        const int64_t busiest = ((panels + group - 1) / group + threads - 1) / threads * group;
        const int64_t half = group / 2;
        const int64_t busiest_half = ((panels + half - 1) / half + threads - 1) / threads * half;
        if (busiest_half >= busiest) break;
        group = half;
    }
    const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mc = (m - m0) < MC ? (m - m0) : MC;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t p = g * group;
            const int64_t np = (panels - p) < group ? (panels - p) : group;
            const float *panel = packed + p * k * NR;
            const int64_t cols = (n - p * NR) < np * NR ? (n - p * NR) : np * NR;
            const float *bp = bias == NULL ? NULL : bias + p * NR;
            if (np == group) {
                /* While this panel is reused from cache by the row blocks, the next one is
                 * brought into L2, a slice per row block, so memory and compute overlap. */
                const int64_t blocks = (mc + MR - 1) / MR;
                const int64_t next_lines = (p + np < panels) ? k * NR / 16 : 0;
                const int64_t slice = (next_lines + blocks - 1) / blocks;
                const float *next = packed + (p + np) * k * NR;
                for (int64_t r0 = 0, j = 0; r0 < mc; r0 += MR, ++j) {
                    const int64_t mr = (mc - r0) < MR ? (mc - r0) : MR;
                    int64_t lines = next_lines - j * slice;
                    lines = lines < 0 ? 0 : (lines < slice ? lines : slice);
                    tile(mr, np, x + (m0 + r0) * ldx, ldx, panel, k, bp,
                         out + (m0 + r0) * ldo + p * NR, ldo, cols, next + j * slice * 16, lines);
                }
            } else { /* the last, short group: one panel at a time */
                for (int64_t q = 0; q < np; ++q) {
                    const int64_t c = (n - (p + q) * NR) < NR ? (n - (p + q) * NR) : NR;
                    for (int64_t r0 = 0; r0 < mc; r0 += MR) {
                        const int64_t mr = (mc - r0) < MR ? (mc - r0) : MR;
                        tile(mr, 1, x + (m0 + r0) * ldx, ldx, panel + q * k * NR, k,
                             bias == NULL ? NULL : bp + q * NR,
                             out + (m0 + r0) * ldo + (p + q) * NR, ldo, c, NULL, 0);
                    }
                }
            }
        }
    }
}
