"""When axondist turns MPICH's single-copy reads on (axondist/backends/mpi/single_copy.py): on a
fake procfs, every combination of a seccomp filter and Yama's ptrace scope, and a value the
user set."""

from __future__ import annotations

from pathlib import Path

import pytest

from axondist.backends.mpi.single_copy import CMA_VARIABLE, default_on, why_not_permitted


def _proc(root: Path, seccomp: str | None, yama: str | None) -> str:
    (root / "self").mkdir(parents=True)
    lines = ["Name:\tpython", "NoNewPrivs:\t0"]
    if seccomp is not None:
        lines.append(f"Seccomp:\t{seccomp}")
    (root / "self" / "status").write_text("\n".join(lines) + "\n")
    if yama is not None:
        (root / "sys" / "kernel" / "yama").mkdir(parents=True)
        (root / "sys" / "kernel" / "yama" / "ptrace_scope").write_text(f"{yama}\n")
    return str(root)


@pytest.mark.parametrize("seccomp, yama, reason", [
    ("0", None, None),
    ("0", "0", None),
    ("0", "1", "kernel.yama.ptrace_scope is 1"),
    ("0", "3", "kernel.yama.ptrace_scope is 3"),
    ("2", None, "a seccomp filter is in force (Seccomp: 2)"),
    ("2", "0", "a seccomp filter is in force (Seccomp: 2)"),
    (None, None, "a seccomp filter is in force (Seccomp: None)"),
])
def test_reads_are_permitted_only_without_a_filter_or_a_yama_scope(
        tmp_path: Path, seccomp: str | None, yama: str | None, reason: str | None) -> None:
    proc = _proc(tmp_path, seccomp, yama)
    assert why_not_permitted(proc) == reason
    env: dict[str, str] = {}
    assert default_on(env, proc) is (reason is None)
    assert env == ({CMA_VARIABLE: "1"} if reason is None else {})


def test_without_procfs_nothing_is_set(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert why_not_permitted(str(tmp_path / "none")) == "no /proc/self/status (not Linux)"
    assert default_on(env, str(tmp_path / "none")) is False
    assert env == {}


@pytest.mark.parametrize("value, on", [("0", False), ("1", True), ("", False), (" 1 ", True)])
def test_a_value_the_user_set_is_kept(tmp_path: Path, value: str, on: bool) -> None:
    proc = _proc(tmp_path, "0", None)
    env = {CMA_VARIABLE: value}
    assert default_on(env, proc) is on
    assert env == {CMA_VARIABLE: value}
