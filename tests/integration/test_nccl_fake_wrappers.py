"""The wrappers on the NCCL backend without a GPU (CPU stand-in ``nccl_fake``), against the
same training on the mock world with NumPy.

NCCL takes device memory only, so every small array a wrapper exchanges beside the user's
(a loss, row counts, a sample count, a presence mask, a norm term) must be made where the
backend wants it (``Backend.metadata_buffer``). Each test runs one body twice: on a world
of 1-3 fake GPUs with parameters and batches on the device, and on the mock world with
NumPy arrays, and checks that the two agree. The fake runs NCCL's calls on host memory,
so agreement is exact up to float64 rounding.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import _array, clip
from axondist.ddp import DistributedDataParallel
from axondist.errors import CollectiveMismatchError
from axondist.fsdp import FSDP, ShardingStrategy
from axondist.log import all_reduce_scalar
from axondist.optim import SGD
from axondist.pipeline import Pipeline, PipelineStage

REUSED_FIXTURE = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
TIMEOUT = 30.0


def on_nccl(body: Any, n: int, *args: Any) -> list[Any]:
    """``body(world, to_array, *args)`` on ``n`` fake GPUs, arrays made on the device."""
    from axondist.launching.worlds import spawn_on_devices

    return spawn_on_devices(body, list(range(n)), ad.to_device, *args, timeout=TIMEOUT)


def on_mock(body: Any, n: int, *args: Any) -> list[Any]:
    """``body(world, to_array, *args)`` on an ``n``-rank mock world, arrays in NumPy."""
    return ad.spawn(body, n, np.asarray, *args, timeout=TIMEOUT)


def both(body: Any, n: int, *args: Any) -> tuple[list[Any], list[Any]]:
    return on_nccl(body, n, *args), on_mock(body, n, *args)


def host(a: Any) -> np.ndarray:
    return np.array(_array.to_host(a), copy=True)


def on_device(*arrays: Any) -> None:
    for a in arrays:
        assert _array.is_cupy(a), f"{_array.describe(a)} is not on the device"


def assert_agree(got: Any, want: Any) -> None:
    if isinstance(got, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_agree(a, b)
        return
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-12, atol=1e-13)


# --- a model: 0.5 * mean((tanh(x . theta) - y)^2) ------------------------------------------

SHAPES = [(3, 4), (5,), (2, 3), ()]


def numel() -> int:
    return sum(math.prod(s) for s in SHAPES)


def init_values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 1])
    return [0.4 * rng.standard_normal(s) for s in SHAPES]


def local_batch(seed: int, rank: int, step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, rank, step, 2])
    return rng.standard_normal((rows, numel())) / math.sqrt(numel()), rng.standard_normal(rows)


def grad_fn(arrays: list[Any], x: Any, y: Any) -> tuple[float, list[Any]]:
    xp = ad.namespace(*arrays, x, y)
    theta = xp.concatenate([a.reshape(-1) for a in arrays])
    yh = xp.tanh(x @ theta)
    r = yh - y
    g = x.T @ (r * (1.0 - yh * yh)) / len(y)
    grads, off = [], 0
    for a in arrays:
        grads.append(g[off:off + a.size].reshape(a.shape))
        off += a.size
    return 0.5 * float(xp.mean(r * r)), grads


def single_process(seed: int, rows: list[int], steps: int, lr: float = 0.3) -> list[np.ndarray]:
    """Plain SGD on every rank's batch concatenated (the weighted average over samples)."""
    values = init_values(seed)
    for step in range(steps):
        parts = [local_batch(seed, r, step, k) for r, k in enumerate(rows)]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        _, grads = grad_fn(values, x, y)
        values = [v - lr * g for v, g in zip(values, grads)]
    return values


# --- DDP weighted by num_samples (an all-reduced sample count) -----------------------------

def ddp_num_samples_body(world: ad.World, to: Any, seed: int, rows: list[int],
                         overlapped: bool) -> list[np.ndarray]:
    params = [ad.Parameter(to(v), name=f"p{i}") for i, v in enumerate(init_values(seed))]
    strategy = "overlapped" if overlapped else "synchronous"
    ddp = DistributedDataParallel(params, world, grad_fn=grad_fn, strategy=strategy,
                                  bucket_cap_mb=64 / 2**20)
    opt = SGD(ddp.parameters(), lr=0.3)
    for step in range(2):
        k = rows[world.rank]
        x, y = (to(a) for a in local_batch(seed, world.rank, step, k))
        ddp.backward(x, y, num_samples=k)
        if to is ad.to_device:
            on_device(*(p.grad for p in params))
        opt.step()
        opt.zero_grad()
    ddp.close()
    return [host(p.data) for p in params]


@given(n=st.integers(1, 3), seed=st.integers(0, 2**16),
       rows=st.lists(st.integers(1, 4), min_size=3, max_size=3), overlapped=st.booleans())
@settings(max_examples=6, deadline=None, suppress_health_check=REUSED_FIXTURE)
def test_ddp_num_samples_equals_mock_and_one_process(fake, n, seed, rows, overlapped):
    rows = rows[:n]
    got, want = both(ddp_num_samples_body, n, seed, rows, overlapped)
    assert_agree(got, want)
    for values in want:
        assert_agree(values, single_process(seed, rows, 2))


# --- DDP missing_grad="error" (an all-gathered presence mask) -----------------------------

def ddp_presence_body(world: ad.World, to: Any, seed: int, lacking: int | None) -> Any:
    """Parameter 1 has no gradient on any rank (kept None); with ``lacking`` set, parameter 2
    has none on that rank only (an error on every rank)."""
    params = [ad.Parameter(to(v), name=f"p{i}") for i, v in enumerate(init_values(seed))]
    ddp = DistributedDataParallel(params, world, missing_grad="error")
    x, y = (to(a) for a in local_batch(seed, world.rank, 0, 3))
    _, grads = grad_fn([p.data for p in params], x, y)
    for i, (p, g) in enumerate(zip(params, grads)):
        skip = i == 1 or (i == 2 and world.rank == lacking)
        p.grad = None if skip else g
    try:
        ddp.sync_gradients()
    except CollectiveMismatchError as exc:
        ddp.close()
        return str(exc)
    ddp.close()
    assert params[1].grad is None
    return [host(p.grad) for i, p in enumerate(params) if i != 1]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ddp_missing_grad_error_passes_when_ranks_agree(fake, n):
    got, want = both(ddp_presence_body, n, 5, None)
    assert_agree(got, want)


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_missing_grad_error_names_the_lacking_rank_on_every_rank(fake, n):
    got, want = both(ddp_presence_body, n, 5, n - 1)
    assert got == want  # every rank raised, with the mock world's text
    for text in got:
        assert re.search(rf"parameter 2 \(p2\) has no gradient on ranks \[{n - 1}\]", text), text
        assert "DistributedDataParallel.sync_gradients: ranks disagree" in text
        assert "missing_grad='zeros'" in text


# --- the pipeline: row counts all-gathered, the loss broadcast, clipping ------------------

def affine_tanh(params: list[Any], x: Any) -> tuple[Any, Any]:
    w, b = params
    y = ad.namespace(w, x).tanh(x @ w + b)
    return y, (x, y)


def affine_tanh_bwd(params: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
    w, _ = params
    x, y = saved
    gz = gy * (1.0 - y * y)
    return gz @ w.T, [x.T @ gz, gz.sum(axis=0)]


def square(params: list[Any], x: Any) -> tuple[Any, Any]:
    """A stage without parameters: elementwise x**2 (its rank holds no gradients)."""
    return x * x, x


def square_bwd(params: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
    return 2.0 * saved * gy, []


def mse(y: Any, t: Any) -> tuple[float, Any]:
    d = y - t
    return 0.5 * float(ad.namespace(d).sum(d * d)) / y.shape[0], d / y.shape[0]


def pipeline_body(world: ad.World, to: Any, seed: int, micro: int, bare: int | None,
                  max_norm: float, kind: str = "1f1b"
                  ) -> tuple[list[float], list[float], list[np.ndarray]]:
    """``chunks`` stages per rank (2 for an interleaved ``kind``), rank ``bare``'s without
    parameters; two train steps, each clipped."""
    n, r = world.world_size, world.rank
    chunks = 2 if kind.startswith("interleaved") else 1
    d = 3
    stages = []
    for s in (c * n + r for c in range(chunks)):
        rng = np.random.default_rng([seed, s, 3])
        stages.append(PipelineStage(square, square_bwd) if r == bare else PipelineStage(
            affine_tanh, affine_tanh_bwd,
            [ad.Parameter(to(rng.standard_normal((d, d)) / 2), f"W{s}"),
             ad.Parameter(to(0.1 * rng.standard_normal(d)), f"b{s}")]))
    last = (n * chunks - 1) % n
    pipe = Pipeline(stages, world, num_microbatches=micro, schedule=kind, chunks=chunks)
    opt = SGD(pipe, lr=0.1) if r != bare else None  # SGD refuses an empty parameter list
    losses, norms = [], []
    for step in range(2):
        data = np.random.default_rng([seed, step, 4])
        x, t = (to(data.standard_normal((2 * micro + 1, d))) for _ in range(2))
        losses.append(pipe.train_step(x if r == 0 else None, t if r == last else None, mse))
        norms.append(pipe.clip_grad_norm(max_norm))
        if opt is not None:
            opt.step()
            opt.zero_grad()
    pipe.close()
    return losses, norms, [host(p.data) for stage in stages for p in stage.params]


@given(n=st.integers(1, 3), seed=st.integers(0, 2**16), micro=st.integers(1, 3),
       max_norm=st.sampled_from([0.05, 100.0]),
       kind=st.sampled_from(["1f1b", "gpipe", "interleaved_1f1b"]))
@settings(max_examples=8, deadline=None, suppress_health_check=REUSED_FIXTURE)
def test_pipeline_loss_on_every_rank_equals_mock(fake, n, seed, micro, max_norm, kind):
    if kind.startswith("interleaved"):
        micro = max(micro, n)  # interleaved schedules need at least one microbatch per rank
    got, want = both(pipeline_body, n, seed, micro, None, max_norm, kind)
    assert_agree(got, want)
    assert all(losses == got[0][0] for losses, _, _ in got)  # the same loss on every rank
    assert all(math.isfinite(v) for v in got[0][0])


@pytest.mark.parametrize("n, bare", [(2, 0), (2, 1), (3, 1)])
def test_pipeline_clip_with_a_rank_without_gradients_equals_mock(fake, n, bare):
    got, want = both(pipeline_body, n, 7, 2, bare, 0.05)
    assert_agree(got, want)
    assert got[bare][2] == []
    norms = [norm for _, norm_list, _ in got for norm in norm_list]
    assert all(math.isfinite(v) and v > 0.05 for v in norms)  # so the clipping scaled


def clip_body(world: ad.World, to: Any, values: list[list[float]], norm_type: float
              ) -> tuple[float, list[np.ndarray]]:
    """The clip every wrapper runs (axondist.clip), some ranks without gradients."""
    grads = [to(np.array(v)) for v in values[world.rank] if v]
    norm = clip.clip_grad_norm(grads, 1.0, norm_type, group=world)
    return norm, [host(g) for g in grads]


@given(n=st.integers(2, 3), norm_type=st.sampled_from([2.0, 1.0, 3.0, math.inf]),
       values=st.lists(st.lists(st.floats(-10, 10), max_size=4), min_size=3, max_size=3))
@settings(max_examples=8, deadline=None, suppress_health_check=REUSED_FIXTURE)
def test_clip_grad_norm_where_ranks_lack_gradients_equals_mock(fake, n, norm_type, values):
    got, want = both(clip_body, n, values, norm_type)
    assert_agree(got, want)
    flat = np.abs([x for v in values[:n] for x in v] or [0.0])
    norm = flat.max() if math.isinf(norm_type) else (flat ** norm_type).sum() ** (1 / norm_type)
    assert got[0][0] == pytest.approx(norm, rel=1e-12)


# --- FSDP clip_grad_norm under CPU offload (host shard gradients) -------------------------

def fsdp_clip_body(world: ad.World, to: Any, seed: int, offload: str, norm_type: float,
                   max_norm: float) -> tuple[list[float], list[np.ndarray]]:
    params = [ad.Parameter(to(v), name=f"p{i}") for i, v in enumerate(init_values(seed))]
    f = FSDP(params, world, sharding_strategy=ShardingStrategy.FULL_SHARD, cpu_offload=offload,
             units=[[0, 1], [2, 3]])
    opt = SGD(f.sharded_parameters(), lr=0.3)
    norms = []
    for step in range(2):
        x, y = (to(a) for a in local_batch(seed, world.rank, step, 3))
        f.backward(grad_fn, x, y)
        if offload != "none":  # the shard gradients the norm is taken of rest on the host
            assert all(type(s.grad) is np.ndarray for s in f.sharded_parameters())
        norms.append(f.clip_grad_norm(max_norm, norm_type))
        opt.step()
        opt.zero_grad()
    state = f.state_dict()
    return norms, [state[f"p{i}"] for i in range(len(SHAPES))]


@given(n=st.integers(2, 3), seed=st.integers(0, 2**16),
       offload=st.sampled_from(["params", "full", "none"]),
       norm_type=st.sampled_from([2.0, 1.0, math.inf]), max_norm=st.sampled_from([0.01, 50.0]))
@settings(max_examples=8, deadline=None, suppress_health_check=REUSED_FIXTURE)
def test_fsdp_clip_grad_norm_with_cpu_offload_equals_mock(fake, n, seed, offload, norm_type,
                                                          max_norm):
    got, want = both(fsdp_clip_body, n, seed, offload, norm_type, max_norm)
    assert_agree(got, want)


# --- log.all_reduce_scalar -----------------------------------------------------------------

def scalar_body(world: ad.World, to: Any, values: list[float], op: str) -> float:
    return all_reduce_scalar(values[world.rank], op)


@given(n=st.integers(1, 3), values=st.lists(st.floats(-1e3, 1e3), min_size=3, max_size=3),
       op=st.sampled_from(["mean", "sum", "max", "min"]))
@settings(max_examples=6, deadline=None, suppress_health_check=REUSED_FIXTURE)
def test_all_reduce_scalar_equals_mock(fake, n, values, op):
    got, want = both(scalar_body, n, values, op)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert len(set(got)) == 1


# --- the mechanism ------------------------------------------------------------------------

def metadata_body(world: ad.World, to: Any) -> tuple[bool, bool, list[int]]:
    values = np.arange(3, dtype=np.int64) + world.rank
    buf = world.backend.metadata_buffer(values)
    on_gpu = _array.is_cupy(buf)
    same_device = not on_gpu or buf.device.id == world.backend.device
    ad.all_reduce(buf, "sum")
    return on_gpu, same_device, _array.to_host(buf).tolist()


def test_metadata_buffer_is_on_the_backends_gpu_under_nccl_and_the_array_itself_on_mock(fake):
    got, want = both(metadata_body, 3)
    assert all(on_gpu and same for on_gpu, same, _ in got)
    assert not any(on_gpu for on_gpu, _, _ in want)
    assert [v for _, _, v in got] == [v for _, _, v in want] == [[3, 6, 9]] * 3
    values = np.zeros(2)
    assert ad.spawn(lambda w: w.backend.metadata_buffer(values) is values, 2) == [True, True]


# --- failure: a stage that raises on one rank of an NCCL pipeline --------------------------

_RAISING_PIPELINE = """
import sys
sys.path[:0] = [{root!r}, {support!r}]
import numpy as np
import nccl_fake


nccl_fake.install_for_process(device_count=4)
import axondist as ad
from axondist.launching.worlds import spawn_on_devices
from axondist.pipeline import Pipeline, PipelineStage


def body(world):
    def fwd(params, x):
        if world.rank == world.world_size - 1:
            raise ValueError(f"stage boom on rank {{world.rank}}")
        return x @ params[0], x

    def bwd(params, x, gy):
        return gy @ params[0].T, [x.T @ gy]

    stage = PipelineStage(fwd, bwd, [ad.Parameter(ad.to_device(np.eye(2)), "w")])
    pipe = Pipeline([stage], world, num_microbatches=2)
    x = ad.to_device(np.ones((4, 2)))
    pipe.train_step(x, x, lambda y, t: (0.0, y - t))


try:
    spawn_on_devices(body, list(range({n})), timeout=10.0)
except Exception as exc:
    print("RAISED", type(exc).__name__, str(exc).splitlines()[0])
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize("n", [2, 3])
def test_a_stage_raising_on_one_rank_ends_every_rank_of_an_nccl_pipeline(n):
    """The others wait in a receive (and the send thread in a send) that can never complete:
    the run must end with the stage's error, not hang (a subprocess, in case it does)."""
    code = _RAISING_PIPELINE.format(root=str(Path(__file__).resolve().parents[2]),
                                    support=str(_SUPPORT), n=n)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items()
                                           if not k.startswith(("PMI_", "HYDI_", "MPI"))})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RAISED ValueError stage boom on rank {n - 1}" in out.stdout, out.stdout + out.stderr


def sweep_body(world: ad.World, to: Any) -> list[tuple[int, bool]]:
    from axondist.tune import sweep

    return [(point.nbytes, point.seconds > 0) for point in sweep(world, [4, 4096], repeats=2)]


def test_the_tune_sweep_runs_on_nccl(fake):
    got, want = both(sweep_body, 2)
    assert got == want == [[(4, True), (4096, True)]] * 2


# --- the real-data examples with --device gpu -------------------------------------------------

_EXAMPLE_ON_STAND_IN = """
import runpy, sys
sys.path[:0] = [{root!r}, {support!r}]
import nccl_fake
nccl_fake.install_for_process(device_count={gpus})
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_SUPPORT = _EXAMPLES.parent / "tests" / "support"  # nccl_fake, the CPU stand-in
_NO_LAUNCHER = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_", "OMPI_", "SLURM_")


def _example_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_NO_LAUNCHER)}


@pytest.mark.parametrize("script, args, verdict", [
    ("char_lm.py", ["--steps", "3"], "loss curves equal single-process training at every "
                                     "step: yes"),
    ("digits_ddp_fsdp.py", ["--epochs", "2"], "matches single-process training: yes"),
])
@pytest.mark.parametrize("gpus, ranks", [(2, 2), (2, 3)], ids=["nccl", "mock-world-on-cupy"])
def test_real_data_examples_train_on_cupy_arrays_on_the_stand_in(script, args, verdict, gpus,
                                                                 ranks):
    """``--device gpu`` on two stand-in GPUs: two ranks run on NCCL (which refuses NumPy
    arrays, so every exchanged array was a device array), three on the in-process world
    with CuPy arrays; either way the example's own check against one process passes."""
    if script.startswith("digits"):
        pytest.importorskip("sklearn")
    argv = [str(_EXAMPLES / script), "--device", "gpu", "--world-size", str(ranks), *args]
    code = _EXAMPLE_ON_STAND_IN.format(root=str(_EXAMPLES.parent), support=str(_SUPPORT),
                                       gpus=gpus, argv=argv)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=_example_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert verdict in out.stdout, out.stdout
    if script == "char_lm.py":
        assert re.search(r"^1 process .* gpu$", out.stdout, re.MULTILINE), out.stdout


@pytest.mark.parametrize("script", ["char_lm.py", "digits_ddp_fsdp.py"])
def test_real_data_examples_say_what_a_gpu_run_lacks(script):
    if script.startswith("digits"):
        pytest.importorskip("sklearn")
    code = ("import runpy, sys; sys.modules['cupy'] = None; "  # as where CuPy is missing
            f"sys.argv = [{str(_EXAMPLES / script)!r}, '--device', 'gpu']; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=_example_env())
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{script}: --device gpu needs CuPy and a CUDA GPU, and this machine has none " \
        "usable (ModuleNotFoundError: import of cupy halted; None in sys.modules). Install " \
        "CuPy from the checkout with pip install '.[gpu-cuda13]' (CUDA 13) or '.[gpu]' " \
        "(CUDA 12): the \"CUDA Version\" that nvidia-smi prints says which; or run with " \
        "--device cpu." \
        in out.stderr, out.stderr
