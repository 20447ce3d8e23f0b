"""pagedllm's common code: settings, wire messages, subjects, the NATS bus, logging."""
