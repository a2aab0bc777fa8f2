"""SCV patches: the scheduler's per-request chunk cut and draft budget, and the runner's parts that
follow it (on the V1 runner: lazy draft sync, FULL decode graphs per chunk size, ngram_gpu's
wait; on the V2 runner: vLLM's varlen decode graphs)."""
