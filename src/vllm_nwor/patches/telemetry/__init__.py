"""Telemetry patches: the step numbers behind the plugin's metrics (chunk sizes, NWOR's counters),
from the engine core to /metrics and the log line. Per-request acceptance lengths are vLLM's own
(docs/telemetry.md)."""
