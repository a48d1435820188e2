"""The notebooks under notebooks/: executed top to bottom, committed without outputs, public API only.

Executing needs the ``notebooks`` extra (nbclient, nbformat, ipykernel, ipywidgets, matplotlib);
without it those tests skip. ``05_ddpo`` also needs the ``diffusion`` and ``peft`` extras. Each notebook runs in a
fresh ``python3`` kernel of this interpreter, offline, in an empty working directory that must still
be empty afterwards: run artefacts go to temp dirs.

Strip outputs after running a notebook in Jupyter: ``python tests/test_notebooks.py notebooks/*.ipynb``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
# Extra packages a notebook needs beyond the `notebooks` extra (skipped cleanly without them).
NEEDS = {"05_ddpo": ("diffusers", "PIL", "peft")}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _load(path: Path) -> dict:
    """The notebook as plain JSON (no nbformat needed for the static checks)."""
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def strip_outputs(path: Path) -> bool:
    """Remove outputs and execution counts from a notebook in place; returns whether it changed."""
    nb = _load(path)
    changed = False
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            cell["outputs"], cell["execution_count"] = [], None
            changed = True
        if cell.get("metadata", {}).pop("execution", None) is not None:
            changed = True
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return changed


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["01_losses_in_your_own_loop.ipynb", "02_ppo_from_parts.ipynb",
                                           "03_group_methods.ipynb", "04_reft.ipynb", "05_ddpo.ipynb"]
    index = (NOTEBOOKS_DIR / "README.md").read_text()
    assert all(p.name in index for p in NOTEBOOKS), "notebooks/README.md must list every notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_without_outputs(path):
    nb = _load(path)
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None or "execution" in c.get("metadata", {}))]
    assert not dirty, (f"{path.name}: cells {dirty} hold outputs or execution counts; strip them with "
                       f"`python tests/test_notebooks.py notebooks/{path.name}`")
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", f"{path.name}: kernel must be python3"


def test_strip_outputs_removes_outputs_and_counts(tmp_path):
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": [
        {"cell_type": "code", "execution_count": 3, "metadata": {"execution": {"x": 1}}, "source": "1",
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "1"}]},
        {"cell_type": "markdown", "metadata": {}, "source": "# t"}], "metadata": {}, "nbformat": 4,
        "nbformat_minor": 5}))
    assert strip_outputs(path) and not strip_outputs(path)
    cell = _load(path)["cells"][0]
    assert cell["outputs"] == [] and cell["execution_count"] is None and cell["metadata"] == {}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_code_cell_is_explained(path):
    cells = _load(path)["cells"]
    assert cells[0]["cell_type"] == "markdown" and _source(cells[0]).startswith("# "), "start with a title"
    unexplained = [i for i, c in enumerate(cells) if c["cell_type"] == "code"
                   and (i == 0 or cells[i - 1]["cell_type"] != "markdown" or not _source(cells[i - 1]).strip())]
    assert not unexplained, f"{path.name}: code cells {unexplained} have no markdown cell before them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_uses_only_the_public_api(path):
    """Every name imported from rlcore is in its module's ``__all__`` (or is a public submodule)."""
    code = "\n".join(_source(c) for c in _load(path)["cells"] if c["cell_type"] == "code")
    private = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlcore"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name in getattr(module, "__all__", ()):
                    continue
                is_package = hasattr(module, "__path__")
                if not (is_package and importlib.util.find_spec(f"{node.module}.{alias.name}") is not None):
                    private.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.startswith("rlcore") and "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(f"<attribute>.{node.attr}")
    assert not private, f"{path.name} uses names outside the public API: {private}"


def _this_interpreter_kernel(root: Path) -> Path:
    """A ``python3`` kernelspec running ``sys.executable``, for ``JUPYTER_PATH`` (searched first, so a
    user's own ``python3`` kernel pointing at another interpreter is not picked up)."""
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (rlcore tests)", "language": "python"}))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for module in ("ipykernel", "matplotlib", *NEEDS.get(path.stem, ())):
        pytest.importorskip(module)
    monkeypatch.setenv("JUPYTER_PATH", str(_this_interpreter_kernel(tmp_path / "jupyter")))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600, allow_errors=False,
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env={**os.environ, **OFFLINE, "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
    assert sorted(p.name for p in workdir.iterdir()) == [], "a notebook wrote into its working directory"
    # the committed file is untouched by the run (outputs live in the in-memory copy only)
    assert not any(c.get("outputs") for c in _load(path)["cells"] if c["cell_type"] == "code")


if __name__ == "__main__":
    for arg in sys.argv[1:] or map(str, NOTEBOOKS):
        print(("stripped " if strip_outputs(Path(arg)) else "clean    ") + arg)
