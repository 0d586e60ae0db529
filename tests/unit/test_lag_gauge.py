"""The consumer-lag gauge while it is being refilled: a scrape must still see every partition.

The lag is measured on the Kafka thread and scraped from the metrics server's thread. Clearing
the gauge first and refilling it one partition at a time left a window in which a scrape saw
some partitions, or none: an alert on `absent()` or on a summed lag would fire for nothing.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmworker.checkpoints import Checkpoints
from mmworker.config import load_config
from mmworker.health import Health
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.stopping import Stopping

TOPIC = "jobs"
LAG = "mmworker_consumer_lag_messages"


class _Consumer:
    """While `hold` is set, `highwater()` of partition 0 stops until `go` is set: the moment
    inside `Checkpoints.measure_lag` at which the test scrapes."""

    def __init__(self, marks: dict[int, int]) -> None:
        self.marks = marks
        self.hold = False
        self.inside = threading.Event()
        self.go = threading.Event()

    def highwater(self, tp: Any) -> int:
        if tp.partition == 0 and self.hold:
            self.inside.set()
            assert self.go.wait(10), "the test never let the measurement go on"
        return self.marks[tp.partition]


def _checkpoints(consumer: _Consumer, metrics: Metrics) -> Checkpoints:
    """Checkpoints with offset 10 of each partition in flight: the lag counts from 10."""
    tracker = OffsetTracker()
    for p in (0, 1):
        tracker.track(TopicPartition(TOPIC, p), 10)
    stopping = Stopping(Health(load_config().health))
    return Checkpoints(consumer, tracker, metrics, stopping, ThreadPoolExecutor(1))


def _lag(metrics: Metrics, partition: int) -> float | None:
    return metrics.registry.get_sample_value(LAG, {"topic": TOPIC, "partition": str(partition)})


def test_a_scrape_during_the_lag_update_sees_every_partition() -> None:
    metrics = Metrics()
    consumer = _Consumer({0: 15, 1: 12})
    checkpoints = _checkpoints(consumer, metrics)
    owned = {TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)}

    checkpoints.measure_lag(owned)
    assert (_lag(metrics, 0), _lag(metrics, 1)) == (5, 2)

    consumer.marks, consumer.hold = {0: 20, 1: 30}, True
    measuring = threading.Thread(target=checkpoints.measure_lag, args=(owned,))
    measuring.start()
    try:
        assert consumer.inside.wait(10)
        during = (_lag(metrics, 0), _lag(metrics, 1))
    finally:
        consumer.go.set()
        measuring.join(10)
    # Each partition is there, with its previous value or its new one, never missing.
    assert during[0] in (5, 10) and during[1] in (2, 20), during
    assert (_lag(metrics, 0), _lag(metrics, 1)) == (10, 20)


def test_a_partition_no_longer_owned_leaves_the_gauge() -> None:
    metrics = Metrics()
    checkpoints = _checkpoints(_Consumer({0: 11, 1: 13}), metrics)
    tps = [TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)]
    owned = set(tps)
    checkpoints.measure_lag(owned)
    assert (_lag(metrics, 0), _lag(metrics, 1)) == (1, 3)

    owned.discard(tps[1])  # revoked
    checkpoints.measure_lag(owned)
    assert (_lag(metrics, 0), _lag(metrics, 1)) == (1, None)
