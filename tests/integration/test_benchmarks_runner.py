"""The benchmark runner and timing helpers: planning from source, robust runs, figures with
their spread, readable tables, targets met or missed, missing peers named, and the report."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


runner = _load("benchmarks_run", ROOT / "benchmarks" / "run.py")
common = _load("benchmarks_common", ROOT / "benchmarks" / "_common.py")


def bench(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"bench_{name}.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def test_plan_reads_the_launch_from_the_docstring_and_runner(tmp_path):
    mpi = bench(tmp_path, "a", '''
        """Something.

            mpiexec -n 3 python benchmarks/bench_a.py [--json out.json]
        """
        import argparse
        p = argparse.ArgumentParser(); p.add_argument("--json"); p.add_argument("--repeats")
    ''')
    plan = runner.plan_benchmark(mpi, quick=True, timeout=None)
    assert (plan.ranks, plan.json_option, plan.args) == (3, True, ["--repeats", "3"])
    assert plan.how == "mpiexec -n 3" and "mpi4py" in plan.needs and plan.summary == "Something."
    assert plan.peers == []

    plain = bench(tmp_path, "b", '''
        """Runs in one process (python benchmarks/bench_b.py --quick)."""
        RUNNER = {"ranks": None, "args": ["--big"], "quick_args": ["--tiny"], "timeout": 5,
                  "needs": ["cupy"]}
    ''')
    plan = runner.plan_benchmark(plain, quick=True, timeout=None)
    assert (plan.ranks, plan.args, plan.timeout, plan.needs) == (None, ["--big", "--tiny"], 5.0,
                                                                 ["cupy"])
    assert not plan.json_option
    assert runner.plan_benchmark(plain, quick=False, timeout=7).args == ["--big"]


def test_every_repository_benchmark_gets_a_plan():
    plans = [runner.plan_benchmark(p, True, None) for p in runner.discover()]
    assert plans and all(p.name.startswith("bench_") for p in plans)
    cmd = runner.command_for(plans[0], Path("out.json"))
    assert str(plans[0].path) in cmd
    # --quick stays quick: every benchmark is handed its quick option or fewer repeats
    slow = [p.name for p in plans if not p.args]
    assert not slow, f"{slow} have no quick mode: give them RUNNER['quick_args'] or --quick"
    assert all(p.timeout <= 900 for p in plans)


def test_peers_are_read_from_the_source(tmp_path):
    path = bench(tmp_path, "p", """
        import numpy
        def gloo(comm):
            return start_gloo(comm)
        def f():
            import jax.numpy as jnp
    """)
    assert runner.plan_benchmark(path, False, None).peers == ["jax", "torch"]


def test_bad_runner_spec_is_named(tmp_path):
    path = bench(tmp_path, "c", 'RUNNER = {"ranks": int("2")}\n')
    with pytest.raises(ValueError, match="bench_c.py: RUNNER must be a literal dict"):
        runner.plan_benchmark(path, False, None)


def test_tables_are_found_flattened_and_ordered():
    data = {"world_size": 2, "ops": {"all_reduce": [
        {"bytes": 4096, "us": {"ours": 12.5, "peer": 30.0}, "peer/ours": 2.4,
         "meets_target": True},
        {"bytes": 1 << 20, "us": {"ours": 950.0, "peer": 2000.0}, "peer/ours": 2.1,
         "meets_target": False}]}}
    (table,) = runner.find_tables(data)
    assert table.title == "ops.all_reduce" and table.context == {"world_size": 2}
    assert runner.size_column(table) == "bytes"
    assert runner.ratio_columns(table) == ["peer/ours"]
    assert runner.column_order(table) == ["bytes", "us.ours", "us.peer", "peer/ours",
                                          "meets_target"]
    md = runner.markdown_table(table).splitlines()
    # readable headers; bare medians are flagged as having no spread
    assert md[0] == ("| size | ours (µs) † | peer (µs) † | **peer / ours** † | target |")
    assert md[2] == "| 4 KiB | 12.5 | 30.0 | 2.4 | met |"
    assert md[3] == "| 1 MiB | 950 | 2000 | 2.1 | **missed** |"
    assert runner.table_notes(table) == [
        "† a median the benchmark reported without its spread or repeat count."]
    assert runner.find_tables([{"a": 1}, {"a": 2, "b": 3}])[0].columns == ["a", "b"]
    assert runner.find_tables({"x": 1}) == []  # top-level scalars are context, not a table


def test_dicts_of_values_become_name_value_tables():
    data = {"world_size": 2, "summary": {"ratios": {"a / b": 0.5}, "targets": {"a < b": True,
                                                                              "a < c": False}}}
    ratios, targets = runner.find_tables(data)
    assert (ratios.title, ratios.rows) == ("summary.ratios", [{"name": "a / b", "value": 0.5}])
    assert runner.markdown_table(targets).splitlines() == [
        "| target | result |", "|---|---|", "| a < b | met |", "| a < c | **missed** |"]
    outcome = runner.Outcome(runner.Plan("x", Path("x.py"), None, [], True, 1.0), "ok", [],
                             data=data)
    assert runner.targets_summary(outcome) == "1/2 met; **missed**: summary: targets: a < c"


def _outcome(tmp_path, body, timeout=60.0):
    path = bench(tmp_path, "t", body)
    plan = runner.plan_benchmark(path, quick=False, timeout=timeout)
    out = tmp_path / "results"
    out.mkdir(exist_ok=True)
    return runner.run_benchmark(plan, out), out


def test_a_benchmark_that_writes_json_is_reported_with_its_tables(tmp_path):
    outcome, out = _outcome(tmp_path, '''
        """A fake benchmark."""
        import argparse, json
        p = argparse.ArgumentParser(); p.add_argument("--json"); a = p.parse_args()
        rows = [{"bytes": 1024 * 4 ** k, "ours_us": 10.0 * (k + 1), "floor_us": 8.0 * (k + 1),
                 "ratio": 1.25} for k in range(3)]
        print("size  ratio"); json.dump(rows, open(a.json, "w"))
    ''')
    assert outcome.status == "ok" and outcome.data[0]["ratio"] == 1.25
    report = runner.write_report([outcome], out, quick=False).read_text()
    assert "| [bench_t](#bench-t) | python | ok |" in report
    assert "| size | ours (µs) † | floor (µs) † | **ratio** † |" in report
    assert (out / "bench_t.txt").read_text().startswith("size  ratio")


def test_failures_and_timeouts_are_reported_not_fatal(tmp_path):
    failed, out = _outcome(tmp_path, 'import sys\nprint("partial")\nsys.exit("boom: bad size")\n')
    assert failed.status == "failed" and failed.returncode == 1
    hung, _ = _outcome(tmp_path, 'import time\ntime.sleep(60)\n', timeout=1.0)
    assert hung.status == "timeout" and hung.seconds < 30
    report = runner.write_report([failed, hung], out, quick=True).read_text()
    assert "failed (exit status 1)" in report and "boom: bad size" in report
    assert "timeout (killed after 1 s)" in report


def test_missing_requirements_skip(tmp_path):
    path = bench(tmp_path, "g", 'RUNNER = {"needs": ["surely_not_installed_module"]}\n')
    plan = runner.plan_benchmark(path, False, None)
    outcome = runner.run_benchmark(plan, tmp_path)
    assert outcome.status == "skipped" and "surely_not_installed_module" in outcome.note


def test_plot_is_drawn_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    table = runner.Table("t", ["bytes", "a/b"], [{"bytes": 1 << k, "a/b": 1.0 + k}
                                                 for k in range(10, 14)])
    assert runner.plot_table(table, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert not runner.plot_table(runner.Table("u", ["x"], [{"x": 1}]), tmp_path / "u.png")


def test_main_lists_the_plan(capsys):
    assert runner.main(["--list", "--only", "mock"]) == 0
    assert "bench_mock_allreduce" in capsys.readouterr().out
    assert runner.main(["--list", "--only", "no_such_benchmark"]) == 1


# --- figures with their spread ---------------------------------------------------------------

_times = st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=30)


@given(_times, st.sampled_from([1.0, 1e3, 1e6]))
def test_spread_brackets_its_median(values, scale):
    s = common.spread(values, scale)
    assert s["n"] == len(values)
    assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"]
    assert s["median"] == pytest.approx(statistics.median(values) * scale)
    assert (s["min"], s["max"]) == (min(values) * scale, max(values) * scale)
    assert runner.is_spread(s)


@given(st.lists(st.tuples(st.floats(1e-6, 10.0), st.floats(1e-6, 10.0)), min_size=1,
                max_size=20))
def test_ratio_spread_is_of_the_paired_ratios(pairs):
    num, den = [a for a, _ in pairs], [b for _, b in pairs]
    s = common.ratio_spread(num, den)
    assert s["median"] == pytest.approx(common.paired_ratio(num, den))
    assert s["min"] == pytest.approx(min(a / b for a, b in pairs))


def test_spread_and_ratios_refuse_empty_or_unpaired_input():
    with pytest.raises(ValueError, match="spread: needs at least one value"):
        common.spread([])
    with pytest.raises(ValueError, match="paired_ratios: needs two equally long"):
        common.ratio_spread([1.0, 2.0], [1.0])


class _FakeComm:
    """``allgather`` over ranks whose other members measured ``others``."""

    def __init__(self, others):
        self.others = others
        self.barriers = 0

    def allgather(self, mine):
        return [mine, *self.others]

    def Barrier(self):  # noqa: N802 (mpi4py's name)
        self.barriers += 1


@given(st.lists(st.lists(st.floats(0.0, 5.0), min_size=3, max_size=3), min_size=1,
                max_size=4))
def test_each_batch_is_the_slowest_ranks(ranks):
    mine, others = ranks[0], ranks[1:]
    comm = _FakeComm([{"a": o} for o in others])
    slowest = common.slowest_rank({"a": mine}, comm)["a"]
    assert slowest == [max(r[k] for r in ranks) for k in range(3)]


def test_alternate_with_a_communicator_syncs_and_takes_the_slowest_rank():
    comm = _FakeComm([{"f": [10.0, 10.0, 10.0]}])
    times = common.alternate({"f": lambda: None}, batch=2, repeats=3, warmup=1, comm=comm)
    assert times == {"f": [10.0, 10.0, 10.0]}  # the other rank was slower every batch
    assert comm.barriers == 2 * 4  # before and after each of 1 warm-up + 3 timed batches


def test_missing_peers_are_named():
    assert common.missing_peers({"numpy itself": "numpy"}) == {}
    assert common.missing_peers({"torch DDP": "surely_not_installed_peer"}) == {
        "torch DDP": "surely_not_installed_peer not installed"}


def test_spreads_render_as_median_and_range_with_their_count():
    s = {"median": 12.5, "q1": 12.0, "q3": 13.0, "min": 11.0, "max": 140.0, "n": 7}
    table = runner.Table("ops.all_reduce", ["bytes", "axondist_us", "axondist/mpi4py"],
                         [{"bytes": 4096, "axondist_us": s, "axondist/mpi4py": dict(s, n=7)}])
    md = runner.markdown_table(table).splitlines()
    assert md[0] == "| size | axondist (µs) | **axondist / mpi4py** |"
    assert md[2] == "| 4 KiB | 12.5 (11.0–140) | 12.5 (11.0–140) |"
    assert runner.table_notes(table) == ["Each figure: median (min–max) over n = 7 timed repeats."]
    mixed = runner.Table("t", ["x_ms"], [{"x_ms": s}, {"x_ms": dict(s, n=3)}])
    assert runner.markdown_table(mixed).splitlines()[2:] == ["| 12.5 (11.0–140), n=7 |",
                                                             "| 12.5 (11.0–140), n=3 |"]
    assert runner.table_notes(mixed) == [
        "Each figure: median (min–max) over the n repeats shown beside it."]
    few = runner.Table("t", ["x_ms"], [{"x_ms": dict(s, n=2)}])
    assert "fewer than 3" in runner.table_notes(few)[0]


@pytest.mark.parametrize("key, label", [
    ("us.ours", "ours (µs)"), ("numpy_sum_us", "numpy sum (µs)"), ("time_ms", "time (ms)"),
    ("no sizes_us", "no sizes (µs)"), ("bytes", "size"), ("meets_target", "target"),
    ("axondist/mpi4py", "axondist / mpi4py"), ("step ms", "step (ms)"), ("mib", "MiB"),
    ("resident MiB", "resident (MiB)"), ("strategy", "strategy"), ("world_size", "world size"),
    ("vs NO_SHARD", "vs NO_SHARD"),
])
def test_headers_are_readable(key, label):
    assert runner.column_label(key) == label


def test_a_run_without_a_verdict_says_why():
    plan = runner.Plan("x", Path("x.py"), None, [], True, 1.0)
    assert runner.targets_summary(runner.Outcome(plan, "failed", [])) == "not measured (failed)"
    no_targets = runner.Outcome(plan, "ok", [], data={"rows": [{"a_ms": 1.0}]})
    assert runner.targets_summary(no_targets) == "none defined"
    assert runner.targets_summary(runner.Outcome(plan, "ok", [])) == "none reported"


def test_predicted_figures_are_not_flagged_as_timings_without_a_spread():
    table = runner.Table("rows", ["step_ms_simulated", "step_ms_measured", "step_ms"],
                         [{"step_ms_simulated": 3.0, "step_ms_measured": common.spread([1.0, 2]),
                           "step_ms": 2.0}])
    assert runner.unspread_columns(table) == ["step_ms"]


def test_target_rows_are_collected_into_one_section_marked_met_or_missed():
    plan = runner.Plan("bench_x", Path("x.py"), 2, [], True, 1.0)
    rows = [common.target("a <= 1.05x b", common.spread([1.0, 1.02, 1.1]), 1.05),
            common.target("c >= 3x d", common.spread([2.5, 2.9, 3.1]), 3.0, at_most=False)]
    assert [common.verdict(r) for r in rows] == ["met", "MISSED"]
    outcome = runner.Outcome(plan, "ok", [], data={"targets": rows})
    assert runner.target_results(outcome) == [("targets: a <= 1.05x b", True),
                                              ("targets: c >= 3x d", False)]
    section = "\n".join(runner.targets_section([outcome]))
    assert "1 of 2 met" in section
    assert "| bench_x | targets: a <= 1.05x b | met |" in section
    assert "| bench_x | targets: c >= 3x d | **MISSED** |" in section
    assert runner.targets_section([runner.Outcome(plan, "failed", [])]) == []


def test_peers_not_installed_are_named_even_when_the_benchmark_is_silent():
    plan = runner.Plan("x", Path("x.py"), None, [], True, 1.0,
                       peers=["surely_not_installed_peer", "numpy"])
    silent = runner.Outcome(plan, "ok", [], data={"rows": []})
    assert runner.not_compared(silent) == {
        "surely_not_installed_peer": "surely_not_installed_peer not installed"}
    said = runner.Outcome(plan, "ok", [], data={"missing_peers": {
        "its DDP (gloo)": "surely_not_installed_peer not installed"}})
    assert runner.not_compared(said) == {
        "its DDP (gloo)": "surely_not_installed_peer not installed"}


_FULL_BENCH = """
    \"\"\"A benchmark reporting spreads, targets and a missing peer.\"\"\"
    import argparse, json, sys
    sys.path.insert(0, {common_dir!r})
    from _common import missing_peers, ratio_spread, spread, write_json
    p = argparse.ArgumentParser(); p.add_argument("--json"); p.add_argument("--quick",
        action="store_true"); a = p.parse_args()
    assert a.quick, "the runner passes --quick"
    ours, floor = [1.0, 1.2, 1.1], [1.0, 1.0, 1.0]
    write_json(a.json, {{
        "repeats": 3,
        "rows": [{{"bytes": 4096, "ours_us": spread(ours, 1e6), "floor_us": spread(floor, 1e6),
                   "ours/floor": ratio_spread(ours, floor)}}],
        "targets": {{"ours <= 1.5x floor": True, "start-up <= 1.5x mpi4py": False}},
        "missing_peers": missing_peers({{"torch DDP (gloo)": "surely_not_installed_peer"}}),
    }})
    print("done")
"""


def test_quick_mode_end_to_end_through_the_module_entry_point(tmp_path):
    """``python -m benchmarks --quick`` plans, runs and reports a benchmark folder."""
    folder = tmp_path / "benches"
    folder.mkdir()
    (folder / "bench_full.py").write_text(textwrap.dedent(_FULL_BENCH.format(
        common_dir=str(ROOT / "benchmarks"))), encoding="utf-8")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--strict",
                           "--dir", str(folder), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (out / "report.md").read_text(encoding="utf-8")
    assert ("| [bench_full](#bench-full) | python | ok |" in report
            and "| 1/2 met; **missed**: targets: start-up <= 1.5x mpi4py | "
                "torch DDP (gloo) (surely_not_installed_peer not installed) |" in report)
    assert "| size | ours (µs) | floor (µs) | **ours / floor** |" in report
    assert "| 4 KiB | 1100000 (1000000–1200000) | 1000000 (1000000–1000000) | 1.1 (1–1.2) |" \
        in report
    assert "Each figure: median (min–max) over n = 3 timed repeats." in report
    assert "Not compared: torch DDP (gloo) (surely_not_installed_peer not installed)." in report
    assert json.loads((out / "bench_full.json").read_text())["repeats"] == 3


def test_quartiles_and_figures_print_without_exponents():
    s = common.spread([700.0, 1200.0, 1580.0, 3000.0])
    assert common.format_spread(s) == "1390 (700-3000)"
    assert common.format_spread(s, quartiles=True) == f"1390 [{s['q1']:.0f}-{s['q3']:.0f}]"
    assert [common.format_figure(v) for v in (0.9123, 12.345, 4630.4)] == ["0.912", "12.3",
                                                                         "4630"]


_TORCH_BENCH = ROOT / "benchmarks" / "bench_torch_backend.py"


def _run_torch_bench(hide: str | None) -> subprocess.CompletedProcess:
    """The torch backend's benchmark run with plain Python (no MPI launch), ``hide`` made
    unimportable."""
    code = ("import runpy, sys\n"
            + (f"sys.modules[{hide!r}] = None\n" if hide else "")
            + f"sys.argv = [{str(_TORCH_BENCH)!r}, '--quick']\n"
            + f"runpy.run_path({str(_TORCH_BENCH)!r}, run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYD"))}
    env.pop("MPI_LOCALNRANKS", None)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_torch_backend_benchmark_needs_torch_and_mpiexec():
    plan = runner.plan_benchmark(_TORCH_BENCH, quick=True, timeout=None)
    assert (plan.ranks, plan.args) == (2, ["--quick"])
    assert {"torch", "mpi4py"} <= set(plan.needs)  # the runner skips it, naming what is missing


@pytest.mark.parametrize("hide, why", [
    ("torch", "skipped: torch is not installed (pip install '.[torch]')"),
    ("mpi4py", "skipped: mpi4py is not installed"),
    (None, "skipped: it needs several ranks and an MPI launcher: launch it with mpiexec -n 2"),
])
def test_the_torch_backend_benchmark_says_why_it_is_skipped(hide, why):
    if hide != "torch" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: the benchmark stops at that first")
    proc = _run_torch_bench(hide)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert why in proc.stdout, proc.stdout + proc.stderr
