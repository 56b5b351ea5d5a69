"""Run every benchmark the way it is meant to be run, and write one Markdown report.

    python -m benchmarks [--quick] [--only NAME ...] [--timeout S] [--out DIR]
    python benchmarks/run.py [same options]

Each ``benchmarks/bench_*.py`` runs in its own subprocess: with this Python
when it runs in one process (the mock world), under ``mpiexec -n K`` when
its docstring says ``mpiexec -n K`` (the venv's ``mpiexec`` next to this
Python first, then the one on ``PATH``; skipped when mpi4py or mpiexec is
missing). A benchmark module may refine that with a literal module-level
dict ``RUNNER = {"ranks": 4, "args": [...], "quick_args": [...],
"timeout": 300, "needs": ["cupy"]}``.

Every benchmark is asked for ``--json PATH`` when its source mentions that
option; the JSON's tables (lists of row dicts, however nested) go into the
report under readable column names, with a plot of each ratio column against
the size column when matplotlib is installed. A figure given as a spread
(``{"median", "min", "max", "n", ...}``, see ``_common.spread``) is printed as
``median (min-max)`` with the number of repeats behind it; a bare number in a
timing column is flagged as having no spread. Booleans in target columns (and
``{"targets": {name: bool}}``) are counted as met or missed in the summary; a
benchmark with none says so. Peers named under ``"missing_peers"``, and peer
libraries the source imports but this machine lacks, are listed as not
compared. Its own printed table is kept too, so one without ``--json`` is
reported as text. A benchmark that fails, times out or is skipped is reported
as such; the others still run.

``--quick`` passes ``RUNNER["quick_args"]``, else ``--quick`` when the
benchmark accepts it, else fewer repeats (``--repeats 3``) when it accepts
that, and lowers the default timeout.

The report goes to ``benchmarks/results/report.md`` (with ``<name>.json``,
``<name>.txt`` and plots beside it); the results folder is not committed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results"

_MPIEXEC_RE = re.compile(r"mpiexec\s+-n(?:p)?\s+(\d+)")
_PEER_RE = re.compile(r"^\s*(?:import|from)\s+(torch|jax|cupy)\b|\b(start_gloo)\(", re.MULTILINE)


# --- planning ------------------------------------------------------------------------


@dataclass
class Plan:
    """How one benchmark is run."""

    name: str
    path: Path
    ranks: int | None
    """MPI processes, or None for a plain ``python`` run."""
    args: list[str]
    json_option: bool
    """The benchmark accepts ``--json PATH``."""
    timeout: float
    needs: list[str] = field(default_factory=list)
    """Modules that must be importable (mpi4py is added for MPI runs)."""
    summary: str = ""
    peers: list[str] = field(default_factory=list)
    """Peer libraries its source imports (compared against when installed)."""

    @property
    def how(self) -> str:
        return f"mpiexec -n {self.ranks}" if self.ranks else "python"


def _runner_spec(tree: ast.Module, path: Path) -> dict[str, Any]:
    """The literal ``RUNNER = {...}`` of a benchmark module, or {}."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "RUNNER"):
            try:
                spec = ast.literal_eval(node.value)
            except ValueError as exc:
                raise ValueError(f"{path.name}: RUNNER must be a literal dict ({exc})") from None
            if not isinstance(spec, dict):
                raise ValueError(f"{path.name}: RUNNER must be a dict, got {type(spec).__name__}")
            return spec
    return {}


def plan_benchmark(path: Path, quick: bool, timeout: float | None) -> Plan:
    """Decide from the source how ``path`` is run (nothing is imported or executed)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, str(path))
    doc = ast.get_docstring(tree) or ""
    spec = _runner_spec(tree, path)
    match = _MPIEXEC_RE.search(doc)
    ranks = spec.get("ranks", int(match.group(1)) if match else None)
    args = [str(a) for a in spec.get("args", [])]
    if quick:
        if "quick_args" in spec:
            args += [str(a) for a in spec["quick_args"]]
        elif "--quick" in source:
            args.append("--quick")
        elif "--repeats" in source:
            args += ["--repeats", "3"]
    default_timeout = 180.0 if quick else 900.0
    needs = [str(m) for m in spec.get("needs", [])] + (["mpi4py"] if ranks else [])
    peers = sorted({m.group(1) or "torch" for m in _PEER_RE.finditer(source)} - set(needs))
    return Plan(name=path.stem, path=path, ranks=int(ranks) if ranks else None, args=args,
                json_option="--json" in source,
                timeout=float(timeout or spec.get("timeout", default_timeout)),
                needs=needs, summary=doc.strip().split("\n")[0] if doc else "", peers=peers)


def discover(directory: Path = HERE, only: Sequence[str] = ()) -> list[Path]:
    """``bench_*.py`` in ``directory``, sorted; ``only`` keeps names containing any of its
    strings."""
    paths = sorted(directory.glob("bench_*.py"))
    if only:
        paths = [p for p in paths if any(o in p.stem for o in only)]
    return paths


def find_mpiexec() -> str | None:
    """The ``mpiexec`` next to this Python (a venv with the mpich wheel), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("mpiexec")


def missing_requirement(plan: Plan) -> str | None:
    """Why ``plan`` cannot run here, or None."""
    for module in plan.needs:
        if importlib.util.find_spec(module) is None:
            return f"needs {module}, which is not installed"
    if plan.ranks and find_mpiexec() is None:
        return "needs mpiexec (pip install mpich, or a system MPI)"
    return None


# --- running -------------------------------------------------------------------------


@dataclass
class Outcome:
    """What happened when one benchmark ran."""

    plan: Plan
    status: str
    """``ok``, ``failed``, ``timeout`` or ``skipped``."""
    command: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    data: Any = None
    """The parsed ``--json`` output, when there is one."""
    note: str = ""


def command_for(plan: Plan, json_path: Path | None) -> list[str]:
    """The command line that runs ``plan``."""
    cmd = [sys.executable, str(plan.path), *plan.args]
    if plan.json_option and json_path is not None:
        cmd += ["--json", str(json_path)]
    if plan.ranks:
        cmd = [find_mpiexec() or "mpiexec", "-n", str(plan.ranks), *cmd]
    return cmd


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # The checkout's axondist, whatever the current directory; no parent MPI launch leaks in.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_benchmark(plan: Plan, out_dir: Path) -> Outcome:
    """Run one benchmark in a subprocess (its own process group, killed whole on timeout)."""
    json_path = out_dir / f"{plan.name}.json"
    if json_path.exists():
        json_path.unlink()
    cmd = command_for(plan, json_path)
    why = missing_requirement(plan)
    if why:
        return Outcome(plan, "skipped", cmd, note=why)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=plan.timeout)
        status = "ok" if proc.returncode == 0 else "failed"
        note = "" if status == "ok" else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        stdout, stderr = proc.communicate()
        status, note = "timeout", f"killed after {plan.timeout:.0f} s"
    outcome = Outcome(plan, status, cmd, time.perf_counter() - start, proc.returncode,
                      stdout, stderr, note=note)
    if json_path.exists():
        try:
            outcome.data = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            outcome.note = (outcome.note + "; " if outcome.note else "") + f"bad JSON: {exc}"
    elif status == "ok" and plan.json_option:
        outcome.note = "wrote no JSON; the report shows its printed output"
    return outcome


# --- tables and plots ----------------------------------------------------------------

_SPREAD_KEYS = frozenset({"median", "min", "max", "n"})


def is_spread(value: Any) -> bool:
    """True for a figure with its spread: ``{"median", "min", "max", "n", ...}``."""
    return isinstance(value, dict) and _SPREAD_KEYS <= value.keys()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _median(value: Any) -> Any:
    """The median of a spread, or the value itself."""
    return value["median"] if is_spread(value) else value


@dataclass
class Table:
    """A list of rows found in a benchmark's JSON, with flattened column names."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    context: dict[str, Any] = field(default_factory=dict)
    """Scalars next to the rows in the JSON (world size, dtype, ...)."""


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not is_spread(value):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, list) and not all(isinstance(v, (int, float, str)) for v in value):
            continue
        else:
            flat[name] = value
    return flat


#: JSON keys that are about the run, not tables of figures.
_NOT_TABLES = ("missing_peers",)


def find_tables(data: Any, title: str = "") -> list[Table]:
    """Every list of dicts in ``data`` (depth first, in order) as a Table; a dict of
    scalars or spreads under a key becomes a two-column table."""
    tables: list[Table] = []
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        rows = [_flatten(r) for r in data]
        columns: list[str] = []
        for r in rows:
            columns += [c for c in r if c not in columns]
        return [Table(title, columns, rows)]
    if isinstance(data, dict) and not is_spread(data):
        scalars = {k: v for k, v in data.items() if isinstance(v, (int, float, str, bool))}
        leaves = {k: v for k, v in data.items()
                  if isinstance(v, (int, float, str, bool)) or is_spread(v)}
        if title and data and len(leaves) == len(data):  # {name: value}: a two-column table
            return [Table(title, ["name", "value"],
                          [{"name": k, "value": v} for k, v in data.items()])]
        for key, value in data.items():
            if key in _NOT_TABLES:
                continue
            if isinstance(value, (dict, list)) and not is_spread(value):
                for t in find_tables(value, f"{title}.{key}" if title else str(key)):
                    t.context = {**scalars, **t.context}
                    tables.append(t)
    return tables


_SIZE_COLUMNS = ("bytes", "nbytes", "size_bytes", "size")


def size_column(table: Table) -> str | None:
    """The column holding message/model sizes in bytes, if any."""
    for c in _SIZE_COLUMNS:
        if c in table.columns and all(isinstance(r.get(c), (int, float)) for r in table.rows):
            return c
    return None


def ratio_columns(table: Table) -> list[str]:
    """Columns that hold ratios (``a/b`` or ``vs X`` names, or names with "ratio" or
    "speedup")."""
    return [c for c in table.columns
            if ("/" in c or "ratio" in c.lower() or "speedup" in c.lower()
                or c.lower().startswith("vs ") or " vs " in c.lower())
            and all(_is_number(_median(r.get(c))) for r in table.rows if c in r)]


_TIMING = re.compile(r"(^|[\s_.])(us|ms|s|seconds|time)($|[\s_.])", re.IGNORECASE)


#: Words marking a column as a model's prediction rather than a measurement.
_PREDICTED = ("simulated", "calibrated", "formula", "predicted")


def unspread_columns(table: Table) -> list[str]:
    """Timing columns and timing ratios (``a/b``, "ratio") holding bare numbers: figures
    reported without a spread. Ratios of deterministic quantities (memory ``vs X``) and a
    model's predictions (``simulated``, ``calibrated``...) are not timings and are not
    flagged."""
    sizes = size_column(table)
    return [c for c in table.columns
            if c != sizes and ("/" in c or "ratio" in c.lower() or _TIMING.search(c))
            and not any(word in c.lower() for word in _PREDICTED)
            and any(isinstance(r.get(c), float) for r in table.rows)]


def format_bytes(n: float) -> str:
    n = int(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


_UNITS = {"us": "µs", "ms": "ms", "s": "s", "seconds": "s", "mib": "MiB", "kib": "KiB",
          "gib": "GiB"}
_UNIT_SUFFIX = re.compile(r"^(.*?)[ _](us|ms|s|mib|kib|gib)$", re.IGNORECASE)
_LABELS = {"bytes": "size", "nbytes": "size", "size_bytes": "size",
           "meets_target": "target", "target": "target"}


def column_label(column: str) -> str:
    """A readable header for a flattened JSON key: ``us.ours`` -> ``ours (µs)``,
    ``numpy_sum_us`` -> ``numpy sum (µs)``, ``meets_target`` -> ``target``."""
    if column in _LABELS:
        return _LABELS[column]
    unit = None
    words = []
    for part in column.split("."):
        if part.lower() in _UNITS and unit is None:
            unit = _UNITS[part.lower()]
            continue
        m = _UNIT_SUFFIX.match(part)
        if m and unit is None:
            part, unit = m.group(1), _UNITS[m.group(2).lower()]
        if part == part.lower():  # snake_case keys read as words; NO_SHARD stays a name
            part = part.replace("_", " ")
        words.append(part.replace("/", " / ").strip())
    label = ": ".join(w for w in words if w)
    if not label:
        return unit or column
    return f"{label} ({unit})" if unit else label


def table_title(title: str) -> str:
    """``summary.sync_ms`` -> ``summary: sync (ms)``."""
    return ": ".join(column_label(part) for part in title.split(".")) if title else ""


def _number(value: float) -> str:
    mag = abs(value)
    return f"{value:.0f}" if mag >= 100 else f"{value:.1f}" if mag >= 10 else f"{value:.3g}"


def _cell(value: Any, column: str, sizes: str | None, n_shown: bool = False) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        if "target" in column or column == "value":
            return "met" if value else "**missed**"
        return str(value)
    if is_spread(value):
        text = f"{_number(value['median'])} ({_number(value['min'])}–{_number(value['max'])})"
        return text + (f", n={value['n']}" if n_shown else "")
    if column == sizes:
        return format_bytes(value)
    if isinstance(value, float):
        return _number(value)
    return str(value).replace("|", "\\|")


def column_order(table: Table) -> list[str]:
    """Size first, then the measured values (ours, floors, peers), then ratios, then targets."""
    sizes, ratios = size_column(table), ratio_columns(table)

    def rank(c: str) -> int:
        if c == sizes:
            return 0
        if c in ratios:
            return 2
        return 3 if "target" in c else 1

    return sorted(table.columns, key=rank)  # stable: the JSON's order within each kind


def repeat_counts(table: Table) -> set[int]:
    """The ``n`` of every spread in the table."""
    return {int(v["n"]) for r in table.rows for v in r.values() if is_spread(v)}


def markdown_table(table: Table) -> str:
    """The table in Markdown under readable headers; ratio columns in bold, columns of
    figures without a spread marked with a dagger."""
    sizes = size_column(table)
    ratios = set(ratio_columns(table))
    bare = set(unspread_columns(table))
    columns = column_order(table)
    if columns == ["name", "value"] and table.title.split(".")[-1] == "targets":
        head = ["target", "result"]
    elif columns == ["name", "value"]:
        head = ["", "value"]
    else:
        head = [column_label(c) for c in columns]
    head = [(f"**{h}**" if c in ratios else h) + (" †" if c in bare else "")
            for c, h in zip(columns, head)]
    n_shown = len(repeat_counts(table)) > 1
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.rows:
        lines.append("| " + " | ".join(_cell(r.get(c), c, sizes, n_shown) for c in columns)
                     + " |")
    return "\n".join(lines)


def table_notes(table: Table) -> list[str]:
    """What backs the figures: how many repeats, and which have no spread."""
    notes = []
    counts = repeat_counts(table)
    if len(counts) == 1:
        n = counts.pop()
        notes.append(f"Each figure: median (min–max) over n = {n} timed repeats"
                     + (" (fewer than 3: the spread means little)." if n < 3 else "."))
    elif counts:
        notes.append("Each figure: median (min–max) over the n repeats shown beside it.")
    if unspread_columns(table):
        notes.append("† a median the benchmark reported without its spread or repeat count.")
    return notes


def plot_table(table: Table, path: Path) -> bool:
    """Plot the ratio columns against the size column into ``path`` (needs matplotlib);
    spreads are drawn as min-max error bars around the median.

    Returns False (and draws nothing) without matplotlib, a size column or a
    ratio column.
    """
    sizes, ratios = size_column(table), ratio_columns(table)
    if sizes is None or not ratios:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r[sizes] for r in table.rows]
    values = []
    for c in ratios:
        pts = [(r[sizes], r[c]) for r in table.rows if _is_number(_median(r.get(c)))]
        meds = [_median(v) for _, v in pts]
        low = [m - (v["min"] if is_spread(v) else m) for m, (_, v) in zip(meds, pts)]
        high = [(v["max"] if is_spread(v) else m) - m for m, (_, v) in zip(meds, pts)]
        ax.errorbar([p[0] for p in pts], meds, yerr=[low, high], marker="o", capsize=3,
                    label=column_label(c))
        values += [m - lo for m, lo in zip(meds, low)] + [m + h for m, h in zip(meds, high)]
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    if min(xs) > 0:
        ax.set_xscale("log", base=2)
    if values and min(values) > 0 and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set_xlabel(column_label(sizes) + " (bytes)")
    ax.set_ylabel("ratio, median (min–max)")
    ax.set_title(table_title(table.title) or path.stem, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# --- the report ----------------------------------------------------------------------


def target_results(outcome: Outcome) -> list[tuple[str, bool]]:
    """``(what, met)`` for every boolean target the benchmark reported."""
    found = []
    for t in find_tables(outcome.data) if outcome.data is not None else []:
        targets_table = "target" in t.title.split(".")[-1]
        sizes = size_column(t)
        for c in t.columns:
            if "target" not in c and not (c == "value" and targets_table):
                continue
            for r in t.rows:
                if not isinstance(r.get(c), bool):
                    continue
                first = sizes or next((k for k in t.columns if isinstance(r.get(k), str)), c)
                where = _cell(r.get(first), first, sizes) if first != c else ""
                what = ": ".join(x for x in (table_title(t.title), where) if x)
                found.append((what or outcome.plan.name, r[c]))
    return found


def targets_summary(outcome: Outcome) -> str:
    """``2/3 met; missed: ...``, or why there is no verdict."""
    if outcome.status != "ok":
        return f"not measured ({outcome.status})"
    found = target_results(outcome)
    if not found:
        return "none defined" if outcome.data is not None else "none reported"
    missed = [what for what, met in found if not met]
    met = len(found) - len(missed)
    text = f"{met}/{len(found)} met"
    return text + ("; **missed**: " + ", ".join(missed) if missed else "")


def targets_section(outcomes: list[Outcome]) -> list[str]:
    """Every target of every benchmark that ran, one row each, marked met or MISSED
    (Markdown lines; none when no benchmark reported a target)."""
    rows = [(o.plan.name, what, met) for o in outcomes if o.status == "ok"
            for what, met in target_results(o)]
    if not rows:
        return []
    lines = ["", "## Targets", "",
             f"{sum(met for _, _, met in rows)} of {len(rows)} met, judged on the median.", "",
             "| benchmark | target | verdict |", "|---|---|---|"]
    lines += [f"| {name} | {what} | {'met' if met else '**MISSED**'} |"
              for name, what, met in rows]
    return lines


def not_compared(outcome: Outcome) -> dict[str, str]:
    """Peers the benchmark could not compare against here, and why."""
    named: dict[str, str] = {}
    if isinstance(outcome.data, dict) and isinstance(outcome.data.get("missing_peers"), dict):
        named = {str(k): str(v) for k, v in outcome.data["missing_peers"].items()}
    for module in outcome.plan.peers:
        if importlib.util.find_spec(module) is None and not any(
                module in k or module in v for k, v in named.items()):
            named[module] = f"{module} not installed"
    return named


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def write_report(outcomes: list[Outcome], out_dir: Path, quick: bool) -> Path:
    """Write ``report.md`` (and per-benchmark text, JSON and plots) into ``out_dir``."""
    import platform

    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["# axondist benchmarks", "",
          (f"{time.strftime('%Y-%m-%d %H:%M:%S')} on {platform.node() or 'this machine'} "
           f"({platform.machine()}, {os.cpu_count()} CPUs), Python {platform.python_version()}"
           f"{', quick mode (fewer repeats: wider spreads)' if quick else ''}."), "",
          ("Ratios compare variants timed in alternating batches within one run; each "
           "benchmark's docstring says which way is better and its target. Figures read "
           "`median (min–max)` over the timed repeats (their number is under each table); "
           "under MPI each repeat is the slowest rank's time. Targets are judged on the "
           "median: a spread that straddles a target means the verdict may flip on a rerun."),
          "",
          "| benchmark | run with | status | seconds | targets | not compared |",
          "|---|---|---|---|---|---|"]
    for o in outcomes:
        status = o.status + (f" ({o.note})" if o.note and o.status != "ok" else "")
        peers = "; ".join(f"{k} ({v})" for k, v in not_compared(o).items())
        md.append(f"| [{o.plan.name}](#{o.plan.name.replace('_', '-')}) | {o.plan.how} | "
                  f"{status} | {o.seconds:.1f} | {targets_summary(o)} | {peers} |")
    md += targets_section(outcomes)
    for o in outcomes:
        md += ["", f"## {o.plan.name}", ""]
        if o.plan.summary:
            md += [o.plan.summary, ""]
        md += [f"`{' '.join(_display(c) for c in o.command)}` — **{o.status}**"
               + (f": {o.note}" if o.note else ""), ""]
        for peer, why in not_compared(o).items():
            md += [f"Not compared: {peer} ({why}).", ""]
        (out_dir / f"{o.plan.name}.txt").write_text(o.stdout + ("\n--- stderr ---\n" + o.stderr
                                                                 if o.stderr else ""))
        tables = find_tables(o.data) if o.data is not None else []
        for k, t in enumerate(tables):
            if t.title:
                md += [f"### {table_title(t.title)}", ""]
            if t.context:
                md += [", ".join(f"{column_label(key)} = {_cell(v, key, None)}"
                                 for key, v in t.context.items()), ""]
            md += [markdown_table(t), ""]
            md += [" ".join(table_notes(t)), ""] if table_notes(t) else []
            png = out_dir / f"{o.plan.name}_{k}.png"
            if plot_table(t, png):
                md += [f"![{table_title(t.title) or o.plan.name}]({png.name})", ""]
        if o.stdout.strip() and (not tables or o.status != "ok"):
            md += ["Printed output:", "", "```text", _tail(o.stdout, 60), "```", ""]
        elif o.stdout.strip():  # the benchmark's own table, folded away
            md += ["<details><summary>printed output</summary>", "", "```text",
                   _tail(o.stdout, 80), "```", "", "</details>", ""]
        if o.status in ("failed", "timeout") and o.stderr.strip():
            md += ["Error output (last lines):", "", "```text", _tail(o.stderr), "```", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return report


def _display(arg: str) -> str:
    """Paths relative to the checkout, for a report that reads the same on any machine."""
    try:
        rel = Path(arg).resolve().relative_to(ROOT)
        return str(rel)
    except ValueError:
        return Path(arg).name if arg == sys.executable or arg.endswith("mpiexec") else arg


# --- command line --------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; exit status 0 unless ``--strict`` and one did not pass."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast pass: fewer repeats")
    parser.add_argument("--only", nargs="+", default=(), metavar="NAME",
                        help="run only benchmarks whose name contains one of these")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per benchmark (default: 180 with --quick, else 900)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="results folder (default: benchmarks/results)")
    parser.add_argument("--list", action="store_true", help="show the plan and run nothing")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a benchmark fails or times out")
    parser.add_argument("--dir", type=Path, default=HERE,
                        help="folder of bench_*.py files (default: this one)")
    args = parser.parse_args(argv)
    plans = [plan_benchmark(p, args.quick, args.timeout) for p in discover(args.dir, args.only)]
    if not plans:
        print("no benchmarks matched", file=sys.stderr)
        return 1
    if args.list:
        for p in plans:
            print(f"{p.name:32s} {' '.join(_display(c) for c in command_for(p, Path('x.json')))}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for p in plans:
        print(f"{p.name} ({p.how}) ...", end=" ", flush=True)
        o = run_benchmark(p, args.out)
        print(f"{o.status} in {o.seconds:.1f} s" + (f" ({o.note})" if o.note else ""),
              flush=True)
        outcomes.append(o)
    report = write_report(outcomes, args.out, args.quick)
    print(f"report: {report}")
    bad = [o for o in outcomes if o.status in ("failed", "timeout")]
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
