"""Chunk-verify attention (committed prefix + the step's chunk, LSE merge) vs plain causal."""

from __future__ import annotations

import pytest
import torch

from vllm_nwor.nwor.attention import attention_with_lse, chunk_verify_attention, merge_attn_states


def causal_reference(query, keys, values, q_positions, scale):
    """Causal attention of queries at ``q_positions`` over keys at positions 0..len-1."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("mhd,shd->hms", query.double(), k) * scale
    mask = torch.arange(len(keys))[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hms,shd->mhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize(
    "requests",
    [
        # (tokens committed before this step, rows scheduled in this step)
        [(10, 4)],  # verify: last sampled token + 3 drafts
        [(5, 1), (0, 9), (17, 5), (3, 2)],  # decode, first prefill chunk, verify, verify
        [(1, 1)],
        [(30, 3), (8, 6)],  # verify beside a prefill chunk with history
    ],
)
def test_matches_causal_attention_over_the_whole_sequence(requests, num_q_heads, num_kv_heads):
    torch.manual_seed(0)
    dim, scale = 16, 16**-0.5
    seqs, queries, step_k, step_v, qsl, seq_lens = [], [], [], [], [0], []
    for committed, rows in requests:
        seq_len = committed + rows
        k = torch.randn(seq_len, num_kv_heads, dim)
        v = torch.randn(seq_len, num_kv_heads, dim)
        seqs.append((k, v))
        queries.append(torch.randn(rows, num_q_heads, dim))
        step_k.append(k[committed:])
        step_v.append(v[committed:])
        qsl.append(qsl[-1] + rows)
        seq_lens.append(seq_len)
    query = torch.cat(queries)

    def read_prefix(i, n):
        # Only the committed prefix may come from the cache: the step's drafts are not there.
        assert n == seq_lens[i] - (qsl[i + 1] - qsl[i])
        return seqs[i][0][:n], seqs[i][1][:n]

    out = torch.full((len(query) + 2, num_q_heads, dim), 99.0)  # 2 padding rows
    chunk_verify_attention(query, torch.cat(step_k), torch.cat(step_v), qsl, seq_lens,
                           read_prefix, scale, out)
    for i, (k, v) in enumerate(seqs):
        rows = slice(qsl[i], qsl[i + 1])
        positions = torch.arange(seq_lens[i] - (qsl[i + 1] - qsl[i]), seq_lens[i])
        expected = causal_reference(query[rows], k, v, positions, scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.all(out[len(query):] == 99.0)


def test_merge_drops_an_empty_side():
    out = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    empty_out, empty_lse = torch.zeros(3, 2, 4), torch.full((3, 2), float("-inf"))
    torch.testing.assert_close(merge_attn_states(out, lse, empty_out, empty_lse), out)
    torch.testing.assert_close(merge_attn_states(empty_out, empty_lse, out, lse), out)


def test_rows_that_see_nothing_get_zero_and_minus_inf():
    q, k, v = torch.randn(2, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    out, lse = attention_with_lse(q, k, v, torch.zeros(2, 3, dtype=torch.bool), 0.5)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
