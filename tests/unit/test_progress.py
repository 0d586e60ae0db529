"""Progress as a bar only on a terminal, as periodic log lines elsewhere (issue #35 item 7)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import select
import struct
import termios

import pytest

from mmworker.progress import Progress, progress


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_file_gets_no_bar_and_a_log_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    clock = _Clock()
    caplog.set_level(logging.INFO, logger="mmworker.progress")
    with Progress(10, "submitting", "job", stream=out, interval_s=5.0, clock=clock) as bar:
        assert not bar.is_bar
        bar.update()
        clock.now += 4.9
        bar.update()  # within the interval: nothing logged
        assert caplog.messages == []
        clock.now += 0.2
        bar.set_postfix_str("failed=1")
        bar.update(3)
        bar.write("refused x: because")
        clock.now += 1.0
        bar.update()
    assert out.getvalue() == "refused x: because\n"  # no carriage returns, no bar
    assert caplog.messages == [
        "submitting: 5/10 jobs (50%), 1.0 jobs/s, failed=1",
        "submitting: 6/10 jobs (60%), 1.0 jobs/s, failed=1",  # the last count, at close
    ]


def test_a_short_run_off_a_terminal_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    caplog.set_level(logging.INFO, logger="mmworker.progress")
    with progress(1, "submitting", "job", stream=out) as bar:
        bar.update()
    assert out.getvalue() == ""
    assert caplog.messages == []


def test_an_unknown_total_and_a_resumed_count() -> None:
    clock = _Clock()
    bar = Progress(None, "tail", "record", initial=4, stream=io.StringIO(), clock=clock)
    clock.now += 2.0
    bar.set_count(10)
    assert bar.line() == "tail: 10 records, 3.0 records/s"
    bar.close()
    bar.close()  # twice is harmless (a finally after an explicit close)


def test_a_terminal_gets_a_tqdm_bar() -> None:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        with open(follower, "w", closefd=False) as tty:
            with progress(3, "submitting", "job", stream=tty) as bar:
                assert bar.is_bar
                bar.update(2)
                bar.write("a message")
            tty.flush()
        chunks = []
        while select.select([leader], [], [], 0.5)[0]:  # all of it: a pty hands it out in parts
            chunks.append(os.read(leader, 65536))
        shown = b"".join(chunks).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert "a message" in shown
    assert "submitting" in shown
    assert "2/3" in shown
    assert "\r" in shown  # redrawn in place, as a bar is
