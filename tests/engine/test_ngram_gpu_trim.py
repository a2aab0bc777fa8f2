"""ngram_gpu's trim with SCV (``patches/ngram_gpu.py``), on vLLM's own function: a step with no
drafts skips its wait for the drafter's counts; a step with drafts still waits and trims.

The function runs on the GPU engine only (ngram_gpu); here it gets host tensors and an event
that counts its waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

from vllm_nwor.patches.scv import ngram_gpu


class CountingEvent:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def _runner(scv: str):
    return SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"scv": scv}))


def _output(drafts: dict[str, list[int]]):
    tokens = {"a": 1 + len(drafts.get("a", [])), "b": 1 + len(drafts.get("b", []))}
    return SimpleNamespace(
        scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b"]),
        scheduled_spec_decode_tokens=dict(drafts), num_scheduled_tokens=dict(tokens),
        total_num_scheduled_tokens=sum(tokens.values()))


@pytest.fixture
def trim():
    yield ngram_gpu._wrap_update_scheduler_for_invalid_drafts(update_scheduler_for_invalid_drafts)
    ngram_gpu.configure(_runner("off"))


@pytest.mark.parametrize("scv, waits", [("off", 1), ("adaptive", 0)])
def test_a_step_without_drafts_waits_for_the_drafter_only_without_scv(trim, scv, waits):
    ngram_gpu.configure(_runner(scv))
    event, output = CountingEvent(), _output({})
    trim(event, torch.tensor([0, 0]), output, {"a": 0, "b": 1})
    assert event.waits == waits
    assert output.total_num_scheduled_tokens == 2


def test_a_step_with_drafts_still_waits_and_trims_with_scv(trim):
    ngram_gpu.configure(_runner("adaptive"))
    event, output = CountingEvent(), _output({"a": [-1, -1, -1], "b": [-1, -1, -1]})
    trim(event, torch.tensor([1, 0]), output, {"a": 0, "b": 1})  # a: 1 valid draft, b: none
    assert event.waits == 1
    assert output.scheduled_spec_decode_tokens == {"a": [-1]}
    assert output.num_scheduled_tokens == {"a": 2, "b": 1}
    assert output.total_num_scheduled_tokens == 3
