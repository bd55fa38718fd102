"""Run the notebooks top to bottom in place and stamp what ran; the test holds the stamp to the code.

    python notebooks/execute.py                          # full run: refresh the committed outputs
    SHARPDRAFT_NB_SMALL=1 python notebooks/execute.py    # the small CI setting (leaves files alone)

Each executed notebook gets ``metadata.sharpdraft = {"setting": "full" | "small", "code_sha256": ...}``:
the digest of its code cells at run time. ``tests/test_notebooks.py`` checks the committed
notebooks were run in full from exactly the code they show, and executes them at the small setting.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("mass_dilution.ipynb", "calibration_report.ipynb", "distance_model.ipynb")
SMALL_ENV = "SHARPDRAFT_NB_SMALL"  # "1": fewer Monte Carlo rows, shorter n, fewer bootstrap draws


def code_digest(nb) -> str:
    """SHA-256 of the notebook's code cells, in order (outputs and markdown excluded)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode("utf-8") + b"\0")
    return h.hexdigest()


def execute(path: Path, *, small: bool, timeout: int = 900):
    """Execute ``path`` in its own folder with the setting in the environment; return the notebook."""
    nb = nbformat.read(path, as_version=4)
    previous = os.environ.get(SMALL_ENV)
    os.environ[SMALL_ENV] = "1" if small else "0"
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if previous is None:
            os.environ.pop(SMALL_ENV)
        else:
            os.environ[SMALL_ENV] = previous
    nb.metadata["sharpdraft"] = {"setting": "small" if small else "full", "code_sha256": code_digest(nb)}
    return nb


def main() -> None:
    small = os.environ.get(SMALL_ENV) == "1"
    names = sys.argv[1:] or NOTEBOOKS
    for name in names:
        path = HERE / Path(name).name
        started = time.perf_counter()
        nb = execute(path, small=small)
        if not small:
            nbformat.write(nb, path)
        print(f"{path.name}: {'small' if small else 'full'} run in {time.perf_counter() - started:.0f} s"
              + ("" if small else ", outputs written"))


if __name__ == "__main__":
    main()
