"""The executor: model weights, the paged KV cache, kernels and sampling."""
