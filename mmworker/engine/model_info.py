"""vLLM's look at the model class, taken ahead of the engine's start and beside the worker's
own import of vLLM.

Why: before it builds an engine, vLLM asks what the model class supports (multimodal,
pooling, ...). For a class it has not imported, which includes its own Qwen2.5-VL and the
worker's pixel-path class, it answers from a file under `VLLM_CACHE_ROOT/modelinfos`, or, with
none there, by starting `python -m vllm.model_executor.models.registry`, which imports vLLM and
the model module all over again. On an H100 host with new caches that took 22 s of a plain
`LLM(...)`'s start and 26.5 s of the worker's, after the worker had already imported vLLM
itself (session 26 logs: "loading the model" to "Resolved architecture"). The worker knows
the architecture from the model's config.json at its first line, so it starts that same
inspection then, in a process of its own, and the engine finds the file written.

Nothing here imports vLLM: the script below runs in the new process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mmworker.engine import pixels

log = logging.getLogger(__name__)

#: Architecture -> the module and class vLLM's registry names for it (its cache file is named
#: after them). Only the worker's own model family: any other model's first start does what
#: vLLM does.
_CLASSES = {
    pixels.ARCHITECTURE: ("mmworker.engine.pixels_model", "PixelModel"),
    "Qwen2_5_VLForConditionalGeneration": (
        "vllm.model_executor.models.qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
    ),
}

#: vLLM's own inspection (module hash, cache file and all), run in this process instead of
#: the one vLLM would start: this process is that process.
_SCRIPT = """
import sys
from vllm.plugins import load_general_plugins
from vllm.model_executor.models import registry
load_general_plugins()
registry._run_in_subprocess = lambda fn: fn()
for arch in sys.argv[1:]:
    if registry.ModelRegistry._try_inspect_model_cls(arch) is None:
        sys.exit(f"vLLM knows no model class {arch}")
"""


def cache_root() -> Path:
    """vLLM's `VLLM_CACHE_ROOT`, as vLLM computes it (`vllm.envs`)."""
    if root := os.environ.get("VLLM_CACHE_ROOT"):
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "vllm"


def cache_file(architecture: str) -> Path | None:
    """The file vLLM keeps its answer for `architecture` in, None for a class not listed."""
    if (named := _CLASSES.get(architecture)) is None:
        return None
    module, cls = named
    name = f"{module}-{cls}".replace(".", "-") + ".json"
    return cache_root() / "modelinfos" / name


def architectures(model_path: str, pixels_on_engine: bool) -> list[str]:
    """The architectures vLLM will resolve for the model, from its config.json on disk (a local
    directory or the Hub cache; nothing is downloaded here), [] when it cannot say."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return []
        try:
            found = try_to_load_from_cache(model_path, "config.json")
        except ValueError:  # not a repository id (a directory that is not there, say)
            return []
        if not isinstance(found, str):
            return []
        config = Path(found)
    try:
        archs = [str(a) for a in json.loads(config.read_text()).get("architectures") or ()]
    except (OSError, ValueError, AttributeError) as exc:
        log.debug("model info: %s unreadable (%s)", config, exc)
        return []
    if pixels_on_engine and archs and all(a in pixels.REPLACES for a in archs):
        return [pixels.ARCHITECTURE]  # what `pixels.overrides` makes of it
    return archs


@dataclass
class Inspection:
    """vLLM's inspection of the model class, under way in a process of its own."""

    process: subprocess.Popen[bytes]
    architectures: list[str]
    started: float
    #: its stderr, read once it is done (a pipe could fill while nobody reads it and stall it)
    err: IO[bytes]

    def stop(self) -> None:
        """A start-up cut short (a signal) leaves no inspection behind."""
        if self.process.poll() is None:
            self.process.kill()

    def wait(self, timeout_s: float = 120.0) -> bool:
        """Before the engine starts: its own inspection would start the same process again.
        Never raises: a failed or slow inspection only leaves vLLM to do its own (False)."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            log.warning("model info for %s not ready after %.0fs: vLLM looks itself",
                        ", ".join(self.architectures), timeout_s)  # fmt: skip
            return False
        finally:
            self.err.seek(0)
            err = self.err.read()
            self.err.close()
        if self.process.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            log.warning("model info for %s failed (exit %s): vLLM looks itself. %s",
                        ", ".join(self.architectures), self.process.returncode,
                        " | ".join(tail))  # fmt: skip
            return False
        log.debug("model info for %s taken beside the start-up in %.1fs",
                  ", ".join(self.architectures), time.monotonic() - self.started)  # fmt: skip
        return True


def pending(model_path: str, pixels_on_engine: bool) -> list[str]:
    """The architectures whose look vLLM would take at this start: [] where every answer is on
    disk, or the model is not one listed (then vLLM does what it does)."""
    archs = architectures(model_path, pixels_on_engine)
    files = [cache_file(a) for a in archs]
    if not archs or any(f is None for f in files) or all(f.is_file() for f in files if f):
        return []
    return archs


def start(archs: list[str]) -> Inspection:
    """vLLM's inspection of `archs`, in a process of its own (started after `lifeline.arm`, so
    the worker's plugin ties it to the worker like vLLM's own processes)."""
    err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by Inspection.wait)
    process = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, *archs],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    return Inspection(process, archs, time.monotonic(), err)


def inspect_ahead(model_path: str, pixels_on_engine: bool) -> Inspection | None:
    """`start` for what is `pending`, None where nothing is."""
    archs = pending(model_path, pixels_on_engine)
    return start(archs) if archs else None
