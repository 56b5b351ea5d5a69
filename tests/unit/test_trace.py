"""The trace file, its reader and the straggler report, without communication."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from axondist.__main__ import main
from axondist.backends.recording import trace_file
from axondist.backends.recording.recorder import FlightRecorder, describe_detail
from axondist.backends.recording.trace_file import TraceWriter, payload_bytes, rank_file
from axondist.trace.export import TRACKS, perfetto_trace
from axondist.trace.report import format_report, straggler_report
from axondist.trace.timeline import read_rank, read_timeline


def _recorder(rank: int, world_size: int = 2) -> FlightRecorder:
    rec = FlightRecorder(rank, world_size, "host-a")
    rec.groups["world"] = tuple(range(world_size))
    return rec


def _call(writer: TraceWriter, seq: int, start: float, end: float, op: str = "all_reduce",
          group: str = "world") -> None:
    entry = (group, seq, op, (("dtype", np.dtype(np.float32)), ("shape", (256,))), start, True,
             seq)
    writer(entry, end)


def test_payload_bytes_from_pairs_and_plain_keys() -> None:
    f4 = np.dtype(np.float32)
    assert payload_bytes((("dtype", f4), ("shape", (4, 8)))) == 128
    assert payload_bytes((("dtype", f4), ("counts", (3, 5)))) == 32
    assert payload_bytes((f4, (10,), "SUM", False)) == 40  # a backend's key
    assert payload_bytes(None) == 0 and payload_bytes(()) == 0


def test_recorder_feeds_its_sink_on_every_end(tmp_path: Path) -> None:
    rec = _recorder(0)
    writer = TraceWriter(str(tmp_path), rec, describe=describe_detail)
    rec.sink = writer
    slot = rec.begin("world", 1, "all_reduce", (np.dtype(np.float64), (3,), "SUM", False))
    rec.end(slot)
    slot = rec.begin("world", 2, "broadcast", (np.dtype(np.float64), (5,), 0, False))
    rec.end_blocking(slot, "world", 2)  # the MPI hot path
    writer.close()
    trace = read_rank(str(tmp_path), 0)
    assert [(c.op, c.seq, c.bytes) for c in trace.calls] == [("all_reduce", 1, 24),
                                                            ("broadcast", 2, 40)]
    assert trace.calls[0].detail == "dtype=float64, shape=[3], reduce_op=SUM"
    assert all(c.end >= c.start for c in trace.calls)
    assert trace.groups == {"world": (0, 1)} and trace.header["rank"] == 0


def test_disk_stays_bounded_and_keeps_the_newest_calls(tmp_path: Path) -> None:
    limit = 128 << 10
    writer = TraceWriter(str(tmp_path), _recorder(1), max_bytes=limit)
    for seq in range(1, 5001):  # about 700 KiB of records
        _call(writer, seq, float(seq), seq + 0.5)
    writer.close()
    files = [rank_file(str(tmp_path), 1), rank_file(str(tmp_path), 1, old=True)]
    total = sum(os.path.getsize(f) for f in files)
    with open(files[0]) as f:
        longest = max(len(line) for line in f)
    # each file holds at most half the limit, or one batch when a batch is bigger
    assert total <= limit + 2 * trace_file.BATCH * longest, total
    assert total <= 2 * max(limit // 2, trace_file.BATCH * longest) + 4096, total
    seqs = [c.seq for c in read_rank(str(tmp_path), 1).calls]
    assert seqs[-1] == 5000 and seqs == sorted(seqs) and len(seqs) < 5000
    assert seqs == list(range(seqs[0], 5001))  # no gap between the two files
    with open(files[0]) as f:  # each file starts with the rank's header and groups
        assert "header" in json.loads(f.readline())


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    writer = TraceWriter(str(tmp_path), _recorder(0))
    for seq in range(1, 4):
        _call(writer, seq, float(seq), seq + 0.1)
    writer.flush()  # a crash: no close
    with open(rank_file(str(tmp_path), 0), "a") as f:
        f.write('{"call": "all_reduce", "group": "wor')
    trace = read_rank(str(tmp_path), 0)
    writer.close()
    assert [c.seq for c in trace.calls] == [1, 2, 3] and trace.skipped_lines == 1


def test_clock_offsets_move_each_rank_onto_rank_0s_clock(tmp_path: Path) -> None:
    # rank 1's clock runs 2 s behind rank 0's at its start and 2.01 s at its stop (drift)
    w0, w1 = TraceWriter(str(tmp_path), _recorder(0)), TraceWriter(str(tmp_path), _recorder(1))
    w0.clock({"phase": "start", "offset_s": 0.0, "rtt_s": 0.0, "at": 10.0})
    w1.clock({"phase": "start", "offset_s": 2.0, "rtt_s": 1e-5, "at": 8.0})
    _call(w0, 1, 12.0, 12.5)
    _call(w1, 1, 9.5, 10.5)  # on rank 0's clock 11.505 .. 12.505: arrived first
    w0.clock({"phase": "stop", "offset_s": 0.0, "rtt_s": 0.0, "at": 20.0})
    w1.clock({"phase": "stop", "offset_s": 2.01, "rtt_s": 1e-5, "at": 18.0})
    w0.close()
    w1.close()
    timeline = read_timeline(str(tmp_path))
    (c,) = timeline.collectives()[0]
    assert c.arrivals[1] == pytest.approx(9.5 + 2.0 + 0.01 * 1.5 / 10)
    assert c.last_rank == 0 and c.held_s == pytest.approx(12.0 - 11.5015)
    assert "ping exchanges on 2 of 2 ranks" in timeline.clock_note()


def test_groups_of_one_with_one_name_are_not_matched(tmp_path: Path) -> None:
    # every rank names its own group of one "world.1": they are not one collective
    writers = []
    for rank in range(2):
        rec = _recorder(rank)
        rec.groups["world.1"] = (rank,)
        writers.append(TraceWriter(str(tmp_path), rec))
        _call(writers[-1], 1, 1.0 + rank, 2.0 + rank, group="world.1")
        _call(writers[-1], 1, 5.0 + rank, 6.0, group="world")
        del rec.groups["world.1"]  # destroyed before the trace is written
    for w in writers:
        w.close()
    collectives, partial = read_timeline(str(tmp_path)).collectives()
    assert [(c.group, c.last_rank, c.held_s) for c in collectives] == [("world", 1, 1.0)]
    assert partial == 0


def _synthetic_run(directory: Path, slow: int, sleep_s: float, steps: int = 20,
                   world_size: int = 3) -> float:
    """Rank ``slow`` arrives ``sleep_s`` late at every third step's all-reduce; the others
    arrive within 1 ms of each other. Returns the total lateness."""
    writers = [TraceWriter(str(directory), _recorder(r, world_size), describe=describe_detail)
               for r in range(world_size)]
    rng = np.random.default_rng(0)
    t, late_total = 100.0, 0.0
    for step in range(steps):
        late = sleep_s if step % 3 == 0 else 0.0
        late_total += late
        arrive = {r: t + rng.uniform(0, 1e-3) for r in range(world_size)}
        arrive[slow] += late
        done = max(arrive.values()) + 1e-4
        for r, w in enumerate(writers):
            _call(w, step + 1, arrive[r], done)
            w.span("step", arrive[r] - 0.01, done)
        t = done + 0.05
    for w in writers:
        w.close()
    return late_total


def test_straggler_report_names_the_late_rank_and_its_wait(tmp_path: Path) -> None:
    late = _synthetic_run(tmp_path, slow=2, sleep_s=0.2)
    report = straggler_report(read_timeline(str(tmp_path)))
    assert report.collectives == 20 and report.straggler == 2
    assert report.held_s(2) == pytest.approx(late, rel=0.02)
    text = format_report(report)
    assert "rank 2 kept the others waiting 1.40 s over 20 steps (20 collectives)" in text
    assert "before all_reduce" in text


def test_perfetto_json_has_a_process_per_rank_and_a_track_per_kind(tmp_path: Path) -> None:
    _synthetic_run(tmp_path, slow=1, sleep_s=0.05, steps=4)
    trace = perfetto_trace(read_timeline(str(tmp_path)))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (host-a)", 1: "rank 1 (host-a)", 2: "rank 2 (host-a)"}
    calls = [e for e in events if e.get("cat") == "collective"]
    spans = [e for e in events if e.get("cat") == "span"]
    assert len(calls) == 12 and len(spans) == 12
    assert {e["tid"] for e in calls} == {TRACKS["collectives"]}
    assert {e["tid"] for e in spans} == {TRACKS["spans"]}
    late = [e for e in calls if e["pid"] == 0 and e["args"]["seq"] == 1]
    assert 49.0 <= late[0]["args"]["waited_for_last_rank_ms"] <= 51.0
    assert min(e["ts"] for e in calls + spans) == 0.0
    json.dumps(trace)  # plain JSON


def test_trace_command_writes_json_and_report(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _synthetic_run(tmp_path, slow=1, sleep_s=0.1, steps=6)
    assert main(["trace", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    held = re.search(r"rank 1 kept the others waiting ([\d.]+) ms", out)
    assert held is not None, out
    assert float(held.group(1)) == pytest.approx(200.0, rel=0.02)
    assert "before all_reduce (dtype=float32, shape=[256])" in out
    with open(tmp_path / "trace.json") as f:
        assert json.load(f)["traceEvents"]


def test_trace_command_on_a_folder_without_trace(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", str(tmp_path)]) == 2
    assert "holds no rank-NNNNN.jsonl files" in capsys.readouterr().err


def test_trace_command_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    _synthetic_run(tmp_path, slow=1, sleep_s=0.1, steps=3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["trace", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "timeline PNG skipped" in captured.err and "pip install matplotlib" in captured.err
    assert not (tmp_path / "timeline.png").exists()


def test_writer_refuses_bad_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_bytes=10 is too small"):
        TraceWriter(str(tmp_path), _recorder(0), max_bytes=10)
    monkeypatch.setenv("AXONDIST_TRACE_MB", "lots")
    with pytest.raises(ValueError, match="AXONDIST_TRACE_MB='lots' must be a number"):
        TraceWriter(str(tmp_path), _recorder(0))


def test_environment_variable_gives_every_new_recorder_a_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXONDIST_TRACE", str(tmp_path))
    rec: Any = FlightRecorder(3, 4)
    assert isinstance(rec.sink, TraceWriter) and rec.sink.path == rank_file(str(tmp_path), 3)
    rec.sink.close()
    monkeypatch.delenv("AXONDIST_TRACE")
    assert FlightRecorder(3, 4).sink is None


_OPEN_AND_CLOSE = """
import sys
from axondist.backends.recording.recorder import FlightRecorder
from axondist.backends.recording.trace_file import TraceWriter
for _ in range(int(sys.argv[2])):
    rec = FlightRecorder(0, 2, "host-a")
    TraceWriter(sys.argv[1], rec).close()
print("done")
"""


def test_several_processes_trace_into_one_folder(tmp_path: Path) -> None:
    """Jobs (or spawn worlds in several processes) sharing a trace folder each clear their rank's
    stale file; one removing it first must not crash the other."""
    import subprocess
    import sys

    folder = tmp_path / "trace"
    folder.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_AND_CLOSE, str(folder), "150"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "done" in out, err


def test_the_pictures_colours_are_told_apart() -> None:
    """No two legend entries (ops, then spans) share a colour or a near-twin of one."""
    import itertools

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from axondist.trace.export import legend_colours

    for count in (2, 10, 16, 20):
        colours = np.array([c[:3] for c in legend_colours(plt, count)])
        nearest = min(float(np.linalg.norm(a - b))
                      for a, b in itertools.combinations(colours, 2))
        assert nearest > 0.2, (count, nearest)
