"""GPU kernels for NWOR, each beside its PyTorch reference (same signature) and a checked wrapper.

- :mod:`.stage_kv`: the KV update of a verify step: draft rows to the staging buffer, the rest
  to the paged cache, a drafting request's rows also to its scratch blocks (one launch per
  layer, replacing vLLM's ``reshape_and_cache_flash``).
- :mod:`.scratch`: plans a verify step's scratch blocks, where FlashAttention reads the staged
  chunk, and copies the committed tokens that share them (one launch per step).
- :mod:`.commit_kv`: writes every layer's accepted staged tokens into the paged cache (one launch
  per step).

The wrappers run the Triton kernel on CUDA tensors and the reference otherwise. Triton is
imported lazily, so the package imports on machines without it.
"""
