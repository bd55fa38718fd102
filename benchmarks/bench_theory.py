"""Throughput of the vectorised math: alpha(n) evaluations and Gaussian exact corrections per second.

Run: ``python benchmarks/bench_theory.py``. Targets on a 2-core CPU: >= 1e7 alpha(n) per second,
>= 1e5 Gaussian exact corrections per second. Prints the best of several repeats.
"""

from __future__ import annotations

import time

import numpy as np

from sharpdraft_theory import Gaussian, alpha_law, exact_alpha


def best_rate(fn, items: int, repeats: int = 7) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return items / best


def main() -> None:
    rng = np.random.default_rng(0)
    n = rng.integers(1, 1 << 20, size=1_000_000)
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    lengths = rng.integers(512, 1 << 24, size=1_000_000)
    rows = [
        ("alpha(n), log-linear", best_rate(lambda: alpha_law("log-linear", n, n_ref=512, slope=0.2, alpha_max=4.0),
                                            n.size), 1e7),
        ("alpha(n), qwen-logn", best_rate(lambda: alpha_law("qwen-logn", n, n_ref=512), n.size), 1e7),
        ("Gaussian exact corrections", best_rate(lambda: exact_alpha(model, lengths, 512), lengths.size), 1e5),
    ]
    print(f"{'quantity':32s} {'per second':>14s} {'target':>10s}  met")
    for name, rate, target in rows:
        print(f"{name:32s} {rate:14.3e} {target:10.0e}  {'yes' if rate >= target else 'NO'}")


if __name__ == "__main__":
    main()
