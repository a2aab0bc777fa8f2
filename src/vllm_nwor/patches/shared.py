"""What one feature's patches leave on vLLM's objects for another feature's, so that the
feature packages (``nwor/``, ``scv/``, ``telemetry/``) never import each other."""

CHUNK_ZERO_ATTR = "_nwor_chunk_zero_requests"
"""Set in the scheduler's ``__dict__`` by SCV in every step it plans: how many of the step's
requests run at chunk 0 (decode without drafts). Telemetry takes it for its chunk-size
histogram; absent without SCV."""
