/* The int8-activation path of pagedllm_gemm_gguf (cpu_gguf_q8.c), which cpu_gguf_gemm.c takes
 * for bf16 activations and Q4_0 / Q4_1 / Q8_0 weights. */
#ifndef PAGEDLLM_CPU_GGUF_Q8_H
#define PAGEDLLM_CPU_GGUF_Q8_H
#include <stdint.h>

/* 1 where the build has int8 dot products (AVX512-VNNI's vpdpbusd): only then are the int8 paths
 * below compiled and taken. Elsewhere bf16 activations are widened to float32 and take
 * cpu_gguf_gemm.c's float32 path, which on the builds without VNNI was measured faster than
 * int8 sums in C loops (benchmarks/RESULTS.md, session 14). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define GGUF_INT8_DOT 1
#else
#define GGUF_INT8_DOT 0
#endif

/* Whether gguf_gemm_q8a takes GGML type qtype (Q4_0, Q4_1, Q8_0). */
int gguf_q8a_supports(int qtype);

/* out [M, N] (row stride ldo; float32 for out_dtype 0, else bf16) = A . W^T with A [M, K] bf16
 * (row stride lda) quantized to int8 per 32-element block and W [N, K] in qtype's blocks.
 * Returns 0, 1 for a bad type or size, 3 when out of memory. Defined where GGUF_INT8_DOT is 1,
 * like gguf_q8_quantize_block, gguf_gemm_r16_q8a and gguf_gemm_r16k_q8a. */
int gguf_gemm_q8a(int qtype, const uint8_t* w, const uint16_t* a, int64_t lda, int out_dtype, void* out, int64_t ldo,
                  int64_t M, int64_t N, int64_t K, int num_threads);
/* One 32-element block of bf16 activations x -> q[32] int8, its scale d and s = sum q, as the
 * header of cpu_gguf_q8.c states (also the quantization of cpu_gguf_r16.c and cpu_gguf_r16k.c). */
void gguf_q8_quantize_block(const uint16_t* x, int8_t* q, float* d, int32_t* s);

/* GGUF_R16 layouts (cpu_gguf_r16.c): whether base type qtype has one; a group's 16 rows
 * unpacked to the file's blocks ([16, nb * bytes per block]); the int8-activation matmul on it,
 * with gguf_gemm_q8a's arguments and statuses (N a multiple of 16). */
int gguf_r16_supports(int qtype);
void gguf_r16_unpack(int qtype, const uint8_t* group, int64_t nb, uint8_t* rows);
int gguf_gemm_r16_q8a(int qtype, const uint8_t* w, const uint16_t* a, int64_t lda, int out_dtype, void* out,
                      int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads);
/* The same for the K-quants Q4_K / Q5_K / Q6_K (cpu_gguf_r16k.c): ns super-blocks per row,
 * K a multiple of 256. */
int gguf_r16k_supports(int qtype);
void gguf_r16k_unpack(int qtype, const uint8_t* group, int64_t ns, uint8_t* rows);
int gguf_gemm_r16k_q8a(int qtype, const uint8_t* w, const uint16_t* a, int64_t lda, int out_dtype, void* out,
                       int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads);
#endif
