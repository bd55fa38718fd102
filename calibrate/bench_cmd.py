"""``sharpdraft bench``: a thin typer command over ``calibrate.bench.run_bench``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .bench import DEFAULT_VARIANTS, BenchOptions, plot_result, report_tables, run_bench
from .drafters import DEFAULT_DRAFTERS, kind_names
from .eval import flags
from .workloads import BUILTIN

__all__ = ["bench"]

console = Console()


def bench(
    *,
    out: Annotated[Path, typer.Option("--out", help="Where to write the result (JSON).")],
    drafter: Annotated[str, typer.Option(help=f"Drafter kind: {', '.join(kind_names(evaluates=True))}.")] = "eagle3",
    drafter_path: Annotated[Optional[str], typer.Option("--drafter-path", help="Drafter checkpoint, or a folder with a "
                                              f"copy_pointer.json naming one (default: {DEFAULT_DRAFTERS}).")] = None,
    pointer_unmatched: flags.PointerUnmatched = None,
    target_path: Annotated[Optional[str], typer.Option("--target-path", help="Target model folder (default: the "
                                                                             "built-in SmolLM2).")] = None,
    spec: Annotated[Optional[Path], typer.Option(help="Scale spec for the spec arm (sharpdraft calibrate --out).")]
        = None,
    workload: Annotated[str, typer.Option(help=f"Built-in workload ({', '.join(BUILTIN)}) or a .jsonl file, "
                                               "optionally :train, :heldout or :all (default split: heldout).")]
        = "diary",
    prompts: Annotated[int, typer.Option(help="Prompts to decode (the first N of the split).")] = 2,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens to generate per prompt at most (fewer "
                                                                 "where the target ends).")] = 2048,
    min_new_tokens: Annotated[int, typer.Option("--min-new-tokens", help="Bar the target's end-of-sequence token "
                                                "until this many tokens are written (0: the target ends where it "
                                                "would; as sharpdraft generate's).")] = 0,
    variants: Annotated[str, typer.Option(help="Comma-separated arms, as sharpdraft eval names them (none, spec, "
                                               "window, sinks, qwen-logn, clamp, clamp+spec, ..., lookup, "
                                               "lookup+head, online-full, online-lora, online-full+spec, "
                                               "online-lora+spec).")] = ",".join(DEFAULT_VARIANTS),
    window: Annotated[Optional[int], typer.Option(help="The window arm's W (default: the drafter's n_ref).")] = None,
    num_draft: Annotated[Optional[int], typer.Option("--num-draft", help="Drafts per verification (default: 4; a "
                                                                         "block drafter's block size - 1).")] = None,
    bin_size: Annotated[int, typer.Option("--bin-size", help="Output tokens per bin of the by-position report.")]
        = 512,
    temperature: Annotated[float, typer.Option(help="0: greedy (outputs checked equal to target-only); else "
                                                    "speculative sampling at this temperature.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed (paired: every arm of a prompt shares its stream).")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: torch's).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run with the same options.")]
        = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of tables.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Also plot acceptance against output position (PNG).")] = None,
    online_every: Annotated[Optional[int], typer.Option(
        "--online-every", help="Online arms: period T, generated rows learnt from per update (default 64).")] = None,
    online_steps: flags.OnlineSteps = None,
    online_lr: Annotated[Optional[float], typer.Option(
        "--online-lr", help="Online arms: AdamW learning rate (default 1e-4 for online-full, 1e-2 for online-lora: a "
                            "generation gives LoRA too few updates to move at eval's 1e-3).")] = None,
    online_rank: flags.OnlineRank = None,
) -> None:
    """Speculative decoding through long generations: acceptance by output position, the fade, the speedup."""
    opts = BenchOptions(out=out, drafter=drafter, drafter_path=drafter_path, pointer_unmatched=pointer_unmatched,
                        target_path=target_path, spec=spec,
                        workload=workload, prompts=prompts, new_tokens=new_tokens,
                        min_new_tokens=min_new_tokens,
                        variants=tuple(v.strip() for v in variants.split(",") if v.strip()), window=window,
                        num_draft=num_draft, bin_size=bin_size, temperature=temperature, seed=seed, threads=threads,
                        plot=plot, resume=resume, online_every=online_every, online_steps=online_steps,
                        online_lr=online_lr, online_rank=online_rank)
    total = len(opts.check().prompts)  # every bad value refused before any model loads
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("loading", total=total)
        started = []

        def progress(message: str) -> None:
            bar.update(task, description=f"decoding {message}", completed=len(started))
            started.append(message)

        result = run_bench(opts, progress=progress)
    if as_json:
        print(json.dumps({k: v for k, v in result.items() if k != "units"}, indent=1))
    else:
        for table in report_tables(result):
            console.print(table)
        console.print(f"result: {out}")
    if plot is not None:
        plot_result(result, plot)
