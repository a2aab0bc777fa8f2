"""Draft context window for draft_model: each request is drafted from its last W tokens.

vLLM's V1 runner caps drafting at the draft model's own max length: as soon as one request in
the batch is longer, ``GPUModelRunner._input_fits_in_drafter`` zeroes the drafts of the *whole*
batch. The window hooks V1's draft proposer; on the V2 runner (a GPU's default on vLLM 0.32) the
key is refused at start-up (``patches/engine_args.py``). With ``"draft_context_window": W``:

- the draft's length limit is lifted to the target's (plus the draft steps), and its rotary
  table sized to match, so no request is ever too long to draft and no batch loses its drafts;
- every draft attention layer attends to the last ``W`` tokens only (the backend's own sliding
  window), so the draft sees a context of the length it handles well, however long the request.

The draft layers stay in the target's KV-cache group (same block table, same slots as vLLM's
draft_model path); only their attention is windowed. Positions stay absolute; with rotary
embeddings attention depends on distances only, which the window keeps within ``W``. Rope
scalings that depend on absolute length (``llama3``, ``yarn``, dynamic NTK) are refused.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_nwor._logging import get_logger
from vllm_nwor.config import NworConfigError
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.nwor.model_runner import attention_layers, backend_for
from vllm_nwor.patches.settings import plugin_config

logger = get_logger(__name__)


def lift_draft_limits(vllm_config: Any, window: int) -> None:
    """Front end, at start-up: lets every request be drafted (see the module docstring)."""
    speculative = vllm_config.speculative_config
    if speculative.method != "draft_model":
        raise NworConfigError(
            f"'draft_context_window' applies to method 'draft_model', got {speculative.method!r}"
        )
    target_len = vllm_config.model_config.max_model_len
    if window > target_len:
        raise NworConfigError(
            f"'draft_context_window' is {window}, longer than max_model_len {target_len}; "
            f"allowed: 1 to {target_len}"
        )
    draft = speculative.draft_model_config
    rope = getattr(draft.hf_config, "rope_parameters", None) or getattr(
        draft.hf_config, "rope_scaling", None
    ) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise NworConfigError(
            f"'draft_context_window' needs plain rotary embeddings in the draft model; its "
            f"rope_type is {rope_type!r} (allowed: 'default')"
        )
    limit = target_len + speculative.num_speculative_tokens + 1
    draft.hf_config.max_position_embeddings = max(
        limit, getattr(draft.hf_config, "max_position_embeddings", 0)
    )
    draft.max_model_len = limit
    speculative.max_model_len = limit
    logger.info("Draft context window: draft_model drafts from each request's last %d tokens",
                window)


def _window_draft_layers(model, window: int) -> int:
    layers = attention_layers(model)
    for layer in layers:
        backend_for(layer).window_attention(layer.impl, window)
    return len(layers)


def _wrap_get_model(get_model):
    def wrapper(self):
        model = get_model(self)
        window = plugin_config(self.vllm_config).draft_context_window
        if window:
            _window_draft_layers(model, window)
        return model

    return wrapper


PATCHES = [
    Patch(
        DraftModelProposer,
        "_get_model",
        _wrap_get_model,
        why="Window the draft model's attention to the last W tokens as soon as it is built, "
        "before any attention metadata exists. Retired by a per-request draft window upstream.",
    ),
]
