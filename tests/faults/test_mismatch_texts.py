"""One mistake, one message, on every backend: ranks that call different collectives are
told so (with ``AXONDIST_DEBUG=1`` too, where the ranks exchange their calls instead of a
hash), a shape mismatch reads ``(rank 0: (3,), rank 1: (4,))`` everywhere, ``sizes=`` on one
rank only names ``counts``, ``op=None`` names the argument and the valid ops, torch's own
ReduceOp members work, an unreceived send is counted once (also one sent after its
destination went to its exit), and a waiting call is described
with each field once. Each run of ``scripts/mismatch_cases.py`` is a subprocess under its own
timeout (``faults.runner``), on the mock world, under ``mpiexec -n 2/3`` and under
``torchrun --nproc-per-node 2``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import LIMIT, MISSING, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "mismatch_cases.py"


def _different(other: str) -> str:
    return (r"ranks called different collectives at the same point \(rank 0 called all_reduce, "
            rf"(rank 1 called all_reduce, )?rank [12] called {other}\); every rank must make "
            "the same collective calls in the same order")


#: case -> what every run of it prints (None: it must succeed, printing ``CASE OK``).
SAID: dict[str, str | None] = {
    "reduce_vs_broadcast": _different("broadcast"),
    "reduce_vs_gather": _different("all_gather"),
    "reduce_vs_reduce_scatter": _different("reduce_scatter"),
    "shape_mismatch": r"all_reduce: ranks disagree on shape \(rank 0: \(3,\), rank 1: \(4,\)"
                      r"(, rank 2: \(5,\))?\)",
    "sizes_on_one_rank": r"all_gather: ranks disagree on counts \(rank 0: \[2, 2(, 2)?\], "
                         r"rank 1: not given",
    "op_none": r"all_reduce: op=None is an unknown reduce op; pass a ReduceOp \(SUM, PRODUCT, "
               r"MIN, MAX, AVERAGE\)",
    "torch_ops": None,
    "one_unreceived_send": r"messages were sent but never received: 1 from rank 0 to rank 1 "
                           r"\(tag 0\)",
    "three_unreceived_sends": r"messages were sent but never received: 3 from rank 0 to rank 1 "
                              r"\(tag 0\)",
    "send_after_the_peer_left": r"messages were sent but never received: 1 from rank 0 to "
                                r"rank 1 \(tag 0\)",
    "waits_in_all_reduce": r"waits in all_reduce #1 on world \([^)]*reduce_op=MAX\)",
}
DIFFERENT = ("reduce_vs_broadcast", "reduce_vs_gather", "reduce_vs_reduce_scatter")
# (case, mode, ranks, AXONDIST_DEBUG)
RUNS = sorted(
    {(c, "mock", n, False) for c in SAID for n in (2, 3) if c != "torch_ops"}
    | {(c, "mpi", n, d) for c in DIFFERENT for n in (2, 3) for d in (False, True)}
    | {(c, "mpi", n, d) for c in ("shape_mismatch", "sizes_on_one_rank") for n in (2, 3)
       for d in (False, True)}
    | {(c, m, 2, False) for c in ("op_none", "torch_ops") for m in ("mock", "mpi", "torch")}
    | {(c, "mpi", n, False) for c in ("one_unreceived_send", "three_unreceived_sends",
                                     "send_after_the_peer_left") for n in (2, 3)}
    | {("waits_in_all_reduce", "mpi", 2, False)}
    | {("reduce_vs_broadcast", "torch", 2, d) for d in (False, True)}
    | {("reduce_vs_reduce_scatter", "torch", 2, True), ("shape_mismatch", "torch", 2, True),
       ("one_unreceived_send", "torch", 2, False)})

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs")


def _run(case: str, mode: str, n: int, debug: bool) -> Outcome:
    env = {"AXONDIST_DEBUG": "1" if debug else "0"}
    if case == "waits_in_all_reduce":
        env["AXONDIST_TIMEOUT"] = "3"
    return run_case(SCRIPT, case, mode, n, env)


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, _run)


def _params() -> list:
    return [pytest.param(*r, id=f"{r[0]}-{r[1]}{r[2]}{'-debug' if r[3] else ''}")
            for r in RUNS]


@pytest.mark.parametrize("case,mode,n,debug", _params())
def test_the_message_is_the_same_on_every_backend(case: str, mode: str, n: int,
                                                  debug: bool) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n, debug)].result()
    tail = outcome.output[-6000:]
    pattern = SAID[case]
    if pattern is None:
        assert outcome.returncode == 0, tail
        assert outcome.output.count(f"{case} OK") == n, tail
        assert outcome.output.count("op=<RedOpType.BAND: 5> is an unknown reduce op") == n, tail
        return
    assert outcome.returncode not in (0, -999), f"{case} must fail:\n{tail}"
    assert outcome.fault_seconds < LIMIT, f"{case} took {outcome.fault_seconds:.1f} s:\n{tail}"
    assert re.search(pattern, outcome.output), f"no match for {pattern!r} in:\n{tail}"
    assert not re.search(r"rank \d: None", outcome.output), tail  # a field of another call
    assert not re.search(r"(\w+)=[^,()]+, \1=", outcome.output), tail  # a field said twice


#: Cases whose whole message must be the same text on the mock world and under mpiexec.
SAME_TEXT = DIFFERENT + ("shape_mismatch", "sizes_on_one_rank")


def _messages(outcome: Outcome) -> set[str]:
    return {m.strip() for m in re.findall(r"CollectiveMismatchError: (.*)", outcome.output)}


@pytest.mark.parametrize("case,n,debug", [(c, n, d) for c in SAME_TEXT for n in (2, 3)
                                           for d in (False, True)])
def test_the_mock_world_and_mpi_word_a_mistake_identically(case: str, n: int,
                                                          debug: bool) -> None:
    if MISSING["mpi"]() is not None:
        pytest.skip(MISSING["mpi"]() or "")
    mock = _outcomes()[(case, "mock", n, False)].result()
    mpi = _outcomes()[(case, "mpi", n, debug)].result()
    said, told = _messages(mock), _messages(mpi)
    assert len(said) == 1 and told, f"mock:\n{mock.output[-3000:]}\nmpi:\n{mpi.output[-3000:]}"
    if case in DIFFERENT:  # each rank names its own call first: compare what follows it,
        # since the first rank to raise may end an MPI job before the others print
        said, told = {m.partition(": ")[2] for m in said}, {m.partition(": ")[2] for m in told}
    assert told == said, f"mock: {said}\nmpi:\n{mpi.output[-4000:]}"
