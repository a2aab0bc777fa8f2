"""GPU kernels for NWOR, each beside its PyTorch reference (same signature) and a checked wrapper.

- :mod:`.scratch`: plans a verify step's scratch blocks (one launch per step): the slots through
  which vLLM's own KV write puts a drafting request's rows there, the block table through which
  FlashAttention reads them, and the committed tokens that share those blocks.
- :mod:`.commit_kv`: copies every layer's accepted rows from the scratch blocks to their own
  slots in the paged cache (one launch per step).

The wrappers run the Triton kernel on CUDA tensors and the reference otherwise. Triton is
imported lazily, so the package imports on machines without it.
"""
