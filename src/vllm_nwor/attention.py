"""Verify attention over the committed prefix and the staged chunk: the PyTorch reference.

In a staged verify step a request's draft K/V are not in the paged KV cache, so its attention is
computed in two parts and merged by log-sum-exp. For a query row at position ``p`` of a request
with ``c`` tokens in the cache (the committed prefix) and ``d`` staged tokens at positions
``[c, c + d)``:

- prefix part: causal attention over the cache, keys at positions ``<= min(p, c - 1)``;
- chunk part: causal attention over the staged chunk, keys at positions ``c .. p``;

and ``merge_attn_states`` of the two equals causal attention over all keys ``<= p``. Requests
without drafts have ``d = 0`` and reduce to ordinary causal attention over the cache.

This module is the reference the GPU kernels are tested against, and the path the CPU backend
uses. It imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ReadPrefix = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(request_index, num_tokens) -> (key, value)``, each ``[num_tokens, num_kv_heads, head]``."""


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention returning its log-sum-exp, in float32.

    Args:
        query: ``[M, Hq, D]``. key, value: ``[S, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA).
        mask: ``[M, S]`` bool, True where query ``m`` may attend to key ``s``.

    Returns:
        ``out [M, Hq, D]`` and ``lse [M, Hq]``. Rows that attend to nothing get ``out = 0``
        and ``lse = -inf``, so they drop out of a merge.
    """
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,shd->hms", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, M]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hms,shd->mhd", probs, v)
    return out, lse.transpose(0, 1)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combines two attention results over disjoint key sets (``out [M, H, D]``, ``lse [M, H]``)."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * w_a + out_b * w_b


def chunk_verify_attention(
    query: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    num_staged: Sequence[int],
    read_prefix: ReadPrefix,
    staged_key: torch.Tensor,
    staged_value: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attention for a whole batch, each request over its cached prefix plus its staged chunk.

    Args:
        query: ``[N, Hq, D]`` rows of the flattened batch.
        query_start_loc: ``[B + 1]`` row offsets per request.
        seq_lens: ``[B]`` tokens per request after this step, staged ones included.
        num_staged: ``[B]`` staged tokens per request (the last rows of its query).
        read_prefix: reads a request's first ``n`` tokens' K/V from the paged cache.
        staged_key, staged_value: ``[sum(num_staged), Hkv, D]`` in request order.
        out: ``[>= N, Hq, D]`` written in place for the batch's rows and returned.
    """
    staged_start = 0
    for i, seq_len in enumerate(seq_lens):
        q_start, q_end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        num_q, d = q_end - q_start, int(num_staged[i])
        if num_q == 0:
            continue
        cached = int(seq_len) - d
        positions = torch.arange(int(seq_len) - num_q, int(seq_len), device=query.device)
        q = query[q_start:q_end]

        prefix_k, prefix_v = read_prefix(i, cached)
        prefix_pos = torch.arange(cached, device=query.device)
        result, lse = attention_with_lse(
            q, prefix_k, prefix_v, prefix_pos[None, :] <= positions[:, None], scale
        )
        if d:
            chunk_pos = torch.arange(cached, cached + d, device=query.device)
            chunk_out, chunk_lse = attention_with_lse(
                q,
                staged_key[staged_start : staged_start + d],
                staged_value[staged_start : staged_start + d],
                chunk_pos[None, :] <= positions[:, None],
                scale,
            )
            result = merge_attn_states(result, lse, chunk_out, chunk_lse)
            staged_start += d
        out[q_start:q_end] = result.to(out.dtype)
    return out
