"""Finished units of a long measurement, kept so an interrupted run continues where it stopped.

A run writing ``<out>`` keeps each finished unit (a sequence's :class:`~calibrate.measure.forced.Tally`,
one speculative prompt) as one JSON file in ``<out>.partial/``, written atomically, next to
``run.json`` holding the run's parameters. Rerun with ``resume=True`` (``--resume``), the saved
units are read instead of measured again, so the result is the same JSON as an uninterrupted run;
with other parameters the run is refused, naming the first that differs (a folder another command
left, with other parameters altogether, is refused as such). A damaged file (not UTF-8 JSON, nested
past reading, or a unit of the wrong shape: each unit's reader checks it) is refused in one line
naming it, never trusted. The folder is created
with the first saved unit (a run refused before measuring anything leaves nothing behind) and
removed once the result is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from sharpdraft_theory.atomic import atomic_write_text

from ..errors import UserError

__all__ = ["SavedUnits", "partial_dir", "read_json"]


def read_json(path: Path, delete: str) -> Any:
    """The JSON value in ``path``; a file that cannot be read, is not UTF-8 or not JSON, or is nested too
    deeply to read is a ``UserError`` naming it and saying to delete ``delete``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "nested too deeply to read" if isinstance(err, RecursionError) else (
            getattr(err, "strerror", None) or f"not UTF-8 JSON: {err}")
        raise UserError(f"--resume: cannot read {path} ({why}); delete {delete}") from None


def check_params(folder: Path, params: dict) -> None:
    """The interrupted run in ``folder`` (its ``run.json``) has the parameters ``params``; else a ``UserError``
    naming the first that differs, or saying that another command (other parameters altogether) left it."""
    run_file = folder / "run.json"
    before = read_json(run_file, f"{folder} to start over")
    if not isinstance(before, dict) or set(before) != set(params):
        raise UserError(f"--resume: {run_file} was not written by this command (its parameters are "
                        f"{_keys(before)}); delete {folder} to start over, or pass another --out")
    for key, value in params.items():
        if before[key] != value:
            shown = "(differs)" if isinstance(value, list) and len(value) > 8 else f"{before[key]!r}, now {value!r}"
            raise UserError(f"--resume: {key} does not match the interrupted run in {folder}: was {shown}; "
                            "rerun with the same options, or delete the folder to start over")


def _keys(value) -> str:
    if not isinstance(value, dict):
        return f"not an object but {type(value).__name__}"
    return ", ".join(sorted(value)[:6]) + (", ..." if len(value) > 6 else "") if value else "none"


def partial_dir(out: Path) -> Path:
    """Folder of an interrupted run's saved units: ``<out>.partial``."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


class SavedUnits:
    """Saved units of one run (``folder`` None: nothing is kept, e.g. a run without ``--out``).

    Checks happen at construction, before any model loads: a folder holding an interrupted run
    is refused without ``resume``; with it, ``params`` must equal the saved ones.
    """

    def __init__(self, folder: Path | None, params: dict, resume: bool):
        self.folder, self.params = folder, json.loads(json.dumps(params))  # JSON-normal form, as saved
        self.resumed = 0  # units read back
        if folder is None:
            if resume:
                raise UserError("--resume: give --out, the result file of the interrupted run (its progress "
                                "is kept beside it in <out>.partial)")
            return
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{folder} is a file where the run keeps its progress; move or delete it")
        run_file = folder / "run.json"
        if not run_file.is_file():
            return
        if not resume:
            raise UserError(f"{folder} holds an interrupted run: pass --resume to continue it, "
                            "or delete the folder to start over")
        check_params(folder, self.params)

    def get(self, key: str, read: Callable[[Any], Any]):
        """The saved unit ``key`` as ``read`` makes it from its JSON value, or None when it is not saved.

        ``read`` raises ``ValueError`` for a value of the wrong shape: the unit is damaged, and refused."""
        if self.folder is None or not (self.folder / f"{key}.json").is_file():
            return None
        path = self.folder / f"{key}.json"
        again = "it to measure that unit again"
        value = read_json(path, again)
        try:
            unit = read(value)
        except ValueError as err:
            raise UserError(f"--resume: {path} is damaged ({err}); delete {again}") from None
        self.resumed += 1
        return unit

    def put(self, key: str, value: dict) -> None:
        """Save unit ``key`` atomically (the folder and its ``run.json`` first, if this is the first)."""
        if self.folder is None:
            return
        try:
            if not (self.folder / "run.json").is_file():
                self.folder.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.folder / "run.json", json.dumps(self.params, indent=1))
            atomic_write_text(self.folder / f"{key}.json", json.dumps(value))
        except OSError as err:
            raise UserError(f"cannot write {self.folder}: {err.strerror or err}; free space or fix the path, "
                            "then --resume to continue") from None

    def finish(self) -> None:
        """The result is written: drop the saved units."""
        if self.folder is not None and self.folder.is_dir():
            shutil.rmtree(self.folder, ignore_errors=True)
