"""SCV (Speculative Chunk Verify): each request's verify chunk sized from its own acceptance.

Terms (see also :mod:`vllm_nwor.staging`):

spec chunk
    One request's drafts verified in one step (:class:`SpecChunk`). Its accepted prefix is what
    NWOR commits.
chunk size
    How many of a request's drafts are verified, in ``[0, max_chunk]``. Size 0 makes the
    request plain decoding for that step.
probe
    A chunk of size 1 given to a request at size 0 now and then, so that it can come back when
    its acceptance recovers. A due probe goes with the next step that drafts anyway, or else
    waits for the batch's shared probe step: the drafter works for the whole batch whenever one
    request gets a draft, so probes are gathered, not spread. A shared probe step comes
    ``probe_interval`` steps after the last at the soonest, and only when the ledger owes
    nothing: a step planned to learn (a shared probe step, or a random plan at a concurrency
    the cost model does not price yet, see exploration) and the step that verifies its drafts
    owe what they measured over the plain step the cost model prices for them, and every step
    repays ``probe_cost`` of its own measured seconds. So such steps take ``probe_cost`` of the
    engine's time, give or take the last one, whatever they cost: at high concurrency with
    draft_model most of it is the catch-up of the positions the draft skipped (lazy draft
    sync).
exploration
    Where the cost model does not price a concurrency yet (:meth:`StepCostModel.ready`), random
    plans (budgets and chunks, uniform or not); once it prices some concurrency, these are paid
    from the probes' ledger, and while the ledger owes the fit is used as it extrapolates (at
    the end of a run at batch 256 the batch drained through concurrencies never priced, and
    random plans there caught the draft up over hundreds of skipped positions per request).
    And every ``EXPLORE_INTERVAL`` steps, a step that drafts verifies a plan near the chosen
    one (another budget, uniform or not), so that the cost model keeps seeing what other plans
    cost.

The policy maximises the batch's expected output rate in steady state. A request's drafts
are accepted in sequence; with a per-draft acceptance probability ``a`` (estimated per request
from its own history, forgetting old steps), a chunk of size ``c`` yields
``1 + a + ... + a**c`` tokens. A plan is valued by the batch it settles into, where a request
it hurries leaves its slot to the next one sooner (:func:`choose_sizes`), not by its next
step alone. A
step costs (:class:`StepCost`) ``fixed + tokens(scheduled_tokens) + drafting * [D > 0]
+ per_pass * D + per_draft * n * D + off_graph * [no FULL graph] + catching_up * [P > 0]
+ per_caught_up * P`` seconds for ``n`` requests, draft budget ``D`` and ``P`` positions the
lazy draft sync catches up (draft_model: a step at budget 0 skips the drafter, and a request
drafted again first has its skipped positions written; the policy keeps each request's
positions behind as the sync does), fitted online to the engine's own step times at every
concurrency it has seen (:class:`StepCostModel`): nothing is hand-tuned. ``tokens`` is
piecewise linear, its slope falling at 16, 64, 256 and 1,024 tokens where the fit says so: a
forward over few tokens is bound by memory, over many by compute. A step that drafts at all
pays for the drafter's preparation and the rejection sampler (``drafting``); the drafter runs
``D`` passes one after the other, each with its own launches whatever the batch
(``per_pass``), over ``n`` tokens each (``per_draft``). The
``off_graph`` term is what running without a FULL CUDA graph costs: a decode batch replays one
when its requests all verify the same number of drafts (``patches/decode_graphs.py``; any
batch with vLLM's ``cudagraph_mode`` ``FULL``) and it fits vLLM's largest graph; otherwise
it runs PIECEWISE or eagerly. At low concurrency a verified token costs little and long
chunks pay; at high concurrency it costs more and they do not.
Each request's ``j``-th draft is a candidate when ``a**j`` exceeds what its verification time
would buy at the batch's rate. The drafter proposes the same number of drafts for the whole
batch (the draft budget ``D``), so for each ``D`` in ``[0, max_chunk]`` the candidates are
every request at ``D``, and each request at ``min(D, its own limit)``, all of them or only
those whose rate reaches a quantile of the batch's; the best in steady state wins. A request
behind pays its catch-up, spread over the steps it has left, in every plan that drafts it.

The policy plans on the engine core's thread, so its own host time counts where a step is
bound by the host: a batch under the rate floor is planned at chunk 0 from a bound on its rates
(:meth:`AcceptanceEstimator.rate_bound`), without computing them.

This module imports nothing from vLLM; :mod:`vllm_nwor.patches.scheduler` wires it in.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np

MODES = ("off", "fixed", "adaptive")
EXPLORE_INTERVAL = 32
"""Every this many steps, a step that drafts verifies a plan near the chosen one instead."""


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


TOKEN_KNOTS = (16, 64, 256, 1024)
"""Where a step's cost per scheduled token may fall (:class:`StepCost`'s ``below_*`` terms)."""


class StepCost(NamedTuple):
    """Seconds of one engine step: see the module docstring."""

    fixed: float
    per_token: float
    per_pass: float
    per_draft: float
    off_graph: float
    drafting: float = 0.0
    """What a step that drafts at all costs beyond its passes: the drafter's preparation and
    first pass over the verified tokens, the rejection sampler."""
    catching_up: float = 0.0
    """What a step that catches the draft up at all costs beyond its positions (the lazy draft
    sync's pass of the draft model, draft_model): at batch 1 a catch-up over a few positions
    is mostly this."""
    per_caught_up: float = 0.0
    """Cost per position the lazy draft sync catches up in the step: the draft model's pass
    over what a request skipped while it was not drafted."""
    below_16: float = 0.0
    """Cost per scheduled token beyond ``per_token``, for the first 16 tokens of a step (and
    likewise below 64, 256 and 1024, :data:`TOKEN_KNOTS`): a forward over few tokens is bound
    by memory, over many by compute, so its cost per token falls as the step grows."""
    below_64: float = 0.0
    below_256: float = 0.0
    below_1024: float = 0.0

    def seconds(self, requests, tokens, budget, off_graph, caught_up=0):
        """Works on numbers and on numpy arrays alike. Terms at 0 are left out (most are: the
        fit is non-negative), which changes no sum and saves the planner's host time: a step
        at batch 1 is bound by it."""
        total = self.fixed + self.per_token * tokens + self.per_pass * budget  # (its shape)
        if self.per_draft:
            total = total + self.per_draft * requests * budget
        if self.off_graph:
            total = total + self.off_graph * off_graph
        if self.drafting:
            total = total + self.drafting * np.greater(budget, 0)
        if self.per_caught_up:
            total = total + self.per_caught_up * caught_up
        if self.catching_up:
            total = total + self.catching_up * np.greater(caught_up, 0)
        slopes = self._token_slopes()
        if slopes:
            total = total + sum(slope * np.minimum(tokens, knot) for slope, knot in slopes)
        return total

    def per_token_at(self, tokens: float) -> float:
        """What one more scheduled token costs in a step of ``tokens`` tokens."""
        return self.per_token + sum(slope for slope, knot in self._token_slopes()
                                    if tokens < knot)

    def _token_slopes(self):
        """The ``below_*`` terms other than 0, each with its knot."""
        return [(slope, knot) for slope, knot in zip(self[_FIRST_SLOPE:], TOKEN_KNOTS,
                                                     strict=True) if slope]


_FIRST_SLOPE = StepCost._fields.index("below_16")


def cost_features(requests, tokens, budget, off_graph, caught_up=0) -> tuple:
    """A step's row for fitting :class:`StepCost`: one value per field, in order."""
    return (1.0, tokens, budget, requests * budget, float(off_graph), float(budget > 0),
            float(caught_up > 0), caught_up, *(min(tokens, knot) for knot in TOKEN_KNOTS))


def on_full_graph(uniform, tokens, max_graph_tokens: int | None, mixed_graphs: bool = False):
    """Whether a decode step replays a FULL graph: every request has as many tokens, or FULL
    graphs take any batch (``mixed_graphs``: vLLM's ``cudagraph_mode`` ``FULL``, with an
    attention backend that supports it), and the batch fits vLLM's largest graph
    (``max_graph_tokens``; None: there are none). Works on numbers and on numpy arrays alike."""
    return (uniform | mixed_graphs) & (max_graph_tokens is not None
                                       and tokens <= max_graph_tokens)


def concurrency_band(requests: int) -> int:
    """The band of a step with ``requests`` requests: ``b`` for ``[2**(b-1), 2**b)`` (1 is band
    1, 2-3 band 2, ..., 128-255 band 8)."""
    return max(int(requests), 1).bit_length()


class StepCostModel:
    """:class:`StepCost` fitted to the engine's own steps, over every concurrency it has seen.

    The steps are kept by band of concurrency (:func:`concurrency_band`: requests in
    ``[2**(b-1), 2**b)``) and draft budget, the last ``window`` of each, and one fit covers them
    all. A single window of the last steps held one batch size after a while: at batch 1 a
    draft pass's own cost and its cost per request are the same column, the fit split them at
    will, and at batch 32 that priced a pass many times its real cost (on the GPU, SCV then held
    uniform L=3 at chunk 0 in 457 of 489 steps at batch 32, right after the batch-1 cells).
    Kept by band, steps at other batch sizes stay in the fit and tell the two apart. Kept by
    budget too, the plain steps of a batch held at chunk 0 do not push out what its drafting
    steps cost: by band alone, at batch 128 the warm-up's steps at every budget (a step
    verifying 2 drafts per request took 16.4 ms, a plain one 8.5) were gone after 256 plain
    steps, the drafting terms were left to a few compile-slowed steps of the warm-up's smaller
    batches, and the fit priced that step at 31 ms: SCV never drafted where fixed k=2 gained
    13% (``benchmarks/results/scv_b128_fixed2_2026-11-23_h200.json``).

    ``ready(requests)`` is True where the steps seen price that concurrency: its own band has
    ``min_steps`` steps, or bands that have lie on both sides of it (between them the fit
    interpolates; beyond them it would extrapolate). Elsewhere the policy explores (random
    budgets, chunk sizes mixed or uniform), and later it keeps exploring now and then (see
    :class:`ChunkPolicy`), so that the terms stay told apart.

    A step's time is the interval between its output and the previous one's (the scheduler
    patch), and with async scheduling the host prepares and launches the next step before it
    takes a step's output: where the host is what bounds the engine (batch 1 on the H200), an
    interval holds much of the next step's preparation. There the plain step before a shared
    probe took 8.6-9.1 ms, the probe 4.7-6.0 and the step verifying it 3.8, against 4.95 for
    a plain step; fitted to each step's own terms, a step verifying one draft and drafting
    one, 7.3 ms when one followed another, was priced at 6.6 (1.32x a plain step, not 1.47x),
    and at L=1.5 SCV drafted where plain decoding was faster
    (``scv_warm_switch_again_2026-11-24_h200.json``). So each step is fitted to its own terms
    and the next step's (every term but the fixed one, twice; a step's row waits for the next
    step), and a plan is priced as the sum of both, what it costs an engine that runs it step
    after step. Where the GPU bounds the step, the next step's terms fit near 0.

    The fit is by non-negative least squares (each slope of the cost per token too, so that it
    can only fall where the steps say it does), every ``refit_interval`` steps, with three Huber
    reweightings so that a rare slow step (a draft catch-up, a pause of the host) does not move
    it. Every term is a cost, so none may be negative: an unconstrained fit (the first GPU runs
    used recursive least squares) traded a large ``fixed`` against a negative draft cost while
    the budget rarely changed, and clipping that afterwards made every step look like a large
    fixed cost and every draft free (``benchmarks/results/scv_2026-11-22_h200.json``).
    Coefficients given by the user (``scv_cost_model``: fixed, per token, per draft) are used as
    they are, with no cost per pass or off the graphs.
    """

    def __init__(self, window: int = 128, min_steps: int = 32, refit_interval: int = 32,
                 fixed_coefficients: Sequence[float] | None = None) -> None:
        self.window = window
        self.min_steps = min_steps
        self.refit_interval = refit_interval
        # by (band, budget): x (a step's terms, then the next step's but the fixed one), y (a
        # ring of the last `window` steps), and steps observed
        self._rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._counts: dict[tuple[int, int], int] = {}
        self._band_counts: dict[int, int] = {}  # by band: steps observed
        self._pending: tuple | None = None  # the last step: (key, its terms, seconds)
        self._theta = np.zeros(2 * len(StepCost._fields) - 1)  # the fit, as fitted
        self._cost = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self._fits = self._since_fit = 0
        self._fixed = None
        if fixed_coefficients is not None:
            fixed, per_token, per_draft = tuple(fixed_coefficients)[:3]
            self._fixed = StepCost(fixed, per_token, 0.0, per_draft, 0.0)

    @property
    def steps(self) -> int:
        """Steps observed, all bands together."""
        return sum(self._counts.values())

    def observe(self, requests: int, tokens: int, budget: int, seconds: float,
                off_graph: bool = False, caught_up: int = 0) -> None:
        """One step, right after the one observed before it (else :meth:`interrupt` first):
        that one's row is complete now."""
        if seconds <= 0 or tokens <= 0 or self._fixed is not None:
            self._pending = None
            return
        terms = cost_features(requests, tokens, budget, off_graph, caught_up)
        pending, self._pending = self._pending, ((concurrency_band(requests), int(budget)),
                                                 terms, seconds)
        if pending is None:
            return
        key, own, seconds = pending
        if key not in self._rows:
            self._rows[key] = (np.zeros((self.window, len(self._theta))), np.zeros(self.window))
        x, y = self._rows[key]
        row = self._counts.get(key, 0) % self.window
        x[row, :len(own)], x[row, len(own):] = own, terms[1:]
        y[row] = seconds
        self._counts[key] = self._counts.get(key, 0) + 1
        self._band_counts[key[0]] = self._band_counts.get(key[0], 0) + 1
        self._since_fit += 1

    def interrupt(self) -> None:
        """The next step observed will not follow the last one (a step between them was not
        observed): the last one's row is dropped."""
        self._pending = None

    def ready(self, requests: int) -> bool:
        """Whether the steps seen price steps of ``requests`` requests (see the class)."""
        if self._fixed is not None:
            return True
        band = concurrency_band(requests)
        seen = [b for b, count in self._band_counts.items() if count >= self.min_steps]
        return band in seen or (any(b < band for b in seen) and any(b > band for b in seen))

    def priced(self) -> bool:
        """Whether the steps seen price any concurrency (:meth:`ready` somewhere)."""
        return self._fixed is not None or any(
            count >= self.min_steps for count in self._band_counts.values())

    @property
    def coefficients(self) -> StepCost:
        """The current fit (every term at least zero)."""
        if self._fixed is not None:
            return self._fixed
        if self._since_fit and self.steps >= self.min_steps and (
                not self._fits or self._since_fit >= self.refit_interval):
            self._refit()
        return self._cost

    def _refit(self) -> None:
        self._fits += 1
        self._since_fit = 0
        kept = {key: min(count, self.window) for key, count in self._counts.items()}
        x = np.concatenate([self._rows[key][0][:n] for key, n in kept.items()])
        y = np.concatenate([self._rows[key][1][:n] for key, n in kept.items()])
        # A term whose column did not vary (no drafts; every step on the graphs; the same
        # number of tokens) cannot be told apart from the fixed cost: it keeps its last fit,
        # and only the others are fitted to what it leaves. Fitting it anyway set a draft cost
        # to 0 after a window without drafts (drafting looked free) or traded the fixed cost
        # against the per-token one, and the singular columns made the solves fall back to
        # lstsq.
        last = self._theta.copy()
        varies = x.std(axis=0) > 0
        varies[0] = True  # the fixed cost (a column of ones) is always fitted
        y = y - x[:, ~varies] @ last[~varies]
        x = x[:, varies]
        base = self._row_weights(kept)
        theta = nonnegative_least_squares(x, y, base, start=(last > 0)[varies])
        for _ in range(3):  # Huber weights: full weight within two robust deviations
            residual = np.abs(y - x @ theta)
            scale = 1.4826 * float(np.median(residual))
            if scale <= 0:
                break
            huber = np.minimum(1.0, 2.0 * scale / np.maximum(residual, 1e-12))
            theta = nonnegative_least_squares(x, y, huber if base is None else base * huber,
                                              start=theta > 0)
        last[varies] = theta
        self._theta = last
        fields = len(StepCost._fields)  # a plan step after step: its terms and the next's
        self._cost = StepCost(float(last[0]), *(float(a + b) for a, b in zip(
            last[1:fields], last[fields:], strict=True)))

    def _row_weights(self, kept: Mapping[tuple[int, int], int]) -> np.ndarray | None:
        """Each kept step's weight in the fit, in the order :meth:`_refit` stacks them (``kept``:
        by band and budget, the steps kept); None: all alike. A variant of the fit overrides
        this (``benchmarks/scv_fit_replay.py``)."""
        return None


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray,
                              weights: np.ndarray | None = None,
                              start: np.ndarray | None = None) -> np.ndarray:
    """``argmin sum(weights * (x @ theta - y)**2)`` over ``theta >= 0`` (Lawson and Hanson's
    active-set method on the normal equations: a few solves of at most ``columns`` square).

    ``start``: the terms to try first (by column, those a fit of nearly the same steps kept):
    where the fit on them alone keeps every one of them above 0, the search begins there
    instead of from none, and usually ends at once, with the same fit. The cost model refits
    every 32 steps and four times at each (the Huber reweightings); from none, each fit added
    its terms one by one, a solve each."""
    w = np.ones(len(y)) if weights is None else weights
    gram, moment = (x.T * w) @ x, (x.T * w) @ y
    columns = x.shape[1]
    theta = np.zeros(columns)
    passive = np.zeros(columns, dtype=bool)
    tolerance = 1e-10 * max(float(np.abs(moment).max(initial=0.0)), 1e-300)

    def solve(support: np.ndarray) -> np.ndarray:
        z = np.zeros(columns)
        sub_gram, sub_moment = gram[np.ix_(support, support)], moment[support]
        try:
            z[support] = np.linalg.solve(sub_gram, sub_moment)
        except np.linalg.LinAlgError:  # columns that never vary apart: the least-norm fit
            z[support] = np.linalg.lstsq(sub_gram, sub_moment, rcond=None)[0]
        return z

    if start is not None and start.any():
        z = solve(np.flatnonzero(start))
        if (z[start] > 0).all():
            theta, passive = z, start.copy()
    for _ in range(3 * columns):
        gradient = moment - gram @ theta
        candidates = np.where(passive, -np.inf, gradient)
        if passive.all() or candidates.max() <= tolerance:
            break
        passive[int(np.argmax(candidates))] = True
        for _ in range(3 * columns):
            z = solve(np.flatnonzero(passive))
            if (z[passive] > 0).all():
                theta = z
                break
            # Step from theta towards z as far as every term stays at least zero, and drop
            # the terms that reach zero.
            falling = passive & (z <= 0)
            gap = theta[falling] - z[falling]  # > 0 but for a term at 0 staying at 0
            step = float(np.min(np.where(gap > 0, theta[falling] / np.maximum(gap, 1e-300), 0.0)))
            theta = theta + step * (z - theta)
            passive &= theta > tolerance * 1e-6
            theta[~passive] = 0.0
    return theta


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
    the positions it skipped before drafting it again (draft_model,
    :mod:`vllm_nwor.patches.draft_sync`): the policy then keeps each request's positions
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


class ChunkPolicy:
    """Chooses every running request's chunk size each step (see the module docstring)."""

    def __init__(self, settings: ScvSettings, cost: StepCostModel | None = None,
                 seed: int = 0) -> None:
        self.settings = settings
        self.acceptance = AcceptanceEstimator(settings.acceptance_window)
        self.cost = cost or StepCostModel(fixed_coefficients=settings.cost_model)
        self._rng = np.random.default_rng(seed)
        self._plan: dict[str, int] = {}
        self._budget = 0
        self._cuts: list[tuple[str, int]] = []  # planned chunks shorter than the budget
        self.probes: frozenset[str] = frozenset()
        """The requests this step's plan probes."""
        # idle_from: the step a request's current run at chunk 0 began (-1: not at chunk 0);
        # probe_wait: steps at chunk 0 before its next probe; awaiting: a probe's verdict is due.
        # behind: positions without draft K/V (lazy draft sync), as of this step's plan;
        # planned: the request's chunk in the last plan (0 where it was not in it);
        # steps, made: the steps it was planned in and the tokens they made it (choose_sizes'
        # history).
        self._requests = RequestTable(idle_from=-1, probe_wait=settings.probe_interval,
                                      awaiting=0, behind=0, planned=0, steps=0, made=0)
        self._planned_rows = np.zeros(0, dtype=np.intp)  # the last plan's rows
        self._planned_any = False  # whether the last plan gave any request a chunk
        self.caught_up = 0
        """Positions the lazy draft sync catches up in this plan's step (the requests it
        drafts that were behind)."""
        self.budget_counts = [0] * (settings.max_chunk + 1)
        """Planned steps by draft budget (diagnostics)."""
        self.uniform_plans = 0
        """Planned steps where every request got the same chunk (diagnostics)."""
        self.budget_seconds = [[0, 0.0] for _ in range(settings.max_chunk + 1)]
        """Observed steps and their seconds, by draft budget (diagnostics)."""
        self.steps = 0
        """Steps planned so far: the clock of probes and exploration. It is the policy's own,
        not its estimator's: a benchmark that replaced the estimator after its warm-up (fresh
        verdicts, :func:`benchmarks.gpu_engines.warm_every_chunk`) reset the estimator's step
        count, the last shared probe step stayed at the warm-up's, and no shared probe came
        until the new count passed it (on the H200, SCV never drafted in five runs of 258 steps
        at batch 128, uniform L=4, where fixed k=2 gained 12%)."""
        self._last_probe_step = 0  # the last shared probe step
        self._balance = 0.0  # the ledger (observe_step): at most 0; below, what is owed
        self._unpriced: deque[float] = deque(maxlen=3)  # the last learning steps' seconds
        # over their price (observe_step)
        self.learning_step = False
        """Whether this step's plan is one taken to learn: a shared probe step, or a random plan
        where the cost model does not price the concurrency yet (paid from the ledger)."""
        self.learning_excess = [0, 0.0]
        """Steps debited to the ledger and their measured seconds over plain steps
        (diagnostics)."""
        self.unpriced_plans = 0
        """Random plans at a concurrency the cost model did not price (diagnostics)."""

    @property
    def ledger(self) -> float:
        """The probes' ledger in seconds (:meth:`observe_step`): 0, or below it what learning
        steps still owe; no shared probe step comes while it owes."""
        return self._balance

    # -- what happened ---------------------------------------------------------------------

    def observe(self, chunks: Iterable[SpecChunk]) -> None:
        """Records the verdicts of one verify step (at most one chunk per request)."""
        chunks = list(chunks)
        if not chunks:
            return
        req_ids, drafts, _, accepted = zip(*chunks, strict=True)
        sizes = np.fromiter(map(len, drafts), int, len(drafts))
        accepted = np.array(accepted, dtype=int)
        if not sizes.all():  # chunks of size 0 verify nothing
            kept = sizes > 0
            req_ids = [r for r, keep in zip(req_ids, kept.tolist(), strict=True) if keep]
            sizes, accepted = sizes[kept], accepted[kept]
            if not req_ids:
                return
        req_ids = list(req_ids)
        self.acceptance.observe_many(req_ids, sizes, accepted)
        rows = self._requests.rows(req_ids)
        columns = self._requests.columns
        columns["made"][rows] += accepted
        # A rejected draft's position is no position behind: the sequence rolls back over it
        # (a request whose tokens joined its gap this step is behind by more than that).
        behind = columns["behind"]
        behind[rows] -= np.where(behind[rows] > 0, sizes - accepted, 0)
        probed = columns["awaiting"][rows] > 0
        if probed.any():
            # Back off after a failed probe (up to 8x); come back at once after a success.
            interval = self.settings.probe_interval
            rows, accepted = rows[probed], accepted[probed]
            wait = columns["probe_wait"][rows]
            columns["probe_wait"][rows] = np.where(accepted > 0, interval,
                                                   np.minimum(8 * interval, 2 * wait))
            columns["awaiting"][rows] = 0

    def observe_step(self, requests: int, tokens: int, budget: int, seconds: float,
                     uniform: bool = True, learning: bool = False, *, verified: int,
                     caught_up: int = 0) -> None:
        """One step's duration: ``requests`` scheduled, ``tokens`` in all, of which ``verified``
        were drafts being verified, ``budget`` drafts proposed per request after it, the lazy
        draft sync catching up ``caught_up`` positions (:attr:`caught_up` of its plan);
        ``uniform`` when every request had as many tokens; ``learning`` for a step planned to
        learn (:attr:`learning_step` when it was planned) and the step after it, which verified
        its drafts: the ledger owes their measured time over what the cost model prices for the
        same step without drafts (its prompt tokens too: at batch 128 the warm-up's random
        plans fell on steps with 16,000 prompt tokens, each priced as a plain decode step, and
        the 1.1 s they owed kept every shared probe away for the rest of the benchmark). What
        a step took over the fit's price for it counts up to the median of the last three
        learning steps': a surcharge the fit misses on every such step counts in full, one
        step's own (a host pause, a compile) does not; at 1% of a 15 ms step a 0.4 s pause
        kept shared probes away for 2,700 steps. Every step repays ``probe_cost`` of its
        time; nothing is saved beyond that (no burst of learning steps after a quiet
        spell)."""
        if seconds <= 0:
            self.cost.interrupt()  # no step to pair the last one with
            return
        graphs = self.settings.max_graph_tokens
        on_graph = on_full_graph(uniform, tokens, graphs, self.settings.mixed_graphs)
        if 0 <= budget < len(self.budget_seconds):
            self.budget_seconds[budget][0] += 1
            self.budget_seconds[budget][1] += seconds
        self._balance = min(0.0, self._balance + self.settings.probe_cost * seconds)
        if learning and self.cost.priced():
            cost, plain_tokens = self.cost.coefficients, tokens - verified
            plain = cost.seconds(requests, plain_tokens, 0, not on_full_graph(
                plain_tokens == requests, plain_tokens, graphs, self.settings.mixed_graphs))
            # What the step took over its price counts up to the median of the last three
            # learning steps' (one slow step of its own, such as a host pause, does not).
            priced = cost.seconds(requests, tokens, budget, not on_graph, caught_up)
            self._unpriced.append(seconds - priced)
            unpriced = min(seconds - priced, float(np.median(self._unpriced)))
            excess = max(0.0, priced + unpriced - plain)
            self._balance -= excess
            self.learning_excess[0] += 1
            self.learning_excess[1] += excess
        self.cost.observe(requests, tokens, budget, seconds, off_graph=not on_graph,
                          caught_up=caught_up)

    def forget(self, req_id: str) -> None:
        """A request that finished: its history goes."""
        self.acceptance.forget(req_id)
        self._requests.forget(req_id)
        self._plan.pop(req_id, None)

    # -- what to do next -------------------------------------------------------------------

    def plan(self, req_ids: Sequence[str], *,
             remaining: Sequence[int] | Callable[[], Sequence[int]] | None = None,
             scheduled: Mapping[str, int] | None = None) -> dict[str, int]:
        """Chunk sizes for the next verify step of ``req_ids`` (the running batch).

        Called once per scheduler step, also when no request holds drafts. With the lazy draft
        sync (:attr:`ScvSettings.lazy_draft_sync`), ``scheduled`` is every request this step
        runs (prompt chunks too) with its tokens, and ``remaining`` each of ``req_ids``' tokens
        left at most (or a function that returns them, called only where the plan needs them):
        a request behind is drafted only where its catch-up, spread over the steps it has
        left, pays (:func:`choose_sizes`).
        """
        req_ids = list(req_ids)
        rows = self._requests.rows(req_ids)
        sizes = self._choose(req_ids, rows, remaining)
        self._budget = budget = int(sizes.max(initial=0))
        self.caught_up = 0
        if self.settings.lazy_draft_sync and scheduled is not None:
            self.caught_up = self._follow_draft_sync(rows[sizes > 0] if budget else rows[:0],
                                                     scheduled)
        columns = self._requests.columns
        planned = columns["planned"]
        if budget:
            self._plan = dict(zip(req_ids, sizes.tolist(), strict=True))
            planned[self._planned_rows] = 0  # (a row freed since holds 0 again when reused)
            planned[rows] = sizes
        else:  # (a plan of zeros after another leaves every row at 0)
            self._plan = dict.fromkeys(req_ids, 0)
            if self._planned_any:
                planned[self._planned_rows] = 0
        self._planned_rows, self._planned_any = rows, bool(budget)
        columns["steps"][rows] += 1  # each step makes each request one token, and its
        columns["made"][rows] += 1  # accepted drafts (observe)
        asked = self.drafts_asked()
        if budget or asked:
            short = np.flatnonzero(sizes < asked)
            self._cuts = [(req_ids[i], int(sizes[i])) for i in short]
        else:
            self._cuts = []
        self.budget_counts[budget] += 1
        self.uniform_plans += int(sizes.min(initial=budget)) == budget
        return self._plan

    def _follow_draft_sync(self, drafted_rows: np.ndarray, scheduled: Mapping[str, int]) -> int:
        """Each request's positions behind after this step, as the lazy draft sync keeps them:
        at budget 0 every request skips this step's tokens; otherwise the drafted (their rows:
        ``drafted_rows``) catch up (the positions returned) and a request left out stays behind
        if it was, its tokens joining its gap."""
        rows = self._requests.rows(list(scheduled))
        behind = self._requests.columns["behind"]
        tokens = np.fromiter(scheduled.values(), dtype=np.int64, count=len(rows))
        if not self._budget:
            behind[rows] += tokens
            return 0
        caught_up = int(behind[drafted_rows].sum())
        behind[rows] += np.where(behind[rows] > 0, tokens, 0)
        behind[drafted_rows] = 0
        return caught_up

    def _choose(self, req_ids: list[str], rows: np.ndarray,
                remaining: Sequence[int] | Callable[[], Sequence[int]] | None = None
                ) -> np.ndarray:
        """Chunk sizes for ``req_ids`` (``rows``: theirs in the request table)."""
        k = self.settings.max_chunk
        self.probes = frozenset()
        self.learning_step = False
        self.acceptance.tick()
        self.steps += 1
        if self.settings.mode == "fixed":
            return np.full(len(req_ids), k)
        if not self.cost.ready(len(req_ids)) and (not self.cost.priced() or self._balance >= 0):
            # Warm-up at this concurrency: vary the budget and the chunks (mixed or uniform) so
            # the cost model can separate the costs. Once it prices some concurrency, such a
            # plan is paid from the ledger, like a shared probe step; while the ledger owes,
            # the fit is used where it extrapolates.
            self.unpriced_plans += 1
            budget = int(self._rng.integers(0, k + 1))
            if self._rng.random() < 0.5:
                sizes = np.full(len(req_ids), budget)
            else:
                sizes = self._rng.integers(0, budget + 1, size=len(req_ids))
            # A plan that drafts nothing learns nothing and owes nothing (on the H200 such a
            # warm-up step took 786 ms where 350 were priced and owed 0.4 s).
            self.learning_step = self.cost.priced() and bool(sizes.any())
            return sizes
        step = self.steps
        columns = self._requests.columns
        cost = self.cost.coefficients
        graphs, mixed = self.settings.max_graph_tokens, self.settings.mixed_graphs
        floor = _rate_floor(len(req_ids), k, cost, graphs, mixed)
        # A batch whose rates are all at most the floor is kept at chunk 0: what choose_sizes
        # returns, without what it and its arguments cost, nor (under the bound) the rates. At
        # batch 128 on the H200 a plain step is bound by the host, and most steps of a batch
        # kept at chunk 0 end here.
        if floor is not None and self.acceptance.rate_bound(req_ids) < floor - 1e-9:
            rates = None
        else:
            rates = self.acceptance.rates(req_ids)
        if rates is None or (floor is not None and _clipped_max(rates) <= floor):
            sizes = np.zeros(len(req_ids), dtype=int)
        else:
            # The batch is what its requests' own history settled it into (choose_sizes).
            last = columns["planned"][rows]
            history = (columns["made"][rows], columns["steps"][rows])
            catch_up = None
            if self.settings.lazy_draft_sync and remaining is not None and (
                    cost.per_caught_up or cost.catching_up):
                behind = columns["behind"][rows]
                if callable(remaining):
                    remaining = remaining()
                left = np.maximum(np.fromiter(remaining, dtype=float, count=len(req_ids)),
                                  1.0)
                # The pass's own cost shared by the requests behind (drafted together, as a
                # batch that drafts again is).
                pass_share = cost.catching_up / max(int(np.count_nonzero(behind)), 1)
                catch_up = np.where(behind > 0, pass_share + cost.per_caught_up * behind,
                                    0) / left
            sizes = choose_sizes(rates, k, cost, graphs, settled_under=last, history=history,
                                 mixed_graphs=mixed, catch_up=catch_up)
            if step % EXPLORE_INTERVAL == 0 and sizes.any():
                sizes = self._explore_near(sizes)  # keep the cost model's terms apart
        # A request at chunk 0 for probe_wait steps is probed (chunk 1). Probes ride on a step
        # that drafts anyway, or on the shared probe step.
        idle = sizes == 0
        idle_from = np.where(idle, columns["idle_from"][rows], -1)
        idle_from[idle & (idle_from < 0)] = step
        drafting = bool(sizes.any())
        if drafting or step - self._last_probe_step >= self.settings.probe_interval:
            probe = idle & (step - idle_from + 1 >= columns["probe_wait"][rows])
            if probe.any() and not drafting:  # a step drafting only to probe: paid for?
                if self._balance >= 0:  # nothing owed (observe_step)
                    self._last_probe_step = step
                    self.learning_step = True
                else:
                    probe[:] = False
            if probe.any():
                sizes = np.where(probe, 1, sizes)
                idle_from[probe] = -1
                columns["awaiting"][rows[probe]] = 1
                self.probes = frozenset(req_ids[i] for i in np.flatnonzero(probe))
        columns["idle_from"][rows] = idle_from
        return sizes

    def _explore_near(self, sizes: np.ndarray) -> np.ndarray:
        """A plan near the chosen one: the drafting requests' chunks set to a budget up to two
        away, all of them or, when the plan is uniform, half the time half of them. Requests
        at chunk 0 stay there. Without it a budget that never changes leaves the fixed cost and
        the draft costs indistinguishable (and the cost off the graphs, when every plan is
        uniform)."""
        k, budget = self.settings.max_chunk, int(sizes.max(initial=0))
        other = int(np.clip(budget + self._rng.integers(-2, 3), 0, k))
        moved = sizes > 0
        if sizes.min() == budget and self._rng.random() < 0.5:
            moved &= self._rng.random(len(sizes)) < 0.5
        return np.where(moved, other, sizes)

    def current_plan(self) -> dict[str, int]:
        return self._plan

    def cuts(self) -> list[tuple[str, int]]:
        """The current plan's requests whose chunk is shorter than the drafts asked for
        (:meth:`drafts_asked`), with their chunk: the drafts to cut (every other request
        verifies all it drafted)."""
        return self._cuts

    def draft_budget(self) -> int:
        """The longest planned chunk."""
        return self._budget

    def drafts_asked(self) -> int:
        """Drafts the drafter is asked for per request: the draft budget, or what the drafter
        proposes whatever it is asked (:attr:`ScvSettings.drafter_proposes`)."""
        proposes = self.settings.drafter_proposes
        return self._budget if proposes is None else proposes


QUANTILES = np.array([0.0, 0.25, 0.5, 0.75, 0.875])
"""The quantiles of a batch's rates that :func:`choose_sizes` draws only the requests above."""


def choose_sizes(rates: np.ndarray, max_chunk: int, cost: StepCost,
                 max_graph_tokens: int | None = None, *,
                 settled_under: np.ndarray | None = None,
                 history: tuple[np.ndarray, np.ndarray] | None = None,
                 mixed_graphs: bool = False, catch_up: np.ndarray | None = None,
                 exit_early: bool = True) -> np.ndarray:
    """Chunk sizes maximising the batch's output rate in steady state under ``cost``.

    ``rates``: per-request acceptance probabilities. A plan gives request ``i`` a chunk
    ``c_i`` and so ``E_i = 1 + a_i + ... + a_i**c_i`` expected tokens per step. It is valued
    as the batch that plan would settle into, not as the next step: a request stays in its
    slot for as many steps as its length over ``E_i``, and a request that leaves is replaced
    by the next one, so where slots are what is short, a plan that hurries some requests fills
    their slots with others (Little's law). With arrival weights ``w_i`` (how often requests
    like ``i`` arrive, relative to one another) the settled batch holds requests in proportion
    to ``w_i / E_i``, yields ``n * sum(w) / sum(w / E)`` tokens per step (``n`` slots) and
    schedules ``n + n * sum(w * c / E) / sum(w / E)`` tokens. The batch is taken to be what the
    plan ``settled_under`` (each request's chunk; None: 0, requests alike) settled into, so
    ``w_i`` is the ``E_i`` that plan gave request ``i``, and that plan is valued exactly as
    its next step; valuing every plan by its next step
    instead drafted, on the GPU, for the accepting half of a mixed batch at batch 32 to 256
    and lost 3-31% to plain decoding, because the accepting requests left and the batch became
    the rejecting half, each step still paying for a draft pass over every request.

    ``history``: each request's tokens made and steps taken in the batch so far. The batch
    holds what the plans over its requests' stay settled it into, not what the last plan
    would: ``w_i`` is then request ``i``'s tokens per step so far, the last plan's ``E_i``
    counted as one more step. On the H200 a mixed batch at 128 that had decoded plainly for
    fifteen steps met a probe step drafting part of it; taken as settled under that plan, it
    valued drafting for every request above plain decoding, and verified a draft for all 128
    requests for the next 42 steps (``scv_small_warm_2026-11-23_h200.json``).

    ``catch_up``: per request, the seconds its catch-up costs (the lazy draft sync's pass over
    the positions it skipped) per token it has left to generate. A plan that drafts it pays
    that once, spread over the steps it has left (its tokens left over ``E_i``): ``E_i`` times
    ``catch_up`` each step. Without it, a batch near the line between drafting and not went
    back and forth (on the GPU at batch 256, L=3: budget 1 for one to three steps every 15, each
    return catching 256 requests up on 15 positions, several milliseconds on an 11 ms step).

    The plan with budget ``D = max(c)`` replays a FULL graph when its sizes are equal (or
    always, with ``mixed_graphs``) and its tokens are at most ``max_graph_tokens`` (None:
    never). Candidates: for each ``D``, every request at ``D``; and each request at
    ``min(D, its own limit)``, for all requests or only those whose rate is at least one of a
    few quantiles of the batch's rates. A request's limit comes from the marginal test
    ``rate**j > tokens_per_second * per_token_at(tokens)`` (``tokens``: the plan the rate is
    of; ``tokens_per_second`` starts at the full-chunk plan's and is re-estimated from the best
    plan, Dinkelbach iterations). The best candidate wins, so the choice depends on the model
    alone. ``exit_early`` (the default) skips the search where no plan with drafts can win;
    the result is the same.
    """
    n = len(rates)
    if n == 0:
        return np.zeros(0, dtype=int)
    if exit_early and _below_floor(rates, max_chunk, cost, max_graph_tokens, mixed_graphs):
        return np.zeros(n, dtype=int)
    a = np.clip(rates, 1e-9, 1 - 1e-9)
    log_a = np.log(a)
    budgets = np.arange(max_chunk + 1)
    gain = np.cumsum(a ** budgets[:, None], axis=0)  # gain[c, i]: request i's tokens at chunk c
    columns = np.arange(n)
    w = gain[0 if settled_under is None else settled_under, columns]  # arrival weights
    if history is not None:  # each request's tokens per step so far; the plan is one step
        made, steps = history
        w = (made + w) / (steps + 1)
    # charge[c, i]: what drafting request i at chunk c pays for its catch-up each step
    charge = np.zeros_like(gain) if catch_up is None else gain * catch_up
    charge[0] = 0.0

    def settled(sizes):  # the tokens out and in per step of the batch plans ``sizes`` settle into
        share = w / gain[sizes, columns]  # slots held, in proportion
        held = share.sum(axis=-1)
        return n * w.sum() / held, n + n * (share * sizes).sum(axis=-1) / held

    def value(share, share_sizes, charges, budget, lowest):
        """Plans' tokens per second and tokens out per step, from each request's share of the
        slots (``w / E`` at its chunk), that times its chunk, and its catch-up charge (None:
        none), ``[..., n]``; ``budget`` and ``lowest``: each plan's longest and shortest
        chunk."""
        held = share.sum(axis=-1)
        tokens_out, tokens_in = n * w.sum() / held, n + n * share_sizes.sum(axis=-1) / held
        off_graph = ~on_full_graph(lowest == budget, tokens_in, max_graph_tokens, mixed_graphs)
        seconds = cost.seconds(n, tokens_in, budget, off_graph)
        if charges is not None:
            seconds = seconds + charges.sum(-1)
        return tokens_out / np.maximum(seconds, 1e-12), tokens_out

    if exit_early and min(cost) >= 0 and not _drafts_can_win(gain, w, cost, max_graph_tokens,
                                                                mixed_graphs):
        return np.zeros(n, dtype=int)
    # Every request verifying D: the plans that can replay FULL decode graphs.
    uniform_share = w / gain
    uniform_value, uniform_out = value(uniform_share, uniform_share * budgets[:, None],
                                       charge if catch_up is not None else None, budgets,
                                       budgets)
    if exit_early and min(cost) >= 0 and uniform_value[0] > np.max(
            uniform_out[1:] / cost.seconds(n, n, budgets[1:], False), initial=0.0):
        # No plan with drafts can beat none: with budget D a plan yields at most what every
        # request at chunk D does, and costs at least a step of n tokens on the graphs.
        return np.zeros(n, dtype=int)
    uniform_best = int(np.argmax(uniform_value))
    chosen, best = float(uniform_value[uniform_best]), np.full(n, uniform_best)
    if n == 1:  # every plan of one request is uniform: the search above was all of them
        return best
    # The requests whose rate reaches a quantile of the batch's (0, 1/4, 1/2, 3/4, 7/8) are
    # those whose rate reaches the order statistic at or above it (np.quantile took a fifth
    # of the planning's host time).
    floors = np.unique(np.sort(a)[np.ceil((n - 1) * QUANTILES).astype(int)])
    drawn = a >= floors[:, None]  # [floor, n]
    everyone = drawn.all(axis=1)
    tokens_per_second = float(uniform_value[max_chunk])
    tokens_in = n * (1 + max_chunk)  # the plan whose rate tokens_per_second is
    for _ in range(3):
        threshold = tokens_per_second * cost.per_token_at(tokens_in)
        if threshold <= 0:
            limit = np.full(n, max_chunk)
        else:
            with np.errstate(divide="ignore", over="ignore"):
                limit = np.floor(np.log(min(threshold, 1.0)) / log_a)
            limit = np.where(a > threshold, np.minimum(limit, max_chunk), 0).astype(int)
            # Drafting at all must also pay the request's catch-up.
            paid = gain[limit, columns] - 1 > tokens_per_second * (
                cost.per_token_at(tokens_in) * limit + charge[limit, columns])
            limit = np.where(paid, limit, 0)
        # The plans [floor, D]: min(D, limit) for the requests whose rate reaches the floor,
        # else 0 (whose share is w, as gain[0] is 1). Each request's terms at min(D, limit),
        # gathered once, then taken or not by floor. A budget past every limit repeats the
        # plan of the longest limit: left out.
        at = np.minimum(budgets[:int(limit.max()) + 1, None], limit)  # [D, n]
        share = w / gain[at, columns]
        taken = drawn[:, None, :]
        charges = None if catch_up is None else np.where(taken, charge[at, columns], 0.0)
        longest = np.max(limit * drawn, axis=1)  # by floor: the longest limit drawn
        shortest = np.where(everyone, limit.min(), 0)
        values, _ = value(np.where(taken, share, w), np.where(taken, share * at, 0.0), charges,
                          np.minimum(budgets[:len(at)], longest[:, None]),
                          np.minimum(budgets[:len(at)], shortest[:, None]))
        floor, budget = np.unravel_index(int(np.argmax(values)), values.shape)
        if values[floor, budget] > chosen:
            chosen = float(values[floor, budget])
            best = np.where(drawn[floor], at[budget], 0)
        if chosen == tokens_per_second:
            break  # a fixed point: the next iteration would choose the same plan
        tokens_per_second, tokens_in = chosen, float(settled(best)[1])
    return np.array(best, dtype=int)


def _drafts_can_win(gain: np.ndarray, w: np.ndarray, cost: StepCost,
                     max_graph_tokens: int | None, mixed_graphs: bool) -> bool:
    """Whether some plan with drafts might beat the plan without (False: none can), for
    :func:`choose_sizes` (``gain[c, i]``: request ``i``'s tokens at chunk ``c``; ``w``: the
    arrival weights; every term of ``cost`` at least 0).

    A plan with budget ``D`` costs at least ``S_D``, a step of ``n`` tokens at that budget
    (off the graphs where every such plan is), plus ``p`` for each draft it settles into
    (``p``: what a token costs at the most tokens a plan can schedule; the cost per token only
    falls); the plain step costs ``S_0``. With ``choose_sizes``' settled batch, such a plan
    yields more tokens per second than the plain one only if
    ``sum_i w_i * (1 - (S_D / S_0 + v * c_i) / gain[c_i, i]) > 0``, ``v = n * p / S_0``: a
    sum of one term per request, so no plan with budget ``D`` can if no request's best term at
    a chunk up to ``D`` makes it positive (catch-up charges, left out, only add cost). At
    batch 256 on the H200 that keeps L=3 at chunk 0 without the search, which the bound by
    budget alone (every request at chunk ``D``, priced as a step of ``n`` tokens) never did:
    a step's drafts cost mostly per token there, and that bound leaves them out."""
    bars, _ = _bars(gain.shape[1], len(gain) - 1, cost, max_graph_tokens, mixed_graphs)
    if bars is None:
        return True
    terms = 1 - bars[:, :, None] / gain[None]  # [D, c, i]; a chunk over its budget: -inf
    best = terms.max(axis=1)[1:] @ w  # by budget D >= 1
    return bool(np.any(best > -1e-9 * w.sum()))  # a tie (to rounding) is searched


def _below_floor(rates: np.ndarray, max_chunk: int, cost: StepCost,
                 max_graph_tokens: int | None, mixed_graphs: bool) -> bool:
    """Whether every rate is at most the one at which no request's term of
    :func:`_drafts_can_win` is positive (:func:`_rate_floor`): then no plan with drafts can win,
    whatever the weights, and a batch is kept at chunk 0 with none of the search's work. A
    request's term grows with its rate."""
    floor = _rate_floor(len(rates), max_chunk, cost, max_graph_tokens, mixed_graphs)
    return floor is not None and _clipped_max(rates) <= floor


def _clipped_max(rates: np.ndarray) -> float:
    """The highest rate as :func:`choose_sizes` clips it."""
    return min(max(float(rates.max()), 1e-9), 1 - 1e-9)


def _rate_floor(n: int, max_chunk: int, cost: StepCost, max_graph_tokens: int | None,
                mixed_graphs: bool) -> float | None:
    """The rate floor of :func:`_bars` at ``n`` requests; None where there is none to use (no
    request, a negative term of the cost, a plain step that costs nothing)."""
    if n == 0 or min(cost) < 0:
        return None
    bars, floor = _bars(n, max_chunk, cost, max_graph_tokens, mixed_graphs)
    return None if bars is None else floor


_GRID = np.arange(65) / 64  # (:func:`_bars`' grids of rates)


@functools.lru_cache(maxsize=256)
def _bars(n: int, max_chunk: int, cost: StepCost, max_graph_tokens: int | None,
          mixed_graphs: bool) -> tuple[np.ndarray | None, float]:
    """For :func:`_drafts_can_win`, at ``n`` requests: ``bars[D, c] = S_D / S_0 + v * c``
    (infinite for ``c > D``), which a request's ``gain[c]`` must pass for its term to be
    positive (None where the plain step costs nothing), and the rate below which none does
    (with a margin, so that such terms sum below the tie). Cached: a batch's size and the
    cost fit change far less often than steps come."""
    budgets = np.arange(max_chunk + 1)
    # Off the graphs for certain where even the plan of budget D most likely on them is not:
    # the fewest tokens (n + D) with mixed graphs, else every request at D (only uniform plans
    # replay). With D = 0 this is the plain step.
    fewest = n + budgets if mixed_graphs else n * (1 + budgets)
    off = np.logical_not(on_full_graph(True, fewest, max_graph_tokens, mixed_graphs))
    least = cost.seconds(n, n, budgets, off)  # S_D; S_0 is the plain step
    plain = least[0]
    if plain <= 0:
        return None, 0.0
    per_draft_token = n * cost.per_token_at(n * len(budgets)) / plain  # v, the least it can be
    bars = least[:, None] / plain + per_draft_token * budgets[None, :]
    bars[budgets[None, :] > budgets[:, None]] = np.inf
    bars.flags.writeable = False
    # The highest rate at which no chunk's gain (1 + r + ... + r**c) passes its lowest bar
    # less 1e-8 of it (every term then stays below -1e-8): on a grid, then on finer ones
    # between the last rate below and the first above (to 64**-3). Gain grows with the rate.
    target = bars[1:, 1:].min(axis=0) / (1 + 1e-8)  # by chunk c >= 1
    low, high = 0.0, 1.0
    for _ in range(3):
        grid = low + (high - low) * _GRID
        below = (np.cumsum(grid[:, None] ** budgets, axis=1)[:, 1:] <= target).all(axis=1)
        if not below[0]:
            break  # (only at rate 0: no rate is below)
        last = len(grid) - 1 if below.all() else int(np.argmin(below)) - 1
        low, high = float(grid[last]), float(grid[min(last + 1, len(grid) - 1)])
    return bars, low


def expected_tokens(rate: float, size: int) -> float:
    """Expected tokens from one step with ``size`` drafts at per-draft acceptance ``rate``."""
    return 1.0 + sum(rate**j for j in range(1, size + 1))
