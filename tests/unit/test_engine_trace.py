"""The trace diff (tests/support/engine_trace.py) names the first step where two engines part,
and the field that parted first: the schedule, the batch, the forward (logits), the sampled
tokens. Each case is two hand-made traces that differ in one place (no vLLM here; the GPU
matrix's rows carry real ones: docs/equivalence.md)."""

from __future__ import annotations

import copy
import json

import pytest

from tests.support.engine_trace import first_difference, read, request_key, summary


def trace(steps: int = 4) -> dict:
    """Two requests; "0" is new at step 0 with 8 prompt tokens, then both decode with drafts."""
    schedule, worker, update = [], [], {}
    for step in range(steps):
        kind = "new" if step == 0 else "running"
        reqs = [["0", kind, 8 if step == 0 else 3, 0 if step == 0 else 8 + step, 2, None],
                ["1", kind, 5 if step == 0 else 3, 0 if step == 0 else 5 + step, 2, None]]
        schedule.append({"kind": "schedule", "step": step, "reqs": reqs, "preempted": [],
                         "finished": []})
        worker.append({"step": step, "reqs": ["0", "1"], "logits": [f"a{step}", f"b{step}"]})
        update[step] = {"0": [step, step + 1], "1": [7]}
    return {"schedule": schedule, "worker": worker, "update": update}


def test_identical_traces_never_part():
    assert first_difference(trace(), trace()) is None


def test_a_schedule_that_differs_is_named_before_the_forward():
    other = trace()
    other["schedule"][2]["reqs"][1][2] = 4  # one more token for request 1 at step 2
    other["worker"][2]["logits"][1] = "changed"  # (which then changes its logits too)
    diff = first_difference(trace(), other)
    assert diff["step"] == 2 and diff["what"] == "schedule.reqs" and diff["index"] == 1


def test_preemptions_are_part_of_the_schedule():
    other = trace()
    other["schedule"][1]["preempted"] = ["1"]
    assert first_difference(trace(), other)["what"] == "schedule.preempted"


def test_logits_that_differ_under_the_same_schedule_name_the_request():
    other = trace()
    other["worker"][3]["logits"][0] = "changed"
    diff = first_difference(trace(), other)
    assert (diff["step"], diff["what"], diff["request"]) == (3, "logits", "0")
    assert diff["scheduled"][:3] == ["0", "running", 3]


def test_sampled_tokens_that_differ_are_named():
    other = trace()
    other["update"][1]["1"] = [8]
    diff = first_difference(trace(), other)
    assert (diff["step"], diff["what"], diff["request"], diff["a"], diff["b"]) == (
        1, "sampled", "1", [7], [8])


def test_worker_records_align_with_the_steps_that_scheduled_something():
    """A schedule with no request (nothing to run) has no worker record: the worker's records
    are matched to the busy steps, so one idle step does not shift every comparison after it."""
    a, b = trace(), trace()
    for t in (a, b):
        t["schedule"].insert(1, {"kind": "schedule", "step": 1, "reqs": [], "preempted": [],
                                 "finished": []})
        for step, record in enumerate(t["schedule"]):
            record["step"] = step
        t["update"] = {s + (s >= 1): v for s, v in t["update"].items()}
    assert first_difference(a, b) is None
    b["worker"][1]["logits"][1] = "changed"  # the worker's second record: schedule step 2
    assert first_difference(a, b)["step"] == 2


def test_logits_can_be_left_out_of_the_comparison():
    """On the CPU NWOR's staged attention is a reference whose logits differ in the last bits:
    there the schedules and sampled tokens are compared at every step, the logits not."""
    other = trace()
    other["worker"][0]["logits"][0] = "changed"
    assert first_difference(trace(), other, logits=False) is None
    other["update"][3]["0"] = [0]
    assert first_difference(trace(), other, logits=False)["what"] == "sampled"


def test_a_trace_that_ends_early_parts_where_it_ends():
    short = copy.deepcopy(trace())
    del short["schedule"][3]
    assert first_difference(trace(), short) == {"step": 3, "what": "trace length", "a": 4,
                                                "b": 3}


def test_read_and_summary_from_files(tmp_path):
    t = trace()
    t["schedule"][0]["reqs"][1][3] = 4  # request 1 starts from 4 prefix-cache hits
    t["schedule"][2]["preempted"] = ["1"]
    lines = [json.dumps(r) for r in t["schedule"]]
    lines += [json.dumps({"kind": "update", "step": s, "sampled": v})
              for s, v in t["update"].items()]
    (tmp_path / "sched-1.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "worker-2.jsonl").write_text(
        "\n".join(json.dumps(r) for r in t["worker"]) + "\n")
    back = read(tmp_path)
    assert back["schedule"] == t["schedule"] and back["worker"] == t["worker"]
    assert back["update"] == {s: v for s, v in t["update"].items()}
    assert summary(back) == {"steps": 4, "preemptions": 1, "hit_tokens": 4, "worker_steps": 4}


@pytest.mark.parametrize("vllm_id, key", [
    ("3-1a2b3c4d", "3"), ("cmpl-abc-0-9f8e7d6c", "cmpl-abc-0"), ("7", "7")])
def test_request_keys_drop_the_suffix_vllm_adds(vllm_id, key):
    assert request_key(vllm_id) == key
