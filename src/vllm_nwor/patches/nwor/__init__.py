"""NWOR patches: bind the interceptor to the target layers, stage and commit each verify step
(the model runner, the attention backends, the engine core's scratch blocks, the worker's
counters)."""
