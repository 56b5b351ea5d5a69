"""One training loop for every data-parallel wrapper, checked against one process.

DDP, ZeRO-1 (DDP with a ZeroRedundancyOptimizer) and FSDP under every
sharding strategy are driven by the same calls: ``model.backward(*batch)``
then ``model.clip_grad_norm``/``opt.step()``, the one-call
``model.step(*batch, optimizer=opt)``, and FSDP's older
``step(grad_fn, *batch, optimizer=opt)``; each must land on the parameters
single-process training on the whole batch gives; so must a Pipeline holding the
same model as stages, driven by the same calls. ``examples/one_script.py``
runs on threads here and under ``mpiexec -n 2`` / ``-n 3`` and
``axondist run -n 2`` in subprocesses, each under its own timeout.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from harness import LAUNCHED, current_size, mock_only, run_world, world_sizes
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import Parameter
from axondist.ddp import DDP
from axondist.errors import NonFiniteNormError, UnsupportedDTypeError
from axondist.fsdp import FSDP, ShardingStrategy
from axondist.optim import SGD, Adam
from axondist.pipeline import SCHEDULES, Pipeline, PipelineStage
from axondist.zero import ZeroRedundancyOptimizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "one_script.py"
KINDS = ["ddp", "zero1", *[f"fsdp:{s.name}" for s in ShardingStrategy]]
SHAPES = [(3, 4), (4,), (2, 3), (5,)]
TOL = {"rtol": 1e-9, "atol": 1e-11}


# --- a model every rank can compute the single-process answer for ---------------------------

def init_params(seed: int, rank: int) -> list[Parameter]:
    """Rank-dependent values: every wrapper must start from rank 0's."""
    rng = np.random.default_rng([seed, rank])
    return [Parameter(0.5 * rng.standard_normal(s), name=f"p{i}") for i, s in enumerate(SHAPES)]


def batch(seed: int, rank: int, step: int, n: int = 3) -> tuple[np.ndarray, np.ndarray]:
    dim = sum(int(np.prod(s)) for s in SHAPES)
    rng = np.random.default_rng([seed, rank, step, 1])
    return rng.standard_normal((n, dim)) / np.sqrt(dim), rng.standard_normal(n)


def grad_fn(arrays, x, y):
    """0.5 * mean((tanh(x @ theta) - y)**2) and its gradient per parameter."""
    theta = np.concatenate([np.asarray(a).ravel() for a in arrays])
    yh = np.tanh(x @ theta)
    r = yh - y
    g = x.T @ (r * (1 - yh * yh)) / len(y)
    grads, off = [], 0
    for a in arrays:
        grads.append(g[off:off + a.size].reshape(a.shape))
        off += a.size
    return 0.5 * float(np.mean(r * r)), grads


def generator_grad_fn(arrays, x, y):
    loss, grads = grad_fn(arrays, x, y)
    for i in reversed(range(len(grads))):
        yield i, grads[i]
    return loss


def reference(seed: int, world: int, steps: int, max_norm: float | None, opt_kind: str):
    """(final {name: array}, each step's pre-clipping norm): one process, the whole batch."""
    params = init_params(seed, 0)
    opt = make_opt(opt_kind, params)
    norms = []
    for step in range(steps):
        parts = [batch(seed, r, step) for r in range(world)]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        _, grads = grad_fn([p.data for p in params], x, y)
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
        norms.append(norm)
        coef = max_norm / (norm + 1e-6) if max_norm is not None else 1.0
        for p, g in zip(params, grads):
            p.grad = g * coef if coef < 1 else g
        opt.step()
        opt.zero_grad()
    return {p.name: p.data.copy() for p in params}, norms


def make_opt(kind: str, params):
    return SGD(params, lr=0.3, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.05)


def build(kind: str, params, world, opt_kind: str = "sgd", with_grad_fn=grad_fn):
    """(wrapper, optimizer) for ``kind``: the only place the strategy appears."""
    if kind in ("ddp", "zero1"):
        model = DDP(params, world, grad_fn=with_grad_fn)
    else:
        strategy = ShardingStrategy[kind.split(":")[1]]
        rpn = (2 if world.world_size % 2 == 0 else 1) if strategy.spec.uses_nodes else None
        model = FSDP(params, world, grad_fn=with_grad_fn, sharding_strategy=strategy,
                     units=[[0, 1], [2, 3]], ranks_per_node=rpn)
    if kind == "zero1":
        opt_class = SGD if opt_kind == "sgd" else Adam
        hyper = {"lr": 0.3, "momentum": 0.9} if opt_kind == "sgd" else {"lr": 0.05}
        return model, ZeroRedundancyOptimizer(model.parameters(), opt_class, **hyper)
    return model, make_opt(opt_kind, model.parameters())


# --- every wrapper, every call shape, against one process ----------------------------------

@given(size=world_sizes(1, 4), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16),
       steps=st.integers(1, 3), style=st.sampled_from(["two_calls", "one_call", "legacy"]),
       max_norm=st.sampled_from([None, 0.05, 100.0]), opt_kind=st.sampled_from(["sgd", "adam"]))
def test_every_wrapper_trains_like_one_process(size, kind, seed, steps, style, max_norm,
                                               opt_kind):
    want, norms = reference(seed, current_size(size), steps, max_norm, opt_kind)

    def body(world):
        params = init_params(seed, world.rank)
        model, opt = build(kind, params, world, opt_kind,
                           with_grad_fn=None if style == "legacy" else grad_fn)
        for step in range(steps):
            xb, yb = batch(seed, world.rank, step)
            if style == "two_calls":
                model.backward(xb, yb)
                if max_norm is not None:
                    norm = model.clip_grad_norm(max_norm)
                    np.testing.assert_allclose(norm, norms[step], rtol=1e-9)
                opt.step()
                opt.zero_grad()
            elif style == "one_call":
                model.step(xb, yb, optimizer=opt, max_norm=max_norm)
            else:
                model.step(grad_fn, xb, yb, optimizer=opt, max_norm=max_norm)
        state = model.state_dict()
        assert list(state) == [f"p{i}" for i in range(len(SHAPES))]
        for name, value in want.items():
            np.testing.assert_allclose(state[name], value, **TOL, err_msg=f"{kind} {name}")
        return True

    assert all(run_world(body, size))


@pytest.mark.parametrize("kind", [k for k in KINDS if k.startswith("fsdp")] + ["ddp"])
def test_a_generator_grad_fn_works_on_every_wrapper(kind):
    want, _ = reference(3, current_size(2), 2, None, "sgd")

    def body(world):
        model, opt = build(kind, init_params(3, world.rank), world,
                           with_grad_fn=generator_grad_fn)
        for step in range(2):
            loss = model.step(*batch(3, world.rank, step), optimizer=opt)
            assert loss == pytest.approx(grad_fn(
                [p.data for p in init_params(3, 0)], *batch(3, world.rank, 0))[0]) or step
        state = model.state_dict()
        for name, value in want.items():
            np.testing.assert_allclose(state[name], value, **TOL)
        return True

    assert all(run_world(body, 2))


@pytest.mark.parametrize("src", KINDS)
def test_a_state_dict_loads_under_every_other_strategy(src):
    """state_dict() has the same keys and full shapes everywhere, on every rank."""

    def body(world):
        model, opt = build(src, init_params(5, world.rank), world)
        model.step(*batch(5, world.rank, 0), optimizer=opt)
        saved = model.state_dict()
        for dst in KINDS:
            other, _ = build(dst, init_params(6, world.rank), world)
            other.load_state_dict(saved)
            back = other.state_dict()
            assert list(back) == list(saved)
            for name in saved:
                np.testing.assert_array_equal(back[name], saved[name])
            with other.summon_full_params():
                for p, name in zip(init_params(0, 0), saved):
                    assert p.name == name
        return True

    assert all(run_world(body, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_refuses_other_models(kind):
    def body(world):
        model, _ = build(kind, init_params(1, world.rank), world)
        state = model.state_dict()
        with pytest.raises(TypeError, match="load_state_dict: state must be a dict"):
            model.load_state_dict([1, 2])
        with pytest.raises(ValueError, match="q9"):
            model.load_state_dict({**state, "q9": np.zeros(1)})
        with pytest.raises(ValueError, match=r"'p1' has shape \(7,\), the parameter has \(4,\)"):
            model.load_state_dict({**state, "p1": np.zeros(7)})
        partial = dict(state)
        del partial["p2"]
        with pytest.raises(ValueError, match="p2"):
            model.load_state_dict(partial)
        return True

    assert all(run_world(body, 2))


def test_summon_full_params_is_a_no_op_for_ddp_and_gathers_for_fsdp():
    def body(world):
        params = init_params(2, world.rank)
        ddp = DDP(params, world)
        with ddp.summon_full_params() as held:
            assert all(a is b for a, b in zip(held, params))
        fparams = init_params(2, world.rank)
        fsdp = FSDP(fparams, world)
        assert fparams[0].data.size == 0  # resharded
        with fsdp.summon_full_params() as held:
            np.testing.assert_array_equal(held[0].data, init_params(2, 0)[0].data)
        assert fparams[0].data.size == 0
        return True

    assert all(run_world(body, 3))


# --- the same model as a pipeline -----------------------------------------------------------
# Stage 0 appends z = 0 to x; each stage adds its parameters' share of z = x @ theta to the
# carried [x | z]; the loss is on z.

OFFSETS = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])


def stage_of(i: int, p: int) -> int:
    """The pipeline stage holding parameter ``i`` when the model is split over ``p`` ranks."""
    return i * p // len(SHAPES)


def pipeline_stage(params: list[Parameter], rank: int, p: int) -> PipelineStage:
    held = [i for i in range(len(SHAPES)) if stage_of(i, p) == rank]

    def forward(arrays, h):
        if rank == 0:
            h = np.concatenate([h, np.zeros((len(h), 1))], axis=1)
        z = h[:, -1].copy()
        for i, a in zip(held, arrays):
            z += h[:, OFFSETS[i]:OFFSETS[i + 1]] @ a.ravel()
        return np.concatenate([h[:, :-1], z[:, None]], axis=1), h

    def backward(arrays, h, grad):
        gz = grad[:, -1]
        grad_h = grad.copy()
        grads = []
        for i, a in zip(held, arrays):
            grad_h[:, OFFSETS[i]:OFFSETS[i + 1]] += gz[:, None] * a.ravel()
            grads.append((h[:, OFFSETS[i]:OFFSETS[i + 1]].T @ gz).reshape(a.shape))
        return (grad_h[:, :-1] if rank == 0 else grad_h), grads

    return PipelineStage(forward, backward, [params[i] for i in held])


def pipeline_loss(h, y):
    """grad_fn's loss on the carried z, and its gradient with respect to [x | z]."""
    yh = np.tanh(h[:, -1])
    r = yh - y
    grad = np.zeros_like(h)
    grad[:, -1] = r * (1 - yh * yh) / len(y)
    return 0.5 * float(np.mean(r * r)), grad


def build_pipeline(params, world, schedule="1f1b") -> Pipeline:
    stage = pipeline_stage(params, world.rank, world.world_size)
    return Pipeline(stage, world, num_microbatches=2, schedule=schedule, loss_fn=pipeline_loss)


def global_batch(seed: int, world: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's batch of the data-parallel tests, concatenated: the pipeline's batch."""
    parts = [batch(seed, r, step) for r in range(world)]
    return np.concatenate([q[0] for q in parts]), np.concatenate([q[1] for q in parts])


@given(size=world_sizes(1, 4), schedule=st.sampled_from(list(SCHEDULES)),
       seed=st.integers(0, 2**16), steps=st.integers(1, 3),
       style=st.sampled_from(["two_calls", "one_call"]),
       max_norm=st.sampled_from([None, 0.05, 100.0]), opt_kind=st.sampled_from(["sgd", "adam"]))
def test_a_pipeline_trains_like_one_process_with_the_same_calls(size, schedule, seed, steps,
                                                                style, max_norm, opt_kind):
    want, norms = reference(seed, current_size(size), steps, max_norm, opt_kind)

    def body(world):
        model = build_pipeline(init_params(seed, 0), world, schedule)
        opt = make_opt(opt_kind, model.parameters())
        for step in range(steps):
            xb, yb = global_batch(seed, world.world_size, step)
            if style == "two_calls":
                model.backward(xb, yb)
                if max_norm is not None:
                    np.testing.assert_allclose(model.clip_grad_norm(max_norm), norms[step],
                                               rtol=1e-9)
                opt.step()
                opt.zero_grad()
            else:
                model.step(xb, yb, optimizer=opt, max_norm=max_norm)
        state = model.state_dict()
        assert list(state) == [f"p{i}" for i in range(len(SHAPES))]
        for name, value in want.items():
            np.testing.assert_allclose(state[name], value, **TOL, err_msg=f"{schedule} {name}")
        model.close()
        return True

    assert all(run_world(body, size))


def test_a_pipeline_state_dict_loads_under_every_other_strategy_and_back():
    def body(world):
        pipe = build_pipeline(init_params(5, 0), world)
        pipe.step(*global_batch(5, world.world_size, 0), optimizer=make_opt("sgd",
                                                                            pipe.parameters()))
        saved = pipe.state_dict()
        for dst in KINDS:
            other, _ = build(dst, init_params(6, world.rank), world)
            other.load_state_dict(saved)
            back = other.state_dict()
            for name in saved:
                np.testing.assert_array_equal(back[name], saved[name])
            other.step(*batch(6, world.rank, 0), optimizer=make_opt("sgd", other.parameters()))
            trained = other.state_dict()
            target = build_pipeline(init_params(7, 0), world)
            target.load_state_dict(trained)
            again = target.state_dict()
            assert list(again) == list(trained)
            for name in trained:
                np.testing.assert_array_equal(again[name], trained[name], err_msg=dst)
            target.close()
        pipe.close()
        return True

    assert all(run_world(body, current_size(3)))


# --- failure paths ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_step_api_errors_are_clear(kind):
    def body(world):
        model, opt = build(kind, init_params(1, world.rank), world, with_grad_fn=None)
        xb, yb = batch(1, world.rank, 0)
        with pytest.raises(TypeError, match=r"no grad_fn; pass grad_fn=\.\.\."):
            model.backward(xb, yb)
        with pytest.raises(TypeError, match=r"step: optimizer= must be an optimizer.*got NoneType"):
            model.step(grad_fn, xb, yb, optimizer=None)
        with model.no_sync(), pytest.raises(RuntimeError, match="cannot step inside no_sync"):
            model.step(grad_fn, xb, yb, optimizer=opt)
        model.backward(grad_fn, xb, yb)
        with pytest.raises(TypeError, match="max_norm must be a number, got str '1'"):
            model.clip_grad_norm("1")
        with pytest.raises(ValueError, match="max_norm=-1.0 must be a finite number > 0"):
            model.clip_grad_norm(-1.0)
        with pytest.raises(ValueError, match="norm_type must be"):
            model.clip_grad_norm(1.0, "two")

        def complex_grads(arrays, x, y):
            loss, grads = grad_fn(arrays, x, y)
            return loss, [g.astype(np.complex128) for g in grads]

        with pytest.raises(UnsupportedDTypeError, match="complex128; complex gradients are not "
                                                        "supported"):
            model.backward(complex_grads, xb, yb)
        with pytest.raises(TypeError, match="grad_fn must be a callable"):
            (DDP if kind in ("ddp", "zero1") else FSDP)(init_params(1, world.rank), world,
                                                        grad_fn="f")
        return True

    assert all(run_world(body, 2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_clip_grad_norm_non_finite_as_torch_on_every_wrapper(kind, bad):
    """A NaN (inf) gradient element on one rank: the norm is NaN (inf) on every rank, every
    gradient becomes NaN (is scaled by 0 -> NaN where inf), and error_if_nonfinite refuses."""

    def poisoned(arrays, x, y):
        loss, grads = grad_fn(arrays, x, y)
        if ad.rank() == 0:
            grads[1] = grads[1].copy()
            grads[1][0] = bad
        return loss, grads

    def body(world):
        model, _ = build(kind, init_params(4, world.rank), world, with_grad_fn=poisoned)
        model.backward(*batch(4, world.rank, 0))
        with pytest.raises(NonFiniteNormError, match=f"is {bad}.*error_if_nonfinite=False"):
            model.clip_grad_norm(1.0, 2.0, True)
        norm = model.clip_grad_norm(1.0)
        assert math.isnan(norm) if math.isnan(bad) else norm == math.inf
        flat = np.concatenate([p.grad.ravel() for p in model.parameters() if p.grad is not None])
        if math.isnan(bad):  # scaled by NaN: every element NaN
            assert np.isnan(flat).all()
        else:  # scaled by 0: zeros, and inf * 0 = NaN where the inf was
            assert np.isnan(flat).sum() <= 1 and np.all(flat[~np.isnan(flat)] == 0)
        return True

    assert all(run_world(body, 2))


def test_ddp_clip_grad_norm_refuses_unaveraged_no_sync_sums():
    def body(world):
        ddp = DDP(init_params(1, world.rank), world, grad_fn=grad_fn)
        with ddp.no_sync():
            ddp.backward(*batch(1, world.rank, 0))
            with pytest.raises(RuntimeError, match="local sums from no_sync"):
                ddp.clip_grad_norm(1.0)
        with pytest.raises(RuntimeError, match="local sums from no_sync"):
            ddp.clip_grad_norm(1.0)
        ddp.backward(*batch(1, world.rank, 1))
        assert ddp.clip_grad_norm(1e9) > 0
        return True

    assert all(run_world(body, 2))


# --- examples/one_script.py ------------------------------------------------------------------

def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("one_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS = 3


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script()


@pytest.fixture(scope="module")
def thread_states(script) -> dict[str, dict[str, np.ndarray]]:
    """Each strategy's final parameters from the script's own train() (the world of this
    session: 4 threads, or the MPI world under mpiexec)."""
    size = current_size(4)
    rpn = 2 if size % 2 == 0 else 1
    return {s: ad.run(script.train, size, s, STEPS, rpn)[0]["state"] for s in script.WRAPPERS}


def test_the_script_agrees_for_every_strategy(script, thread_states):
    want = script.train_single_process(STEPS)
    for strategy, state in thread_states.items():
        assert script.max_difference(state, want) <= script.TOLERANCE, strategy
        for name in want:
            np.testing.assert_allclose(state[name], thread_states["ddp"][name], rtol=0,
                                       atol=1e-6, err_msg=f"{strategy} {name}")


@mock_only
def test_the_script_exits_non_zero_when_it_disagrees(script, monkeypatch, capsys,
                                                     started_world):
    good = script.train_single_process

    def wrong(steps):
        return {k: v + 1e-3 for k, v in good(steps).items()}

    monkeypatch.setattr(script, "train_single_process", wrong)
    assert script.main(["--strategy", "fsdp", "--world-size", "2", "--steps", "2"]) == 1
    assert "FAILED" in capsys.readouterr().out


# --- the same script under mpiexec and axondist run (subprocesses, each with a timeout) -------

MPIEXEC = Path(sys.executable).parent / "mpiexec"
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")
needs_mpi = pytest.mark.skipif(
    LAUNCHED or importlib.util.find_spec("mpi4py") is None or not MPIEXEC.exists(),
    reason="needs mpi4py and the mpiexec next to Python, and not to be under mpiexec already")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env.pop("AXONDIST_BACKEND", None)
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
                "AXONDIST_TIMEOUT": "30", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
                "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true"})
    return env


def _launch(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_the_script_under_mpiexec_matches_threads(n, tmp_path, script, thread_states):
    out = tmp_path / "final.npz"
    proc = _launch([str(MPIEXEC), "-n", str(n), sys.executable, str(SCRIPT), "--strategy",
                    *script.WRAPPERS, "--steps", str(STEPS), "--ranks-per-node", "1",
                    "--save", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(OK)") == len(script.WRAPPERS), proc.stdout
    saved = np.load(out)
    for strategy, state in thread_states.items():
        for name, value in state.items():
            np.testing.assert_allclose(saved[f"{strategy}/{name}"], value, rtol=0, atol=1e-6,
                                       err_msg=f"{strategy} {name} at {n} ranks")


@needs_mpi
def test_the_script_under_axondist_run():
    proc = _launch([sys.executable, "-m", "axondist", "run", "-n", "2", str(SCRIPT),
                    "--strategy", "zero1", "hybrid", "--steps", str(STEPS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(OK)") == 2, proc.stdout
