from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from mmworker.cli import build_parser, overrides_from
from mmworker.config import load_config
from mmworker.config_reference import render_reference
from mmworker.errors import ConfigError


def test_precedence_flags_over_env_over_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('[kafka]\ngroup_id = "from-file"\ninput_topic = "file-topic"\n'
                    '[engine]\nmax_num_seqs = 8\n')  # fmt: skip
    monkeypatch.setenv("MMWORKER_KAFKA__GROUP_ID", "from-env")
    cfg = load_config(toml, engine={"max_num_seqs": 32})
    assert cfg.kafka.group_id == "from-env"
    assert cfg.kafka.input_topic == "file-topic"
    assert cfg.engine.max_num_seqs == 32


def test_gpu_memory_utilization_is_raised_above_vllm_default() -> None:
    assert load_config().engine.gpu_memory_utilization > 0.9


def test_secrets_are_masked() -> None:
    cfg = load_config(kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                             "sasl_username": "u", "sasl_password": "hunter2"})  # fmt: skip
    assert "hunter2" not in str(cfg.masked())
    assert cfg.kafka.client_kwargs()["sasl_plain_password"] == "hunter2"


def test_incomplete_sasl_is_refused() -> None:
    with pytest.raises(ValidationError, match="SASL needs"):
        load_config(kafka={"security_protocol": "SASL_PLAINTEXT"})


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(ValidationError):
        load_config(engine={"no_such_knob": 1})


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_config_is_frozen() -> None:
    cfg = load_config()
    with pytest.raises(ValidationError):
        cfg.kafka.group_id = "x"  # type: ignore[misc]


def test_cli_flags_and_set_build_nested_overrides() -> None:
    args = build_parser().parse_args([
        "run", "--bootstrap-servers", "b:1", "--max-in-flight", "7",
        "--set", "engine.limit_mm_per_prompt={\"image\": 2, \"video\": 2}",
        "--set", "engine.quantization=fp8",
    ])  # fmt: skip
    over = overrides_from(args)
    cfg = load_config(**over)
    assert cfg.kafka.bootstrap_servers == "b:1"
    assert cfg.limits.max_in_flight == 7
    assert cfg.engine.limit_mm_per_prompt == {"image": 2, "video": 2}
    assert cfg.engine.quantization == "fp8"


def test_reference_lists_every_setting_with_its_env_var() -> None:
    ref = render_reference()
    assert "`MMWORKER_ENGINE__GPU_MEMORY_UTILIZATION`" in ref
    assert "`MMWORKER_LIMITS__MAX_IN_FLIGHT`" in ref
    assert ref.count("\n") > 50


def test_deploy_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).parents[2] / "deploy" / "mmworker.example.toml"
    monkeypatch.setenv("MMWORKER_KAFKA__SASL_PASSWORD", "from-a-secret")
    cfg = load_config(example)
    assert cfg.kafka.sasl_mechanism == "SCRAM-SHA-512"
    assert cfg.kafka.sasl_password is not None
    assert cfg.kafka.sasl_password.get_secret_value() == "from-a-secret"
    assert cfg.engine.limit_mm_per_prompt == {"image": 4, "video": 1}
    assert cfg.preprocess.allowed_roots == (Path("/data/media"),)


def test_every_setting_is_described() -> None:
    undocumented = [ln.split("|")[1] for ln in render_reference().splitlines() if "|  |" in ln]
    assert undocumented == []


def test_docs_reference_is_current() -> None:
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    assert render_reference() in page, (
        "docs/configuration.md's reference is stale: run scripts/refresh-docs.py"
    )


def test_config_and_schema_commands_print_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from mmworker.cli import main

    monkeypatch.setenv("MMWORKER_KAFKA__SASL_PASSWORD", "s3cret")
    assert main(["config", "--group-id", "g7"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["kafka"]["group_id"] == "g7"
    assert "s3cret" not in printed
    assert main(["schema", "job"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "job_id" in schema["required"] and "media" in schema["required"]


def test_invalid_setting_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    from mmworker.cli import main

    assert main(["config", "--set", "limits.max_in_flight=0"]) == 2
    assert "invalid configuration" in capsys.readouterr().err


def test_log_level_in_any_case() -> None:
    assert load_config(log_level="warning").log_level == "WARNING"
    with pytest.raises(ValidationError, match="Input should be 'DEBUG'"):
        load_config(log_level="loud")


def test_bad_toml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text("[engine]\nmodel = \n")
    with pytest.raises(ConfigError) as err:
        load_config(toml)
    assert err.value.message == (
        f"config file {toml} is not valid TOML: Invalid value (at line 2, column 9): fix the file"
    )


def test_environment_lists_and_tables_must_be_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMWORKER_KAFKA__REPLY_TOPICS", "captions, search")
    with pytest.raises(ConfigError) as err:
        load_config()
    assert err.value.message == (
        "MMWORKER_KAFKA__REPLY_TOPICS='captions, search' is not JSON; lists and tables in the "
        "environment are written as JSON, e.g. "
        'MMWORKER_KAFKA__REPLY_TOPICS=\'["captions", "search"]\''
    )
    monkeypatch.setenv("MMWORKER_KAFKA__REPLY_TOPICS", '["captions"]')
    monkeypatch.setenv("MMWORKER_ENGINE__LIMIT_MM_PER_PROMPT", "image=2")
    with pytest.raises(ConfigError, match=r"e\.g\. MMWORKER_ENGINE__LIMIT_MM_PER_PROMPT="):
        load_config()
    monkeypatch.delenv("MMWORKER_ENGINE__LIMIT_MM_PER_PROMPT")
    assert load_config().kafka.reply_topics == ("captions",)


def test_incomplete_sasl_names_the_missing_variables() -> None:
    with pytest.raises(ValidationError) as err:
        load_config(kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"})
    assert (
        "SASL needs kafka.sasl_username (MMWORKER_KAFKA__SASL_USERNAME), kafka.sasl_password "
        "(MMWORKER_KAFKA__SASL_PASSWORD) with security_protocol SASL_SSL: set them in the "
        "environment or the config file"
    ) in str(err.value)


def test_unset_fast_path_settings_follow_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left unset, processes, the compiled encoder and max_in_flight are chosen from the host
    once at load; a host without a GPU gets exactly the old fixed defaults."""
    from mmworker import hardware
    from mmworker.hardware import GIB, Hardware

    cpu = Hardware(gpu_name=None, gpu_memory_bytes=0, gpus=0, cores=2)
    h200 = Hardware(gpu_name="NVIDIA H200", gpu_memory_bytes=140 * GIB, gpus=1, cores=16)
    monkeypatch.setattr(hardware, "probe", lambda: cpu)
    on_cpu = load_config()
    assert (on_cpu.processes, on_cpu.engine.compile_vision_encoder) == (1, False)
    assert on_cpu.limits.max_in_flight == 256
    monkeypatch.setattr(hardware, "probe", lambda: h200)
    on_gpu = load_config()
    assert (on_gpu.processes, on_gpu.engine.compile_vision_encoder) == (2, True)
    assert on_gpu.limits.max_in_flight == 1024
    # An explicit value wins over the hardware, and a model over two GPUs keeps one process.
    mine = load_config(
        processes=1, engine={"compile_vision_encoder": False}, limits={"max_in_flight": 64}
    )
    assert (mine.processes, mine.engine.compile_vision_encoder) == (1, False)
    assert mine.limits.max_in_flight == 64
    assert load_config(engine={"tensor_parallel_size": 2}).processes == 1
    assert load_config(engine={"enforce_eager": True}).engine.compile_vision_encoder is False
    monkeypatch.setenv("MMWORKER_PROCESSES", "3")
    assert load_config().processes == 3


def test_config_command_says_what_the_hardware_chose_and_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from mmworker import hardware
    from mmworker.cli import main
    from mmworker.hardware import GIB, Hardware

    h200 = Hardware(gpu_name="NVIDIA H200", gpu_memory_bytes=140 * GIB, gpus=1, cores=16)
    monkeypatch.setattr(hardware, "probe", lambda: h200)
    assert main(["config", "--max-in-flight", "512"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["processes"] == 2  # stdout stays one JSON document
    why = captured.err.splitlines()
    assert why[0] == "# this host: NVIDIA H200 (140 GiB), 16 cores"
    assert why[1].startswith("# processes = 2 (auto: NVIDIA H200 (140 GiB), 16 cores: one vLLM")
    assert why[2].startswith("# engine.compile_vision_encoder = true (auto: ")
    assert why[3] == "# limits.max_in_flight = 512 (set)"


def test_a_metrics_port_whose_process_ports_pass_65535_is_refused() -> None:
    """Process i of a set listens on metrics_port + 1 + i: past 65535 each failed to start."""
    with pytest.raises(ValidationError, match="pick a port at most 65533"):
        load_config(processes=2, metrics_port=65535)
    assert load_config(processes=2, metrics_port=65533).metrics_port == 65533
    assert load_config(processes=1, metrics_port=65535).metrics_port == 65535


def test_the_default_preprocessing_pool_counts_the_cores_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod limited to 8 CPUs on a 128-core node: 7 decoders, not 127."""
    from mmworker import hardware

    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    assert load_config().preprocess.workers == 7


def test_an_infinite_aspect_ratio_limit_is_refused() -> None:
    """It passed, and every media item then failed: the cache key's JSON refuses inf."""
    with pytest.raises(ValidationError, match="finite"):
        load_config(preprocess={"max_aspect_ratio": float("inf")})


def test_text_settings_given_like_numbers_are_taken_as_text() -> None:
    """`--set` reads values as JSON, so `kafka.input_topic=2024` arrived as a number and was
    refused with "Input should be a valid string"."""
    args = build_parser().parse_args(
        ["run", "--set", "kafka.input_topic=2024", "--set", "worker_id=7"]
    )
    cfg = load_config(**overrides_from(args))
    assert (cfg.kafka.input_topic, cfg.worker_id) == ("2024", "7")
