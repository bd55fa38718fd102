"""``sharpdraft eval``: a thin typer command over ``calibrate.eval`` (options, run, report)."""

from __future__ import annotations

import json

from rich.console import Console

from .eval import flags

__all__ = ["eval_command"]

err_console = Console(stderr=True)


def eval_command(
    *,
    drafter: flags.Drafter = "eagle3",
    drafter_path: flags.DrafterPath = None,
    pointer_unmatched: flags.PointerUnmatched = None,
    target_path: flags.TargetPath = None,
    spec: flags.Spec = None,
    extra_spec: flags.ExtraSpec = None,
    lengths: flags.Lengths = "256,512,1024,2048",
    corpus: flags.Corpus = "pydoc:heldout",
    sequences: flags.Sequences = None,
    skip: flags.Skip = 0,
    bin_size: flags.BinSize = None,
    top_k: flags.TopK = None,
    speculative: flags.Speculative = False,
    sample: flags.Sample = False,
    seed: flags.Seed = None,
    new_tokens: flags.NewTokens = 32,
    num_draft: flags.NumDraft = None,
    variants: flags.Variants = "none,spec,qwen-logn,window,sinks",
    lookup_max_ngram: flags.LookupMaxNgram = 2,
    lookup_min_ngram: flags.LookupMinNgram = 1,
    window: flags.Window = None,
    sinks: flags.Sinks = 4,
    neighbour_window: flags.NeighbourWindow = None,
    group: flags.Group = None,
    n_ref: flags.NRef = None,
    reference_drafter_path: flags.ReferenceDrafterPath = None,
    temperature: flags.Temperature = 1.0,
    slopes: flags.Slopes = None,
    alphas: flags.Alphas = None,
    online_every: flags.OnlineEvery = None,
    online_steps: flags.OnlineSteps = None,
    online_lr: flags.OnlineLr = None,
    online_rank: flags.OnlineRank = None,
    online_carry: flags.OnlineCarry = False,
    resume: flags.Resume = False,
    device: flags.Device = "auto",
    dtype: flags.Dtype = "auto",
    threads: flags.Threads = 0,
    as_json: flags.AsJson = False,
    out: flags.Out = None,
    plot: flags.Plot = None,
):
    """Mass, agreement and (with --speculative) acceptance per context length, per variant, with paired intervals."""
    options = dict(locals())  # the command's options by name, taken before anything else is bound here
    del options["as_json"]  # how to print, not what to measure
    from .eval.options import EvalOptions
    from .eval.report import print_summary
    from .eval.run import run_eval

    opts = EvalOptions.from_cli(**options)  # every refusal of a value comes here, before any model loads
    progress = None if as_json else (lambda msg: err_console.print(f"[dim]{msg}[/]"))
    result = run_eval(opts, progress=progress)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print_summary(result)
