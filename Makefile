# Two commands do all set-up on a fresh machine:
#   make run    start the local cluster on the embedded default
#   make test   run the whole test suite
# Both create .venv and install what they need through `make install`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# llama-cpp-python builds from source (about 5 minutes on 2 cores); the wheel is
# built once, portable (no -march=native), and kept outside the work tree so
# fresh clones on the same machine reuse it.
LLAMA_CPP_VERSION := 0.3.36
WHEELHOUSE ?= $(HOME)/.cache/modelpool/wheels

.PHONY: install run test test-gpu test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip wheel
	@mkdir -p $(WHEELHOUSE)
	@if ! ls $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
		echo "building llama-cpp-python $(LLAMA_CPP_VERSION) once (portable, about 5 minutes)"; \
		CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
			$(BIN)/pip wheel --no-deps --wheel-dir $(WHEELHOUSE) llama-cpp-python==$(LLAMA_CPP_VERSION); \
	fi
	$(BIN)/pip install --quiet --find-links $(WHEELHOUSE) -e '.[dev]'
	@# llama.cpp's own llama-server, from the same llama.cpp source, once (about 10 minutes; cached beside the wheel)
	$(BIN)/python -m services.engines.llama_server.binary
	touch $@

run: install
	$(BIN)/modelpool up

test: install
	$(BIN)/pytest -q

# On a machine with an NVIDIA GPU and vLLM: the worker's vLLM adapter against a real `vllm serve`.
test-gpu: install
	$(BIN)/pytest -q tests/gpu

# The inner loop: the pure and in-memory tests, no servers, processes or model (well under a minute).
test-fast: install
	$(BIN)/pytest -q -m "not servers and not processes and not model"

bench: install
	$(BIN)/python bench/eventlog.py
	$(BIN)/python bench/sim.py
	$(BIN)/python bench/llamacpp_engine.py
	$(BIN)/python bench/controller.py
	$(BIN)/python bench/pool.py
	$(BIN)/python bench/chaos.py

clean:
	rm -rf $(VENV)
