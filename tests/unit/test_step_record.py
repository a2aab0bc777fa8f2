"""The worker's graph record (tests/support/step_record.py) counts the steps it is meant to, on a
stand-in runner (no vLLM here): vLLM's dummy runs (profiling, warm-up, graph capture) call the
same dispatch method as real steps and must not be counted."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.step_record import full_verify_steps, record_dispatches


class Runner:
    """Dispatches FULL for uniform batches and PIECEWISE for mixed ones, as vLLM's V1 runner
    does under FULL_AND_PIECEWISE; ``execute_model`` takes (num_reqs, tokens per request)."""

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs,
                                               num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, use_cascade_attn,
                                               allow_microbatching=True):
        uniform = num_tokens == num_reqs * max_num_scheduled_tokens
        return (SimpleNamespace(name="FULL" if uniform else "PIECEWISE"), None, False, None,
                None)

    def execute_model(self, per_request: list[int]):
        return self._determine_batch_execution_and_padding(
            num_tokens=sum(per_request), num_reqs=len(per_request),
            num_scheduled_tokens_np=per_request,
            max_num_scheduled_tokens=max(per_request), use_cascade_attn=False)

    def dummy_run(self, num_tokens: int):  # as vLLM's _dummy_run: positional, outside a step
        return self._determine_batch_execution_and_padding(num_tokens, num_tokens, None, 1,
                                                           False)


def test_only_real_steps_are_counted_by_batch_shape():
    runner = Runner()
    counts = record_dispatches(runner)
    runner.dummy_run(8)  # a capture: not a step
    runner.execute_model([4, 4, 4])  # a verify step, three requests with three drafts each
    runner.execute_model([4, 4])
    runner.execute_model([1, 1])  # plain decoding
    runner.execute_model([4, 30])  # a verify step beside a prefill chunk
    runner.dummy_run(2)
    assert counts == {"4:FULL": 2, "1:FULL": 1, "mixed:PIECEWISE": 1}
    assert full_verify_steps(counts) == 2


def test_a_failed_step_does_not_leave_dummy_runs_counted():
    runner = Runner()
    counts = record_dispatches(runner)
    try:
        runner.execute_model([])  # max() of nothing: the step raises inside execute_model
    except ValueError:
        pass
    runner.dummy_run(4)
    assert counts == {}
