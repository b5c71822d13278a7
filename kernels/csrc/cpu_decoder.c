/*
 * The decoder layers of a Llama-family model in one call: for each layer, the same
 * kernels, in the same order and on the same data, as LlamaDecoderLayer.forward_cpu
 * (pagedserve/worker/model.py) calls one by one from Python:
 *
 *   normed   = rms_norm(x, residual += x)          (layer 0: residual = x, no add)
 *   qkv      = normed @ Wqkv^T (+ b)               linear_packed_f32
 *   rope_store(qkv) -> K/V cache slots            rope_store_f32 / _bf16kv
 *   attn     = paged_attention(q of qkv)          paged_attention_f32 / _bf16kv
 *   x        = attn @ Wo^T (+ b)
 *   normed   = rms_norm(x, residual += x)
 *   gate_up  = normed @ Wgu^T (+ b); act = silu(gate) * up
 *   x        = act @ Wdown^T (+ b)
 *
 * so its results are the per-kernel path's, bit for bit. What it saves is the Python
 * around ~9 ctypes calls and ~7 tensor allocations per layer (about a tenth of a decode
 * step at small batch on the 2-core Xeon). vLLM's CPU backend gets the same from its C++
 * custom ops inside a compiled graph. A layer's KV caches are fp32 or bf16 (its
 * kv_bf16 flag picks the *_bf16kv kernels); everything else is fp32.
 */
#include <stdint.h>
#include <string.h>

void rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                  int64_t num_rows, int64_t hidden, float eps);
void linear_packed_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                       int64_t n, const float *bias, float *out, int64_t ldo,
                       int64_t num_threads);
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
void silu_mul_f32(const float *x, float *out, int64_t num_rows, int64_t inter);

/* One layer's tensors; a NULL bias means none. Packed weights as pack_weight_f32 makes
 * them; k_cache/v_cache hold fp32, or bf16 when kv_bf16 is nonzero. Mirrored by ctypes in pagedserve/kernels/cpu_native.py (DecoderLayerPtrs). */
typedef struct {
    const float *input_norm;
    const float *post_norm;
    const float *qkv;
    const float *qkv_bias;
    const float *o;
    const float *o_bias;
    const float *gate_up;
    const float *gate_up_bias;
    const float *down;
    const float *down_bias;
    void *k_cache;
    void *v_cache;
    int64_t kv_bf16;
} decoder_layer_f32_t;

/*
 * x: [T, hidden] in: the embeddings; out: the last layer's MLP output.
 * residual: [T, hidden] out: the residual stream (the model's hidden state is x + residual).
 * scratch: T * (hidden + qkv + q + 3 * inter) floats, qkv = (num_heads + 2 * num_kv_heads)
 * * head_dim, q = num_heads * head_dim.
 */
void decoder_layers_f32(const decoder_layer_f32_t *layers, int64_t num_layers,
                        int64_t num_tokens, int64_t hidden, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps,
                        float scale, const float *cos_table, const float *sin_table,
                        const int64_t *positions, const int64_t *slots,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                        const int32_t *cu_seqlens_q, int64_t num_seqs, int64_t block_size,
                        float *x, float *residual, float *scratch, int64_t num_threads) {
    const int64_t t = num_tokens;
    const int64_t q_size = num_heads * head_dim;
    const int64_t qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
    float *normed = scratch;
    float *qkv = normed + t * hidden;
    float *attn = qkv + t * qkv_size;
    float *gate_up = attn + t * q_size;
    float *act = gate_up + t * 2 * inter;
    if (t == 0) return;
    for (int64_t i = 0; i < num_layers; ++i) {
        const decoder_layer_f32_t *l = layers + i;
        if (i == 0) {
            memcpy(residual, x, sizeof(float) * t * hidden);
            rms_norm_f32(x, NULL, l->input_norm, normed, t, hidden, eps);
        } else {
            rms_norm_f32(x, residual, l->input_norm, normed, t, hidden, eps);
        }
        linear_packed_f32(normed, t, hidden, hidden, l->qkv, qkv_size, l->qkv_bias, qkv,
                          qkv_size, num_threads);
        if (l->kv_bf16) {
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
        linear_packed_f32(attn, t, q_size, q_size, l->o, hidden, l->o_bias, x, hidden,
                          num_threads);
        rms_norm_f32(x, residual, l->post_norm, normed, t, hidden, eps);
        linear_packed_f32(normed, t, hidden, hidden, l->gate_up, 2 * inter, l->gate_up_bias,
                          gate_up, 2 * inter, num_threads);
        silu_mul_f32(gate_up, act, t, inter);
        linear_packed_f32(act, t, inter, inter, l->down, hidden, l->down_bias, x, hidden,
                          num_threads);
    }
}
