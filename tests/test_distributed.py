"""``sharpdraft calibrate`` under torchrun: two CPU ranks (gloo) on a tiny PARD drafter.

The spec must be the one process's, byte for byte; a rank killed mid-run must leave partial
files that ``--resume`` completes, with any world size, to that same spec; an error on one rank
is printed once, by rank 0, naming the rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.distributed import Ranks
from calibrate.errors import UserError
from calibrate.run import partial_dir
from test_calibrate import _write_causal_lm

BIN = Path(sys.executable).parent
SEQUENCES = 16  # 8 per rank: enough time to kill a rank half-way


@pytest.fixture(scope="module")
def pard(tmp_path_factory):
    return _write_causal_lm(tmp_path_factory.mktemp("dist") / "pard", pard_token=258, spd_type="pard")


def _args(pard, out: Path, *extra) -> list[str]:
    return ["calibrate", "--drafter", "pard", "--drafter-path", str(pard), "--n-ref", "64", "--max-length", "512",
            "--sequences", str(SEQUENCES), "--device", "cpu", "--out", str(out), *extra]


def _torchrun(ranks: int, args: list[str], **kw):
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), str(BIN / "sharpdraft"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


@pytest.fixture(scope="module")
def one_process(pard, tmp_path_factory):
    """The spec and statistics of the same calibration in one process."""
    root = tmp_path_factory.mktemp("one")
    res = CliRunner().invoke(app, _args(pard, root / "one.json", "--stats", str(root / "one.npz")))
    assert res.exit_code == 0, res.output
    return root / "one.json", root / "one.npz"


def test_two_ranks_write_the_spec_of_one_process(pard, one_process, tmp_path):
    out, stats = tmp_path / "two.json", tmp_path / "two.npz"
    proc = _torchrun(2, _args(pard, out, "--stats", str(stats)))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert out.read_text() == one_process[0].read_text()
    with np.load(stats) as two, np.load(one_process[1]) as one:
        assert sorted(two.files) == sorted(one.files)
        for name in one.files:
            assert np.array_equal(two[name], one[name]), name
        # the distance profile and the attention budget travel with the rows: every sequence once, in order
        assert one["budget_share"].shape == (one["n"].size, 3) and one["budget_window"] == 64
        assert one["distance_seq"].tolist() == list(range(SEQUENCES)) and one["distance_weight"].any()
    assert stdout.count("Calibrating pard drafter") == 1  # rank 1 is quiet
    assert stdout.count(f"from {SEQUENCES} sequences on 2 processes") == 1
    assert "Traceback" not in stderr and not partial_dir(out).exists()


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    return None


def test_a_killed_rank_resumes_to_the_same_spec_with_any_world_size(pard, one_process, tmp_path):
    out, stats = tmp_path / "killed.json", tmp_path / "killed.npz"
    partial = partial_dir(out)
    proc = _torchrun(2, _args(pard, out, "--stats", str(stats)))
    deadline = time.monotonic() + 240
    while len(list(partial.glob("seq-*.npz"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = _rank_pid(proc, 1)
    assert pid is not None, "rank 1 was not found"
    os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    saved = sorted(int(p.stem[4:]) for p in partial.glob("seq-*.npz"))
    assert proc.returncode != 0 and not out.exists()
    assert 3 <= len(saved) < SEQUENCES, "the run was not killed half-way"

    # Three ranks now: a corrupt saved file of rank 1 (sequence 1 mod 3) stops every rank, and
    # rank 0 alone says so, naming rank 1.
    victim = next(i for i in saved if i % 3 == 1)
    (partial / f"seq-{victim:05d}.npz").write_bytes(b"not an npz")
    proc = _torchrun(3, _args(pard, out, "--stats", str(stats), "--resume"))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0 and not out.exists()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: --resume:") and f"seq-{victim:05d}" in errors[0]

    (partial / f"seq-{victim:05d}.npz").unlink()
    done = len(list(partial.glob("seq-*.npz")))  # the failed run's healthy ranks saved theirs
    proc = _torchrun(3, _args(pard, out, "--stats", str(stats), "--resume"))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert f"({done} resumed)" in " ".join(stdout.split()), stdout
    assert out.read_text() == one_process[0].read_text()  # the verdict's distance profile survived the kill
    with np.load(stats) as resumed, np.load(one_process[1]) as one:
        assert sorted(resumed.files) == sorted(one.files)
        for name in one.files:
            assert np.array_equal(resumed[name], one[name]), name
    assert not partial.exists()


def test_ranks_from_the_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert Ranks.from_environment() == Ranks(rank=0, world_size=1, local_rank=0, local_world_size=1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ranks = Ranks.from_environment()
    assert not ranks.main and [i for i in range(10) if ranks.owns(i)] == [3, 7]
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(UserError, match="RANK=4, LOCAL_RANK=1 do not fit WORLD_SIZE=4"):
        Ranks.from_environment()


@pytest.mark.parametrize("visible,local,per_node,expected", [
    ("0,1,2,3", 1, 2, "2,3"),  # two GPUs per rank: a model may spread over both
    ("4,5,6,7", 3, 4, "7"),  # one GPU per rank: the LOCAL_RANK-th of those visible
    ("0,1,2", 1, 2, "1"),  # an odd GPU is left out
])
def test_each_rank_sees_only_its_own_gpus(monkeypatch, visible, local, per_node, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    ranks = Ranks(rank=local, world_size=per_node, local_rank=local, local_world_size=per_node)
    assert ranks.device_option("auto") == "auto"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_device_choices_under_torchrun(monkeypatch):
    ranks = Ranks(rank=1, world_size=4, local_rank=1, local_world_size=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError, match="4 ranks on this node but 2 GPUs"):
        ranks.device_option("cuda")
    with pytest.raises(UserError, match="--device cuda:1: under torchrun each rank uses its own GPUs"):
        ranks.device_option("cuda:1")
    assert ranks.device_option("cpu") == "cpu" and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
