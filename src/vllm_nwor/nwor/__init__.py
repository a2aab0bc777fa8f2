"""NWOR (No-Write-On-Reject): draft tokens' K/V staged during verification and only the accepted
prefix committed to the paged cache. Nothing here imports vLLM; :mod:`vllm_nwor.patches.nwor`
wires it in.

- :mod:`~vllm_nwor.nwor.interceptor`: a verify step's lifecycle, decided once for all layers:
  begin, stage every layer, then commit the accepted drafts or fall back.
- :mod:`~vllm_nwor.nwor.verify_step`: where the step's drafts sit in the flattened batch, and
  the upload of those indices to the device.
- :mod:`~vllm_nwor.nwor.kv_staging`: where the drafts' K/V wait for the verdict.
- :mod:`~vllm_nwor.nwor.counters`: what NWOR did, and why a step fell back.
- :mod:`~vllm_nwor.nwor.kernels`: the Triton kernels.

Terms used throughout the package:

verify step
    One forward of the target model in which at least one request carries draft tokens.
draft row
    A row of the step's flattened token batch that holds a draft token. As in vLLM, the drafts
    of request ``i`` are its last ``num_draft_tokens[i]`` scheduled tokens; the rows before them
    (the request's last sampled token, or prompt tokens) are not drafts.
staged
    A draft row whose K/V waits for the verdict outside the blocks the scheduler gave its
    request: in scratch KV blocks (:mod:`~vllm_nwor.nwor.kernels.scratch`; on the CPU, also in
    a copy of its rows each layer keeps for the commit).
chunk
    One request's rows in one verify step: its last sampled token and its drafts (or a prompt
    chunk, for a request without drafts). Verify attention reads a drafting request's chunk
    from its scratch blocks, so staged drafts are visible without being in its own blocks.
committed
    A staged token whose draft rejection sampling accepted. Its K/V is written to the paged KV
    cache for every layer, through the one slot mapping all layers share.
rejected
    A staged token whose draft was rejected. Its K/V never reaches a block the scheduler gave a
    request (it was written to a scratch block).
fallback
    The step takes vLLM's plain write path for every token that must be in the cache. Counted by
    :class:`~vllm_nwor.nwor.counters.FallbackReason`. A fallback never loses an accepted
    token's K/V.
"""
