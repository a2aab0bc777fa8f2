"""docs/design.md's patch table is the registry's (``python -m vllm_nwor.patches``), and every
patch says why it exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
BLOCK = re.compile(r"<!-- patch inventory: .*?-->\n(.*?)\n<!-- end of patch inventory -->", re.S)


def test_the_design_docs_table_is_the_registry():
    from vllm_nwor.patches import inventory_markdown

    (table,) = BLOCK.findall(DESIGN.read_text())
    assert table == inventory_markdown(), "run python -m vllm_nwor.patches into docs/design.md"


def test_every_patch_says_why_and_features_hook_in_the_declared_order():
    from vllm_nwor.patches import all_patches

    patches = all_patches()
    assert all(len(p.why) > 20 for p in patches)
    on_kv_cache = [p.wrap.__module__ for p in patches
                   if p.attribute.endswith("gpu_model_runner.GPUModelRunner.initialize_kv_cache")]
    assert on_kv_cache == ["vllm_nwor.patches.nwor.model_runner", "vllm_nwor.patches.scv.ngram_gpu"]
