"""The NCCL backend without a GPU: tables, plans, ids, bootstrap, rendezvous, and the
backend's own logic on a CPU stand-in for CuPy (``nccl_fake``).

The fake runs NCCL's calls synchronously on host memory, so these tests check
what the backend asks NCCL to do (pointers, byte counts, dtype/op codes,
roots, grouping, ids) and the results, not CUDA stream ordering; the tests
in tests/gpu/test_nccl_gpu.py do that on a real GPU. The last section checks
the no-hang contract: the cross-rank check before each collective, the
flight recorder, and the watchdog's stall warnings, timeout abort and
departure detection (the cases that could hang run in subprocesses).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import _array
from axondist.backends.nccl import basics as nt
from axondist.backends.rendezvous import (
    KeyValueClient,
    KeyValueServer,
    LaunchEnv,
    RendezvousError,
    allgather_over_rendezvous,
    exchange_from_rank0,
)
from axondist.errors import (
    AxondistError,
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidBufferError,
    RankError,
    UnsupportedDTypeError,
)
from axondist.ops import ReduceOp, check_op_dtype, combine_into

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"  # nccl_fake, the CPU stand-in
MODERN, OLD = (2, 19, 3), (2, 9, 9)
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_", "SLURM_", "MPIR_")


def child_env() -> dict[str, str]:
    """This environment minus MPI launcher variables (tests may themselves run under mpiexec)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_values(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    """Values of ``dtype`` small enough that products and sums stay exact-ish."""
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -3, 4, n).astype(dtype)
    if dtype.kind == "c":
        return (rng.uniform(-2, 2, n) + 1j * rng.uniform(-2, 2, n)).astype(dtype)
    return rng.uniform(0.5, 2.0, n).astype(dtype)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if _array.is_floating(want.dtype) or want.dtype.kind == "c":
        tol = 2e-2 if want.dtype.itemsize <= 2 or want.dtype.name == "bfloat16" else 1e-5
        kind = np.complex128 if want.dtype.kind == "c" else np.float64
        np.testing.assert_allclose(got.astype(kind), want.astype(kind), rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


# --- import and availability ---------------------------------------------------------

def test_importing_the_backend_imports_neither_cupy_nor_mpi4py():
    code = ("import sys, axondist, axondist.backends.nccl, axondist.backends.rendezvous; "
            "print(sorted(m for m in ('cupy', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60, env=child_env())
    assert out.stdout.strip() == "[]"


def test_without_cupy_every_entry_point_says_what_to_install(monkeypatch):
    from axondist.backends import nccl

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    calls = [nccl.NcclBackend.generate_unique_id,
             lambda: nccl.NcclBackend(bytes(128), 0, 1, 0),
             lambda: nccl.NcclBackend.create_world([0]),
             nccl.create_world_backend,
             lambda: ad.init("nccl")]
    for call in calls:
        with pytest.raises(BackendUnavailableError, match=r"from the axondist checkout, pip "
                           r"install '\.\[gpu-cuda13\]' \(cupy-cuda13x\) for CUDA 13, or pip "
                           r"install '\.\[gpu\]' \(cupy-cuda12x\) for CUDA 12; the \"CUDA "
                           r"Version\" that nvidia-smi prints says which") as e:
            call()
        assert isinstance(e.value, ImportError)


# --- tables and plans ------------------------------------------------------------------

def test_dtype_and_op_codes_are_ncclh_enums():
    # nccl.h: ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64,
    # ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16 = 0..9; ncclSum..ncclAvg = 0..4
    order = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
             "float64", "bfloat16"]
    assert nt.NCCL_DTYPES == {name: code for code, name in enumerate(order)}
    assert nt.NCCL_OPS == {name: code for code, name in enumerate(["sum", "prod", "max", "min",
                                                                   "avg"])}
    assert nt.NCCL_BYTE == nt.NCCL_DTYPES["uint8"]
    assert nt.NCCL_RESULTS[6][0] == "ncclRemoteError" and all(
        nt.NCCL_RESULTS[c][0].startswith("nccl") for c in nt.NCCL_RESULTS)
    for name in nt.NCCL_DTYPES:
        assert np.dtype(_array.dtype_named(name)).itemsize in (1, 2, 4, 8)


def _nccl_reduce(arrays: list[np.ndarray], op_code: int) -> np.ndarray:
    """An independent model of what NCCL computes for one ncclRedOp_t."""
    wide = [a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16"
            else a for a in arrays]
    out = wide[0].copy()
    for a in wide[1:]:
        out = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}[op_code](out, a)
    if op_code == 4:
        out = out / len(arrays)
    return out.astype(arrays[0].dtype)


@given(dtype=st.sampled_from(_array.SUPPORTED_DTYPES), op=st.sampled_from(list(ReduceOp)),
       version=st.sampled_from([MODERN, OLD]), n=st.integers(1, 4), seed=st.integers(0, 99))
@settings(max_examples=150)
def test_reduce_plan_computes_what_reduce_op_means(dtype, op, version, n, seed):
    try:
        check_op_dtype(op, dtype, "t")
    except UnsupportedDTypeError:
        with pytest.raises(UnsupportedDTypeError):
            nt.reduce_plan(dtype, op, version, "t")
        return
    expect_refusal = (dtype.kind == "c" and op is ReduceOp.PRODUCT) or (
        dtype.name == "bfloat16" and version < (2, 10, 0))
    if expect_refusal:
        with pytest.raises(UnsupportedDTypeError, match="t: "):
            nt.reduce_plan(dtype, op, version, "t")
        return
    plan = nt.reduce_plan(dtype, op, version, "t")
    assert (plan.nccl_op == nt.NCCL_OPS["avg"]) == (op is ReduceOp.AVERAGE and version >= (2, 10))
    assert plan.divide_by_size == (op is ReduceOp.AVERAGE and version < (2, 10))
    rng = np.random.default_rng(seed)
    inputs = [random_values(rng, dtype, 6) for _ in range(n)]
    as_nccl = np.dtype(_array.dtype_named(
        {c: name for name, c in nt.NCCL_DTYPES.items()}[plan.nccl_dtype]))
    views = [x.view(as_nccl) for x in inputs]
    assert views[0].size == inputs[0].size * plan.count_factor
    got = _nccl_reduce(views, plan.nccl_op).view(dtype)
    if plan.divide_by_size:
        got = (got / n).astype(dtype)
    want = combine_into(inputs[0].copy(), [x.copy() for x in inputs], op)
    assert_close(got, want)


@given(major=st.integers(2, 4), minor=st.integers(0, 99), patch=st.integers(0, 99))
def test_parse_nccl_version_new_encoding(major, minor, patch):
    assert nt.parse_nccl_version(major * 10000 + minor * 100 + patch) == (major, minor, patch)


@given(minor=st.integers(0, 8), patch=st.integers(0, 99))
def test_parse_nccl_version_old_encoding(minor, patch):
    assert nt.parse_nccl_version(2000 + minor * 100 + patch) == (2, minor, patch)
    with pytest.raises(ValueError):
        nt.parse_nccl_version(-1)


@given(raw=st.binary(min_size=128, max_size=128))
def test_unique_id_round_trips(raw):
    uid = nt.NcclUniqueId(raw)
    signed = uid.to_cupy()
    assert len(signed) == 128 and all(-128 <= v <= 127 for v in signed)
    assert nt.NcclUniqueId.from_cupy(signed) == uid
    assert nt.NcclUniqueId.from_hex(uid.hex()) == uid
    assert pickle.loads(pickle.dumps(uid)) == uid
    for form in (uid, raw, bytearray(raw), uid.hex(), signed, list(signed)):
        assert nt.NcclUniqueId.coerce(form) == uid


def test_unique_id_rejects_wrong_lengths_and_types():
    with pytest.raises(ValueError, match="128 bytes, got 3 bytes"):
        nt.NcclUniqueId(b"abc")
    with pytest.raises(TypeError, match="NcclUniqueId"):
        nt.NcclUniqueId.coerce(1.5)


def test_nccl_error_names_the_operation_status_and_remedy():
    class CupyNcclError(RuntimeError):
        def __init__(self, status):
            self.status = status
            super().__init__("NCCL_ERROR_REMOTE_ERROR: remote process exited")

    err = nt.nccl_error("all_reduce", CupyNcclError(6), "rank 1 of 4 (GPU 1)")
    assert isinstance(err, nt.NcclError) and isinstance(err, AxondistError)
    assert isinstance(err, RuntimeError)
    text = str(err)
    for part in ("all_reduce", "ncclRemoteError (6)", "rank 1 of 4 (GPU 1)", "remote process",
                 "other ranks"):
        assert part in text
    assert (err.op, err.status, err.status_name) == ("all_reduce", 6, "ncclRemoteError")
    again = pickle.loads(pickle.dumps(err))
    assert (again.op, again.status, str(again)) == (err.op, err.status, str(err))
    unknown = nt.nccl_error("broadcast", RuntimeError("odd"), "here")
    assert unknown.status is None and "broadcast" in str(unknown)


def test_host_arrays_are_refused_with_what_to_do():
    for op in ("all_reduce", "broadcast", "send"):
        with pytest.raises(nt.NotOnDeviceError, match=rf"^{op}: .*NumPy.*axondist.to_device") as e:
            nt.check_device_array(np.zeros(3, np.float32), op)
        assert isinstance(e.value, TypeError) and isinstance(e.value, AxondistError)
    with pytest.raises(TypeError, match="gather: .*got list"):
        nt.check_device_array([1.0, 2.0], "gather")


@given(hosts=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=8))
def test_node_info_from_hosts(hosts):
    firsts = list(dict.fromkeys(hosts))
    for rank, host in enumerate(hosts):
        node, local, size = nt.node_info_from_hosts(hosts, rank)
        same = [r for r, h in enumerate(hosts) if h == host]
        assert (node, local, size) == (firsts.index(host), same.index(rank), len(same))


def test_select_device():
    assert [nt.select_device(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="no CUDA device"):
        nt.select_device(0, 0)


# --- the torchrun-style environment ---------------------------------------------------

def test_launch_env_parses_and_checks():
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5",
           "LOCAL_RANK": "1"}
    assert LaunchEnv.from_environ(env) == LaunchEnv("node0", 29500, 8, 5, 1)
    assert LaunchEnv.from_environ({**env, "LOCAL_RANK": ""}).local_rank is None
    assert LaunchEnv.present(env) and not LaunchEnv.present({"PATH": "/bin"})
    assert LaunchEnv.from_environ(env).endpoint == "MASTER_ADDR:MASTER_PORT=node0:29500"
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set .*WORLD_SIZE=8"):
        LaunchEnv.from_environ({"WORLD_SIZE": "8", "RANK": "0"})
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        LaunchEnv.from_environ({**env, "RANK": "x"})
    with pytest.raises(ValueError, match=r"RANK=8 is out of range \(0..7\)"):
        LaunchEnv.from_environ({**env, "RANK": "8"})
    with pytest.raises(ValueError, match="MASTER_PORT=70000 is out of range"):
        LaunchEnv.from_environ({**env, "MASTER_PORT": "70000"})


# --- the TCP rendezvous ---------------------------------------------------------------------

def _run_ranks(world_size: int, port: int, timeout: float, ranks=None, value=b"token"):
    results, errors = {}, {}

    def rank_main(r):
        env = LaunchEnv("127.0.0.1", port, world_size, r)
        try:
            results[r] = exchange_from_rank0(env, "k", lambda: value + bytes([r]), timeout)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,))
               for r in (range(world_size) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return results, errors


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rendezvous_hands_rank0s_value_to_every_rank(world_size):
    port = free_port()
    results, errors = _run_ranks(world_size, port, 20.0, value=os.urandom(128))
    assert not errors
    assert len(results) == world_size and len(set(results.values())) == 1
    assert results[0][-1] == 0  # made by rank 0
    KeyValueServer(port).close()  # the server is gone, so the port can be used again


def test_rendezvous_rank0_times_out_naming_the_endpoint_and_missing_ranks():
    port = free_port()
    _, errors = _run_ranks(3, port, 0.6, ranks=[0, 2])
    assert isinstance(errors.get(0), CollectiveTimeoutError)
    assert f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in str(errors[0])
    assert "ranks [1] of 3 did not join" in str(errors[0])
    assert 2 not in errors


def test_rendezvous_rank_without_rank0_times_out_naming_the_endpoint():
    port = free_port()
    _, errors = _run_ranks(2, port, 0.5, ranks=[1])
    err = errors[1]
    assert isinstance(err, CollectiveTimeoutError) and isinstance(err, TimeoutError)
    assert f"rank 1 could not reach rank 0 at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in str(err)


def test_rendezvous_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"cannot listen on port {port}.*MASTER_PORT"):
            KeyValueServer(port)


def test_key_value_store_set_get_keys_and_get_timeout():
    with KeyValueServer(0, "127.0.0.1", {"a": b"1"}) as server:
        with KeyValueClient("127.0.0.1", server.port, 5.0) as client:
            assert client.get("a", 1.0) == b"1"
            client.set("b", b"\x00\xff" * 1000)
            assert client.get("b", 1.0) == b"\x00\xff" * 1000
            assert sorted(client.keys()) == ["a", "b"]
            with pytest.raises(CollectiveTimeoutError, match="key 'zz' was not set"):
                client.get("zz", 0.2)
            late = threading.Timer(0.2, server.set, args=("later", b"x"))
            late.start()
            assert client.get("later", 5.0) == b"x"
            late.join()


def test_rendezvous_between_processes():
    port = free_port()
    code = textwrap.dedent(f"""
        import sys
        from axondist.backends.rendezvous import LaunchEnv, exchange_from_rank0
        r = int(sys.argv[1])
        env = LaunchEnv("127.0.0.1", {port}, 2, r)
        print(exchange_from_rank0(env, "uid", lambda: b"made-by-%d" % r, 30.0).decode())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=ROOT, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (1, 0)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["made-by-0", "made-by-0"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rendezvous_allgather_hands_every_rank_every_value(world_size):
    port, results, errors = free_port(), {}, {}

    def rank_main(r):
        env = LaunchEnv("127.0.0.1", port, world_size, r)
        try:
            results[r] = allgather_over_rendezvous(env, "places", b"rank-%d" % r, 20.0)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    want = [b"rank-%d" % r for r in range(world_size)]
    assert results == {r: want for r in range(world_size)}
    KeyValueServer(port).close()  # the server is gone, so the port can be used again


# --- ranks that would share a GPU ---------------------------------------------------------------

def test_shared_gpu_message_names_the_ranks_the_gpu_the_host_and_what_to_run():
    one = [nt.RankGpu("node7", "GPU-aa", 0, 1)] * 2
    assert nt.shared_gpu_message(one) == (
        "nccl backend: NCCL needs a GPU of its own for every rank, but ranks 0 and 1 on host "
        "node7 chose the same GPU (device 0, GPU-aa) of the host's 1 GPU. Start at most 1 rank "
        "per host (one rank per GPU, e.g. torchrun --nproc-per-node or mpiexec -n with one "
        "process per GPU), give each rank its own GPU (init(\"nccl\", device=...) or "
        "CUDA_VISIBLE_DEVICES), or use the mpi backend with CuPy arrays (init(\"mpi\")), where "
        "ranks may share a GPU")
    apart = [nt.RankGpu("a", "GPU-0", 0, 2), nt.RankGpu("a", "GPU-1", 1, 2),
             nt.RankGpu("b", "GPU-0", 0, 2)]  # the same UUID text on another host is no clash
    assert nt.shared_gpu_message(apart) is None
    three = apart + [nt.RankGpu("a", "GPU-1", 1, 2), nt.RankGpu("a", "GPU-1", 1, 2)]
    text = nt.shared_gpu_message(three)
    assert "ranks 1, 3 and 4 on host a chose the same GPU (device 1, GPU-1) of the host's 2 GPUs" \
        in text and "Start at most 2 ranks per host" in text


_SHARED_GPU_SCRIPT = """
import os, sys
sys.path[:0] = [{root!r}, {support!r}]
import nccl_fake
fake = nccl_fake.install_for_process(device_count={count})
fake.uuids = {uuids!r}
import axondist as ad
try:
    ad.init("nccl", timeout=30)
except ad.AxondistError as exc:
    os.write(1, f"REFUSED {{type(exc).__name__}} {{exc}}\\n".encode())  # one write
    sys.exit(3)
print("STARTED")
"""


@pytest.mark.parametrize("count, uuids", [(1, {}), (2, {0: b"\x07" * 16, 1: b"\x07" * 16})],
                         ids=["one-gpu", "two-devices-one-uuid"])
def test_two_ranks_on_one_gpu_are_refused_before_nccl_starts(count, uuids):
    script = _SHARED_GPU_SCRIPT.format(root=str(ROOT), support=str(SUPPORT),
                                       count=count, uuids=uuids)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r)))
        for r in (0, 1)]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outs
    device = "device 0" if count == 1 else "devices 0, 1"
    gpu = "GPU-face0000-0000-0000-0000-000000000000" if count == 1 else \
        "GPU-07070707-0707-0707-0707-070707070707"
    for out, _ in outs:
        assert out.startswith("REFUSED RankError nccl backend: NCCL needs a GPU of its own for "
                              "every rank, but ranks 0 and 1 on host "), out
        assert f"chose the same GPU ({device}, {gpu}) of the host's {count} GPU" in out
        assert f"Start at most {count} rank" in out
        assert "or use the mpi backend with CuPy arrays" in out


@pytest.mark.mpi
def test_two_ranks_on_one_gpu_are_refused_under_mpiexec(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if importlib.util.find_spec("mpi4py") is None or not mpiexec.exists():
        pytest.skip("needs mpi4py and mpiexec")
    script = tmp_path / "shared.py"
    script.write_text(_SHARED_GPU_SCRIPT.format(root=str(ROOT), support=str(SUPPORT),
                                                count=1, uuids={}))
    out = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode != 0
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 2, out.stdout + out.stderr
    for line in lines:
        assert "REFUSED RankError nccl backend: NCCL needs a GPU of its own for every rank, but " \
            "ranks 0 and 1 on host " in line
        assert "chose the same GPU (device 0, GPU-face0000-0000-0000-0000-000000000000) of the " \
            "host's 1 GPU" in line


# --- the backend on the CPU stand-in --------------------------------------------------------

def spawn(body, world_size, *args, timeout=20.0):
    from axondist.launching.worlds import spawn_on_devices

    return spawn_on_devices(body, list(range(world_size)), *args, timeout=timeout)


def dev(x):
    return ad.to_device(x)


def _all_reduce_body(world, seed):
    n, r = world.world_size, world.rank
    checked = 0
    for dtype in _array.SUPPORTED_DTYPES:
        for op in ReduceOp:
            try:
                nt.reduce_plan(dtype, op, MODERN, "t")
            except UnsupportedDTypeError:
                continue
            inputs = [random_values(np.random.default_rng([seed, k]), dtype, 7).reshape(7, 1)
                      for k in range(n)]
            x = dev(inputs[r])
            ad.all_reduce(x, op)
            assert x.device.id == world.backend.device
            assert_close(x.get(), combine_into(inputs[0].copy(), inputs, op))
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_reduce_every_op_and_dtype(fake, world_size):
    checked = spawn(_all_reduce_body, world_size, 7)
    assert checked[0] >= 40 and len(set(checked)) == 1


def _collectives_body(world, seed):
    n, r = world.world_size, world.rank
    rng = [np.random.default_rng([seed, k]) for k in range(n)]
    data = [g.standard_normal((2 * n + 1, 3)).astype(np.float32) for g in rng]
    # reduce_scatter, uneven rows (2n+1 over n), SUM and AVERAGE
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        got = ad.reduce_scatter(dev(data[r]), op).get()
        full = combine_into(data[0].copy(), data, op)
        assert_close(got, np.array_split(full, n)[r])
    # all_gather with uneven leading sizes, and with even ones (ncclAllGather)
    pieces = [np.full((k + 1, 2), k, np.int64) for k in range(n)]
    assert_close(ad.all_gather(dev(pieces[r])).get(), np.concatenate(pieces))
    even = [np.full((2, 2), k, np.float16) for k in range(n)]
    assert_close(ad.all_gather(dev(even[r])).get(), np.concatenate(even))
    for root in range(n):
        b = dev(data[r].copy())
        ad.broadcast(b, src=root)
        assert_close(b.get(), data[root])
        out = ad.gather_tensor(dev(pieces[r].astype(np.complex64)), dst=root)
        if r == root:
            assert_close(out.get(), np.concatenate(pieces).astype(np.complex64))
        else:
            assert out is None
        src = np.arange(3 * n + 2) % 3 == 0
        part = ad.scatter_tensor(dev(src) if r == root else None, src=root)
        assert_close(part.get(), np.array_split(src, n)[r])
    ad.barrier()
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gathers_scatters_broadcasts_uneven_counts(fake, world_size):
    assert all(spawn(_collectives_body, world_size, 11))


def _p2p_and_objects_body(world):
    n, r = world.world_size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    msg = np.arange(5, dtype=np.float64) * (r + 1)
    if r % 2 == 0:  # a ring without deadlock: even ranks send first
        ad.send(dev(msg), nxt)
        got = ad.recv(prv).get()
    else:
        got = ad.recv(prv).get()
        ad.send(dev(msg), nxt)
    assert_close(got, np.arange(5, dtype=np.float64) * (prv + 1))
    b = world.backend
    assert b.allgather_object({"rank": r, "pad": "x" * r}) == [
        {"rank": k, "pad": "x" * k} for k in range(n)]
    for root in range(n):
        assert b.broadcast_object(("from", r) if r == root else None, root) == ("from", root)
    if r % 2 == 0:
        b.send_object(["hello", r], nxt, tag=5)
        assert b.recv_object(prv, tag=5) == ["hello", prv]
    else:
        assert b.recv_object(prv, tag=5) == ["hello", prv]
        b.send_object(["hello", r], nxt, tag=5)
    return True


def test_send_recv_and_objects_over_nccl(fake):
    assert all(spawn(_p2p_and_objects_body, 2))
    assert all(spawn(_p2p_and_objects_body, 4))


def test_recv_object_checks_the_tag(fake):
    def body(world):
        b = world.backend
        if world.rank == 0:
            b.send_object("x", 1, tag=3)
            return None
        with pytest.raises(CollectiveMismatchError, match="next message has tag 3.*expects tag 4"):
            b.recv_object(0, tag=4)
        return True

    assert spawn(body, 2)[1]


def _groups_body(world):
    r = world.rank
    sub = world.new_group([2, 0])
    assert sub.ranks == (2, 0)
    if r in (0, 2):
        assert sub.is_member and sub.rank == [2, 0].index(r)
        x = dev(np.array([r + 1.0], np.float32))
        ad.all_reduce(x, group=sub)
        assert_close(x.get(), np.array([4.0], np.float32))
        assert sub.backend.node_info() == (0, sub.rank, 2)
    else:
        assert not sub.is_member
    ones = [world.new_group([k]) for k in range(world.world_size)]
    mine = ones[r]
    y = dev(np.array([5.0 + r]))
    ad.all_reduce(y, ReduceOp.AVERAGE, group=mine)
    assert_close(y.get(), np.array([5.0 + r]))
    with pytest.raises(CollectiveMismatchError, match="disagree on the members"):
        world.backend.new_group([0, 1] if r == 0 else [0, 2])
    return True


def test_new_group_with_a_fresh_unique_id(fake):
    assert all(spawn(_groups_body, 3))


def _what_one_blocking_call_does(world, counts, nccl_calls):
    n = world.world_size
    x, y = dev(np.ones(8, np.float32)), dev(np.zeros(3, np.int64))
    rows, out = dev(np.full((2, 3), world.rank, np.float64)), dev(np.zeros((2 * n, 3)))
    calls = {"all_reduce": lambda: ad.all_reduce(x), "broadcast": lambda: ad.broadcast(y),
             "all_gather": lambda: ad.all_gather(rows, sizes=[2] * n, out=out),
             "reduce_scatter": lambda: ad.reduce_scatter(out)}
    for call in calls.values():
        call()  # the first call of a key prepares it (its check buffer goes to the GPU)
    mine = world.backend.rank
    spent = {}
    for name, call in calls.items():
        for stream in ("the caller's", "the backend's"):
            before, issued = counts(), len([c for c in nccl_calls if c[1] == mine])
            if stream == "the caller's":
                call()
            else:
                with world.backend.stream:
                    call()
            after = counts()
            after.subtract(before)
            issued = [c[0] for c in nccl_calls if c[1] == mine][issued:]
            spent[name, stream] = (after["device enter"], after["event record"],
                                   after["event query"], issued)
    assert_close(x.get(), np.full(8, float(n ** 3), np.float32))
    assert_close(out.get(), np.repeat(np.arange(n, dtype=np.float64), 2)[:, None] * np.ones(3))
    return spent, world.backend.recorder.running()


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_blocking_call_enters_the_device_once_and_records_at_most_one_event(fake,
                                                                                world_size):
    """The per-call cost the GPU showed (the device entered twice, two events recorded and
    a sweep of finished work per call), counted on the stand-in: a blocking all-reduce,
    broadcast, all-gather or reduce-scatter from the caller's stream makes the GPU current
    once and records one event (ordering after that stream); from the backend's own
    stream none; and it polls no event. The cross-rank check (two ranks) and the flight
    recorder stay on."""
    results = spawn(_what_one_blocking_call_does, world_size, fake.module.thread_counts,
                    fake.calls)
    checked = ["allReduce"] if world_size > 1 else []
    nccl_names = {"all_reduce": "allReduce", "broadcast": "broadcast",
                  "all_gather": "allGather", "reduce_scatter": "reduceScatter"}
    for spent, running in results:
        assert spent == {
            (op, stream): (1, 1 if stream == "the caller's" else 0, 0, checked + [name])
            for op, name in nccl_names.items() for stream in ("the caller's", "the backend's")}
        assert running == []  # every call's recorder entry was stamped done


def test_async_work_handles(fake):
    issued = threading.Event()

    def body(world):
        from axondist.backends.nccl import NcclWork

        n = world.world_size
        x = dev(np.full(4, world.rank + 1.0, np.float32))
        if world.rank == 1:
            assert issued.wait(20)  # rank 0's call is in flight, waiting for this rank
        work = ad.all_reduce(x, async_op=True)
        assert isinstance(work, NcclWork)
        if world.rank == 0:
            assert not work.is_completed()  # rank 1 has not joined yet
            issued.set()
        assert work.wait() is x and work.wait() is x
        assert work.is_completed()
        work.wait_stream()
        assert_close(x.get(), np.full(4, n * (n + 1) / 2, np.float32))
        rs = ad.reduce_scatter(dev(np.ones((n, 2))), async_op=True).wait()
        assert_close(rs.get(), np.full((1, 2), float(n)))
        return True

    assert all(spawn(body, 2))


def test_grouped_calls_from_one_thread_over_create_world(fake):
    from axondist.backends.nccl import GroupedCallError, NcclBackend, group_calls

    fake.version_code = 20909  # no ncclAvg: AVERAGE divides after the group's sum
    backends = NcclBackend.create_world([1, 3, 0])
    assert [b.device for b in backends] == [1, 3, 0] and [b.rank for b in backends] == [0, 1, 2]
    rng = np.random.default_rng(3)
    bucket = [[rng.standard_normal(k + 2).astype(np.float32) for k in range(4)] for _ in range(3)]
    arrays = []
    for b, host in zip(backends, bucket):
        with fake.module.Device(b.device):
            arrays.append([ad.to_device(h) for h in host])
    works = []
    fake.calls.clear()
    with group_calls():
        for b, xs in zip(backends, arrays):
            for x in xs:
                works.append(b.all_reduce(x, ReduceOp.AVERAGE, async_op=True))
            with pytest.raises(GroupedCallError, match="wait\\(\\) inside"):
                works[-1].wait()
            with pytest.raises(GroupedCallError, match="allgather_object: cannot run inside"):
                b.allgather_object(1)
        assert not any(w.is_completed() for w in works)
        assert fake.calls == [("allReduce", r) for r in range(3) for _ in range(4)]
    for w in works:
        w.wait()
    for k in range(4):
        want = combine_into(bucket[0][k].copy(), [bucket[j][k] for j in range(3)],
                            ReduceOp.AVERAGE)
        for xs in arrays:
            assert_close(xs[k].get(), want)
    # a blocking call inside the group completes when the block ends
    ys = []
    for b in backends:
        with fake.module.Device(b.device):
            ys.append(ad.to_device(np.array([b.rank + 1.0])))
    with backends[0].grouped():
        for b, y in zip(backends, ys):
            b.broadcast(y, 2)
    assert [y.get()[0] for y in ys] == [3.0, 3.0, 3.0]
    for b in backends:
        b.close()
        b.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        backends[0].broadcast(ys[0], 0)


def test_blocking_comm_calls_inside_a_group_say_to_use_async(fake):
    def body(world):
        x = dev(np.ones(3, np.float32))
        with world.backend.grouped():
            with pytest.raises(ad.AxondistError, match="async_op=True"):
                ad.all_reduce(x)
            work = ad.all_reduce(x, async_op=True)
        work.wait()
        return x.get()

    for got in spawn(body, 2):
        # the failed blocking call was still issued inside the group, so x was summed twice
        assert_close(got, np.full(3, 4.0, np.float32))


def test_exchange_inside_a_group_does_not_deadlock(fake):
    def body(world):
        peer = 1 - world.rank
        out = dev(np.zeros(3))
        with world.backend.grouped():
            world.backend.send(dev(np.full(3, world.rank + 10.0)), peer)
            world.backend.recv(out, peer)
        return out.get()

    got = spawn(body, 2)
    assert_close(got[0], np.full(3, 11.0))
    assert_close(got[1], np.full(3, 10.0))


def test_old_nccl_average_falls_back_and_bfloat16_is_refused_for_reductions(fake):
    fake.version_code = 20909

    def body(world):
        assert world.backend.nccl_version() == (2, 9, 9)
        x = dev(np.array([1.0, 2.0], np.float16) * (world.rank + 1))
        ad.all_reduce(x, "mean")
        assert_close(x.get(), np.array([1.5, 3.0], np.float16))
        bf = np.array([1.5, -2.0], _array.bfloat16)
        with pytest.raises(UnsupportedDTypeError, match="bfloat16 needs NCCL >= 2.10"):
            ad.all_reduce(dev(bf))
        moved = dev(bf * (world.rank + 1))
        ad.broadcast(moved, src=1)  # data movement is bytes: fine on any NCCL
        assert_close(moved.get(), bf * 2)
        return True

    assert all(spawn(body, 2))  # the fake NCCL 2.9 refuses ncclAvg and ncclBfloat16


def test_bfloat16_and_float16_reduce_on_modern_nccl(fake):
    def body(world):
        r, n = world.rank, world.world_size
        for dtype in (_array.bfloat16, np.dtype(np.float16)):
            for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX):
                inputs = [np.array([0.5, 1.25, -3.0], dtype) * (k + 1) for k in range(n)]
                x = dev(inputs[r])
                ad.all_reduce(x, op)
                assert x.dtype == dtype
                assert_close(x.get(), combine_into(inputs[0].copy(), inputs, op))
        return True

    assert all(spawn(body, 3))


def test_numpy_arrays_are_refused_by_every_operation(fake):
    def body(world):
        host = np.zeros(4, np.float32)
        for name, call in [("all_reduce", lambda: ad.all_reduce(host)),
                           ("broadcast", lambda: ad.broadcast(host)),
                           ("reduce_scatter", lambda: ad.reduce_scatter(host)),
                           ("all_gather", lambda: ad.all_gather(host, sizes=[4] * 2)),
                           ("send", lambda: world.backend.send(host, 1 - world.rank))]:
            with pytest.raises(nt.NotOnDeviceError, match=f"{name}: .*axondist.to_device"):
                call()
        with fake.module.Device(3):
            elsewhere = ad.to_device(np.zeros(2))
        with pytest.raises(InvalidBufferError, match="on GPU 3 but this rank's communicator"):
            ad.all_reduce(elsewhere)
        strided = dev(np.zeros(8))[::2]
        with pytest.raises(InvalidBufferError, match="not C-contiguous"):
            world.backend.broadcast(strided, 0)
        with pytest.raises(RankError, match=f"dst={world.rank} is this rank"):
            world.backend.send(dev(np.zeros(1)), world.rank)
        return True

    assert all(spawn(body, 2))


def test_complex_product_is_refused_with_a_reason(fake):
    def body(world):
        with pytest.raises(UnsupportedDTypeError, match="PRODUCT of complex64 is not supported"):
            ad.all_reduce(dev(np.ones(2, np.complex64)), "prod")
        return True

    assert spawn(body, 1)[0]


def test_debug_mode_compares_arguments_across_ranks(fake, monkeypatch):
    monkeypatch.setenv("AXONDIST_DEBUG", "1")

    def body(world):
        x = dev(np.zeros(3 + world.rank, np.float32))
        with pytest.raises(CollectiveMismatchError, match="all_reduce: ranks disagree on shape"):
            ad.all_reduce(x)
        return True

    assert all(spawn(body, 2))


def test_a_timeout_aborts_the_communicators_with_the_watchdogs_report(fake):
    from axondist.backends.nccl import NcclBackend

    b0, b1 = NcclBackend.create_world([0, 1], timeout=0.3)
    x = ad.to_device(np.ones(2))
    # rank 1 never joins: NCCL would spin forever, the watchdog aborts rank 0's communicator
    with pytest.raises(CollectiveTimeoutError, match=r"all_reduce: not completed within 0.3 s on "
                                                     r"rank 0 of 2 \(GPU 0\)") as e:
        b0.all_reduce(x, ReduceOp.SUM)
    text = str(e.value)
    assert "the watchdog aborted this rank's NCCL communicators (ncclCommAbort)" in text
    assert "all_reduce #1 on world (dtype=float64, shape=[2], reduce_op=SUM) timed out" in text
    assert "missing ranks: [1]" in text and "rank 1 (host " in text
    assert "is not in any axondist call (busy in its own code)" in text
    assert "last calls of rank 0 (flight recorder, oldest first)" in text
    assert not b0.communicator.alive  # ncclCommAbort
    with pytest.raises(CollectiveTimeoutError, match=r"broadcast: not completed within 0.3 s"):
        b0.broadcast(x, 0)  # an aborted communicator is never used again
    b0.close()
    b1.close()


def test_async_errors_name_the_operation(fake, monkeypatch):
    from axondist.backends.nccl import NcclBackend

    monkeypatch.setenv("AXONDIST_CHECKS", "0")  # the async call's own check would wait too
    b0, b1 = NcclBackend.create_world([0, 1], timeout=30)
    x = ad.to_device(np.ones(2))
    work = b0.broadcast(x, 0, async_op=True)
    assert not work.is_completed()
    with pytest.raises(CollectiveTimeoutError, match=r"broadcast: not completed within 0.2 s on "
                                                     r"rank 0 of 2 \(GPU 0\); it keeps running"):
        work.wait(timeout=0.2)  # an explicit timeout leaves the call running
    assert b0.communicator.alive
    fake.async_error = 6  # a peer died
    with pytest.raises(nt.NcclError, match="broadcast: NCCL failed with ncclRemoteError") as e:
        work.wait(timeout=5.0)
    assert e.value.op == "broadcast" and e.value.status == 6
    b0.close()  # the outstanding call failed: close aborts instead of hanging
    b1.close()
    assert fake.aborted == [0]  # rank 1 had nothing outstanding: destroyed normally
    fake.async_error = None


def test_mismatched_calls_surface_as_nccl_errors_without_checks(fake, monkeypatch):
    monkeypatch.setenv("AXONDIST_CHECKS", "0")  # unsafe: NCCL itself meets the wrong calls

    def body(world):
        x = dev(np.zeros(3 + world.rank, np.float32))  # different counts: NCCL misbehaves
        with pytest.raises(nt.NcclError, match="all_reduce: NCCL failed with ncclInvalidUsage"):
            world.backend.all_reduce(x, ReduceOp.SUM)
        return True

    assert all(spawn(body, 2))
    assert [k for k, _ in fake.calls].count("allReduce") == 2  # no check call


def test_nccl_call_errors_are_wrapped(fake):
    from axondist.backends.nccl import NcclBackend

    (b,) = NcclBackend.create_world([0])
    b.communicator.alive = False  # as after ncclCommAbort: NCCL answers ncclInvalidArgument
    with pytest.raises(nt.NcclError, match="all_reduce: NCCL failed with ncclInvalidArgument"):
        b.all_reduce(ad.to_device(np.ones(2)), ReduceOp.SUM)


def test_a_failing_rank_releases_the_others(fake):
    seen = []

    def body(world):
        if world.rank == 1:
            raise ValueError("rank 1 broke")
        try:
            ad.all_reduce(dev(np.ones(2)))  # rank 1 never joins
        except ad.WorldAbortedError as exc:
            seen.append(str(exc))
            raise

    with pytest.raises(ValueError, match="rank 1 broke"):
        spawn(body, 2, timeout=60.0)
    assert seen and "rank 1 failed with ValueError: rank 1 broke" in seen[0]


def test_bootstrap_from_torchrun_environment_in_threads(fake):
    from axondist.backends.nccl import bootstrap_from_env

    port, n = free_port(), 3
    results, errors = [None] * n, []

    def rank_main(r):
        try:
            b = bootstrap_from_env(LaunchEnv("127.0.0.1", port, n, r, r), timeout=20.0)
            with fake.module.Device(b.device):
                x = ad.to_device(np.array([float(r)]))
            b.all_reduce(x, ReduceOp.SUM)
            results[r] = (b.device, b.node_info(), x.get()[0], b.world_size)
            b.close()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == [(r, (0, r, n), 3.0, n) for r in range(n)]


def test_create_world_backend_without_a_launcher_and_with_options(fake, monkeypatch):
    from axondist.backends import nccl

    monkeypatch.setattr("axondist.process_group._process_world", None)  # restored afterwards
    for var in LaunchEnv.REQUIRED + ("LOCAL_RANK",):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("axondist.launching.worlds.launched_by_mpi", lambda: False)
    with pytest.raises(TypeError, match=r"unknown options \['devcie'\]"):
        nccl.create_world_backend(devcie=1)
    b = nccl.create_world_backend(device=2, timeout=5)
    assert (b.rank, b.world_size, b.device, b.timeout) == (0, 1, 2, 5.0)
    assert fake.module.current_device() == 2  # the chosen GPU became current
    b.close()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT, RANK not set"):
        nccl.create_world_backend()
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "5")
    world = ad.init("nccl")
    assert world.backend.name == "nccl" and world.backend.device == 5 % 4
    x = ad.to_device(np.ones(3, np.float32))
    assert_close(ad.all_reduce(x).get(), np.ones(3, np.float32))
    world.backend.close()


@pytest.mark.parametrize("tuple_form", [False, True], ids=["cupy14-bytes", "cupy13-tuple"])
def test_unique_id_reaches_cupy_in_the_form_its_version_takes(fake, tuple_form):
    """CuPy 14 takes the id as bytes and refuses a tuple (seen on a GPU); CuPy 13 the reverse."""
    from axondist.backends.nccl import NcclBackend

    fake.tuple_unique_id = tuple_form
    uid, n = NcclBackend.generate_unique_id(), 2
    sums, errors = [None] * n, []

    def rank_main(r):
        try:
            b = NcclBackend(uid, r, n, r, timeout=20.0)
            sub = b.new_group([0, 1])
            with fake.module.Device(r):
                x = ad.to_device(np.array([r + 1.0], np.float32))
            sub.all_reduce(x, ReduceOp.SUM)
            sums[r] = float(x.get()[0])
            sub.close()
            b.close()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sums == [3.0, 3.0]


def test_wrong_construction_arguments(fake):
    from axondist.backends.nccl import NcclBackend

    with pytest.raises(ValueError, match="rank=2 must be in 0..1"):
        NcclBackend(NcclBackend.generate_unique_id(), 2, 2, 0)
    with pytest.raises(ValueError, match="device=9 is not a visible GPU"):
        NcclBackend(NcclBackend.generate_unique_id(), 0, 1, 9)
    with pytest.raises(ValueError, match="distinct visible GPU ids"):
        NcclBackend.create_world([0, 0])


@pytest.mark.mpi
def test_mpi_bootstrap_under_mpiexec(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if importlib.util.find_spec("mpi4py") is None or not mpiexec.exists():
        pytest.skip("needs mpi4py and mpiexec")
    script = tmp_path / "boot.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(SUPPORT)!r}]
        import numpy as np
        import nccl_fake

        nccl_fake.install_for_process(device_count=2)
        import axondist as ad
        world = ad.init("nccl")
        x = ad.to_device(np.arange(3.0))
        ad.all_reduce(x)
        print(world.backend.name, world.world_size, world.backend.device, x.get().tolist(),
              world.backend.node_info())
    """))
    out = subprocess.run([str(mpiexec), "-n", "1", sys.executable, str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "nccl 1 0 [0.0, 1.0, 2.0] (0, 0, 1)"


# --- the benchmark's arithmetic and its no-GPU exit -----------------------------------------

@functools.cache
def _bench():
    path = ROOT / "benchmarks" / "bench_nccl.py"
    spec = importlib.util.spec_from_file_location("bench_nccl_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@given(algbw=st.floats(0.1, 1000.0), n=st.integers(1, 64))
def test_bus_bandwidth_follows_nccl_tests(algbw, n):
    bench = _bench()
    busbw = bench.bus_bandwidth(algbw, n)
    assert busbw == pytest.approx(algbw * 2 * (n - 1) / n)
    assert 0 <= busbw < 2 * algbw


def test_bench_sizes_and_exit_without_gpu():
    bench = _bench()
    sizes = bench.message_sizes()
    assert sizes[0] == 1 << 20 and sizes[-1] == 1 << 30 and len(sizes) == 11
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert bench.message_sizes(1 << 20, 1 << 30, 4)[-1] == 1 << 30
    if bench.gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present; the benchmark would run")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_nccl.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 1
    assert "bench_nccl: cannot run without a CUDA GPU" in out.stderr
    assert "pip install '.[gpu-cuda13]' for CUDA 13 or '.[gpu]' for CUDA 12" in out.stderr


_ON_STAND_IN = """
import runpy, sys
sys.path.insert(0, {support!r})
import nccl_fake

nccl_fake.install_for_process(device_count=2)
sys.argv = [{launcher!r}, *{args!r}]
runpy.run_path({launcher!r}, run_name="__main__")
"""


@pytest.mark.parametrize("ranks", [0, 2], ids=["mock-world", "mpiexec-n2"])
def test_the_cupy_world_test_files_pass_on_the_cpu_stand_in(ranks):
    """tests/gpu's CuPy-array tests (every collective, every wrapper against NumPy), on the
    stand-in: their logic and the library's device paths (host staging under MPI, arrays
    kept on the device) are checked here; real CuPy refuses mixed NumPy/CuPy operands and
    so does the stand-in."""
    files = [str(ROOT / "tests" / "gpu" / name)
             for name in ("test_cupy_collectives.py", "test_cupy_wrappers.py")]
    launcher = str(ROOT / "tests" / "world" / "rank_pytest.py")
    code = _ON_STAND_IN.format(support=str(SUPPORT), launcher=launcher,
                               args=["-q", "-p", "no:cacheprovider", "-x", *files])
    cmd = [sys.executable, "-c", code]
    if ranks:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        if importlib.util.find_spec("mpi4py") is None or not mpiexec.exists():
            pytest.skip("needs mpi4py and MPICH's mpiexec next to this Python")
        cmd = [str(mpiexec), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-c", code]
    env = {**child_env(), "AXONDIST_TEST_EXAMPLES": "5", "AXONDIST_TIMEOUT": "60"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert out.stdout.count("pytest OK") == max(ranks, 1), out.stdout[-3000:]
    summaries = [line for line in out.stdout.splitlines() if " passed" in line]
    assert len(summaries) == max(ranks, 1) and all("failed" not in s for s in summaries), \
        out.stdout[-3000:]


def test_the_gpu_test_file_passes_on_the_cpu_stand_in():
    """tests/gpu/test_nccl_gpu.py and test_nccl_wrappers.py, run against the fake with two
    'GPUs' (world sizes 1 and 2).

    It checks the gpu tests' own logic here, so a machine with GPUs runs tests
    known to be sound; what only real GPUs show (stream races, NCCL itself)
    is still theirs to find.
    """
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(SUPPORT)!r})
        import nccl_fake, pytest

        nccl_fake.install_for_process(device_count=2)
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x",
                              {str(ROOT / "tests" / "gpu" / "test_nccl_gpu.py")!r},
                              {str(ROOT / "tests" / "gpu" / "test_nccl_wrappers.py")!r}]))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=child_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


# --- the default cross-rank check, the flight recorder, the watchdog ----------------------

def _allreduce_count(fake) -> int:
    return [k for k, _ in fake.calls].count("allReduce")


def test_every_collective_starts_with_one_small_check(fake, monkeypatch):
    def body(world):
        ad.barrier()
        ad.all_reduce(dev(np.ones(5, np.float32)))

    spawn(body, 2)
    # per rank: a barrier and an all_reduce, each preceded by its check
    assert _allreduce_count(fake) == 2 * (2 + 2)
    fake.calls.clear()
    monkeypatch.setenv("AXONDIST_CHECKS", "0")
    spawn(body, 2)
    assert _allreduce_count(fake) == 2 * 2


_CALLS = st.fixed_dictionaries({
    "op": st.sampled_from(["all_reduce", "broadcast", "barrier"]),
    "dtype": st.sampled_from(["float32", "float64", "int32"]),
    "shape": st.sampled_from([(2,), (1,), (2, 1)]),
    "reduce_op": st.sampled_from(["sum", "max"]),
    "root": st.integers(0, 2),
    "async_op": st.sampled_from([False, False, True]),
})
_KEY_FIELDS = {"all_reduce": ("dtype", "shape", "reduce_op", "async_op"),
               "broadcast": ("dtype", "shape", "root", "async_op"), "barrier": ()}


def _key(call, n):
    call = dict(call, root=call["root"] % n)
    return (call["op"],) + tuple(call[f] for f in _KEY_FIELDS[call["op"]])


def _issue(world, call):
    """Run one drawn call; its result on the host (None for a barrier)."""
    if call["op"] == "barrier":
        ad.barrier()
        return None
    x = dev(np.full(call["shape"], world.rank + 1, call["dtype"]))
    if call["op"] == "all_reduce":
        work = ad.all_reduce(x, call["reduce_op"], async_op=call["async_op"])
    else:
        work = ad.broadcast(x, src=call["root"] % world.world_size, async_op=call["async_op"])
    if call["async_op"]:
        work.wait()
    return x.get()


def _mismatch_body(world, calls):
    try:
        return "ok", _issue(world, calls[world.rank])
    except CollectiveMismatchError as exc:
        return "mismatch", str(exc)


# The fake stays installed across examples: each spawn makes a fresh world (its own id).
@given(n=st.integers(2, 3), data=st.data())
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_ranks_that_disagree_all_raise_the_mismatch_before_data_moves(fake, n, data):
    first = data.draw(_CALLS)
    calls = [data.draw(st.one_of(st.just(first), _CALLS)) for _ in range(n)]
    results = spawn(_mismatch_body, n, calls)
    keys = [_key(c, n) for c in calls]
    agree = all(k == keys[0] for k in keys)
    event("agree" if agree else "async mismatch" if any(c["async_op"] for c in calls)
          else "blocking mismatch")
    if agree:
        call = calls[0]
        assert all(kind == "ok" for kind, _ in results), results
        if call["op"] == "all_reduce":
            inputs = [np.full(call["shape"], r + 1, call["dtype"]) for r in range(n)]
            want = combine_into(inputs[0].copy(), inputs, ReduceOp(call["reduce_op"]))
            for _, got in results:
                assert_close(got, want)
        elif call["op"] == "broadcast":
            want = np.full(call["shape"], call["root"] % n + 1, call["dtype"])
            for _, got in results:
                assert_close(got, want)
        return
    assert all(kind == "mismatch" for kind, _ in results), results
    ops = [k[0] for k in keys]
    if len(set(ops)) > 1:
        want = "ranks called different collectives at the same point (" + ", ".join(
            f"rank {r} called {o}" for r, o in enumerate(ops))
    else:
        names = _KEY_FIELDS[ops[0]]
        field = next(f for i, f in enumerate(names) if len({k[i + 1] for k in keys}) > 1)
        want = f"ranks disagree on {field} (rank 0: "
    for _, text in results:
        assert want in text, (want, text)
    async_ops = any(c["async_op"] and c["op"] != "barrier" for c in calls)
    aborted = any("communicator was aborted" in text for _, text in results)
    assert aborted == async_ops  # blocking-only mismatches leave the communicators usable


def test_mismatched_dtype_op_and_collective_name_the_ranks_and_keep_the_group_usable(fake):
    def body(world):
        r = world.rank
        errors = []
        same_bytes = dev(np.ones(2, np.float32) if r == 0 else np.ones(1, np.float64))
        for call in (lambda: ad.all_reduce(same_bytes),
                     lambda: ad.all_reduce(dev(np.ones(4)), "sum" if r == 0 else "max"),
                     lambda: ad.all_reduce(dev(np.ones(4))) if r == 0 else ad.barrier()):
            with pytest.raises(CollectiveMismatchError) as e:
                call()
            errors.append(str(e.value))
        x = dev(np.full(3, r + 1.0))
        ad.all_reduce(x)  # the communicator is still in step
        return errors, x.get().tolist()

    results = spawn(body, 2)
    for errors, value in results:
        assert errors == [
            "all_reduce: ranks disagree on dtype (rank 0: float32, rank 1: float64)",
            "all_reduce: ranks disagree on reduce_op (rank 0: SUM, rank 1: MAX)",
            "all_reduce: ranks called different collectives at the same point (rank 0 called "
            "all_reduce, rank 1 called barrier); every rank must make the same collective calls "
            "in the same order"] or errors[2].startswith("barrier: ranks called different"), errors
        assert value == [3.0, 3.0, 3.0]


def test_the_flight_recorder_lists_every_call(fake):
    joined = threading.Event()

    def body(world):
        r = world.rank
        ad.barrier()
        ad.all_reduce(dev(np.ones((2, 3), np.float32)), "max")
        if r == 1:
            assert joined.wait(20)
        work = ad.all_reduce(dev(np.ones(4)), async_op=True)
        if r == 0:
            running = ad.flight_recorder(last=1)[0]
            assert (running["op"], running["state"], running["blocking"]) == \
                ("all_reduce", "running", False)
            joined.set()
        work.wait()
        peer = 1 - r
        if r == 0:
            world.backend.send(dev(np.arange(3.0)), peer, tag=5)
        else:
            world.backend.recv(dev(np.zeros(3)), peer, tag=5)
        world.backend.allgather_object(r)
        sub = world.new_group([0, 1])
        ad.all_reduce(dev(np.ones(1)), group=sub)
        return ad.flight_recorder()

    for r, dump in enumerate(spawn(body, 2)):
        calls = [(e["group"], e["seq"], e["op"]) for e in dump]
        peer = 1 - r
        assert calls[:4] == [("world", 1, "barrier"), ("world", 2, "all_reduce"),
                             ("world", 3, "all_reduce"), ("world", 3, "wait all_reduce")] or \
            calls[:3] == [("world", 1, "barrier"), ("world", 2, "all_reduce"),
                          ("world", 3, "all_reduce")], calls
        assert ("world:p2p", 1, "send" if r == 0 else "recv") in calls
        assert ("world", 4, "allgather_object") in calls
        assert calls[-1][0] == "world.0" and calls[-1][2] == "all_reduce"
        assert all(e["state"] == "done" for e in dump), dump
        by_op = {(e["group"], e["seq"], e["op"]): e for e in dump}
        assert by_op[("world", 2, "all_reduce")]["detail"] == \
            "dtype=float32, shape=[2, 3], reduce_op=MAX"
        assert by_op[("world", 3, "all_reduce")]["blocking"] is False
        p2p = by_op[("world:p2p", 1, "send" if r == 0 else "recv")]
        assert p2p["peer"] == peer and p2p["detail"] == f"peer={peer}, tag=5"


_FAULT_SCRIPT = """
import sys, time
sys.path[:0] = [{root!r}, {support!r}]
import numpy as np
import nccl_fake

nccl_fake.install_for_process(device_count=2)
import axondist as ad
from axondist.launching.worlds import spawn_on_devices

def body(world):
    ad.barrier()
    if world.rank == 1:
        if {case!r} == "stuck":
            time.sleep(6)  # busy in its own code: it skips the all_reduce
        return "skipped"  # 'left': returns while rank 0 waits
    work = ad.all_reduce(ad.to_device(np.ones(4)), async_op={async_op!r})
    return work.wait() if {async_op!r} else work

start = time.monotonic()
try:
    spawn_on_devices(body, [0, 1], timeout={timeout!r})
except Exception as exc:
    print("ERROR", type(exc).__name__, round(time.monotonic() - start, 1))
    print(exc)
    sys.exit(1)
print("no error")
"""


def _run_fault(case, async_op, timeout, stall):
    script = _FAULT_SCRIPT.format(root=str(ROOT), support=str(SUPPORT), case=case,
                                  async_op=async_op, timeout=timeout)
    env = dict(child_env(), AXONDIST_STALL_WARNING=str(stall))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=90, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout, out.stderr


@pytest.mark.parametrize("async_op", [False, True])
def test_a_rank_that_skips_a_collective_times_out_with_the_watchdogs_report(async_op):
    stdout, stderr = _run_fault("stuck", async_op, 3.0, 0.5)
    assert "ERROR CollectiveTimeoutError" in stdout, stdout + stderr
    assert "all_reduce: not completed within 3 s on rank 0 of 2 (GPU 0); the watchdog aborted " \
        "this rank's NCCL communicators (ncclCommAbort)" in stdout
    wait = "wait all_reduce" if async_op else "all_reduce"
    assert f"{wait} #2 on world" in stdout and "timed out on rank 0 of 2 after" in stdout
    assert "missing ranks: [1]" in stdout
    assert "rank 1 (host " in stdout and "is not in any axondist call (busy in its own code); " \
        "its last completed call was barrier #1 on world" in stdout
    assert "last calls of rank 0 (flight recorder, oldest first):" in stdout
    assert "barrier #1 on world: started" in stdout and "RUNNING for" in stdout
    # the stall warnings came first, on stderr, naming the missing rank
    assert "[axondist rank 0/2] stall: rank 0 has waited" in stderr, stderr
    assert "[axondist rank 0/2]   missing ranks: [1]" in stderr


@pytest.mark.parametrize("async_op", [False, True])
def test_a_rank_that_left_is_named_within_seconds_not_at_the_timeout(async_op):
    stdout, stderr = _run_fault("left", async_op, 60.0, 30.0)
    assert "ERROR RankExitedError" in stdout, stdout + stderr
    assert "all_reduce: cannot complete on rank 0 of 2 (GPU 0); the watchdog aborted" in stdout
    assert "rank 1 (host " in stdout and "left after barrier #1 on world" in stdout
    assert float(stdout.split()[2]) < 60.0  # long before AXONDIST_TIMEOUT


def test_ranks_started_with_different_checks_settings_refuse_to_start(fake, monkeypatch):
    from axondist.backends.nccl import backend as nccl_backend
    from axondist.backends.nccl import bootstrap_from_env

    # AXONDIST_CHECKS=0 on rank 1 only (the environment is per process; these are threads)
    monkeypatch.setattr(nccl_backend, "checks_enabled",
                        lambda: threading.current_thread().name != "rank1")
    port, n = free_port(), 2
    errors: list[BaseException | None] = [None] * n

    def rank_main(r):
        try:
            bootstrap_from_env(LaunchEnv("127.0.0.1", port, n, r, r), timeout=20.0)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for exc in errors:
        assert isinstance(exc, ValueError), errors
        assert str(exc) == (
            "NcclBackend: the ranks were started with different axondist settings (rank 0: "
            "checks=True, debug=False, timeout=20; rank 1: checks=False, debug=False, "
            "timeout=20); set AXONDIST_CHECKS, AXONDIST_DEBUG and AXONDIST_TIMEOUT (or "
            "timeout=) alike on every rank")


def test_an_async_call_returns_at_once_and_its_check_honours_wait_timeout(fake):
    from axondist.backends.nccl import NcclBackend

    b0, b1 = NcclBackend.create_world([0, 1], timeout=30)
    x0 = ad.to_device(np.ones(2))
    with fake.module.Device(1):
        x1 = ad.to_device(np.full(2, 2.0))
    work = b0.all_reduce(x0, ReduceOp.SUM, async_op=True)  # rank 1 is not there yet
    with pytest.raises(CollectiveTimeoutError, match=r"all_reduce: not completed within 0.2 s on "
                                                     r"rank 0 of 2 \(GPU 0\); it keeps running"):
        work.wait(timeout=0.2)  # still in its check: nothing was aborted
    peer = threading.Thread(target=lambda: b1.all_reduce(x1, ReduceOp.SUM, async_op=True).wait())
    peer.start()
    assert work.wait() is x0
    peer.join(30)
    assert_close(x0.get(), np.full(2, 3.0))
    assert_close(x1.get(), np.full(2, 3.0))
    b0.close()
    b1.close()


def test_the_mock_world_refuses_ranks_that_mix_numpy_and_cupy_arrays(fake):
    def body(world):
        x = ad.to_device(np.ones(3)) if world.rank == 1 else np.ones(3)
        with pytest.raises(ad.InvalidBufferError, match=r"all_gather: the ranks passed arrays of "
                           r"different libraries \(rank 0: numpy, rank 1: cupy, rank 2: numpy\)"):
            ad.all_gather(x)
        ad.all_reduce(np.ones(2))  # the world goes on
        got = ad.all_gather_object([x])  # objects are handed over as they are, mixed or not
        assert [_array.is_cupy(g[0]) for g in got] == [False, True, False]
        return True

    assert ad.spawn(body, 3) == [True] * 3
