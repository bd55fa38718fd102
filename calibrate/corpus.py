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

__all__ = ["SPLITS", "documents", "no_text", "pack", "pydoc_topics", "stdlib_modules"]

SPLITS = ("train", "heldout", "all")
HELD_OUT_EVERY = 10  # every 10th document (sorted by name) is held out
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


def pack(source: str, tokenize: Callable[[str], list[int]], eos_token_id: int | None, max_length: int,
         limit: int | None = None) -> Iterator[list[int]]:
    """Token sequences of exactly ``max_length`` from ``source``, at most ``limit`` of them.

    Documents are joined with ``eos_token_id`` (a drafter's ``eos_token_id``; None: the tokens of a
    blank line). Tokenizes lazily: a large corpus is read only as far as the sequences asked for.
    Raises ``UserError`` when the corpus holds no full sequence.
    """
    separator = [eos_token_id] if eos_token_id is not None else tokenize("\n\n")
    buffer: list[int] = []
    produced = 0
    seen = 0
    for doc in documents(source):
        if limit is not None and produced >= limit:
            return
        if seen:
            buffer.extend(separator)
        buffer.extend(tokenize(doc))
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
