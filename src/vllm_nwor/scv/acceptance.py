"""Each request's probability that its next draft is accepted (:class:`AcceptanceEstimator`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_nwor.scv.types import RequestTable


class AcceptanceEstimator:
    """Per-request probability that the next draft is accepted, forgetting old steps.

    A chunk of size ``c`` with ``n`` accepted is ``n`` acceptances, plus one rejection when
    ``n < c``. Every step (:meth:`tick`) multiplies all counts by ``1 - 1/window``, whether the
    request verified anything or not, so a request idling at chunk 0 sheds its old rejections
    and a probe can bring it back. The prior is worth one observation: where the traffic is,
    so a new request starts there and a request that never accepts is not kept far from 0.
    For a batch (:meth:`rates`) that is the mean of its requests' own acceptance, each request
    with some evidence counted once: pooling their drafts instead would weigh each request by
    the drafts it was given, and the policy gives most to those that accept (with half the
    requests accepting everything and half nothing, the pool said 0.9, and every new request
    was given drafts until its own rejections outweighed that). Where no request of the batch
    has that much evidence left, it is the other requests' recent verdicts, pooled, with the
    engine's recent acceptance over all drafts worth one observation (the same counts, pooled,
    forgetting per verify step rather than per step; the Jeffreys prior, half an acceptance and
    half a rejection, for the pool). A shared probe gives every idle request one verdict, which
    counts for less than one observation a step later: with the pool alone as the prior, a
    batch of 128 whose traffic had turned (acceptance length 1.5 and 3, then 4) was priced at 0.59
    after a shared probe whose verdicts said 0.89, as the pool still remembered the old
    traffic, and it did not draft until the next shared probe, hundreds of steps later
    (``scv_sim.py --batches 128 --carry``). A request's own verdicts stay out of its prior:
    alone, it would count them twice.
    """

    def __init__(self, window: int) -> None:
        self.decay = 1.0 - 1.0 / window
        self._step = 0
        # own: the share of its verdicts that were acceptances (forgetting scales both alike)
        self._table = RequestTable(accepted=0.0, rejected=0.0, last=0.0, own=0.0)
        self._pool = (0.0, 0.0)  # all requests' accepted and rejected counts, decayed
        self._prior = 0.5

    def tick(self) -> None:
        self._step += 1

    def _decayed(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        columns = self._table.columns
        factor = self.decay ** (self._step - columns["last"][rows])
        return columns["accepted"][rows] * factor, columns["rejected"][rows] * factor

    def observe(self, req_id: str, size: int, accepted: int) -> None:
        self.observe_many([req_id], np.array([size]), np.array([accepted]))

    def observe_many(self, req_ids: Sequence[str], sizes: np.ndarray,
                     accepted: np.ndarray) -> None:
        """One verdict per request (no request twice): ``accepted`` of ``sizes`` drafts."""
        rows = self._table.rows(req_ids)
        old_accepted, old_rejected = self._decayed(rows)
        rejected = (accepted < sizes).astype(float)
        columns = self._table.columns
        new_accepted, new_rejected = old_accepted + accepted, old_rejected + rejected
        columns["accepted"][rows] = new_accepted
        columns["rejected"][rows] = new_rejected
        columns["own"][rows] = new_accepted / (new_accepted + new_rejected)
        columns["last"][rows] = self._step
        # The pool forgets per verify step, not per step: while nothing is verified the
        # traffic's acceptance is what the last verdicts said (forgetting it there drifted the
        # prior to 1/2, and a batch that should not draft drafted again every few windows).
        self._pool = (self._pool[0] * self.decay + float(accepted.sum()),
                      self._pool[1] * self.decay + float(rejected.sum()))
        self._prior = (self._pool[0] + 0.5) / (sum(self._pool) + 1.0)

    def rate(self, req_id: str) -> float:
        return float(self.rates([req_id])[0])

    def rates(self, req_ids: Sequence[str]) -> np.ndarray:
        """Each request's acceptance probability, with the batch's prior (see the class)."""
        accepted, rejected = self._decayed(self._table.rows(req_ids))
        evidence = accepted + rejected
        seen = evidence >= 1.0
        if seen.any():
            prior = float(np.mean(accepted[seen] / evidence[seen]))
        else:  # the other requests' verdicts, pooled, with the engine's pool worth one
            prior = ((accepted.sum() - accepted + self._prior)
                     / (evidence.sum() - evidence + 1.0))
        return (accepted + prior) / (evidence + 1.0)

    def rate_bound(self, req_ids: Sequence[str]) -> float:
        """At least every rate :meth:`rates` gives ``req_ids``, for less: each rate is a mean of
        the request's own share of acceptances and a prior that is a mean of such shares (of
        the batch's requests, or of the others' and the engine's pool), so none is above the
        highest own share or the pool. A subclass that rates otherwise says 1."""
        rows = self._table.rows(req_ids)  # (first: a new request may grow the columns)
        return max(float(self._table.columns["own"][rows].max(initial=0.0)), self._prior)

    def forget(self, req_id: str) -> None:
        self._table.forget(req_id)
