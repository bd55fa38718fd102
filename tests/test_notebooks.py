"""The notebooks: committed with the outputs of a full run of exactly their code, and runnable in CI.

CI executes each at the small setting (``SHARPDRAFT_NB_SMALL=1``) and fails on any cell error. The
committed copies must carry the stamp ``notebooks/execute.py`` writes after a full run, with the
digest of the code they show: edit a code cell and this fails until the notebook is run again.
"""

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_execute", NOTEBOOK_DIR / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

RERUN = "run `python notebooks/execute.py` and commit the notebooks"


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _errors(nb):
    return [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]


def _images(nb):
    return sum("image/png" in o.get("data", {}) for c in _code_cells(nb) for o in c.outputs)


@pytest.mark.parametrize("name", execute.NOTEBOOKS)
def test_committed_notebook_carries_a_full_run_of_its_code(name):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    stamp = nb.metadata.get("sharpdraft", {})
    assert stamp.get("setting") == "full", f"{name} was not committed from a full run; {RERUN}"
    assert stamp.get("code_sha256") == execute.code_digest(nb), f"{name}: code changed since its run; {RERUN}"
    code = _code_cells(nb)
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: not run top to bottom"
    assert all(c.outputs for c in code), f"{name}: a code cell has no output"
    assert not _errors(nb)
    assert _images(nb) >= 4  # the figures are the point of the notebooks


@pytest.mark.parametrize("name", execute.NOTEBOOKS)
def test_notebook_executes_at_the_small_setting(name):
    committed = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    ran = execute.execute(NOTEBOOK_DIR / name, small=True, timeout=300)  # raises CellExecutionError on error
    assert execute.code_digest(ran) == execute.code_digest(committed)
    assert not _errors(ran)
    assert _images(ran) == _images(committed)
    assert "setting: small (CI)" in ran.cells[1].outputs[0]["text"]
