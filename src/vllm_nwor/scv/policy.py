"""The SCV chunk policy (:class:`ChunkPolicy`): what each running request verifies next step,
from its acceptance, the cost fit, probes and exploration (see :mod:`vllm_nwor.scv`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from vllm_nwor.scv.acceptance import AcceptanceEstimator
from vllm_nwor.scv.cost import StepCostModel, on_full_graph
from vllm_nwor.scv.planner import choose_sizes, clipped_max, rate_floor
from vllm_nwor.scv.types import RequestTable, ScvSettings, SpecChunk

EXPLORE_INTERVAL = 32
"""Every this many steps, a step that drafts verifies a plan near the chosen one instead."""


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
        until the new count passed it."""
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

    def plan_chunk_zero(self, req_ids: Sequence[str]) -> dict[str, int]:
        """Chunk 0 for every request of ``req_ids``, without choosing and without recording:
        what :meth:`plan` returns when it holds every request at chunk 0, at none of its cost.
        For measuring what planning costs (the benchmarks' ``plan`` ablation), not for serving:
        no request ever comes back to drafting through it."""
        self._plan, self._budget, self._cuts = dict.fromkeys(req_ids, 0), 0, []
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
            # A plan that drafts nothing learns nothing and owes nothing (a slow warm-up step
            # of its own would otherwise keep shared probes away for long).
            self.learning_step = self.cost.priced() and bool(sizes.any())
            return sizes
        step = self.steps
        columns = self._requests.columns
        cost = self.cost.coefficients
        graphs, mixed = self.settings.max_graph_tokens, self.settings.mixed_graphs
        floor = rate_floor(len(req_ids), k, cost, graphs, mixed)
        # A batch whose rates are all at most the floor is kept at chunk 0: what choose_sizes
        # returns, without what it and its arguments cost, nor (under the bound) the rates. At
        # large batches a plain step can be bound by the host, and most steps of a batch
        # kept at chunk 0 end here.
        if floor is not None and self.acceptance.rate_bound(req_ids) < floor - 1e-9:
            rates = None
        else:
            rates = self.acceptance.rates(req_ids)
        if rates is None or (floor is not None and clipped_max(rates) <= floor):
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
