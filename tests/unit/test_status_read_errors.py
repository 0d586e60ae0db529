"""`StatusReader.read` when the brokers stop answering: one line with one prefix, whichever of
its questions (the group's members, its committed offsets, the topics) was cut off. A CI run saw
`status -w` print the members' own wording ("cannot describe consumer group ...") when the
broker stopped just as that question went out."""

from __future__ import annotations

from typing import Any

import pytest
from kafka.errors import KafkaConnectionError, NodeNotReadyError

from mmworker import status
from mmworker.config import KafkaConfig
from mmworker.group_members import GroupMembers, GroupQueryError

PREFIX = "cannot read group 'g' from localhost:9"


class _Admin:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def list_group_offsets(self, group: str) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {group: {}}


class _Consumer:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def topics(self) -> set[str]:
        if self.error is not None:
            raise self.error
        return set()


def _reader(admin_error: Exception | None = None, consumer_error: Exception | None = None) -> Any:
    reader = object.__new__(status.StatusReader)  # no clients: the questions are faked
    reader._cfg = KafkaConfig(bootstrap_servers="localhost:9", group_id="g")
    reader._read_timeout_s = 1.0
    reader._admin = _Admin(admin_error)
    reader._consumer = _Consumer(consumer_error)
    return reader


def _members_fail(admin: Any, group: str) -> GroupMembers:
    raise GroupQueryError(f"cannot describe consumer group {group!r} (NodeNotReadyError: 111)")


def _members_ok(admin: Any, group: str) -> GroupMembers:
    return GroupMembers(group, "Empty", ())


@pytest.mark.parametrize(
    ("members", "admin_error", "consumer_error", "detail"),
    [
        (_members_fail, None, None, "cannot describe consumer group 'g' (NodeNotReadyError: 111)"),
        (_members_ok, NodeNotReadyError(111), None, "cannot read the committed offsets"),
        (_members_ok, None, KafkaConnectionError("gone"), "KafkaConnectionError: gone"),
    ],
    ids=["members", "committed-offsets", "topics"],
)
def test_every_cut_off_question_reads_as_one_line_with_one_prefix(
    monkeypatch: pytest.MonkeyPatch,
    members: Any,
    admin_error: Exception | None,
    consumer_error: Exception | None,
    detail: str,
) -> None:
    monkeypatch.setattr(status, "describe_members", members)
    with pytest.raises(GroupQueryError) as caught:
        _reader(admin_error, consumer_error).read(60)
    line = caught.value.message
    assert line.startswith(PREFIX), line
    assert detail in line and "\n" not in line, line
