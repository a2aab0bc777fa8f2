"""NWOR (No-Write-On-Reject): draft tokens' K/V staged during verification, only the accepted
prefix committed to the paged cache (:mod:`~vllm_nwor.nwor.staging`), verify attention over the
committed prefix and the staged chunk (:mod:`~vllm_nwor.nwor.attention`), the paged layout it
reads (:mod:`~vllm_nwor.nwor.kv_layout`) and the Triton kernels (:mod:`~vllm_nwor.nwor.kernels`).
Nothing here imports vLLM; :mod:`vllm_nwor.patches.nwor` wires it in."""
