"""OpenAI's Files and Batch API on NATS JetStream: the objects (``objects.py``), their storage
(``store.py``), the input file's checks (``validation.py``), the HTTP routes (``routes.py``), the
``batch`` service that runs the lines (``worker.py``, its own process; ``lines.py``: one line through
the gateway's ``OpenAIServing``, shared with the offline command); the offline
``pagedllm run-batch`` is ``pagedllm/run_batch.py``.

The batch service runs each line through the gateway's own ``OpenAIServing`` (the same
validation, engine requests and response bodies as an HTTP request), which is why it lives
beside the gateway's code rather than under ``services/``.
"""
