"""The plan of one step's chunk sizes from the batch's rates and the cost terms
(:func:`choose_sizes`), with the early exits that keep a batch at chunk 0 without the search."""

from __future__ import annotations

import functools

import numpy as np

from vllm_nwor.scv.cost import StepCost, on_full_graph

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
    counted as one more step. Taken as settled under the last plan alone, a mixed batch that
    had decoded plainly and then met a probe step drafting part of it valued drafting for every
    request above plain decoding, and kept drafting for all of them.

    ``catch_up``: per request, the seconds its catch-up costs (the lazy draft sync's pass over
    the positions it skipped) per token it has left to generate. A plan that drafts it pays
    that once, spread over the steps it has left (its tokens left over ``E_i``): ``E_i`` times
    ``catch_up`` each step. Without it, a batch near the line between drafting and not went
    back and forth, each return paying a catch-up over every request's skipped positions.

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
    if exit_early and below_floor(rates, max_chunk, cost, max_graph_tokens, mixed_graphs):
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

    if exit_early and min(cost) >= 0 and not drafts_can_win(gain, w, cost, max_graph_tokens,
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


def drafts_can_win(gain: np.ndarray, w: np.ndarray, cost: StepCost,
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
    a chunk up to ``D`` makes it positive (catch-up charges, left out, only add cost). At large
    batches that keeps a low-acceptance batch at chunk 0 without the search, which the bound by
    budget alone (every request at chunk ``D``, priced as a step of ``n`` tokens) does not:
    a step's drafts cost mostly per token there, and that bound leaves them out."""
    bars, _ = bars_at(gain.shape[1], len(gain) - 1, cost, max_graph_tokens, mixed_graphs)
    if bars is None:
        return True
    terms = 1 - bars[:, :, None] / gain[None]  # [D, c, i]; a chunk over its budget: -inf
    best = terms.max(axis=1)[1:] @ w  # by budget D >= 1
    return bool(np.any(best > -1e-9 * w.sum()))  # a tie (to rounding) is searched


def below_floor(rates: np.ndarray, max_chunk: int, cost: StepCost,
                 max_graph_tokens: int | None, mixed_graphs: bool) -> bool:
    """Whether every rate is at most the one at which no request's term of
    :func:`drafts_can_win` is positive (:func:`rate_floor`): then no plan with drafts can win,
    whatever the weights, and a batch is kept at chunk 0 with none of the search's work. A
    request's term grows with its rate."""
    floor = rate_floor(len(rates), max_chunk, cost, max_graph_tokens, mixed_graphs)
    return floor is not None and clipped_max(rates) <= floor


def clipped_max(rates: np.ndarray) -> float:
    """The highest rate as :func:`choose_sizes` clips it."""
    return min(max(float(rates.max()), 1e-9), 1 - 1e-9)


def rate_floor(n: int, max_chunk: int, cost: StepCost, max_graph_tokens: int | None,
                mixed_graphs: bool) -> float | None:
    """The rate floor of :func:`bars_at` at ``n`` requests; None where there is none to use (no
    request, a negative term of the cost, a plain step that costs nothing)."""
    if n == 0 or min(cost) < 0:
        return None
    bars, floor = bars_at(n, max_chunk, cost, max_graph_tokens, mixed_graphs)
    return None if bars is None else floor


_GRID = np.arange(65) / 64  # (:func:`bars_at`' grids of rates)


@functools.lru_cache(maxsize=256)
def bars_at(n: int, max_chunk: int, cost: StepCost, max_graph_tokens: int | None,
          mixed_graphs: bool) -> tuple[np.ndarray | None, float]:
    """For :func:`drafts_can_win`, at ``n`` requests: ``bars[D, c] = S_D / S_0 + v * c``
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
