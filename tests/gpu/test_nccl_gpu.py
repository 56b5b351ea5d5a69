"""The NCCL backend on real GPUs, checked against NumPy references on the host.

Skipped (cleanly, at collection) without CuPy, without NCCL or without a
CUDA device. With one GPU the world has one rank; with more, the collective
tests run once more over every visible GPU (one thread per GPU,
``spawn_on_devices``). Every rank derives all ranks' inputs from seeds, so
each computes the reference itself.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import why_no_gpu

import axondist as ad
from axondist import _array
from axondist.backends.nccl import basics as nt
from axondist.errors import RankError, UnsupportedDTypeError
from axondist.ops import ReduceOp, combine_into

REASON = why_no_gpu(need_nccl=True)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def _device_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _world_sizes() -> list[int]:
    if REASON is not None:
        return [1]
    n = _device_count()
    return [1] if n == 1 else [1, n]


def _cupy_has_bfloat16() -> bool:
    import cupy

    try:
        x = cupy.asarray(np.array([1.5], _array.bfloat16))
        return x.dtype == _array.bfloat16 and float(x.get()[0]) == 1.5
    except Exception:  # CuPy < 14 has no bfloat16
        return False


def spawn(body, world_size, *args):
    from axondist.launching.worlds import spawn_on_devices

    return spawn_on_devices(body, list(range(world_size)), *args, timeout=120.0)


def values(rng: np.random.Generator, dtype: np.dtype, shape) -> np.ndarray:
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -3, 4, shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.uniform(-2, 2, shape) + 1j * rng.uniform(-2, 2, shape)).astype(dtype)
    return rng.uniform(0.5, 2.0, shape).astype(dtype)


def close(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind in "fc" or want.dtype == _array.bfloat16:
        tol = 3e-2 if want.dtype.itemsize <= 2 else 1e-5
        kind = np.complex128 if want.dtype.kind == "c" else np.float64
        np.testing.assert_allclose(got.astype(kind), want.astype(kind), rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def _dtypes() -> list[np.dtype]:
    return [d for d in _array.SUPPORTED_DTYPES
            if d != _array.bfloat16 or (REASON is None and _cupy_has_bfloat16())]


# --- every collective and op against NumPy -----------------------------------------------

def _reductions_body(world, seed):
    n, r = world.world_size, world.rank
    checked = 0
    version = world.backend.nccl_version()
    for dtype in _dtypes():
        for op in ReduceOp:
            try:
                nt.reduce_plan(dtype, op, version, "t")
            except UnsupportedDTypeError:
                continue
            inputs = [values(np.random.default_rng([seed, k]), dtype, (5, 3)) for k in range(n)]
            x = ad.to_device(inputs[r])
            assert ad.all_reduce(x, op) is x
            close(x.get(), combine_into(inputs[0].copy(), inputs, op))
            rows = [values(np.random.default_rng([seed, k, 1]), dtype, (2 * n + 1, 2))
                    for k in range(n)]
            part = ad.reduce_scatter(ad.to_device(rows[r]), op)
            close(part.get(), np.array_split(combine_into(rows[0].copy(), rows, op), n)[r])
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", _world_sizes())
def test_all_reduce_and_reduce_scatter_every_op_and_dtype(world_size):
    checked = spawn(_reductions_body, world_size, 5)
    assert checked[0] >= 30


def _movement_body(world, seed):
    n, r = world.world_size, world.rank
    for dtype in _dtypes():
        data = [values(np.random.default_rng([seed, k]), dtype, (k + 2, 3)) for k in range(n)]
        close(ad.all_gather(ad.to_device(data[r])).get(), np.concatenate(data))
        for root in range(n):
            b = ad.to_device(values(np.random.default_rng([seed, r, 9]), dtype, (4,)))
            want = values(np.random.default_rng([seed, root, 9]), dtype, (4,))
            close(ad.broadcast(b, src=root).get(), want)
            got = ad.gather_tensor(ad.to_device(data[r]), dst=root)
            if r == root:
                close(got.get(), np.concatenate(data))
            else:
                assert got is None
            full = values(np.random.default_rng([seed, 7]), dtype, (3 * n + 1, 2))
            part = ad.scatter_tensor(ad.to_device(full) if r == root else None, src=root)
            close(part.get(), np.array_split(full, n)[r])
    if n > 1:
        nxt, prv = (r + 1) % n, (r - 1) % n
        msg = np.arange(6.0) * (r + 1)
        if r % 2 == 0:
            ad.send(ad.to_device(msg), nxt)
            got = ad.recv(prv)
        else:
            got = ad.recv(prv)
            ad.send(ad.to_device(msg), nxt)
        close(got.get(), np.arange(6.0) * (prv + 1))
    b = world.backend
    assert b.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    assert b.broadcast_object({"x": r} if r == 0 else None, 0) == {"x": 0}
    ad.barrier()
    return True


@pytest.mark.parametrize("world_size", _world_sizes())
def test_gathers_scatters_broadcasts_send_recv_objects(world_size):
    assert all(spawn(_movement_body, world_size, 3))


# --- one process, one GPU: bootstrap, streams, async handles, groups --------------------------

def test_backend_basics_and_tables_match_cupy(world):
    from cupy.cuda import nccl

    b = world.backend
    major, minor, patch = b.nccl_version()
    assert major >= 2 and (major, minor, patch) == nt.parse_nccl_version(nccl.get_version())
    assert b.node_info() == (0, 0, 1) and b.name == "nccl"
    for name, code in nt.NCCL_DTYPES.items():
        const = getattr(nccl, f"NCCL_{name.upper()}", None)
        assert const is None or const == code
    for name, code in nt.NCCL_OPS.items():
        const = getattr(nccl, f"NCCL_{name.upper()}", None)
        assert const is None or const == code


def test_two_ranks_on_one_gpu_are_refused_naming_the_gpu():
    """Two ranks that chose GPU 0 are refused before NCCL starts (NCCL would fail with a
    bare ncclInvalidUsage), the GPU named by the UUID CUDA reports."""
    import socket
    import threading

    import cupy

    from axondist.backends.nccl import bootstrap_from_env
    from axondist.backends.nccl.runtime import gpu_identity
    from axondist.backends.rendezvous import LaunchEnv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors: list[BaseException | None] = [None, None]

    def rank_main(r: int) -> None:
        try:
            bootstrap_from_env(LaunchEnv("127.0.0.1", port, 2, r, r), timeout=30.0, device=0)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gpu = gpu_identity(cupy, 0)
    assert gpu.startswith(("GPU-", "PCI ")), gpu
    count = _device_count()
    for exc in errors:
        assert isinstance(exc, RankError), errors
        assert f"ranks 0 and 1 on host {socket.gethostname()} chose the same GPU (device 0, " \
            f"{gpu}) of the host's {count} GPU" in str(exc)


def test_work_waits_for_the_callers_stream_and_hands_back_to_another(world):
    import cupy

    n = 1 << 22
    user = cupy.cuda.Stream(non_blocking=True)
    with user:
        x = cupy.zeros(n, dtype=cupy.float32)
        for _ in range(40):  # slow work queued on the user's stream: the gather must see it all
            x += 1
        work = ad.all_gather(x, world, sizes=[n], async_op=True)
    out = work.wait()
    assert work.is_completed()
    close(out.get(), np.full(n, 40, np.float32))
    other = cupy.cuda.Stream(non_blocking=True)
    with user:
        x *= 2
        out2 = cupy.empty_like(x)
        w2 = world.backend.all_gather(x, out2, [n], async_op=True)  # an NcclWork
    w2.wait_stream(other)  # no host wait: the other stream waits on the GPU
    with other:
        z = out2 + 1
    other.synchronize()
    close(z.get(), np.full(n, 81, np.float32))
    x16 = cupy.asarray(np.array([0.25, 3.0], np.float32))
    work = ad.all_reduce(x16, ReduceOp.AVERAGE, group=world, async_op=True)
    assert work.wait() is x16
    world.backend.synchronize()


def test_grouped_bucket_of_all_reduces(world):
    import cupy

    xs = [cupy.full(k + 1, k, dtype=cupy.float64) for k in range(16)]
    with world.backend.grouped():
        works = [ad.all_reduce(x, "sum", group=world, async_op=True) for x in xs]
    for k, (w, x) in enumerate(zip(works, xs)):
        assert w.wait() is x
        close(x.get(), np.full(k + 1, k, np.float64))


def test_subgroup_of_one(world):
    import cupy

    sub = world.new_group([0])
    assert sub.is_member and sub.world_size == 1
    x = cupy.asarray(np.array([1.0, 2.0], np.float32))
    ad.all_reduce(x, ReduceOp.MAX, group=sub)
    close(x.get(), np.array([1.0, 2.0], np.float32))
    sub.backend.close()


def test_float16_and_bfloat16(world):
    import cupy

    x16 = cupy.asarray(np.array([0.5, 1.5, -2.0], np.float16))
    ad.all_reduce(x16, ReduceOp.AVERAGE, group=world)
    close(x16.get(), np.array([0.5, 1.5, -2.0], np.float16))
    if not _cupy_has_bfloat16():
        pytest.skip("this CuPy has no bfloat16 arrays (CuPy >= 14 with ml_dtypes has)")
    bf = cupy.asarray(np.array([0.5, 1.25, -3.0], _array.bfloat16))
    if world.backend.nccl_version() < (2, 10, 0):
        with pytest.raises(UnsupportedDTypeError, match="NCCL >= 2.10"):
            ad.all_reduce(bf, group=world)
    else:
        ad.all_reduce(bf, ReduceOp.SUM, group=world)
        close(bf.get(), np.array([0.5, 1.25, -3.0], _array.bfloat16))


def test_numpy_arrays_are_refused(world):
    with pytest.raises(TypeError, match="all_reduce: .*axondist.to_device"):
        ad.all_reduce(np.ones(3, np.float32), group=world)


# --- no hang, no silent wrong number: the check, the flight recorder, the watchdog -----------

def test_the_flight_recorder_lists_each_call_once_the_gpu_finished_it(world):
    import cupy

    ad.barrier(world)
    x = cupy.ones((64, 2), dtype=cupy.float32)
    work = ad.all_reduce(x, ReduceOp.MAX, group=world, async_op=True)
    work.wait()
    dump = ad.flight_recorder(world, last=2)
    assert [(e["op"], e["blocking"], e["state"]) for e in dump] == \
        [("barrier", True, "done"), ("all_reduce", False, "done")], dump
    assert dump[1]["detail"] == "dtype=float32, shape=[64, 2], reduce_op=MAX"
    assert dump[1]["seq"] == dump[0]["seq"] + 1 and dump[1]["group"] == "world"


def _two_gpus() -> list[int]:
    if _device_count() < 2:
        pytest.skip("needs two GPUs (NCCL refuses two ranks on one GPU)")
    return [0, 1]


def _mismatch_body(world):
    import cupy

    r = world.rank
    errors = []
    same_bytes = cupy.ones(2, cupy.float32) if r == 0 else cupy.ones(1, cupy.float64)
    for call in (lambda: ad.all_reduce(same_bytes),
                 lambda: ad.all_reduce(cupy.ones(4), "sum" if r == 0 else "max")):
        with pytest.raises(ad.CollectiveMismatchError) as e:
            call()
        errors.append(str(e.value))
    x = cupy.full(3, r + 1.0)
    ad.all_reduce(x)  # blocking calls that disagree leave the communicator in step
    return errors, x.get().tolist()


def test_mismatched_dtype_and_op_raise_on_every_gpu_before_data_moves():
    from axondist.launching.worlds import spawn_on_devices

    results = spawn_on_devices(_mismatch_body, _two_gpus(), timeout=120.0)
    for errors, value in results:
        assert errors == ["all_reduce: ranks disagree on dtype (rank 0: float32, rank 1: float64)",
                          "all_reduce: ranks disagree on reduce_op (rank 0: SUM, rank 1: MAX)"]
        assert value == [3.0, 3.0, 3.0]


_FAULT = """
import sys, time
import numpy as np
import axondist as ad
from axondist.launching.worlds import spawn_on_devices

def body(world):
    import cupy
    ad.barrier()
    if world.rank == 1:
        if {case!r} == "stuck":
            time.sleep(8)  # in its own code: it skips the all_reduce
        return None  # "left": it returns while rank 0 waits
    return ad.all_reduce(cupy.ones(1 << 20, cupy.float32)).get()

start = time.monotonic()
try:
    spawn_on_devices(body, [0, 1], timeout={timeout!r})
except Exception as exc:
    print("ERROR", type(exc).__name__, round(time.monotonic() - start, 1))
    print(exc)
    sys.exit(1)
print("no error")
"""


def _prelude() -> str:
    """What a child process runs first: the CPU stand-in, when this file runs on it."""
    fake = sys.modules.get("nccl_fake")
    if fake is None:
        return ""
    return (f"import sys\nsys.path.insert(0, {str(Path(fake.__file__).parent)!r})\n"
            "import nccl_fake\n"
            f"nccl_fake.install_for_process(device_count={fake.SETTINGS.device_count})\n")


def _run_fault(case: str, timeout: float) -> str:
    _two_gpus()
    script = _prelude() + _FAULT.format(case=case, timeout=timeout)
    env = dict(os.environ, AXONDIST_STALL_WARNING="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=180, env=env, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_a_gpu_that_skips_a_collective_times_out_with_the_watchdogs_report():
    text = _run_fault("stuck", 4.0)
    assert "ERROR CollectiveTimeoutError" in text, text
    assert "all_reduce: not completed within 4 s on rank 0 of 2 (GPU 0); the watchdog aborted " \
        "this rank's NCCL communicators (ncclCommAbort)" in text
    assert "missing ranks: [1]" in text
    assert "its last completed call was barrier #1 on world" in text
    assert "last calls of rank 0 (flight recorder, oldest first):" in text
    assert "[axondist rank 0/2] stall: rank 0 has waited" in text


def test_a_gpu_that_left_is_named_long_before_the_timeout():
    text = _run_fault("left", 120.0)
    assert "ERROR RankExitedError" in text, text
    assert "left after barrier #1 on world" in text
    assert float(text.split("ERROR RankExitedError ")[1].split()[0]) < 120.0


# --- several GPUs from one thread ----------------------------------------------------------------

def test_one_thread_drives_every_gpu_with_group_calls():
    import cupy

    from axondist.backends.nccl import NcclBackend, group_calls

    n = _device_count()
    if n < 2:
        pytest.skip("needs two GPUs")
    backends = NcclBackend.create_world(list(range(n)))
    inputs = [np.random.default_rng(k).standard_normal(1000).astype(np.float32) for k in range(n)]
    xs = []
    for b, h in zip(backends, inputs):
        with cupy.cuda.Device(b.device):
            xs.append(cupy.asarray(h))
    with group_calls():
        for b, x in zip(backends, xs):
            b.all_reduce(x, ReduceOp.SUM)
    want = combine_into(inputs[0].copy(), inputs, ReduceOp.SUM)
    for x in xs:
        close(x.get(), want)
    for b in backends:
        b.close()


def test_benchmark_runs_a_quick_pass():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_nccl.py"
    spec = importlib.util.spec_from_file_location("bench_nccl_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results, is_rank0 = bench.run([1 << 20, 4 << 20], iters=3, warmup=1, devices=None)
    assert is_rank0 and len(results["all_reduce"]) == 2
    for row in results["all_reduce"]:
        assert row["algbw_GBps"] > 0 and row["busbw_GBps"] >= 0
