/*
 * Paged attention for the CPU, one new token row at a time: each row attends its sequence's
 * first row_len[r] cached positions (its own K/V already written), read straight from the
 * paged KV cache (no gathered copy), FlashAttention-style online softmax over one cache block
 * at a time, float32 accumulation. A decode is one row with row_len = seq_len; a prefill or
 * chunk of q_len rows over ctx cached tokens has rows with row_len = ctx + 1 .. ctx + q_len
 * (causal). Built and loaded by kernels/cpu/native.py (gcc -O3 -march=native -fopenmp);
 * called through ctypes with the GIL released.
 *
 * Layouts (element offsets; all tensors dense except the query's token stride):
 *   q        [T, H, D]              q[r * q_row_stride + h * D + d]
 *   k_cache  [num_blocks, bs, Hkv, D]  (v_cache the same)
 *   block_index [S, nblk] int64     physical block of each sequence's logical block
 *   row_seq  [T] int64              sequence (row of block_index) of each query row
 *   row_len  [T] int64              positions 0 .. row_len - 1 are attended by the row
 *   out      [T, H, D]              dense
 * GQA: query head h attends KV head h / (H / Hkv). dtype 0 = float32, 1 = bfloat16.
 * Rows may come in any order. Work runs on num_threads OpenMP threads (the caller passes
 * torch.get_num_threads(); torch's bundled libgomp.so.1, already loaded, serves this library):
 * bf16 with AVX512-BF16 in tiles of rows of one sequence (attention_bf16), everything else
 * per (row, KV head) pair (attend_row).
 * Algorithm: vLLM's PagedAttention (Kwon et al. 2023) with the online softmax of
 * FlashAttention (Dao et al. 2022).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "pagedllm_abi.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define PAGEDLLM_AVX512_BF16 1
#endif

static inline void load_row(int dtype, const void* base, int64_t offset, int64_t n, float* dst) {
  if (dtype == 0) {
    memcpy(dst, (const float*)base + offset, (size_t)n * sizeof(float));
  } else {
    const uint16_t* p = (const uint16_t*)base + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
  }
}

/* Scores of the G query heads against one cache row (already scaled query). */
static inline void score_row(int dtype, const void* k_cache, int64_t offset, int64_t D, int64_t G,
                             float (*qf)[MAX_HEAD_DIM], float* dst, int64_t stride) {
  float kf[MAX_HEAD_DIM];
  load_row(dtype, k_cache, offset, D, kf);
  for (int64_t g = 0; g < G; ++g) {
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * kf[d];
    dst[g * stride] = dot;
  }
}

/* Software prefetch of K/V ahead of use: blocks sit in shuffled physical order, where the
   hardware prefetchers do not follow. Into L2 (prefetcht1: PF_LOC 2), PF_DIST blocks ahead:
   twice as fast as the next block into L1 for the bf16 kernel, and best for the portable
   kernel spread over the tokens (A/B figures: benchmarks/RESULTS.md, "Figures moved out of the code"). */
#ifndef PF_LOC
#define PF_LOC 2
#endif
#ifndef PF_DIST
#define PF_DIST 3
#endif
/* Ask for the K and V of n tokens from slot0 (every KV head: one contiguous range each). */
static inline void prefetch_block(const void* k_cache, const void* v_cache, int64_t slot0, int64_t n, int64_t Hkv,
                                  int64_t row_bytes) {
  const int64_t start = slot0 * Hkv * row_bytes, end = (slot0 + n) * Hkv * row_bytes;
  for (int64_t c = start; c < end; c += 64) {
    __builtin_prefetch((const char*)k_cache + c, 0, PF_LOC);
    __builtin_prefetch((const char*)v_cache + c, 0, PF_LOC);
  }
}

/* The slot of the first token of logical block j of sequence b (L tokens) and its token count
   in *n, or past its end, of block j - blocks(L) of sequence b_next (L_next tokens; b_next < 0:
   none); -1 when there is no such block. */
static inline int64_t locate_block(const int64_t* block_index, int64_t nblk, int64_t bs, int64_t b, int64_t L,
                                   int64_t j, int64_t b_next, int64_t L_next, int64_t* n) {
  const int64_t blocks = (L + bs - 1) / bs;
  if (j >= blocks) {
    if (b_next < 0) return -1;
    j -= blocks;
    b = b_next;
    L = L_next;
    if (j >= (L + bs - 1) / bs) return -1;
  }
  *n = L - j * bs < bs ? L - j * bs : bs;
  return block_index[b * nblk + j] * bs;
}

/* A prefetch cursor over one K/V byte range, advanced a few cache lines per compute step so
   that the requests never pile up (a burst of hundreds fills the miss buffers and stalls the
   core). */
typedef struct {
  const char *k, *v;
  int64_t off, end, step;
} prefetch_cursor;

static inline void pf_advance(prefetch_cursor* c) {
  for (int64_t s = 0; s < c->step && c->off < c->end; ++s, c->off += 64) {
    __builtin_prefetch(c->k + c->off, 0, PF_LOC);
    __builtin_prefetch(c->v + c->off, 0, PF_LOC);
  }
}

/* Point the cursor at logical block j of sequence b (L tokens; past its end, the next
   sequence's: locate_block), every KV head (token_bytes per token), to be covered in `steps`
   calls of pf_advance; no block: the cursor is left as it was. */
static inline void pf_aim(prefetch_cursor* c, const int64_t* block_index, int64_t nblk, int64_t bs,
                          int64_t token_bytes, int64_t b, int64_t L, int64_t j, int64_t b_next, int64_t L_next,
                          int64_t steps) {
  int64_t n = 0;
  const int64_t s0 = locate_block(block_index, nblk, bs, b, L, j, b_next, L_next, &n);
  if (s0 < 0) return;
  c->off = s0 * token_bytes;
  c->end = (s0 + n) * token_bytes;
  c->step = ((c->end - c->off) / 64 + steps - 1) / steps;
}

/* Ask at once for logical blocks 0 .. count - 1 of sequence b (as pf_aim counts them): the
   first blocks of an item that no earlier look-ahead on this thread reached. */
static inline void prefetch_first_blocks(const void* k_cache, const void* v_cache, const int64_t* block_index,
                                         int64_t nblk, int64_t bs, int64_t Hkv, int64_t row_bytes, int64_t b,
                                         int64_t L, int64_t b_next, int64_t L_next, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    int64_t n = 0;
    const int64_t s0 = locate_block(block_index, nblk, bs, b, L, j, b_next, L_next, &n);
    if (s0 >= 0) prefetch_block(k_cache, v_cache, s0, n, Hkv, row_bytes);
  }
}

#ifdef PAGEDLLM_AVX512_BF16
/* The bf16 path (AVX512-BF16, head_dim a multiple of 32). A work item is a tile of up to
 * TILE_ROWS query rows of one sequence and a group of its KV heads (all of them when there are
 * items enough for every thread):
 * - each 16-token chunk of a K/V block is read from memory once for all the tile's rows (a
 *   prefill's rows share their context), and a decode row walks every KV head of a block, one
 *   contiguous [bs, Hkv, D] range;
 * - the blocks PF_DIST ahead (past the tile's end: the next tile's) are prefetched a few cache
 *   lines per step, never in a burst;
 * - scores: vdpbf16ps per (token, query head), then a transposed add tree turns 16 tokens'
 *   accumulators into one vector of 16 scores; where TRANSPOSE_MIN_HEADS query heads share a
 *   chunk (a prefill tile's rows x the GQA group), the K chunk is transposed once instead and
 *   each score vector is one vdpbf16ps per head-dim pair (faster for long prefills); the
 *   online softmax runs on whole vectors;
 * - P V: vdpbf16ps on token pairs, the probabilities rounded to bf16 as a bf16 matmul would
 *   (and the softmax sum taken of the rounded values), float32 accumulators.
 * About twice as fast as one (row, KV head) per item (attend_row) at decode batch sizes
 * (A/B figures: benchmarks/RESULTS.md, "Figures moved out of the code"). */
#define TILE_ROWS 8      /* rows of one sequence per item */
#define ACC_FLOATS 16384 /* an item's float32 accumulators, TILE_ROWS x heads x G x D (64 KiB) */
#define CHUNK 16         /* tokens per score vector */
#define TRANSPOSE_MIN_HEADS 6 /* query heads sharing a chunk (rows x group) from which K is transposed */

/* e^x for x <= 0 (Cody-Waite reduction, degree-7 Taylor polynomial, 2^n by vscalefps):
   relative error ~1e-7; x below -87 gives about 1.6e-38. */
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln 2, high bits */
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);   /* ln 2, low bits */
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

/* 32 bf16 from p (any alignment), loaded as the dot-product instruction's operand type (a
   cast of an integer-vector load makes GCC 12 bounce each vector through the stack). */
typedef __m512bh __attribute__((aligned(2), may_alias)) m512bh_unaligned;
static inline __m512bh load_bh(const uint16_t* p) { return *(const m512bh_unaligned*)p; }

/* Dot products of one query head (D / 32 bf16 vectors qv) with 8 K rows from k (token stride ts;
   rows from n on are not read), folded into 2 vectors of partial sums by the first two levels
   of a transposed add tree (c[0]: tokens 0 4 2 6 in its four 128-bit quarters, c[1]: 1 5 3 7). */
static inline __attribute__((always_inline)) void dot8(const int64_t D, const __m512bh* qv, const uint16_t* k,
                                                       const int64_t ts, const int n, __m512* c) {
  __m512 a[8], b[4];
  for (int t = 0; t < 8; ++t, k += ts) {
    a[t] = _mm512_setzero_ps();
    if (t < n)
      for (int64_t j = 0; j < D / 32; ++j) a[t] = _mm512_dpbf16_ps(a[t], qv[j], load_bh(k + 32 * j));
  }
  for (int i = 0; i < 4; ++i) /* 256-bit halves: b[i] = token i | token i + 4 */
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xEE));
  for (int i = 0; i < 2; ++i) /* 128-bit quarters */
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 2], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 2], 0xDD));
}

/* The n <= 16 scores of one query head (bf16 [D]) against tokens 0 .. n - 1 of k (token
   stride ts elements) in lanes 0 .. n - 1 (the rest 0): vdpbf16ps per token, then the rest of
   the transposed add tree (31 shuffles and 15 adds for 16 sums, against 16 horizontal
   reductions). */
static inline __attribute__((always_inline)) __m512 chunk_scores(const int64_t D, const uint16_t* q,
                                                                 const uint16_t* k, const int64_t ts, const int n) {
  __m512bh qv[MAX_HEAD_DIM / 32];
  for (int64_t j = 0; j < D / 32; ++j) qv[j] = load_bh(q + 32 * j);
  __m512 c[4], d[2];
  if (n == CHUNK) { /* the common case, without a test per token */
    dot8(D, qv, k, ts, 8, c);
    dot8(D, qv, k + 8 * ts, ts, 8, c + 2);
  } else {
    dot8(D, qv, k, ts, n, c);
    if (n > 8)
      dot8(D, qv, k + 8 * ts, ts, n - 8, c + 2);
    else
      c[2] = c[3] = _mm512_setzero_ps();
  }
  /* c: tokens 0 4 2 6 | 1 5 3 7 | 8 12 10 14 | 9 13 11 15 (per 128-bit quarter) */
  for (int i = 0; i < 2; ++i) /* lane pairs */
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  /* z: tokens 0 8 1 9 | 4 12 5 13 | 2 10 3 11 | 6 14 7 15 */
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 1, 3, 9, 11, 5, 7, 13, 15), z);
}

/* A 16-token chunk of one KV head's K (bf16, token stride ts; tokens from n on read as 0)
   transposed to kt[D / 2]: kt[p] holds the bf16 pair (2 p, 2 p + 1) of the 16 tokens, one token
   per 32-bit lane (four rounds of unpack / 128-bit shuffles per 16 x 16 block). */
static inline __attribute__((always_inline)) void transpose_chunk(const int64_t D, const uint16_t* k,
                                                                  const int64_t ts, const int n, __m512i* kt) {
  for (int64_t blk = 0; blk < D / 32; ++blk) {
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_loadu_si512(k + i * ts + 32 * blk) : _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) { /* per 128-bit lane: rows 2i, 2i + 1 interleaved */
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* u[4 i + m], lane L: rows 4 i .. 4 i + 3 of pair 4 L + m */
      u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int m = 0; m < 4; ++m) { /* gather lane L of u[m], u[4 + m], u[8 + m], u[12 + m] */
      const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
      const __m512i w0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
      const __m512i w1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
      kt[16 * blk + m] = _mm512_shuffle_i32x4(v0, w0, 0x88);
      kt[16 * blk + 4 + m] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
      kt[16 * blk + 8 + m] = _mm512_shuffle_i32x4(v1, w1, 0x88);
      kt[16 * blk + 12 + m] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
  }
}

/* The 16 scores of one query head (bf16 [D]) against a transposed chunk: one vdpbf16ps per
   head-dim pair, no horizontal sums (cheaper than chunk_scores once several query heads share
   the transpose: a prefill tile's rows times the GQA group). */
static inline __attribute__((always_inline)) __m512 transposed_scores(const int64_t D, const uint16_t* q,
                                                                      const __m512i* kt) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / 2; j += 2) {
    int32_t p0, p1;
    memcpy(&p0, q + 2 * j, 4);
    memcpy(&p1, q + 2 * j + 2, 4);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(p0), (__m512bh)kt[j]);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(p1), (__m512bh)kt[j + 1]);
  }
  return _mm512_add_ps(a0, a1);
}

/* acc += P V for n <= 16 tokens of one KV head (v bf16, token stride ts) and its G query heads,
   with vdpbf16ps on token pairs: pp[g][i] holds the bf16 probabilities of tokens 2i, 2i + 1
   (0 past n), V rows 2i and 2i + 1 are interleaved with vpunpck[lh]wd. Hence acc's layout: per
   32-wide head-dim segment j, acc[32 j .. 32 j + 15] holds dims {0-3, 8-11, 16-19, 24-27} + 32 j
   and acc[32 j + 16 ..] dims {4-7, 12-15, 20-23, 28-31} + 32 j (unscrambled by store_acc_row). */
static inline __attribute__((always_inline)) void pv_group(const int64_t G, const int64_t D, float* acc,
                                                           const uint32_t (*pp)[CHUNK / 2], const uint16_t* v,
                                                           const int64_t ts, const int n) {
  const int64_t DJ = D / 32;
  __m512 a[24];
  for (int64_t i = 0; i < 2 * G * DJ; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int t = 0; t < n; t += 2) {
    __m512i vi[2 * (MAX_HEAD_DIM / 32)];
    for (int64_t j = 0; j < DJ; ++j) {
      const __m512i x = _mm512_loadu_si512(v + t * ts + 32 * j);
      const __m512i y = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * ts + 32 * j) : _mm512_setzero_si512();
      vi[2 * j] = _mm512_unpacklo_epi16(x, y);
      vi[2 * j + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512bh pg = (__m512bh)_mm512_set1_epi32((int)pp[g][t / 2]);
      for (int64_t k = 0; k < 2 * DJ; ++k) a[g * 2 * DJ + k] = _mm512_dpbf16_ps(a[g * 2 * DJ + k], pg, (__m512bh)vi[k]);
    }
  }
  for (int64_t i = 0; i < 2 * G * DJ; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

static inline __attribute__((always_inline)) void pv_chunk(const int64_t G, const int64_t D, float* acc,
                                                           const uint32_t (*pp)[CHUNK / 2], const uint16_t* v,
                                                           const int64_t ts, const int n) {
  if (G * D / 16 <= 24) /* every accumulator in a register */
    pv_group(G, D, acc, pp, v, ts, n);
  else /* one query head at a time (at most 16 accumulators) */
    for (int64_t g = 0; g < G; ++g) pv_group(1, D, acc + g * D, pp + g, v, ts, n);
}

/* One query head's output row: acc (pv_group's layout) times inv, as bf16 in head-dim order. */
static inline void store_acc_row(const int64_t D, const float* acc, const float inv, uint16_t* out) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < D / 32; ++j) {
    const __m512 a = _mm512_loadu_ps(acc + 32 * j), b = _mm512_loadu_ps(acc + 32 * j + 16);
    _mm256_storeu_si256((__m256i*)(out + 32 * j), bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), vinv)));
    _mm256_storeu_si256((__m256i*)(out + 32 * j + 16),
                        bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), vinv)));
  }
}

/* The arguments every work item shares. */
typedef struct {
  const uint16_t *q, *k_cache, *v_cache;
  const int64_t *block_index, *row_len;
  uint16_t* out;
  int64_t q_row_stride, nblk, H, Hkv, bs;
  float scale;
} tile_args;

/* Rows r0 .. r0 + nr - 1 (all of sequence b), KV heads h0 .. h0 + nh - 1. uncovered: how many
   of the first blocks no earlier item on this thread prefetched (its look-ahead reaches
   PF_DIST blocks past its own); b_next, L_next: the next tile's sequence and length (b_next < 0:
   none), whose first blocks this item's look-ahead reaches. */
static inline __attribute__((always_inline)) void attend_tile_bf16(const int64_t G, const int64_t D,
                                                                   const tile_args* args, const int64_t r0,
                                                                   const int64_t nr, const int64_t h0,
                                                                   const int64_t nh, const int64_t b,
                                                                   const int64_t uncovered,
                                                                   const int64_t b_next, const int64_t L_next) {
  const uint16_t *q = args->q, *k_cache = args->k_cache, *v_cache = args->v_cache;
  const int64_t *block_index = args->block_index, *row_len = args->row_len;
  uint16_t* out = args->out;
  const int64_t q_row_stride = args->q_row_stride, nblk = args->nblk, H = args->H, Hkv = args->Hkv, bs = args->bs;
  const float scale = args->scale;
  const int64_t ts = Hkv * D, heads = nh * G; /* cache token stride; query heads per row */
  float acc[ACC_FLOATS] __attribute__((aligned(64))); /* [nr][nh * G][D] */
  float m[ACC_FLOATS / 32];                           /* [nr][nh * G] running max */
  __m512 l[ACC_FLOATS / 32];                          /* [nr][nh * G] running sum, per lane */
  uint8_t bad[ACC_FLOATS / 32];                       /* [nr][nh * G]: a NaN or infinite score */
  uint32_t pp[MAX_GROUP][CHUNK / 2] __attribute__((aligned(32))); /* bf16 probabilities, token pairs */
  int64_t Lmax = 0;
  for (int64_t i = 0; i < nr; ++i) Lmax = row_len[r0 + i] > Lmax ? row_len[r0 + i] : Lmax;
  memset(acc, 0, (size_t)(nr * heads * D) * sizeof(float));
  for (int64_t i = 0; i < nr * heads; ++i) {
    m[i] = -FLT_MAX;
    l[i] = _mm512_setzero_ps();
    bad[i] = 0;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  prefetch_cursor pf = {(const char*)k_cache, (const char*)v_cache, 0, 0, 0};
  if (h0 == 0)
    prefetch_first_blocks(k_cache, v_cache, block_index, nblk, bs, Hkv, 2 * D, b, Lmax, b_next, L_next, uncovered);
  const int transposed = nr * G >= TRANSPOSE_MIN_HEADS;
  for (int64_t start = 0; start < Lmax; start += bs) {
    const int64_t slot0 = block_index[b * nblk + start / bs] * bs;
    const int64_t nb = Lmax - start < bs ? Lmax - start : bs;
    if (h0 == 0) /* PF_DIST blocks ahead (into the next tile's sequence), spread over this block's steps */
      pf_aim(&pf, block_index, nblk, bs, 2 * D * Hkv, b, Lmax, start / bs + PF_DIST, b_next, L_next,
             ((nb + CHUNK - 1) / CHUNK) * nh * nr * G);
    for (int64_t c = 0; c < nb; c += CHUNK) {
      const int64_t pos = start + c;
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t h = h0 + hh;
        const uint16_t* kb = k_cache + (slot0 + c) * ts + h * D;
        const uint16_t* vb = v_cache + (slot0 + c) * ts + h * D;
        __m512i kt[MAX_HEAD_DIM / 2];
        if (transposed) transpose_chunk(D, kb, ts, nb - c < CHUNK ? (int)(nb - c) : CHUNK, kt);
        for (int64_t i = 0; i < nr; ++i) {
          int64_t left = row_len[r0 + i] - pos; /* this row's tokens from pos on, within the chunk */
          if (left > nb - c) left = nb - c;
          if (left <= 0) continue;
          const int n = left < CHUNK ? (int)left : CHUNK;
          const __mmask16 valid = (__mmask16)((1u << n) - 1u);
          const int64_t base = i * heads + hh * G; /* this row's first query head of KV head h */
          for (int64_t g = 0; g < G; ++g) {
            const uint16_t* qg = q + (r0 + i) * q_row_stride + (h * G + g) * D;
            pf_advance(&pf);
            const __m512 s = _mm512_mul_ps(transposed ? transposed_scores(D, qg, kt) : chunk_scores(D, qg, kb, ts, n),
                                           vscale);
            /* NaN or inf in q or K: the output is NaN, as the float32 math's (a class test: the
               max and exp below would swallow them) */
            bad[base + g] |= _mm512_mask_fpclass_ps_mask(valid, s, 0x99) != 0; /* QNaN, SNaN, +-inf */
            const float bm = _mm512_mask_reduce_max_ps(valid, s);
            if (bm > m[base + g]) { /* rescale what was accumulated under the old maximum */
              if (m[base + g] != -FLT_MAX) { /* something was accumulated */
                const float corr = expf(m[base + g] - bm);
                l[base + g] = _mm512_mul_ps(l[base + g], _mm512_set1_ps(corr));
                float* a = acc + (base + g) * D;
                for (int64_t d = 0; d < D; ++d) a[d] *= corr;
              }
              m[base + g] = bm;
            }
            /* probabilities in [0, 1]: vcvtneps2bf16 rounds to nearest even like f32_to_bf16 and
               only differs on denormals (flushed), which weigh nothing, and is faster */
            const __m256i e = (__m256i)_mm512_cvtneps_pbh(
                _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m[base + g])))));
            /* the sum of the rounded probabilities that weight V: the output stays a convex combination */
            l[base + g] = _mm512_add_ps(l[base + g], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e), 16)));
            _mm256_store_si256((__m256i*)pp[g], e);
          }
          pv_chunk(G, D, acc + base * D, (const uint32_t(*)[CHUNK / 2])pp, vb, ts, n);
        }
      }
    }
  }
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t hh = 0; hh < heads; ++hh) {
      const int64_t idx = i * heads + hh;
      const float sum = _mm512_reduce_add_ps(l[idx]);
      uint16_t* o = out + ((r0 + i) * H + h0 * G + hh) * D;
      if (bad[idx])
        for (int64_t d = 0; d < D; ++d) o[d] = 0x7fc0; /* bf16 quiet NaN */
      else
        store_acc_row(D, acc + idx * D, sum > 0.f ? 1.f / sum : 0.f, o);
    }
}

typedef void (*tile_fn)(int64_t, int64_t, const tile_args*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t);
/* One function per common (G, D), compiled with them constant (unrolled head-dim loops,
   accumulators in registers), and one for any shape. */
#define TILE_FN(name, g, d)                                                                                  \
  static __attribute__((noinline)) void name(int64_t G, int64_t D, const tile_args* args, int64_t r0,       \
                                             int64_t nr, int64_t h0, int64_t nh, int64_t b, int64_t uncov,   \
                                             int64_t b_next, int64_t L_next) {                               \
    (void)G, (void)D;                                                                                        \
    attend_tile_bf16(g, d, args, r0, nr, h0, nh, b, uncov, b_next, L_next);                                 \
  }
TILE_FN(tile_1_64, 1, 64)
TILE_FN(tile_2_64, 2, 64)
TILE_FN(tile_3_64, 3, 64)
TILE_FN(tile_4_64, 4, 64)
TILE_FN(tile_1_128, 1, 128)
TILE_FN(tile_2_128, 2, 128)
TILE_FN(tile_4_128, 4, 128)
TILE_FN(tile_8_128, 8, 128)
TILE_FN(tile_any, G, D)
#undef TILE_FN

static tile_fn pick_tile(int64_t G, int64_t D) {
  if (D == 64) {
    if (G == 1) return tile_1_64;
    if (G == 2) return tile_2_64;
    if (G == 3) return tile_3_64;
    if (G == 4) return tile_4_64;
  } else if (D == 128) {
    if (G == 1) return tile_1_128;
    if (G == 2) return tile_2_128;
    if (G == 4) return tile_4_128;
    if (G == 8) return tile_8_128;
  }
  return tile_any;
}

/* Tiles (runs of up to TILE_ROWS consecutive rows of one sequence) times KV-head groups, in
   parallel. Returns 0, or 3 when the tile list cannot be allocated. */
static int attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                          const int64_t* block_index, int64_t nblk, const int64_t* row_seq, const int64_t* row_len,
                          uint16_t* out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                          int num_threads) {
  const int64_t G = H / Hkv;
  int64_t* tile0 = (int64_t*)malloc((size_t)(T + 1) * sizeof(int64_t));
  if (!tile0) return 3;
  /* rows per tile: as many as the accumulators hold for one KV head (G D <= 4096: >= 4) */
  const int64_t tile_rows = ACC_FLOATS / (G * D) < TILE_ROWS ? ACC_FLOATS / (G * D) : TILE_ROWS;
  int64_t ntiles = 0;
  for (int64_t r = 0; r < T; ++r)
    if (r == 0 || row_seq[r] != row_seq[r - 1] || r - tile0[ntiles - 1] == tile_rows) tile0[ntiles++] = r;
  tile0[ntiles] = T;
  /* all KV heads in an item when there is work enough for every thread (and room for the
     accumulators), else one KV head per item */
  int64_t hg = ACC_FLOATS / (tile_rows * G * D);
  if (hg > Hkv) hg = Hkv;
  if (hg < 1 || ntiles < 2 * num_threads) hg = 1;
  const int64_t ngroups = (Hkv + hg - 1) / hg;
  const tile_args args = {q, k_cache, v_cache, block_index, row_len, out, q_row_stride, nblk, H, Hkv, bs, scale};
  const tile_fn fn = pick_tile(G, D);
#pragma omp parallel num_threads(num_threads)
  {
    int64_t prev = -2; /* this thread's previous item: its prefetches cover this one's first blocks */
#pragma omp for schedule(guided)
    for (int64_t item = 0; item < ntiles * ngroups; ++item) {
      const int64_t t = item / ngroups, h0 = (item % ngroups) * hg, r0 = tile0[t];
      const int64_t b_next = t + 1 < ntiles ? row_seq[tile0[t + 1]] : -1;
      const int64_t L_next = t + 1 < ntiles ? row_len[tile0[t + 2] - 1] : 0;
      int64_t uncovered = PF_DIST; /* the previous tile's look-ahead reached our blocks past its own */
      if (item == prev + 1 && t > 0) {
        int64_t Lp = 0;
        for (int64_t r = tile0[t - 1]; r < r0; ++r) Lp = row_len[r] > Lp ? row_len[r] : Lp;
        uncovered = PF_DIST - (Lp + bs - 1) / bs;
      }
      fn(G, D, &args, r0, tile0[t + 1] - r0, h0, Hkv - h0 < hg ? Hkv - h0 : hg, row_seq[r0], uncovered, b_next,
         L_next);
      prev = item;
    }
  }
  free(tile0);
  return 0;
}
#endif

/* One (row, KV head) pair. always_inline: the dispatcher below calls it with constant
 * dtype, G and D for the common shapes, so the compiler unrolls the head-dim loops and keeps
 * the accumulators in registers. */
static inline __attribute__((always_inline)) void attend_row(
    const int dtype, const int64_t G, const int64_t D, const int64_t item, const void* q, const int64_t q_row_stride,
    const void* k_cache, const void* v_cache, const int64_t* block_index, const int64_t nblk,
    const int64_t* row_seq, const int64_t* row_len, void* out, const int64_t T, const int64_t H, const int64_t Hkv,
    const int64_t bs, const float scale) {
  const int64_t r = item / Hkv, h = item % Hkv;
  const int64_t b = row_seq[r], L = row_len[r];
  const int64_t b_next = r + 1 < T ? row_seq[r + 1] : -1, L_next = r + 1 < T ? row_len[r + 1] : 0;
  float qf[MAX_GROUP][MAX_HEAD_DIM];   /* scaled query, float32 (generic scores) */
  float acc[MAX_GROUP][MAX_HEAD_DIM];  /* sum of p * V, float32 */
  float m[MAX_GROUP], l[MAX_GROUP];    /* running max and sum of the softmax */
  float s[MAX_GROUP][MAX_BLOCK];       /* one block's scores, then probabilities */
  float vf[MAX_HEAD_DIM];
  for (int64_t g = 0; g < G; ++g) {
    const int64_t qoff = r * q_row_stride + (h * G + g) * D;
    load_row(dtype, q, qoff, D, qf[g]);
    for (int64_t d = 0; d < D; ++d) {
      qf[g][d] *= scale;
      acc[g][d] = 0.f;
    }
    m[g] = -FLT_MAX;
    l[g] = 0.f;
  }
  const int64_t row_bytes = D * (dtype == 1 ? 2 : 4);
  /* The row's head-0 item prefetches for all its heads (the next items on this thread) the
     block PF_DIST ahead (past the row's end: the next row's), a few lines per token; the
     previous row's look-ahead reached this row's blocks past its own, and the first ones it
     could not reach (a row shorter than PF_DIST blocks) are asked for here. */
  prefetch_cursor pf = {(const char*)k_cache, (const char*)v_cache, 0, 0, 0};
  const int64_t prev_blocks = r > 0 && row_len[r - 1] > 0 ? (row_len[r - 1] + bs - 1) / bs : 0;
  if (L > 0 && h == 0)
    prefetch_first_blocks(k_cache, v_cache, block_index, nblk, bs, Hkv, row_bytes, b, L, b_next, L_next,
                          PF_DIST - prev_blocks);
  for (int64_t start = 0; start < L; start += bs) {
    const int64_t n = L - start < bs ? L - start : bs;
    const int64_t slot0 = block_index[b * nblk + start / bs] * bs;
    if (h == 0) pf_aim(&pf, block_index, nblk, bs, Hkv * row_bytes, b, L, start / bs + PF_DIST, b_next, L_next, n);
    for (int64_t t = 0; t < n; ++t) {
      pf_advance(&pf);
      score_row(dtype, k_cache, ((slot0 + t) * Hkv + h) * D, D, G, qf, &s[0][t], MAX_BLOCK);
    }
    for (int64_t g = 0; g < G; ++g) {
      float bm = -FLT_MAX;
      for (int64_t t = 0; t < n; ++t) bm = s[g][t] > bm ? s[g][t] : bm;
      if (bm > m[g]) { /* rescale what was accumulated under the old maximum */
        const float corr = l[g] > 0.f ? expf(m[g] - bm) : 0.f;
        l[g] *= corr;
        for (int64_t d = 0; d < D; ++d) acc[g][d] *= corr;
        m[g] = bm;
      }
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        s[g][t] = expf(s[g][t] - m[g]);
        sum += s[g][t];
      }
      l[g] += sum;
    }
    for (int64_t t = 0; t < n; ++t) {
      load_row(dtype, v_cache, ((slot0 + t) * Hkv + h) * D, D, vf);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g][t];
        for (int64_t d = 0; d < D; ++d) acc[g][d] += p * vf[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    const int64_t ooff = (r * H + h * G + g) * D;
    if (dtype == 0) {
      float* op = (float*)out + ooff;
      for (int64_t d = 0; d < D; ++d) op[d] = acc[g][d] * inv;
    } else {
      uint16_t* op = (uint16_t*)out + ooff;
      for (int64_t d = 0; d < D; ++d) op[d] = f32_to_bf16(acc[g][d] * inv);
    }
  }
}

int pagedllm_paged_attention(int dtype, const void* q, int64_t q_row_stride, const void* k_cache,
                             const void* v_cache, const int64_t* block_index, int64_t nblk,
                             const int64_t* row_seq, const int64_t* row_len, void* out, int64_t T, int64_t H,
                             int64_t Hkv, int64_t D, int64_t bs, float scale, int num_threads) {
  if (dtype < 0 || dtype > 1 || Hkv < 1 || H % Hkv || H / Hkv > MAX_GROUP || D > MAX_HEAD_DIM ||
      bs > MAX_BLOCK || D < 1 || bs < 1 || num_threads < 1)
    return 1;
  if (T < 1 || H < 1) return 0; /* nothing to attend */
#ifdef PAGEDLLM_AVX512_BF16
  if (dtype == 1 && D % 32 == 0)
    return attention_bf16((const uint16_t*)q, q_row_stride, (const uint16_t*)k_cache, (const uint16_t*)v_cache,
                          block_index, nblk, row_seq, row_len, (uint16_t*)out, T, H, Hkv, D, bs, scale, num_threads);
#endif
  const int64_t G = H / Hkv;
#define PAGEDLLM_ITEM(dt, g, d) attend_row(dt, g, d, item, q, q_row_stride, k_cache, v_cache, block_index, nblk, \
                                            row_seq, row_len, out, T, H, Hkv, bs, scale)
#define PAGEDLLM_SHAPES(dt)                                                   \
  if (D == 64 && G == 1) PAGEDLLM_ITEM(dt, 1, 64);                            \
  else if (D == 64 && G == 2) PAGEDLLM_ITEM(dt, 2, 64);                       \
  else if (D == 64 && G == 3) PAGEDLLM_ITEM(dt, 3, 64);                       \
  else if (D == 64 && G == 4) PAGEDLLM_ITEM(dt, 4, 64);                       \
  else if (D == 128 && G == 1) PAGEDLLM_ITEM(dt, 1, 128);                     \
  else if (D == 128 && G == 2) PAGEDLLM_ITEM(dt, 2, 128);                     \
  else if (D == 128 && G == 4) PAGEDLLM_ITEM(dt, 4, 128);                     \
  else if (D == 128 && G == 8) PAGEDLLM_ITEM(dt, 8, 128);                     \
  else PAGEDLLM_ITEM(dt, G, D);
  /* rows of one sequence are neighbours: contiguous chunks keep its K/V in this core's cache */
#pragma omp parallel for schedule(guided) num_threads(num_threads)
  for (int64_t item = 0; item < T * Hkv; ++item) {
    if (dtype == 1) {
      PAGEDLLM_SHAPES(1)
    } else {
      PAGEDLLM_SHAPES(0)
    }
  }
  return 0;
}
