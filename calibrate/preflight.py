"""Checks every command runs before expensive work (model loading, collection, evaluation).

* :func:`check_outputs`: each output path can be written, is not a folder (or, for a folder
  output, not a file), and names neither an input nor another output, so a run can never replace
  the spec, corpus or checkpoint it reads, and never fails to write after all its work is done.
* :func:`check_corpus`: the corpus source exists and its first document can be read (a generated
  corpus: its split has a generation long enough, written with the target's tokenizer).
* :func:`load_spec`: a spec file, its :class:`~sharpdraft_theory.SpecError` as a ``UserError``.

Each problem is a one-line ``UserError`` naming the option, the path and what to do.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from sharpdraft_theory import ScaleSpec, SpecError
from sharpdraft_theory.stats import RowStats

from .errors import UserError

__all__ = ["check_outputs", "check_corpus", "load_spec", "load_stats_file", "local_inputs"]


def local_inputs(**options) -> dict[str, Path]:
    """``{"--option": path}`` for the options whose value is an existing local file or folder.

    Keys are option names with ``_`` for ``-`` (``drafter_path`` is ``--drafter-path``); values that
    are None, hub ids or corpus names such as ``pydoc`` are left out.
    """
    found = {}
    for name, value in options.items():
        if value is not None and str(value) and Path(value).expanduser().exists():
            found["--" + name.replace("_", "-")] = Path(value).expanduser().resolve()
    return found


def check_outputs(outputs: dict[str, Path | None], inputs: dict[str, Path], *, folders: tuple[str, ...] = ()) -> None:
    """Refuse outputs that would destroy an input, collide, or cannot be written.

    ``outputs`` maps option names to paths (None: not asked for); ``inputs`` maps option names to
    resolved existing paths (:func:`local_inputs`). Options in ``folders`` name an output folder
    (created if missing); the others name files.
    """
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        path = Path(path).expanduser()
        resolved = path.resolve()
        folder = option in folders
        if folder and resolved.exists() and not resolved.is_dir():
            raise UserError(f"{option} {path}: is a file; give a folder (it is created if missing)")
        if not folder and resolved.is_dir():
            raise UserError(f"{option} {path}: is a folder; give a file name")
        if resolved in seen:
            raise UserError(f"{option} {path}: same path as {seen[resolved]}; give each output its own path")
        seen[resolved] = option
        for source, where in inputs.items():
            if resolved == where or (where.is_dir() and resolved.exists() and where in resolved.parents):
                what = "is" if resolved == where else "lies inside"
                raise UserError(f"{option} {path}: {what} the {source} input, which writing would destroy; "
                                "give another path")
        _check_writable(option, path, resolved)


def _check_writable(option: str, path: Path, resolved: Path) -> None:
    """The nearest existing folder above ``resolved`` is a folder and takes a new file."""
    parent = resolved.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{option} {path}: {parent} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".sharpdraft-probe-", dir=parent)
    except OSError as err:
        raise UserError(f"{option} {path}: cannot write in {parent} ({err.strerror}); give another path") from None
    os.close(fd)
    os.unlink(probe)


def check_corpus(source: str, max_length: int | None = None, *, drafter: str | None = None,
                 drafter_path: str | None = None, target_path: str | None = None) -> None:
    """The corpus exists and its first document reads (``calibrate.corpus`` raises the ``UserError``);
    a corpus with no text at all (an empty file, blank lines, a folder of such) is refused here too,
    and a recall corpus whose sequences of ``max_length`` (when given) fit no repeat distance.

    A generated corpus (``calibrate.generated``): its split holds a finished generation of ``max_length``
    tokens, and, when ``drafter`` is given and the target's tokenizer reads without weights
    (``target_tokenizer`` of ``drafter``, ``drafter_path``, ``target_path``), it is that tokenizer's."""
    from .corpus import RECALL_AT, documents, is_recall, no_text, recall_parts
    from .generated import check_tokenizer, generated_sequences, is_generated, read_corpus, target_tokenizer
    from .recall import passage_length, usable_distances

    if is_generated(source):
        read_corpus(source)
        if max_length is not None:
            generated_sequences(source, max_length, limit=1)
        tokenizer = None if drafter is None else target_tokenizer(drafter, drafter_path, target_path)
        if tokenizer is not None:
            check_tokenizer(source, tokenizer)
        return
    if next(iter(documents(source)), None) is None:
        raise no_text(source)
    if not is_recall(source) or max_length is None:
        return
    _, distances = recall_parts(source)
    usable = usable_distances(max_length, distances)
    block = lambda d: d + passage_length(d)  # noqa: E731  (one passage, the filler, the passage again)
    if not usable:
        raise UserError(f"--corpus {source}: sequences of {max_length} tokens fit no repeat distance of "
                        f"{', '.join(map(str, distances))} (a block is the distance plus its passage, at least "
                        f"{min(map(block, distances))} tokens); use longer sequences")
    if source.startswith(RECALL_AT) and len(usable) < len(distances):  # asked for by name: each must fit
        d = next(d for d in distances if d not in usable)
        raise UserError(f"--corpus {source}: repeat distance {d} does not fit sequences of {max_length} tokens "
                        f"(a block is {block(d)} tokens); use longer sequences or a shorter distance")


def load_spec(path: str | os.PathLike) -> ScaleSpec:
    """``ScaleSpec.load`` with its ``SpecError`` (which names the file) as a ``UserError``."""
    try:
        return ScaleSpec.load(path)
    except SpecError as err:
        raise UserError(str(err)) from None


def load_stats_file(path: str | os.PathLike) -> tuple[RowStats, dict[str, str]]:
    """``RowStats.load`` (rows and the stored record, as strings) with its errors as a ``UserError``."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"statistics file {str(path)!r} is a folder; pass the .npz file that "
                        "`sharpdraft calibrate --stats FILE` wrote")
    if not path.is_file():
        raise UserError(f"statistics file {str(path)!r} does not exist; create it with "
                        "`sharpdraft calibrate --stats FILE`")
    try:
        return RowStats.load(path)
    except ValueError as err:
        raise UserError(str(err)) from None
