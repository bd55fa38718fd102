"""``sharpdraft eval --plot``: mass, agreement and acceptance length versus context length, per variant; on a
generated corpus also expected acceptance versus the output's position."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_result"]


def plot_result(result: dict, path: Path) -> None:
    """Mass, agreement and (with acceptance) acceptance length versus n (log x), one line per variant,
    agreement and acceptance with their 95% bootstrap bands over sequences; with output bins (an eval on a
    generated corpus) one more panel: expected acceptance per bin of output position, and the bin's copy rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mass", f"mean top-{result['top_k']} attention mass"), ("agreement", "teacher-forced top-1 agreement")]
    if result["speculative"] is not None:
        panels.append(("acceptance_length", "acceptance length (tokens per target forward)"))

    from .style import save_figure

    n = [row["n"] for row in result["buckets"]]
    bins = (result.get("output_bins") or {}).get("bins")
    width = len(panels) + bool(bins)
    fig, axes = plt.subplots(1, width, figsize=(5 * width, 4))
    styles = ("o-", "s-", "^--", "v-.", "D:", "*-")
    if bins:
        _by_output(axes[-1], result["variants"], bins, styles)
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


def _by_output(ax, variants, bins: list[dict], styles) -> None:
    """Expected acceptance against the output position (bin centres), each variant with its 95% band, and the
    share of the bin's rows a 3-gram lookup drafts right (grey): a fade told from a loop."""
    x = [(b["start"] + b["end"]) / 2 for b in bins]
    for variant, style in zip(variants, styles):
        cells = [b.get(variant) or {} for b in bins]
        line, = ax.plot(x, [_nan(c.get("expected_acceptance")) for c in cells], style, label=variant)
        bands = [c.get("expected_acceptance_interval") for c in cells]
        ax.fill_between(x, [_nan(b and b[0]) for b in bands], [_nan(b and b[1]) for b in bands],
                        color=line.get_color(), alpha=0.15, lw=0)
    ax.plot(x, [b["copy_rows_share"][0] for b in bins], color="grey", ls="--", lw=1, label="copy rows")
    ax.set_xlabel("output position (bin centre, tokens)")
    ax.set_ylabel("expected acceptance by output position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _nan(x):
    return float("nan") if x is None else x
