"""notebooks/quickstart.ipynb runs top to bottom (nbclient), so it cannot rot: offline LLM, a server subprocess,
a gRPC call, an OpenAI-client call, metrics and a clean shutdown (its cells assert on what they print)."""

from pathlib import Path

import pytest

from serving.engine.config import shared_cache_dir

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


@pytest.mark.timeout(600)
def test_quickstart_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("DSV41_COMPILATION_CACHE_DIR", shared_cache_dir())  # shared with the other API tests
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=400, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "server exit status: 0" in outputs
    assert "cached tokens: 0 then 56" in outputs  # the 64-token page minus the 8-token window replayed
