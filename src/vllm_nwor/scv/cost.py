"""What an engine step costs: the terms (:class:`StepCost`) and their online fit
(:class:`StepCostModel`, non-negative least squares over the engine's own steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

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
    will, and at larger batches that priced a pass many times its real cost. Kept by band,
    steps at other batch sizes stay in the fit and tell the two apart. Kept by
    budget too, the plain steps of a batch held at chunk 0 do not push out what its drafting
    steps cost: by band alone, the warm-up's steps at every budget were soon pushed out by plain
    steps, the drafting terms were left to a few compile-slowed warm-up steps, and the fit
    overpriced drafting where it paid (docs/scv.md).

    ``ready(requests)`` is True where the steps seen price that concurrency: its own band has
    ``min_steps`` steps, or bands that have lie on both sides of it (between them the fit
    interpolates; beyond them it would extrapolate). Elsewhere the policy explores (random
    budgets, chunk sizes mixed or uniform), and later it keeps exploring now and then (see
    :class:`ChunkPolicy`), so that the terms stay told apart.

    A step's time is the interval between its output and the previous one's (the scheduler
    patch), and with async scheduling the host prepares and launches the next step before it
    takes a step's output: where the host is what bounds the engine (small batches on a fast
    GPU), an interval holds much of the next step's preparation, and a fit of each step's own
    terms underpriced steps that draft, so SCV drafted where plain decoding was faster
    (docs/scv.md). So each step is fitted to its own terms
    and the next step's (every term but the fixed one, twice; a step's row waits for the next
    step), and a plan is priced as the sum of both, what it costs an engine that runs it step
    after step. Where the GPU bounds the step, the next step's terms fit near 0.

    The fit is by non-negative least squares (each slope of the cost per token too, so that it
    can only fall where the steps say it does), every ``refit_interval`` steps, with three Huber
    reweightings so that a rare slow step (a draft catch-up, a pause of the host) does not move
    it. Every term is a cost, so none may be negative: an unconstrained fit (the first GPU runs
    used recursive least squares) traded a large ``fixed`` against a negative draft cost while
    the budget rarely changed, and clipping that afterwards made every step look like a large
    fixed cost and every draft free.
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
        this (``benchmarks/tools/scv_fit_replay.py``)."""
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
