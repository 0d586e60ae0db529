"""The engine core skips vLLM's dummy-encode width measurement for the worker's store only."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mmworker.engine import encoder_widths
from mmworker.lifeline import ENV

core = pytest.importorskip("vllm.v1.engine.core")


def _config(connector: str | None, module: str = encoder_widths.CONNECTOR_MODULE) -> Any:
    ec = (
        None
        if connector is None
        else SimpleNamespace(ec_connector=connector, ec_connector_module_path=module)
    )
    return SimpleNamespace(ec_transfer_config=ec)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """vLLM's measurement, replaced by one that records the connector it was asked about (and
    put back after the test, patched or not)."""
    calls: list[str] = []

    def measure(vllm_config: Any, collective_rpc: Any) -> None:
        ec = vllm_config.ec_transfer_config
        calls.append("none" if ec is None else ec.ec_connector)

    monkeypatch.setattr(core, "measure_encoder_output_widths", measure)
    return calls


def test_only_the_workers_store_skips_the_measurement(measured: list[str]) -> None:
    assert encoder_widths.skip_for_disk_store()
    assert not encoder_widths.skip_for_disk_store()  # once: not wrapped twice
    for connector in (encoder_widths.CONNECTOR, "MooncakeECConnector", None):
        core.measure_encoder_output_widths(_config(connector), collective_rpc=None)
    # A connector of the same name from another module may read the width.
    core.measure_encoder_output_widths(
        _config(encoder_widths.CONNECTOR, module="someone.elses"), collective_rpc=None
    )
    # Mooncake sizes its transfers by the width: it is measured, as without a connector.
    assert measured == ["MooncakeECConnector", "none", encoder_widths.CONNECTOR]


@pytest.mark.parametrize("in_worker", [True, False])
def test_the_plugin_acts_only_in_a_workers_processes(
    monkeypatch: pytest.MonkeyPatch, measured: list[str], in_worker: bool
) -> None:
    if in_worker:
        monkeypatch.setenv(ENV, "1")
    else:
        monkeypatch.delenv(ENV, raising=False)
    encoder_widths.install()
    core.measure_encoder_output_widths(_config(encoder_widths.CONNECTOR), collective_rpc=None)
    assert measured == ([] if in_worker else [encoder_widths.CONNECTOR])


def test_the_engine_names_the_connector_the_patch_looks_for(tmp_path: Path) -> None:
    from mmworker.config import EngineConfig
    from mmworker.engine import Engine
    from mmworker.engine.encoder_store import DiskEncoderStore

    kwargs = Engine(EngineConfig(), "tiny", encoder_store=tmp_path).engine_kwargs()
    assert kwargs["ec_transfer_config"]["ec_connector"] == encoder_widths.CONNECTOR
    assert DiskEncoderStore.__name__ == encoder_widths.CONNECTOR
    assert DiskEncoderStore.__module__ == encoder_widths.CONNECTOR_MODULE


def test_the_engine_skips_it_before_its_core_starts(
    monkeypatch: pytest.MonkeyPatch, measured: list[str], tmp_path: Path
) -> None:
    """A forked core (the first start on a GPU) runs no plugin of its own: it inherits what the
    worker's process has when vLLM's engine is built."""
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm

    import mmworker.engine as engine_module
    from mmworker.config import EngineConfig
    from mmworker.engine import Engine

    seen: list[str] = []

    class Built(Exception):
        pass

    class FakeAsyncLLM:
        @classmethod
        def from_engine_args(cls, args: Any, **_: Any) -> Any:
            ec = SimpleNamespace(**args.ec_transfer_config)  # what vLLM's config makes of it
            core.measure_encoder_output_widths(
                SimpleNamespace(ec_transfer_config=ec), collective_rpc=None
            )
            seen.append(ec.ec_connector)
            raise Built

    monkeypatch.setattr(vllm.v1.engine.async_llm, "AsyncLLM", FakeAsyncLLM)
    # The arguments as given: vLLM's own would look the model up.
    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", SimpleNamespace)
    # What else `_start` does to this process (its environment, vLLM's config class) is for
    # other tests to check, and must not outlive this one.
    monkeypatch.setattr(engine_module, "engine_process_env", lambda first_start=False: None)
    monkeypatch.setattr(engine_module.compile_key, "ignore_kv_size", lambda _cls: False)
    engine = Engine(EngineConfig(), "tiny", encoder_store=tmp_path)
    with pytest.raises(Built):
        engine._start()
    assert seen == [encoder_widths.CONNECTOR]
    assert measured == []  # skipped: the patch was in place when the core would have started


def test_vllm_finds_the_plugin_in_every_process_it_starts() -> None:
    from importlib.metadata import entry_points

    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "mmworker.engine.encoder_widths:install" in plugins
