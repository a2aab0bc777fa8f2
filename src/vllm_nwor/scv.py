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
    waits for the batch's shared probe step (every ``probe_interval`` steps): the drafter works
    for the whole batch whenever one request gets a draft, so probes are gathered, not spread.
exploration
    Every ``EXPLORE_INTERVAL`` steps, a step that drafts verifies a plan near the chosen one
    (another budget, uniform or not), so that the cost model keeps seeing what other plans
    cost.

The policy maximises the batch's expected output rate. A request's drafts are accepted in
sequence; with a per-draft acceptance probability ``a`` (estimated per request from its own
history, forgetting old steps), a chunk of size ``c`` yields ``1 + a + ... + a**c`` tokens. A
step costs (:class:`StepCost`) ``fixed + per_token * scheduled_tokens + per_pass * D
+ per_draft * n * D + off_graph * [no FULL graph]`` seconds for ``n`` requests and draft budget
``D``, a linear model fitted online to the engine's own step times: nothing is hand-tuned. The
drafter runs ``D`` passes one after the other, each with its own launches whatever the batch
(``per_pass``), over ``n`` tokens each (``per_draft``). The last term is what running without a
FULL CUDA graph costs: a decode batch replays one when its requests all verify the same number
of drafts (``patches/decode_graphs.py``) and it fits vLLM's largest graph; otherwise it runs
PIECEWISE or eagerly. At low concurrency ``per_token`` is small and long chunks pay; at high
concurrency it is large and they do not. Each request's ``j``-th draft is verified when
``a**j`` exceeds what its verification time would buy at the batch's rate. The drafter
proposes the same number of drafts for the whole batch (the draft budget ``D``), so ``D`` is
chosen by evaluating the batch's rate for each ``D`` in ``[0, max_chunk]``; each request then
verifies ``min(D, its own limit)``, or, where that is worth more once ``off_graph`` is
counted, every request verifies ``D``.

This module imports nothing from vLLM; :mod:`vllm_nwor.patches.scheduler` wires it in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

MODES = ("off", "fixed", "adaptive")
EXPLORE_INTERVAL = 32
"""Every this many steps, a step that drafts verifies a plan near the chosen one instead."""


@dataclass(frozen=True)
class SpecChunk:
    """One request's drafts in one verify step, and how many of them were accepted."""

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


class AcceptanceEstimator:
    """Per-request probability that the next draft is accepted, forgetting old steps.

    A chunk of size ``c`` with ``n`` accepted is ``n`` acceptances, plus one rejection when
    ``n < c``. Every step (:meth:`tick`) multiplies all counts by ``1 - 1/window``, whether the
    request verified anything or not, so a request idling at chunk 0 sheds its old rejections
    and a probe can bring it back. The prior is worth one observation: the engine's recent
    acceptance over all requests (the same counts, pooled and forgetting alike; the Jeffreys
    prior, half an acceptance and half a rejection, for the pool), so a new request starts
    where the traffic is and a request that never accepts is not kept far from 0.
    """

    def __init__(self, window: int) -> None:
        self.decay = 1.0 - 1.0 / window
        self._step = 0
        self._counts: dict[str, tuple[float, float, int]] = {}
        self._pool = (0.0, 0.0)  # all requests' accepted and rejected counts, decayed
        self._prior = 0.5

    @property
    def steps(self) -> int:
        """Ticks so far: the scheduler steps the policy has planned."""
        return self._step

    def tick(self) -> None:
        self._step += 1
        accepted, rejected = self._pool
        self._pool = (accepted * self.decay, rejected * self.decay)
        self._prior = (self._pool[0] + 0.5) / (sum(self._pool) + 1.0)

    def _decayed(self, req_id: str) -> tuple[float, float]:
        accepted, rejected, last = self._counts.get(req_id, (0.0, 0.0, self._step))
        factor = self.decay ** (self._step - last)
        return accepted * factor, rejected * factor

    def observe(self, req_id: str, size: int, accepted: int) -> None:
        old_accepted, old_rejected = self._decayed(req_id)
        rejected = 1.0 if accepted < size else 0.0
        self._counts[req_id] = (old_accepted + accepted, old_rejected + rejected, self._step)
        self._pool = (self._pool[0] + accepted, self._pool[1] + rejected)

    def rate(self, req_id: str) -> float:
        accepted, rejected = self._decayed(req_id)
        return (accepted + self._prior) / (accepted + rejected + 1.0)

    def forget(self, req_id: str) -> None:
        self._counts.pop(req_id, None)


class StepCost(NamedTuple):
    """Seconds of one engine step: see the module docstring."""

    fixed: float
    per_token: float
    per_pass: float
    per_draft: float
    off_graph: float

    def seconds(self, requests, tokens, budget, off_graph):
        """Works on numbers and on numpy arrays alike."""
        return (self.fixed + self.per_token * tokens + self.per_pass * budget
                + self.per_draft * requests * budget + self.off_graph * off_graph)


def on_full_graph(uniform, tokens, max_graph_tokens: int | None):
    """Whether a decode step replays a FULL graph: every request has as many tokens and the
    batch fits vLLM's largest graph (``max_graph_tokens``; None: there are none). Works on
    numbers and on numpy arrays alike."""
    return uniform & (max_graph_tokens is not None and tokens <= max_graph_tokens)


class StepCostModel:
    """:class:`StepCost` fitted to the engine's own steps.

    Fitted to the last ``window`` steps by non-negative least squares, refitted every
    ``refit_interval`` steps, with three Huber reweightings so that a rare slow step (a draft
    catch-up, a pause of the host) does not move the fit. Every term is a cost, so none may be
    negative: an unconstrained fit (the first GPU runs used recursive least squares) traded a
    large ``fixed`` against a negative draft cost while the budget rarely changed, and clipping
    that afterwards made every step look like a large fixed cost and every draft free
    (``benchmarks/results/scv_2026-11-22_h200.json``). ``ready`` stays False until ``min_steps``
    steps were seen; meanwhile the policy explores (random budgets, chunk sizes mixed or
    uniform), and later it keeps exploring now and then (see :class:`ChunkPolicy`), so that
    the terms stay told apart. Coefficients given by the user (``scv_cost_model``: fixed, per
    token, per draft) are used as they are, with no cost per pass or off the graphs.
    """

    def __init__(self, window: int = 256, min_steps: int = 32, refit_interval: int = 32,
                 fixed_coefficients: Sequence[float] | None = None) -> None:
        self.window = window
        self.min_steps = min_steps
        self.refit_interval = refit_interval
        self.steps = 0
        self._x = np.zeros((window, len(StepCost._fields)))
        self._y = np.zeros(window)
        self._cost = StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        self._fits = self._since_fit = 0
        self._fixed = None
        if fixed_coefficients is not None:
            fixed, per_token, per_draft = tuple(fixed_coefficients)[:3]
            self._fixed = StepCost(fixed, per_token, 0.0, per_draft, 0.0)

    def observe(self, requests: int, tokens: int, budget: int, seconds: float,
                off_graph: bool = False) -> None:
        if seconds <= 0 or tokens <= 0 or self._fixed is not None:
            return
        row = self.steps % self.window
        self._x[row] = (1.0, tokens, budget, requests * budget, float(off_graph))
        self._y[row] = seconds
        self.steps += 1
        self._since_fit += 1

    def _refit(self) -> None:
        self._fits += 1
        self._since_fit = 0
        n = min(self.steps, self.window)
        x, y = self._x[:n], self._y[:n]
        theta = nonnegative_least_squares(x, y)
        for _ in range(3):  # Huber weights: full weight within two robust deviations
            residual = np.abs(y - x @ theta)
            scale = 1.4826 * float(np.median(residual))
            if scale <= 0:
                break
            theta = nonnegative_least_squares(
                x, y, np.minimum(1.0, 2.0 * scale / np.maximum(residual, 1e-12)))
        self._cost = StepCost(*(float(v) for v in theta))

    @property
    def ready(self) -> bool:
        return self._fixed is not None or self.steps >= self.min_steps

    @property
    def coefficients(self) -> StepCost:
        """The current fit (every term at least zero)."""
        if self._fixed is not None:
            return self._fixed
        if self.ready and self._since_fit and (
                not self._fits or self._since_fit >= self.refit_interval):
            self._refit()
        return self._cost


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray,
                              weights: np.ndarray | None = None) -> np.ndarray:
    """``argmin sum(weights * (x @ theta - y)**2)`` over ``theta >= 0``, for a few columns.

    The solution is the unconstrained fit on its own support, so every support is tried (31
    for five columns, each a solve of at most 5 x 5 normal equations) and the best fit that is
    non-negative wins.
    """
    w = np.ones(len(y)) if weights is None else weights
    gram, moment, total = (x.T * w) @ x, (x.T * w) @ y, float(w @ (y * y))
    columns = x.shape[1]
    best, best_error = np.zeros(columns), total
    for mask in range((1 << columns) - 1, 0, -1):  # the full support first
        support = [c for c in range(columns) if mask >> c & 1]
        sub_gram, sub_moment = gram[np.ix_(support, support)], moment[support]
        try:
            coef = np.linalg.solve(sub_gram, sub_moment)
        except np.linalg.LinAlgError:  # columns that never vary together: the least-norm fit
            coef = np.linalg.lstsq(sub_gram, sub_moment, rcond=None)[0]
        if (coef < 0).any():
            continue
        theta = np.zeros(columns)
        theta[support] = coef
        if mask == (1 << columns) - 1:
            return theta  # the unconstrained fit is non-negative: it is the answer
        error = total - 2.0 * float(theta @ moment) + float(theta @ gram @ theta)
        if error < best_error:
            best, best_error = theta, error
    return best


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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"scv mode {self.mode!r} is not one of {MODES}")
        if self.max_chunk < 0 or self.probe_interval < 1 or self.acceptance_window < 1:
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
        self._probes: set[str] = set()  # planned this step
        self._awaiting_probe: set[str] = set()  # planned, verdict not seen yet
        self._idle_steps: dict[str, int] = {}
        self._probe_wait: dict[str, int] = {}
        self.budget_counts = [0] * (settings.max_chunk + 1)
        """Planned steps by draft budget (diagnostics)."""
        self.uniform_plans = 0
        """Planned steps where every request got the same chunk (diagnostics)."""

    # -- what happened ---------------------------------------------------------------------

    def observe(self, chunks: Iterable[SpecChunk]) -> None:
        """Records the verdicts of one verify step."""
        for chunk in chunks:
            if chunk.size == 0:
                continue
            self.acceptance.observe(chunk.req_id, chunk.size, chunk.accepted)
            if chunk.req_id in self._awaiting_probe:
                self._awaiting_probe.discard(chunk.req_id)
                # Back off after a failed probe (up to 8x); come back at once after a success.
                interval = self.settings.probe_interval
                wait = self._probe_wait.get(chunk.req_id, interval)
                self._probe_wait[chunk.req_id] = (
                    interval if chunk.accepted else min(8 * interval, 2 * wait)
                )

    def observe_step(self, requests: int, tokens: int, budget: int, seconds: float,
                     uniform: bool = True) -> None:
        """One step's duration: ``requests`` scheduled, ``tokens`` in all, ``budget`` drafts
        proposed per request after it; ``uniform`` when every request had as many tokens."""
        on_graph = on_full_graph(uniform, tokens, self.settings.max_graph_tokens)
        self.cost.observe(requests, tokens, budget, seconds, off_graph=not on_graph)

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)
        self._probes.discard(req_id)
        self._awaiting_probe.discard(req_id)
        for table in (self._plan, self._idle_steps, self._probe_wait):
            table.pop(req_id, None)

    # -- what to do next -------------------------------------------------------------------

    def plan(self, req_ids: Sequence[str]) -> dict[str, int]:
        """Chunk sizes for the next verify step of ``req_ids`` (the running batch).

        Called once per scheduler step, also when no request holds drafts.
        """
        self._plan = self._choose(req_ids)
        sizes = set(self._plan.values())
        self.budget_counts[max(sizes, default=0)] += 1
        self.uniform_plans += len(sizes) <= 1
        return self._plan

    def _choose(self, req_ids: Sequence[str]) -> dict[str, int]:
        k = self.settings.max_chunk
        self._probes = set()
        self.acceptance.tick()
        if self.settings.mode == "fixed":
            return dict.fromkeys(req_ids, k)
        if not self.cost.ready:
            # Warm-up: vary the budget and the chunks (mixed or uniform) so the cost model can
            # separate the costs.
            budget = int(self._rng.integers(0, k + 1))
            if self._rng.random() < 0.5:
                return dict.fromkeys(req_ids, budget)
            sizes = self._rng.integers(0, budget + 1, size=len(req_ids))
            return {r: int(s) for r, s in zip(req_ids, sizes, strict=True)}
        rates = np.array([self.acceptance.rate(r) for r in req_ids])
        sizes = choose_sizes(rates, k, self.cost.coefficients, self.settings.max_graph_tokens)
        shared_step = self.acceptance.steps % self.settings.probe_interval == 0
        if self.acceptance.steps % EXPLORE_INTERVAL == 0 and sizes.any():
            sizes = self._explore_near(sizes)  # keep the cost model's terms apart
        # Probes ride on a step that drafts anyway, or on the shared probe step.
        probe_now = sizes.any() or shared_step
        plan = {}
        for req_id, size in zip(req_ids, sizes.tolist(), strict=True):
            idle = self._idle_steps.get(req_id, 0) + 1 if size == 0 else 0
            wait = self._probe_wait.get(req_id, self.settings.probe_interval)
            if idle and idle >= wait and probe_now:
                size, idle = 1, 0
                self._probes.add(req_id)
                self._awaiting_probe.add(req_id)
            self._idle_steps[req_id] = idle
            plan[req_id] = size
        return plan

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

    def known_requests(self) -> set[str]:
        return set(self._plan) | set(self._idle_steps) | set(self._probe_wait)

    def draft_budget(self) -> int:
        """Drafts the drafter should propose per request: the longest planned chunk."""
        if self.settings.mode == "fixed":
            return self.settings.max_chunk
        return max(self._plan.values(), default=0)


def choose_sizes(rates: np.ndarray, max_chunk: int, cost: StepCost,
                 max_graph_tokens: int | None = None) -> np.ndarray:
    """Chunk sizes maximising the batch's expected tokens per second under ``cost``.

    ``rates``: per-request acceptance probabilities. A plan of ``n`` requests with budget
    ``D = max(sizes)`` has ``n + sum(sizes)`` tokens, and replays a FULL graph when its sizes
    are equal and its tokens at most ``max_graph_tokens`` (None: never). Each request's own
    limit comes from the marginal test ``rate**j > tokens_per_second * per_token``; for each
    budget ``D`` the plan is ``min(D, limit)`` per request, or ``D`` for every request, and the
    best of them all is chosen. ``tokens_per_second`` starts at the full-chunk plan's rate and
    is re-estimated from the best plan (Dinkelbach iterations), so the choice depends on the
    model alone.
    """
    n = len(rates)
    if n == 0:
        return np.zeros(0, dtype=int)
    a = np.clip(rates, 1e-9, 1 - 1e-9)
    # gain[c, i]: expected tokens of request i with chunk c.
    powers = a[None, :] ** np.arange(max_chunk + 1)[:, None]
    gain = np.cumsum(powers, axis=0)
    budgets = np.arange(max_chunk + 1)

    def value(tokens_out, tokens_in, uniform):
        off_graph = ~on_full_graph(uniform, tokens_in, max_graph_tokens)
        return tokens_out / np.maximum(cost.seconds(n, tokens_in, budgets, off_graph), 1e-12)

    # Every request verifying D: the plans that can replay FULL decode graphs.
    uniform_value = value(gain.sum(axis=1), n * (1 + budgets), np.ones(len(budgets), bool))
    best = np.zeros(n, dtype=int)
    tokens_per_second = float(uniform_value[max_chunk])
    for _ in range(3):
        threshold = tokens_per_second * cost.per_token
        if threshold <= 0:
            limit = np.full(n, max_chunk)
        else:
            with np.errstate(divide="ignore", over="ignore"):
                limit = np.floor(np.log(min(threshold, 1.0)) / np.log(a)).astype(int)
            limit = np.clip(np.where(a**1 > threshold, limit, 0), 0, max_chunk)
        sizes = np.minimum(budgets[:, None], limit[None, :])  # [D, n]
        values = np.concatenate([
            value(np.take_along_axis(gain, sizes, axis=0).sum(axis=1), n + sizes.sum(axis=1),
                  sizes.min(axis=1) == sizes.max(axis=1)),
            uniform_value])
        choice = int(np.argmax(values))
        best = sizes[choice] if choice <= max_chunk else np.full(n, choice - max_chunk - 1)
        if float(values[choice]) == tokens_per_second:
            break  # a fixed point: the next iteration would choose the same plan
        tokens_per_second = float(values[choice])
    return best


def expected_tokens(rate: float, size: int) -> float:
    """Expected tokens from one step with ``size`` drafts at per-draft acceptance ``rate``."""
    return 1.0 + sum(rate**j for j in range(1, size + 1))
