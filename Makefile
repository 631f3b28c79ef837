# Everything sets itself up from a fresh clone: a .venv in the repo, the CPU wheel of torch
# installed first (an unpinned torch would pull a multi-GB CUDA build), then laqat editable.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.laqat-installed

.PHONY: demo test bench-rewrite clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[fla,test]'
	# Megatron-Core for tests/megatron: its cp311 wheel declares Python >= 3.12; its dependencies (torch,
	# numpy, packaging) are in place by now. psutil: its checkpoint writer imports it.
	$(PY) -m pip install -q --ignore-requires-python megatron-core==0.19.2 psutil
	touch $(STAMP)

# laqat's cache (LAQAT_CACHE_DIR: the chunk kernels' autotuning choices) is kept in the repo, so `make clean`
# removes it too.
RUN := TRITON_INTERPRET=1 LAQAT_CACHE_DIR=$(CURDIR)/.laqat_cache

demo: $(STAMP)
	$(RUN) $(PY) examples/quickstart.py

test: $(STAMP)
	$(RUN) $(PY) -m pytest -q -n 2 --dist loadgroup --durations=40 tests

bench-rewrite: $(STAMP)
	$(PY) examples/benchmarks/rewrite_time.py

clean:
	rm -rf $(VENV) .laqat_cache
