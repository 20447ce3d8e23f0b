/* pagedllm_abi(): what this build of the library speaks (pagedllm_abi.h), for kernels/cpu/native.py. */
#include "pagedllm_abi.h"

const pagedllm_abi_info* pagedllm_abi(void) {
  static const pagedllm_abi_info info = {
      PAGEDLLM_ABI_VERSION, (int64_t)sizeof(pagedllm_abi_info), (int64_t)sizeof(pagedllm_llama_args),
      MAX_GROUP,            MAX_HEAD_DIM,                        MAX_BLOCK,
      MAX_ROPE_DIM,         PANEL,                               MAX_SHARDS,
  };
  return &info;
}
