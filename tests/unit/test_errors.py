"""Every layer's errors share one coded root: the worker reads any of them the same way."""

from __future__ import annotations

import pickle

import pytest
from mmworker_preprocess.errors import BadResponse, FetchFailed, PreprocessError, TooLarge
from mmworker_schemas.codes import RETRYABLE_CODES, ErrorCode
from mmworker_schemas.errors import CodedError, InvalidJson, SchemaError

from mmworker.errors import EngineFatal, RequestFailed, WorkerError


def _leaves(root: type[CodedError]) -> list[type[CodedError]]:
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


@pytest.mark.parametrize("root", [SchemaError, PreprocessError, WorkerError])
def test_each_root_is_coded_and_retries_follow_the_code(root: type[CodedError]) -> None:
    assert issubclass(root, CodedError)
    for cls in _leaves(root):
        if cls is BadResponse:  # permanent by default (see below)
            continue
        error = cls("m")
        assert error.message == "m" and str(error) == "m"
        assert error.retryable is (cls.code in RETRYABLE_CODES), cls


def test_schema_errors_are_never_retried() -> None:
    assert not any(cls.code in RETRYABLE_CODES for cls in _leaves(SchemaError))
    error = InvalidJson("not json", job_id="j1")
    assert (error.code, error.job_id, error.retryable) == (ErrorCode.INVALID_JSON, "j1", False)


def test_one_instance_may_overrule_its_code() -> None:
    assert FetchFailed("reset").retryable
    assert not FetchFailed("hostile", retryable=False).retryable
    assert not BadResponse("broke HTTP").retryable  # permanent unless told otherwise
    assert BadResponse("flaky", retryable=True).retryable
    assert RequestFailed("busy").retryable
    assert not RequestFailed("rejected", retryable=False).retryable
    assert TooLarge("big", retryable=True).retryable


@pytest.mark.parametrize(
    "error",
    [
        BadResponse("b"),
        FetchFailed("f", retryable=False),
        EngineFatal("e"),
        RequestFailed("r", retryable=False),
        InvalidJson("i", job_id="j"),
    ],
)
def test_errors_keep_code_and_override_across_processes(error: CodedError) -> None:
    # Preprocessing errors come back from the process pool pickled.
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert (again.code, again.message, again.retryable) == (
        error.code,
        error.message,
        error.retryable,
    )
    assert getattr(again, "job_id", None) == getattr(error, "job_id", None)
