#!/usr/bin/env bash
# One prepared GPU job, sized for one call of under 10 minutes on one H200: every drafter this
# toolkit trains, at once, each for at most TRAIN_S seconds, then each checked on held-out text.
#
#   bash benchmarks/gpu_train.sh              # on the GPU machine, after scripts/gpu_stage.py's parts arrived
#   FETCH=pard bash benchmarks/gpu_train.sh   # a later call: the PARD drafter, in parts of 14 MiB
#   FETCH=dflash bash benchmarks/gpu_train.sh # another: the DFlash head with its draft vocabulary
#
# JOBS (default "copy dflash pard") picks among:
#   copy    the three EAGLE-3 heads retrained on the recall mix (scripts/train_copy_heads.sh, PARALLEL=1);
#   dflash  a DFlash head on the same features (scripts/train_dflash.py, blocks of 5, 256 a step);
#   pard    a PARD drafter (scripts/train_pard.py, SmolLM2's layers 0-2 and 29, 16 sequences a step);
#   pard-regen (opt-in) the same drafter trained on text the target wrote (scripts/regenerate.py: 8,192
#           sequences of 512, 64 tokens of a training sequence then 448 sampled from SmolLM2 at T = 1),
#           beside `pard` for a paired comparison: the first GPU run's PARD drafter saw its 2,275
#           sequences five times and its held-out acceptance stayed where 800 CPU steps had left it;
#   circuit (opt-in: JOBS=circuit) the demo head grown with the two-token copy circuit
#           (scripts/induction_head.py --bigram, docs/training.md "A copy circuit, built rather than
#           learned"), then trained end to end on the recall features (train_demo_eagle3.py --init),
#           so that fc learns to keep the token identity the circuit's key map reads.
# SmolLM2 comes from .gpu/ (scripts/gpu_stage.py unpack; docs/training.md "On a GPU machine" gives the
# transfers that bring it). A drafter stopped at TRAIN_S (default 240 s) keeps its last save. Under $OUT
# (else ./gpu_out): job.log, results.tar.gz (configs, training logs, each check's JSON; each check stops
# at CHECK_S seconds) and the EAGLE-3 heads' model.safetensors (14 MiB each). The PARD drafter (54 MiB)
# and the DFlash head (22 MiB) do not fit beside them in what one call returns (64 MiB): FETCH=pard and
# FETCH=dflash return each, split, with its config and log.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu_out}"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/sharpdraft-site}"
TRAIN_S="${TRAIN_S:-240}"
CHECK_S="${CHECK_S:-100}"  # each check's limit, so that what was trained comes back within one call
JOBS="${JOBS:-copy dflash pard}"
FEATURES=.cache/smollm2-features-copy-mix  # scripts/train_copy_heads.sh writes it
mkdir -p "$OUT"
if [[ -n "${FETCH:-}" ]]; then  # pard, pard-regen or dflash: one drafter's weights in parts of 14 MiB
    case "$FETCH" in
        pard) folder=.cache/heads/pard-smollm2 ;;
        pard-regen) folder=.cache/heads/pard-smollm2-regen ;;
        dflash) folder=.cache/heads/dflash-smollm2-v4096 ;;
        *) echo "FETCH=$FETCH: expected pard, pard-regen or dflash"; exit 1 ;;
    esac
    [[ -f "$folder/model.safetensors" ]] || { echo "no $FETCH drafter in $folder: run the job first"; exit 1; }
    split -b 14M -d "$folder/model.safetensors" "$OUT/$FETCH.safetensors.part"
    cp "$folder/config.json" "$OUT/$FETCH.config.json"
    cp "$folder/training_log.json" "$OUT/$FETCH.training_log.json"
    sha256sum "$folder/model.safetensors" | tee "$OUT/$FETCH.sha256"
    exit 0
fi
mkdir -p "$OUT/results"
exec > >(tee "$OUT/job.log") 2>&1
export PYTHONUNBUFFERED=1
started=$SECONDS
stamp() { echo "[$((SECONDS - started)) s] $*"; }
wants() { [[ " $JOBS " == *" $1 "* ]]; }

stamp "unpacking SmolLM2"
"$PY" scripts/gpu_stage.py unpack --site "$SITE" || exit 1
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name(0))" \
    || exit 1

rm -f .cache/train-*.log
mkdir -p .cache
pids=()
if wants pard; then  # needs no features: starts at once
    stamp "pard: training"
    "$PY" scripts/train_pard.py --out .cache/heads/pard-smollm2 --device cuda --batch 16 --sequences 4096 \
        --save-every 25 > .cache/train-pard-smollm2.log 2>&1 &
    pids+=($!)
fi
if wants pard-regen; then  # the target writes the text first (seconds on a GPU), then the drafter trains on it
    stamp "pard-regen: the target writes the training text"
    ( "$PY" scripts/regenerate.py --out .cache/regen-smollm2-512.npy --sequences 8192 --batch 1024 --device cuda \
          --threads 4 && \
      "$PY" scripts/train_pard.py --out .cache/heads/pard-smollm2-regen --device cuda --batch 16 \
          --tokens .cache/regen-smollm2-512.npy --save-every 25 ) > .cache/train-pard-smollm2-regen.log 2>&1 &
    pids+=($!)
fi
if wants copy || wants dflash; then
    stamp "features (and, with copy, the three EAGLE-3 heads at once)"
    if wants copy; then
        PARALLEL=1 DEVICE=cuda PYTHON="$PY" THREADS=4 PRECISION=bf16 bash scripts/train_copy_heads.sh &
        copy=$!
        while kill -0 "$copy" 2>/dev/null && ! ls .cache/train-eagle3-smollm2*.log >/dev/null 2>&1; do sleep 2; done
        pids+=("$copy")
    else
        FEATURES_ONLY=1 DEVICE=cuda PYTHON="$PY" THREADS=8 bash scripts/train_copy_heads.sh
    fi
    if wants dflash; then
        stamp "dflash: training"
        # many anchors a step: on a CPU, more blocks of fewer rows left the first row's plateau sooner
        # (docs/training.md, "A DFlash head"); a GPU takes hundreds of blocks a step at little cost in time.
        # Blocks of 5, as the built-in head's: the loop verifies 4 drafts. The layers start from SmolLM2's
        # last three, which reached the random start's check in half the steps
        "$PY" scripts/train_dflash.py --features "$FEATURES" --out .cache/heads/dflash-smollm2 --device cuda \
            --layers 3 --layer-init target --block 5 --anchors 256 --write-every-save > .cache/train-dflash-smollm2.log 2>&1 &
        pids+=($!)
    fi
fi
if wants circuit; then
    CIRCUIT_FEATURES=.cache/smollm2-features-recall-1024
    stamp "circuit: recall features, then the circuit (CPU threads)"
    "$PY" scripts/target_features.py --sources recall:pydoc:train,recall:stdlib --per-source 100,220 \
        --seq-len 1024 --tokens 327680 --out "$CIRCUIT_FEATURES" --device cuda --threads 8 || exit 1
    "$PY" scripts/induction_head.py --features "$CIRCUIT_FEATURES" --out .cache/heads/eagle3-smollm2-ind-bi \
        --epochs 12 --scale 0.5 --bigram --threads 8 > .cache/train-induction.log 2>&1 || exit 1
    stamp "circuit: end-to-end training"
    "$PY" scripts/train_demo_eagle3.py --features "$CIRCUIT_FEATURES" --span 256 --rows 4096 --copy-share 0.8 \
        --lr 3e-4 --steps 2000 --precision bf16 --device cuda --save-every 50 --write-every-save \
        --init .cache/heads/eagle3-smollm2-ind-bi --out .cache/heads/eagle3-smollm2-ind-bi-gpu \
        > .cache/train-eagle3-smollm2-ind-bi-gpu.log 2>&1 &
    pids+=($!)
fi
deadline=$((SECONDS + TRAIN_S))
running() { for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
while running && (( SECONDS < deadline )); do sleep 2; done
if running; then
    stamp "training time is up: stopping (each drafter keeps its last save)"
    for pid in "${pids[@]}"; do  # this job's trainers only (background jobs ignore SIGINT; saves are atomic)
        pkill -TERM -P "$pid" 2>/dev/null
        kill -TERM "$pid" 2>/dev/null
    done
fi
for pid in "${pids[@]}"; do wait "$pid"; done
cp .cache/train-*.log "$OUT/results/" 2>/dev/null

# fp32 weights, as on a CPU: the checks compare with CPU figures, and in bf16 the batched verification
# and the one-row target pass round differently (the first GPU run's greedy outputs were not identical)
check() {  # name, folder, eval arguments...
    local name="$1" folder="$2"; shift 2
    [[ -f "$folder/model.safetensors" ]] || { stamp "$name: nothing written"; return; }
    stamp "$name: checks"
    timeout "$CHECK_S" "$PY" -m calibrate eval --drafter-path "$folder" --corpus stdlib:heldout --lengths 256 \
        --sequences 12 --variants none --speculative --dtype float32 --json "$@" > "$OUT/results/accept-$name.json"
    timeout "$CHECK_S" "$PY" -m calibrate eval --drafter-path "$folder" --corpus recall:stdlib:heldout \
        --lengths 256 --sequences 4 --variants none --dtype float32 --json "$@" > "$OUT/results/copy-$name.json"
    cp "$folder/config.json" "$OUT/results/$name.config.json"
    cp "$folder/training_log.json" "$OUT/results/$name.training_log.json"
}
checks=()  # the drafters' checks at once, each on its own CPU threads and the one GPU
if wants copy; then
    for head in eagle3-smollm2 eagle3-smollm2-far eagle3-smollm2-long; do
        check "$head" ".cache/heads/$head" --drafter eagle3 --threads 2 & checks+=($!)
        cp ".cache/heads/$head/model.safetensors" "$OUT/$head.safetensors" 2>/dev/null
    done
fi
if wants dflash && [[ -f .cache/heads/dflash-smollm2/model.safetensors ]]; then
    # the built-in head drafts from its training text's 4,096 most frequent tokens (its TRAINING.md)
    rm -rf .cache/heads/dflash-smollm2-v4096
    "$PY" scripts/dflash_draft_vocab.py .cache/heads/dflash-smollm2 --features "$FEATURES" --size 4096 \
        --out .cache/heads/dflash-smollm2-v4096
    check dflash-smollm2 .cache/heads/dflash-smollm2-v4096 --drafter dflash --threads 2 & checks+=($!)
fi
wants pard && { check pard-smollm2 .cache/heads/pard-smollm2 --drafter pard --num-draft 4 --threads 2 & checks+=($!); }
wants pard-regen && { check pard-smollm2-regen .cache/heads/pard-smollm2-regen --drafter pard --num-draft 4 --threads 2 &
                      checks+=($!); }
if wants circuit; then
    for head in eagle3-smollm2-ind-bi eagle3-smollm2-ind-bi-gpu; do
        check "$head" ".cache/heads/$head" --drafter eagle3 --threads 2 & checks+=($!)
        cp ".cache/heads/$head/model.safetensors" "$OUT/$head.safetensors" 2>/dev/null
    done
fi
for pid in "${checks[@]}"; do wait "$pid"; done
stamp "done"
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
