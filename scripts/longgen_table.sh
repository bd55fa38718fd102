#!/usr/bin/env bash
# The long-generation tables (docs/results.md "Long generations"): for each workload's generated corpus
# (calibrate/assets/generated/, the built-in target's own text) and each drafter kind, calibrate on the
# train prompts with --select (the head alone, named: the kind's default adds its copy pointer), fit the
# plain scale from the same statistics, then check on the held-out prompts, teacher-forced on the same
# generated tokens for every arm, by output position: the head alone and with its copy pointer. Writes
# out/longgen/: each eval's JSON and its table by output position (.md).
# diary-long (the held-out diaries to the end of the target's context, held out only) is checked with the
# calibration of the diary's train prompts, to 8,176 tokens; a greedy corpus (diary-greedy, ...) with the
# calibration of its workload's sampled train prompts.
# Usage: scripts/longgen_table.sh [WORKLOADS] [KINDS] (about 5 minutes a calibration and 6 an eval on 2 CPU cores,
# 9 an eval of diary-long).
set -euo pipefail
WORKLOADS=${1:-diary math science diary-long diary-greedy math-greedy science-greedy}
KINDS=${2:-eagle3 dflash pard}
SD=${SD:-.venv/bin/sharpdraft}
OUT=${OUT:-out/longgen}
mkdir -p "$OUT"
for w in $WORKLOADS; do
  # the shipped corpora: 4,096 tokens a prompt, sampled and greedy; diary-long 7,890 (8,176 with the prompt)
  case $w in diary-long) lengths=512,2048,4096,8176 ;; *) lengths=512,2048,4096 ;; esac
  train=${w%-long}; train=${train%-greedy}  # the sampled corpus whose train prompts calibrate it
  for kind in $KINDS; do
    base="$OUT/$train-$kind"
    [ -f "$base-select.json" ] || $SD calibrate --drafter "$kind" --drafter-path "calibrate/assets/$kind-smollm2" \
      --corpus "generated:$train" --sequences 6 --max-length 2048 --select --stats "$base-stats.npz" \
      --out "$base-select.json"
    [ -f "$base-spec.json" ] || $SD fit "$base-stats.npz" --out "$base-spec.json"
    for drafter in "$kind-smollm2" "$kind-smollm2-copy"; do
      [ -f "$OUT/$w-$drafter.json" ] || $SD eval --drafter "$kind" --drafter-path "calibrate/assets/$drafter" \
        --spec "$base-spec.json" --corpus "generated:$w:heldout" --lengths "$lengths" --sequences 4 \
        --variants none,spec,window,clamp+spec,lookup,lookup+head --threads 1 --out "$OUT/$w-$drafter.json"
      ${PY:-.venv/bin/python} scripts/eval_table.py "$OUT/$w-$drafter.json" --by-output expected_acceptance \
        > "$OUT/$w-$drafter.md"
    done
  done
done
