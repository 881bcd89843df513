"""docs/PARALLELISM.md's memory plan of the full model is the code's own accounting (serving/engine/memory_plan.py)."""
from pathlib import Path

from dsv41_jax.config import ModelConfig
from serving.engine.memory_plan import GIB, H200_GIB, doc_plans, markdown, plan

DOC = Path(__file__).resolve().parents[1] / "docs" / "PARALLELISM.md"


def test_doc_table_matches_the_accounting():
    assert markdown(doc_plans()) in DOC.read_text()


def test_plan_adds_up():
    cfg = ModelConfig.preset("full")
    tp4, dep2 = plan(cfg, "TP4"), plan(cfg, "DEP2")
    assert tp4.fits and not dep2.fits and dep2.pages == 0
    used = tp4.weights + tp4.rings + tp4.staging + tp4.reserve + tp4.kv
    assert 0 <= H200_GIB * GIB - used < tp4.page_bytes  # every byte accounted for, the rest is less than a page
    assert round(tp4.host_tables / GIB, 1) == 188.8
    dev = plan(cfg, "TP4", host_tables=False)
    assert dev.weights - tp4.weights == tp4.host_tables and not dev.fits  # replicated device tables
