"""Progress for long commands: a bar for a person at a terminal, a log line now and then otherwise.

A tqdm bar redrawn into a file or a CI log is hundreds of carriage-return fragments (or, for one
job, a bar and a "sent 1 jobs" that say the same thing), so the bar is drawn only when the stream
is a terminal. Elsewhere the same calls write one `mmworker.progress` log line every
`interval_s` seconds (and a last one at the end of a run that logged any), which a log
collector keeps and a person can grep; a short run logs nothing, its command's summary says it.

The API is the small part of tqdm's the commands use, so `submit`, `backfill` and `tail` share
one policy without each testing `isatty()`:

    with progress(total=len(jobs), desc="submitting", unit="job") as bar:
        bar.update()                 # one more done
        bar.set_count(n)             # or: n done in all (a resumed run counts what it found)
        bar.set_postfix_str("failed=2")
        bar.write("refused x: ...")  # a message line that does not tear the bar
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any

#: Seconds between two progress log lines when the stream is not a terminal.
LOG_INTERVAL_S = 10.0

log = logging.getLogger("mmworker.progress")


class Progress:
    """One counter towards `total` (None: unknown), shown as a bar or as log lines."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        *,
        initial: int = 0,
        stream: IO[str] | None = None,
        interval_s: float = LOG_INTERVAL_S,
        tty: bool | None = None,
        show: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = initial
        self.postfix = ""
        self._stream = stream if stream is not None else sys.stderr
        self._interval = interval_s
        self._clock = clock
        self._started = clock()
        self._initial = initial
        self._last_log = self._started
        self._logged_n: int | None = None
        self._closed = False
        self._show = show
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty and isatty())
        self._bar: Any = None
        if tty and show:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit=unit, initial=initial, file=self._stream,
                smoothing=0.1, dynamic_ncols=True,
            )  # fmt: skip

    @property
    def is_bar(self) -> bool:
        """True when a terminal bar is drawn (tests and callers that word messages for it)."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        self.set_count(self.n + n)

    def set_count(self, n: int) -> None:
        self.n = n
        if self._bar is not None:
            self._bar.n = n
            self._bar.refresh()
        else:
            self._maybe_log()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def write(self, line: str) -> None:
        """A message of its own, above the bar where there is one."""
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def line(self) -> str:
        """The log line for the count so far: `desc: n/total unit (pct), rate/s, postfix`."""
        elapsed = max(self._clock() - self._started, 1e-9)
        done = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = (self.n - self._initial) / elapsed
        extra = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done} {self.unit}s{pct}, {rate:.1f} {self.unit}s/s{extra}"

    def _maybe_log(self) -> None:
        if not self._show:
            return
        now = self._clock()
        if now - self._last_log >= self._interval:
            self._last_log = now
            self._logged_n = self.n
            log.info("%s", self.line())

    def close(self) -> None:
        """Ends the bar, or logs the last count (once, and only if it moved since the last
        line: a one-job `submit` says nothing here, its own summary is enough)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._logged_n is not None and self._logged_n != self.n:
            log.info("%s", self.line())

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def progress(
    total: int | None,
    desc: str,
    unit: str,
    *,
    initial: int = 0,
    stream: IO[str] | None = None,
    interval_s: float = LOG_INTERVAL_S,
    show: bool = True,
) -> Progress:
    """A bar when `stream` (stderr by default) is a terminal, periodic log lines otherwise;
    `show=False`: neither (a one-item run), `write` still prints."""
    return Progress(
        total, desc, unit, initial=initial, stream=stream, interval_s=interval_s, show=show
    )
