"""End to end in vLLM's CPU build: the SmolLM2 target with the packaged EAGLE-3 head, exported by
``sharpdraft export``, served offline with the plugin and a spec (docs/serving.md).

These start vLLM (``benchmarks/vllm_engine.py`` in ``.venv-vllm``, a subprocess: vLLM spawns processes),
which takes minutes on 2 cores: marked ``vllm``, left out of ``make test``, run by ``make test-vllm``
(``.ci/run``, after the main suite). Two engines decode (a log-linear spec, then the same with a window),
two are refused before any model loads. Each decoding engine serves a prompt within the head's trained
length and one past it, with the drafter's counts and factors traced (``SHARPDRAFT_TRACE``).

Checks: (a) greedy output equals the target's own greedy decoding (transformers, float32, here);
(b) every traced factor equals sharpdraft_theory's float64 alpha(n) (rtol 1e-6: float32 alpha) at the
counts the module docstring of ``sharpdraft_runtime.serving`` derives from vLLM's reported
``query_start_loc`` and ``seq_lens``; (c) the target's 30 layers run vLLM's own kernel at the model's scale
and no scaled call names one; (d) a bad spec stops the engine in one line naming the field. And the
exported head drafts past its 256 trained tokens (the trap of a head's ``max_position_embeddings``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from sharpdraft_theory import ScaleSpec

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PY = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "benchmarks" / "vllm_engine.py"
N_REF = 256  # the demo head's training length
TARGET_LAYERS = 30
NEW_TOKENS = 24
ALPHA_RTOL = 1e-6  # float32 alpha against the float64 reference
TIMEOUT_S = 1200  # one engine: start (about 2 minutes on 2 shared cores) and two prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not ENGINE_PY.is_file(), reason="vLLM's environment .venv-vllm is missing "
                                                                 "(`make vllm` builds it)")]

SPEC = {"law": "log-linear", "n_ref": N_REF, "slope": 0.3, "top_k": 4}
WINDOW = 300


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The exported folder, the prompts (40 and 600 tokens of held-out text) and their greedy continuations."""
    from calibrate.cli import main
    from calibrate.smollm2 import load_smollm2

    root = tmp_path_factory.mktemp("vllm")
    (root / "spec.json").write_text(json.dumps(SPEC))
    (root / "window.json").write_text(json.dumps({**SPEC, "window": WINDOW}))
    (root / "bad.json").write_text(json.dumps({**SPEC, "slope": -0.5}))
    argv = ["export", "--out", str(root / "export"), "--spec", str(root / "spec.json"), "--max-length", "2048"]
    old, sys.argv = sys.argv, ["sharpdraft", *argv]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = old
    assert done.value.code == 0
    model, tokenizer = load_smollm2()
    ids = tokenizer(inspect.getsource(textwrap))["input_ids"]
    prompts = [ids[:40], ids[:600]]
    (root / "prompts.json").write_text(json.dumps(prompts))
    greedy = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
            greedy.append(out[0, len(p):].tolist())
    return root, prompts, greedy


def _engine(root: Path, spec: str, name: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARPDRAFT_SPEC": str(root / spec), "SHARPDRAFT_TRACE": str(root / f"{name}.trace"),
           "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the engine's environment has its own install of this project
    return subprocess.run([str(ENGINE_PY), str(RUNNER), "--export", str(root / "export"), "--prompts",
                           str(root / "prompts.json"), "--new-tokens", str(NEW_TOKENS), "--out",
                           str(root / f"{name}.out.json"), *extra], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _decoded(served, spec: str, name: str):
    root = served[0]
    done = _engine(root, spec, name)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((root / f"{name}.out.json").read_text())
    trace = [json.loads(line) for line in (root / f"{name}.trace").read_text().splitlines()]
    return result, trace


@pytest.fixture(scope="module")
def scaled(served):
    return _decoded(served, "spec.json", "spec")


@pytest.fixture(scope="module")
def windowed(served):
    return _decoded(served, "window.json", "window")


def _counts(query_start_loc, seq_lens, window=None):
    n = [seq - (query_start_loc[r + 1] - query_start_loc[r]) + j + 1
         for r, seq in enumerate(seq_lens) for j in range(query_start_loc[r + 1] - query_start_loc[r])]
    return n if window is None else [min(x, window) for x in n]


def _check_trace(trace, spec: ScaleSpec, window):
    routes = {r["layer"]: r for r in trace if "drafter_layer" in r}
    calls = [r for r in trace if "n" in r]
    # (c) the target's layers: routed to vLLM's kernel, at the model's own scale, no window; the drafter's one layer
    targets = [f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS)]
    assert sorted(routes) == sorted(targets + [f"model.layers.{TARGET_LAYERS}.self_attn.attn"])
    for name in targets:
        assert routes[name]["drafter_layer"] is None and routes[name]["scale"] == 64 ** -0.5
        assert routes[name]["sliding_window"] == -1
    drafter = routes[f"model.layers.{TARGET_LAYERS}.self_attn.attn"]
    assert drafter["drafter_layer"] == 0 and drafter["sliding_window"] == (window or -1)
    assert calls and {c["layer"] for c in calls} == {drafter["layer"]}
    # (b) each scaled call: the counts from vLLM's metadata, the factor alpha(n) in float64
    for c in calls:
        assert c["n"] == _counts(c["query_start_loc"], c["seq_lens"], window)[:len(c["n"])]
        np.testing.assert_allclose(np.asarray(c["alpha"])[:, 0], spec.alpha(c["n"]), rtol=ALPHA_RTOL)
    assert max(max(c["n"]) for c in calls) >= (window or 600)  # the long prompt's rows were scaled
    assert any(a[0] > 1.0 for c in calls for a in c["alpha"])


def _check_output(result, served):
    _, prompts, greedy = served
    runs = result["runs"]
    assert [r["output"] for r in runs] == greedy  # (a)
    long = runs[1]["counters"]  # past the head's 256 trained tokens, it drafts and some drafts are accepted
    assert long["vllm:spec_decode_num_drafts"] > 0 and long["vllm:spec_decode_num_accepted_tokens"] > 0


def test_greedy_output_is_the_targets_and_the_head_drafts_past_its_length(scaled, served):
    _check_output(scaled[0], served)


def test_the_drafters_factors_are_alpha_of_the_keys_vllm_reports_and_the_target_is_untouched(scaled):
    _check_trace(scaled[1], ScaleSpec.from_dict(SPEC), None)


def test_a_window_is_vllms_sliding_window_on_the_drafter_alone(windowed, served):
    _check_output(windowed[0], served)
    _check_trace(windowed[1], ScaleSpec.from_dict(SPEC), WINDOW)


@pytest.mark.parametrize("spec,extra,fragment", [
    ("bad.json", (), "field 'slope'"),
    ("spec.json", ("--no-draft",), "speculative method is none"),
])
def test_a_bad_spec_or_engine_stops_it_in_one_line(served, spec, extra, fragment):
    done = _engine(served[0], spec, "refused", *extra)
    lines = [line for line in done.stderr.splitlines() if line.startswith("sharpdraft:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert len(lines) == 1 and fragment in lines[0], done.stderr[-3000:]
