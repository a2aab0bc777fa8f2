"""``python -m vllm_nwor.patches``: the patch inventory, as docs/design.md shows it."""

from vllm_nwor.patches import inventory_markdown

print(inventory_markdown())
