"""Hostile inputs: every bad value gets one clear line and exit 1, and no input file ever changes.

A table of cases over the five commands (predict, inspect, calibrate, eval, plot) and the Python
API (``ScaleSpec.load``, ``sharpdraft_runtime.enable``). Each command case runs the real console
entry point ``calibrate.cli.main`` in this process and is judged on:

* traceback: an exception escaped ``main`` (a bug, not a user error) or a traceback was printed;
* silent: exit 0, or still running after ``TIMEOUT_S`` (a hang), where a refusal was due;
* data loss: a file that existed before the run changed or vanished, or a refused run left a new file
  (other than those the case says it keeps: a fit that fails after collecting keeps what it collected);
* misleading: the refusal is not one line, exit 1, naming the bad value (``fragment``).

Each case works in a folder of its own (``{w}``) with the shared fixtures (``{fx}``: tiny
checkpoints, a corpus, a spec, a statistics file) beside it; both are hashed before and after.
Most cases are refused before any model loads; the few that need one use tiny random checkpoints.
Setting ``SHARPDRAFT_HOSTILE_REPORT=FILE`` appends one JSON line per case with its verdict.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from calibrate.cli import main
from calibrate.run import CalibrateOptions, partial_dir, run_calibration
from sharpdraft_runtime.serving import check_engine, load_spec
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.stats import RowStats

from test_calibrate import _write_causal_lm, _write_tokenizer, VOCAB
from tiny_checkpoints import corrupt_checkpoint, tiny_target, write_tiny_dflash, write_tiny_eagle3

TIMEOUT_S = 30  # a case still running after this long is a hang (it should have been refused at once)
UNWRITABLE = "/proc/sharpdraft-hostile"  # no one, root included, can create files under /proc

GOOD_SPEC = {"law": "log-linear", "n_ref": 64, "slope": 0.2, "top_k": 4}
TEXT = " ".join(["the query sees more keys as the context grows and its attention spreads out"] * 60)


def _spec(**over) -> str:
    return json.dumps({**GOOD_SPEC, **over})


def _drafter_info(layers: int, heads: int, kind: str = "hf") -> dict:
    return {"kind": kind, "path": None, "num_layers": layers, "num_heads": heads, "num_kv_heads": 1, "head_dim": 16}


@dataclass(frozen=True)
class Case:
    """One hostile input to a command."""

    id: str  # test id: command-what
    argv: str  # command line after ``sharpdraft``, with {fx} (fixtures) and {w} (the case's folder) filled in
    fragment: str  # the one-line message must contain this (the bad value, or the file)
    files: tuple = ()  # (name in {w}, text or bytes, or None for a folder) created before the run
    keeps: tuple = ()  # names in {w} the refused run may leave: progress it tells the user how to reuse


PREDICT = [
    Case("predict-model-unknown", "predict --model cauchy", "cauchy"),
    Case("predict-gap-nan", "predict --gap nan", "--gap nan"),
    Case("predict-gap-inf", "predict --gap inf", "--gap inf"),
    Case("predict-gap-negative", "predict --gap -1", "--gap -1"),
    Case("predict-gap-below-sigma2", "predict --sigma 3 --gap 4", "--gap 4"),
    Case("predict-sigma-zero", "predict --sigma 0", "--sigma 0"),
    Case("predict-sigma-negative", "predict --sigma -1", "--sigma -1"),
    Case("predict-sigma-nan", "predict --sigma nan", "--sigma nan"),
    Case("predict-two-level-sigma", "predict --model two-level --sigma 1", "--sigma"),
    Case("predict-top-k-zero", "predict --top-k 0", "--top-k 0"),
    Case("predict-top-k-negative", "predict --top-k -3", "--top-k -3"),
    Case("predict-n-ref-one", "predict --n-ref 1", "--n-ref 1"),
    Case("predict-n-ref-huge", f"predict --n-ref {10**30}", f"--n-ref {10**30}"),
    Case("predict-n-ref-overflow", f"predict --n-ref {10**400}", "--n-ref"),
    Case("predict-n-zero", "predict --n 0", "--n 0"),
    Case("predict-n-negative", "predict --n -5", "--n -5"),
    Case("predict-n-not-above-top-k", "predict --n 3", "--n 3"),
    Case("predict-n-huge", f"predict --n {10**30}", f"--n {10**30}"),
    Case("predict-mc-rows-negative", "predict --mc-rows -5", "--mc-rows -5"),
    Case("predict-mc-rows-huge", "predict --mc-rows 1000000000", "--mc-rows 1000000000"),
    Case("predict-mc-rows-long-n", "predict --mc-rows 10 --n 10000000", "--n 10000000"),
    Case("predict-mc-rows-float", "predict --mc-rows 1e9", "--mc-rows"),
    Case("predict-mc-rows-text", "predict --mc-rows many", "--mc-rows"),
    Case("predict-top-k-text", "predict --top-k four", "--top-k four: expected an integer"),
    Case("predict-gap-text", "predict --gap wide", "--gap wide: expected a number"),
    Case("predict-gap-abc", "predict --gap abc", "--gap abc: expected a number"),
    Case("predict-gap-no-value", "predict --gap", "--gap"),
    Case("predict-seed-negative", "predict --mc-rows 10 --seed -1", "--seed -1"),
    Case("predict-unknown-option", "predict --frobnicate", "--frobnicate"),
    # predict --stats: the distance model from a statistics file ({fx}/stats.npz: n_ref 64, n up to 256)
    Case("predict-stats-missing", "predict --stats {w}/none.npz", "none.npz"),
    Case("predict-stats-folder", "predict --stats {w}/d.npz", "d.npz", (("d.npz", None),)),
    Case("predict-stats-json", "predict --stats {w}/spec.json", "spec.json", (("spec.json", _spec()),)),
    Case("predict-stats-truncated", "predict --stats {fx}/stats-truncated.npz", "is an incomplete .npz archive"),
    Case("predict-stats-wrong-arrays", "predict --stats {fx}/wrong-arrays.npz", "wrong-arrays.npz' has no array 'n'"),
    Case("predict-stats-no-distance", "predict --stats {fx}/stats-no-distance.npz", "stats-no-distance.npz"),
    Case("predict-stats-tail-unknown", "predict --stats {fx}/stats.npz --tail cubic", "--tail 'cubic'"),
    Case("predict-stats-bootstrap-negative", "predict --stats {fx}/stats.npz --bootstrap -1", "--bootstrap -1"),
    Case("predict-stats-bootstrap-huge", "predict --stats {fx}/stats.npz --bootstrap 1000000000",
         "--bootstrap 1000000000"),
    Case("predict-stats-n-below-n-ref", "predict --stats {fx}/stats.npz --n 48", "--n 48"),
    Case("predict-stats-n-zero", "predict --stats {fx}/stats.npz --n 0", "--n 0"),
    Case("predict-stats-with-model", "predict --stats {fx}/stats.npz --model gaussian", "--model"),
]

_DEEP_LIST = "[" * 200_000
_DEEP_OBJECT = '{"a": ' * 100_000


def _inspect(case_id, text, fragment):
    return Case(f"inspect-{case_id}", "inspect {w}/spec.json", fragment, (("spec.json", text),))


INSPECT = [
    Case("inspect-missing", "inspect {w}/nope.json", "nope.json"),
    Case("inspect-folder", "inspect {w}", "folder"),
    _inspect("empty", "", "spec.json"),
    _inspect("not-json", "{not json", "spec.json"),
    _inspect("array", "[1, 2]", "got an array"),
    _inspect("null", "null", "expected a JSON object with law, n_ref, slope and top_k, got null"),
    _inspect("law-null", _spec(law=None), "'law': expected a string, got null"),
    _inspect("binary", b"\xff\xfe\x00\x81garbage", "spec.json"),
    _inspect("latin1", _spec(law="caf\u00e9").replace("\\u00e9", "\u00e9").encode("latin-1"), "spec.json"),
    _inspect("deep-list", _DEEP_LIST, "spec.json"),
    _inspect("deep-object", _DEEP_OBJECT, "spec.json"),
    _inspect("slope-negative", _spec(slope=-0.5), "slope"),
    _inspect("slope-1e308", _spec(slope=1e308), "slope"),
    _inspect("slope-1e38", _spec(slope=1e38), "slope"),
    _inspect("slope-nan", _spec(slope=float("nan")), "slope"),
    _inspect("slope-infinity", _spec(slope=float("inf")), "slope"),
    _inspect("ssmax-negative", _spec(law="ssmax", n_ref=None, slope=-0.3), "slope"),
    _inspect("ssmax-zero", _spec(law="ssmax", n_ref=None, slope=0.0), "slope"),
    _inspect("llama4-negative", _spec(law="llama4", slope=-0.1), "slope"),
    _inspect("constant-minus-one", _spec(law="constant", slope=-1.0), "slope"),
    _inspect("constant-minus-two", _spec(law="constant", slope=-2.0), "slope"),
    _inspect("layer-one-negative", _spec(granularity="layer", slope=[0.2, -0.4]), "slope"),
    _inspect("head-one-huge", _spec(granularity="head", slope=[[0.2, 1e308]]), "slope"),
    _inspect("negative-slope-capped", _spec(slope=-0.5, alpha_max=2.0), "slope"),
    _inspect("n-ref-1e30", _spec(n_ref=10**30), "n_ref"),
    _inspect("n-ref-overflow", _spec().replace('"n_ref": 64', '"n_ref": 1' + "0" * 400), "n_ref"),
    _inspect("n-ref-float", _spec(n_ref=1e30), "n_ref"),
    _inspect("top-k-overflow", _spec().replace('"top_k": 4', '"top_k": 1' + "0" * 400), "top_k"),
    _inspect("alpha-max-nan", _spec(alpha_max=float("nan")), "alpha_max"),
    _inspect("alpha-max-negative", _spec(alpha_max=-1.0), "alpha_max"),
    _inspect("law-unknown", _spec(law="cubic"), "law"),
    _inspect("schema-v2", _spec(schema="sharpdraft.scale-spec/v2"), "schema"),
    _inspect("extra-field", _spec(alpha_min=0.5), "alpha_min"),
    _inspect("short-per-layer", _spec(granularity="layer", slope=[0.1, 0.2], drafter=_drafter_info(4, 4)), "slope"),
]

EVAL = ("eval --drafter hf --drafter-path {fx}/pard --target-path {fx}/target --corpus {fx}/corpus.txt "
        "--lengths 32,64,128 --sequences 1 --device cpu --threads 1")
SPEC_9_HEADS = _spec(granularity="head", slope=[[0.1] * 9, [0.1] * 9], drafter=_drafter_info(2, 9))
SPEC_OTHER_DRAFTER = _spec(drafter=_drafter_info(30, 9))
SPEC_EAGLE3 = _spec(drafter=_drafter_info(1, 8, kind="eagle3"))

EVAL_CASES = [
    Case("eval-out-is-spec", EVAL + " --spec {w}/s.json --out {w}/s.json", "--out", (("s.json", _spec()),)),
    Case("eval-out-is-corpus", EVAL.replace("{fx}/corpus.txt", "{w}/c.txt") + " --out {w}/c.txt", "--out",
         (("c.txt", TEXT),)),
    Case("eval-plot-is-out", EVAL + " --out {w}/r.png --plot {w}/r.png", "--plot"),
    Case("eval-plot-is-spec", EVAL + " --spec {w}/s.png --plot {w}/s.png", "--plot", (("s.png", _spec()),)),
    Case("eval-out-folder", EVAL + " --out {w}", "--out"),
    Case("eval-out-under-file", EVAL + " --out {w}/f.txt/r.json", "--out", (("f.txt", "x"),)),
    Case("eval-out-unwritable", EVAL + f" --out {UNWRITABLE}/r.json", "--out"),
    Case("eval-plot-folder", EVAL + " --plot {w}/d.png", "--plot", (("d.png", None),)),
    Case("eval-plot-unwritable", EVAL + f" --plot {UNWRITABLE}/r.png", "--plot"),
    Case("eval-skip-negative", EVAL + " --skip -1", "--skip -1"),
    Case("eval-top-k-zero", EVAL + " --top-k 0", "--top-k 0"),
    Case("eval-top-k-negative", EVAL + " --top-k -1", "--top-k -1"),
    Case("eval-n-ref-zero", EVAL + " --n-ref 0", "--n-ref 0"),
    Case("eval-n-ref-past-lengths", EVAL + " --n-ref 100000", "--n-ref 100000"),
    Case("eval-n-ref-negative", EVAL + " --n-ref -8", "--n-ref -8"),
    Case("eval-n-ref-text", EVAL + " --n-ref four", "--n-ref"),
    Case("eval-n-ref-nan", EVAL + " --n-ref nan", "--n-ref"),
    Case("eval-temperature-zero", EVAL + " --temperature 0", "--temperature 0"),
    Case("eval-temperature-negative", EVAL + " --temperature -1", "--temperature -1"),
    Case("eval-temperature-nan", EVAL + " --temperature nan", "--temperature nan"),
    Case("eval-temperature-inf", EVAL + " --temperature inf", "--temperature inf"),
    Case("eval-temperature-huge", EVAL + " --temperature 1e9", "--temperature"),
    Case("eval-temperature-text", EVAL + " --temperature hot", "--temperature"),
    Case("eval-slopes-text", EVAL + " --slopes 0.1,steep", "--slopes 0.1,steep"),
    Case("eval-slopes-nan", EVAL + " --slopes 0.1,nan", "nan"),
    Case("eval-slopes-twice", EVAL + " --slopes 0.1,0.1", "--slopes"),
    Case("eval-slopes-too-many", EVAL + " --slopes " + ",".join(str(i / 100) for i in range(70)), "--slopes"),
    Case("eval-slopes-negative-unbounded", EVAL + " --n-ref 64 --slopes -1", "--slopes -1"),
    Case("eval-alphas-zero", EVAL + " --n-ref 64 --alphas 0", "--alphas 0"),
    Case("eval-alphas-negative", EVAL + " --n-ref 64 --alphas -1.5", "--alphas -1.5"),
    Case("eval-alphas-inf", EVAL + " --alphas inf", "inf"),
    Case("eval-alphas-huge", EVAL + " --n-ref 64 --alphas 1e6", "--alphas 1e+06"),
    Case("eval-resume-without-out", EVAL + " --resume", "--resume"),
    Case("eval-partial-without-resume", EVAL + " --out {w}/r.json", "--resume", (("r.json.partial", None),
                                                                                  ("r.json.partial/run.json", "{}"))),
    Case("eval-resume-other-options", EVAL + " --out {w}/r.json --resume --temperature 0.5", "--resume",
         (("r.json.partial", None), ("r.json.partial/run.json", '{"temperature": 1.0}'))),
    Case("eval-partial-is-a-file", EVAL + " --out {w}/r.json", "r.json.partial", (("r.json.partial", "x"),)),
    Case("eval-sequences-zero", EVAL + " --sequences 0", "--sequences 0"),
    Case("eval-sequences-negative", EVAL + " --sequences -2", "--sequences -2"),
    Case("eval-threads-negative", EVAL + " --threads -1", "--threads -1"),
    Case("eval-num-draft-zero", EVAL + " --num-draft 0", "--num-draft"),
    Case("eval-new-tokens-one", EVAL + " --new-tokens 1", "--new-tokens"),
    Case("eval-sample-temperature-zero", EVAL + " --speculative --sample --temperature 0", "--temperature 0"),
    Case("eval-sample-temperature-tiny", EVAL + " --speculative --sample --temperature 0.001", "--temperature 0.001"),
    Case("eval-sample-temperature-negative", EVAL + " --speculative --sample --temperature -0.5", "--temperature -0.5"),
    Case("eval-sample-temperature-nan", EVAL + " --speculative --sample --temperature nan", "--temperature nan"),
    Case("eval-sample-temperature-inf", EVAL + " --speculative --sample --temperature inf", "--temperature inf"),
    Case("eval-sample-temperature-text", EVAL + " --speculative --sample --temperature abc", "--temperature"),
    Case("eval-sample-temperature-huge", EVAL + " --speculative --sample --temperature 1e300", "--temperature 1e+300"),
    Case("eval-seed-negative", EVAL + " --speculative --sample --seed -1", "--seed -1"),
    Case("eval-seed-huge", EVAL + " --speculative --sample --seed 99999999999999999999999",
         "--seed 99999999999999999999999"),
    Case("eval-seed-text", EVAL + " --speculative --sample --seed one", "--seed"),
    Case("eval-sample-without-speculative", EVAL + " --sample", "--sample"),
    Case("eval-lengths-text", EVAL + " --lengths 256,abc", "--lengths"),
    Case("eval-lengths-one", EVAL + " --lengths 1", "--lengths"),
    Case("eval-plot-pdf", EVAL + " --plot {w}/r.pdf", "--plot"),
    Case("eval-drafter-unknown", EVAL + " --drafter medusa", "--drafter medusa"),
    Case("eval-dflash-fix-window-zero", EVAL.replace("--drafter hf --drafter-path {fx}/pard", "--drafter dflash "
                                                      "--drafter-path {fx}/dflash") + " --variants none,clamp "
         "--neighbour-window 0", "--neighbour-window 0"),
    Case("eval-dflash-fix-spec-past-n-ref", EVAL.replace("--drafter hf --drafter-path {fx}/pard", "--drafter dflash "
                                                          "--drafter-path {fx}/dflash") + " --n-ref 64 --variants "
         "none,spec --spec {w}/s.json", "positions.window",
         (("s.json", _spec(positions={"fix": "clamp", "window": 64, "group": None, "n_ref": None})),)),
    Case("eval-pard-token-out-of-range", EVAL.replace("--drafter hf --drafter-path {fx}/pard", "--drafter pard "
                                                       "--drafter-path {fx}/pard-bad-token") + " --speculative",
         "pard_token 9999"),
    Case("eval-pard-num-draft-huge", EVAL.replace("--drafter hf", "--drafter pard") + " --num-draft 1000000",
         "--num-draft 1000000"),
    Case("eval-device-unknown", EVAL + " --device tpu", "--device tpu"),
    Case("eval-dtype-unknown", EVAL + " --dtype float8", "--dtype float8"),
    Case("eval-corpus-missing", EVAL + " --corpus {w}/none.txt", "none.txt"),
    Case("eval-spec-missing", EVAL + " --spec {w}/none.json", "none.json"),
    Case("eval-extra-spec-no-name", EVAL + " --extra-spec {w}/s.json", "NAME=FILE", (("s.json", _spec()),)),
    Case("eval-extra-spec-empty-name", EVAL + " --extra-spec ={w}/s.json", "the name ''", (("s.json", _spec()),)),
    Case("eval-extra-spec-bad-name", EVAL + " --extra-spec Layer/1={w}/s.json", "'Layer/1'", (("s.json", _spec()),)),
    Case("eval-extra-spec-long-name", EVAL + " --extra-spec " + "a" * 25 + "={w}/s.json", "1 to 24",
         (("s.json", _spec()),)),
    Case("eval-extra-spec-no-file", EVAL + " --extra-spec layer=", "after '='"),
    Case("eval-extra-spec-twice", EVAL + " --extra-spec a={w}/s.json --extra-spec a={w}/s.json", "given twice",
         (("s.json", _spec()),)),
    Case("eval-extra-spec-missing", EVAL + " --extra-spec a={w}/none.json", "none.json"),
    Case("eval-extra-spec-not-json", EVAL + " --extra-spec a={w}/s.json", "s.json", (("s.json", "{law"),)),
    Case("eval-extra-spec-is-out", EVAL + " --extra-spec a={w}/s.json --out {w}/s.json", "--out",
         (("s.json", _spec()),)),
    Case("eval-extra-spec-other-drafter", EVAL + " --extra-spec a={w}/s.json", "--extra-spec a=",
         (("s.json", SPEC_9_HEADS),)),
    Case("eval-extra-spec-window-past-n-ref", EVAL + " --n-ref 64 --extra-spec a={w}/s.json", "positions.window",
         (("s.json", _spec(positions={"fix": "clamp", "window": 64, "group": None, "n_ref": None})),)),
    Case("eval-extra-spec-dflash-fix-past-n-ref", EVAL.replace("--drafter hf --drafter-path {fx}/pard", "--drafter "
                                                                "dflash --drafter-path {fx}/dflash") + " --n-ref 64 "
         "--extra-spec a={w}/s.json", "positions.window", (("s.json", _spec(positions={"fix": "clamp", "window": 64,
                                                                                       "group": None, "n_ref": None})),)),
    Case("eval-spec-not-json", EVAL + " --spec {w}/s.json", "s.json", (("s.json", "{oops"),)),
    Case("eval-spec-negative-slope", EVAL + " --spec {w}/s.json", "slope", (("s.json", _spec(slope=-1.0)),)),
    Case("eval-spec-9-heads", EVAL + " --spec {w}/s.json", "9 heads", (("s.json", SPEC_9_HEADS),)),
    Case("eval-spec-other-drafter", EVAL + " --spec {w}/s.json", "30 layers", (("s.json", SPEC_OTHER_DRAFTER),)),
    Case("eval-spec-one-layer-head", EVAL + " --spec {w}/s.json",
         "made for a drafter of kind eagle3 with 1 layer x 8 heads", (("s.json", SPEC_EAGLE3),)),
    Case("eval-threads-text", EVAL + " --threads abc", "--threads abc: expected an integer"),
    Case("eval-corpus-empty", EVAL + " --corpus {w}/c.txt", "c.txt: holds no text", (("c.txt", ""),)),
    Case("eval-drafter-path-missing", EVAL.replace("{fx}/pard", "{w}/none"), "none"),
    Case("eval-window-zero", EVAL + " --window 0", "--window 0"),
    Case("eval-sinks-negative", EVAL + " --sinks -1", "--sinks -1"),
    Case("eval-window-unused", EVAL + " --variants none,spec --window 16", "--window 16: no variant uses it"),
    Case("eval-sinks-unused", EVAL + " --variants none,window --sinks 8", "--sinks 8: no variant uses it"),
    Case("eval-neighbour-window-zero", EVAL + " --variants group --neighbour-window 0", "--neighbour-window 0"),
    Case("eval-neighbour-window-negative", EVAL + " --variants clamp --neighbour-window -5", "--neighbour-window -5"),
    Case("eval-neighbour-window-huge", EVAL + " --variants clamp --neighbour-window 100000", "--neighbour-window"),
    Case("eval-neighbour-window-text", EVAL + " --variants clamp --neighbour-window wide", "--neighbour-window"),
    Case("eval-neighbour-window-float", EVAL + " --variants clamp --neighbour-window 2.5", "--neighbour-window"),
    Case("eval-neighbour-window-at-n-ref", EVAL + " --n-ref 16 --variants clamp --neighbour-window 16",
         "--neighbour-window 16"),
    Case("eval-group-one", EVAL + " --variants group --group 1", "--group 1"),
    Case("eval-group-zero", EVAL + " --variants group --group 0", "--group 0"),
    Case("eval-group-negative", EVAL + " --variants group+spec --group -2", "--group -2"),
    Case("eval-group-huge", EVAL + " --variants group --group 100000", "--group 100000"),
    Case("eval-group-text", EVAL + " --variants group --group many", "--group"),
    Case("eval-variants-fix-typo", EVAL + " --variants clamp+sepc", "clamp+sepc"),
    Case("eval-variants-unknown", EVAL + " --variants none,magic", "magic"),
    Case("eval-out-in-reference-head", EVAL + " --reference-drafter-path {w}/ref --out {w}/ref/config.json", "--out",
         (("ref", "@pard"),)),
    Case("eval-lookup-max-ngram-zero", EVAL + " --variants lookup --lookup-max-ngram 0", "--lookup-max-ngram 0"),
    Case("eval-lookup-max-ngram-negative", EVAL + " --variants lookup --lookup-max-ngram -2", "--lookup-max-ngram -2"),
    Case("eval-lookup-max-ngram-huge", EVAL + " --variants lookup --lookup-max-ngram 100000",
         "--lookup-max-ngram 100000"),
    Case("eval-lookup-max-ngram-text", EVAL + " --variants lookup --lookup-max-ngram three", "--lookup-max-ngram"),
    Case("eval-lookup-min-ngram-zero", EVAL + " --variants lookup+head --lookup-min-ngram 0", "--lookup-min-ngram 0"),
    Case("eval-lookup-min-ngram-float", EVAL + " --variants lookup --lookup-min-ngram 1.5", "--lookup-min-ngram"),
    Case("eval-lookup-min-above-max", EVAL + " --variants lookup --lookup-max-ngram 2 --lookup-min-ngram 3",
         "--lookup-min-ngram 3"),
    Case("eval-recall-empty", EVAL.replace("{fx}/corpus.txt", "recall:"), "--corpus recall:"),
    Case("eval-recall-nested", EVAL.replace("{fx}/corpus.txt", "recall:recall:pydoc"), "recall:recall:pydoc"),
    Case("eval-recall-missing", EVAL.replace("{fx}/corpus.txt", "recall:{w}/none.txt"), "none.txt"),
    Case("eval-recall-bad-split", EVAL.replace("{fx}/corpus.txt", "recall:stdlib:test"), "stdlib:test"),
    Case("eval-recall-too-short", EVAL.replace("{fx}/corpus.txt", "recall:{fx}/corpus.txt").replace(
        "--lengths 32,64,128", "--lengths 32,64"), "fit no repeat distance"),
    Case("eval-recall-empty-file", EVAL.replace("{fx}/corpus.txt", "recall:{w}/c.txt"), "holds no text",
         (("c.txt", ""),)),
    Case("eval-recall-at-no-source", EVAL.replace("{fx}/corpus.txt", "recall@48"), "recall@48"),
    Case("eval-recall-at-empty-list", EVAL.replace("{fx}/corpus.txt", "recall@:{fx}/corpus.txt"), "distance ''"),
    Case("eval-recall-at-text", EVAL.replace("{fx}/corpus.txt", "recall@far:{fx}/corpus.txt"), "distance 'far'"),
    Case("eval-recall-at-underscore", EVAL.replace("{fx}/corpus.txt", "recall@1_0:{fx}/corpus.txt"), "'1_0'"),
    Case("eval-recall-at-negative", EVAL.replace("{fx}/corpus.txt", "recall@-64:{fx}/corpus.txt"), "'-64'"),
    Case("eval-recall-at-too-near", EVAL.replace("{fx}/corpus.txt", "recall@8:{fx}/corpus.txt"), "distance '8'"),
    Case("eval-recall-at-twice", EVAL.replace("{fx}/corpus.txt", "recall@48,48:{fx}/corpus.txt"), "given twice"),
    Case("eval-recall-at-huge", EVAL.replace("{fx}/corpus.txt", "recall@99999999999999999999:{fx}/corpus.txt"),
         "'99999999999999999999'"),
    Case("eval-recall-at-float", EVAL.replace("{fx}/corpus.txt", "recall@nan:{fx}/corpus.txt"), "distance 'nan'"),
    Case("eval-recall-at-too-far", EVAL.replace("{fx}/corpus.txt", "recall@48,4096:{fx}/corpus.txt"),
         "repeat distance 4096 does not fit sequences of 128"),
    Case("eval-recall-at-nested", EVAL.replace("{fx}/corpus.txt", "recall@48:recall:pydoc"), "recall@48:recall:pydoc"),
]

# DFlash heads with a draft vocabulary (draft_vocab_size + d2t) that does not fit
EVAL_DFLASH = EVAL.replace("--drafter hf --drafter-path {fx}/pard", "--drafter dflash --drafter-path {fx}/dflash-vocab-{how}")
EVAL_CASES += [Case(f"eval-dflash-vocab-{how}", EVAL_DFLASH.replace("{how}", how), fragment) for how, fragment in (
    ("outside", "'d2t' maps the draft vocabulary to ids outside"),
    ("no-map", "d2t"),
    ("map-only", "d2t"),
    ("size-zero", "draft_vocab_size 0"),
    ("size-text", "draft_vocab_size"),
)]

# a copy pointer folder (calibrate/drafters/pointer.py) naming a head, damaged
EVAL_POINTER = ("eval --drafter eagle3 --drafter-path {w}/ptr --target-path {fx}/target --corpus {fx}/corpus.txt "
                "--lengths 32,64,128 --sequences 1 --device cpu --threads 1")
_PTR = '{"format": "sharpdraft-copy-pointer", "version": 1, '
EVAL_CASES += [Case(f"eval-copy-pointer-{how}", EVAL_POINTER, fragment, (("ptr", None), ("ptr/copy_pointer.json", text)))
               for how, text, fragment in (
    ("not-json", "{", "copy_pointer.json: not a readable JSON file"),
    ("array", "[1]", "not a copy pointer"),
    ("version", _PTR + '"version": 2}', "version 2"),
    ("order-zero", _PTR + '"order": 0}', "order must be an integer from 1 to 8, got 0"),
    ("gain-text", _PTR + '"gain": "all"}', "gain must be a finite number"),
    ("scale-negative", _PTR + '"scale": -1}', "scale must be > 0"),
    ("head-missing", _PTR + '"head": "../nowhere"}', "is not a head directory"),
    ("head-number", _PTR + '"head": 7}', "must be a directory name"),
    ("not-utf8", b"\xff\xfe{", "not a readable JSON file"),
)]
EVAL_CASES += [Case("eval-copy-pointer-hf", EVAL_POINTER.replace("--drafter eagle3", "--drafter hf"),
                    "a copy pointer joins an eagle3, dflash or pard drafter",
                    (("h", None), ("h/config.json", "{}"), ("ptr", None), ("ptr/copy_pointer.json", _PTR + '"head": "../h"}')))]
EVAL_CASES += [Case("eval-copy-pointer-head-is-itself", EVAL_POINTER, "has a copy pointer of its own",
                    (("ptr", None), ("ptr/config.json", "{}"), ("ptr/copy_pointer.json", _PTR + '"head": "."}')))]

# --pointer-unmatched: a rule for a copy pointer's rows matching nothing, on a drafter that has one
EVAL_CASES += [
    Case("eval-pointer-unmatched-unknown", EVAL + " --pointer-unmatched hidden",
         "--pointer-unmatched hidden: expected scored or masked"),
    Case("eval-pointer-unmatched-empty", EVAL + " --pointer-unmatched ", "--pointer-unmatched : expected scored or masked"),
    Case("eval-pointer-unmatched-no-pointer", EVAL + " --pointer-unmatched masked",
         "--pointer-unmatched masked: the drafter"),
]

# scripts/train_pard.py folders (layers and norm only; the embedding from the base model their config names)
EVAL_CUT = EVAL.replace("--drafter hf --drafter-path {fx}/pard", "--drafter pard --drafter-path {fx}/cut-{how}")
EVAL_CASES += [Case(f"eval-pard-cut-{how}", EVAL_CUT.replace("{how}", how), fragment) for how, fragment in (
    ("base-unknown", "sharpdraft_embedding_from '/no/such/base'"),
    ("layer-missing", "lacks model.layers.1.mlp.down_proj.weight"),
    ("embedding-stored", "holds model.embed_tokens.weight"),
    ("truncated", "cannot read model.safetensors"),
    ("no-weights", "no model.safetensors"),
)]

CAL = ("calibrate --drafter pard --drafter-path {fx}/pard --corpus {fx}/corpus.txt --n-ref 64 --max-length 256 "
       "--sequences 2 --device cpu")


CAL_LENGTH = CAL.replace(" --n-ref 64", "")  # n_ref from the drafter, below --max-length
CAL_DRAFTER = CAL_LENGTH.replace(" --max-length 256", "")  # the tiny PARD's n_ref: 512, from its config
CAL_EAGLE3 = (CAL.replace("--drafter pard --drafter-path {fx}/pard", "--drafter eagle3 --drafter-path {fx}/eagle3 "
                          "--target-path {fx}/target").replace(" --n-ref 64 --max-length 256", ""))


def _cal(case_id, extra, fragment, files=(), base=CAL, keeps=()):
    argv = base + " " + extra if "--out" in extra else base + " --out {w}/spec.json " + extra
    return Case(f"calibrate-{case_id}", argv.strip(), fragment, files, keeps)


CALIBRATE = [
    _cal("out-is-corpus", "--corpus {w}/c.txt --out {w}/c.txt", "--out", (("c.txt", TEXT),)),
    _cal("stats-is-out", "--out {w}/s.json --stats {w}/s.json", "--stats", (("s.json", _spec()),)),
    _cal("stats-is-corpus", "--corpus {w}/c.txt --stats {w}/c.txt", "--stats", (("c.txt", TEXT),)),
    _cal("out-in-checkpoint", "--drafter-path {w}/pard --out {w}/pard/config.json", "--out", (("pard", "@pard"),)),
    _cal("out-folder", "--out {w}", "--out"),
    _cal("out-under-file", "--out {w}/f.txt/s.json", "--out", (("f.txt", "x"),)),
    _cal("out-unwritable", f"--out {UNWRITABLE}/s.json", "--out"),
    _cal("stats-folder", "--stats {w}/d.npz", "--stats", (("d.npz", None),)),
    _cal("stats-unwritable", f"--stats {UNWRITABLE}/s.npz", "--stats"),
    _cal("partial-is-file", "", "spec.json.partial", (("spec.json.partial", "x"),)),
    _cal("interrupted-run-no-resume", "", "--resume", (("spec.json.partial", None), ("spec.json.partial/run.json", "{}"))),
    _cal("resume-run-json-garbage", "--resume", "run.json", (("spec.json.partial", None),
                                                              ("spec.json.partial/run.json", "{garbage"))),
    _cal("resume-corrupt-sequence", "--resume", "seq-00000.npz", (("spec.json.partial", "@partial"),)),
    _cal("sequences-zero", "--sequences 0", "--sequences 0"),
    _cal("sequences-negative", "--sequences -1", "--sequences -1"),
    _cal("top-k-zero", "--top-k 0", "--top-k 0"),
    _cal("top-k-negative", "--top-k -2", "--top-k -2"),
    _cal("top-k-above-n-ref", "--top-k 64", "--top-k 64"),
    _cal("top-k-above-half-n-ref", "--top-k 33", "--top-k 33: too large for n_ref 64 (--n-ref)"),
    _cal("top-k-huge", "--top-k 100000", "--top-k 100000"),
    _cal("top-k-huge-max-length", "--top-k 200", "--top-k 200: too large for --max-length 256", base=CAL_LENGTH),
    _cal("top-k-huge-drafter-n-ref", "--top-k 100000", "--top-k 100000: too large for n_ref 512 (the drafter's",
         base=CAL_DRAFTER),
    Case("calibrate-top-k-huge-built-in", "calibrate --out {w}/spec.json --top-k 100000 --device cpu",
         "--top-k 100000: too large for n_ref 2048 (the built-in drafter's n_ref)"),
    _cal("fit-fails-after-collecting", "--n-ref 480 --max-length 512", "rerun with --resume and another --n-ref",
         base=CAL_EAGLE3, keeps=("spec.json.partial",)),
    _cal("max-length-small", "--max-length 10", "--max-length 10"),
    _cal("n-ref-small", "--n-ref 8", "--n-ref 8"),
    _cal("n-ref-at-max-length", "--n-ref 256", "--n-ref 256"),
    _cal("n-ref-huge", f"--n-ref {10**30}", "--n-ref"),
    _cal("alpha-max-nan", "--alpha-max nan", "--alpha-max nan"),
    _cal("alpha-max-inf", "--alpha-max inf", "--alpha-max inf"),
    _cal("alpha-max-half", "--alpha-max 0.5", "--alpha-max 0.5"),
    _cal("chunk-zero", "--chunk 0", "--chunk 0"),
    _cal("granularity-unknown", "--granularity tensor", "--granularity tensor"),
    _cal("estimator-unknown", "--estimator magic", "magic"),
    _cal("drafter-unknown", "--drafter medusa", "--drafter medusa"),
    _cal("device-unknown", "--device tpu", "--device tpu"),
    _cal("dtype-unknown", "--dtype float8", "--dtype float8"),
    _cal("corpus-missing", "--corpus {w}/none.txt", "none.txt"),
    _cal("corpus-csv", "--corpus {w}/c.csv", "c.csv", (("c.csv", "a,b"),)),
    _cal("corpus-empty", "--corpus {w}/c.txt", "c.txt: holds no text", (("c.txt", ""),)),
    _cal("corpus-blank", "--corpus {w}/c.txt", "c.txt: holds no text", (("c.txt", " \n\n  \n"),)),
    _cal("corpus-jsonl-blank", "--corpus {w}/c.jsonl", "c.jsonl: holds no text", (("c.jsonl", '{"text": " "}\n'),)),
    _cal("corpus-binary", "--corpus {w}/c.txt", "c.txt", (("c.txt", b"\xff\xfe\x81" * 100),)),
    _cal("corpus-jsonl-bad", "--corpus {w}/c.jsonl", "c.jsonl", (("c.jsonl", "{not json}\n"),)),
    _cal("corpus-split-unknown", "--corpus pydoc:nosuch", "pydoc:nosuch"),
    _cal("corpus-empty-folder", "--corpus {w}/docs", "docs", (("docs", None),)),
    _cal("drafter-path-missing", "--drafter-path {w}/none", "none"),
    _cal("drafter-path-not-gguf", "--drafter-path {fx}/corpus.txt", "corpus.txt"),
    _cal("drafter-path-no-config", "--drafter-path {w}/empty", "empty", (("empty", None),)),
    _cal("drafter-path-offline-hub-id", "--drafter-path nosuch-org-sd/nosuch-model", "nosuch-org-sd/nosuch-model"),
    _cal("pard-truncated-weights", "--drafter-path {fx}/pard-truncated", ".safetensors"),
    _cal("eagle3-truncated-weights", "--drafter eagle3 --drafter-path {fx}/eagle3-truncated "
         "--target-path {fx}/target", "model.safetensors"),
    _cal("eagle3-config-array", "--drafter eagle3 --drafter-path {fx}/eagle3-array --target-path {fx}/target",
         "config.json"),
    _cal("eagle3-rope-string", "--drafter eagle3 --drafter-path {fx}/eagle3-rope --target-path {fx}/target",
         "rope_scaling"),
    _cal("eagle3-config-null", "--drafter eagle3 --drafter-path {fx}/eagle3-null --target-path {fx}/target",
         "got null"),
    _cal("eagle3-config-not-json", "--drafter eagle3 --drafter-path {fx}/eagle3-notjson --target-path {fx}/target",
         "config.json"),
    _cal("target-path-missing", "--drafter eagle3 --drafter-path {fx}/eagle3 --target-path {w}/none", "none"),
    _cal("pard-without-path", "--drafter-path ''", "--drafter-path"),
    Case("calibrate-out-missing", CAL, "--out"),
    _cal("select-pard-without-target", "--select", "--select with --drafter pard: give --target-path"),
    _cal("select-dflash-on-a-pard-folder", "--select --drafter dflash --drafter-path {fx}/pard", "pard_token"),
    _cal("select-with-value", "--select yes", "yes"),
    _cal("law-unknown", "--law cubic", "--law cubic"),
    _cal("law-prior", "--law qwen-logn", "--law qwen-logn"),
    _cal("max-n-without-tabulated", "--max-n 4096", "--max-n 4096"),
    _cal("max-n-at-n-ref", "--law tabulated --max-n 64", "--max-n 64"),
    _cal("max-n-negative", "--law tabulated --max-n -5", "--max-n -5"),
    _cal("max-n-huge", f"--law tabulated --max-n {2**40}", f"--max-n {2**40}"),
    _cal("tabulated-gaussian", "--law tabulated --estimator gaussian", "--estimator gaussian"),
    _cal("aux-reading-unknown", "--drafter eagle3 --drafter-path {fx}/eagle3 --target-path {fx}/target "
         "--aux-layer-reading hf", "--aux-layer-reading"),
    _cal("aux-reading-pard", "--aux-layer-reading sglang", "--aux-layer-reading"),
]

PLOT = [
    Case("plot-missing", "plot {w}/none.npz", "none.npz"),
    Case("plot-folder", "plot {w}", "folder"),
    Case("plot-json", "plot {w}/s.json", "s.json", (("s.json", _spec()),)),
    Case("plot-truncated", "plot {fx}/stats-truncated.npz --out {w}/f", "stats-truncated.npz' is an incomplete"),
    Case("plot-garbage", "plot {w}/g.npz --out {w}/f", "g.npz", (("g.npz", os.urandom(2000)),)),
    Case("plot-wrong-arrays", "plot {fx}/wrong-arrays.npz --out {w}/f", "wrong-arrays.npz' has no array 'n'"),
    Case("plot-out-is-file", "plot {fx}/stats.npz --out {w}/f.txt", "--out", (("f.txt", "keep me"),)),
    Case("plot-out-is-stats", "plot {w}/s.npz --out {w}/s.npz", "--out", (("s.npz", "@stats"),)),
    Case("plot-out-unwritable", f"plot {{fx}}/stats.npz --out {UNWRITABLE}/f", "--out"),
    Case("plot-figure-name-is-folder", "plot {fx}/stats.npz --out {w}/f", "dilution.png",
         (("f", None), ("f/dilution.png", None))),
    Case("plot-n-ref-zero", "plot {fx}/stats.npz --out {w}/f --n-ref 0", "--n-ref 0"),
    Case("plot-n-ref-negative", "plot {fx}/stats.npz --out {w}/f --n-ref -64", "--n-ref -64"),
    Case("plot-n-ref-huge", f"plot {{fx}}/stats.npz --out {{w}}/f --n-ref {10**30}", "--n-ref"),
    Case("plot-top-k-zero", "plot {fx}/stats.npz --out {w}/f --top-k 0", "--top-k 0"),
    Case("plot-top-k-huge", "plot {fx}/stats.npz --out {w}/f --top-k 999", "--top-k 999"),
    Case("plot-bootstrap-negative", "plot {fx}/stats.npz --out {w}/f --bootstrap -1", "--bootstrap -1"),
    Case("plot-bootstrap-huge", "plot {fx}/stats.npz --out {w}/f --bootstrap 1000000000", "--bootstrap 1000000000"),
]

FIT = [
    Case("fit-missing", "fit {w}/none.npz --out {w}/f.json", "none.npz"),
    Case("fit-folder", "fit {w} --out {w}/f.json", "folder"),
    Case("fit-json", "fit {w}/s.json --out {w}/f.json", "s.json", (("s.json", _spec()),)),
    Case("fit-truncated", "fit {fx}/stats-truncated.npz --out {w}/f.json", "stats-truncated.npz' is an incomplete"),
    Case("fit-wrong-arrays", "fit {fx}/wrong-arrays.npz --out {w}/f.json", "wrong-arrays.npz' has no array 'n'"),
    Case("fit-garbage", "fit {w}/g.npz --out {w}/f.json", "g.npz' is not an .npz archive",
         (("g.npz", os.urandom(2000)),)),
    Case("fit-out-is-stats", "fit {w}/s.npz --out {w}/s.npz", "--out", (("s.npz", "@stats"),)),
    Case("fit-out-folder", "fit {fx}/stats.npz --out {w}", "--out"),
    Case("fit-out-unwritable", f"fit {{fx}}/stats.npz --out {UNWRITABLE}/f.json", "--out"),
    Case("fit-same-file-twice", "fit {fx}/stats.npz {fx}/stats.npz --out {w}/f.json", "stats.npz"),
    Case("fit-n-ref-zero", "fit {fx}/stats.npz --out {w}/f.json --n-ref 0", "--n-ref 0"),
    Case("fit-top-k-zero", "fit {fx}/stats.npz --out {w}/f.json --top-k 0", "--top-k 0"),
    Case("fit-top-k-huge", "fit {fx}/stats.npz --out {w}/f.json --top-k 999", "--top-k 999"),
    Case("fit-granularity-unknown", "fit {fx}/stats.npz --out {w}/f.json --granularity row", "row"),
    Case("fit-estimator-unknown", "fit {fx}/stats.npz --out {w}/f.json --estimator e9", "e9"),
    Case("fit-alpha-max-nan", "fit {fx}/stats.npz --out {w}/f.json --alpha-max nan", "--alpha-max nan"),
    Case("fit-alpha-max-below-one", "fit {fx}/stats.npz --out {w}/f.json --alpha-max 0.5", "--alpha-max 0.5"),
    Case("fit-law-unknown", "fit {fx}/stats.npz --out {w}/f.json --law cubic", "cubic"),
    Case("fit-max-n-without-tabulated", "fit {fx}/stats.npz --out {w}/f.json --max-n 4096", "--max-n 4096"),
]

def _calibration(selection) -> dict:
    """A calibration record holding ``selection`` (the rest minimal but valid)."""
    return {"estimator": "mass-matching", "corpus": "pydoc", "sequences": 2, "max_length": 256, "rows": 10,
            "buckets": [], "results": [], "tool_version": "0.1.0", "selection": selection}


def _selection(**over) -> dict:
    """A valid ``calibrate --select`` record over buckets 128 and 256, ``spec`` chosen."""
    def gains(g):
        return {"agreement": g, "expected_acceptance": g}

    return {"rule": "r", "simplicity": ["none", "scale"], "metric": "agreement", "weights": "equal", "sequences": 2,
            "buckets": [128, 256], "seconds": 1.0, "best": "spec", "chosen": "spec", "reason": "spec: best",
            "candidates": {"none": {"deployment": None},
                           "spec": {"deployment": {"law": "log-linear"}, "gain": gains([0.02, 0.01, 0.03]),
                                    "per_bucket": {"128": gains([0.01, 0.0, 0.02]), "256": gains([0.03, 0.01, 0.05])},
                                    "versus_best": [0.0, 0.0, 0.0]}}, **over}


def _with_gain(agreement) -> dict:
    record = _selection()
    record["candidates"]["spec"]["gain"]["agreement"] = agreement
    return record


SPEC_CLAMP_AT_N_REF = _spec(positions={"fix": "clamp", "window": 64})  # n_ref 64: the window must lie below it
SPEC_CLAMP_ONLY = _spec(law="constant", n_ref=None, slope=0.0, positions={"fix": "clamp", "window": 64})
SPEC_WITH_CLAMP = _spec(positions={"fix": "clamp", "window": 32})
# pi with its own n_ref far past the spec's: rows up to 2^31 keep their positions, a no-op fix
SPEC_PI_PAST_N_REF = _spec(n_ref=128, positions={"fix": "pi", "n_ref": 2**31})

def _with_within(value) -> dict:
    record = _selection()
    record["candidates"]["spec"]["within_n_ref"] = value
    return record


SELECTION_CASES = [
    _inspect("selection-within-n-ref-string", _spec(calibration=_calibration(_with_within("none"))),
             "within_n_ref"),
    _inspect("selection-within-n-ref-nan", _spec(calibration=_calibration(_with_within(
        {"agreement": [float("nan"), 0.0, 0.1]}))), "within_n_ref"),
    _inspect("selection-within-n-ref-no-metric", _spec(calibration=_calibration(_with_within(
        {"expected_acceptance": [0.0, -0.1, 0.1]}))), "within_n_ref"),
    _inspect("selection-minimal", _spec(calibration=_calibration({"chosen": "none", "candidates": {"none": {}}})),
             "calibration.selection.rule': required field is missing"),
    _inspect("selection-empty-buckets", _spec(calibration=_calibration(_selection(buckets=[]))),
             "calibration.selection.buckets"),
    _inspect("selection-gain-string", _spec(calibration=_calibration(_with_gain("0.02"))),
             "calibration.selection.candidates.spec.gain.agreement"),
    _inspect("selection-nan-bound", _spec(calibration=_calibration(_with_gain([0.02, float("nan"), 0.03]))),
             "calibration.selection.candidates.spec.gain.agreement[1]"),
    _inspect("selection-chosen-unknown", _spec(calibration=_calibration(_selection(chosen="window 64"))),
             "calibration.selection.chosen"),
    _inspect("selection-metric-unread", _spec(calibration=_calibration(_selection(metric="expected_acceptance"))),
             "calibration.selection.metric"),
    _inspect("selection-best-none", _spec(calibration=_calibration(_selection(best="none"))),
             "calibration.selection.best"),
    _inspect("selection-none-with-gain", _spec(calibration=_calibration(_selection(candidates={
        "none": {"deployment": None, "gain": {"agreement": [0.0, 0.0, 0.0]}}}, best=None, chosen="none"))),
             "calibration.selection.candidates.none.gain"),
    _inspect("positions-window-at-n-ref", SPEC_CLAMP_AT_N_REF, "positions.window"),
    _inspect("positions-pi-n-ref-past-n-ref", SPEC_PI_PAST_N_REF, "positions.n_ref': must be at most n_ref=128"),
    Case("eval-spec-pi-n-ref-past-n-ref", EVAL + " --spec {w}/s.json", "positions.n_ref",
         (("s.json", SPEC_PI_PAST_N_REF),)),
    Case("eval-spec-positions-window-at-n-ref", EVAL + " --spec {w}/s.json", "positions.window",
         (("s.json", SPEC_CLAMP_AT_N_REF),)),
    Case("eval-spec-positions-window-past-drafter-n-ref", EVAL + " --n-ref 32 --spec {w}/s.json --variants spec",
         "positions.window 64 must be below the drafter's n_ref (32)", (("s.json", SPEC_CLAMP_ONLY),)),
    Case("eval-spec-pi-n-ref-past-drafter-n-ref", EVAL + " --n-ref 32 --spec {w}/s.json --variants spec",
         "positions.n_ref 64 (pi's trained length) must be at most the drafter's n_ref (32)",
         (("s.json", _spec(law="constant", n_ref=None, slope=0.0, positions={"fix": "pi", "n_ref": 64})),)),
    Case("eval-pi-spec-on-a-clamp", EVAL + " --n-ref 64 --spec {w}/s.json --variants pi+spec",
         "the spec already has a distance fix (clamp", (("s.json", SPEC_WITH_CLAMP),)),
    Case("eval-clamp-spec-past-the-spec-n-ref", EVAL + " --n-ref 100 --spec {w}/s.json --variants clamp+spec",
         "pass a --neighbour-window below the spec's n_ref (64)", (("s.json", _spec()),)),
    Case("eval-pi-spec-past-the-spec-n-ref", EVAL + " --n-ref 100 --spec {w}/s.json --variants pi+spec",
         "pass --n-ref at most the spec's n_ref (64)", (("s.json", _spec()),)),
    Case("eval-slopes-underscore", EVAL + " --slopes 1_0", "--slopes 1_0: '1_0' is not a number"),
    Case("eval-slopes-commas", EVAL + " --slopes ,,,", "--slopes ,,,: an empty value"),
    Case("eval-alphas-empty-item", EVAL + " --alphas 1.1,,1.2", "--alphas 1.1,,1.2: an empty value"),
    Case("eval-seed-without-sample", EVAL + " --seed 7", "--seed 7: seeds the draws of --sample only"),
    Case("eval-seed-zero-without-sample", EVAL + " --speculative --seed 0", "--seed 0"),
    Case("eval-neighbour-window-unused", EVAL + " --neighbour-window 8", "--neighbour-window 8: no variant uses it"),
    Case("eval-group-unused", EVAL + " --variants clamp --group 4", "--group 4: no variant uses it (only group, "
                                                                    "group+spec do)"),
]

EVAL_RESUME = EVAL + " --out {w}/r.json --resume"
_EP, _UNIT = "r.json.partial", "r.json.partial/forced-00000.json"
CAL_RESUME = CAL + " --out {w}/spec.json --resume"
_CP = "spec.json.partial"


def _eval_unit(case_id, content, fragment=_UNIT.split("/")[1]):
    return Case(f"eval-resume-{case_id}", EVAL_RESUME, fragment, ((_EP, "@evalpartial"), (_UNIT, content)))


def _eval_run_json(case_id, content, fragment="run.json"):
    return Case(f"eval-resume-run-json-{case_id}", EVAL_RESUME, fragment, ((_EP, "@evalpartial"),
                                                                          (_EP + "/run.json", content)))


def _cal_run_json(case_id, content, fragment="run.json"):
    return Case(f"calibrate-resume-run-json-{case_id}", CAL_RESUME, fragment, ((_CP, "@calpartial"),
                                                                              (_CP + "/run.json", content)))


RESUME_CASES = [
    _eval_unit("unit-array", "[1, 2]"),
    _eval_unit("unit-empty-object", "{}"),
    _eval_unit("unit-wrong-shapes", '{"rows": [1, 2], "sums": {}, "mass": {}}'),
    _eval_unit("unit-strings", '{"rows": "abc", "sums": {"none": 1}, "mass": {"none": 1}}'),
    _eval_unit("unit-not-utf8", b"\xff\xfe{\x81}"),
    _eval_unit("unit-deep", _DEEP_LIST, "nested too deeply"),
    _eval_run_json("array", "[1, 2]", "was not written by this command"),
    _eval_run_json("empty-object", "{}", "was not written by this command"),
    _eval_run_json("not-utf8", b"\xff\xfe{\x81}"),
    _eval_run_json("deep", _DEEP_OBJECT, "nested too deeply"),
    Case("eval-resume-calibrate-partial", EVAL_RESUME, "was not written by this command", ((_EP, "@calpartial"),)),
    Case("eval-resume-other-lengths", EVAL_RESUME.replace("--lengths 32,64,128", "--lengths 32,128"),
         "lengths does not match", ((_EP, "@evalpartial"),)),
    Case("eval-resume-other-variants", EVAL_RESUME + " --variants spec", "variants does not match",
         ((_EP, "@evalpartial"),)),
    _cal_run_json("array", "[1, 2]", "was not written by this command"),
    _cal_run_json("empty-object", "{}", "was not written by this command"),
    _cal_run_json("wrong-shapes", '{"drafter": ["pard"], "grid": {}}', "was not written by this command"),
    _cal_run_json("not-utf8", b"\xff\xfe{\x81}"),
    _cal_run_json("deep", _DEEP_LIST, "nested too deeply"),
    Case("calibrate-resume-eval-partial", CAL_RESUME, "was not written by this command", ((_CP, "@evalpartial"),)),
    Case("calibrate-resume-sequence-json", CAL_RESUME, "seq-00000.npz", ((_CP, "@calpartial"),
                                                                        (_CP + "/seq-00000.npz", "[1, 2]"))),
]

ASSETS = Path(__file__).resolve().parents[1] / "calibrate" / "assets"  # the built-in drafters (cases chdir away)
EVAL_ONLINE = ("eval --drafter eagle3 --drafter-path {fx}/eagle3 --target-path {fx}/target --corpus {fx}/corpus.txt "
               "--lengths 32,64,128 --sequences 1 --device cpu --threads 1 --variants none,online-lora")
ONLINE = [  # the online arms' options (calibrate.online): all refused before a model loads
    Case("online-every-zero", EVAL_ONLINE + " --online-every 0", "--online-every 0"),
    Case("online-every-negative", EVAL_ONLINE + " --online-every -4", "--online-every -4"),
    Case("online-every-huge", EVAL_ONLINE + " --online-every 100000", "--online-every 100000"),
    Case("online-every-text", EVAL_ONLINE + " --online-every often", "--online-every"),
    Case("online-steps-zero", EVAL_ONLINE + " --online-steps 0", "--online-steps 0"),
    Case("online-steps-huge", EVAL_ONLINE + " --online-steps 1000", "--online-steps 1000"),
    Case("online-lr-zero", EVAL_ONLINE + " --online-lr 0", "--online-lr 0"),
    Case("online-lr-negative", EVAL_ONLINE + " --online-lr -0.001", "--online-lr -0.001"),
    Case("online-lr-nan", EVAL_ONLINE + " --online-lr nan", "--online-lr nan"),
    Case("online-lr-inf", EVAL_ONLINE + " --online-lr inf", "--online-lr inf"),
    Case("online-lr-huge", EVAL_ONLINE + " --online-lr 10", "--online-lr 10"),
    Case("online-lr-text", EVAL_ONLINE + " --online-lr fast", "--online-lr"),
    Case("online-rank-zero", EVAL_ONLINE + " --online-rank 0", "--online-rank 0"),
    Case("online-rank-huge", EVAL_ONLINE + " --online-rank 1000", "--online-rank 1000"),
    Case("online-option-without-arm", EVAL_ONLINE.replace(",online-lora", "") + " --online-steps 2",
         "--online-steps"),
    Case("online-carry-without-arm", EVAL_ONLINE.replace(",online-lora", "") + " --online-carry", "--online-carry"),
    Case("online-variant-unknown", EVAL_ONLINE.replace("online-lora", "online-adapter"), "online-adapter"),
    Case("online-drafter-hf", EVAL + " --variants none,online-full", "online-full"),
    Case("online-speculative", EVAL_ONLINE + " --speculative", "--speculative"),
    Case("online-carry-resume", EVAL_ONLINE + " --online-carry --resume --out {w}/r.json", "--online-carry"),
    # eval's online arms adapt the head alone: the built-in default (the head with its copy pointer) is refused
    Case("online-default-pointer", "eval --drafter eagle3 --corpus {fx}/corpus.txt --lengths 32,64,128 --sequences 1 "
         "--device cpu --threads 1 --variants none,online-full", "copy pointer"),
    Case("online-named-pointer", f"eval --drafter eagle3 --drafter-path {ASSETS}/eagle3-smollm2-copy "
         "--corpus {fx}/corpus.txt --lengths 32,64,128 --sequences 1 --device cpu --threads 1 "
         "--variants none,online-lora", "--drafter-path"),
]
ONLINE_AFTER_LOADING = [  # needs the head's widths: refused once it is read, still in one line
    Case("online-rank-above-width", EVAL_ONLINE + " --online-rank 200", "--online-rank 200"),
]

_GEN = "generate --out {w}/g --workload math:heldout"
GENERATE = [
    Case("generate-new-tokens-zero", _GEN + " --new-tokens 0", "--new-tokens 0"),
    Case("generate-new-tokens-huge", _GEN + " --new-tokens 1000000000", "--new-tokens 1000000000"),
    Case("generate-min-new-tokens-negative", _GEN + " --min-new-tokens -1", "--min-new-tokens -1"),
    Case("generate-min-new-tokens-above-new", _GEN + " --new-tokens 8 --min-new-tokens 9", "--min-new-tokens 9"),
    Case("generate-temperature-nan", _GEN + " --temperature nan", "--temperature nan"),
    Case("generate-temperature-negative", _GEN + " --temperature -1", "--temperature -1"),
    Case("generate-top-p-zero", _GEN + " --top-p 0", "--top-p 0"),
    Case("generate-top-p-above-one", _GEN + " --top-p 1.5", "--top-p 1.5"),
    Case("generate-batch-zero", _GEN + " --batch 0", "--batch 0"),
    Case("generate-prompts-zero", _GEN + " --prompts 0", "--prompts 0"),
    Case("generate-seed-negative", _GEN + " --seed -1", "--seed -1"),
    Case("generate-threads-zero", _GEN + " --threads 0", "--threads 0"),
    Case("generate-workload-unknown", "generate --out {w}/g --workload poetry", "poetry"),
    Case("generate-workload-missing-file", "generate --out {w}/g --workload {w}/none.jsonl", "none.jsonl"),
    Case("generate-workload-split-unknown", "generate --out {w}/g --workload math:test", "math:test"),
    Case("generate-workload-missing-field", "generate --out {w}/g --workload {w}/p.jsonl", "missing field 'prompt'",
         (("p.jsonl", '{"id": "a"}\n'),)),
    Case("generate-workload-empty-prompt", "generate --out {w}/g --workload {w}/p.jsonl", "field 'prompt'",
         (("p.jsonl", '{"id": "a", "prompt": ""}\n'),)),
    Case("generate-workload-empty-file", "generate --out {w}/g --workload {w}/p.jsonl", "no prompts", (("p.jsonl", ""),)),
    Case("generate-out-is-a-file", "generate --out {w}/g --workload math", "a file is there", (("g", "x"),)),
    Case("generate-out-has-a-run", "generate --out {w}/g --workload math", "pass --resume",
         (("g", None), ("g/run.json", "{}"))),
    Case("generate-resume-unreadable-run", "generate --out {w}/g --workload math --resume", "cannot be read",
         (("g", None), ("g/run.json", "{"))),
    Case("generate-resume-other-settings", "generate --out {w}/g --workload math --resume --seed 3", "differs from the run",
         (("g", None), ("g/run.json", json.dumps({"settings": {"seed": 0}})))),
    Case("generate-lengthen-not-a-run", _GEN + " --lengthen {w}/s", "--lengthen", (("s", None),)),
    Case("generate-lengthen-missing", _GEN + " --lengthen {w}/none", "--lengthen"),
    Case("generate-lengthen-a-file", _GEN + " --lengthen {w}/f", "not a generation run", (("f", "x"),)),
    Case("generate-lengthen-unreadable-run", _GEN + " --lengthen {w}/s", "cannot be read",
         (("s", None), ("s/run.json", "["))),
    Case("generate-lengthen-other-settings", _GEN + " --new-tokens 64 --lengthen {w}/s", "differs",
         (("s", None), ("s/run.json", json.dumps({"settings": {"seed": 3}})))),
    Case("generate-lengthen-is-out", "generate --out {w}/g --workload math:heldout --lengthen {w}/g",
         "is --out", (("g", None), ("g/run.json", json.dumps({"settings": {"seed": 0}})))),
]

_BENCH = "bench --out {w}/b.json --workload math --variants none,window"
_BENCH_ONLINE = "bench --out {w}/b.json --workload math --variants none,online-full,online-lora"
BENCH = [
    Case("bench-new-tokens-zero", _BENCH + " --new-tokens 0", "--new-tokens 0"),
    Case("bench-min-new-tokens-negative", _BENCH + " --min-new-tokens -1", "--min-new-tokens -1"),
    Case("bench-min-new-tokens-above-new", _BENCH + " --new-tokens 64 --min-new-tokens 65", "--min-new-tokens 65"),
    Case("bench-min-new-tokens-text", _BENCH + " --min-new-tokens abc", "--min-new-tokens abc: expected an integer"),
    Case("bench-pointer-unmatched-unknown", _BENCH + " --pointer-unmatched MASKED",
         "--pointer-unmatched MASKED: expected scored or masked"),
    Case("bench-pointer-unmatched-no-pointer", _BENCH + f" --drafter-path {ASSETS}/eagle3-smollm2 "
         "--pointer-unmatched masked", "has no copy pointer"),
    Case("bench-bin-size-zero", _BENCH + " --bin-size 0", "--bin-size 0"),
    Case("bench-bin-size-past-new-tokens", _BENCH + " --new-tokens 64 --bin-size 65", "--bin-size 65"),
    Case("bench-prompts-zero", _BENCH + " --prompts 0", "--prompts 0"),
    Case("bench-prompts-more-than-the-split", _BENCH + " --prompts 5", "--prompts 5"),
    Case("bench-num-draft-zero", _BENCH + " --num-draft 0", "--num-draft 0"),
    Case("bench-temperature-nan", _BENCH + " --temperature nan", "--temperature nan"),
    Case("bench-seed-negative", _BENCH + " --seed -1", "--seed -1"),
    Case("bench-threads-zero", _BENCH + " --threads 0", "--threads 0"),
    Case("bench-variant-unknown", "bench --out {w}/b.json --variants none,magic", "magic"),
    Case("bench-spec-arm-without-spec", "bench --out {w}/b.json --variants none,spec", "--variants spec"),
    Case("bench-spec-missing", "bench --out {w}/b.json --spec {w}/none.json", "none.json"),
    Case("bench-drafter-unknown", "bench --out {w}/b.json --drafter gpt --variants none", "gpt"),
    Case("bench-workload-unknown", "bench --out {w}/b.json --workload poetry --variants none", "poetry"),
    Case("bench-workload-bad-line", "bench --out {w}/b.json --workload {w}/p.jsonl:all --variants none",
         "missing field 'id'", (("p.jsonl", '{"prompt": "x"}\n'),)),
    Case("bench-out-is-a-folder", "bench --out {w}/d --variants none", "is a folder; give a file name", (("d", None),)),
    Case("bench-out-is-the-spec", "bench --out {w}/s.json --spec {w}/s.json", "is the --spec input", (("s.json", _spec()),)),
    Case("bench-out-is-the-workload", "bench --out {w}/p.jsonl --workload {w}/p.jsonl:all --variants none",
         "is the --workload input", (("p.jsonl", '{"id": "a", "prompt": "x"}\n'),)),
    Case("bench-plot-is-the-out", "bench --out {w}/b.png --plot {w}/b.png --variants none", "same path as --out"),
    Case("generate-out-is-the-target", "generate --out {w}/t --workload math --target-path {w}/t",
         "is the --target-path input", (("t", None),)),
    Case("bench-interrupted-run-there", "bench --out {w}/b.json --variants none", "pass --resume",
         (("b.json.partial", None), ("b.json.partial/run.json", "{}"))),
    Case("bench-resume-other-options", "bench --out {w}/b.json --variants none --resume", "was not written by this",
         (("b.json.partial", None), ("b.json.partial/run.json", "{}"))),
    Case("bench-partial-is-a-file", "bench --out {w}/b.json --variants none", "is a file where the run keeps",
         (("b.json.partial", "x"),)),
    Case("bench-plot-not-png", _BENCH + " --plot {w}/p.pdf", "--plot"),
    # the online arms' options (calibrate.online); the rank's width is read from the head's config.json
    Case("bench-online-lr-zero", _BENCH_ONLINE + " --online-lr 0", "--online-lr 0"),
    Case("bench-online-lr-negative", _BENCH_ONLINE + " --online-lr -0.001", "--online-lr -0.001"),
    Case("bench-online-lr-nan", _BENCH_ONLINE + " --online-lr nan", "--online-lr nan"),
    Case("bench-online-every-zero", _BENCH_ONLINE + " --online-every 0", "--online-every 0"),
    Case("bench-online-steps-zero", _BENCH_ONLINE + " --online-steps 0", "--online-steps 0"),
    Case("bench-online-rank-zero", _BENCH_ONLINE + " --online-rank 0", "--online-rank 0"),
    Case("bench-online-rank-above-width", _BENCH_ONLINE + " --online-rank 200", "--online-rank 200"),
    Case("bench-online-rank-above-width-of-the-head", _BENCH_ONLINE + " --drafter-path {fx}/eagle3 --online-rank 40",
         "--online-rank 40"),
    Case("bench-online-rank-above-width-of-a-pard-model", _BENCH_ONLINE + " --drafter pard --drafter-path {fx}/pard "
         "--online-rank 40", "--online-rank 40"),
    Case("bench-online-drafter-hf", _BENCH_ONLINE + " --drafter hf --drafter-path {fx}/pard", "online-full"),
    Case("bench-online-option-without-arm", _BENCH + " --online-lr 0.001", "--online-lr"),
    Case("bench-online-rank-above-the-dflash-width", _BENCH_ONLINE + " --drafter dflash --online-rank 200",
         "--online-rank 200"),
]



def _run(tokens: int = 130, tokenizer: str = "0123456789abcdef", generation: str | None = None) -> tuple:
    """The files of a one-prompt ``sharpdraft generate`` run folder ``g`` (prompt a, train split) of ``tokens`` tokens."""
    run = {"settings": {"workload": {"name": "p", "path": "/elsewhere/p.jsonl", "split": "all", "ids": ["a"]}},
           "tokenizer": tokenizer}
    done = {"id": "a", "prompt_ids": [1] * 10, "output_ids": [2] * (tokens - 10), "text": "", "stopped": "length",
            "seconds": 0.0}
    return (("g", None), ("g/run.json", json.dumps(run)), ("g/prompts", None),
            ("g/prompts/a.json", generation if generation is not None else json.dumps(done)))


_GEN_EVAL = EVAL.replace("{fx}/corpus.txt", "generated:{w}/g")
GENERATED = [  # generated:NAME[:SPLIT] corpora and --bin-size: refused before any model loads
    Case("eval-generated-empty", EVAL.replace("{fx}/corpus.txt", "generated:"), "generated:"),
    Case("eval-generated-unknown-name", EVAL.replace("{fx}/corpus.txt", "generated:poetry"), "generated:poetry"),
    Case("eval-generated-split-unknown", EVAL.replace("{fx}/corpus.txt", "generated:diary:test"), "unknown split 'test'"),
    Case("eval-generated-long-train", EVAL.replace("{fx}/corpus.txt", "generated:diary-long"),
         "no finished generation in the train split"),  # diary-long holds the held-out prompts only
    Case("eval-generated-no-folder", EVAL.replace("{fx}/corpus.txt", "generated:{w}/none"), "neither a shipped"),
    Case("eval-generated-not-a-run", _GEN_EVAL, "is not a generation run", (("g", None),)),
    Case("eval-generated-run-json-array", _GEN_EVAL, "is not a generation run", (("g", None), ("g/run.json", "[1]"))),
    Case("eval-generated-empty-split", EVAL.replace("{fx}/corpus.txt", "generated:{w}/g:heldout"), "no finished generation in the heldout split", _run()),
    Case("eval-generated-half-written", _GEN_EVAL, "a.json: not a finished generation",
         _run(generation='{"id": "a", "prompt_ids": [1')),
    Case("eval-generated-too-short", _GEN_EVAL, "holds 128 tokens", _run(tokens=100)),
    Case("eval-generated-other-tokenizer", _GEN_EVAL, "generated with tokenizer 0123456789abcdef", _run()),
    Case("eval-generated-in-recall", EVAL.replace("{fx}/corpus.txt", "recall:generated:{w}/g"), "token ids, not text",
         _run()),
    Case("eval-bin-size-zero", _GEN_EVAL + " --bin-size 0", "--bin-size 0", _run()),
    Case("eval-bin-size-negative", _GEN_EVAL + " --bin-size -5", "--bin-size -5", _run()),
    Case("eval-bin-size-text", _GEN_EVAL + " --bin-size wide", "--bin-size", _run()),
    Case("eval-bin-size-past-the-longest-length", _GEN_EVAL + " --bin-size 129", "--bin-size 129", _run()),
    Case("eval-bin-size-huge", _GEN_EVAL + " --bin-size 1" + "0" * 30, "--bin-size 1" + "0" * 30, _run()),
    Case("eval-bin-size-on-a-text-corpus", EVAL + " --bin-size 64", "--bin-size 64"),
    _cal("generated-unknown-name", "--corpus generated:poetry", "generated:poetry"),
    _cal("generated-empty-split", "--corpus generated:{w}/g:heldout", "no finished generation", _run(300)),
    _cal("generated-too-short", "--corpus generated:{w}/g", "holds 256 tokens", _run(100)),
    _cal("generated-other-tokenizer", "--corpus generated:{w}/g", "generated with tokenizer 0123456789abcdef",
         _run(300), base=CAL_EAGLE3 + " --max-length 256"),
]
GENERATED_AFTER_LOADING = [  # a checkpoint that reads its own tokenizer: refused as soon as it loads, before any pass
    _cal("generated-other-tokenizer-than-the-drafter", "--corpus generated:{w}/g", "not the drafter's", _run(300)),
]

CASES = (GENERATE + BENCH + GENERATED + GENERATED_AFTER_LOADING + PREDICT + INSPECT + EVAL_CASES + CALIBRATE + PLOT + FIT + SELECTION_CASES + RESUME_CASES + ONLINE
         + ONLINE_AFTER_LOADING)
_EXP = "export --out {w}/o --spec {w}/s.json"
EXPORT = [Case(f"export-{how}", f"{_EXP} {extra}".strip(), fragment, (("s.json", spec),) + files) for how, extra, spec, fragment, files in (
    ("drafter-pard", "--drafter pard", _spec(), "--drafter pard", ()),
    ("copy-pointer", "--drafter-path {w}/p", _spec(), "copy pointer", (("p", None), ("p/copy_pointer.json", "{}"))),
    ("no-head", "--drafter-path {w}/p", _spec(), "no config.json", (("p", None),)),
    ("spec-positions", "", _spec(positions={"fix": "clamp", "window": 32}), "field 'positions'", ()),
    ("spec-sinks", "", _spec(window=32, sinks=4), "field 'sinks'", ()),
    ("spec-other-kind", "", _spec(drafter=_drafter_info(1, 9, "pard")), "field 'drafter.kind' (pard)", ()),
    ("spec-other-shape", "", _spec(drafter=_drafter_info(2, 9, "eagle3")), "2 layers", ()),
    ("spec-head-slopes", "", _spec(granularity="head", slope=[[0.1] * 4]), "4 heads", ()),
    ("spec-invalid", "", _spec(slope=-1), "slope", ()),
    ("spec-missing", "--spec {w}/none.json", _spec(), "none.json", ()),
    ("out-has-files", "", _spec(), "--out", (("o", None), ("o/x", "1"))),
    ("max-length-one", "--max-length 1", _spec(), "--max-length 1", ()),
    ("num-draft-zero", "--num-draft 0", _spec(), "--num-draft 0", ()),
    ("other-target", "--target-path {fx}/target", _spec(), "is this the head's target?", ()),
    ("max-length-above-target", "--target-path {fx}/target --drafter-path {fx}/eagle3 --max-length 1000000", _spec(),
     "--max-length 1000000", ()))]
CASES += EXPORT


# -- fixtures -------------------------------------------------------------------------------------

def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


class _StopAfterOne:
    def start(self, total, done, tokens_per_sequence):
        pass

    def advance(self, tokens, rows):
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    """Shared inputs: tiny checkpoints (good and broken), a corpus, a spec, statistics files, a partial run."""
    root = tmp_path_factory.mktemp("fx")
    (root / "corpus.txt").write_text(TEXT)
    (root / "spec.json").write_text(_spec())
    _write_causal_lm(root / "pard", pard_token=258, spd_type="pard")
    _write_causal_lm(root / "pard-bad-token", pard_token=9999, spd_type="pard")
    target = tiny_target(0, vocab_size=VOCAB)
    write_tiny_dflash(root / "dflash", target, seed=2, block_size=4, mask_token_id=259)
    _write_bad_draft_vocabularies(root)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    write_tiny_eagle3(root / "eagle3", target, seed=1)
    _write_cut_pard(root, target)
    shutil.copytree(root / "pard", root / "pard-truncated")
    _truncate(root / "pard-truncated" / "model.safetensors")
    for name in ("eagle3-truncated", "eagle3-array", "eagle3-rope", "eagle3-notjson", "eagle3-null"):
        shutil.copytree(root / "eagle3", root / name)
    _truncate(root / "eagle3-truncated" / "model.safetensors")
    (root / "eagle3-array" / "config.json").write_text("[1, 2, 3]")
    (root / "eagle3-null" / "config.json").write_text("null")
    config = json.loads((root / "eagle3" / "config.json").read_text())
    (root / "eagle3-rope" / "config.json").write_text(json.dumps({**config, "rope_scaling": "linear"}))
    (root / "eagle3-notjson" / "config.json").write_text("{\"hidden_size\": 64,")
    opts = CalibrateOptions(out=root / "work" / "spec.json", drafter="pard", drafter_path=str(root / "pard"),
                            corpus=str(root / "corpus.txt"), max_length=256, sequences=2, n_ref=64, device="cpu",
                            bootstrap=20, stats=root / "stats.npz")
    run_calibration(opts)
    shutil.copy(root / "stats.npz", root / "stats-truncated.npz")
    _truncate(root / "stats-truncated.npz")
    stats, meta = RowStats.load(root / "stats.npz")  # as a version without the distance profile wrote it
    replace(stats, distance=None).save(root / "stats-no-distance.npz", **meta)
    import numpy as np
    np.savez(root / "wrong-arrays.npz", x=np.arange(3))
    # an interrupted run with the same options as CAL, its first sequence then corrupted
    cal = CalibrateOptions(out=root / "partial" / "spec.json", drafter="pard", drafter_path=str(root / "pard"),
                           corpus=str(root / "corpus.txt"), max_length=256, sequences=2, n_ref=64, device="cpu")
    with pytest.raises(KeyboardInterrupt):
        run_calibration(cal, progress=_StopAfterOne())
    shutil.copytree(partial_dir(cal.out), root / "cal-partial")  # intact, for cases that damage another file
    _truncate(partial_dir(cal.out) / "seq-00000.npz")
    # an eval run of EVAL with --out whose progress is kept (as an interrupted run leaves it)
    from unittest import mock

    from calibrate.measure import SavedUnits

    argv = [a.format(fx=root, w=root) for a in (EVAL + " --out {w}/eval/r.json").split(" ")]
    with mock.patch.object(SavedUnits, "finish", lambda self: None):
        code, _, err, escaped = _run_main(argv)
    assert code == 0 and escaped is None, err
    return root


def _write_bad_draft_vocabularies(root: Path) -> None:
    """``dflash-vocab-<how>``: copies of ``root/dflash`` whose draft vocabulary does not fit."""
    from calibrate.drafters.vocab import d2t_of

    ids = torch.arange(0, 64, 2)
    size = lambda value: lambda c: c.update(draft_vocab_size=value)  # noqa: E731
    add_map = lambda offset: lambda w: w.update(d2t=d2t_of(ids) + offset)  # noqa: E731
    for how, weights, config in (("outside", add_map(10 ** 6), size(len(ids))), ("no-map", None, size(len(ids))),
                                 ("map-only", add_map(0), None), ("size-zero", add_map(0), size(0)),
                                 ("size-text", add_map(0), size("many"))):
        corrupt_checkpoint(root / "dflash", root / f"dflash-vocab-{how}", weights, config)


def _write_cut_pard(root: Path, target) -> None:
    """``cut-good``, a train_pard.py folder cut from ``root/target``, and broken copies ``cut-<how>``."""
    from safetensors.torch import load_file, save_file

    from calibrate.drafters.pard_smollm2 import cut_drafter, trained_state

    drafter = cut_drafter(target, [0, 7], 258, 64, str(root / "target"))
    good = root / "cut-good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps(drafter.config.to_dict()))
    save_file(trained_state(drafter), good / "model.safetensors")
    config, tensors = json.loads((good / "config.json").read_text()), load_file(good / "model.safetensors")
    for how in ("base-unknown", "layer-missing", "embedding-stored", "truncated", "no-weights"):
        shutil.copytree(good, root / f"cut-{how}")
    (root / "cut-base-unknown" / "config.json").write_text(
        json.dumps({**config, "sharpdraft_embedding_from": "/no/such/base"}))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"},
              root / "cut-layer-missing" / "model.safetensors")
    save_file({**tensors, "model.embed_tokens.weight": target.get_input_embeddings().weight.detach().clone()},
              root / "cut-embedding-stored" / "model.safetensors")
    _truncate(root / "cut-truncated" / "model.safetensors")
    (root / "cut-no-weights" / "model.safetensors").unlink()


def _hashes(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
    return out


def _make_files(w: Path, fx: Path, files) -> None:
    for name, content in files:
        path = w / name
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        elif content == "@partial":
            shutil.copytree(partial_dir(fx / "partial" / "spec.json"), path)
        elif content == "@calpartial":
            shutil.copytree(fx / "cal-partial", path)
        elif content == "@evalpartial":
            shutil.copytree(fx / "eval" / "r.json.partial", path)
        elif content == "@pard":
            shutil.copytree(fx / "pard", path)
        elif content == "@stats":
            shutil.copy(fx / "stats.npz", path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


class _Hang(Exception):
    pass


def _run_main(argv: list[str]) -> tuple[int | None, str, str, BaseException | None]:
    """Run ``sharpdraft argv`` in this process: (exit status or None, stdout, stderr, escaped exception)."""
    out, err = io.StringIO(), io.StringIO()
    code, escaped = None, None

    def alarm(signum, frame):
        raise _Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(TIMEOUT_S)
    old_argv = sys.argv
    sys.argv = ["sharpdraft", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - anything escaping main is the finding
        escaped = e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.argv = old_argv
    return code, out.getvalue(), err.getvalue(), escaped


def _verdict(code, stdout, stderr, escaped, changed, fragment) -> str:
    if isinstance(escaped, _Hang):
        return "silent"
    if escaped is not None or "Traceback" in stdout + stderr:
        return "traceback"
    if changed:
        return "data-loss"
    if code == 0:
        return "silent"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if code != 1 or len(lines) != 1 or fragment not in lines[0] or not lines[0].startswith("error:"):
        return "misleading"
    return "ok"


def _report(case_id: str, verdict: str, detail: str) -> None:
    path = os.environ.get("SHARPDRAFT_HOSTILE_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case_id, "verdict": verdict, "detail": detail[-300:]}) + "\n")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_is_refused_in_one_line(case, fx, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    w = tmp_path / "w"
    w.mkdir()
    _make_files(w, fx, case.files)
    argv = [a.format(fx=fx, w=w) for a in case.argv.split(" ")]
    argv = ["" if a == "''" else a for a in argv]
    before_fx, before_w = _hashes(fx), _hashes(w)
    code, stdout, stderr, escaped = _run_main(argv)
    after_fx, after_w = _hashes(fx), _hashes(w)
    changed = [k for k, v in before_fx.items() if after_fx.get(k) != v]
    changed += [k for k, v in before_w.items() if after_w.get(k) != v]
    if code not in (0, None):  # a refused run leaves nothing behind, but what the case keeps (and its contents)
        changed += sorted(k for k in set(after_w) - set(before_w)
                          if not any(k == kept or k.startswith(kept + "/") for kept in case.keeps))
    verdict = _verdict(code, stdout, stderr, escaped, changed, case.fragment)
    detail = f"exit {code}; escaped {escaped!r}; changed {changed}; stderr {stderr.strip()!r}"
    _report(case.id, verdict, detail)
    assert verdict == "ok", detail


# Refused before any model loads: nothing is printed but the one line (no "Calibrating ..." banner).
BEFORE_LOADING = ["calibrate-top-k-huge", "calibrate-top-k-above-half-n-ref", "calibrate-top-k-huge-max-length",
                  "calibrate-top-k-huge-built-in", "calibrate-corpus-empty", "calibrate-corpus-blank",
                  "calibrate-corpus-jsonl-blank", "calibrate-n-ref-small", "calibrate-alpha-max-nan",
                  "eval-corpus-empty", "eval-threads-text", "eval-extra-spec-no-name", "eval-extra-spec-twice",
                  "eval-extra-spec-missing", "eval-extra-spec-is-out", "eval-pointer-unmatched-unknown",
                  "eval-pointer-unmatched-empty", "eval-pointer-unmatched-no-pointer"] + [c.id for c in ONLINE] + [c.id for c in GENERATE + BENCH]
BEFORE_LOADING += [c.id for c in GENERATED]


def test_every_before_loading_id_names_a_case():
    assert sorted(set(BEFORE_LOADING) - {c.id for c in CASES}) == []


@pytest.mark.parametrize("case", [c for c in CASES if c.id in BEFORE_LOADING],
                         ids=[c.id for c in CASES if c.id in BEFORE_LOADING])
def test_refused_before_any_model_loads(case, fx, tmp_path, monkeypatch):
    import calibrate.drafters
    import calibrate.drafters.target
    import calibrate.run

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(calibrate.run, "load_drafter", no_loading)
    monkeypatch.setattr(calibrate.drafters, "load_drafter", no_loading)
    monkeypatch.setattr(calibrate.drafters.target, "load_target", no_loading)
    monkeypatch.chdir(tmp_path)
    w = tmp_path / "w"
    w.mkdir()
    _make_files(w, fx, case.files)
    code, stdout, stderr, escaped = _run_main([a.format(fx=fx, w=w) for a in case.argv.split(" ")])
    assert escaped is None and code == 1, (escaped, stderr)
    assert stdout == "" and len(stderr.strip().splitlines()) == 1 and case.fragment in stderr


# -- the Python API -------------------------------------------------------------------------------

def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _enable(spec_dict):
    from sharpdraft_runtime import enable

    enable(_tiny_llama(), ScaleSpec.from_dict(spec_dict))


# (id, file text or None, callable(path) -> anything, fragment of the ValueError's one line)
API = [
    ("load-missing", None, lambda p: ScaleSpec.load(p.with_name("none.json")), "none.json"),
    ("load-folder", None, lambda p: ScaleSpec.load(p.parent), "folder"),
    ("load-binary", b"\xff\xfe\x81", ScaleSpec.load, "spec.json"),
    ("load-deep", _DEEP_LIST, ScaleSpec.load, "spec.json"),
    ("load-not-json", "{", ScaleSpec.load, "spec.json"),
    ("load-negative-slope", _spec(slope=-0.2), ScaleSpec.load, "spec.json"),
    ("load-huge-slope", _spec(slope=1e300), ScaleSpec.load, "slope"),
    ("load-huge-n-ref", _spec(n_ref=10**30), ScaleSpec.load, "n_ref"),
    ("enable-9-heads", None, lambda p: _enable({**GOOD_SPEC, "granularity": "head", "slope": [[0.1] * 9] * 2}),
     "9"),
    ("enable-3-layers", None, lambda p: _enable({**GOOD_SPEC, "granularity": "layer", "slope": [0.1] * 3}), "3"),
    ("enable-other-drafter", None, lambda p: _enable({**GOOD_SPEC, "drafter": _drafter_info(30, 9)}), "30 layers"),
]
_ENGINE = dict(cpu=True, method="eagle3", draft_layers=1, draft_heads=9, draft_length=4096, serving_length=4096,
               draft_path=None)
API += [(f"serve-{how}", text, call, fragment) for how, text, call, fragment in (  # the vLLM plugin's reading
    ("missing", None, lambda p: load_spec(p.with_name("none.json")), "none.json"),
    ("not-json", "{", load_spec, "spec.json"),
    ("positions", _spec(positions={"fix": "pi", "n_ref": 64}), load_spec, "field 'positions'"),
    ("other-kind", _spec(drafter=_drafter_info(1, 9, "dflash")), load_spec, "field 'drafter.kind' (dflash)"),
    ("other-shape", _spec(drafter=_drafter_info(2, 9, "eagle3")), lambda p: check_engine(load_spec(p), **_ENGINE),
     "2 layers"),
    ("no-drafter", _spec(), lambda p: check_engine(load_spec(p), **{**_ENGINE, "method": None}), "method is none"))]


@pytest.mark.parametrize("case_id,text,call,fragment", API, ids=[a[0] for a in API])
def test_api_refuses_in_one_line(case_id, text, call, fragment, tmp_path):
    path = tmp_path / "spec.json"
    if text is not None:
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    before = _hashes(tmp_path)
    try:
        call(path)
        verdict, detail = "silent", "accepted"
    except ValueError as err:
        line = str(err)
        verdict = "ok" if "\n" not in line and fragment in line else "misleading"
        detail = line
    except Exception as err:  # noqa: BLE001 - any other exception is the finding
        verdict, detail = "traceback", repr(err)
    if verdict == "ok" and _hashes(tmp_path) != before:
        verdict = "data-loss"
    _report(f"api-{case_id}", verdict, detail)
    assert verdict == "ok", detail


# -- writes ---------------------------------------------------------------------------------------

def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    from sharpdraft_theory.atomic import atomic_write_text

    path = tmp_path / "spec.json"
    path.write_text("old")
    path.chmod(0o644)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and (path.stat().st_mode & 0o777) == 0o644
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "fresh.json", "x")
    finally:
        os.umask(umask)
    assert (tmp_path / "fresh.json").stat().st_mode & 0o777 == 0o644


def test_a_full_disk_leaves_the_previous_spec_and_the_progress(fx, tmp_path, monkeypatch):
    """ENOSPC half-way through writing the spec: one UserError, old spec intact, --resume possible."""
    import errno

    import sharpdraft_theory.spec as spec_module
    from calibrate.errors import UserError
    from sharpdraft_theory.atomic import atomic_path

    out = tmp_path / "spec.json"
    out.write_text(_spec())
    before = out.read_bytes()

    def half_then_enospc(path, text):
        with atomic_path(path) as tmp:
            tmp.write_text(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    monkeypatch.setattr(spec_module, "atomic_write_text", half_then_enospc)
    opts = CalibrateOptions(out=out, drafter="pard", drafter_path=str(fx / "pard"), corpus=str(fx / "corpus.txt"),
                            max_length=256, sequences=2, n_ref=64, device="cpu", bootstrap=20)
    with pytest.raises(UserError, match=f"cannot write --out {out}: No space left on device"):
        run_calibration(opts)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json", "spec.json.partial"]
    monkeypatch.undo()
    from dataclasses import replace
    assert run_calibration(replace(opts, resume=True)).resumed == 2


def test_console_script_usage_error_is_one_line_exit_1():
    import subprocess

    script = str(Path(sys.executable).with_name("sharpdraft"))
    checkout = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # this checkout, wherever it is installed
    proc = subprocess.run([script, "predict", "--top-k", "four"], capture_output=True, text=True, timeout=120,
                          env=checkout)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --top-k four: expected an integer") and "sharpdraft predict" in lines[0]


def test_implausible_fits_warn():
    """A random-weight model's slope 19.5 with a wide interval: every warning fires; a sane fit gives none."""
    from types import SimpleNamespace

    from calibrate.run import plausibility_notes
    from sharpdraft_theory import Calibration, EstimatorResult

    def notes(slope, low, high, alpha_max=None):
        calibration = Calibration(estimator="mass-matching", corpus="c", sequences=2, max_length=256, rows=10,
                                  buckets=(), results=(), tool_version="0")
        spec = ScaleSpec(law="log-linear", n_ref=64, slope=slope, top_k=4, alpha_max=alpha_max, calibration=calibration)
        fit = SimpleNamespace(result=lambda name: EstimatorResult("mass-matching", slope, low, high, {}))
        return plausibility_notes(spec, fit)

    wild = notes(19.5, -3.0, 40.0)
    assert len(wild) == 3 and "slope 19.5000 is beyond" in wild[0] and "alpha(16 n_ref) = 55" in wild[1]
    assert "wider than the slope" in wild[2]
    assert notes(0.2, 0.18, 0.22) == []
    assert "exceeds --alpha-max 1.2" in notes(0.2, 0.18, 0.22, alpha_max=1.2)[0]
