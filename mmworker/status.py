"""`mmworker status`: is anyone consuming, how far behind is the group, what failed lately.

Read from the brokers alone, so it answers with no worker running and needs no metrics port:
- members and their assignments: the group coordinator's DescribeGroups (`group_members`);
- lag: the group's committed offsets (OffsetFetch) against each partition's high-water mark,
  taken from a fetch response at the committed offset (Fetch). Not from ListOffsets
  (`end_offsets`): the embedded Tansu broker answers that with the last batch's base offset + 1,
  where a fetch's high-water mark is right on it and on Apache Kafka alike;
- the oldest waiting job: the timestamp of the first record after the committed offset, the same
  fetch. It may be running in a worker already: offsets are committed when jobs finish;
- dead letters lately: the dead-letter topic from `offsets_for_times(now - recent)` (ListOffsets by
  time; Tansu answers the log start, so there the whole topic is read) up to its end, counting the
  records stamped inside the window, by code;
- suspects: the compacted suspects topic read whole, the latest value per key.
Every read is bounded by `read_timeout_s`; a count that was cut short says so (`complete`).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer
from kafka.errors import KafkaError
from kafka.structs import TopicPartition as KafkaTP

from mmworker.config import KafkaConfig, WorkerConfig
from mmworker.exits import Interrupted, check_interrupted, signal_behind
from mmworker.group_members import GroupQueryError, Member, describe_members

#: Bytes a partition's fetch may return: the lag scan needs one record per partition, and a
#: broker returns at least one whole batch whatever this says.
_FETCH_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class PartitionLag:
    topic: str
    partition: int
    #: The group's committed offset; None: nothing committed yet (a worker starts at the log start).
    committed: int | None
    #: The high-water mark (next offset to be written); None: the broker did not say in time.
    end: int | None
    lag: int
    #: Timestamp (ms) of the first record past the committed offset: the oldest waiting job here.
    oldest_waiting_ms: int | None


@dataclass(frozen=True, slots=True)
class RecentFailures:
    since: str
    count: int
    by_code: dict[str, int]
    #: False when the read stopped at its time limit before the topic's end: `count` is a floor.
    complete: bool


@dataclass(frozen=True, slots=True)
class Suspects:
    #: Jobs that were inside a dead engine and have not finished since.
    live: int
    #: Of those, recorded inside the window.
    recent: int
    complete: bool


@dataclass(frozen=True, slots=True)
class GroupStatus:
    bootstrap: str
    group: str
    taken_at: float
    state: str
    members: tuple[Member, ...]
    partitions: tuple[PartitionLag, ...]
    dead_letters: RecentFailures
    suspects: Suspects
    #: Lag read to the end of every partition in time (else the figures are floors).
    lag_complete: bool = True
    missing_topics: tuple[str, ...] = field(default=())

    @property
    def consuming(self) -> bool:
        return bool(self.members)

    @property
    def total_lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    @property
    def oldest_waiting_s(self) -> float | None:
        stamps = [p.oldest_waiting_ms for p in self.partitions if p.oldest_waiting_ms is not None]
        return max(0.0, self.taken_at - min(stamps) / 1000) if stamps else None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["members"] = [asdict(m) for m in self.members]
        for member in doc["members"]:
            parts = member["partitions"]
            member["partitions"] = None if parts is None else [list(p) for p in parts]
        doc["consuming"] = self.consuming
        doc["total_lag"] = self.total_lag
        doc["oldest_waiting_s"] = self.oldest_waiting_s
        doc["missing_topics"] = list(self.missing_topics)
        return doc


class StatusReader:
    """Clients kept open across `read` calls (`status -w` refreshes with them)."""

    def __init__(self, cfg: KafkaConfig, read_timeout_s: float = 10.0) -> None:
        self._cfg = cfg
        self._read_timeout_s = read_timeout_s
        kwargs = cfg.client_kwargs()
        timeout_ms = int(read_timeout_s * 1000)
        self._admin = KafkaAdminClient(**kwargs, request_timeout_ms=timeout_ms)
        self._consumer = KafkaConsumer(
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            max_partition_fetch_bytes=_FETCH_BYTES, request_timeout_ms=timeout_ms + 1000,
            **kwargs,
        )  # fmt: skip

    def close(self) -> None:
        self._consumer.close()
        self._admin.close()

    def read(self, recent_s: float) -> GroupStatus:
        """Raises `GroupQueryError` (one line) when the brokers do not answer in time. Whichever
        question a broker's death cuts off, the line starts the same way (`status -w` prints one
        per refresh, and a reader or a script looks for one prefix, not for each step's own)."""
        try:
            return self._read(recent_s)
        except (KafkaError, GroupQueryError) as exc:
            name = type(exc).__name__
            why = exc.message if isinstance(exc, GroupQueryError) else f"{name}: {exc}"
            raise GroupQueryError(
                f"cannot read group {self._cfg.group_id!r} from {self._cfg.bootstrap_servers} "
                f"({why})"
            ) from exc

    def _read(self, recent_s: float) -> GroupStatus:
        cfg = self._cfg
        taken_at = time.time()
        described = describe_members(self._admin, cfg.group_id)
        try:
            committed = self._admin.list_group_offsets(cfg.group_id).get(cfg.group_id, {})
        except KafkaError as exc:
            raise GroupQueryError(
                f"cannot read the committed offsets of group {cfg.group_id!r} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        wanted = [cfg.input_topic, *([cfg.backfill_topic] if cfg.backfill_topic else [])]
        topics = sorted({*wanted, *(tp.topic for tp in committed)})
        parts, missing = self._partitions(topics)
        done = {tp: om.offset for tp, om in committed.items() if om.offset >= 0}  # -1: none
        lags, lag_complete = self._lag(parts, done)
        since = taken_at - recent_s
        return GroupStatus(
            bootstrap=cfg.bootstrap_servers,
            group=cfg.group_id,
            taken_at=taken_at,
            state=described.state,
            members=described.members,
            partitions=lags,
            dead_letters=self._dead_letters(since),
            suspects=self._suspects(since),
            lag_complete=lag_complete,
            missing_topics=tuple(t for t in missing if t in wanted),
        )

    def _partitions(self, topics: list[str]) -> tuple[list[KafkaTP], list[str]]:
        self._consumer.topics()  # one metadata refresh: topics created since the last read
        found: list[KafkaTP] = []
        missing: list[str] = []
        for topic in topics:
            ids = self._consumer.partitions_for_topic(topic)
            if not ids:
                missing.append(topic)
            found.extend(KafkaTP(topic, p) for p in sorted(ids or ()))
        return found, missing

    def _lag(
        self, parts: list[KafkaTP], committed: dict[KafkaTP, int]
    ) -> tuple[tuple[PartitionLag, ...], bool]:
        starts = {tp: committed.get(tp) for tp in parts}
        first: dict[KafkaTP, Any] = {}

        def keep_first(record: Any) -> bool:
            first[KafkaTP(record.topic, record.partition)] = record
            return False  # one record a partition is all it takes

        highs, complete = self._scan(starts, keep_first)
        out = []
        for tp in parts:
            end, done, head = highs.get(tp), committed.get(tp), first.get(tp)
            start = done if done is not None else (head.offset if head is not None else end)
            lag = max(0, end - start) if end is not None and start is not None else 0
            out.append(PartitionLag(
                tp.topic, tp.partition, done, end, lag, head.timestamp if head else None,
            ))  # fmt: skip
        return tuple(out), complete

    def _dead_letters(self, since: float) -> RecentFailures:
        topic = self._cfg.dead_letter_topic
        parts, _missing = self._partitions([topic])
        stamp = int(since * 1000)
        starts: dict[KafkaTP, int | None] = {}
        if parts:
            try:
                found = self._consumer.offsets_for_times(dict.fromkeys(parts, stamp))
            except KafkaError:
                found = {}  # a broker without ListOffsets by time: read the whole topic
            for tp in parts:
                if tp in found and found[tp] is None:
                    continue  # nothing stamped inside the window on this partition
                hit = found.get(tp)
                starts[tp] = hit.offset if hit is not None else None
        codes: Counter[str] = Counter()

        def count(record: Any) -> bool:
            if record.timestamp >= stamp:
                codes[_failure_code(record.value)] += 1
            return True

        _highs, complete = self._scan(starts, count)
        return RecentFailures(_iso(since), sum(codes.values()), dict(codes.most_common()), complete)

    def _suspects(self, since: float) -> Suspects:
        parts, _missing = self._partitions([self._cfg.suspects_topic])
        latest: dict[bytes, Any] = {}

        def remember(record: Any) -> bool:
            if record.key is not None:
                latest[record.key] = record.value
            return True

        _highs, complete = self._scan(dict.fromkeys(parts), remember)
        live = [v for v in latest.values() if v is not None]
        recent = sum(1 for v in live if _recorded_at(v) >= since)
        return Suspects(len(live), recent, complete)

    def _scan(
        self, starts: dict[KafkaTP, int | None], on_record: Callable[[Any], bool]
    ) -> tuple[dict[KafkaTP, int | None], bool]:
        """Read each partition from its start (None: its beginning) to the high-water mark that
        fetch responses report, handing every record to `on_record` until that returns False
        for its partition. Returns the high-water marks, and whether every partition was read
        that far before the time limit."""
        consumer = self._consumer
        consumer.assign(list(starts))
        for tp, offset in starts.items():
            if offset is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, offset)
        open_ = set(starts)
        deadline = time.monotonic() + self._read_timeout_s
        while open_ and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=100, max_records=500).items():
                for record in records:
                    if tp in open_ and not on_record(record):
                        open_.discard(tp)
                        consumer.pause(tp)
            for tp in list(open_):
                high = consumer.highwater(tp)
                if high is not None and consumer.position(tp) >= high:
                    open_.discard(tp)
        highs = {tp: consumer.highwater(tp) for tp in starts}
        consumer.assign([])
        return highs, not open_


def _failure_code(value: bytes | None) -> str:
    try:
        code = json.loads(value or b"").get("code")
    except (ValueError, AttributeError):
        return "unreadable"
    return str(code) if code else "unreadable"


def _recorded_at(value: bytes) -> float:
    try:
        return float(json.loads(value).get("at", 0.0))
    except (ValueError, TypeError, AttributeError):
        return 0.0


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render(status: GroupStatus, window: str) -> str:
    """The text a person reads: the verdict first, then members, lag, failures."""
    lines: list[str] = []
    waiting = status.total_lag
    oldest = status.oldest_waiting_s
    oldest_text = f", the oldest for {_age(oldest)}" if oldest is not None else ""
    if not status.consuming:
        lines.append(
            f"NOBODY IS CONSUMING: group {status.group} has no live member; {waiting} jobs "
            f"waiting{oldest_text}"
        )
    else:
        lines.append(
            f"group {status.group}: {status.state}, {_count(len(status.members), 'member')} "
            "consuming; "
            f"{waiting} jobs waiting or running{oldest_text}"
        )
    for m in status.members:
        host = f" on {m.host}" if m.host else ""
        if m.partitions is None:
            owns = "assignment not reported by this broker"
        else:
            owns = ", ".join(f"{t}[{p}]" for t, p in m.partitions) or "no partitions"
        lines.append(f"  member {m.member_id} (client {m.client_id}{host}): {owns}")
    floor = "" if status.lag_complete else " (read cut short: at least)"
    lines.append(f"lag{floor}:")
    for p in status.partitions:
        done = "-" if p.committed is None else str(p.committed)
        end = "?" if p.end is None else str(p.end)
        age = (
            f"  oldest {_age(max(0.0, status.taken_at - p.oldest_waiting_ms / 1000))}"
            if p.oldest_waiting_ms is not None
            else ""
        )
        lines.append(f"  {p.topic}[{p.partition}]  committed {done}  end {end}  lag {p.lag}{age}")
    for topic in status.missing_topics:
        lines.append(f"  {topic}: no such topic on the brokers")
    lines.append(f"  total {status.total_lag}")
    dl = status.dead_letters
    codes = ", ".join(f"{c} {n}" for c, n in dl.by_code.items())
    more = "" if dl.complete else " (read cut short: at least)"
    lines.append(f"dead letters ({window}){more}: {dl.count}" + (f" ({codes})" if codes else ""))
    sus = status.suspects
    lines.append(
        f"suspects (jobs inside a dead engine, not finished since): {sus.live}, "
        f"{sus.recent} recorded ({window})" + ("" if sus.complete else " (read cut short)")
    )
    lines.append(f"at {_iso(status.taken_at)} from {status.bootstrap}")
    return "\n".join(lines)


def run_status(cfg: WorkerConfig, as_json: bool, watch_s: float | None, since: str) -> int:
    """Print the group's status once, or every `watch_s` seconds until Ctrl-C (text: the screen
    redrawn when it is a terminal; JSON: one object per line)."""
    from mmworker.replay import parse_when

    label = (
        f"last {since}" if re.fullmatch(r"\d+(\.\d+)?[smhd]", since.strip()) else f"since {since}"
    )
    reader = StatusReader(cfg.kafka)
    try:
        while True:
            check_interrupted()  # a Ctrl-C that a library swallowed or wrapped still ends it
            recent_s = max(0.0, time.time() - parse_when(since).timestamp())
            try:
                status = reader.read(recent_s)
            except GroupQueryError as exc:
                if watch_s is None or signal_behind(exc) is not None:
                    raise
                # -w outlives a broker that goes away: it says so and asks again.
                print(f"mmworker status: {exc.message}; again in {watch_s:g}s", file=sys.stderr)
                time.sleep(watch_s)
                continue
            if as_json:
                print(json.dumps(status.to_json()), flush=True)
            else:
                redraw = "\x1b[H\x1b[2J" if watch_s is not None and sys.stdout.isatty() else ""
                print(redraw + render(status, label), flush=True)
            if watch_s is None:
                return 0
            if not as_json and not redraw:
                print(flush=True)
            time.sleep(watch_s)
    except Interrupted:
        return 0  # Ctrl-C is how -w ends
    finally:
        reader.close()
