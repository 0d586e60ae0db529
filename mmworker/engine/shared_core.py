"""One vLLM engine core fed by several worker processes (`engine.shared_core`).

Why: on a fast GPU one process's vLLM front end (chat template, HF processor, request
serialisation) cannot keep the engine busy, and `processes = N` answers that with N whole engines,
each with 1/N of the KV cache, its own copy of the weights and its own scheduler, all taking turns
on the GPU. vLLM's server has a better shape for the same problem: `vllm serve --api-server-count N`
runs N front-end processes against ONE engine core, each front end a client of it
(`client_count`, `client_index`). This module lets the worker's own processes be those clients:
the supervisor launches the engine core the way `vllm serve` does, then each child builds an
`AsyncLLM` that attaches to it instead of starting its own.

vLLM's launch API differs between the releases the worker runs on (0.25 on the GPU host: the
children bind their sockets; 0.3x: the supervisor binds them and hands them over); both forms are
absorbed here, and nothing outside the engine package imports vllm.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreLink:
    """What a worker process needs to attach to the shared engine core (picklable: it travels
    to a spawned child). `addresses` is vLLM's client_addresses dict for that client."""

    addresses: dict[str, Any]
    count: int
    index: int


@dataclass
class SharedCore:
    """The running engine core, owned by the supervisor."""

    manager: Any
    startup_s: float

    def sentinels(self) -> list[int]:
        """Waitable handles of the engine-core processes (multiprocessing.connection.wait)."""
        return [p.sentinel for p in getattr(self.manager, "processes", [])]

    def alive(self) -> bool:
        return all(p.exitcode is None for p in getattr(self.manager, "processes", []))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self.manager is None:
            return
        try:
            self.manager.shutdown(timeout=timeout_s)
        except TypeError:  # releases whose shutdown takes no timeout
            self.manager.shutdown()
        self.manager = None


def vllm_config(kwargs: dict[str, Any], count: int, rank: int) -> Any:
    """The engine configuration as vLLM's API servers build it: the same arguments in every
    process, with the front-end count (rank -1: the process that launches the core)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = AsyncEngineArgs(**kwargs)
    args._api_process_count = count
    args._api_process_rank = rank
    # The worker is a batch client: vLLM's offline batch limits, as for a single AsyncLLM.
    return args.create_engine_config(usage_context=UsageContext.LLM_CLASS)


@contextlib.contextmanager
def launch(
    kwargs: dict[str, Any],
    count: int,
    start_clients: Callable[[list[CoreLink]], Sequence[BaseProcess]],
) -> Iterator[SharedCore]:
    """Start the engine core for `count` clients; `start_clients` starts the worker processes
    (they attach while the core loads, as vLLM's API servers do). Yields once the core is up;
    the core is shut down on exit."""
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import Executor

    config = vllm_config(kwargs, count, -1)
    executor = Executor.get_class(config)
    t0 = time.monotonic()
    manager: Any = None
    if hasattr(engine_utils, "bind_engine_zmq_listeners"):  # vLLM 0.3x
        listeners = engine_utils.bind_engine_zmq_listeners(config, count)
        with engine_utils.launch_core_engines(
            config, executor, False, listeners.addresses
        ) as started:
            manager = started.engine_manager
            links = [
                CoreLink(
                    {
                        "input_address": li.address,
                        "output_address": lo.address,
                        "input_listener": li.socket,
                        "output_listener": lo.socket,
                        **_extras(started.coordinator, started.tensor_queue),
                    },
                    count,
                    i,
                )
                for i, (li, lo) in enumerate(zip(listeners.inputs, listeners.outputs, strict=True))
            ]
            started.watched_frontend_processes = list(start_clients(links))
    else:  # vLLM 0.25: each client binds the addresses it is given
        old_api: Any = engine_utils  # typed against the installed release, which is newer
        addresses = old_api.get_engine_zmq_addresses(config, count)
        with old_api.launch_core_engines(config, executor, False, addresses, count) as (
            manager,
            coordinator,
            addresses,
            tensor_queue,
        ):
            links = [
                CoreLink(
                    {
                        "input_address": addresses.inputs[i],
                        "output_address": addresses.outputs[i],
                        **_extras(coordinator, tensor_queue),
                    },
                    count,
                    i,
                )
                for i in range(count)
            ]
            start_clients(links)
    core = SharedCore(manager, time.monotonic() - t0)
    log.info("shared engine core up in %.1fs for %d worker processes", core.startup_s, count)
    try:
        yield core
    finally:
        core.shutdown()


def _extras(coordinator: Any, tensor_queue: Any) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if coordinator is not None:
        extras["stats_update_address"] = coordinator.get_stats_publish_address()
    if tensor_queue is not None:
        extras["tensor_queue"] = tensor_queue
    return extras


def attach(kwargs: dict[str, Any], link: CoreLink, stat_loggers: list[Any] | None = None) -> Any:
    """An `AsyncLLM` front end of the shared core, in a worker process."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_vllm_config(
        vllm_config(kwargs, link.count, link.index),
        usage_context=UsageContext.LLM_CLASS,
        disable_log_stats=stat_loggers is None,
        stat_loggers=stat_loggers,
        client_addresses=link.addresses,
        client_count=link.count,
        client_index=link.index,
    )
