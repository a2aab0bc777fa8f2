"""SCV (Speculative Chunk Verify): each request's verify chunk sized from its own acceptance.

Terms (see also :mod:`vllm_nwor.nwor`):

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
when its requests all verify the same number of drafts (``patches/scv/decode_graphs.py``; any
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

The package imports nothing from vLLM; :mod:`vllm_nwor.patches.scv.scheduler` wires it in.

- :mod:`~vllm_nwor.scv.types`: :class:`SpecChunk`, :class:`ScvSettings`, the per-request
  columns (:class:`RequestTable`);
- :mod:`~vllm_nwor.scv.acceptance`: :class:`AcceptanceEstimator`;
- :mod:`~vllm_nwor.scv.cost`: :class:`StepCost` and its fit, :class:`StepCostModel`;
- :mod:`~vllm_nwor.scv.planner`: :func:`choose_sizes`, a step's plan from rates and costs;
- :mod:`~vllm_nwor.scv.policy`: :class:`ChunkPolicy`, which runs them step after step.
"""

from __future__ import annotations

from vllm_nwor.scv.acceptance import AcceptanceEstimator
from vllm_nwor.scv.cost import (
    TOKEN_KNOTS,
    StepCost,
    StepCostModel,
    concurrency_band,
    cost_features,
    nonnegative_least_squares,
    on_full_graph,
)
from vllm_nwor.scv.planner import QUANTILES, choose_sizes, expected_tokens
from vllm_nwor.scv.policy import EXPLORE_INTERVAL, ChunkPolicy
from vllm_nwor.scv.types import MODES, RequestTable, ScvSettings, SpecChunk

__all__ = [
    "EXPLORE_INTERVAL", "MODES", "QUANTILES", "TOKEN_KNOTS", "AcceptanceEstimator",
    "ChunkPolicy", "RequestTable", "ScvSettings", "SpecChunk", "StepCost", "StepCostModel",
    "choose_sizes", "concurrency_band", "cost_features", "expected_tokens",
    "nonnegative_least_squares", "on_full_graph",
]
