"""The benchmark runner: planning from source, robust runs, tables and the report."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
runner = importlib.util.module_from_spec(_spec)
sys.modules["benchmarks_run"] = runner  # dataclasses look their module up by name
_spec.loader.exec_module(runner)


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
    assert md[0] == "| bytes | us.ours | us.peer | **peer/ours** | meets_target |"
    assert md[2] == "| 4 KiB | 12.5 | 30.0 | 2.4 | ok |"
    assert md[3] == "| 1 MiB | 950 | 2000 | 2.1 | **MISSED** |"
    assert runner.find_tables([{"a": 1}, {"a": 2, "b": 3}])[0].columns == ["a", "b"]
    assert runner.find_tables({"x": 1}) == []  # top-level scalars are context, not a table


def test_dicts_of_values_become_name_value_tables():
    data = {"world_size": 2, "summary": {"ratios": {"a / b": 0.5}, "targets": {"a < b": True,
                                                                              "a < c": False}}}
    ratios, targets = runner.find_tables(data)
    assert (ratios.title, ratios.rows) == ("summary.ratios", [{"name": "a / b", "value": 0.5}])
    assert runner.markdown_table(targets).splitlines()[2:] == ["| a < b | ok |",
                                                               "| a < c | **MISSED** |"]
    outcome = runner.Outcome(runner.Plan("x", Path("x.py"), None, [], True, 1.0), "ok", [],
                             data=data)
    assert runner._targets(outcome) == "1/2 met"


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
    assert "| bytes | ours_us | floor_us | **ratio** |" in report
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
