"""axondist.log: the rank in every record, no handler unless asked, print0 on rank 0 only, and
all_reduce_scalar against NumPy on every world size."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist
from axondist import log

ROOT = Path(__file__).resolve().parents[2]
_RANK_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "PMIX_RANK", "PMIX_SIZE", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture
def no_launch_env(monkeypatch):
    for var in _RANK_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def handler():
    stream = io.StringIO()
    added = log.setup("DEBUG", stream=stream)
    yield stream
    logging.getLogger("axondist").removeHandler(added)
    logging.getLogger("axondist").setLevel(logging.NOTSET)


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in _RANK_VARS and k != log.LEVEL_VAR}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full.get("PYTHONPATH")]))
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=60, check=False)


# --- all_reduce_scalar ---------------------------------------------------------------------

REDUCTIONS = {"mean": np.mean, "sum": np.sum, "min": np.min, "max": np.max,
              "product": np.prod, "avg": np.mean}
finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(world_size=st.integers(1, 5), op=st.sampled_from(sorted(REDUCTIONS)),
       values=st.lists(finite, min_size=5, max_size=5))
def test_all_reduce_scalar_matches_numpy(world_size, op, values):
    results = axondist.spawn(lambda w: log.all_reduce_scalar(values[w.rank], op), world_size)
    expected = float(REDUCTIONS[op](np.array(values[:world_size], dtype=np.float64)))
    for got in results:
        assert type(got) is float
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-9)
    assert len(set(results)) == 1  # every rank gets the same bits


@pytest.mark.parametrize("value", [np.float32(2.5), np.array(2.5), np.array([2.5]),
                                   np.array([[2.5]], dtype=np.float16), 2, True])
def test_all_reduce_scalar_takes_numbers_and_one_element_arrays(value):
    got = axondist.spawn(lambda w: log.all_reduce_scalar(value, "sum", w), 2)
    assert got == [2.0 * float(np.asarray(value).reshape(()))] * 2


def test_all_reduce_scalar_uses_the_given_group():
    def body(world):
        evens = world.new_group([0, 2])
        if evens.is_member:
            return log.all_reduce_scalar(world.rank, "sum", evens)
        return None

    assert axondist.spawn(body, 3) == [2.0, None, 2.0]


@pytest.mark.parametrize("value, match", [
    ("1.5", "value must be a real number or a one-element array, got str '1.5'"),
    (1 + 2j, "got complex"),
    (np.ones(3), r"got an array of shape \(3,\); reduce arrays with axondist.all_reduce"),
    (None, "got NoneType"),
])
def test_all_reduce_scalar_refuses_what_is_not_a_scalar(value, match):
    with pytest.raises(TypeError, match=match):
        log.all_reduce_scalar(value, "sum", axondist.World.mock())


def test_all_reduce_scalar_names_a_bad_op():
    with pytest.raises(ValueError, match="all_reduce_scalar: op='median' is not one of ReduceOp"):
        log.all_reduce_scalar(1.0, "median", axondist.World.mock())


def test_top_level_exports():
    assert axondist.all_reduce_scalar is log.all_reduce_scalar
    assert axondist.print0 is log.print0
    assert {"print0", "all_reduce_scalar"} <= set(axondist.__all__)


# --- print0 --------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_print0_prints_on_rank_0_only(world_size):
    out = io.StringIO()
    axondist.spawn(lambda w: log.print0("loss", w.rank, sep="=", file=out), world_size)
    assert out.getvalue() == "loss=0\n"


def test_print0_on_a_subgroup_prints_on_its_first_member():
    out = io.StringIO()

    def body(world):
        group = world.new_group([2, 1])
        log.print0("from world rank", world.rank, group=group, file=out)

    axondist.spawn(body, 3)
    assert out.getvalue() == "from world rank 2\n"


# --- the logger ----------------------------------------------------------------------------

def test_importing_adds_no_handler_that_prints():
    proc = python("import logging, axondist, axondist.log\n"
                  "lg = logging.getLogger('axondist')\n"
                  "print([type(h).__name__ for h in lg.handlers], logging.getLogger().handlers)\n"
                  "lg.warning('should not show')\n"
                  "axondist.log.logger.error('nor this')")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['NullHandler'] []"
    assert proc.stderr == ""


def test_the_environment_variable_enables_a_stderr_handler():
    code = ("from axondist import log\n"
            "log.get_logger('ddp').info('bucket plan: 3 buckets')\n"
            "log.get_logger('ddp').debug('hidden at INFO')")
    proc = python(code, AXONDIST_LOG_LEVEL="info", PMI_RANK="1", PMI_SIZE="2")
    assert proc.returncode == 0, proc.stderr
    assert "[rank 1/2] INFO axondist.ddp: bucket plan: 3 buckets" in proc.stderr
    assert "hidden" not in proc.stderr


def test_a_bad_level_in_the_environment_warns_and_adds_nothing():
    proc = python("import warnings; warnings.simplefilter('always')\n"
                  "from axondist import log\nlog.logger.error('a record')",
                  AXONDIST_LOG_LEVEL="LOUD")
    assert proc.returncode == 0, proc.stderr
    assert "AXONDIST_LOG_LEVEL='LOUD'" in proc.stderr and "no log handler added" in proc.stderr
    assert "a record" not in proc.stderr


def test_records_carry_the_registered_rank(handler, no_launch_env):
    ranks = {"r0": (0, 2), "r1": (1, 2)}
    previous = log.set_rank_source(lambda: ranks.get(threading.current_thread().name))
    try:
        threads = [threading.Thread(target=log.logger.info, args=("hello from %s", name),
                                    name=name) for name in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log.logger.info("no world here")
    finally:
        log.set_rank_source(previous)
    text = handler.getvalue()
    assert "[rank 0/2] INFO axondist: hello from r0" in text
    assert "[rank 1/2] INFO axondist: hello from r1" in text
    assert "[rank -/-] INFO axondist: no world here" in text


def test_a_failing_rank_source_falls_back_to_the_environment(handler, monkeypatch):
    def broken():
        raise RuntimeError("no world")

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    previous = log.set_rank_source(broken)
    try:
        logging.getLogger("axondist.comm").warning("plain stdlib logger")
    finally:
        log.set_rank_source(previous)
    assert "[rank 3/4] WARNING axondist.comm: plain stdlib logger" in handler.getvalue()


def test_get_logger_names_and_user_handlers_see_the_rank(no_launch_env, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "3")
    assert log.get_logger("fsdp").name == "axondist.fsdp"
    assert log.get_logger("axondist.pipeline").name == "axondist.pipeline"
    assert log.get_logger().name == "axondist"
    stream = io.StringIO()
    user = logging.StreamHandler(stream)
    user.setFormatter(logging.Formatter("%(rank)s of %(world_size)s: %(message)s"))
    lg = log.get_logger("fsdp")
    lg.addHandler(user)
    lg.setLevel(logging.INFO)
    try:
        lg.info("units: 4")
    finally:
        lg.removeHandler(user)
        lg.setLevel(logging.NOTSET)
    assert stream.getvalue() == "0 of 3: units: 4\n"


def test_setup_replaces_its_own_handler_only():
    mine = logging.NullHandler()
    lg = logging.getLogger("axondist")
    lg.addHandler(mine)
    try:
        first = log.setup("WARNING", stream=io.StringIO())
        second = log.setup(logging.DEBUG, stream=io.StringIO())
        assert first not in lg.handlers and second in lg.handlers and mine in lg.handlers
        assert lg.level == logging.DEBUG
    finally:
        lg.removeHandler(second)
        lg.removeHandler(mine)
        lg.setLevel(logging.NOTSET)


@pytest.mark.parametrize("level, error, match", [
    ("LOUD", ValueError, "setup: level 'LOUD' is not a logging level"),
    (None, TypeError, "setup: level must be a level name or number, got NoneType"),
    (True, TypeError, "got bool"),
])
def test_setup_names_a_bad_level(level, error, match):
    with pytest.raises(error, match=match):
        log.setup(level, stream=io.StringIO())
