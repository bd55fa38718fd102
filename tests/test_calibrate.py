"""``sharpdraft calibrate`` end to end on tiny random checkpoints of every drafter kind."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.collect import log_grid
from calibrate.drafters import KINDS, kind_names, load_drafter
from calibrate.errors import UserError
from calibrate.run import CalibrateOptions, partial_dir, run_calibration
from sharpdraft_theory.spec import ScaleSpec
from sharpdraft_theory.stats import RowStats

from tiny_checkpoints import tiny_target, write_tiny_dflash, write_tiny_eagle3

VOCAB = 260  # 256 byte tokens, <eos>, spare ids (PARD's token, DFlash's mask token)
SHARPDRAFT = str(Path(sys.executable).with_name("sharpdraft"))


def _write_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer (one token per UTF-8 byte, plus <eos> = 256): no download needed."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(directory)


def _write_causal_lm(directory: Path, *, tokenizer: bool = True, **extra) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.2, **extra)
    LlamaForCausalLM(config).save_pretrained(directory)
    if tokenizer:
        _write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    target = tiny_target(0, vocab_size=VOCAB)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    return {
        "pard": _write_causal_lm(root / "pard", pard_token=258, spd_type="pard"),
        "hf-no-tokenizer": _write_causal_lm(root / "bare", tokenizer=False),
        "target": root / "target",
        "eagle3": write_tiny_eagle3(root / "eagle3", target, seed=1, max_position_embeddings=64),
        "dflash": write_tiny_dflash(root / "dflash", target, seed=2, target_layer_ids=(1, 3, 5)),
    }


def _opts(tmp_path, ckpts, **kw) -> CalibrateOptions:
    base = dict(out=tmp_path / "slope.json", drafter="pard", drafter_path=str(ckpts["pard"]), max_length=256,
                sequences=3, n_ref=64, device="cpu", bootstrap=20)
    return CalibrateOptions(**{**base, **kw})


def test_pard_calibrates_to_a_valid_spec(tmp_path, ckpts):
    opts = _opts(tmp_path, ckpts, stats=tmp_path / "rows.npz")
    result = run_calibration(opts)
    spec = ScaleSpec.load(opts.out)
    assert spec == result.spec
    assert spec.law == "log-linear" and spec.n_ref == 64 and spec.top_k == 4
    assert (spec.drafter.kind, spec.drafter.num_layers, spec.drafter.num_heads, spec.drafter.num_kv_heads,
            spec.drafter.head_dim) == ("pard", 2, 4, 2, 16)
    grid = log_grid(256)
    assert spec.calibration.rows == 3 * len(grid) * 2 * 4 == result.stats.rows
    assert spec.calibration.sequences == 3 and spec.calibration.max_length == 256
    assert {r.estimator for r in spec.calibration.results} == {"mass-matching", "closed-form", "gaussian"}
    beyond = [b for b in spec.calibration.buckets if b.n > 64]
    assert beyond and all(0 < b.mass < 1 for b in spec.calibration.buckets)
    assert not partial_dir(opts.out).exists()
    saved, meta = RowStats.load(tmp_path / "rows.npz")
    assert saved.rows == result.stats.rows and '"pard"' == meta["drafter"]
    assert set(saved.seq.tolist()) == {0, 1, 2}


def test_layer_and_head_granularity(tmp_path, ckpts):
    layer = run_calibration(_opts(tmp_path, ckpts, granularity="layer", sequences=2)).spec
    assert layer.slopes().shape == (2,)
    head = run_calibration(_opts(tmp_path, ckpts, granularity="head", sequences=2, estimator="gaussian")).spec
    assert head.slopes().shape == (2, 4) and head.calibration.estimator == "gaussian"


@pytest.mark.parametrize("granularity", ["global", "head"])
def test_tabulated_law_is_exact_where_calibrated_and_extrapolated_beyond(tmp_path, ckpts, granularity):
    """--law tabulated: knots at the buckets past n_ref holding mass matching's alpha, then fixed-slope
    knots up to --max-n; the spec loads, and the runtime applies it (float64) exactly at every knot."""
    import sharpdraft_runtime as sr
    from sharpdraft_theory.tabulate import FIXED_SLOPE

    opts = _opts(tmp_path, ckpts, law="tabulated", granularity=granularity, sequences=2, max_n=2000)
    result = run_calibration(opts)
    spec = ScaleSpec.load(opts.out)
    assert spec == result.spec and spec.law == "tabulated" and spec.slope is None
    t, fit = spec.table, result.fit
    calibrated = [b for b in fit.buckets if b.n > 64 and b.alpha is not None]
    assert t.measured == len(calibrated) > 0 and t.extrapolation == FIXED_SLOPE
    assert t.n[:t.measured] == tuple(round(b.n) for b in calibrated)
    last = t.n[t.measured - 1]  # the last bucket's n, ~220 (its rows reach 256)
    assert t.n[t.measured:] == tuple(64 * 2**j for j in range(1, 5) if last < 64 * 2**j) + (2000,)  # then --max-n
    values = spec.values()
    assert values.shape == spec.shape() + (len(t.n),) == ((2, 4) if granularity == "head" else ()) + (len(t.n),)
    if granularity == "global":  # exact where calibrated: the buckets' matched alpha
        np.testing.assert_array_equal(values[:t.measured], [b.alpha for b in calibrated])
    else:
        own = fit.bucket_alpha[..., [fit.buckets.index(b) for b in calibrated]]
        np.testing.assert_array_equal(values[..., :t.measured][np.isfinite(own)], own[np.isfinite(own)])
    slope = np.maximum(fit.slopes["mass-matching"], 0.0)
    at_last = values[..., t.measured - 1]
    want = at_last[..., None] + np.asarray(slope)[..., None] * np.log(np.array(t.n[t.measured:]) / last)
    np.testing.assert_allclose(values[..., t.measured:], want, rtol=1e-12)
    knots = torch.tensor((64,) + t.n + (10**6,))
    for layer in range(2):
        got = sr.alpha_for(spec, knots, layer=layer if granularity == "head" else None, dtype=torch.float64)[0]
        row = values[layer] if granularity == "head" else values[None]
        want = np.concatenate([np.ones(row.shape[:-1] + (1,)), row, row[..., -1:]], axis=-1)
        np.testing.assert_allclose(got.numpy(), np.broadcast_to(want, got.shape), rtol=1e-14)
    res = CliRunner().invoke(app, ["inspect", str(opts.out)], terminal_width=200)
    assert res.exit_code == 0, res.output
    for text in ("tabulated", "alpha at the knots", "calibration", FIXED_SLOPE, f"{len(t.n)} knots"):
        assert text in res.output


def test_hf_drafter_borrows_the_target_tokenizer(tmp_path, ckpts):
    bare = str(ckpts["hf-no-tokenizer"])
    with pytest.raises(UserError, match="no tokenizer files there; pass --target-path"):
        run_calibration(_opts(tmp_path, ckpts, drafter="hf", drafter_path=bare))
    spec = run_calibration(_opts(tmp_path, ckpts, drafter="hf", drafter_path=bare,
                                 target_path=str(ckpts["target"]), sequences=2)).spec
    assert spec.drafter.kind == "hf" and spec.drafter.path == bare


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_feature_drafters_calibrate(tmp_path, ckpts, kind):
    drafter = load_drafter(kind, str(ckpts[kind]), str(ckpts["target"]), torch.device("cpu"), torch.float32)
    opts = _opts(tmp_path, ckpts, drafter=kind, drafter_path=str(ckpts[kind]), target_path=str(ckpts["target"]),
                 sequences=2)
    result = run_calibration(opts, drafter=drafter)
    spec = ScaleSpec.load(opts.out)
    assert spec.drafter.kind == kind and spec.drafter.num_layers == drafter.info.num_layers
    assert result.stats.n.max() > 64 and np.isfinite(spec.slope)
    assert set(result.stats.layer.tolist()) == set(range(drafter.info.num_layers))


def test_every_kind_packs_with_eos_and_loads_its_target_on_demand(ckpts):
    """One packing rule: every adapter joins documents with its tokenizer's EOS (<eos> = 256 here)."""
    cpu, target = torch.device("cpu"), str(ckpts["target"])
    drafters = {kind: load_drafter(kind, str(ckpts[kind]), target, cpu, torch.float32)
                for kind in ("pard", "eagle3", "dflash")}
    assert {kind: d.eos_token_id for kind, d in drafters.items()} == {"pard": 256, "eagle3": 256, "dflash": 256}
    assert drafters["pard"].target.config.num_hidden_layers == 8  # the --target-path model, loaded when asked for
    with pytest.raises(UserError, match="--target-path /no/such/dir: no such file or folder"):
        load_drafter("eagle3", str(ckpts["eagle3"]), "/no/such/dir", cpu, torch.float32)


def test_every_registered_kind_has_an_adapter():
    for name, kind in KINDS.items():
        module = importlib.import_module(f"calibrate.drafters.{kind.module}")
        assert callable(module.load), name
    assert kind_names(evaluates=True) == ["hf", "pard", "eagle3", "dflash"]


def _corrupt(src: Path, dst: Path, how: str) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(dst / "model.safetensors")
    if how == "missing":
        del state["model.layers.1.mlp.up_proj.weight"]
    else:
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("how,match", [
    ("missing", "the checkpoint lacks weight model.layers.1.mlp.up_proj.weight"),
    ("shape", r"weight model.layers.0.self_attn.k_proj.weight has shape \[7, 64\], the config expects \[32, 64\]"),
])
def test_malformed_checkpoint_is_one_clear_line(tmp_path, ckpts, how, match):
    bad = _corrupt(ckpts["pard"], tmp_path / how, how)
    with pytest.raises(UserError, match=match):
        run_calibration(_opts(tmp_path, ckpts, drafter_path=str(bad)))
    if how != "missing":
        return  # one subprocess run is enough to check the console script's one-line error
    proc = subprocess.run([SHARPDRAFT, "calibrate", "--drafter", "pard", "--drafter-path", str(bad), "--out",
                           str(tmp_path / "x.json"), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --drafter-path") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("kw,match", [
    (dict(n_ref=256), "--n-ref 256 >= --max-length 256: no rows beyond n_ref"),
    (dict(drafter_path="/no/such/dir"), "no such file or folder"),
    (dict(corpus="/no/such/corpus.txt"), "--corpus /no/such/corpus.txt: no such file or folder"),
    (dict(top_k=0), "--top-k 0"),
    (dict(drafter="medusa"), "--drafter medusa: expected one of hf, pard, eagle3, dflash"),
    (dict(law="qwen-logn"), "--law qwen-logn: calibration writes one of log-linear, tabulated"),
    (dict(law="tabulated", estimator="gaussian"), "--estimator gaussian with --law tabulated"),
    (dict(max_n=4096), "--max-n 4096: only --law tabulated"),
    (dict(law="tabulated", max_n=64), r"--max-n 64: expected more than n_ref=64"),
    (dict(law="tabulated", max_n=2**32 + 1), r"--max-n 4294967297: .* at most 2\^32"),
])
def test_user_errors(tmp_path, ckpts, kw, match):
    with pytest.raises(UserError, match=match):
        run_calibration(_opts(tmp_path, ckpts, **kw))


def test_empty_corpus(tmp_path, ckpts):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="holds no text"):
        run_calibration(_opts(tmp_path, ckpts, corpus=str(tmp_path / "empty.txt")))


class _StopAfter:
    """Progress that interrupts the run after ``n`` sequences, as Ctrl-C would."""

    def __init__(self, n):
        self.n = n

    def start(self, total, done, tokens_per_sequence):
        self.left = self.n

    def advance(self, tokens, rows):
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, ckpts):
    whole = run_calibration(_opts(tmp_path, ckpts, out=tmp_path / "whole.json", sequences=4)).spec
    opts = _opts(tmp_path, ckpts, out=tmp_path / "resumed.json", sequences=4)
    with pytest.raises(KeyboardInterrupt):
        run_calibration(opts, progress=_StopAfter(2))
    assert sorted(p.name for p in partial_dir(opts.out).glob("seq-*.npz")) == ["seq-00000.npz", "seq-00001.npz"]
    with pytest.raises(UserError, match="holds an interrupted run: pass --resume"):
        run_calibration(opts)
    with pytest.raises(UserError, match="--resume: max_length does not match the interrupted run"):
        run_calibration(replace(opts, resume=True, max_length=512))
    result = run_calibration(replace(opts, resume=True))
    assert result.resumed == 2
    assert opts.out.read_text() == (tmp_path / "whole.json").read_text()
    assert result.spec == whole


def test_cli_calibrates_and_prints_the_summary(tmp_path, ckpts):
    out = tmp_path / ("a-folder-name-long-enough-that-the-path-passes-80-columns-" * 2) / "cli.json"
    out.parent.mkdir()
    res = CliRunner().invoke(app, ["calibrate", "--drafter", "pard", "--drafter-path", str(ckpts["pard"]),
                                   "--n-ref", "64", "--max-length", "256", "--sequences", "2", "--device", "cpu",
                                   "--out", str(out)], terminal_width=200)
    assert res.exit_code == 0, res.output
    for text in ("mean top-4 mass", "fitted alpha", "mass-matching", "closed-form", "gaussian", "95% interval",
                 "tokens/s", str(out)):  # the path whole on one line, however wide the terminal
        assert text in res.output
    assert ScaleSpec.load(out).calibration.sequences == 2


def test_killed_process_resumes_to_the_same_spec(tmp_path, ckpts):
    args = ["calibrate", "--drafter", "pard", "--drafter-path", str(ckpts["pard"]), "--n-ref", "64",
            "--max-length", "512", "--sequences", "10", "--device", "cpu"]
    killed = tmp_path / "killed.json"
    proc = subprocess.Popen([SHARPDRAFT, *args, "--out", str(killed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    partial = partial_dir(killed)
    deadline = time.monotonic() + 120
    while len(list(partial.glob("seq-*.npz"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(partial.glob("seq-*.npz")))
    assert not killed.exists() and 2 <= done < 10, "the run was not killed half-way"
    resumed = CliRunner().invoke(app, [*args, "--out", str(killed), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert f"({done} resumed)" in resumed.output.replace("\n", " ")
    whole = tmp_path / "whole.json"
    assert CliRunner().invoke(app, [*args, "--out", str(whole)]).exit_code == 0
    assert killed.read_text() == whole.read_text()
