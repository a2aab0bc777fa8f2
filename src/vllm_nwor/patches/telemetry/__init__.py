"""Telemetry patches: per-request acceptance lengths from the scheduler to outputs, responses and
/metrics (docs/telemetry.md)."""
