"""Calibration corpora: documents in a fixed order, packed into token sequences of one length.

Sources (the ``--corpus`` option):

``pydoc`` (default; also ``pydoc:train``), ``pydoc:heldout``, ``pydoc:all``
    Python's own documentation topics, ``pydoc_data.topics.topics`` (real English prose, about
    113k SmolLM2 tokens, shipped with every Python). The split is deterministic: topics sorted
    by name, every 10th one (sorted indices 9, 19, 29, ...) is **held out** for evaluation;
    calibration reads the other nine in ten (``train``) unless told otherwise.
``stdlib`` (also ``stdlib:train``), ``stdlib:heldout``, ``stdlib:all``
    the Python standard library's own source files (``sysconfig``'s ``stdlib`` path): real code
    with long-range structure, long enough for held-out sequences of 8,192 tokens. One document
    per ``.py`` file; test suites (folders named ``test``, ``tests``, ``idle_test``) and
    ``site-packages`` are left out. Split by file like pydoc: module paths sorted, every 10th
    (sorted indices 9, 19, ...) held out.
a ``.txt`` file
    one document.
a ``.jsonl`` file
    one document per line, the string in its ``text`` field.
a folder
    every ``.txt`` and ``.jsonl`` file under it, in sorted path order.
``recall:SOURCE`` (e.g. ``recall:stdlib:heldout``, ``recall:pydoc:heldout``, ``recall:notes.txt``)
    **recall sequences** (:mod:`calibrate.recall`) from ``SOURCE``'s text: its documents read as one
    stream of tokens (joined as :func:`pack` joins them) and cut into sequences of ``max_length``
    tokens in which passages recur verbatim at set distances, each token marked when it is a copy
    (:func:`recall_corpus`); its documents are ``SOURCE``'s.
``generated:NAME[:SPLIT]`` (e.g. ``generated:diary:heldout``, ``generated:out/gen/diary``)
    the target's own text: one sequence per prompt of a ``sharpdraft generate`` run folder, its token ids
    as written (:mod:`calibrate.generated`): :func:`pack` gives each generation of at least ``max_length``
    tokens cut there, and leaves the shorter ones out (never padded, never joined). Token ids, not text:
    it has no :func:`documents`, so it is no source of recall sequences.

Packing (:func:`pack`, the one rule for calibration, evaluation and the demo head's training):
documents are tokenized in order, joined with the end-of-sequence token (the tokens of a blank
line only when the tokenizer has no such token), and cut into consecutive sequences of exactly
``max_length`` tokens; the tail shorter than ``max_length`` is dropped. The same source, tokenizer
and length always give the same sequences in the same order, which is what lets ``--resume``
continue a run.
"""

from __future__ import annotations

import json
import os
import sysconfig
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UserError
from .generated import generated_sequences, is_generated

__all__ = ["SPLITS", "RECALL", "RECALL_AT", "documents", "is_recall", "no_text", "pack", "pydoc_topics",
           "recall_corpus", "recall_parts", "stdlib_modules"]

SPLITS = ("train", "heldout", "all")
HELD_OUT_EVERY = 10  # every 10th document (sorted by name) is held out
RECALL = "recall:"  # prefix of a recall source: recall:SOURCE
RECALL_AT = "recall@"  # prefix of a recall source with its own distances: recall@D1,D2,...:SOURCE
MAX_RECALL_DISTANCE = 1 << 20  # no sequence this toolkit measures is longer
STDLIB_LEFT_OUT = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _split(named: list, split: str, source: str) -> list:
    """The ``split`` of ``named`` (sorted): every 10th item held out, the rest train."""
    if split not in SPLITS:
        raise UserError(f"--corpus {source}:{split}: unknown split; use one of {', '.join(SPLITS)}")
    if split == "all":
        return named
    held = split == "heldout"
    return [item for i, item in enumerate(named) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held]


def pydoc_topics(split: str = "train") -> list[tuple[str, str]]:
    """``(name, text)`` of the pydoc topics in ``split`` (train, heldout or all), sorted by name."""
    from pydoc_data.topics import topics

    return _split(sorted(topics.items()), split, "pydoc")


def stdlib_modules(split: str = "train", root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """``(module path, file)`` of the standard library's ``.py`` files in ``split``, sorted by path.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``; folders in ``STDLIB_LEFT_OUT`` (test
    suites, installed packages, caches) are not entered.
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in STDLIB_LEFT_OUT]
        found += [(Path(folder, f).relative_to(root).as_posix(), Path(folder, f)) for f in files if f.endswith(".py")]
    return _split(sorted(found), split, "stdlib")


def _source_text(file: Path) -> str:
    """A Python file's text in its declared encoding (PEP 263); undecodable bytes replaced."""
    with file.open("rb") as handle:
        encoding, _ = tokenize.detect_encoding(handle.readline)
    return file.read_bytes().decode(encoding, errors="replace")


def documents(source: str) -> Iterator[str]:
    """The documents of a corpus source (see the module docstring), in their fixed order."""
    if is_recall(source):
        yield from documents(recall_parts(source)[0])
        return
    if is_generated(source):
        raise UserError(f"--corpus {source}: a generated corpus is token ids, not text; recall sequences and "
                        "the training scripts read a text corpus (pydoc, stdlib, a .txt or .jsonl file)")
    if source == "pydoc" or source.startswith("pydoc:"):
        split = source.partition(":")[2] or "train"
        for _, text in pydoc_topics(split):
            yield text
        return
    if source == "stdlib" or source.startswith("stdlib:"):
        for _, file in stdlib_modules(source.partition(":")[2] or "train"):
            text = _source_text(file)
            if text.strip():
                yield text
        return
    path = Path(source)
    if not path.exists():
        raise UserError(f"--corpus {source}: no such file or folder (use pydoc, stdlib, a .txt or .jsonl file, "
                        "or a folder)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
        if not files:
            raise UserError(f"--corpus {source}: the folder holds no .txt or .jsonl files")
    elif path.suffix in (".txt", ".jsonl"):
        files = [path]
    else:
        raise UserError(f"--corpus {source}: expected a .txt or .jsonl file or a folder, got a {path.suffix or 'bare'} file")
    for file in files:
        yield from _file_documents(file)


def is_recall(source: str) -> bool:
    """Whether ``source`` names recall sequences (``recall:SOURCE`` or ``recall@D1,D2,...:SOURCE``)."""
    return source.startswith(RECALL) or source.startswith(RECALL_AT)


def recall_parts(source: str) -> tuple[str, tuple[int, ...]]:
    """``(SOURCE, distances)`` of ``recall:SOURCE`` (the default distances, ``calibrate.recall.DISTANCES``)
    or ``recall@D1,D2,...:SOURCE`` (those repeat distances, in that order); a ``UserError`` naming the
    part that is wrong: no SOURCE or a recall one inside, a distance that is not a whole number of
    tokens from 16 (the shortest passage) up, one given twice.

    >>> recall_parts("recall@1024,2048:stdlib:heldout")
    ('stdlib:heldout', (1024, 2048))
    """
    from .recall import DISTANCES, MIN_PASSAGE

    example = "e.g. recall:stdlib:heldout or recall@1024,2048,3072:stdlib:heldout"
    if source.startswith(RECALL_AT):
        listed, colon, inner = source[len(RECALL_AT):].partition(":")
        if not colon:
            raise UserError(f"--corpus {source}: expected recall@D1,D2,...:SOURCE, {example}")
        distances = []
        for word in listed.split(","):
            if not (word.isascii() and word.isdigit()) or not MIN_PASSAGE <= int(word) <= MAX_RECALL_DISTANCE:
                raise UserError(f"--corpus {source}: repeat distance {word!r} is not a whole number of tokens from "
                                f"{MIN_PASSAGE} to {MAX_RECALL_DISTANCE}; {example}")
            if int(word) in distances:
                raise UserError(f"--corpus {source}: repeat distance {word} is given twice; name each once")
            distances.append(int(word))
        distances = tuple(distances)
    else:
        inner, distances = source[len(RECALL):], DISTANCES
    if not inner or is_recall(inner):
        raise UserError(f"--corpus {source}: expected recall:SOURCE with SOURCE a corpus of text, {example}")
    return inner, distances


def _file_documents(file: Path) -> Iterator[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--corpus: cannot read {file} as UTF-8 text ({err})") from None
    if file.suffix == ".txt":
        if text.strip():
            yield text
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"--corpus: {file} line {lineno} is not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f"--corpus: {file} line {lineno} has no string 'text' field")
        if record["text"].strip():
            yield record["text"]


def no_text(source: str) -> UserError:
    """The refusal of a corpus with no text at all: an empty or blank file, or a folder of such."""
    return UserError(f"--corpus {source}: holds no text (empty or blank); give a .txt or .jsonl file with text, "
                     "or pydoc")


def _joined(source: str, tokenize: Callable[[str], list[int]], eos_token_id: int | None) -> Iterator[list[int]]:
    """The tokens of each document of ``source`` in order, every one after the first preceded by the
    separator: ``eos_token_id``, or the tokens of a blank line when it is None."""
    separator = [eos_token_id] if eos_token_id is not None else tokenize("\n\n")
    for i, doc in enumerate(documents(source)):
        yield (separator if i else []) + tokenize(doc)


def pack(source: str, tokenize: Callable[[str], list[int]], eos_token_id: int | None, max_length: int,
         limit: int | None = None) -> Iterator[list[int]]:
    """Token sequences of exactly ``max_length`` from ``source``, at most ``limit`` of them.

    Documents are joined with ``eos_token_id`` (a drafter's ``eos_token_id``; None: the tokens of a
    blank line). Tokenizes lazily: a large corpus is read only as far as the sequences asked for.
    A recall source gives its recall sequences' tokens (:func:`recall_corpus`), a generated one its
    generations of at least ``max_length`` tokens, cut there (``tokenize`` and ``eos_token_id`` unused:
    :func:`calibrate.generated.generated_sequences`). Raises ``UserError`` when the corpus holds no full
    sequence.
    """
    if is_recall(source):
        yield from (s.ids for s in recall_corpus(source, tokenize, eos_token_id, max_length, limit))
        return
    if is_generated(source):
        yield from (s.ids for s in generated_sequences(source, max_length, limit))
        return
    buffer: list[int] = []
    produced = 0
    seen = 0
    for tokens in _joined(source, tokenize, eos_token_id):
        if limit is not None and produced >= limit:
            return
        buffer.extend(tokens)
        seen += 1
        while len(buffer) >= max_length and (limit is None or produced < limit):
            yield buffer[:max_length]
            buffer = buffer[max_length:]
            produced += 1
    if produced == 0 and seen == 0:
        raise no_text(source)
    if produced == 0:
        raise UserError(f"--corpus {source}: its {len(buffer)} tokens do not fill one sequence of --max-length "
                        f"{max_length}; use a larger corpus or a smaller --max-length")


def recall_corpus(source: str, tokenize: Callable[[str], list[int]], eos_token_id: int | None, max_length: int,
                  limit: int | None = None) -> list:
    """The recall sequences (:class:`calibrate.recall.RecallSequence`: ids, copied mask, distance) of
    ``recall:SOURCE``, at most ``limit`` (None: as many as its text fills), each of ``max_length`` tokens.

    Raises ``UserError`` when no repeat distance fits ``max_length`` or the text fills no sequence.
    """
    from .recall import recall_sequences

    inner, distances = recall_parts(source)
    stream = (t for tokens in _joined(inner, tokenize, eos_token_id) for t in tokens)
    try:
        return recall_sequences(stream, max_length, limit, distances)
    except ValueError as err:
        raise UserError(f"--corpus {source}: {err}") from None
