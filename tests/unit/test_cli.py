"""The command line a newcomer meets, without a broker: every expected failure is one line on
stderr naming the cause, the source of the setting and the fix, with exit code 2 (issue #12)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from mmworker import __version__, logs
from mmworker.cli import build_parser, main
from mmworker.devkit.broker import free_port
from mmworker.devkit.samples import sample_image, sample_video
from mmworker.errors import ConfigError
from mmworker.metrics import Metrics
from mmworker.tools import expand_sources, media_ref, summarise, unreadable_by_worker
from tests import media_images as mi
from tests import media_videos as mv

ROOT = Path(__file__).parents[2]
REFUSED_FIX = (
    "start Kafka there, or point kafka.bootstrap_servers at your brokers (--bootstrap-servers, "
    "MMWORKER_KAFKA__BOOTSTRAP_SERVERS or [kafka] in the config file)"
)


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """The real command, as a person runs it: a fresh process, its own stdout and stderr."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MMWORKER_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mmworker", *args],
        capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT, check=False,
    )  # fmt: skip


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: an unreachable broker without leaving the host."""
    return free_port()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MMWORKER_"):
            monkeypatch.delenv(name)


# --- global flags and help ---------------------------------------------------------------------


def test_version_flag() -> None:
    out = _cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"mmworker {__version__}\n", "")


def test_run_help_uses_metavars_and_describes_each_setting() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    assert "KAFKA__BOOTSTRAP_SERVERS" not in text
    assert "--bootstrap-servers HOST:PORT[,...]" in text
    assert "--model ID_OR_DIR" in text
    flat = " ".join(text.split())
    assert "(kafka.group_id; default: mmworker)" in flat
    assert "Consumer group shared by all workers" in flat


def test_submit_and_tail_help_show_every_option_with_its_default() -> None:
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    submit = " ".join(choices["submit"].format_help().split())
    for expected in ("--max-tokens N longest caption (default: 128)",
                     "--temperature T 0 is greedy decoding (default: 0.0)",
                     "--top-p P nucleus sampling mass (default: 1.0)", "--seed N",
                     "(default: 786432)", "--config FILE", "--set KEY=VALUE"):  # fmt: skip
        assert expected in submit, expected
    tail = " ".join(choices["tail"].format_help().split())
    for expected in ("--follow, -f", "--from-now", "(default: 5.0)", "--config FILE"):
        assert expected in tail, expected
    broker = " ".join(choices["broker"].format_help().split())
    assert "--port PORT port on 127.0.0.1 (default: 9092)" in broker


#: Each command, and what its --help must show: every option (and positional) it takes. A command
#: added to the parser without an entry here fails test_every_command_is_covered_by_help_tests.
HELP_SHOWS: dict[str, tuple[str, ...]] = {
    "": ("COMMAND", "--version", "--debug", "run", "demo", "submit", "backfill", "replay", "tail",
         "broker", "schema", "config", "tiny-model"),
    "run": ("--config FILE", "--bootstrap-servers HOST:PORT[,...]", "--group-id GROUP",
            "--input-topic TOPIC", "--output-topic TOPIC", "--dead-letter-topic TOPIC",
            "--model ID_OR_DIR", "--max-in-flight N", "--cache-dir DIR", "--metrics-port PORT",
            "--worker-id NAME", "--processes N", "--set KEY=VALUE", "--create-topics PARTITIONS"),
    "demo": ("--keep",),
    "submit": ("PATH_OR_URL", "--config FILE", "--bootstrap-servers HOST:PORT[,...]",
               "--set KEY=VALUE", "--topic TOPIC", "--prompt PROMPT", "--task NAME",
               "--max-tokens N", "--temperature T", "--top-p P", "--seed N",
               "--inline-max-bytes BYTES", "--repeat N", "--response-format FILE|JSON"),
    "backfill": ("MANIFEST", "--out RESULTS", "--format {parquet,jsonl}", "--name NAME",
                 "--uri-column COLUMN", "(default: uri)", "--key-column COLUMN",
                 "--prompt-column COLUMN", "--options-column COLUMN",
                 "--metadata-columns COLUMN[,COLUMN...]", "--window N", "(default: 256)",
                 "--grace SECONDS", "(default: 300.0)", "--config FILE",
                 "--bootstrap-servers HOST:PORT[,...]", "--set KEY=VALUE", "--topic TOPIC",
                 "--prompt PROMPT", "--task NAME", "--max-tokens N", "--temperature T",
                 "--top-p P", "--seed N"),
    "replay": ("--config FILE", "--bootstrap-servers HOST:PORT[,...]", "--set KEY=VALUE",
               "--code CODE[,CODE...]", "--since WHEN", "--until WHEN", "--retryable-only",
               "--dry-run", "--topic TOPIC", "--backfill-out RESULTS", "--wait SECONDS",
               "(default: 600.0)"),
    "tail": ("--config FILE", "--bootstrap-servers HOST:PORT[,...]", "--set KEY=VALUE",
             "--topics TOPIC", "--follow, -f", "--from-now", "--timeout SECONDS", "--json"),
    "status": ("--config FILE", "--bootstrap-servers HOST:PORT[,...]", "--group-id GROUP",
               "--input-topic TOPIC", "--dead-letter-topic TOPIC", "--set KEY=VALUE", "--json",
               "-w [SECONDS], --watch [SECONDS]", "--since WHEN", "(default: 1h)"),
    "broker": ("--port PORT", "--partitions N"),
    "schema": ("{job,result,failure}",),
    "config": ("--config FILE", "--bootstrap-servers HOST:PORT[,...]", "--group-id GROUP",
               "--model ID_OR_DIR", "--processes N", "--set KEY=VALUE", "--reference"),
    "tiny-model": ("directory", "--arch {tiny,3b}", "--seed SEED"),
}  # fmt: skip


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


def test_every_command_is_covered_by_help_tests() -> None:
    assert sorted(_parsers()) == sorted(HELP_SHOWS)


@pytest.mark.parametrize("command", list(HELP_SHOWS), ids=lambda c: c or "mmworker")
def test_help_of_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), "--help"])
    captured = capsys.readouterr()
    assert (exit_.value.code, captured.err) == (0, "")
    text = captured.out
    assert text.startswith(f"usage: mmworker {command}".rstrip() + " "), text
    assert "-h, --help" in text
    flat = " ".join(text.split())
    for shown in HELP_SHOWS[command]:
        assert shown in flat, shown
    for action in _parsers()[command]._actions:  # nothing it accepts goes unmentioned
        if action.help != argparse.SUPPRESS:
            for flag in action.option_strings:
                assert flag in flat, flag
    # A metavar argparse made from a nested dest (kafka.bootstrap_servers -> dest
    # kafka__bootstrap_servers) reads KAFKA__BOOTSTRAP_SERVERS: every such one needs a metavar.
    usage = text.partition("\n\n")[0]
    assert "__" not in usage, usage
    assert not re.search(r"(?<![\w*])[A-Z][A-Z0-9]*__[A-Z0-9_]+", text), text


def test_help_imports_no_engine_or_media_stack() -> None:
    """--help answers at once: it must not import vLLM, torch or the media decoders."""
    script = (
        "import sys\nfrom mmworker.cli import main\n"
        f"for command in {list(HELP_SHOWS)!r}:\n"
        "    try:\n        main([*command.split(), '--help'])\n"
        "    except SystemExit as e:\n        assert e.code == 0, (command, e.code)\n"
        "heavy = ('vllm', 'torch', 'transformers', 'av', 'PIL', 'kafka', 'cv2')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


# --- brokers: checked first, in one line ------------------------------------------------------


def test_run_with_no_broker_fails_in_one_line_before_the_engine(closed_port: int) -> None:
    out = _cli("run", "--model", "tiny", "--bootstrap-servers", f"127.0.0.1:{closed_port}")
    assert out.returncode == 2
    assert out.stderr == (
        f"mmworker: cannot reach the Kafka brokers, kafka.bootstrap_servers='127.0.0.1:"
        f"{closed_port}' (from --bootstrap-servers): 127.0.0.1:{closed_port}: connection refused; "
        f"{REFUSED_FIX}\n"
    )
    assert out.stdout == ""


def test_the_message_names_the_environment_variable_it_came_from(closed_port: int) -> None:
    env = {"MMWORKER_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port}"}
    for command in (["run", "--model", "tiny"], ["tail"], ["submit", "x.jpg"]):
        out = _cli(*command, env=env)
        assert out.returncode == 2, command
        assert "(from MMWORKER_KAFKA__BOOTSTRAP_SERVERS)" in out.stderr
        assert len(out.stderr.splitlines()) == 1, out.stderr


def test_debug_adds_the_traceback(closed_port: int) -> None:
    out = _cli("--debug", "tail", "--bootstrap-servers", f"127.0.0.1:{closed_port}")
    assert out.returncode == 2
    assert out.stderr.startswith("Traceback (most recent call last):")
    assert out.stderr.splitlines()[-1].startswith("mmworker: cannot reach the Kafka brokers")
    after = _cli("tail", "--debug", "--bootstrap-servers", f"127.0.0.1:{closed_port}")
    assert after.stderr.startswith("Traceback")


def test_a_listener_that_is_not_kafka_is_named(clean_env: None) -> None:
    from mmworker.config import KafkaConfig
    from mmworker.kafka_io import check_brokers

    with socket.create_server(("127.0.0.1", 0)) as mute:
        port = mute.getsockname()[1]
        cfg = KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}")
        with pytest.raises(ConfigError) as err:
            check_brokers(cfg, 1.0, source="a test")
    assert err.value.message.startswith(
        f"reached kafka.bootstrap_servers='127.0.0.1:{port}' (from a test) over TCP, but it gave "
        "no Kafka answer within 1s with kafka.security_protocol=PLAINTEXT ("
    )
    assert err.value.message.endswith(
        "check that it is a Kafka listener and the TLS/SASL settings (kafka.security_protocol, "
        "kafka.sasl_*, kafka.ssl_*)"
    )


def test_a_bootstrap_server_without_port_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tail", "--bootstrap-servers", "kafka-0"]) == 2
    assert capsys.readouterr().err == (
        "mmworker: kafka.bootstrap_servers='kafka-0' (from --bootstrap-servers): 'kafka-0' is "
        "not host:port; write e.g. kafka-0:9092\n"
    )


# --- the model: checked before the engine -----------------------------------------------------


def test_a_model_path_that_does_not_exist(closed_port: int) -> None:
    out = _cli(
        "run", "--model", "/no/such/model", "--bootstrap-servers", f"127.0.0.1:{closed_port}"
    )
    assert out.returncode == 2
    assert out.stderr == (
        "mmworker: engine.model='/no/such/model' (from --model): no such directory: fix the path, "
        "or name a Hugging Face model such as Qwen/Qwen2.5-VL-3B-Instruct\n"
    )


def test_a_model_directory_without_config_json(tmp_path: Path, closed_port: int) -> None:
    out = _cli("run", "--model", str(tmp_path), "--bootstrap-servers", f"127.0.0.1:{closed_port}")
    assert out.returncode == 2
    assert out.stderr.startswith(
        f"mmworker: engine.model='{tmp_path}' (from --model) is a directory without config.json: "
        "point engine.model at"
    )


def test_the_default_model_offline_and_not_cached(tmp_path: Path, closed_port: int) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "MMWORKER_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port}"}  # fmt: skip
    out = _cli("run", env=env)
    assert out.returncode == 2
    assert out.stderr == (
        "mmworker: engine.model='Qwen/Qwen2.5-VL-3B-Instruct' (from the default) is not in the "
        f"Hugging Face cache ({tmp_path / 'hf' / 'hub'}) and HF_HUB_OFFLINE is set: download it "
        "where there is network (`hf download Qwen/Qwen2.5-VL-3B-Instruct`) into that cache, or "
        "set engine.model to a local model directory\n"
    )


def test_the_default_model_with_the_hub_out_of_reach(tmp_path: Path, closed_port: int) -> None:
    # The "Hub" is a closed loopback port: nothing leaves the machine.
    env = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": f"http://127.0.0.1:{closed_port}",
           "MMWORKER_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port}"}  # fmt: skip
    out = _cli("run", "--set", "engine.model=Qwen/Qwen2.5-VL-7B-Instruct", env=env)
    assert out.returncode == 2
    assert out.stderr == (
        "mmworker: engine.model='Qwen/Qwen2.5-VL-7B-Instruct' (from --set engine.model) is not "
        f"in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}) and the Hub (http://127.0.0.1:"
        f"{closed_port}) cannot be reached (ConnectError: [Errno 111] Connection refused): fix "
        "the network or proxy, or download it elsewhere (`hf download "
        "Qwen/Qwen2.5-VL-7B-Instruct`) and set engine.model to its directory\n"
    )


# --- configuration mistakes --------------------------------------------------------------------


def _config_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["config", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


def test_bad_toml_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    bad = tmp_path / "w.toml"
    bad.write_text('[kafka\nbootstrap_servers = "x"\n')
    assert _config_error(capsys, "--config", str(bad)) == (
        f"mmworker: config file {bad} is not valid TOML: Expected ']' at the end of a table "
        "declaration (at line 1, column 7): fix the file\n"
    )


def test_an_unknown_key_in_the_file_is_named_with_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('[kafka]\nbootstrap = "k:9092"\n')
    assert _config_error(capsys, "--config", str(toml)) == (
        f"mmworker: invalid configuration: kafka.bootstrap='k:9092' (from config file {toml}): "
        "no such setting; did you mean kafka.bootstrap_servers? (`mmworker config --reference` "
        "lists them all)\n"
    )


def test_a_missing_config_file_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    clean_env: None,
) -> None:  # fmt: skip
    monkeypatch.setenv("MMWORKER_CONFIG", str(tmp_path / "nope.toml"))
    assert _config_error(capsys) == (
        f"mmworker: config file {tmp_path / 'nope.toml'} (from MMWORKER_CONFIG) does not exist: "
        "fix the path\n"
    )


def test_an_environment_list_that_is_not_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    monkeypatch.setenv("MMWORKER_PREPROCESS__ALLOWED_ROOTS", "/data")
    assert _config_error(capsys) == (
        "mmworker: MMWORKER_PREPROCESS__ALLOWED_ROOTS='/data' is not JSON; lists and tables in "
        "the environment are written as JSON, e.g. "
        "MMWORKER_PREPROCESS__ALLOWED_ROOTS='[\"/data\"]'\n"
    )


def test_a_set_list_that_is_not_json(capsys: pytest.CaptureFixture[str], clean_env: None) -> None:
    assert _config_error(capsys, "--set", "preprocess.allowed_roots=/data") == (
        "mmworker: invalid configuration: preprocess.allowed_roots='/data' (from --set "
        "preprocess.allowed_roots): Input should be a valid tuple; lists are JSON: --set "
        "'preprocess.allowed_roots=[\"/data\"]'\n"
    )


def test_a_set_without_a_value(capsys: pytest.CaptureFixture[str], clean_env: None) -> None:
    assert _config_error(capsys, "--set", "limits.max_in_flight") == (
        "mmworker: --set needs KEY=VALUE, got 'limits.max_in_flight': e.g. --set "
        "limits.max_in_flight=64\n"
    )


def test_log_level_in_any_case_and_a_wrong_one_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    monkeypatch.setenv("MMWORKER_LOG_LEVEL", "debug")
    assert main(["config"]) == 0
    assert json.loads(capsys.readouterr().out)["log_level"] == "DEBUG"
    monkeypatch.setenv("MMWORKER_LOG_LEVEL", "verbose")
    assert _config_error(capsys) == (
        "mmworker: invalid configuration: log_level='verbose' (from MMWORKER_LOG_LEVEL): Input "
        "should be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'\n"
    )


def test_the_example_config_says_which_variable_holds_the_password(
    capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    example = ROOT / "deploy" / "mmworker.example.toml"
    assert _config_error(capsys, "--config", str(example)) == (
        f"mmworker: invalid configuration: kafka (from config file {example}): SASL needs "
        "kafka.sasl_password (MMWORKER_KAFKA__SASL_PASSWORD) with security_protocol SASL_SSL: "
        "set them in the environment or the config file\n"
    )


def test_a_bad_sampling_option_is_named_before_the_brokers(
    capsys: pytest.CaptureFixture[str], closed_port: int, clean_env: None
) -> None:
    argv = [
        "submit",
        "x.jpg",
        "--temperature",
        "3",
        "--bootstrap-servers",
        f"127.0.0.1:{closed_port}",
    ]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "mmworker: invalid sampling option: --temperature 3.0: Input should be less than or "
        "equal to 2\n"
    )


def test_broker_refuses_a_port_in_use_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["broker", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (
        f"mmworker: cannot listen on 127.0.0.1:{port}: pid {os.getpid()} "
        f"({psutil.Process().name()}) listens there; stop it or pick another port with --port\n"
    )


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmworker", "schema"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read()
    # 141 when a write met the closed pipe; 0 when the whole output had already fit in the pipe
    # buffer before the reader left (timing): either way, nothing on stderr.
    assert proc.wait(timeout=60) in (0, 141)
    assert err == b""


# --- submit's choices, without a broker --------------------------------------------------------


def test_directories_are_walked_by_content_not_by_name(tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    (tmp_path / "photo.dat").write_bytes(sample_image(seed=1))  # a JPEG without its suffix
    (tmp_path / "nested" / "clip").write_bytes(sample_video(seconds=1))
    (tmp_path / "fake.jpg").write_text("<html><body>404</body></html>")
    (tmp_path / "notes.txt").write_text("not media")
    found = {Path(s.name).name: s.skip for s in expand_sources([str(tmp_path)])}
    assert found == {
        "clip": None,
        "photo.dat": None,
        "fake.jpg": "media is an HTML document (an error or login page?), not an image or video",
        "notes.txt": "media is text ('not media'...), not an image or video",
    }
    missing = list(expand_sources([str(tmp_path / "nope.jpg"), "https://example.com/a.jpg"]))
    assert [(s.name.rpartition("/")[2], s.skip) for s in missing] == [
        ("nope.jpg", "no such file"), ("a.jpg", None)
    ]  # fmt: skip


def test_phone_stills_and_old_containers_under_any_name_are_walked_in(tmp_path: Path) -> None:
    """AVIF and HEIC from phones, ASF/WMV, Ogg and FLV from archives: found by their bytes
    under a wrong suffix or none, and sendable when named one by one too."""
    media = {
        "IMG_0001.jpg": mi.avif(64, 48),  # AVIF named as a JPEG
        "IMG_0002": mi.heic(64, 48),  # HEIC without a suffix
        "lecture.mp4": mv.encode_video("wmv2"),  # ASF/WMV named as MP4
        "nested/clip.dat": mv.encode_video("libvpx", container="ogg"),  # Ogg (VP8)
        "nested/old/flash": mv.encode_video("flv"),  # FLV without a suffix
    }
    for name, data in media.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    # A real Ogg that is not a video: the walk must look inside, not pass every container.
    voice = mv.encode_audio_only(fmt="ogg", codec="libopus")
    (tmp_path / "nested" / "voice.ogv").write_bytes(voice)

    walked = list(expand_sources([str(tmp_path)]))
    found = {Path(s.name).relative_to(tmp_path).as_posix(): s.skip for s in walked}
    assert found == {
        **dict.fromkeys(media),
        "nested/voice.ogv": "media is ogg without a video stream (streams: audio)",
    }
    assert not any(s.named for s in walked)
    named = list(expand_sources([str(tmp_path / name) for name in media]))
    assert [(s.skip, s.named) for s in named] == [(None, True)] * len(media)


def test_a_large_file_outside_the_allowed_roots_says_how_to_fix_it(tmp_path: Path) -> None:
    big = tmp_path / "big.jpg"
    big.write_bytes(sample_image(seed=3))
    size = big.stat().st_size
    assert unreadable_by_worker(str(big), size, ()) is None
    assert media_ref(str(big), size).data == big.read_bytes()
    assert unreadable_by_worker(str(big), 100, ()) == (
        f"{size} bytes is over --inline-max-bytes (100), so it would go as a file:// URI, which "
        "a worker reads only under preprocess.allowed_roots (empty): raise --inline-max-bytes, "
        "or give the worker and this command --set "
        f"'preprocess.allowed_roots={json.dumps([str(tmp_path.resolve())])}'"
    )
    assert unreadable_by_worker(str(big), 100, (tmp_path,)) is None
    assert media_ref(str(big), 100).uri == big.resolve().as_uri()


def test_tail_names_a_record_by_the_source_submit_recorded() -> None:
    result = {"job_id": "j1", "metadata": {"source": "/data/a.jpg"}, "text": "a cat",
              "media": [{"kind": "image"}]}  # fmt: skip
    assert summarise("out", result) == "[out] /data/a.jpg (job j1) [image]: 'a cat'"
    failure = {"job_id": "j2", "metadata": {"source": "b.mp4"}, "code": "too_large", "message": "m"}
    assert summarise("dlq", failure) == "[dlq] FAILED b.mp4 (job j2): too_large: m"
    assert summarise("dlq", {"code": "invalid_json", "message": "m"}, b"k") == (
        "[dlq] FAILED k: invalid_json: m"
    )
    # A record with no value (a tombstone): json.loads(None) stopped tail with a traceback.
    from types import SimpleNamespace

    from mmworker.tools import _line

    tombstone = SimpleNamespace(topic="suspects", key=b"in/0/7", value=None)
    assert _line(tombstone, raw=False) == "[suspects] no value (key b'in/0/7')"
    assert _line(tombstone, raw=True) == "[suspects] no value (key b'in/0/7')"


def test_submit_and_tail_connect_with_the_workers_tls_and_sasl_settings(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    clean_env: None,
) -> None:
    """The deployment's SASL_SSL settings (file, secret from the environment, --set) reach the
    kafka-python clients of submit and tail, and the broker check before them."""
    import mmworker.client
    import mmworker.kafka_io
    from mmworker.config import KafkaConfig
    from tests.unit.loopkit import Producer

    example = ROOT / "deploy" / "mmworker.example.toml"
    monkeypatch.setenv("MMWORKER_KAFKA__SASL_PASSWORD", "from-a-secret")
    mutual_tls = ["--set", "kafka.ssl_certfile=/etc/mmworker/client.pem",
                  "--set", "kafka.ssl_keyfile=/etc/mmworker/client.key",
                  "--set", "kafka.ssl_password=key-pass"]  # fmt: skip
    expected = {
        "bootstrap_servers": ["kafka-0.kafka:9092", "kafka-1.kafka:9092"],
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "mmworker",
        "sasl_plain_password": "from-a-secret",
        "ssl_cafile": "/etc/mmworker/ca.pem",
        "ssl_certfile": "/etc/mmworker/client.pem",
        "ssl_keyfile": "/etc/mmworker/client.key",
        "ssl_password": "key-pass",
    }
    checked: list[object] = []
    monkeypatch.setattr(mmworker.kafka_io, "check_brokers",
                        lambda cfg, timeout_s, source: checked.append(cfg))  # fmt: skip
    clients: dict[str, dict[str, object]] = {}

    class Acked:  # kafka-python's future, answered at once with the record's place
        def __init__(self, topic: str) -> None:
            self.meta = SimpleNamespace(topic=topic, partition=0, offset=0)

        def add_callback(self, fn: Any) -> None:
            fn(self.meta)

        def add_errback(self, fn: Any) -> None:
            pass

    class AckingProducer(Producer):
        def send(self, topic: str, *, key: bytes, value: bytes, headers: Any = None) -> Any:
            super().send(topic, key=key, value=value, headers=headers)
            return Acked(topic)

    producer = AckingProducer()

    def make_producer(**kwargs: object) -> Producer:
        clients["producer"] = kwargs
        return producer

    class Consumer:
        def __init__(self, *topics: str, **kwargs: object) -> None:
            clients["consumer"] = kwargs
            self.subscribed = set(topics)
            value = json.dumps({"job_id": "j1", "text": "a cat", "media": [{"kind": "image"}]})
            result = SimpleNamespace(topic="mmworker.results", key=b"j1", value=value.encode())
            self.batches = [{("mmworker.results", 0): [result]}]

        def topics(self) -> set[str]:
            return {"mmworker.results", "mmworker.dead-letter"}

        def poll(self, timeout_ms: int) -> dict[Any, list[Any]]:
            return self.batches.pop(0) if self.batches else {}

        def subscription(self) -> set[str]:
            return self.subscribed

        def close(self) -> None:
            pass

    monkeypatch.setattr(mmworker.kafka_io, "KafkaProducer", make_producer)
    monkeypatch.setattr(mmworker.client, "KafkaConsumer", Consumer)
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(sample_image(seed=2))

    assert main(["submit", "--config", str(example), *mutual_tls, str(photo)]) == 0
    assert main(["tail", "--config", str(example), *mutual_tls, "--timeout", "0.1"]) == 0

    for name in ("producer", "consumer"):
        given = {key: clients[name].get(key) for key in expected}
        assert given == expected, name
    assert [topic for topic, _, _ in producer.sent] == ["mmworker.jobs"]
    assert "[mmworker.results] j1 [image]: 'a cat'" in capsys.readouterr().out
    assert len(checked) == 2
    for cfg in checked:  # the broker check before them speaks the same protocol
        assert isinstance(cfg, KafkaConfig)
        assert {key: cfg.client_kwargs().get(key) for key in expected} == expected


# --- logging policy ----------------------------------------------------------------------------


def test_library_levels_follow_ours() -> None:
    assert [logs.library_level(x) for x in ("DEBUG", "INFO", "WARNING", "ERROR")] == [
        "DEBUG", "WARNING", "WARNING", "ERROR"
    ]  # fmt: skip


def test_vllm_processes_get_our_policy_but_a_persons_setting_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "TORCH_CPP_LOG_LEVEL",
                 "PYTHONWARNINGS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # a person's choice
    monkeypatch.setattr(logs, "_SET_BY_US", {})
    logs.quiet_libraries("INFO")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["loggers"]["vllm"] == {"handlers": ["mmworker"], "level": "WARNING",
                                         "propagate": False}  # fmt: skip
    assert config["handlers"]["mmworker"]["stream"] == "ext://sys.stderr"
    assert config["filters"]["noise"] == {"()": "mmworker.logs.KnownNoise"}
    assert Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).parent == tmp_path / "mmworker"
    logs.quiet_libraries("DEBUG")  # the level became known: ours change, the person's stays
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ
    debug = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert "noise" not in debug["filters"]  # DEBUG shows everything; job fields stay
    assert debug["handlers"]["mmworker"]["filters"] == ["job"]
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"


def test_a_persons_vllm_logging_level_reaches_vllms_own_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VLLM_LOGGING_LEVEL=INFO is how one sees vLLM's start-up lines (KV cache size, compile
    times): the logging file vLLM applies, and its logger here, must carry it, not our WARNING
    (they did not: the file's handler cut every INFO line whatever the variable said)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "info")  # a person's choice, any case
    monkeypatch.setattr(logs, "_SET_BY_US", {})
    logs.quiet_libraries("INFO")
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["loggers"]["vllm"]["level"] == "INFO"
    assert config["handlers"]["mmworker"]["level"] == "INFO"
    assert logging.getLogger("vllm").level == logging.INFO
    assert logging.getLogger("kafka").level == logging.WARNING  # the rest keeps our policy
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH"):  # a fresh process
        monkeypatch.delenv(name)
    monkeypatch.setattr(logs, "_SET_BY_US", {})
    logs.quiet_libraries("INFO")  # nobody asked: ours
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["handlers"]["mmworker"]["level"] == "WARNING"
    assert logging.getLogger("vllm").level == logging.WARNING


def test_known_noise_is_dropped_and_the_rest_kept() -> None:
    noise = logs.KnownNoise()

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("vllm.x", logging.WARNING, "f", 1, msg, ("w", "a", "b"), None)

    assert not noise.filter(record("Attempted to load weight %s with dtype %s into parameter %s"))
    assert not noise.filter(record("Enforce eager set, disabling torch.compile"))
    assert noise.filter(record("Not enough KV cache for %s %s %s"))


def test_the_progress_summary_reads_the_metrics(caplog: pytest.LogCaptureFixture) -> None:
    from mmworker.app import _summarise_forever

    metrics = Metrics()
    metrics.jobs.labels("result").inc(6)
    metrics.jobs.labels("failure").inc(2)
    metrics.in_flight.set(3)

    async def two_rounds() -> None:
        task = asyncio.create_task(_summarise_forever(metrics, every_s=0.05))
        async with asyncio.timeout(30):
            while not caplog.records:  # the first round has logged (a busy host may be late)
                await asyncio.sleep(0.005)
        metrics.in_flight.set(0)
        await asyncio.sleep(0.15)  # nothing new, nothing held: no line
        task.cancel()

    with caplog.at_level(logging.INFO, logger="mmworker.app"):
        asyncio.run(two_rounds())
    assert [r.getMessage() for r in caplog.records] == [
        "6 ok, 2 failed, 3 in flight; 160.00 jobs/s over the last 0.05s"
    ]


_KILLED_LOCK_HOLDER = """
import multiprocessing, os, signal, sys

def hold(conn):
    lock = multiprocessing.get_context("spawn").Lock()  # as vLLM's engine core holds one
    conn.send("holding")
    signal.pause()

if __name__ == "__main__":
    if sys.argv[1] == "policy":
        from mmworker import logs
        logs.quiet_libraries("INFO")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    holder = ctx.Process(target=hold, args=(child,))
    holder.start()
    assert parent.recv() == "holding"
    os.kill(holder.pid, signal.SIGKILL)  # what vLLM's shutdown does to a slow engine core
    holder.join()
"""


def test_a_killed_engine_core_leaves_no_leaked_semaphore_warning(tmp_path: Path) -> None:
    script = tmp_path / "holder.py"
    script.write_text(_KILLED_LOCK_HOLDER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["XDG_CACHE_HOME"] = str(tmp_path)

    def run(mode: str) -> str:
        out = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                             env=env, timeout=120, check=True)  # fmt: skip
        return out.stderr

    assert "There appear to be 1 leaked semaphore objects" in run("bare")
    assert run("policy") == ""


# --- the remaining commands and flags ----------------------------------------------------------


def test_every_run_flag_sets_its_setting(tmp_path: Path, clean_env: None) -> None:
    from mmworker.cli import overrides_from
    from mmworker.config import load_config

    toml = tmp_path / "w.toml"
    toml.write_text("[limits]\nshutdown_grace_s = 7\n")
    args = build_parser().parse_args([
        "run", "--config", str(toml), "--bootstrap-servers", "k:1", "--group-id", "g",
        "--input-topic", "i", "--output-topic", "o", "--dead-letter-topic", "d", "--model", "m",
        "--max-in-flight", "9", "--cache-dir", str(tmp_path), "--metrics-port", "9400",
        "--worker-id", "w", "--processes", "2", "--create-topics", "4",
        "--set", "engine.max_num_seqs=8",
    ])  # fmt: skip
    cfg = load_config(args.config, **overrides_from(args))
    k = cfg.kafka
    assert (k.bootstrap_servers, k.group_id, k.input_topic, k.output_topic,
            k.dead_letter_topic) == ("k:1", "g", "i", "o", "d")  # fmt: skip
    assert (cfg.engine.model, cfg.limits.max_in_flight, cfg.cache.directory) == ("m", 9, tmp_path)
    assert (cfg.metrics_port, cfg.worker_id, cfg.processes) == (9400, "w", 2)
    assert (cfg.engine.max_num_seqs, cfg.limits.shutdown_grace_s, args.create_topics) == (8, 7, 4)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["backfill", "{tmp}/notes.txt", "--out", "{tmp}/r.parquet"],
         "manifest {tmp}/notes.txt: not a directory, a glob, or a file ending in .jsonl"),
        (["backfill", "{tmp}/gone.csv", "--out", "{tmp}/r.parquet"],
         "manifest {tmp}/gone.csv: no such file"),
        (["backfill", "{tmp}/m.jsonl", "--out", "{tmp}/r.csv"],
         "--out {tmp}/r.csv: name it .parquet or .jsonl, or say which with --format"),
        (["backfill", "{tmp}/m.jsonl", "--out", "{tmp}/r.parquet", "--window", "0"],
         "--window 0: at least 1 job must be allowed outstanding"),
        (["backfill", "{tmp}/m.jsonl", "--out", "{tmp}/r.parquet", "--max-tokens", "0"],
         "invalid sampling option: --max-tokens 0"),
        # was "invalid configuration: prompt='xxx…' (from the default)" for submit, and every
        # row an invalid_schema failure for backfill
        (["backfill", "{tmp}/m.jsonl", "--out", "{tmp}/r.parquet", "--prompt", "x" * 16385],
         "invalid --prompt (16,385 characters): String should have at most 16384 characters"),
        (["replay", "--code", "fetch_failed,nope"], "--code nope: no such failure code"),
        (["replay", "--since", "yesterday"], "'yesterday' is not a time"),
        # were tracebacks: OverflowError, and time.sleep(nan)'s ValueError once watching
        (["replay", "--since", "1000000d"], "'1000000d' reaches back before any time"),
        (["status", "-w", "nan"], "-w nan: refresh every so many seconds"),
        # each was silent: nothing posted with exit 0, a resume that never re-posted, a
        # mistyped glob that made an empty "ok" backfill
        (["submit", "{tmp}/notes.txt", "--repeat", "0"], "--repeat 0: post each source at least"),
        (["backfill", "{tmp}/m.jsonl", "--out", "{tmp}/r.parquet", "--grace", "nan"],
         "--grace nan: seconds, 0 or more"),
        (["backfill", "{tmp}/*.jpeg", "--out", "{tmp}/r.parquet"],
         "manifest {tmp}/*.jpeg: the glob matches no file"),
        (["replay", "--backfill-out", "{tmp}/r.parquet", "--wait", "-1"],
         "--wait -1.0: seconds, 0 or more"),
    ],
)  # fmt: skip
def test_backfill_and_replay_mistakes_are_one_line_before_the_brokers(
    argv: list[str], expected: str, tmp_path: Path, closed_port: int, clean_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "m.jsonl").write_text('{"uri": "a.jpg"}\n')
    args = [a.format(tmp=tmp_path) for a in argv]
    assert main([*args, "--bootstrap-servers", f"127.0.0.1:{closed_port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmworker: " + expected.format(tmp=tmp_path)), err
    assert err.count("\n") == 1


def test_backfill_needs_reachable_brokers(
    tmp_path: Path, closed_port: int, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "m.jsonl").write_text('{"uri": "a.jpg"}\n')
    argv = ["backfill", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "r.parquet"),
            "--bootstrap-servers", f"127.0.0.1:{closed_port}"]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("mmworker: cannot reach the Kafka brokers")
    assert not (tmp_path / "r.parquet").exists() and not (tmp_path / "r.parquet.journal").exists()


def test_config_reference_and_schemas(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out.startswith("| setting | environment variable | default |")
    for name in ("job", "result", "failure"):
        assert main(["schema", name]) == 0
        assert json.loads(capsys.readouterr().out)["title"].lower() == name


def test_tiny_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiny-model", str(tmp_path / "3b"), "--arch", "3b", "--seed", "1"]) == 0
    assert capsys.readouterr().out == (
        f"wrote 3b Qwen2.5-VL (random weights, for testing) to {tmp_path / '3b'}\n"
    )
    assert (tmp_path / "3b" / "config.json").is_file()


def test_kafka_pythons_slow_task_warning_is_noise() -> None:
    # kafka-python formats this one itself, so the filter sees the rendered text.
    rendered = "Task <kafka.net.selector.Task object at 0x7f> ran for 0.2s (>0.1s threshold)."
    record = logging.LogRecord("kafka.net.selector", logging.WARNING, "f", 1, rendered, (), None)
    assert not logs.KnownNoise().filter(record)


@pytest.mark.parametrize(("command", "want"), [("submit", 130), ("run", 0)])
def test_a_stop_before_a_commands_own_handler_keeps_its_documented_code(
    monkeypatch: pytest.MonkeyPatch, command: str, want: int
) -> None:
    """Ctrl-C while `submit` checked the brokers (before its own handler) exited 0, so a shell's
    `&&` went on as if the jobs were posted; `run` stopped before consuming is a stop: 0."""
    import signal

    from mmworker import cli
    from mmworker.exits import Interrupted

    def interrupted(*_args: object) -> None:
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(cli, "_check_brokers", interrupted)
    monkeypatch.setattr(cli, "check_model", lambda model, source: None)
    argv = {"submit": ["submit", "https://example.org/a.jpg"], "run": ["run"]}[command]
    assert cli.main(argv) == want
