"""The plugin's configuration keys, and their validation.

Users set the keys inside ``--speculative-config`` / ``speculative_config=`` next to vLLM's own
keys, or at the top level of ``--additional-config`` / ``additional_config=``::

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "nwor": true}'
    --additional-config '{"nwor": true}'

vLLM rejects unknown keys in the speculative config, so the plugin takes its keys out before vLLM
validates it and carries them in ``VllmConfig.additional_config``, which reaches every process.

Every check here runs at start-up and raises :class:`NworConfigError` (a ``ValueError``) whose
message names the key, the value and what is allowed. This module imports nothing from vLLM.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


class NworConfigError(ValueError):
    """A plugin configuration key or value that cannot be used."""


@dataclass(frozen=True)
class NworConfig:
    """Validated plugin settings. Defaults leave vLLM's behaviour untouched."""

    nwor: bool = False
    """Stage draft tokens' K/V during verification; commit only accepted prefixes."""
    nwor_telemetry: bool | None = None
    """Per-request acceptance lengths in outputs and responses, plugin metrics on /metrics.
    ``None`` (the default) follows the other keys: on exactly when another plugin feature is on
    (``nwor``, ``scv``, ``draft_context_window``, ``synthetic_acceptance_per_request``)."""
    scv: str = "off"
    """Chunk verifier: ``off``, ``fixed`` (every request verifies ``scv_chunk_size`` drafts) or
    ``adaptive`` (each request's chunk sized from its own acceptance and the step cost)."""
    scv_chunk_size: int | None = None
    """Largest chunk; defaults to ``num_speculative_tokens``."""
    scv_probe_interval: int = 16
    """Steps before a request at chunk 0 is probed again (doubling, up to 8x, after failures)."""
    scv_probe_cost: float = 0.01
    """The share of the engine's time that probes of requests at chunk 0 may cost, by the cost
    model's measure: a step that drafts only to probe comes at most that often."""
    scv_acceptance_window: int = 16
    """Steps over which a request's acceptance estimate forgets (its effective memory)."""
    scv_cost_model: list | None = None
    """``[fixed, per_token, per_draft]`` step-cost seconds measured elsewhere, instead of
    fitting them online (the default)."""
    draft_context_window: int | None = None
    """draft_model: draft each request from its last W tokens (no length cap, no batch-wide
    drop of drafts); see ``vllm_nwor.patches.draft_window``."""
    synthetic_acceptance_per_request: bool = False
    """Benchmark feature: honour ``SamplingParams.extra_args["synthetic_acceptance_rate"]``
    (see :mod:`vllm_nwor.synthetic`). Never for production traffic."""

    @property
    def _features(self) -> bool:
        """Whether a plugin feature other than telemetry is switched on."""
        return (
            self.nwor
            or self.scv != "off"
            or self.draft_context_window is not None
            or self.synthetic_acceptance_per_request
        )

    @property
    def telemetry(self) -> bool:
        """Whether telemetry is on: ``nwor_telemetry``, or, when it is unset, whether another
        plugin feature is on."""
        return self._features if self.nwor_telemetry is None else self.nwor_telemetry

    @property
    def enabled(self) -> bool:
        """Whether any plugin feature is switched on."""
        return self._features or self.telemetry

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str = "config") -> NworConfig:
        """Validates plugin keys. ``raw`` must hold plugin keys only."""
        for key, value in raw.items():
            if key not in PLUGIN_KEYS:
                raise NworConfigError(_unknown_key_message(key, value, where))
            _KEYS[key].check(key, value, where)
        return cls(**dict(raw))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Key:
    kind: type
    allowed: str
    choices: tuple = ()
    minimum: int | None = None
    optional: bool = False
    share: bool = False  # a number in (0, 1]

    def check(self, key: str, value: Any, where: str) -> None:
        kinds = (int, float) if self.kind is float else self.kind
        ok = (value is None and self.optional) or (
            isinstance(value, kinds)
            and not (self.kind in (int, float) and isinstance(value, bool))
            and (not self.share or 0 < value <= 1)
            and (not self.choices or value in self.choices)
            and (self.minimum is None or value >= self.minimum)
        )
        if ok and self.kind is list and value is not None:
            ok = len(value) == 3 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value
            )
        if not ok:
            raise NworConfigError(f"{where}: '{key}' must be {self.allowed}, got {value!r}")


_KEYS = {
    "nwor": _Key(bool, "true or false"),
    "nwor_telemetry": _Key(bool, "true, false or null", optional=True),
    "scv": _Key(str, "one of 'off', 'fixed', 'adaptive'", choices=("off", "fixed", "adaptive")),
    "scv_chunk_size": _Key(int, "an integer >= 1 (at most num_speculative_tokens)", minimum=1,
                           optional=True),
    "scv_probe_interval": _Key(int, "an integer >= 1 (steps)", minimum=1),
    "scv_probe_cost": _Key(float, "a number > 0 and <= 1 (share of engine time)", share=True),
    "scv_acceptance_window": _Key(int, "an integer >= 1 (steps)", minimum=1),
    "scv_cost_model": _Key(list, "null or [fixed, per_token, per_draft]: three seconds >= 0",
                           optional=True),
    "draft_context_window": _Key(int, "null or an integer >= 1 (tokens)", minimum=1,
                                 optional=True),
    "synthetic_acceptance_per_request": _Key(bool, "true or false"),
}
PLUGIN_KEYS: tuple[str, ...] = tuple(f.name for f in fields(NworConfig))
assert set(PLUGIN_KEYS) == set(_KEYS)
_PLUGIN_PREFIXES = ("nwor", "scv", "draft_context")
# KV cache dtypes NWOR serves (its commit copies the bytes vLLM wrote). The front end and each
# attention backend refuse the others at start-up.
NWOR_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


def unsupported_kv_cache_dtype(dtype: str) -> str | None:
    """What NWOR's start-up checks say of ``kv_cache_dtype=dtype``; None where it is served."""
    if dtype in NWOR_KV_CACHE_DTYPES:
        return None
    allowed = ", ".join(repr(d) for d in NWOR_KV_CACHE_DTYPES)
    return (f"kv_cache_dtype={dtype!r} (allowed: {allowed}; NWOR with an fp8 KV cache is not "
            "yet tested, docs/gpu.md)")


def _unknown_key_message(key: str, value: Any, where: str) -> str:
    close = difflib.get_close_matches(key, PLUGIN_KEYS, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    allowed = ", ".join(PLUGIN_KEYS)
    return (
        f"{where}: unknown vllm-nwor key '{key}' (value {value!r}){hint} "
        f"The plugin's keys are: {allowed}."
    )


def looks_like_plugin_key(key: str, host_keys: Collection[str] = ()) -> bool:
    """True for the plugin's keys and for near-misses of them (``nwr``, ``nwor_enable``).

    Near-misses are claimed so that a typo gets the plugin's message rather than slipping through
    ``--additional-config`` unnoticed. Keys that resemble nothing of ours are left to vLLM, and so
    are ``host_keys``: vLLM's own keys in that place (``synthetic_acceptance_length`` is close to
    ``synthetic_acceptance_per_request`` but is vLLM's).
    """
    if key in PLUGIN_KEYS:
        return True
    if key in host_keys:
        return False
    if key.lower().startswith(_PLUGIN_PREFIXES):
        return True
    return bool(difflib.get_close_matches(key, PLUGIN_KEYS, n=1, cutoff=0.75))


def split_plugin_keys(
    raw: Mapping[str, Any], host_keys: Collection[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits a dict into (plugin keys and near-misses of them, everything else).

    Keys are normalised like vLLM normalises speculative-config keys (``-`` becomes ``_``).
    """
    ours: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if isinstance(name, str) and looks_like_plugin_key(name, host_keys):
            ours[name] = value
        else:
            rest[key] = value
    return ours, rest


def merge_plugin_settings(
    from_speculative: Mapping[str, Any], from_additional: Mapping[str, Any]
) -> dict[str, Any]:
    """Combines the keys given in both places; the same key with two values is an error."""
    merged = dict(from_additional)
    for key, value in from_speculative.items():
        if key in merged and merged[key] != value:
            raise NworConfigError(
                f"'{key}' is set twice with different values: {value!r} in speculative_config "
                f"and {merged[key]!r} in additional_config. Set it in one place."
            )
        merged[key] = value
    return merged


def config_from_additional(additional_config: Any) -> NworConfig:
    """Reads the validated plugin settings back from ``VllmConfig.additional_config``."""
    if not isinstance(additional_config, Mapping):
        return NworConfig()
    ours, _ = split_plugin_keys(additional_config)
    return NworConfig.from_dict(ours, where="additional_config")
