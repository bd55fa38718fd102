"""Fault injection: kills, interrupts and a full disk never lose or corrupt a user's file.

On a tiny random PARD drafter (built here, CPU, no download) the script checks:

1. **kill -9 during calibrate, then --resume** (``--trials`` times): ``sharpdraft calibrate`` is
   started and killed with SIGKILL at a random moment of its collection: once a random number of
   sequences (0 to all) has been saved, after a further random delay of up to one sequence's
   time (so kills land in start-up, mid-sequence, mid-save, in the fit and in the spec write);
   the same command with ``--resume`` must then write a spec byte-identical to the
   uninterrupted run's. A killed run must never leave a half spec.
2. **SIGINT during eval and plot** (``--interrupts`` times each): Ctrl-C at a random moment must
   leave each output either absent or complete (valid JSON, whole PNG) and no temporary file.
3. **a failed write** (ENOSPC, simulated by making every write fail half-way): a calibration
   whose spec cannot be written exits with one line, leaves the previous spec at ``--out``
   byte-identical and no temporary file, and keeps its progress for ``--resume``.

Prints one line per trial and a summary; exits 1 if any check failed.

    python benchmarks/fault_injection.py --trials 20 --interrupts 5
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny checkpoint builders the tests use

from test_calibrate import _write_causal_lm  # noqa: E402

SHARPDRAFT = str(Path(sys.executable).with_name("sharpdraft"))
TEXT = " ".join(f"line {i}: the query sees more keys as the context grows and its attention spreads" for i in range(500))
PNG_END = b"IEND\xaeB`\x82"
SEQUENCES = 8


def _calibrate_args(work: Path) -> list[str]:
    return ["calibrate", "--drafter", "pard", "--drafter-path", str(work / "pard"), "--corpus", str(work / "corpus.txt"),
            "--n-ref", "256", "--max-length", "2048", "--sequences", str(SEQUENCES), "--device", "cpu"]


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([SHARPDRAFT, *args], capture_output=True, text=True, timeout=600, **kw)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.tmp*"))


def kill_and_resume(work: Path, trials: int, rng: random.Random) -> list[bool]:
    reference = work / "reference.json"
    began = time.perf_counter()
    done = _run([*_calibrate_args(work), "--out", str(reference)])
    span = time.perf_counter() - began
    assert done.returncode == 0, done.stderr
    expected = reference.read_bytes()
    print(f"reference calibration: {span:.1f} s")
    results = []
    for trial in range(trials):
        out = work / f"killed-{trial}.json"
        partial = out.with_name(out.name + ".partial")
        after = rng.randint(0, SEQUENCES)
        proc = subprocess.Popen([SHARPDRAFT, *_calibrate_args(work), "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        began, first = time.perf_counter(), None
        while (saved := len(list(partial.glob("seq-*.npz")))) < after and proc.poll() is None:
            if saved and first is None:
                first = time.perf_counter()
            time.sleep(0.002)
        if after >= 2 and first is not None:  # the time one sequence takes, start-up excluded
            per_sequence = (time.perf_counter() - first) / (after - 1)
        else:
            per_sequence = 0.1
        time.sleep(rng.uniform(0.0, per_sequence))
        at = time.perf_counter() - began
        alive = proc.poll() is None  # a kill that lands after the run ended tests nothing
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saved = len(list(partial.glob("seq-*.npz")))
        written = out.exists()
        half = written and out.read_bytes() != expected  # a spec written but not whole
        resumed = _run([*_calibrate_args(work), "--out", str(out), "--resume"])
        same = resumed.returncode == 0 and out.read_bytes() == expected and not partial.exists()
        ok = same and not half and not _leftovers(work) and alive
        results.append(ok)
        print(f"kill -9 at {at:5.2f} s (aimed after {after} sequences): {saved} saved, spec "
              f"{'written' if written else 'not written'} by the killed run; "
              f"resumed spec byte-identical: {same}" + ("" if alive else "; the run had ended before the kill") + ("" if ok else f"  FAILED {resumed.stderr.strip()[-200:]}"))
    return results


def _complete(path: Path) -> bool:
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
            return True
        except ValueError:
            return False
    return path.read_bytes().endswith(PNG_END)


def interrupt(work: Path, name: str, args: list[str], outputs: list[Path], trials: int,
              rng: random.Random) -> list[bool]:
    began = time.perf_counter()
    done = _run(args)
    span = time.perf_counter() - began
    assert done.returncode == 0, done.stderr
    results = []
    for trial in range(trials):
        for path in outputs:
            if path.is_file():
                path.unlink()
        at = rng.uniform(0.3 * span, span)  # past start-up, where the work and the writing are
        proc = subprocess.Popen([SHARPDRAFT, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(at)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)
        present = [p for p in outputs if p.exists()]
        ok = all(_complete(p) for p in present) and not _leftovers(outputs[0].parent) and "Traceback" not in err
        results.append(ok)
        print(f"SIGINT to {name} at {at:5.2f} s: exit {proc.returncode}, {len(present)}/{len(outputs)} output(s) "
              f"present, all complete, no temporary files: {ok}")
    return results


def full_disk(work: Path) -> bool:
    """A spec write that fails half-way (ENOSPC) leaves the previous spec intact."""
    sys.path.insert(0, str(ROOT))
    from calibrate.errors import UserError
    from calibrate.run import CalibrateOptions, partial_dir, run_calibration
    from sharpdraft_theory import atomic

    out = work / "previous.json"
    out.write_text('{"previous": "spec"}\n')
    before = out.read_bytes()
    opts = CalibrateOptions(out=out, drafter="pard", drafter_path=str(work / "pard"), corpus=str(work / "corpus.txt"),
                            n_ref=64, max_length=256, sequences=2, device="cpu", bootstrap=20)
    real = atomic.atomic_write_text

    def half_then_enospc(path, text):
        with atomic.atomic_path(path) as tmp:
            tmp.write_text(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    import sharpdraft_theory.spec as spec_module
    spec_module.atomic_write_text = half_then_enospc
    try:
        run_calibration(opts)
        message = None
    except UserError as err:
        message = str(err)
    finally:
        spec_module.atomic_write_text = real
    ok = (message is not None and "No space left" in message and out.read_bytes() == before
          and not _leftovers(work) and partial_dir(out).is_dir())
    print(f"ENOSPC while writing the spec: {message!r}; previous spec intact, progress kept: {ok}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="kill -9 trials of calibrate")
    parser.add_argument("--interrupts", type=int, default=5, help="SIGINT trials of eval and of plot")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _write_causal_lm(work / "pard", pard_token=258, spd_type="pard")
        (work / "corpus.txt").write_text(TEXT)
        killed = kill_and_resume(work, args.trials, rng)
        stats = work / "rows.npz"
        done = _run([*_calibrate_args(work), "--out", str(work / "for-plot.json"), "--stats", str(stats)])
        assert done.returncode == 0, done.stderr
        figures = work / "figures"
        plot = interrupt(work, "plot", ["plot", str(stats), "--out", str(figures)],
                         [figures / n for n in ("dilution.png", "alpha.png", "slope_heatmap.png")], args.interrupts, rng)
        result, png = work / "eval" / "result.json", work / "eval" / "result.png"
        evaluation = interrupt(work, "eval", ["eval", "--drafter", "hf", "--drafter-path", str(work / "pard"),
                                              "--target-path", str(work / "pard"), "--corpus", str(work / "corpus.txt"),
                                              "--lengths", "64,128,256", "--sequences", "2", "--device", "cpu",
                                              "--out", str(result), "--plot", str(png)],
                               [result, png], args.interrupts, rng)
        disk = full_disk(work)
    print(f"\nkill -9 then --resume, byte-identical spec: {sum(killed)}/{len(killed)}")
    print(f"SIGINT during plot, no partial output: {sum(plot)}/{len(plot)}")
    print(f"SIGINT during eval, no partial output: {sum(evaluation)}/{len(evaluation)}")
    print(f"ENOSPC while writing the spec, previous spec intact: {int(disk)}/1")
    return 0 if all(killed) and all(plot) and all(evaluation) and disk else 1


if __name__ == "__main__":
    raise SystemExit(main())
