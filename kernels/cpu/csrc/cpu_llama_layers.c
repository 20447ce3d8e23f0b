/*
 * The decoder layers of a Llama-family model in bfloat16 on the CPU, in one call per forward
 * pass, where the model's matmuls run in the bf16-weight GEMM (cpu_gemm_bf16.c: AVX512-BF16 or
 * AVX2 CPUs; kernels/cpu/ops.py: prefer_native_gemm). It strings together the library's
 * kernels with the three small steps between them, so a step pays one ctypes call instead of
 * ~25 torch / ctypes calls per layer, whose Python overhead was over a third of a single-token
 * step (benchmarks/RESULTS.md, "Figures moved out of the code").
 *
 * Per layer, with the roundings of the torch path (services/executor/models/llama.py,
 * LlamaDecoderLayer.forward with panels: see its numerics change checklist), every
 * intermediate in bf16:
 *   x = RMSNorm(h)                      (cpu_rms_norm.c; fused with the previous layer's residual add)
 *   qkv = x . Wqkv^T (+ b)              (cpu_gemm_bf16.c, or cpu_gguf_gemm.c for GGUF blocks: wtype,
 *                                        one call per shard where q, k, v differ in type: nshard)
 *   q, k = RoPE(q, k)                   rotate_half form: bf16(bf16(rot(x) * sin) + bf16(x * cos))
 *   k, v -> cache at slots[t]           (reshape_and_cache; slots < 0 are skipped)
 *   a = PagedAttention(q, cache)        (cpu_paged_attention.c, rows as planned by the caller)
 *   h = h + a . Wo^T (+ b); x = RMSNorm(h)
 *   g | u = x . Wgu^T (+ b);  m = bf16(bf16(silu(g)) * u)
 *   h = h + m . Wdown^T (+ b)
 * The final norm and the logits stay with the caller. Layouts: h [T, hidden]; cos, sin [T, D]
 * (sin sign-folded: (-sin, +sin) halves); caches [num_blocks, block_size, Hkv, D]; weights as
 * packed by kernels/cpu/ops.py (pack_bf16_weight); scratch buffers sized by the caller.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "pagedllm_abi.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16) /* below: one thread (a parallel region costs more) */

static inline float rnd(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* RoPE of the q and k heads of each token (in place in qkv) and the K/V cache write. */
static void rope_and_cache(const pagedllm_llama_args* a, int64_t layer, int num_threads) {
  const int64_t H = a->num_heads, Hkv = a->num_kv_heads, D = a->head_dim, half = D / 2;
  const int64_t width = (H + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t t = 0; t < a->T; ++t) {
    uint16_t* row = a->qkv + t * width;
    const uint16_t* c = a->cos + t * D;
    const uint16_t* s = a->sin + t * D;
    for (int64_t head = 0; head < H + Hkv; ++head) {
      uint16_t* x = row + head * D;
      float xf[MAX_ROPE_DIM];
      for (int64_t i = 0; i < D; ++i) xf[i] = bf16_to_f32(x[i]);
      for (int64_t i = 0; i < D; ++i) {
        const float swapped = xf[i < half ? i + half : i - half];
        x[i] = f32_to_bf16(rnd(swapped * bf16_to_f32(s[i])) + rnd(xf[i] * bf16_to_f32(c[i])));
      }
    }
    const int64_t slot = a->slots[t];
    if (slot >= 0) {
      memcpy(a->k_cache[layer] + slot * Hkv * D, row + H * D, (size_t)(Hkv * D) * 2);
      memcpy(a->v_cache[layer] + slot * Hkv * D, row + (H + Hkv) * D, (size_t)(Hkv * D) * 2);
    }
  }
}

static void silu_mul(const pagedllm_llama_args* a, int num_threads) {
  const int64_t I = a->inter;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t t = 0; t < a->T; ++t) {
    const uint16_t* g = a->gate_up + t * 2 * I;
    const uint16_t* u = g + I;
    uint16_t* m = a->act + t * I;
    for (int64_t i = 0; i < I; ++i) {
      const float gf = bf16_to_f32(g[i]);
      m[i] = f32_to_bf16(rnd(gf / (1.f + expf(-gf))) * bf16_to_f32(u[i]));
    }
  }
}

static void residual_add(uint16_t* h, const uint16_t* delta, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(delta[i]));
}

/* out [T, N] = in [T, K] . W^T of matmul i's `ns` shards of GGUF blocks (nshard): shard s writes
 * columns [c_s, c_s + rows_s) of out (ldo N), as the per-layer path's GGUFShardedLinearMethod
 * concatenates its parts' outputs. Returns 1 for a bad shard (count, type, rows not summing to N). */
static int linear_shards(const pagedllm_llama_args* a, int64_t i, int32_t ns, const uint16_t* in, int64_t K,
                         uint16_t* out, int64_t N, int nt) {
  if (ns > MAX_SHARDS || !a->shard_w || !a->shard_type || !a->shard_rows) return 1;
  int64_t col = 0;
  for (int32_t s = 0; s < ns; ++s) {
    const int64_t j = i * MAX_SHARDS + s, rows = a->shard_rows[j];
    const int32_t wt = a->shard_type[j];
    if (wt == 0 || rows < 1 || col + rows > N) return 1;
    if (pagedllm_gemm_gguf(wt, a->shard_w[j], 1, in, K, 1, out + col, N, a->T, rows, K, nt)) return 1;
    col += rows;
  }
  return col != N;
}

/* out [T, N] = in [T, K] . W^T (+ b) for weight `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer l:
 * the bf16 panels' GEMM, or the GGUF blocks' (bf16 in and out, as the per-layer path's
 * GGUFLinearMethod calls it), or one GGUF GEMM per shard of a merged matmul (nshard). */
static int linear(const pagedllm_llama_args* a, int64_t l, int which, const uint16_t* w, const uint16_t* b,
                  const uint16_t* in, int64_t K, uint16_t* out, int64_t N, int nt) {
  const int64_t i = l * 4 + which;
  const int32_t ns = a->nshard ? a->nshard[i] : 0;
  if (ns) return b || ns < 0 ? 1 : linear_shards(a, i, ns, in, K, out, N, nt);
  const int32_t wt = a->wtype ? a->wtype[i] : 0;
  if (wt == 0) return pagedllm_gemm_bf16w(1, in, K, w, b, 1, out, N, a->T, N, K, nt);
  if (b) return 1;
  return pagedllm_gemm_gguf(wt, (const uint8_t*)w, 1, in, K, 1, out, N, a->T, N, K, nt);
}

/* Returns 0, or 1 for bad sizes, 2 for a slot outside the cache, 10 + k for kernel k failing. */
int pagedllm_llama_layers_bf16(const pagedllm_llama_args* a) {
  const int64_t T = a->T, hidden = a->hidden, H = a->num_heads, Hkv = a->num_kv_heads, D = a->head_dim;
  const int64_t qkv_n = (H + 2 * Hkv) * D, I = a->inter;
  const int nt = a->num_threads < 1 ? 1 : a->num_threads;
  if (T < 1 || D > MAX_ROPE_DIM || D % 2 || a->num_layers < 1) return 1;
  for (int64_t t = 0; t < T; ++t)
    if (a->slots[t] >= a->num_slots) return 2;
  const int nt_hidden = T * hidden >= PARALLEL_MIN_ELEMENTS ? nt : 1;
  const int nt_qkv = T * qkv_n >= PARALLEL_MIN_ELEMENTS ? nt : 1;
  const int nt_inter = T * I >= PARALLEL_MIN_ELEMENTS ? nt : 1;
  for (int64_t l = 0; l < a->num_layers; ++l) {
    /* x = RMSNorm(h), with the previous layer's MLP residual add fused in */
    if (pagedllm_add_rms_norm_bf16(a->h, l ? a->delta : 0, a->in_norm[l], a->x, T, hidden, a->eps, nt_hidden))
      return 11;
    if (linear(a, l, 0, a->qkv_w[l], a->qkv_b[l], a->x, hidden, a->qkv, qkv_n, nt)) return 12;
    rope_and_cache(a, l, nt_qkv);
    if (pagedllm_paged_attention(1, a->qkv, qkv_n, a->k_cache[l], a->v_cache[l], a->block_index, a->nblk,
                                 a->row_seq, a->row_len, a->attn, T, H, Hkv, D, a->block_size, a->scale, nt))
      return 13;
    if (linear(a, l, 1, a->o_w[l], a->o_b[l], a->attn, H * D, a->delta, hidden, nt)) return 14;
    if (pagedllm_add_rms_norm_bf16(a->h, a->delta, a->post_norm[l], a->x, T, hidden, a->eps, nt_hidden)) return 15;
    if (linear(a, l, 2, a->gate_up_w[l], a->gate_up_b[l], a->x, hidden, a->gate_up, 2 * I, nt)) return 16;
    silu_mul(a, nt_inter);
    if (linear(a, l, 3, a->down_w[l], a->down_b[l], a->act, I, a->delta, hidden, nt)) return 17;
  }
  residual_add(a->h, a->delta, T * hidden, nt_hidden);
  return 0;
}
