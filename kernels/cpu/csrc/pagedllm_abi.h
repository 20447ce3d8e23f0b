/*
 * The interface between the native CPU kernels and their ctypes bindings (kernels/cpu/native.py):
 * the exported functions, the argument block of the all-layers call, and the limits of the
 * kernels. pagedllm_abi() (abi.c) reports PAGEDLLM_ABI_VERSION, the struct sizes and the limits;
 * native.py's bind() checks them before it declares a function, and reads the limits from there.
 * Change PAGEDLLM_ABI_VERSION (and ABI_VERSION in native.py) with any change to a signature or
 * to pagedllm_llama_args.
 */
#ifndef PAGEDLLM_ABI_H
#define PAGEDLLM_ABI_H
#include <stdint.h>

#define PAGEDLLM_ABI_VERSION 8

#define MAX_GROUP 16     /* query heads per KV head (cpu_paged_attention.c) */
#define MAX_HEAD_DIM 256 /* head_dim of paged attention (cpu_paged_attention.c) */
#define MAX_BLOCK 128    /* KV cache block size in tokens (cpu_paged_attention.c) */
#define MAX_ROPE_DIM 512 /* head_dim of the all-layers call (cpu_llama_layers.c) */
#define PANEL 16         /* output columns per packed weight panel (cpu_gemm_bf16.c) */
#define MAX_SHARDS 3     /* shards of a merged matmul of the all-layers call (cpu_llama_layers.c): q | k | v */

/* GGML block types of pagedllm_gemm_gguf (cpu_gguf_gemm.c), as numbered in GGUF files */
#define GGUF_Q4_0 2
#define GGUF_Q4_1 3
#define GGUF_Q8_0 8
#define GGUF_Q4_K 12 /* super-blocks of 256 */
#define GGUF_Q5_K 13
#define GGUF_Q6_K 14
#define GGUF_R16 0x100 /* flag on any of them: rows interleaved by 16 (cpu_gguf_r16.c; the K-quants: cpu_gguf_r16k.c) */

/* The argument block of pagedllm_llama_layers_bf16: the model's pointers (set once) and the step's. */
typedef struct {
  /* the model (set once) */
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size, num_slots;
  float eps, scale;
  const uint16_t* const* in_norm;   /* [L] -> [hidden] */
  const uint16_t* const* post_norm; /* [L] -> [hidden] */
  const uint16_t* const* qkv_w;     /* [L] -> panels of [(H + 2 Hkv) D, hidden] */
  const uint16_t* const* qkv_b;     /* [L] -> [(H + 2 Hkv) D] or NULL */
  const uint16_t* const* o_w;       /* [L] -> panels of [hidden, H D] */
  const uint16_t* const* o_b;
  const uint16_t* const* gate_up_w; /* [L] -> panels of [2 I, hidden] (rows gate | up) */
  const uint16_t* const* gate_up_b;
  const uint16_t* const* down_w;    /* [L] -> panels of [hidden, I] */
  const uint16_t* const* down_b;
  uint16_t* const* k_cache;         /* [L] -> [num_blocks, block_size, Hkv, D] */
  uint16_t* const* v_cache;
  /* [L * 4]: the weight form of each layer's qkv, o, gate_up and down: 0 = bf16 panels, else a
   * GGML block type of pagedllm_gemm_gguf (its *_w then point at the GGUF blocks, rows of K / 32
   * blocks, K / 256 for the K-quants; no bias); NULL: every weight is panels */
  const int32_t* wtype;
  /* [L * 4] or NULL (none): a merged matmul (q | k | v, gate | up) whose shards hold GGUF blocks of
   * different types, as llama.cpp's Q4_K_M files' Q6_K attn_v beside Q4_K attn_q / attn_k: its
   * shard count, 1 .. MAX_SHARDS (its wtype and *_w then unused, its bias NULL), or 0: one weight
   * form (wtype). Shard s of matmul i = l * 4 + which is entry i * MAX_SHARDS + s of the three
   * arrays below; each writes its rows' columns of the matmul's output, side by side in shard
   * order (the rows sum to the matmul's width). */
  const int32_t* nshard;
  const uint8_t* const* shard_w;    /* [L * 4 * MAX_SHARDS] -> GGUF blocks of [rows, K] */
  const int32_t* shard_type;        /* [L * 4 * MAX_SHARDS] GGML block type (| GGUF_R16), never 0 */
  const int64_t* shard_rows;        /* [L * 4 * MAX_SHARDS] output rows */
  /* the step */
  int64_t T;
  uint16_t* h;                      /* [T, hidden] in: embeddings; out: the last layer's residual */
  const uint16_t* cos;              /* [T, D] */
  const uint16_t* sin;              /* [T, D], sign-folded */
  const int64_t* slots;             /* [T] cache slot of each token's K/V, < 0: not written */
  const int64_t* block_index;       /* [S * nblk] */
  int64_t nblk;
  const int64_t* row_seq;           /* [T] */
  const int64_t* row_len;           /* [T] */
  /* scratch, [T, n] each */
  uint16_t* x;                      /* n = hidden */
  uint16_t* qkv;                    /* n = (H + 2 Hkv) D */
  uint16_t* attn;                   /* n = H D */
  uint16_t* gate_up;                /* n = 2 I */
  uint16_t* act;                    /* n = I */
  uint16_t* delta;                  /* n = hidden */
  int num_threads;
} pagedllm_llama_args;

/* What pagedllm_abi() reports; every field int64, version and this struct's size first. */
typedef struct {
  int64_t version, abi_size, llama_args_size, max_group, max_head_dim, max_block, max_rope_dim, panel, max_shards;
} pagedllm_abi_info;

const pagedllm_abi_info* pagedllm_abi(void);
int pagedllm_paged_attention(int dtype, const void* q, int64_t q_row_stride, const void* k_cache,
                             const void* v_cache, const int64_t* block_index, int64_t nblk,
                             const int64_t* row_seq, const int64_t* row_len, void* out, int64_t T, int64_t H,
                             int64_t Hkv, int64_t D, int64_t bs, float scale, int num_threads);
int pagedllm_add_rms_norm_bf16(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* out, int64_t rows,
                               int64_t n, float eps, int num_threads);
int pagedllm_gemm_bf16_layout(void);
int pagedllm_gemm_bf16w(int a_dtype, const void* a, int64_t lda, const uint16_t* wp, const uint16_t* bias,
                        int out_dtype, void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads);
int pagedllm_llama_layers_bf16(const pagedllm_llama_args* a);
int pagedllm_gemm_w4(int dtype, const void* x, int64_t ldx, const uint8_t* qw, const float* scales,
                     const float* szeros, void* out, int64_t M, int64_t N, int64_t K, int64_t G, int num_threads);
int pagedllm_apply_token_bitmask(float* logits, int64_t ld, const int32_t* mask, int64_t words,
                                 const int64_t* rows, int64_t R, int64_t vocab, int num_threads);
int pagedllm_gemm_gguf(int qtype, const uint8_t* w, int a_dtype, const void* a, int64_t lda, int out_dtype,
                       void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads);
/* 1 when pagedllm_gemm_gguf multiplies bf16 activations as int8 (GGUF_INT8_DOT, cpu_gguf_q8.h),
 * so the GGUF_R16 layout pays; 0 when they are widened to float32. */
int pagedllm_gguf_int8_dot(void);

#endif
