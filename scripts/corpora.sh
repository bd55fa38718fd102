#!/usr/bin/env bash
# The shipped generated corpora (calibrate/assets/generated/, docs/longgen.md "Generated corpora") written
# again into out/corpora/, never over the shipped ones: the built-in target's text for every prompt of each
# workload, sampled (temperature 0.8, seed 0; math and science as shipped: 2,048 tokens, then lengthened to
# 4,096) and greedy, 4,096 tokens, plus diary-long. Resumable: a rerun skips finished prompts. The same settings
# and seeds, not always the same tokens: the shipped sampled text up to 2,048 tokens (diary: all of it) was decoded
# with transformers' default cache, and another order of floating-point sums can tip a draw.
# Usage: scripts/corpora.sh [WORKLOADS] (about 35 minutes a 4,096-token corpus on one thread, two side by side on
# 2 CPU cores; 25 a lengthening from 2,048; 40 for diary-long).
set -euo pipefail
WORKLOADS=${1:-diary math science}
SD=${SD:-.venv/bin/sharpdraft}
OUT=${OUT:-out/corpora}
mkdir -p "$OUT"
gen() { $SD generate --new-tokens "$1" --min-new-tokens "$1" --threads 1 --resume "${@:2}"; }
for w in $WORKLOADS; do
  if [ "$w" = diary ]; then
    gen 4096 --workload diary:all --batch 16 --out "$OUT/diary-sampled"
    gen 7890 --workload diary:heldout --batch 4 --out "$OUT/diary-long"
  else
    gen 2048 --workload "$w:all" --batch 16 --out "$OUT/$w-2048"
    gen 4096 --workload "$w:all" --batch 16 --lengthen "$OUT/$w-2048" --out "$OUT/$w-sampled"
  fi
  gen 4096 --workload "$w:all" --batch 16 --temperature 0 --out "$OUT/$w-greedy"
done
