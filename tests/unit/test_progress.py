"""axondist.progress: rank 0 alone shows it; a bar on a terminal that never outgrows it and
ends its line, plain lines elsewhere."""

from __future__ import annotations

import fcntl
import importlib.util
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist.progress import MIN_BAR_WIDTH, Progress, resolve_mode, stream_size

ROOT = Path(__file__).resolve().parents[2]
needs_tqdm = pytest.mark.skipif(importlib.util.find_spec("tqdm") is None, reason="needs tqdm")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frames(text: str) -> list[str]:
    return [f for f in re.split(r"[\r\n]", text) if f.strip()]


def test_auto_is_a_bar_on_a_terminal_and_lines_elsewhere():
    assert resolve_mode(None, _Terminal()) == "bar"
    assert resolve_mode("auto", io.StringIO()) == "lines"
    assert resolve_mode(True, io.StringIO()) == "lines"
    assert resolve_mode(False, _Terminal()) == "off"
    assert resolve_mode("bar", io.StringIO()) == "bar"
    with pytest.raises(ValueError, match="progress: progress='fancy' is not one of auto, bar"):
        resolve_mode("fancy", io.StringIO())


@given(total=st.integers(1, 400))
def test_plain_lines_about_every_tenth_and_always_the_last(total):
    stream = io.StringIO()
    with Progress(total, stream=stream, mode="lines") as shown:
        for step in range(1, total + 1):
            shown.update(step, loss=0.5)
    steps = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    every = -(-total // 10)
    assert steps == sorted({*range(every, total + 1, every), total})
    assert len(steps) <= 11
    assert all(line.endswith("  loss 0.50000") for line in stream.getvalue().splitlines())


@needs_tqdm
@given(columns=st.integers(MIN_BAR_WIDTH, 160), total=st.integers(1, 60))
def test_a_bar_through_a_pipe_fits_columns_and_ends_its_line(columns, total):
    stream = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": str(columns)}):
        with Progress(total, stream=stream, mode="bar") as shown:
            for step in range(1, total + 1):
                shown.update(step, loss=1.0 / step)
    text = stream.getvalue()
    frames = _frames(text)
    assert frames and all(len(f) <= columns for f in frames), frames
    assert f"{total}/{total}" in frames[-1]
    assert text.endswith("\n")  # what is printed next starts on its own line


def test_narrower_than_a_bar_gives_plain_lines():
    stream = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": str(MIN_BAR_WIDTH - 1)}):
        with Progress(3, stream=stream, mode="bar") as shown:
            for step in (1, 2, 3):
                shown.update(step, loss=0.25)
    assert stream.getvalue() == "".join(f"step {s}/3  loss 0.25000\n" for s in (1, 2, 3))


def test_without_tqdm_a_bar_falls_back_to_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    stream = io.StringIO()
    shown: Progress[int] = Progress(10, stream=stream, mode="bar")
    for step in range(1, 11):
        shown.update(step, loss=0.5)
    shown.close()
    assert stream.getvalue() == "".join(f"step {s}/10  loss 0.50000\n" for s in range(1, 11))


_ZERO_SIZED = """
import fcntl, os, pty, struct, sys, termios
pid, fd = pty.fork()
if pid == 0:  # the child's stdout is a terminal that reports 0 columns and 0 lines
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
chunks = []
while True:
    try:
        data = os.read(fd, 4096)
    except OSError:
        break
    if not data:
        break
    chunks.append(data)
os.waitpid(pid, 0)
sys.stdout.write(b"".join(chunks).decode(errors="replace"))
"""

_SHOW_12_STEPS = ("import sys; from axondist.progress import Progress\n"
                  "with Progress(12, stream=sys.stdout) as shown:\n"
                  "    for step in range(1, 13):\n"
                  "        shown.update(step, loss=0.125)\n"
                  "print('after')\n")


@needs_tqdm
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_terminal_of_zero_size_still_shows_the_bar():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _ZERO_SIZED, _SHOW_12_STEPS], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    frames = [f for f in _frames(proc.stdout) if "%|" in f]
    assert frames and "12/12" in frames[-1] and "loss 0.12500" in frames[-1], proc.stdout
    assert all(len(f) <= 80 for f in frames)  # unknown size: 80 columns
    assert "\nafter" in proc.stdout.replace("\r\n", "\n")  # the bar ended its line


def test_the_size_of_a_terminal_that_reports_zero_is_the_fallback(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("LINES", "30")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    with os.fdopen(follower, "w", closefd=True) as terminal:
        assert stream_size(terminal) == (100, 30)
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
        assert stream_size(terminal) == (132, 40)  # a sized terminal answers for itself
    os.close(leader)


def test_only_rank_0_shows_progress_and_every_rank_gets_every_item():
    stream = io.StringIO()

    def train(world):
        seen = []
        for step in (shown := ad.progress(range(7), mode="lines", stream=stream)):
            seen.append(step)
            shown.note(loss=float(world.rank))
        return seen

    assert ad.spawn(train, 3) == [list(range(7))] * 3
    assert stream.getvalue().count("step 7/7") == 1
    assert "loss 0.00000" in stream.getvalue()  # rank 0's value


def test_an_iterable_without_a_length_prints_every_n_and_the_last_step(started_world):
    stream = io.StringIO()
    items = list(ad.progress(iter(range(25)), mode="lines", stream=stream, every=10))
    assert items == list(range(25))
    assert stream.getvalue() == "step 10\nstep 20\nstep 25\n"


def test_a_loop_that_breaks_still_shows_where_it_stopped(started_world):
    stream = io.StringIO()
    for step in ad.progress(range(100), mode="lines", stream=stream):
        if step == 14:
            break
    assert stream.getvalue() == "step 10/100\nstep 14/100\n"


@given(value=st.floats(-1e300, 1e300))
def test_values_are_shown_readably(value):
    stream = io.StringIO()
    with Progress(1, stream=stream, mode="lines") as shown:
        shown.update(1, loss=value)
    shown_value = stream.getvalue().split("loss ")[1].strip()
    assert float(shown_value) == pytest.approx(value, rel=1e-3, abs=1e-5)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="progress: total must be >= 0 or None, got -1"):
        Progress(-1)
    with pytest.raises(ValueError, match="progress: every must be >= 1, got 0"):
        Progress(None, every=0)
    with pytest.raises(TypeError, match=r"only one made by axondist.progress\(iterable\)"):
        iter(Progress(3, mode="off")).__next__()
