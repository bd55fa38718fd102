"""``sharpdraft eval --plot``: mass, agreement and acceptance length versus context length, per variant."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_result"]


def plot_result(result: dict, path: Path) -> None:
    """Mass, agreement and (with acceptance) acceptance length versus n (log x), one line per variant,
    agreement and acceptance with their 95% bootstrap bands over sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mass", f"mean top-{result['top_k']} attention mass"), ("agreement", "teacher-forced top-1 agreement")]
    if result["speculative"] is not None:
        panels.append(("acceptance_length", "acceptance length (tokens per target forward)"))

    from .style import save_figure

    n = [row["n"] for row in result["buckets"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    styles = ("o-", "s-", "^--", "v-.", "D:", "*-")
    for ax, (key, label) in zip(axes, panels):
        for variant, style in zip(result["variants"], styles):
            cells = [row[variant] for row in result["buckets"]]
            line, = ax.plot(n, [_nan(c.get(key)) for c in cells], style, label=variant)
            bands = [c.get(f"{key}_interval") for c in cells]
            if any(b is not None for b in bands):
                ax.fill_between(n, [_nan(b and b[0]) for b in bands], [_nan(b and b[1]) for b in bands],
                                color=line.get_color(), alpha=0.15, lw=0)
        ax.axvline(result["drafter"]["n_ref"], color="grey", lw=0.8, ls=":", label="n_ref")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context n (bucket upper edge)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['drafter']['kind']} drafter on {result['corpus']} ({result['sequences']} sequences; "
                 "bands: 95% bootstrap over sequences)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)  # atomically: an interrupted run leaves no half-written PNG
    plt.close(fig)


def _nan(x):
    return float("nan") if x is None else x
