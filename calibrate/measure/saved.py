"""Finished units of a long measurement, kept so an interrupted run continues where it stopped.

A run writing ``<out>`` keeps each finished unit (a sequence's :class:`~calibrate.measure.forced.Tally`,
one speculative prompt) as one JSON file in ``<out>.partial/``, written atomically, next to
``run.json`` holding the run's parameters. Rerun with ``resume=True`` (``--resume``), the saved
units are read instead of measured again, so the result is the same JSON as an uninterrupted run;
with other parameters the run is refused, naming the first that differs. The folder is created
with the first saved unit (a run refused before measuring anything leaves nothing behind) and
removed once the result is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sharpdraft_theory.atomic import atomic_write_text

from ..errors import UserError

__all__ = ["SavedUnits", "partial_dir"]


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
        try:
            before = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"{run_file}: cannot read it ({err}); delete {folder} to start over") from None
        for key, value in self.params.items():
            if before.get(key) != value:
                raise UserError(f"--resume: {key} does not match the interrupted run in {folder}: was "
                                f"{before.get(key)!r}, now {value!r}; rerun with the same options, or delete "
                                "the folder to start over")

    def get(self, key: str) -> dict | None:
        """The saved unit ``key``, or None when it is not saved."""
        if self.folder is None or not (self.folder / f"{key}.json").is_file():
            return None
        path = self.folder / f"{key}.json"
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"--resume: cannot read {path} ({err}); delete it to measure that unit again") from None
        self.resumed += 1
        return value

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
