"""The options of ``sharpdraft eval`` as the command declares them: type, flag and help text.

One ``Annotated`` type per option, named after it (``--top-k`` is :data:`TopK`); ``calibrate.eval_cmd``
gives each its default, and ``calibrate.eval.options.EvalOptions`` holds and checks the values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..drafters import DEFAULT_DRAFTERS, kind_names

Drafter = Annotated[str, typer.Option(help=f"Drafter kind: {', '.join(kind_names(evaluates=True))}.")]
DrafterPath = Annotated[Optional[str], typer.Option(
    "--drafter-path", help="Drafter checkpoint, or a folder with a copy_pointer.json naming one (default: "
                           f"{DEFAULT_DRAFTERS}).")]
PointerUnmatched = Annotated[Optional[str], typer.Option(
    "--pointer-unmatched", help="With a drafter that has a copy pointer: how its rows that match nothing count, "
                                "scored (a key of logit 0, which dilutes the pointer as the context grows) or masked "
                                "(no key: prompt lookup's rule); the pointer's other numbers as its file has them "
                                "(default: as the file says).")]
TargetPath = Annotated[Optional[str], typer.Option(
    "--target-path", help="Target model folder (default: built-in SmolLM2).")]
Spec = Annotated[Optional[Path], typer.Option(help="Scale spec JSON to evaluate (default: log-linear, slope 0.2, "
                                                   "at the drafter's n_ref).")]
ExtraSpec = Annotated[Optional[list[str]], typer.Option(
    "--extra-spec", help="Another spec measured on the same passes, as NAME=FILE (repeatable; the variant "
                         "spec:NAME): e.g. --extra-spec layer=spec-layer.json --extra-spec head=spec-head.json "
                         "pairs per-layer and per-head specs with the global --spec on one target pass.")]
Lengths = Annotated[str, typer.Option(help="Context-length bucket edges; the largest is the sequence length.")]
Corpus = Annotated[str, typer.Option(help="Held-out text: pydoc:heldout, stdlib:heldout, a .txt or .jsonl file, "
                                          "or a folder; recall:SOURCE (e.g. recall:stdlib:heldout) for SOURCE's text "
                                          "with passages repeated at set distances, reporting copy agreement; "
                                          "generated:NAME[:SPLIT] (the target's own text: diary, math, science, "
                                          "diary-long:heldout to 8,176 tokens, NAME-greedy, or a `sharpdraft "
                                          "generate` folder), also reported by "
                                          "output position.")]
BinSize = Annotated[Optional[int], typer.Option(
    "--bin-size", help="On a generated corpus: output tokens per bin of the by-output-position report (default 512).")]
Sequences = Annotated[Optional[int], typer.Option(help="At most this many sequences of the largest length "
                                                       "(default: all the corpus holds).")]
Skip = Annotated[int, typer.Option(help="Sequences of the corpus to pass over first.")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Top set size for the mass (default: the spec's).")]
Speculative = Annotated[bool, typer.Option("--speculative", help="Also run speculative decoding (greedy unless "
                                                                 "--sample): acceptance length and speedup.")]
Sample = Annotated[bool, typer.Option(
    "--sample", help="With --speculative: speculative sampling at --temperature (rejection-sampling verification; "
                     "the output follows the target's distribution) instead of greedy decoding.")]
Seed = Annotated[Optional[int], typer.Option(help="With --sample: the random seed (default 0); each prompt's runs "
                                                  "draw from a stream seeded by it and the prompt, the same for every "
                                                  "variant.")]
NewTokens = Annotated[int, typer.Option("--new-tokens", help="Tokens generated per speculative prompt.")]
NumDraft = Annotated[Optional[int], typer.Option(
    "--num-draft", help="Drafts per verification K (default: 4 for chains; block size - 1 for dflash).")]
Variants = Annotated[str, typer.Option(help="Variants to compare, comma-separated: none, spec, qwen-logn, window, "
                                            "sinks, clamp, group, pi, clamp+spec, group+spec, pi+spec, lookup "
                                            "(prompt lookup), lookup+head (lookup, else the drafter), reference, "
                                            "online-full, online-lora, online-full+spec, online-lora+spec "
                                            "(none is always run; lookup too on a recall corpus).")]
LookupMaxNgram = Annotated[int, typer.Option(
    "--lookup-max-ngram", help="The lookup variants' longest suffix matched against the context "
                               "(transformers' max_matching_ngram_size, default 2).")]
LookupMinNgram = Annotated[int, typer.Option(
    "--lookup-min-ngram", help="The lookup variants' shortest suffix matched (default 1).")]
Window = Annotated[Optional[int], typer.Option(help="The window variant's W: the drafter attends to its last W "
                                                    "keys (default: its n_ref).")]
Sinks = Annotated[int, typer.Option(help="The sinks variant's S: the first S keys plus the last W - S.")]
NeighbourWindow = Annotated[Optional[int], typer.Option(
    "--neighbour-window", help="W of the clamp and group variants: the last W keys keep their positions "
                               "(default: n_ref - 1 for clamp, n_ref // 2 for group; below n_ref).")]
Group = Annotated[Optional[int], typer.Option(
    "--group", help="G of the group variants (Self-Extend's group size; default: the least G >= 2 that keeps "
                    "every grouped distance below n_ref up to the longest length).")]
NRef = Annotated[Optional[int], typer.Option(
    "--n-ref", help="The drafter's training length: where qwen-logn starts, the window's default W and the "
                    "default spec's n_ref (default: the drafter's, from its training record or config; a "
                    "checkpoint's max_position_embeddings can be its target's context, not its training "
                    "length).")]
ReferenceDrafterPath = Annotated[Optional[str], typer.Option(
    "--reference-drafter-path", help="Another head of the same kind (e.g. long-trained), run unscaled as the "
                                     "variant 'reference'.")]
Temperature = Annotated[float, typer.Option(
    help="Temperature T, 0.01 to 100: of the expected acceptance sum_x min(p_T, q_T) (the chance "
         "speculative sampling at T accepts a drafted token, reported beside greedy agreement), and of the "
         "draws with --sample.")]
Slopes = Annotated[Optional[str], typer.Option(
    help="Oracle: log-linear slopes to try on the same rows, comma-separated (e.g. 0.05,0.1,0.2,0.4); "
         "teacher-forced only, ranked by agreement gain past n_ref.")]
Alphas = Annotated[Optional[str], typer.Option(
    help="Oracle: constant query scales past n_ref to try (e.g. 0.9,1.1,1.25), as --slopes.")]
OnlineEvery = Annotated[Optional[int], typer.Option(
    "--online-every", help="Online arms: rows per chunk M; each chunk is scored, then learnt from "
                           "(default 64).")]
OnlineSteps = Annotated[Optional[int], typer.Option(
    "--online-steps", help="Online arms: AdamW steps G on each chunk after it is scored (default 1).")]
OnlineLr = Annotated[Optional[float], typer.Option(
    "--online-lr", help="Online arms: AdamW learning rate (default 1e-4 for online-full, 1e-3 for "
                        "online-lora).")]
OnlineRank = Annotated[Optional[int], typer.Option(
    "--online-rank", help="online-lora: rank r of the update B A of each attention and MLP projection "
                          "(default 8).")]
OnlineCarry = Annotated[bool, typer.Option(
    "--online-carry", help="Online arms: keep the learnt weights from one sequence to the next (default: "
                           "each sequence starts from the checkpoint).")]
Resume = Annotated[bool, typer.Option(
    "--resume", help="Continue an interrupted run: finished sequences and prompts are kept in <out>.partial "
                     "and read back (needs --out and the same options).")]
Device = Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="Weights: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16.")]
Threads = Annotated[int, typer.Option(help="CPU threads for torch (0: torch's default). On a busy machine 1 is "
                                           "often fastest: decoding one token is too little work to share.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]
Out = Annotated[Optional[Path], typer.Option(help="Also write the JSON result here (atomically).")]
Plot = Annotated[Optional[Path], typer.Option(help="Save mass and agreement versus n as a PNG here.")]
