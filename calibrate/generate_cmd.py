"""``sharpdraft generate``: a thin typer command over ``calibrate.generate.run_generation``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .generate import GenerateOptions, run_generation
from .workloads import BUILTIN

__all__ = ["generate"]

console = Console()


def generate(
    *,
    out: Annotated[Path, typer.Option("--out", help="Folder for the run: run.json, then prompts/ID.json as each "
                                                    "prompt finishes.")],
    workload: Annotated[str, typer.Option(help=f"Built-in workload ({', '.join(BUILTIN)}) or a .jsonl file, "
                                               "optionally :train, :heldout or :all (default split: train).")]
        = "diary",
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens to generate at most per prompt (fewer when "
                                                                 "the target ends or writes the end marker).")] = 4096,
    min_new_tokens: Annotated[int, typer.Option("--min-new-tokens", help="Bar the target's end-of-sequence token "
                                                                         "until this many tokens are written (the "
                                                                         "end marker still stops).")] = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 decodes greedily.")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling: the smallest set of tokens holding this "
                                                         "much probability.")] = 0.95,
    seed: Annotated[int, typer.Option(help="Seed of the sampling (each batch seeded from it and its first prompt).")]
        = 0,
    batch: Annotated[int, typer.Option(help="Prompts decoded together.")] = 4,
    prompts: Annotated[Optional[int], typer.Option(help="Only the first N prompts of the split.")] = None,
    target_path: Annotated[Optional[str], typer.Option("--target-path", help="Target model folder (default: the "
                                                                             "built-in SmolLM2).")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: torch's).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a run in --out with the same options, "
                                                          "skipping finished prompts.")] = False,
    lengthen: Annotated[Optional[Path], typer.Option("--lengthen", help="A finished run (read only) whose "
                                                     "generations this one continues to --new-tokens, generated with "
                                                     "the same options but fewer tokens; what ended stays as it is.")]
        = None,
) -> None:
    """Write what the target generates for a workload's prompts: the corpus of its own long text."""
    opts = GenerateOptions(workload=workload, out=out, new_tokens=new_tokens, min_new_tokens=min_new_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, batch=batch, prompts=prompts, target_path=target_path, threads=threads,
                           resume=resume, lengthen=lengthen)
    total = len(opts.check().prompts)  # every bad value refused before the model loads
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("prompts", total=total)
        done = run_generation(opts, progress=lambda n, _: bar.update(task, completed=n))
    stopped = {k: sum(g.stopped == k for g in done) for k in ("end", "eos", "length")}
    tokens = sum(len(g.output_ids) for g in done)
    console.print(f"{len(done)} prompts, {tokens:,} tokens ({stopped['end']} reached the end marker, {stopped['eos']} "
                  f"ended, {stopped['length']} ran to --new-tokens) in {out}")
