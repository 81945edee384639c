# The two commands of the README. Both set up .venv first (scripts/setup.sh).
PY := .venv/bin/python
DEMO_DIR ?= demo

.PHONY: setup demo test test-fast test-gpu lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m dlrm generate --out $(DEMO_DIR)/data/train --rows 200000 --config configs/tiny.yaml --seed 1
	$(PY) -m dlrm generate --out $(DEMO_DIR)/data/eval --rows 50000 --config configs/tiny.yaml --seed 2
	$(PY) -m dlrm train --config configs/tiny.yaml --out $(DEMO_DIR)/run \
	    data.train=$(DEMO_DIR)/data/train data.eval=$(DEMO_DIR)/data/eval
	$(PY) -m dlrm eval --checkpoint $(DEMO_DIR)/run --data $(DEMO_DIR)/data/eval --plots $(DEMO_DIR)/run/plots

# Two pytest-xdist workers, each taking whole files (module fixtures run once): 13-18
# minutes on the 2-core CI machine against 17-18 in one process (README). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The fast set (under a minute): no multi-process launches, nothing over ~2 s.
test-fast: setup
	$(PY) -m pytest -m "not slow and not distributed" tests

# CUDA tests alone (tests/test_gpu.py; skipped on a machine without CUDA). On a GPU
# machine that has its own torch and no .venv: make test-gpu PY=python3 (no setup).
test-gpu: $(if $(filter .venv/bin/python,$(PY)),setup)
	PYTHONPATH=. $(PY) -m pytest -m "gpu or kernels" tests

lint: setup
	$(PY) -m ruff check dlrm embeddings data tests
