"""SCV patches: the scheduler's per-request chunk cut and draft budget, and the runner's parts that
follow it (lazy draft sync, FULL decode graphs per chunk size, ngram_gpu's wait)."""
