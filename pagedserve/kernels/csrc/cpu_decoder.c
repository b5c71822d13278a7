/*
 * The decoder layers of a Llama-family model in one call: for each layer, the same
 * kernels, in the same order and on the same data, as LlamaDecoderLayer.forward_cpu
 * (pagedserve/worker/model.py) calls one by one from Python:
 *
 *   normed   = rms_norm(x, residual += x)          (layer 0: residual = x, no add; bf16
 *                                                 layers: rounded to bf16 as their GEMM
 *                                                 would, and the GEMM reads it in place)
 *   qkv      = normed @ Wqkv^T (+ b)               linear_packed_f32
 *   rope_store(qkv) -> K/V cache slots            rope_store_f32 / _bf16kv / _fp8kv / _int8kv
 *   attn     = paged_attention(q of qkv)          paged_attention_f32 / _bf16kv / _fp8kv / _int8kv
 *   x        = attn @ Wo^T (+ b)
 *   normed   = rms_norm(x, residual += x)
 *   gate_up  = normed @ Wgu^T (+ b); act = silu(gate) * up
 *                                                 (bf16 weights: one call,
 *                                                 linear_packed_bf16_silu_mul, same bits;
 *                                                 on AMX only above 16 rows)
 *   x        = act @ Wdown^T (+ b)
 *
 * so its results are the per-kernel path's, bit for bit. A layer's weights are fp32
 * (pack_weight_f32, run by linear_packed_f32) or bf16 (pack_weight_bf16, run by
 * linear_packed_bf16: activations rounded to bf16 inside the call, fp32 sums and output);
 * its w_bf16 flag picks which. What it saves is the Python
 * around ~9 ctypes calls and ~7 tensor allocations per layer (about a tenth of a decode
 * step at small batch on the 2-core Xeon). vLLM's CPU backend gets the same from its C++
 * custom ops inside a compiled graph. A layer's KV caches are fp32, bf16 or fp8 e4m3fn (its
 * kv_type picks the _f32, *_bf16kv or *_fp8kv kernels; fp8 with the layer's k_scale and
 * v_scale); activations, norms and the residual stream are fp32 either way.
 */
#include <stdint.h>
#include <string.h>

void rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                  int64_t num_rows, int64_t hidden, float eps);
void rms_norm_f32_to_bf16(const float *x, float *residual, const float *weight, uint16_t *out,
                          int64_t num_rows, int64_t hidden, float eps);
void linear_packed_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                       int64_t n, const float *bias, float *out, int64_t ldo,
                       int64_t num_threads);
int64_t linear_packed_bf16(const void *x, int64_t x_bf16, int64_t m, int64_t k, int64_t ldx,
                           const uint16_t *packed, int64_t n, const float *bias, float *out,
                           int64_t ldo, int64_t num_threads);
void rope_store_f32(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                    const float *sin_table, const int64_t *positions, const int64_t *slots,
                    float *k_cache, float *v_cache);
void paged_attention_f32(const float *q, int64_t q_token_stride, const float *k_cache,
                         const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *seq_lens, const int32_t *cu_seqlens_q, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, float *out, int64_t num_threads);
void rope_store_bf16kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                       const float *sin_table, const int64_t *positions, const int64_t *slots,
                       uint16_t *k_cache, uint16_t *v_cache);
void paged_attention_bf16kv(const float *q, int64_t q_token_stride, const uint16_t *k_cache,
                            const uint16_t *v_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, float *out, int64_t num_threads);
void rope_store_fp8kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                      const float *sin_table, const int64_t *positions, const int64_t *slots,
                      uint8_t *k_cache, uint8_t *v_cache, float k_scale, float v_scale);
void paged_attention_fp8kv(const float *q, int64_t q_token_stride, const uint8_t *k_cache,
                           const uint8_t *v_cache, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *seq_lens,
                           const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, float k_scale, float v_scale, float *out,
                           int64_t num_threads);
void rope_store_int8kv(float *qkv, int64_t qkv_stride, int64_t num_tokens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                       const float *sin_table, const int64_t *positions, const int64_t *slots,
                       int8_t *k_cache, int8_t *v_cache);
void paged_attention_int8kv(const float *q, int64_t q_token_stride, const int8_t *k_cache,
                            const int8_t *v_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, float *out, int64_t num_threads);
void silu_mul_f32(const float *x, float *out, int64_t num_rows, int64_t inter);
int64_t linear_packed_bf16_silu_mul(const void *x, int64_t x_bf16, int64_t m, int64_t k,
                                    int64_t ldx, const uint16_t *packed, int64_t inter,
                                    const float *bias, uint16_t *act, int64_t ldo,
                                    int64_t num_threads);

/* One layer's tensors; a NULL bias (fp32) means none. The four weights are packed as
 * pack_weight_f32 makes them, or as pack_weight_bf16 does when w_bf16 is nonzero;
 * k_cache/v_cache hold fp32 (kv_type 0), bf16 (1), fp8 e4m3fn (2, read and written with
 * the per-tensor k_scale and v_scale) or int8 (3, each head vector followed by its own
 * fp32 scale). Mirrored by ctypes in
 * pagedserve/kernels/cpu_native.py (DecoderLayerPtrs). */
typedef struct {
    const float *input_norm;
    const float *post_norm;
    const void *qkv;
    const float *qkv_bias;
    const void *o;
    const float *o_bias;
    const void *gate_up;
    const float *gate_up_bias;
    const void *down;
    const float *down_bias;
    void *k_cache;
    void *v_cache;
    int64_t kv_type;
    int64_t w_bf16;
    float k_scale;
    float v_scale;
} decoder_layer_f32_t;

/* out[m, n] = x[m, k] @ W^T + bias on the layer's packed weight w; x is fp32, or bf16 bits
 * when x_bf16 (bf16 layers only: what layer_norm and the fused MLP leave). 0, or -1 when the
 * bf16 kernel fails (no scratch memory, or not built). */
static int64_t layer_linear(const decoder_layer_f32_t *l, const void *x, int64_t x_bf16,
                            int64_t m, int64_t k, const void *w, int64_t n, const float *bias,
                            float *out, int64_t num_threads) {
    if (l->w_bf16)
        return linear_packed_bf16(x, x_bf16, m, k, k, (const uint16_t *)w, n, bias, out, n,
                                  num_threads) == 0 ? 0 : -1;
    linear_packed_f32((const float *)x, m, k, k, (const float *)w, n, bias, out, n,
                      num_threads);
    return 0;
}

/* normed = rms_norm(x, residual += x): fp32 for fp32 layers; for bf16 layers its bf16
 * rounding (the values their GEMM would round it to), which the GEMM then reads in place. */
static void layer_norm(const decoder_layer_f32_t *l, const float *x, float *residual,
                       const float *weight, float *normed, int64_t t, int64_t hidden,
                       float eps) {
    if (l->w_bf16)
        rms_norm_f32_to_bf16(x, residual, weight, (uint16_t *)normed, t, hidden, eps);
    else
        rms_norm_f32(x, residual, weight, normed, t, hidden, eps);
}

/*
 * x: [T, hidden] in: the embeddings; out: the last layer's MLP output.
 * residual: [T, hidden] out: the residual stream (the model's hidden state is x + residual).
 * scratch: T * (hidden + qkv + q + 3 * inter) floats, qkv = (num_heads + 2 * num_kv_heads)
 * * head_dim, q = num_heads * head_dim.
 * Returns 0, or -1 when a bf16 linear layer failed: x, residual and this step's cache
 * slots then hold partial results, which the caller must not use.
 */
int64_t decoder_layers_f32(const decoder_layer_f32_t *layers, int64_t num_layers,
                           int64_t num_tokens, int64_t hidden, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps,
                           float scale, const float *cos_table, const float *sin_table,
                           const int64_t *positions, const int64_t *slots,
                           const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *seq_lens, const int32_t *cu_seqlens_q,
                           int64_t num_seqs, int64_t block_size, float *x, float *residual,
                           float *scratch, int64_t num_threads) {
    const int64_t t = num_tokens;
    const int64_t q_size = num_heads * head_dim;
    const int64_t qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
    float *normed = scratch;
    float *qkv = normed + t * hidden;
    float *attn = qkv + t * qkv_size;
    float *gate_up = attn + t * q_size;
    float *act = gate_up + t * 2 * inter;
    if (t == 0) return 0;
    for (int64_t i = 0; i < num_layers; ++i) {
        const decoder_layer_f32_t *l = layers + i;
        if (i == 0) {
            memcpy(residual, x, sizeof(float) * t * hidden);
            layer_norm(l, x, NULL, l->input_norm, normed, t, hidden, eps);
        } else {
            layer_norm(l, x, residual, l->input_norm, normed, t, hidden, eps);
        }
        if (layer_linear(l, normed, l->w_bf16, t, hidden, l->qkv, qkv_size, l->qkv_bias, qkv,
                         num_threads))
            return -1;
        if (l->kv_type == 3) {
            rope_store_int8kv(qkv, qkv_size, t, num_heads, num_kv_heads, head_dim, cos_table,
                              sin_table, positions, slots, l->k_cache, l->v_cache);
            paged_attention_int8kv(qkv, qkv_size, l->k_cache, l->v_cache, block_tables,
                                   bt_stride, seq_lens, cu_seqlens_q, num_seqs, num_heads,
                                   num_kv_heads, head_dim, block_size, scale, attn,
                                   num_threads);
        } else if (l->kv_type == 2) {
            rope_store_fp8kv(qkv, qkv_size, t, num_heads, num_kv_heads, head_dim, cos_table,
                             sin_table, positions, slots, l->k_cache, l->v_cache, l->k_scale,
                             l->v_scale);
            paged_attention_fp8kv(qkv, qkv_size, l->k_cache, l->v_cache, block_tables,
                                  bt_stride, seq_lens, cu_seqlens_q, num_seqs, num_heads,
                                  num_kv_heads, head_dim, block_size, scale, l->k_scale,
                                  l->v_scale, attn, num_threads);
        } else if (l->kv_type == 1) {
            rope_store_bf16kv(qkv, qkv_size, t, num_heads, num_kv_heads, head_dim, cos_table,
                              sin_table, positions, slots, l->k_cache, l->v_cache);
            paged_attention_bf16kv(qkv, qkv_size, l->k_cache, l->v_cache, block_tables,
                                   bt_stride, seq_lens, cu_seqlens_q, num_seqs, num_heads,
                                   num_kv_heads, head_dim, block_size, scale, attn,
                                   num_threads);
        } else {
            rope_store_f32(qkv, qkv_size, t, num_heads, num_kv_heads, head_dim, cos_table,
                           sin_table, positions, slots, l->k_cache, l->v_cache);
            paged_attention_f32(qkv, qkv_size, l->k_cache, l->v_cache, block_tables,
                                bt_stride, seq_lens, cu_seqlens_q, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, scale, attn, num_threads);
        }
        if (layer_linear(l, attn, 0, t, q_size, l->o, hidden, l->o_bias, x, num_threads))
            return -1;
        layer_norm(l, x, residual, l->post_norm, normed, t, hidden, eps);
        const int64_t fused = l->w_bf16 ? linear_packed_bf16_silu_mul(
                                              normed, 1, t, hidden, hidden, l->gate_up, inter,
                                              l->gate_up_bias, (uint16_t *)act, inter,
                                              num_threads)
                                        : -3;
        if (fused == -1) return -1;
        if (fused == 0) { /* act holds bf16(silu(gate) * up): what the down GEMM rounds to */
            if (layer_linear(l, act, 1, t, inter, l->down, hidden, l->down_bias, x,
                             num_threads))
                return -1;
            continue;
        }
        if (layer_linear(l, normed, l->w_bf16, t, hidden, l->gate_up, 2 * inter,
                         l->gate_up_bias, gate_up, num_threads))
            return -1;
        silu_mul_f32(gate_up, act, t, inter);
        if (layer_linear(l, act, 0, t, inter, l->down, hidden, l->down_bias, x, num_threads))
            return -1;
    }
    return 0;
}
