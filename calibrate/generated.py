"""Generated corpora: the target's own text (``sharpdraft generate`` run folders) as calibration and eval sequences.

``--corpus generated:NAME[:SPLIT]`` (calibrate, ``--select`` and eval):

``NAME``
    ``diary``, ``math`` or ``science``: the shipped corpus of the built-in target sampled at temperature 0.8
    (``calibrate/assets/generated/NAME-sampled/``; ``NAME-sampled`` names it too), ``NAME-greedy`` its greedy
    one, ``NAME-long`` its held-out prompts sampled to the end of the target's context; or the path of a run
    folder written by ``sharpdraft generate``.
``SPLIT``
    ``train`` (default), ``heldout`` or ``all``: the prompts' split in their workload file. A shipped corpus
    takes it from the built-in workload of its name. A run folder takes it from the workload file its
    ``run.json`` records when that file exists, else from the built-in workload of the recorded name (when
    it holds every recorded prompt), else every prompt counts as ``train``.

A sequence is one prompt's generation, ``prompt_ids + output_ids``, token ids as written (nothing is
tokenized again), cut to the requested length; its row ``t`` is at output position ``t - len(prompt_ids)``.
Generations shorter than the requested length are left out, as packing drops a tail shorter than a
sequence (:func:`calibrate.corpus.pack`): sequences are never padded, and two generations are never
joined into one, which would give the second one's tokens no output position. Only finished prompt files
are read (:func:`calibrate.generate.read_generations`).

Refused in one line: an unknown name, a folder that is not a run, a split with no finished generation,
lengths no generation reaches, and a corpus whose tokenizer is not the target's (``run.json``'s identity,
:func:`calibrate.generate.tokenizer_identity`), the last before any weights load where the target's
tokenizer is read alone (:func:`target_tokenizer`), else as soon as the drafter loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UserError

__all__ = ["COPY_ORDER", "GENERATED", "SHIPPED", "GeneratedCorpus", "GeneratedSequence", "check_tokenizer", "copied_tokens",
           "generated_sequences", "is_generated", "read_corpus", "shipped_path", "target_tokenizer"]

GENERATED = "generated:"  # prefix of a generated source: generated:NAME[:SPLIT]
SPLITS = ("train", "heldout", "all")
SHIPPED_KINDS = ("", "-sampled", "-greedy", "-long")  # a shipped corpus's name: a workload's, then one of these
SHIPPED = tuple(f"{w}{kind}" for w in ("diary", "math", "science") for kind in SHIPPED_KINDS)
COPY_ORDER = 3  # a copy row: a 3-gram prompt lookup over the text before it drafts its token right


def is_generated(source: str) -> bool:
    """Whether ``source`` names a generated corpus (``generated:NAME[:SPLIT]``)."""
    return source.startswith(GENERATED)


def shipped_path(name: str) -> Path:
    """The run folder of the shipped corpus ``name`` (``diary`` is ``diary-sampled``)."""
    folder = name if name.endswith(SHIPPED_KINDS[1:]) else f"{name}-sampled"
    return Path(__file__).parent / "assets" / "generated" / folder


@dataclass(frozen=True)
class GeneratedSequence:
    """One generation as a sequence: ``ids`` (prompt then output, cut to the length asked) and its prompt's length."""

    id: str
    ids: list[int]
    prompt_length: int


@dataclass(frozen=True)
class GeneratedCorpus:
    """The finished generations of one split of a run folder, in the run's prompt order."""

    source: str
    folder: Path
    split: str
    tokenizer: str | None  # the identity run.json records
    generations: list  # calibrate.generate.Generation

    def to_dict(self) -> dict:
        """What an eval result records of the corpus."""
        return {"folder": str(self.folder), "split": self.split, "tokenizer": self.tokenizer,
                "ids": [g.id for g in self.generations]}


def _parse(source: str) -> tuple[str, str]:
    """``(NAME, SPLIT)`` of ``generated:NAME[:SPLIT]``."""
    name, split = source[len(GENERATED):], "train"
    head, sep, tail = name.rpartition(":")
    if sep and tail in SPLITS:
        name, split = head, tail
    elif sep and head and not Path(name).expanduser().exists() and ("/" not in tail):
        raise UserError(f"--corpus {source}: unknown split {tail!r}; use one of {', '.join(SPLITS)}")
    if not name:
        raise UserError(f"--corpus {source}: expected generated:NAME[:SPLIT], NAME one of {', '.join(SHIPPED)} "
                        "or a run folder of `sharpdraft generate`")
    return name, split


def read_corpus(source: str) -> GeneratedCorpus:
    """The generations of ``source``'s split (module docstring); a ``UserError`` naming what is wrong."""
    from .generate import read_generations

    name, split = _parse(source)
    shipped = name in SHIPPED
    folder = shipped_path(name) if shipped else Path(name).expanduser()
    if shipped and not (folder / "run.json").is_file():
        raise UserError(f"--corpus {source}: the shipped corpus {folder.name} is not in this install; write one with "
                        f"`sharpdraft generate --workload {_how_written(name)} --out DIR` and name generated:DIR")
    if not shipped and not folder.is_dir():
        raise UserError(f"--corpus {source}: {name!r} is neither a shipped generated corpus "
                        f"({', '.join(SHIPPED)}) nor a folder; name one of those or a `sharpdraft generate` run folder")
    try:
        run = json.loads((folder / "run.json").read_text())
        recorded = run["settings"]["workload"]
        ids = [str(i) for i in recorded["ids"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise UserError(f"--corpus {source}: {folder} is not a generation run (no readable run.json); "
                        "write one with `sharpdraft generate`") from None
    try:
        generations = read_generations(folder)
    except UserError as err:
        raise UserError(f"--corpus {source}: {err}") from None
    splits = _splits(recorded, ids, name.split("-")[0] if shipped else None)
    chosen = [g for g in generations if split == "all" or splits.get(g.id) == split]
    if not chosen:
        raise UserError(f"--corpus {source}: no finished generation in the {split} split ({len(generations)} of "
                        f"{len(ids)} prompts finished in all); name another split or finish the run with "
                        "`sharpdraft generate --resume`")
    identity = run.get("tokenizer")
    return GeneratedCorpus(source, folder, split, identity if isinstance(identity, str) else None, chosen)


def _how_written(name: str) -> str:
    """The options of ``sharpdraft generate`` that write a corpus like the shipped ``name``, from ``--workload`` on."""
    workload, _, kind = name.partition("-")
    if kind == "long":
        return f"{workload}:heldout --new-tokens 7890 --min-new-tokens 7890"
    return f"{workload}:all --new-tokens 4096 --min-new-tokens 4096" + (" --temperature 0" if kind == "greedy" else "")


def _splits(recorded: dict, ids: list[str], builtin: str | None) -> dict[str, str]:
    """Each recorded prompt's split: from the built-in workload ``builtin`` (a shipped corpus), else the
    recorded workload file, else the built-in workload of the recorded name; else every prompt is ``train``."""
    from .workloads import BUILTIN, builtin_path, load_workload

    path = recorded.get("path") if isinstance(recorded, dict) else None
    candidates = [builtin_path(builtin)] if builtin else []
    if isinstance(path, str) and path.endswith(".jsonl") and Path(path).is_file():
        candidates.append(Path(path))
    if isinstance(recorded.get("name"), str) and recorded["name"] in BUILTIN:
        candidates.append(builtin_path(recorded["name"]))
    for file in candidates:
        try:
            prompts = {p.id: p.split for p in load_workload(f"{file}:all").prompts}
        except UserError:
            continue
        if set(ids) <= set(prompts):
            return prompts
    return {i: "train" for i in ids}


def generated_sequences(source: str, length: int, limit: int | None = None) -> list[GeneratedSequence]:
    """At most ``limit`` sequences of exactly ``length`` tokens of ``source``: each generation of at least
    ``length`` tokens (prompt and output), cut there, in the run's prompt order; ``UserError`` when none is."""
    corpus = read_corpus(source)
    found = []
    for g in corpus.generations:
        ids = list(g.prompt_ids) + list(g.output_ids)
        if len(ids) >= length and (limit is None or len(found) < limit):
            found.append(GeneratedSequence(g.id, ids[:length], len(g.prompt_ids)))
    if not found:
        longest = max(len(g.prompt_ids) + len(g.output_ids) for g in corpus.generations)
        raise UserError(f"--corpus {source}: none of its {len(corpus.generations)} generations holds {length} tokens "
                        f"(the longest: {longest}, prompt and output); ask for sequences of at most {longest} tokens")
    return found


def copied_tokens(ids) -> np.ndarray:
    """(T,) bool: token ``i`` of ``ids`` is one a ``COPY_ORDER``-gram prompt lookup over ``ids[:i]`` drafts
    (the text repeating what followed the same 3 tokens before).

    >>> copied_tokens([1, 2, 3, 4, 1, 2, 3, 4, 5]).astype(int).tolist()
    [0, 0, 0, 0, 0, 0, 0, 1, 0]
    """
    from .lookup import LookupSettings, next_token_drafts

    ids = np.asarray(ids, dtype=np.int64)
    drafts = next_token_drafts(ids.tolist(), LookupSettings(max_ngram=COPY_ORDER, min_ngram=COPY_ORDER))[:len(ids)]
    return drafts == ids


def target_tokenizer(drafter: str, drafter_path: str | None, target_path: str | None):
    """The tokenizer whose ids the drafter reads, loaded without any weights, or None where that needs them.

    A ``--target-path`` folder's own tokenizer; without one, the built-in SmolLM2's once its converted copy
    is cached, for a drafter of the built-in target (any kind without ``--drafter-path``, eagle3 and dflash
    with one). An ``hf`` or ``pard`` checkpoint without a target reads its own tokenizer: None here.
    """
    from .drafters.target import has_tokenizer, load_tokenizer
    from .generate import tokenizer_and_context

    if target_path is not None:
        folder = Path(target_path).expanduser()
        return load_tokenizer(target_path, option="--target-path") if folder.is_dir() and has_tokenizer(folder) \
            else None
    if drafter_path is None or drafter in ("eagle3", "dflash"):
        return tokenizer_and_context(None)[0]
    return None


def check_tokenizer(source: str, tokenizer, where: str = "the target's") -> None:
    """Refuse ``source`` when its run was generated with another tokenizer than ``tokenizer``."""
    from .generate import tokenizer_identity

    corpus = read_corpus(source)
    mine = tokenizer_identity(tokenizer)
    if corpus.tokenizer != mine:
        raise UserError(f"--corpus {source}: generated with tokenizer {corpus.tokenizer or '(none recorded)'}, not "
                        f"{where} ({mine}); "
                        "its token ids mean other text here: generate the corpus with this target "
                        "(`sharpdraft generate --target-path ...`)")
