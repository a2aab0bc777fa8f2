"""Verify attention over the committed prefix and the step's chunk: the PyTorch reference.

In a staged verify step a request's draft K/V are not in the paged KV cache, so its attention is
computed in two parts and merged by log-sum-exp. A request whose step schedules ``q`` rows (its
last sampled token and its drafts, or a prompt chunk) at positions ``[c, c + q)``, with ``c``
tokens committed before the step:

- prefix part: attention over the cache's ``c`` committed tokens, all visible to every row;
- chunk part: causal attention over the step's own ``q`` rows, read from the layer's key/value
  inputs (so staged drafts are seen without ever being in the cache);

and ``merge_attn_states`` of the two equals causal attention over all keys ``<= p`` for the row
at position ``p``. The same split serves every request in the batch, with or without drafts.

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
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    read_prefix: ReadPrefix,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attention for a whole batch: each request's committed prefix merged with its chunk.

    Args:
        query: ``[N, Hq, D]``; key, value: ``[N, Hkv, D]``: the step's rows, flattened batch.
        query_start_loc: ``[B + 1]`` row offsets per request.
        seq_lens: ``[B]`` tokens per request after this step (committed + scheduled).
        read_prefix: reads a request's first ``n`` tokens' K/V from the paged cache.
        out: ``[>= N, Hq, D]`` written in place for the batch's rows and returned.
    """
    for i, seq_len in enumerate(seq_lens):
        q_start, q_end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        num_q = q_end - q_start
        if num_q == 0:
            continue
        committed = int(seq_len) - num_q
        q = query[q_start:q_end]
        prefix_k, prefix_v = read_prefix(i, committed)
        everything = torch.ones(num_q, committed, dtype=torch.bool, device=query.device)
        result, lse = attention_with_lse(q, prefix_k, prefix_v, everything, scale)
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=query.device).tril()
        chunk_out, chunk_lse = attention_with_lse(
            q, key[q_start:q_end], value[q_start:q_end], causal, scale
        )
        out[q_start:q_end] = merge_attn_states(result, lse, chunk_out, chunk_lse).to(out.dtype)
    return out
