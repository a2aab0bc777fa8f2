"""Per-position acceptance and the step plan that maximises expected tokens per second.

A request's draft at position ``j`` (1-based) is accepted only if every draft before it was:
its *survival* ``S_j`` is the product of the request's conditional acceptance at positions
``1..j`` (:class:`PositionAcceptance`). A step that verifies ``c_i`` drafts of request ``i``
yields ``1 + S_i1 + ... + S_ic_i`` tokens from it in expectation, and costs the drafter's
passes up to the longest chunk plus the target's forward over the step's tokens
(:class:`StepTable`, from a start-up profile). :func:`plan_chunks` chooses every request's
chunk at once, chunk 0 (plain decoding) included, to maximise the batch's expected tokens per
second of that step.

Not wired to the engine: SCV's scheduler runs :class:`vllm_nwor.scv.ChunkPolicy`.
``python -m benchmarks.tools.scv_sim --survival --varlen-graphs`` compares the two in a
simulated engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_nwor.scv.types import RequestTable


@dataclass(frozen=True)
class StepTable:
    """What a step costs, in seconds, at one batch size: ``draft[D]`` for the drafter's ``D``
    passes (``draft[0]``: none), and ``verify[t]`` for the target's forward over ``t`` tokens
    (padded to the sizes its graphs replay, as the profile measured them)."""

    draft: np.ndarray
    verify: np.ndarray

    def seconds(self, depth: int, tokens: np.ndarray | int) -> np.ndarray:
        tokens = np.minimum(tokens, len(self.verify) - 1)
        return self.draft[depth] + self.verify[tokens]


def plan_chunks(survival: np.ndarray, table: StepTable, plain_tokens: int,
                limits: np.ndarray | None = None) -> np.ndarray:
    """Every request's chunk (0 to ``k``) for one step, maximising expected tokens per second.

    ``survival[i, j]``: the probability that request ``i``'s draft ``j + 1`` is accepted,
    non-increasing along ``j``. ``plain_tokens``: the step's tokens without drafts (one per
    decoding request, and any prompt chunks beside them). ``limits``: each request's largest
    chunk (tokens it may still generate, less one); None: ``k``.

    For a drafting depth ``D``, the best plan that verifies ``B`` drafts takes the ``B`` draft
    slots of highest survival among positions up to ``D``: a request's survival falls along its
    positions, so they are a prefix of each request's. A plan makes ``n + the B highest
    survivals`` tokens in ``draft[D] + verify[plain_tokens + B]`` seconds. The rate to beat,
    ``r``, is that of the best plan for the same requests decoding alone (``plain_tokens = n``:
    the engine's steady rate, as the table prices it), and the plan that makes the most tokens
    less what its seconds would make at ``r`` wins (every ``(D, B)`` is valued, ``D = 0`` being
    plain decoding). Without prompt chunks that is the plan of the highest rate; with them, a
    step's own seconds would make drafts look nearly free, and valued by its own rate such a
    step drafted every request to the full depth.
    """
    n, k = survival.shape
    if n == 0:
        return np.zeros(0, dtype=int)
    positions = np.arange(1, k + 1)
    allowed = np.ones((n, k), dtype=bool) if limits is None else \
        positions[None, :] <= np.asarray(limits)[:, None]
    # Slots in order of survival, a request's earlier position first among equals (a prefix).
    order = np.lexsort((np.broadcast_to(positions, (n, k)).ravel(), -survival.ravel()))
    order = order[allowed.ravel()[order]]
    slot_position = np.broadcast_to(positions, (n, k)).ravel()[order]
    slot_survival = survival.ravel()[order]

    def best(plain: int, rate: float | None) -> tuple[float, int, int]:
        """(value, depth, budget) of the best plan: by tokens per second (``rate`` None), or
        by tokens less ``rate`` times seconds."""
        def value(made, seconds):
            return made / seconds if rate is None else made - rate * seconds

        chosen = (value(n, table.seconds(0, plain)), 0, 0)
        for depth in range(1, k + 1):
            within = slot_position <= depth  # the slots a drafting depth of ``depth`` reaches
            if not within.any():
                break
            budgets = np.arange(1, int(within.sum()) + 1)
            values = value(n + np.cumsum(slot_survival[within]),
                           table.seconds(depth, plain + budgets))
            i = int(np.argmax(values))
            if values[i] > chosen[0]:
                chosen = (float(values[i]), depth, int(budgets[i]))
        return chosen

    _, depth, budget = best(plain_tokens, None)
    if plain_tokens != n:
        _, depth, budget = best(plain_tokens, best(n, None)[0])
    chunks = np.zeros(n, dtype=int)
    if budget:
        slots = order[slot_position <= depth][:budget]
        np.maximum.at(chunks, slots // k, slots % k + 1)
    return chunks


class PositionAcceptance:
    """Each request's probability of accepting its draft at each position given that the drafts
    before it were accepted, forgetting old verdicts.

    A chunk of ``c`` drafts with ``a`` accepted is an acceptance at positions ``1..a`` and, if
    ``a < c``, a rejection at position ``a + 1``; positions past it are not seen. Counts decay by
    ``1 - 1/window`` every step (:meth:`tick`), verified or not, so a request at chunk 0 drifts
    back to the prior and is tried again. The prior at each position is the engine's recent
    verdicts there, pooled over requests (forgetting per verify step), worth one observation,
    with the pool's rate over all positions worth one verdict in it.
    """

    def __init__(self, max_chunk: int, window: int) -> None:
        self.k = max_chunk
        self.decay = 1.0 - 1.0 / window
        self._step = 0
        columns = {f"{kind}{j}": 0.0 for j in range(max_chunk) for kind in ("acc", "rej")}
        self._table = RequestTable(last=0.0, **columns)
        self._pool = np.zeros((2, max_chunk))  # accepted, rejected, by position

    def tick(self) -> None:
        self._step += 1

    def forget(self, req_id: str) -> None:
        self._table.forget(req_id)

    def _counts(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        columns = self._table.columns
        factor = (self.decay ** (self._step - columns["last"][rows]))[:, None]
        accepted = np.stack([columns[f"acc{j}"][rows] for j in range(self.k)], axis=1)
        rejected = np.stack([columns[f"rej{j}"][rows] for j in range(self.k)], axis=1)
        return accepted * factor, rejected * factor

    def observe_many(self, req_ids: Sequence[str], sizes: np.ndarray,
                     accepted: np.ndarray) -> None:
        """One verdict per request (no request twice): ``accepted`` of ``sizes`` drafts."""
        rows = self._table.rows(req_ids)
        old_accepted, old_rejected = self._counts(rows)
        positions = np.arange(self.k)[None, :]
        sizes, accepted = np.asarray(sizes)[:, None], np.asarray(accepted)[:, None]
        hits = (positions < accepted).astype(float)
        misses = ((positions == accepted) & (accepted < sizes)).astype(float)
        columns = self._table.columns
        for j in range(self.k):
            columns[f"acc{j}"][rows] = old_accepted[:, j] + hits[:, j]
            columns[f"rej{j}"][rows] = old_rejected[:, j] + misses[:, j]
        columns["last"][rows] = self._step
        self._pool = self._pool * self.decay + np.stack([hits.sum(0), misses.sum(0)])

    def survival(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[len(req_ids), k]``: each request's probability that its draft at each position is
        accepted (the running product of its conditional rates)."""
        accepted, rejected = self._counts(self._table.rows(req_ids))
        # The pool's rate at each position, with its rate over all positions worth one verdict
        # there (a position no chunk has reached yet is priced as the others are, not at 1/2).
        overall = (self._pool[0].sum() + 0.5) / (self._pool.sum() + 1.0)
        prior = (self._pool[0] + overall) / (self._pool.sum(0) + 1.0)
        rates = (accepted + prior) / (accepted + rejected + 1.0)
        return np.cumprod(rates, axis=1)
