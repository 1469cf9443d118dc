"""Every notebook in notebooks/ runs top to bottom (with JAXPC_SMALL=1: tiny settings) without errors.

The committed notebooks are saved with the outputs of a full run; this test executes a copy and never
writes them back."""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_with_outputs():
    assert len(NOTEBOOKS) >= 4
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.get("execution_count") for c in code), f"{path.name} is not fully executed"
        assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", [])), path.name
        assert any(o.get("output_type") == "display_data" for c in code for o in c.get("outputs", [])), \
            f"{path.name} shows no figure"


@pytest.mark.slow
@pytest.mark.every_case
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("JAXPC_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.slow
def test_quickstart_notebook_shows_the_circuit_its_code_builds():
    """The committed 01_quickstart shows the summary of the circuit its code builds at full settings: an output
    left stale by a change to the structures or the compiler fails here (run the notebook again and commit it)."""
    import jaxpc
    from jaxpc import distributions, structures
    from jaxpc.demo import load_digits_split

    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    latents = int(re.search(r"else \((\d+), \d+, \d+\)", code[0].source).group(1))
    cell = next(c for c in code if "structures.HCLT" in c.source)
    shown = next(o["data"]["text/plain"] for o in cell.outputs if o.get("output_type") == "execute_result")
    train, _ = load_digits_split(seed=0)
    root = structures.HCLT(train, num_latents=latents, input_dist=distributions.Categorical(num_cats=17))
    assert repr(jaxpc.compile(root, seed=0)) == shown
