#!/usr/bin/env bash
# One prepared GPU job: the three EAGLE-3 heads retrained on the recall mix (scripts/train_copy_heads.sh,
# the three at once), then each checked on held-out text; sized for one lent H200 call (under 10 min).
#
#   bash benchmarks/gpu_copy_heads.sh        # on the GPU machine, after scripts/gpu_stage.py's parts arrived
#
# SmolLM2 comes from .gpu/ (scripts/gpu_stage.py unpack; docs/training.md "On a GPU machine" gives the
# calls that carry it there). TRAIN_S bounds the heads' training (default 300 s; a head stopped then keeps
# its last save, written every 10 steps). Under $OUT (else ./gpu_out): job.log, the three heads'
# model.safetensors, and results.tar.gz with their config.json and training_log.json, each check's JSON
# and the training logs.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu_out}"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/sharpdraft-site}"
TRAIN_S="${TRAIN_S:-300}"
STEPS="${STEPS:-1000}"
HEADS=(eagle3-smollm2 eagle3-smollm2-far eagle3-smollm2-long)
mkdir -p "$OUT" "$OUT/results"
exec > >(tee "$OUT/job.log") 2>&1
export PYTHONUNBUFFERED=1
started=$SECONDS
stamp() { echo "[$((SECONDS - started)) s] $*"; }

stamp "unpacking SmolLM2"
"$PY" scripts/gpu_stage.py unpack --site "$SITE" || exit 1
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name(0))" \
    || exit 1

stamp "features, then the three heads at once (at most $TRAIN_S s for the heads)"
rm -f .cache/train-eagle3-smollm2*.log
PARALLEL=1 DEVICE=cuda PYTHON="$PY" STEPS="$STEPS" THREADS=4 PRECISION=bf16 bash scripts/train_copy_heads.sh &
job=$!
while kill -0 "$job" 2>/dev/null && ! ls .cache/train-eagle3-smollm2*.log >/dev/null 2>&1; do sleep 2; done
stamp "features done; heads training"
deadline=$((SECONDS + TRAIN_S))
while kill -0 "$job" 2>/dev/null && (( SECONDS < deadline )); do sleep 2; done
if kill -0 "$job" 2>/dev/null; then
    stamp "training time is up: stopping the heads (each keeps its last save)"
    pkill -TERM -f scripts/train_demo_eagle3.py  # background jobs ignore SIGINT; saves are atomic
fi
wait "$job"
cp .cache/train-eagle3-smollm2*.log "$OUT/results/" 2>/dev/null

for head in "${HEADS[@]}"; do
    folder=".cache/heads/$head"
    [[ -f "$folder/model.safetensors" ]] || { stamp "$head: no head written"; continue; }
    stamp "$head: copy agreement (recall:stdlib:heldout, n <= 256) and acceptance (stdlib:heldout, 12 prompts)"
    "$PY" -m calibrate eval --drafter eagle3 --drafter-path "$folder" --corpus recall:stdlib:heldout --lengths 256 \
        --sequences 4 --variants none --json > "$OUT/results/copy-$head.json"
    "$PY" -m calibrate eval --drafter eagle3 --drafter-path "$folder" --corpus stdlib:heldout --lengths 256 \
        --sequences 12 --variants none --speculative --json > "$OUT/results/accept-$head.json"
    cp "$folder/model.safetensors" "$OUT/$head.safetensors"
    cp "$folder/config.json" "$OUT/results/$head.config.json"
    cp "$folder/training_log.json" "$OUT/results/$head.training_log.json"
done
stamp "done"
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
