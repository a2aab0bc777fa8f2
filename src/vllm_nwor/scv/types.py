"""SCV's shared types: a verified chunk, the policy's settings, and per-request numpy columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np

MODES = ("off", "fixed", "adaptive")


class SpecChunk(NamedTuple):
    """One request's drafts in one verify step, and how many of them were accepted.

    A named tuple: the scheduler builds one per verified request per step."""

    req_id: str
    draft_token_ids: tuple[int, ...]
    first_position: int
    """Sequence position of the first draft."""
    accepted: int
    """Length of the accepted prefix (drafts), as rejection sampling decided."""

    @property
    def size(self) -> int:
        return len(self.draft_token_ids)

    @property
    def positions(self) -> range:
        return range(self.first_position, self.first_position + self.size)


class RequestTable:
    """Per-request numbers in numpy columns, one row per request.

    The policy reads and writes a whole batch's rows each step; one pass over the request ids
    finds the rows (:meth:`rows`), and the rest is numpy, not a Python loop per request.
    Rows of forgotten requests are reused.
    """

    def __init__(self, **defaults: float) -> None:
        self._defaults = defaults
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._last: tuple[list[str] | None, np.ndarray] = (None, np.zeros(0, dtype=np.intp))
        self.columns = {name: np.full(16, value) for name, value in defaults.items()}

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._index

    def rows(self, req_ids: Sequence[str]) -> np.ndarray:
        """The rows of ``req_ids``, in order (read-only); requests not seen before get rows of
        defaults. The last answer is kept for the same ids: a step asks for its batch's rows
        several times."""
        if req_ids == self._last[0]:
            return self._last[1]
        index = self._index
        try:
            rows = np.fromiter(map(index.__getitem__, req_ids), dtype=np.intp,
                               count=len(req_ids))
        except KeyError:  # new requests: a row each
            rows = np.fromiter(map(index.get, req_ids, repeat(-1)), dtype=np.intp,
                               count=len(req_ids))
            for i in np.flatnonzero(rows < 0).tolist():
                req_id = req_ids[i]
                if req_id not in index:  # (it may come twice)
                    index[req_id] = self._new_row()
                rows[i] = index[req_id]
        rows.flags.writeable = False
        self._last = (list(req_ids), rows)
        return rows

    def _new_row(self) -> int:
        if self._free:
            row = self._free.pop()
        else:
            row = len(self._index)
            capacity = len(next(iter(self.columns.values()), ()))
            if row >= capacity:
                for name, column in self.columns.items():
                    grown = np.full(2 * capacity, self._defaults[name], dtype=column.dtype)
                    grown[:capacity] = column
                    self.columns[name] = grown
        for name, column in self.columns.items():
            column[row] = self._defaults[name]
        return row

    def forget(self, req_id: str) -> None:
        row = self._index.pop(req_id, None)
        if row is not None:
            self._free.append(row)
            self._last = (None, self._last[1])


@dataclass(frozen=True)
class ScvSettings:
    mode: str
    max_chunk: int
    probe_interval: int
    acceptance_window: int
    cost_model: tuple[float, float, float] | None = None
    """(fixed, per_token, per_draft) seconds measured elsewhere; None fits a
    :class:`StepCost` online."""
    max_graph_tokens: int | None = None
    """The most tokens a FULL decode graph takes (vLLM's largest capture size); None: no
    FULL decode graphs."""
    mixed_graphs: bool = False
    """Whether FULL graphs also take batches whose requests verify different numbers of
    drafts (vLLM's ``cudagraph_mode`` ``FULL``); otherwise only uniform ones do."""
    lazy_draft_sync: bool = False
    """Whether a step at draft budget 0 skips the drafter, which then catches a request up on
    the positions it skipped before drafting it again (draft_model on the V1 runner,
    :mod:`vllm_nwor.patches.scv.draft_sync`): the policy then keeps each request's positions
    behind and prices their catch-up."""
    probe_cost: float = 0.01
    """The share of the engine's measured time that learning steps may cost: shared probe
    steps, and random plans at a concurrency the cost model does not price yet."""
    drafter_proposes: int | None = None
    """The drafts a drafter proposes whatever it is asked for (ngram_gpu proposes all k); None:
    the drafter proposes the draft budget. Every request planned shorter is cut."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"scv mode {self.mode!r} is not one of {MODES}")
        if (self.max_chunk < 0 or self.probe_interval < 1 or self.acceptance_window < 1
                or not 0 < self.probe_cost <= 1):
            raise ValueError(f"invalid SCV settings {self}")
