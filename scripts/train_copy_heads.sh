#!/usr/bin/env bash
# Heads that copy: the recall training mix and the three EAGLE-3 heads continued on it, sized for one GPU.
#
#   bash scripts/train_copy_heads.sh                                   # on a machine with a CUDA GPU
#   DEVICE=cpu THREADS=1 PRECISION=fp32 STEPS=400 bash scripts/train_copy_heads.sh   # on a CPU: many hours
#
# 1. Features (scripts/target_features.py, resumable): 32 recall sequences of 8,192 tokens from the
#    training splits (calibrate.recall: passages recurring verbatim 48 to 7,936 tokens back, 16 from
#    pydoc and 16 from the stdlib, so every distance appears at least once per source), then the 64
#    plain sequences the heads were first trained on (13 pydoc, 51 stdlib): 786,432 target tokens.
# 2. Each head continues from its shipped checkpoint with its own key rule (demo: 256 contiguous keys;
#    every distance: 128 local + 128 drawn, 64 of them match keys; long: every key up to 8,191), half
#    of its windows drawn from the sequences whose copies it can reach (--copy-share 0.5). Resumable;
#    a head is written at every save. Heads go to .cache/heads/: check them on held-out text
#    (docs/training.md) before copying them into calibrate/assets/. PARALLEL=1 trains the three at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
DEVICE="${DEVICE:-cuda}"
THREADS="${THREADS:-8}"
STEPS="${STEPS:-1000}"
PRECISION="${PRECISION:-bf16}"
FEATURES=.cache/smollm2-features-copy-mix

"$PY" scripts/target_features.py --sources recall:pydoc:train,recall:stdlib,pydoc:train,stdlib \
    --per-source 16,16,13,51 --tokens $((96 * 8192)) --device "$DEVICE" --threads "$THREADS" --out "$FEATURES"
[[ "${FEATURES_ONLY:-0}" == 1 ]] && exit 0  # the features alone (the DFlash head reads them too)

COMMON=(--features "$FEATURES" --copy-share 0.5 --lr 1e-3 --steps "$STEPS" --precision "$PRECISION"
        --device "$DEVICE" --threads "$THREADS" --write-every-save)
HEADS=(
    "eagle3-smollm2|--span 256 --seed 5"
    "eagle3-smollm2-far|--span 256 --far 128 --match 64 --seed 6"
    "eagle3-smollm2-long|--span 8192 --seed 7"
)
# PARALLEL=1 trains the three heads at once (one GPU holds all three); each logs to .cache/train-<head>.log.
pids=()
for entry in "${HEADS[@]}"; do
    name="${entry%%|*}"
    read -r -a rule <<< "${entry#*|}"
    run=("$PY" scripts/train_demo_eagle3.py "${rule[@]}" "${COMMON[@]}" --init "calibrate/assets/$name"
         --out ".cache/heads/$name")
    if [[ "${PARALLEL:-0}" == 1 ]]; then
        "${run[@]}" > ".cache/train-$name.log" 2>&1 &
        pids+=($!)
    else
        "${run[@]}"
    fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
