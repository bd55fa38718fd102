"""Calibration cost against plain forward passes over the same tokens, in one run, as ratios.

For each corpus sequence the script runs, alternately (so both see the same machine load):

* **plain**: the drafter's forward over the sequence exactly as calibration runs it (the base
  model, no ``lm_head``, ``use_cache=False``), with no tap;
* **calibrate**: the same forward through the ``sharpdraft-tap`` attention function with a
  ``RowCollector`` (rows on the log n grid, all layers and heads, reduced to statistics and
  moved to host memory), i.e. everything ``sharpdraft calibrate`` does per sequence except
  writing the ``.npz`` (timed separately, with the fit, at the end).

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` per pass (peak above what was allocated
before the pass, and the total peak including weights). On CPU there is no allocator peak
counter, so a thread samples the process RSS every millisecond (psutil) during each pass;
reported are the peak RSS above the RSS before the pass, and the total peak RSS. So that RSS
follows live memory, the script re-runs itself with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then
maps every block over 64 KiB on its own and unmaps it when freed (by default it raises that
threshold as large blocks are freed, keeping freed memory in its heap and RSS). Sampling can
miss spikes shorter than a millisecond; both modes are sampled the same way. Both modes run once
untimed at full length first, so the figures are steady-state, not the allocator's first growth.

On a machine shared with other work, load that comes and goes moves the totals; the median of
the per-sequence ratios (each sequence's two passes run back to back) moves less, and both are
printed, with the ratio of process CPU time (which waiting for a core does not inflate; with one
thread it is the work ratio itself).

With ``--select`` (drafters with a teacher-forced pass: eagle3, hf and pard with a target) it
measures ``calibrate --select`` instead: at each of ``--select-lengths`` (default 1,024 and 2,048
tokens) the whole calibration as the command runs it (``calibrate.run.run_calibration``: collect,
fit, select, write), and prints the selection's time over the collection's, the ratio the command's
summary prints, for every length in one run. A short calibration runs first, untimed, so the figures
are not the first call's (compiled kernels loaded, allocator grown).

    python benchmarks/bench_calibrate.py --max-length 2048 --sequences 3
    python benchmarks/bench_calibrate.py --drafter eagle3 --corpus stdlib --sequences 6 --select --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import psutil
import torch

from calibrate.collect import RowCollector, log_grid
from calibrate.corpus import pack
from calibrate.drafters import load_drafter, resolve_device, resolve_dtype
from sharpdraft_theory.estimators import fit_slopes
from sharpdraft_theory.stats import DISTANCE_ALPHAS, RowStats


class PeakMemory:
    """Peak memory of a block, above the level at its start, and the absolute peak (bytes)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.extra = self.total = 0
        self.sampler_cpu = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        started = time.thread_time()
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)
        self.sampler_cpu = time.thread_time() - started  # left out of the pass's CPU time

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.total = torch.cuda.max_memory_allocated(self.device)
        else:
            self.running = False
            self.thread.join()
            self.total = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.total - self.base


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="hf")
    ap.add_argument("--drafter-path")
    ap.add_argument("--target-path")
    ap.add_argument("--corpus", default="pydoc")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--sequences", type=int, default=3)
    ap.add_argument("--n-ref", type=int, help="for the fit at the end and the budget's window (default max_length / 4)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--distance-profile", action="store_true",
                    help="also collect the distance profile, as calibrate does when it writes --stats")
    ap.add_argument("--attention-budget", action="store_true",
                    help="also collect the attention budget (window n_ref), as calibrate does when it writes --stats")
    ap.add_argument("--select", action="store_true",
                    help="instead, time calibrate --select against its collection at each of --select-lengths")
    ap.add_argument("--select-lengths", default="1024,2048", help="--select: tokens per sequence, comma-separated")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n_ref = args.n_ref or (256 if args.drafter == "eagle3" and args.drafter_path is None else args.max_length // 4)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    started = time.perf_counter()
    drafter = load_drafter(args.drafter, args.drafter_path, args.target_path, device, dtype)
    print(f"loaded {args.drafter} drafter in {time.perf_counter() - started:.1f} s on {device} ({dtype}); "
          f"torch threads {torch.get_num_threads()}")
    if args.select:
        _select(drafter, args, [int(x) for x in args.select_lengths.split(",")])
        return
    sequences = list(pack(args.corpus, drafter.tokenize, drafter.eos_token_id, args.max_length, limit=args.sequences))
    grid = log_grid(args.max_length)
    collector = RowCollector(grid, chunk=args.chunk, distance_alphas=DISTANCE_ALPHAS if args.distance_profile else None,
                             budget_window=n_ref if args.attention_budget else None)
    positions = torch.as_tensor(grid - 1)

    def plain(ids):
        drafter.collect(ids, lambda *a: None, positions)  # tap that keeps nothing: a pure forward
    plain_forward = getattr(drafter, "model", None)
    if plain_forward is not None:  # hf / pard: the very same call without any attention hook
        def plain(ids):  # noqa: F811
            with torch.no_grad():
                plain_forward.base_model(input_ids=ids.to(drafter.device), use_cache=False)

    def calibrate(ids, seq):
        collector.start(seq)
        drafter.collect(ids, collector, positions)
        return collector.take()

    # Warm up both modes at full length: first calls grow the allocator's pools once.
    warm = torch.tensor([sequences[0]])
    plain(warm)
    calibrate(warm, 0)

    times = {"plain": 0.0, "calibrate": 0.0}
    cpu = {"plain": 0.0, "calibrate": 0.0}  # process CPU time, all threads
    pair = {}  # this sequence's time in each mode
    ratios = []  # per sequence: calibrate / plain, the two passes run back to back
    extra = {"plain": 0, "calibrate": 0}
    total = {"plain": 0, "calibrate": 0}
    parts = []
    for i, seq in enumerate(sequences):
        ids = torch.tensor([seq])
        for mode in ("plain", "calibrate"):
            c0 = time.process_time()  # the sampler thread runs inside [c0, c1]: its CPU time is taken out
            with PeakMemory(device) as mem:
                t0 = time.perf_counter()
                if mode == "plain":
                    plain(ids)
                else:
                    parts.append(calibrate(ids, i))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
            cpu[mode] += time.process_time() - c0 - mem.sampler_cpu
            times[mode] += dt
            pair[mode] = dt
            extra[mode] = max(extra[mode], mem.extra)
            total[mode] = max(total[mode], mem.total)
            print(f"  sequence {i} {mode:>9}: {dt:7.2f} s, peak +{mem.extra / 2**20:7.1f} MiB "
                  f"(total {mem.total / 2**20:7.1f} MiB)", flush=True)
        ratios.append(pair["calibrate"] / pair["plain"])

    t0 = time.perf_counter()
    stats = RowStats.concat(parts)
    stats.save("/tmp/sharpdraft-bench-stats.npz")
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fit = fit_slopes(stats, n_ref=n_ref, top_k=4)
    fit_s = time.perf_counter() - t0

    tokens = len(sequences) * args.max_length
    print(f"\n{len(sequences)} sequences x {args.max_length} tokens, {stats.rows:,} rows, device {device}")
    for mode in ("plain", "calibrate"):
        print(f"{mode:>9}: {times[mode]:8.2f} s  {tokens / times[mode]:8.0f} tokens/s  "
              f"peak +{extra[mode] / 2**20:8.1f} MiB  total peak {total[mode] / 2**20:8.1f} MiB")
    print(f"time ratio (calibrate / plain):            {times['calibrate'] / times['plain']:.3f}")
    print(f"time ratio, median of the sequences':      {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}..{max(ratios):.3f}; less exposed to other load)")
    print(f"CPU time ratio (all threads of the process): {cpu['calibrate'] / cpu['plain']:.3f} "
          f"(time on a core rather than waiting for one; not the same measure with several threads)")
    print(f"peak memory ratio, above the loaded model: {extra['calibrate'] / max(extra['plain'], 1):.3f}")
    print(f"peak memory ratio, total:                  {total['calibrate'] / max(total['plain'], 1):.3f}")
    print(f"(not in the ratios: saving statistics {save_s:.2f} s, fit {fit_s:.2f} s; "
          f"mass-matching slope {fit.slopes['mass-matching']:.4f} at n_ref {n_ref})")


def _select(drafter, args, lengths: list[int]) -> None:
    """calibrate --select's cost at each of ``lengths``: the whole calibration as the command runs it, its
    selection's seconds over its collection's (``result.seconds``, what the summary divides by)."""
    import tempfile
    from pathlib import Path

    from calibrate.run import CalibrateOptions, run_calibration

    def calibrate(folder: Path, sequences: int, max_length: int | None):
        opts = CalibrateOptions(out=folder / f"select-{max_length}.json", drafter=args.drafter,
                                drafter_path=args.drafter_path, target_path=args.target_path, corpus=args.corpus,
                                max_length=max_length, sequences=sequences, n_ref=args.n_ref, device=args.device,
                                dtype=args.dtype, chunk=args.chunk, select=True)
        return run_calibration(opts, drafter=drafter)

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        warm = calibrate(Path(folder), 1, None)  # untimed: the first call's costs (compiled kernels, allocator)
        print(f"warm-up: 1 sequence of {warm.spec.calibration.max_length} tokens")
        for length in lengths:
            result = calibrate(Path(folder), args.sequences, length)
            record = result.selection
            rows.append((length, result.spec.calibration.sequences, len(record["candidates"]) - 1, result.seconds,
                         record["seconds"], record["chosen"]))
            print(f"  {length:>6} tokens: collection {result.seconds:7.1f} s, selection {record['seconds']:7.1f} s "
                  f"({record['seconds'] / result.seconds:.2f} x), chose {record['chosen']}", flush=True)
    print(f"\ncalibrate --select, {args.drafter} drafter on {args.corpus}, torch threads {torch.get_num_threads()}:")
    print(f"{'tokens':>8} {'sequences':>9} {'candidates':>10} {'collection s':>12} {'selection s':>11} "
          f"{'selection / collection':>22}  chosen")
    for length, sequences, arms, collection_s, select_s, chosen in rows:
        print(f"{length:>8} {sequences:>9} {arms:>10} {collection_s:>12.1f} {select_s:>11.1f} "
              f"{select_s / collection_s:>22.2f}  {chosen}")


if __name__ == "__main__":
    main()
