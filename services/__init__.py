"""pagedllm services: tokenizer, scheduler, executor, detokenizer."""
