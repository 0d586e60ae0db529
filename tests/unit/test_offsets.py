from __future__ import annotations

import random

from mmworker.offsets import OffsetTracker, TopicPartition

TP = TopicPartition("jobs", 0)


def test_commit_waits_for_the_lowest_pending_offset() -> None:
    t = OffsetTracker()
    for o in range(10, 15):
        t.track(TP, o)
    t.done(TP, 12)
    t.done(TP, 13)
    assert t.to_commit() == {}  # 10 and 11 still running
    t.done(TP, 10)
    assert t.to_commit() == {TP: 11}
    t.done(TP, 11)
    assert t.to_commit() == {TP: 14}
    t.committed({TP: 14})
    assert t.to_commit() == {}
    t.done(TP, 14)
    assert t.to_commit() == {TP: 15}
    assert t.uncommitted() == 1  # answered, not yet committed
    t.committed({TP: 15})
    assert t.uncommitted() == 0


def test_random_completion_order_never_commits_past_a_pending_offset() -> None:
    rng = random.Random(7)
    t = OffsetTracker()
    offsets = list(range(100))
    for o in offsets:
        t.track(TP, o)
    rng.shuffle(offsets)
    finished: set[int] = set()
    for o in offsets:
        t.done(TP, o)
        finished.add(o)
        commit = t.to_commit().get(TP)
        if commit is not None:
            assert all(x in finished for x in range(commit))
            assert commit == min(set(range(101)) - finished)
    assert t.to_commit() == {TP: 100}


def test_revoked_partition_is_forgotten_and_late_completions_ignored() -> None:
    t = OffsetTracker()
    other = TopicPartition("jobs", 1)
    t.track(TP, 0)
    t.track(other, 0)
    t.forget([TP])
    assert t.done(TP, 0) is False
    assert t.done(other, 0) is True
    assert t.to_commit() == {other: 1}
    assert t.uncommitted() == 1  # only the kept partition's answered-but-uncommitted offset


def test_uncommitted_counts_done_work_until_it_is_committed() -> None:
    t = OffsetTracker()
    for o in range(4):
        t.track(TP, o)
    t.done(TP, 0)
    t.done(TP, 1)
    assert t.uncommitted() == 2  # answered but not yet committed (the worker adds its 2 live)
    t.committed(t.to_commit())
    assert t.uncommitted() == 0
    t.done(TP, 3)  # behind pending 2: not committable, still answered-uncommitted
    assert t.uncommitted() == 1
    t.done(TP, 2)
    t.committed(t.to_commit())
    assert t.uncommitted() == 0
