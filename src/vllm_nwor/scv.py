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

The policy maximises the batch's expected output rate. A request's drafts are accepted in
sequence; with a per-draft acceptance probability ``a`` (estimated per request from its own
history, forgetting old steps), a chunk of size ``c`` yields ``1 + a + ... + a**c`` tokens. A
step costs ``T = fixed + per_token * scheduled_tokens + per_draft * proposed_drafts
+ per_mixed * [the batch is not uniform]`` seconds, a linear model fitted online to the
engine's own step times: nothing is hand-tuned. The last term is what leaving the FULL CUDA
graphs costs: a batch whose requests all verify the same number of drafts replays one
(``patches/decode_graphs.py``), a batch of mixed chunk sizes runs PIECEWISE. At low
concurrency ``per_token`` is small and long chunks pay; at high concurrency it is large and they
do not. Each request's ``j``-th draft is verified when ``a**j`` exceeds what its verification
time would buy at the batch's rate. The drafter proposes the same number of drafts for the whole
batch (the draft budget ``D``), so ``D`` is chosen by evaluating the batch's rate for each
``D`` in ``[0, max_chunk]``; each request then verifies ``min(D, its own limit)``, or, where
that is worth more once ``per_mixed`` is counted, every request verifies ``D``.

This module imports nothing from vLLM; :mod:`vllm_nwor.patches.scheduler` wires it in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MODES = ("off", "fixed", "adaptive")


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


class StepCostModel:
    """``seconds = fixed + per_token * tokens + per_draft * drafted + per_mixed * mixed``.

    ``mixed`` is 1 for a step whose requests do not all have the same number of tokens (it
    cannot replay a FULL decode graph), else 0. Fitted online by recursive least squares with
    forgetting over the engine's recent steps. ``ready`` stays False until ``min_steps`` steps
    were seen; meanwhile the policy explores (random budgets, chunk sizes mixed or uniform), so
    that the four costs can be told apart. Coefficients given by the user (``scv_cost_model``:
    fixed, per token, per draft) are used as they are, with no cost for mixed steps.
    """

    def __init__(self, window: int = 256, min_steps: int = 32,
                 fixed_coefficients: Sequence[float] | None = None) -> None:
        self.forget_factor = 1.0 - 1.0 / window
        self.min_steps = min_steps
        self.steps = 0
        self._theta = np.zeros(4)
        self._p = np.eye(4) * 1e3
        self._fixed = (None if fixed_coefficients is None
                       else (*tuple(fixed_coefficients)[:3], 0.0))

    def observe(self, tokens: int, drafted: int, seconds: float, mixed: bool = False) -> None:
        if seconds <= 0 or tokens <= 0 or self._fixed is not None:
            return
        x = np.array([1.0, float(tokens), float(drafted), float(mixed)])
        px = self._p @ x
        gain = px / (self.forget_factor + x @ px)
        self._theta = self._theta + gain * (seconds - x @ self._theta)
        self._p = (self._p - np.outer(gain, px)) / self.forget_factor
        self.steps += 1

    @property
    def ready(self) -> bool:
        return self._fixed is not None or self.steps >= self.min_steps

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(fixed, per_token, per_draft, per_mixed) seconds, clipped at zero."""
        if self._fixed is not None:
            return self._fixed
        fixed, per_token, per_draft, per_mixed = (max(0.0, float(v)) for v in self._theta)
        return fixed, per_token, per_draft, per_mixed


@dataclass(frozen=True)
class ScvSettings:
    mode: str
    max_chunk: int
    probe_interval: int
    acceptance_window: int
    cost_model: tuple[float, float, float] | None = None
    """(fixed, per_token, per_draft) seconds measured elsewhere; None fits them online (with
    the cost of a mixed step)."""

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

    def observe_step(self, tokens: int, drafted: int, seconds: float,
                     mixed: bool = False) -> None:
        self.cost.observe(tokens, drafted, seconds, mixed)

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
        sizes = choose_sizes(rates, k, *self.cost.coefficients)
        # Probes ride on a step that drafts anyway, or on the shared probe step.
        probe_now = sizes.any() or self.acceptance.steps % self.settings.probe_interval == 0
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

    def current_plan(self) -> dict[str, int]:
        return self._plan

    def known_requests(self) -> set[str]:
        return set(self._plan) | set(self._idle_steps) | set(self._probe_wait)

    def draft_budget(self) -> int:
        """Drafts the drafter should propose per request: the longest planned chunk."""
        if self.settings.mode == "fixed":
            return self.settings.max_chunk
        return max(self._plan.values(), default=0)


def choose_sizes(
    rates: np.ndarray, max_chunk: int, fixed: float, per_token: float, per_draft: float,
    per_mixed: float = 0.0,
) -> np.ndarray:
    """Chunk sizes maximising the batch's expected tokens per second under the cost model.

    ``rates``: per-request acceptance probabilities. The seconds of a step are
    ``fixed + per_token * (n + sum(sizes)) + per_draft * n * D + per_mixed * mixed`` for ``n``
    requests and draft budget ``D = max(sizes)``; ``mixed`` when the sizes differ. Each
    request's own limit comes from the marginal test ``rate**j > tokens_per_second *
    per_token``; for each budget ``D`` the plan is ``min(D, limit)`` per request, or ``D`` for
    every request, and the best of them all is chosen. ``tokens_per_second`` starts at the
    full-chunk plan's rate and is re-estimated from the best plan (Dinkelbach iterations), so
    the choice depends on the model alone.
    """
    n = len(rates)
    if n == 0:
        return np.zeros(0, dtype=int)
    a = np.clip(rates, 1e-9, 1 - 1e-9)
    # gain[c, i]: expected tokens of request i with chunk c.
    powers = a[None, :] ** np.arange(max_chunk + 1)[:, None]
    gain = np.cumsum(powers, axis=0)
    budgets = np.arange(max_chunk + 1)
    # Every request verifying D: the plans that replay FULL decode graphs.
    uniform_value = gain.sum(axis=1) / np.maximum(
        fixed + per_token * n * (1 + budgets) + per_draft * n * budgets, 1e-12)
    best = np.zeros(n, dtype=int)
    tokens_per_second = float(uniform_value[max_chunk])
    for _ in range(3):
        threshold = tokens_per_second * per_token
        if threshold <= 0:
            limit = np.full(n, max_chunk)
        else:
            with np.errstate(divide="ignore", over="ignore"):
                limit = np.floor(np.log(min(threshold, 1.0)) / np.log(a)).astype(int)
            limit = np.clip(np.where(a**1 > threshold, limit, 0), 0, max_chunk)
        sizes = np.minimum(budgets[:, None], limit[None, :])  # [D, n]
        tokens = np.take_along_axis(gain, sizes, axis=0).sum(axis=1)
        mixed = sizes.min(axis=1) != sizes.max(axis=1)
        seconds = (fixed + per_token * (n + sizes.sum(axis=1)) + per_draft * n * budgets
                   + per_mixed * mixed)
        value = np.concatenate([tokens / np.maximum(seconds, 1e-12), uniform_value])
        choice = int(np.argmax(value))
        best = sizes[choice] if choice <= max_chunk else np.full(n, choice - max_chunk - 1)
        if float(value[choice]) == tokens_per_second:
            break  # a fixed point: the next iteration would choose the same plan
        tokens_per_second = float(value[choice])
    return best


def expected_tokens(rate: float, size: int) -> float:
    """Expected tokens from one step with ``size`` drafts at per-draft acceptance ``rate``."""
    return 1.0 + sum(rate**j for j in range(1, size + 1))
