"""The everyday command line of issue #35 without a broker: help that shows every default, None
where the README documents it, "did you mean" for a misspelt setting, a wrong option in one
line, and `submit`'s task and response_format checked before anything is posted."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from mmworker_schemas import ChoiceFormat, Failure, JsonSchemaFormat

from mmworker.cli import _RUN_FLAGS, build_parser, main, overrides_from
from mmworker.client import parse_answer, unreachable
from mmworker.config import load_config
from mmworker.devkit.broker import free_port


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MMWORKER_"):
            monkeypatch.delenv(name)


def _help(command: str) -> str:
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[command].format_help().split())


@pytest.mark.parametrize("command", ["run", "config"])
def test_run_and_config_help_show_the_default_of_every_setting_flag(command: str) -> None:
    text = _help(command)
    for flag, (path, _kind) in _RUN_FLAGS.items():
        assert f"({path}; default: " in text, flag
    assert "(limits.max_in_flight; default: auto: " in text  # computed ones say how
    assert "(metrics_port; default: unset)" in text
    assert "(kafka.bootstrap_servers; default: localhost:9092)" in text


def test_metrics_port_none_is_accepted_where_the_readme_documents_it(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text("metrics_port = 9400\n")
    for given in (["--metrics-port", "None"], ["--metrics-port", "none"],
                  ["--set", "metrics_port=None"], ["--set", "metrics_port=null"]):  # fmt: skip
        args = build_parser().parse_args(["run", "--config", str(toml), *given])
        assert overrides_from(args) == {"metrics_port": None}, given
        assert load_config(toml, **overrides_from(args)).metrics_port is None, given
    args = build_parser().parse_args(["run", "--config", str(toml), "--metrics-port", "9500"])
    assert load_config(toml, **overrides_from(args)).metrics_port == 9500


def test_a_wrong_option_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--metrics-port", "x"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "mmworker run: argument --metrics-port: invalid int value: 'x' (`mmworker run --help` "
        "lists them)\n"
    )
    with pytest.raises(SystemExit):
        main(["tail", "--no-such-flag"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --no-such-flag" in err, err


@pytest.mark.parametrize(
    ("setting", "suggestion"),
    [
        ("kafka.bootstrap=k:9092", "kafka.bootstrap_servers"),
        ("kafak.bootstrap_servers=k:9092", "kafka"),
        ("limits.max_inflight=9", "limits.max_in_flight"),
        ("metrics_prot=9400", "metrics_port"),
        ('tasks.tags.promt="x"', "tasks.tags.prompt"),
    ],
)
def test_a_misspelt_setting_gets_a_did_you_mean(
    setting: str, suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"no such setting; did you mean {suggestion}? (`mmworker config --reference`" in err


def test_nothing_close_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--set", "zzzzqqq=1"]) == 2
    assert "no such setting (`mmworker config --reference` lists them all)" in (
        capsys.readouterr().err
    )


def _submit_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`submit` against a port nothing listens on: a mistake must be named before the brokers
    are tried (their error would come instead)."""
    dead = f"127.0.0.1:{free_port()}"
    assert main(["submit", "x.jpg", "--bootstrap-servers", dead, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "cannot reach the Kafka brokers" not in captured.err
    return captured.err


def test_submit_refuses_a_task_the_configuration_does_not_have(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _submit_error(capsys, "--task", "nosuchtask")
    assert err.startswith(
        "mmworker: --task 'nosuchtask' is not one of the configured tasks (caption, objects, "
        "ocr, safety, summary, tags): "
    )
    assert "did you mean" not in err
    assert "tags); did you mean 'tags'?: a new one goes under" in _submit_error(
        capsys, "--task", "tagz"
    )


def test_a_task_added_in_the_configuration_is_accepted(tmp_path: Path) -> None:
    from mmworker.tools import check_task

    toml = tmp_path / "w.toml"
    toml.write_text('[tasks.colours]\nprompt = "Which colours?"\n')
    check_task("colours", load_config(toml))
    check_task(None, load_config(toml))


def test_submit_response_format_as_json_or_file(tmp_path: Path) -> None:
    from mmworker.tools import read_response_format

    choice = read_response_format('{"type": "choice", "choices": ["yes", "no"]}')
    assert choice == ChoiceFormat(type="choice", choices=["yes", "no"])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    path = tmp_path / "format.json"
    path.write_text(json.dumps({"type": "json_schema", "schema": schema}))
    parsed = read_response_format(str(path))
    assert isinstance(parsed, JsonSchemaFormat) and parsed.schema_ == schema


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ('{"type": "choice"}', "--response-format is not a response_format (choice.choices: "
                               "Field required)"),
        ('{"type": "grammar", "g": 1}', "--response-format is not a response_format (it: Input "
                                        "tag 'grammar'"),
        ("{oops", "--response-format is not a response_format (it: Invalid JSON"),
        ("/no/such/format.json", "--response-format /no/such/format.json: cannot read it (No "
                                 "such file or directory)"),
    ],
)  # fmt: skip
def test_a_bad_response_format_is_one_line_before_the_brokers(
    given: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in _submit_error(capsys, "--response-format", given)


def test_answers_are_read_as_results_or_failures() -> None:
    from mmworker_schemas import ErrorCode

    failure = {"job_id": "j2", "code": "forbidden_uri", "message": "m", "retryable": False,
               "attempts": 1, "source": {"topic": "t", "partition": 0, "offset": 3},
               "worker_id": "w", "payload": ""}  # fmt: skip
    parsed = parse_answer(json.dumps(failure).encode())
    assert isinstance(parsed, Failure) and parsed.code == ErrorCode.FORBIDDEN_URI
    assert parse_answer(b"not json") is None
    assert parse_answer(b"[1, 2]") is None
    assert parse_answer(b'{"job_id": "j1", "text": "only part of a result"}') is None
    assert parse_answer(None) is None


def test_a_broker_port_that_refuses_is_named() -> None:
    port = free_port()
    assert unreachable([f"127.0.0.1:{port}"]) == f"127.0.0.1:{port}: connection refused"
    assert unreachable(["no-such-host.invalid:9092"]) == "no-such-host.invalid:9092: no such host"


def test_a_listener_that_never_answers_counts_as_lost_only_when_an_answer_is_asked() -> None:
    from tests.conftest import SilentBroker

    with SilentBroker() as silent:
        assert unreachable([silent.bootstrap]) is None  # TCP alone: it accepts
        assert unreachable([silent.bootstrap], answer_timeout_s=0.3) == (
            f"{silent.bootstrap}: no Kafka answer within 0.3s"
        )
