"""The engine core skips vLLM's dummy-encode width measurement for the worker's store only."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mmworker.engine import encoder_widths
from mmworker.lifeline import ENV

core = pytest.importorskip("vllm.v1.engine.core")


def _config(connector: str | None) -> Any:
    ec = None if connector is None else SimpleNamespace(ec_connector=connector)
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
    # Mooncake sizes its transfers by the width: it is measured, as without a connector.
    assert measured == ["MooncakeECConnector", "none"]


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


def test_vllm_finds_the_plugin_in_every_process_it_starts() -> None:
    from importlib.metadata import entry_points

    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "mmworker.engine.encoder_widths:install" in plugins
