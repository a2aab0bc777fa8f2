"""CommittedReadback: the host reads NWOR's committed count from copies that have landed, never
waiting for the GPU, and never goes back. The GPU's events are stood in for by events the test
lands by hand (the copies themselves are CPU tensors here)."""

from __future__ import annotations

import torch

from vllm_nwor.nwor.counters import CommittedReadback


class HandEvent:
    """An event that has landed once the test says so."""

    def __init__(self) -> None:
        self.recorded = self.landed = False

    def record(self) -> None:
        self.recorded, self.landed = True, False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def readback(slots: int = 4) -> tuple[CommittedReadback, list[HandEvent]]:
    events: list[HandEvent] = []

    def make() -> HandEvent:
        events.append(HandEvent())
        return events[-1]

    return CommittedReadback(slots=slots, make_event=make), events


def test_a_read_takes_the_newest_landed_copy_with_its_own_staged_count() -> None:
    back, events = readback()
    committed = torch.zeros((), dtype=torch.int64)
    for step, (staged, total) in enumerate([(8, 5), (16, 11), (24, 12)], start=1):
        committed.fill_(total)  # the device's count after this step's commit
        back.after_commit(committed, step, staged)
    assert back.latest() == (0, 0, 0)  # nothing landed: the counts before any commit
    events[1].landed = True  # the second commit's copy landed, the third's is in flight
    assert back.latest() == (2, 16, 11)
    events[2].landed = True
    assert back.latest() == (3, 24, 12)


def test_a_read_never_goes_back() -> None:
    back, events = readback()
    committed = torch.zeros((), dtype=torch.int64)
    for step in range(1, 4):
        committed += 2
        back.after_commit(committed, step, 4 * step)
    events[2].landed = True
    assert back.latest() == (3, 12, 6)
    events[0].landed = True  # an older copy landing later changes nothing
    assert back.latest() == (3, 12, 6)


def test_a_slot_is_reused_only_after_its_copy_landed() -> None:
    back, events = readback(slots=2)
    committed = torch.zeros((), dtype=torch.int64)
    for step in range(1, 4):  # the third commit takes the first slot again: it waits for it
        committed += 1
        back.after_commit(committed, step, 2 * step)
    assert events[0].recorded and events[0].landed is False  # re-recorded for the third
    assert back.latest() == (1, 2, 1)  # taken while the slot was reused
    events[1].landed = events[0].landed = True
    assert back.latest() == (3, 6, 3)


def test_reset_forgets_the_counts() -> None:
    back, events = readback()
    back.after_commit(torch.tensor(3), 1, 4)
    events[0].landed = True
    assert back.latest() == (1, 4, 3)
    back.reset()
    assert back.latest() == (0, 0, 0)
