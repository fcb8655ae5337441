"""The quickstart notebook runs top to bottom (on a tiny budget) so it cannot rot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("JDQN_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("JDQN_NOTEBOOK_OUT", str(tmp_path / "run"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert (tmp_path / "run" / "report.json").is_file()
    text = "".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "agent" in text and "buy_and_hold" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
