"""ZeroRedundancyOptimizer against the unsharded optimizer, on random models and world sizes.

Gradients are averaged by DDP (as with torch), each rank's batch derives from
(seed, rank), and the reference is one process training on the concatenated
batches with the plain optimizer: the parameters must agree to rounding, the
optimizer state must be split 1/N, and a consolidated state dict must load at
another world size (or into the plain optimizer) and keep training identically.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile

import numpy as np
import pytest
from harness import LAUNCHED, current_size, mock_only, run_world, world_sizes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointReader,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from axondist.ddp import DistributedDataParallel
from axondist.errors import CollectiveMismatchError, UnsupportedDTypeError
from axondist.fsdp import FSDP
from axondist.optim import SGD, Adam, AdamW
from axondist.zero import ZeroRedundancyOptimizer, shard_elements

KINDS = {
    "sgd": (SGD, {"lr": 0.1}),
    "sgd-momentum": (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "adamw": (AdamW, {"lr": 0.01}),
}


def shapes_of(seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng([seed, 1])
    return [tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(0, 3))))
            for _ in range(int(rng.integers(1, 6)))]


def make_params(seed: int, dtype: str = "float32") -> list[ad.Parameter]:
    rng = np.random.default_rng([seed, 2])
    return [ad.Parameter(rng.standard_normal(s).astype(dtype), name=f"p{i}")
            for i, s in enumerate(shapes_of(seed))]


def batch(seed: int, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    d = sum(math.prod(s) for s in shapes_of(seed))
    rng = np.random.default_rng([seed, 3, rank, step])
    return rng.standard_normal((4, d)) / math.sqrt(d), rng.standard_normal(4)


def grad_fn(arrays: list, x: np.ndarray, y: np.ndarray, skip: int | None = None) -> tuple:
    """mean((x @ theta - y)^2) over every parameter at once; ``skip`` gets no gradient."""
    theta = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays])
    r = x @ theta - y
    g = 2.0 / len(y) * (x.T @ r)
    grads, off = [], 0
    for i, a in enumerate(arrays):
        grads.append(None if i == skip else g[off:off + a.size].reshape(a.shape).astype(a.dtype))
        off += a.size
    return float(np.mean(r * r)), grads


def reference(seed: int, ranks: int, steps: range, kind: str, params: list | None = None,
              opt: object = None, skip: int | None = None) -> tuple[list, object]:
    """The plain optimizer on the concatenated batches of ``ranks`` ranks."""
    params = params if params is not None else make_params(seed)
    cls, kw = KINDS[kind]
    opt = opt if opt is not None else cls(params, **kw)
    for step in steps:
        xs, ys = zip(*(batch(seed, r, step) for r in range(ranks)))
        _, grads = grad_fn([p.data for p in params], np.concatenate(xs), np.concatenate(ys),
                           skip)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
    return params, opt


def train(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, seed: int, rank: int,
          steps: range) -> None:
    for step in steps:
        ddp.backward(*batch(seed, rank, step))
        zero.step()
        zero.zero_grad()


def build(params: list, group: ad.ProcessGroup, kind: str, skip: int | None = None,
          unit_size_mb: float = 16.0) -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    ddp = DistributedDataParallel(params, group, missing_grad="error",
                                  grad_fn=lambda a, x, y: grad_fn(a, x, y, skip))
    cls, kw = KINDS[kind]
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), cls, group, unit_size_mb=unit_size_mb,
                                        **kw)


@given(world_size=world_sizes(1, 4), kind=st.sampled_from(sorted(KINDS)),
       seed=st.integers(0, 10_000), skip=st.sampled_from([None, 0]),
       tiny_units=st.booleans())
@settings(max_examples=25)
def test_trains_like_the_unsharded_optimizer(world_size: int, kind: str, seed: int,
                                             skip: int | None, tiny_units: bool) -> None:
    def body(world: ad.World) -> None:
        params = make_params(seed)
        ddp, zero = build(params, world, kind, skip, 1e-5 if tiny_units else 16.0)
        train(ddp, zero, seed, world.rank, range(3))
        want, ref = reference(seed, world.world_size, range(3), kind, skip=skip)
        for p, q in zip(params, want):
            np.testing.assert_allclose(p.data, q.data, rtol=1e-5, atol=1e-6)
        # the consolidated state is the plain optimizer's, array for array
        sd, ref_sd = zero.state_dict(), ref.state_dict()
        assert sd["optimizer"] == ref_sd["optimizer"] and sd["step_count"] == 3
        assert sd["hyperparameters"] == ref_sd["hyperparameters"]
        assert sorted(sd["state"]) == sorted(ref_sd["state"])
        for i, entry in ref_sd["state"].items():
            assert sd["state"][i]["step"] == entry["step"]
            for name in entry:
                if name != "step":
                    assert isinstance(sd["state"][i][name], np.ndarray)
                    np.testing.assert_allclose(sd["state"][i][name], entry[name], rtol=1e-5,
                                               atol=1e-7)

    run_world(body, world_size)


@given(world_size=world_sizes(1, 4), kind=st.sampled_from(["adam", "sgd-momentum"]),
       seed=st.integers(0, 10_000))
@settings(max_examples=10)
def test_optimizer_state_is_split_over_the_ranks(world_size: int, kind: str, seed: int) -> None:
    def body(world: ad.World) -> tuple[int, int]:
        params = make_params(seed)
        ddp, zero = build(params, world, kind)
        train(ddp, zero, seed, world.rank, range(1))
        per_element = (2 if kind == "adam" else 1) * 4
        mine = zero.local_state_bytes()
        assert mine == per_element * shard_elements(zero.units, world.rank)
        # at most one shard per unit: the padded unit over the ranks, rounded up
        assert mine <= per_element * sum(u.shard_size for u in zero.units)
        return mine, world.world_size

    results = run_world(body, world_size)
    if len(results) > 1:  # the mock world sees every rank: the shares add up to the whole
        _, ref = reference(seed, world_size, range(1), kind)
        whole = sum(v.nbytes for s in ref.state.values() for v in s.values()
                    if hasattr(v, "nbytes"))
        assert sum(m for m, _ in results) == whole


@given(world_size=world_sizes(2, 4), data=st.data(), kind=st.sampled_from(["adam", "adamw"]),
       seed=st.integers(0, 10_000))
@settings(max_examples=10)
def test_state_dict_round_trips_at_another_world_size(world_size: int, data, kind: str,
                                                      seed: int) -> None:
    """Train 2 steps at N ranks, save; load at M ranks (or the plain optimizer), 1 more step."""
    n_save = data.draw(st.integers(1, world_size), label="save ranks")
    n_load = data.draw(st.integers(1, world_size), label="load ranks")

    def body(world: ad.World) -> None:
        save_group = world.new_group(range(n_save))
        load_group = world.new_group(range(n_load))
        saved = values = None
        if save_group.is_member:
            params = make_params(seed)
            ddp, zero = build(params, save_group, kind)
            train(ddp, zero, seed, save_group.rank, range(2))
            saved, values = zero.state_dict(), [p.data.copy() for p in params]
        backend = world.backend
        saved, values = backend.broadcast_object((saved, values), 0)
        want, ref_opt = reference(seed, n_save, range(2), kind)
        reference(seed, n_load, range(2, 3), kind, params=want, opt=ref_opt)
        # the consolidated state loads into the plain optimizer too
        cls, kw = KINDS[kind]
        plain = [ad.Parameter(v.copy()) for v in values]
        plain_opt = cls(plain, **kw)
        plain_opt.load_state_dict(saved)
        reference(seed, n_load, range(2, 3), kind, params=plain, opt=plain_opt)
        if load_group.is_member:
            params = [ad.Parameter(v.copy(), name=f"p{i}") for i, v in enumerate(values)]
            ddp, zero = build(params, load_group, kind)
            zero.load_state_dict(saved)
            assert zero.step_count == 2
            train(ddp, zero, seed, load_group.rank, range(2, 3))
            for p, q, r in zip(params, plain, want):
                np.testing.assert_allclose(p.data, q.data, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(p.data, r.data, rtol=1e-5, atol=1e-6)

    run_world(body, world_size)


def test_mixed_dtypes_and_more_ranks_than_elements() -> None:
    """float64 and float32 parameters in separate units; a rank may own nothing."""
    def body(world: ad.World) -> None:
        params = [ad.Parameter(np.ones(2, np.float64), "a"), ad.Parameter(np.ones(1, np.float32),
                                                                           "b")]
        zero = ZeroRedundancyOptimizer(params, Adam, world, lr=0.1)
        assert [u.dtype for u in zero.units] == [np.float64, np.float32]
        for p in params:
            p.grad = np.ones_like(p.data)
        zero.step()
        for p in params:
            np.testing.assert_allclose(p.data, 1 - 0.1, rtol=1e-6)
            assert p.data.dtype == p.grad.dtype
        assert zero.local_state_bytes() == 16 * shard_elements(zero.units[:1], world.rank) + \
            8 * shard_elements(zero.units[1:], world.rank)

    run_world(body, current_size(3))


def test_errors_are_clear() -> None:
    def body(world: ad.World) -> None:
        params = make_params(4)
        with pytest.raises(TypeError, match="optimizer_class must be an axondist optimizer"):
            ZeroRedundancyOptimizer(params, object, world)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="betas must be two numbers"):
            ZeroRedundancyOptimizer(params, Adam, world, betas=(2.0, 0.5))
        zero = ZeroRedundancyOptimizer(params, Adam, world, lr=0.01)
        params[0].grad = np.zeros(params[0].size + 1, np.float32)
        with pytest.raises(ValueError, match="has shape .* but its .grad has shape"):
            zero.step()
        zero.zero_grad()
        sd = zero.state_dict()
        with pytest.raises(ValueError, match="of optimizer 'Adam', not 'SGD'"):
            ZeroRedundancyOptimizer(params, SGD, world, lr=0.1).load_state_dict(sd)
        bad = {**sd, "state": {0: {"step": 1, "exp_avg": np.zeros(99),
                                   "exp_avg_sq": np.zeros(99)}}}
        with pytest.raises(ValueError, match="state 'exp_avg' of parameter 0 has shape"):
            zero.load_state_dict(bad)
        with pytest.raises(ValueError, match="parameter index 40"):
            zero.load_state_dict({**sd, "state": {40: {"step": 1}}})
        if world.world_size > 1:
            odd = make_params(4) + ([ad.Parameter(np.ones(1, np.float32))]
                                    if world.rank == world.world_size - 1 else [])
            with pytest.raises(CollectiveMismatchError, match="parameters differ: rank"):
                ZeroRedundancyOptimizer(odd, Adam, world)

    run_world(body, current_size(2))


def test_bad_params_and_complex_gradients_are_refused_on_every_rank() -> None:
    def body(world: ad.World) -> None:
        with pytest.raises(TypeError, match="ZeroRedundancyOptimizer: params must be a model, a "
                                            "Parameter or a list of Parameters .*got NoneType"):
            ZeroRedundancyOptimizer(None, SGD, world, lr=0.1)
        params = make_params(4)
        before = [p.data.copy() for p in params]
        zero = ZeroRedundancyOptimizer(params, SGD, world, lr=0.1)
        for p in params:
            p.grad = np.ones(p.shape, np.float32)
        params[1].grad = params[1].grad * (1 + 1j)  # every rank: the gradients are replicated
        with pytest.raises(UnsupportedDTypeError, match="ZeroRedundancyOptimizer.step: the "
                                                        "gradient of parameter 1 .* complex64"):
            zero.step()
        for p, b in zip(params, before):  # nothing moved, on any rank
            np.testing.assert_array_equal(p.data, b)

    run_world(body, current_size(2))


@mock_only
def test_lr_passes_through() -> None:
    def body(world: ad.World) -> float:
        zero = ZeroRedundancyOptimizer(make_params(1), SGD, world, lr=0.5)
        zero.lr = 0.25
        assert "SGD" in repr(zero) and "2 ranks" in repr(zero)
        return zero.optim.lr

    assert ad.spawn(body, 2) == [0.25, 0.25]


# --- sharded checkpoints ----------------------------------------------------------------------

def shared_dir(world: ad.World, base: str | None) -> str:
    """A fresh directory every rank sees: made by rank 0, its path broadcast."""
    path = tempfile.mkdtemp(prefix="zero-ckpt-", dir=base) if world.rank == 0 else None
    return comm.broadcast_object(path, world)


def written_by_rank(path: str, n: int) -> list[int]:
    """Optimizer-state elements each of ``n`` ranks wrote into the latest checkpoint."""
    out = [0] * n
    index = CheckpointReader(path).index
    state_flats = {t["flat"] for name, t in index["tensors"].items() if name.startswith("optim/")}
    for flat in state_flats:
        for shard in index["flats"][flat]["shards"]:
            out[int(re.search(r"\.rank(\d+)", shard["file"]).group(1))] += (shard["stop"]
                                                                          - shard["start"])
    return out


def zeroed(seed: int) -> list[ad.Parameter]:
    """The model of ``seed`` holding zeros: a load must fill every value."""
    params = make_params(seed)
    for p in params:
        p.data[...] = 0
    return params


def assert_state_equal(got: dict, want: dict) -> None:
    assert got["optimizer"] == want["optimizer"] and got["step_count"] == want["step_count"]
    assert got["hyperparameters"] == want["hyperparameters"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        assert got["state"][i]["step"] == entry["step"]
        for name in entry:
            if name != "step":
                np.testing.assert_allclose(np.asarray(got["state"][i][name]), entry[name],
                                           rtol=1e-5, atol=1e-7)


@given(kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 10_000),
       skip=st.sampled_from([None, 0]), middle=st.sampled_from(["zero", "shard_optimizer"]),
       async_save=st.booleans())
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sharded_checkpoint_two_to_three_to_one_rank(tmp_path, kind: str, seed: int,
                                                     skip: int | None, middle: str,
                                                     async_save: bool) -> None:
    """ZeRO on 2 ranks saves (each rank its own state shards); 3 ranks load it (ZeRO, or FSDP
    SHARD_OPTIMIZER), train a step, save; 1 rank of ZeRO, then the plain optimizer, load that:
    every stage equals the uninterrupted single-process run. A parameter that never gets a
    gradient (``skip``) has no state, and still loads under strict."""
    cls, kw = KINDS[kind]
    base = None if LAUNCHED else str(tmp_path)

    def body(world: ad.World) -> None:
        n = world.world_size
        n_save = min(2, n)
        path = shared_dir(world, base)
        ckpt = Checkpointer(path)
        save_group, one = world.new_group(range(n_save)), world.new_group([0])
        want, ref = reference(seed, n_save, range(2), kind, skip=skip)
        if save_group.is_member:  # 1. ZeRO over 2 ranks: 2 steps, save
            ddp, zero = build(make_params(seed), save_group, kind, skip)
            train(ddp, zero, seed, save_group.rank, range(2))
            ckpt.save(ddp, zero, step=2, async_save=async_save)
            ckpt.wait()
            held = sum(int(v.size) for s in zero.optim.state.values()
                       for name, v in s.items() if name != "step")
            assert written_by_rank(path, n_save)[save_group.rank] == held
        comm.barrier(world)
        # 2. every rank (3 by default): ZeRO or FSDP SHARD_OPTIMIZER loads, 1 step, save
        reference(seed, n, range(2, 3), kind, params=want, opt=ref, skip=skip)
        params = zeroed(seed)
        if middle == "zero":
            ddp, zero = build(params, world, kind, skip)
            assert ckpt.load(ddp, zero) == {}
            assert zero.step_count == 2
            train(ddp, zero, seed, world.rank, range(2, 3))
            ckpt.save(ddp, zero, step=3)
        else:
            f = FSDP(params, world, sharding_strategy="shard_optimizer",
                     units=[[i] for i in range(len(params))],
                     grad_fn=lambda a, x, y: grad_fn(a, x, y, skip))
            opt = cls(f.sharded_parameters(), **kw)
            ckpt.load(f, opt)
            f.step(*batch(seed, world.rank, 2), optimizer=opt)
            ckpt.save(f, opt, step=3)
        # 3. one rank of ZeRO loads, 1 step, saves; 4. the plain optimizer loads that
        reference(seed, 1, range(3, 4), kind, params=want, opt=ref, skip=skip)
        if one.is_member:
            params = zeroed(seed)
            ddp, zero = build(params, one, kind, skip)
            ckpt.load(ddp, zero)
            train(ddp, zero, seed, 0, range(3, 4))
            ckpt.save(ddp, zero, step=4, async_save=async_save)
            ckpt.wait()
            for p, q in zip(params, want):
                np.testing.assert_allclose(p.data, q.data, rtol=1e-5, atol=1e-6)
        comm.barrier(world)
        plain = zeroed(seed)
        plain_opt = cls(plain, **kw)
        load_sharded_checkpoint(path, plain, plain_opt)
        for p, q in zip(plain, want):
            np.testing.assert_allclose(p.data, q.data, rtol=1e-5, atol=1e-6)
        assert_state_equal(plain_opt.state_dict(), ref.state_dict())
        comm.barrier(world)
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    run_world(body, current_size(3))


def test_sharded_checkpoint_without_a_parameters_entry_is_refused_unless_not_strict(
        tmp_path) -> None:
    """The plain optimizer over all but parameter 0 saves; ZeRO over every parameter refuses
    to load that (on every rank) unless strict=False, when parameter 0's state starts fresh."""
    base = None if LAUNCHED else str(tmp_path)

    def body(world: ad.World) -> None:
        path = shared_dir(world, base)
        params = make_params(0)
        if world.rank == 0:
            opt = Adam(params[1:], lr=0.01)
            for p in params:
                p.grad = np.ones_like(p.data)
            opt.step()
            save_sharded_checkpoint(path, params, opt, group=world.new_group([0]))
        else:
            world.new_group([0])
        comm.barrier(world)
        ddp, zero = build(zeroed(0), world, "adam")
        with pytest.raises(CheckpointError, match="no optimizer entry for parameter 'p0'; pass "
                                                  "strict=False"):
            load_sharded_checkpoint(path, ddp, zero)
        load_sharded_checkpoint(path, ddp, zero, strict=False)
        sd = zero.state_dict()
        assert 0 not in sd["state"] and sorted(sd["state"]) == list(range(1, len(params)))
        comm.barrier(world)
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    run_world(body, current_size(2))


@given(world_size=world_sizes(1, 4), seed=st.integers(0, 10_000))
@settings(max_examples=8)
def test_sharded_state_dict_is_this_ranks_ranges_and_refuses_others(world_size: int,
                                                                    seed: int) -> None:
    """Each rank's ranges tile every parameter; its sharded state is the consolidated state
    cut to them and loads back; a range of another size or parameter is refused, naming it."""
    def body(world: ad.World) -> dict:
        params = make_params(seed)
        ddp, zero = build(params, world, "adam")
        train(ddp, zero, seed, world.rank, range(2))
        ranges, part, whole = zero.state_ranges(), zero.sharded_state_dict(), zero.state_dict()
        assert sorted(part["state"]) == sorted(ranges)
        for i, (lo, hi) in ranges.items():
            for name in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(part["state"][i][name],
                                              whole["state"][i][name].reshape(-1)[lo:hi])
        fresh = build([ad.Parameter(p.data.copy(), p.name) for p in params], world, "adam")[1]
        fresh.load_sharded_state_dict(part)
        assert fresh.sharded_state_dict()["step_count"] == 2
        for i in ranges:
            np.testing.assert_array_equal(fresh.sharded_state_dict()["state"][i]["exp_avg"],
                                          part["state"][i]["exp_avg"])
        where = "ZeroRedundancyOptimizer.load_sharded_state_dict"
        with pytest.raises(ValueError, match=f"{where}: expected a dict made by "
                                             "sharded_state_dict\\(\\), got list"):
            fresh.load_sharded_state_dict([])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="parameter index 99, of which this rank updates "
                                             "no elements"):
            fresh.load_sharded_state_dict({**part, "state": {99: {"step": 1}}})
        for i, (lo, hi) in list(ranges.items())[:1]:  # a rank may own no elements at all
            short = {**part, "state": {i: {**part["state"][i], "exp_avg": np.zeros(hi - lo + 1)}}}
            with pytest.raises(ValueError, match=f"state 'exp_avg' of parameter {i} has "
                                                 f"{hi - lo + 1} elements, its range "
                                                 f"\\[{lo}, {hi}\\)"):
                fresh.load_sharded_state_dict(short)
        return ranges

    results = run_world(body, world_size)
    if not LAUNCHED:  # the mock world sees every rank: the ranges tile each parameter
        for i, p in enumerate(make_params(seed)):
            spans = sorted(r[i] for r in results if i in r)
            assert spans[0][0] == 0 and spans[-1][1] == p.size
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
