"""Every vLLM attribute the plugin replaces or adds, in the order they are applied.

This package is the only place that touches vLLM internals. Each patch keeps the original and
calls it; its ``why`` says what it does and what would retire it. The modules are grouped by
feature: ``nwor/`` (staged KV writes and verify attention), ``scv/`` (per-request chunks),
``telemetry/`` (the plugin's metrics), ``draft_window`` (the draft context window) and
``synthetic`` (a benchmark feature); ``engine_args`` (the plugin's config), ``shared`` (what
one feature leaves for another) and ``_patch`` (the utility) serve all of them. The feature
packages never import each other.

:func:`all_patches` is the one inventory: several features may hook one attribute, and they run
in its order (the first applied innermost). ``python -m vllm_nwor.patches`` prints it as the
table in docs/design.md, which a test keeps equal to it.
"""

from __future__ import annotations

from vllm_nwor.patches._patch import Patch


def all_patches() -> list[Patch]:
    """The patches applied when the plugin registers, in every process."""
    from vllm_nwor.patches import draft_window, engine_args, synthetic
    from vllm_nwor.patches.nwor import (
        cpu_attn,
        engine_core,
        flash_attn,
        model_runner,
        model_runner_v2,
        worker,
    )
    from vllm_nwor.patches.scv import (
        decode_graphs,
        decode_graphs_v2,
        draft_sync,
        ngram_gpu,
        scheduler,
    )
    from vllm_nwor.patches.telemetry import engine as telemetry_engine
    from vllm_nwor.patches.telemetry import frontend as telemetry_frontend

    return [
        *engine_args.PATCHES,
        *synthetic.PATCHES,
        *model_runner.PATCHES,
        *model_runner_v2.PATCHES,
        *cpu_attn.PATCHES,
        *flash_attn.PATCHES,
        *engine_core.PATCHES,
        *worker.PATCHES,
        *scheduler.PATCHES,
        *draft_window.PATCHES,
        *decode_graphs.PATCHES,
        *decode_graphs_v2.PATCHES,
        *draft_sync.PATCHES,
        *ngram_gpu.PATCHES,
        *telemetry_engine.PATCHES,
        *telemetry_frontend.PATCHES,
    ]


def apply_all() -> int:
    """Applies every patch; returns how many were newly installed (0 when already applied)."""
    return sum(patch.apply() for patch in all_patches())


def inventory_markdown() -> str:
    """The inventory as a Markdown table: each patch in apply order, its feature and its why."""
    rows = ["| attribute | feature | why |", "|---|---|---|"]
    for patch in all_patches():
        feature = patch.wrap.__module__.removeprefix("vllm_nwor.patches.")
        added = " (added)" if patch.new else ""
        why = patch.why.replace("|", "\\|")
        rows.append(f"| `{patch.attribute.removeprefix('vllm.')}`{added} | `{feature}` | {why} |")
    return "\n".join(rows)
