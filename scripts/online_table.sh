#!/usr/bin/env bash
# The end-to-end online-adaptation table (docs/results.md "End to end on the three workloads (4,096 tokens)"):
# for each workload and drafter kind, `sharpdraft bench` on the 2 first held-out prompts, 4,096 new tokens, greedy,
# the head alone named, arms none, spec, online-full and online-lora; science with --min-new-tokens 4096 (greedy,
# the built-in target answers it in a few hundred tokens). The spec is the one shipped beside the results
# (benchmarks/results/online-spec-WORKLOAD-KIND.json) where there is one, else calibrated here on the workload's
# train prompts. Writes out/online/: each run's JSON and plot, then summary.md (`scripts/bench_table.py --summary`).
# Usage: scripts/online_table.sh [WORKLOADS] [KINDS] (60 to 125 minutes a run on one thread of 2 CPU cores shared
# by two or three runs; a stopped run resumes where it stopped).
set -euo pipefail
WORKLOADS=${1:-diary math science}
KINDS=${2:-eagle3 dflash}
SD=${SD:-.venv/bin/sharpdraft}
OUT=${OUT:-out/online}
SPECS=${SPECS:-benchmarks/results}
mkdir -p "$OUT"
for w in $WORKLOADS; do
  case $w in science) longer="--min-new-tokens 4096" ;; *) longer="" ;; esac
  for kind in $KINDS; do
    spec="$SPECS/online-spec-$w-$kind.json"
    if [ ! -f "$spec" ]; then
      spec="$OUT/spec-$w-$kind.json"
      [ -f "$spec" ] || $SD calibrate --drafter "$kind" --drafter-path "calibrate/assets/$kind-smollm2" \
        --corpus "generated:$w" --sequences 6 --max-length 2048 --out "$spec"
    fi
    out="$OUT/online-$w-$kind.json"
    resume=""
    [ -d "$out.partial" ] && resume="--resume"
    # shellcheck disable=SC2086  # $longer and $resume are option lists, or empty
    [ -f "$out" ] || $SD bench --drafter "$kind" --drafter-path "calibrate/assets/$kind-smollm2" --workload "$w" \
      --prompts 2 --new-tokens 4096 $longer --variants none,spec,online-full,online-lora --spec "$spec" \
      --threads 1 $resume --json --plot "${out%.json}.png" --out "$out" > /dev/null
  done
done
${PY:-.venv/bin/python} scripts/bench_table.py --summary "$OUT"/online-*.json > "$OUT/summary.md"
cat "$OUT/summary.md"
