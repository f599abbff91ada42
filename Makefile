PY ?= python3
.PHONY: install demo test lint bench
install:
	PYTHON=$(PY) scripts/install.sh
demo: install
	$(PY) -m cpkv demo
test: install
	$(PY) scripts/run_tests.py
lint:
	$(PY) -m ruff check cpkv tests benchmarks cluster scripts
bench:
	$(PY) benchmarks/bench_core.py
