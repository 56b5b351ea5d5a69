"""Tensor-parallel layers, their collectives and the 2-D mesh against dense NumPy.

Every rank derives the dense weights, inputs and output gradients from a
seed, so it can compute the dense forward and backward pass itself and
check its own outputs, its own shards and the gathered dense gradients.
Everything is float64, so the only differences are summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import mock_only, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist import tensor_parallel as tp
from axondist.ddp import DistributedDataParallel
from axondist.mesh import DeviceMesh, make_mesh, mesh_layout
from axondist.optim import SGD
from axondist.tensor_parallel import (
    ADJOINT,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
    adjoint,
    gather_first_axis,
    gather_last_axis,
    identity,
    reduce_scatter_first_axis,
    reduce_sum,
    shard_bounds,
    split_last_axis,
)

TOL = dict(rtol=1e-10, atol=1e-10)
seeds = st.integers(0, 2**31 - 1)
batch_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
features = st.integers(1, 9)  # often smaller than, or not a multiple of, the world size


def normal(seed: int, tag: int, shape: tuple[int, ...], rank: int = -1) -> np.ndarray:
    """A seeded float64 array; ``rank`` >= 0 makes a per-rank one."""
    return np.random.default_rng([seed, tag, rank + 1]).standard_normal(shape)


def rows(a: np.ndarray) -> np.ndarray:
    """``a`` as (batch, features)."""
    return a.reshape(int(np.prod(a.shape[:-1])), a.shape[-1])


def bounds(world: ad.ProcessGroup, length: int) -> slice:
    return slice(*shard_bounds(length, world.world_size, world.rank))


def dense_linear(x, w, b, gy):
    """y, dx, dW, db of ``y = x @ W.T + b``."""
    y = x @ w.T + (0 if b is None else b)
    return y, gy @ w, rows(gy).T @ rows(x), None if b is None else rows(gy).sum(axis=0)


def test_shard_bounds_follow_array_split():
    for length in range(12):
        for parts in range(1, 7):
            pieces = np.array_split(np.arange(length), parts)
            for i, piece in enumerate(pieces):
                start, stop = shard_bounds(length, parts, i)
                assert list(range(start, stop)) == piece.tolist()


# --- the adjoint pairs ----------------------------------------------------------------

def test_adjoint_table_pairs_each_collective_with_its_partner():
    for fn, adj in ADJOINT.items():
        assert adjoint(adjoint(fn)) is fn
        assert adj is not fn
    assert adjoint(identity) is reduce_sum and adjoint(split_last_axis) is gather_last_axis
    assert adjoint(gather_first_axis) is reduce_scatter_first_axis
    with pytest.raises(ValueError, match="adjoint: 'sum' is not one of the paired collectives"):
        adjoint(sum)


def _body_mappings(world, seed, batch, width):
    p, r = world.world_size, world.rank
    # identity <-> reduce_sum: u is replicated, v differs per rank.
    u = normal(seed, 1, batch + (width,))
    v = [normal(seed, 2, batch + (width,), k) for k in range(p)]
    assert identity(u, world) is u
    summed = reduce_sum(v[r].copy(), world)
    np.testing.assert_allclose(summed, sum(v), **TOL)
    # <identity(u), v> summed over ranks == <u, reduce_sum(v)> (replicated: counted once)
    np.testing.assert_allclose(sum(np.vdot(u, vk) for vk in v), np.vdot(u, summed), **TOL)

    # split_last_axis <-> gather_last_axis: X replicated, H holds per-rank blocks.
    x = normal(seed, 3, batch + (width,))
    mine = split_last_axis(x, world)
    np.testing.assert_array_equal(mine, x[..., bounds(world, width)])
    h_full = [normal(seed, 4, batch + (width,), k) for k in range(p)]
    h = [h_full[k][..., slice(*shard_bounds(width, p, k))] for k in range(p)]
    gathered = gather_last_axis(np.ascontiguousarray(h[r]), world)
    np.testing.assert_array_equal(gathered, np.concatenate(h, axis=-1))
    sizes = [hk.shape[-1] for hk in h]
    np.testing.assert_array_equal(gather_last_axis(h[r], world, sizes=sizes), gathered)
    lhs = sum(np.vdot(x[..., slice(*shard_bounds(width, p, k))], h[k]) for k in range(p))
    np.testing.assert_allclose(lhs, np.vdot(x, gathered), **TOL)

    # gather_first_axis <-> reduce_scatter_first_axis: both sides distributed.
    length = width  # rows along axis 0
    xs = normal(seed, 5, (length,) + batch)
    x_mine = xs[bounds(world, length)]
    full = gather_first_axis(x_mine, world)
    np.testing.assert_array_equal(full, xs)
    g = [normal(seed, 6, (length,) + batch, k) for k in range(p)]
    scattered = reduce_scatter_first_axis(g[r], world)
    np.testing.assert_allclose(scattered, sum(g)[bounds(world, length)], **TOL)
    # sum_r <gather(x)_r, g_r> == sum_r <x_r, reduce_scatter(g)_r>
    rhs = comm.all_reduce_sum(np.array([np.vdot(x_mine, scattered)]), world)[0]
    np.testing.assert_allclose(sum(np.vdot(xs, gk) for gk in g), rhs, **TOL)


@given(n=world_sizes(1, 6), seed=seeds, batch=batch_shapes, width=features)
@settings(max_examples=25)
def test_collective_pairs_are_adjoint(n, seed, batch, width):
    run_world(_body_mappings, n, seed, batch, width)


# --- the layers -------------------------------------------------------------------------

def _body_column(world, seed, n_in, n_out, batch, use_bias, gather_output):
    w = normal(seed, 1, (n_out, n_in))
    b = normal(seed, 2, (n_out,)) if use_bias else None
    x = normal(seed, 3, batch + (n_in,))
    gy = normal(seed, 4, batch + (n_out,))
    want_y, want_dx, want_dw, want_db = dense_linear(x, w, b, gy)
    mine = bounds(world, n_out)

    layer = ColumnParallelLinear.from_dense(w, b, world, gather_output=gather_output)
    assert layer.weight.shape == (mine.stop - mine.start, n_in)
    np.testing.assert_array_equal(layer.weight.data, w[mine])
    y = layer.forward(x)
    np.testing.assert_allclose(y, want_y if gather_output else want_y[..., mine], **TOL)
    dx = layer.backward(gy if gather_output else gy[..., mine])
    np.testing.assert_allclose(dx, want_dx, **TOL)
    np.testing.assert_allclose(layer.weight.grad, want_dw[mine], **TOL)
    full_w, full_b = layer.full_weights()
    full_dw, full_db = layer.full_grads()
    np.testing.assert_array_equal(full_w, w)
    np.testing.assert_allclose(full_dw, want_dw, **TOL)
    if use_bias:
        np.testing.assert_allclose(layer.bias.grad, want_db[mine], **TOL)
        np.testing.assert_array_equal(full_b, b)
        np.testing.assert_allclose(full_db, want_db, **TOL)
    else:
        assert layer.bias is None and full_b is None and full_db is None
        assert layer.parameters() == [layer.weight]


@given(n=world_sizes(1, 6), seed=seeds, n_in=features, n_out=features, batch=batch_shapes,
       use_bias=st.booleans(), gather_output=st.booleans())
@settings(max_examples=30)
def test_column_parallel_matches_dense(n, seed, n_in, n_out, batch, use_bias, gather_output):
    run_world(_body_column, n, seed, n_in, n_out, batch, use_bias, gather_output)


def _body_row(world, seed, n_in, n_out, batch, use_bias, input_is_parallel):
    w = normal(seed, 1, (n_out, n_in))
    b = normal(seed, 2, (n_out,)) if use_bias else None
    x = normal(seed, 3, batch + (n_in,))
    gy = normal(seed, 4, batch + (n_out,))
    want_y, want_dx, want_dw, want_db = dense_linear(x, w, b, gy)
    mine = bounds(world, n_in)

    layer = RowParallelLinear.from_dense(w, b, world, input_is_parallel=input_is_parallel)
    np.testing.assert_array_equal(layer.weight.data, w[:, mine])
    y = layer.forward(x[..., mine] if input_is_parallel else x)
    np.testing.assert_allclose(y, want_y, **TOL)
    dx = layer.backward(gy)
    np.testing.assert_allclose(dx, want_dx[..., mine] if input_is_parallel else want_dx, **TOL)
    np.testing.assert_allclose(layer.weight.grad, want_dw[:, mine], **TOL)
    full_w, full_b = layer.full_weights()
    full_dw, full_db = layer.full_grads()
    np.testing.assert_array_equal(full_w, w)
    np.testing.assert_allclose(full_dw, want_dw, **TOL)
    if use_bias:
        # the replicated bias: every rank holds the full bias and the full bias gradient
        np.testing.assert_array_equal(layer.bias.data, b)
        np.testing.assert_allclose(layer.bias.grad, want_db, **TOL)
        np.testing.assert_array_equal(full_b, b)
    else:
        assert layer.bias is None and full_b is None and full_db is None


@given(n=world_sizes(1, 6), seed=seeds, n_in=features, n_out=features, batch=batch_shapes,
       use_bias=st.booleans(), input_is_parallel=st.booleans())
@settings(max_examples=30)
def test_row_parallel_matches_dense(n, seed, n_in, n_out, batch, use_bias, input_is_parallel):
    run_world(_body_row, n, seed, n_in, n_out, batch, use_bias, input_is_parallel)


def _body_accumulate(world, seed):
    w, b = normal(seed, 1, (5, 3)), normal(seed, 2, (5,))
    x1, x2 = normal(seed, 3, (4, 3)), normal(seed, 4, (2, 3))
    g1, g2 = normal(seed, 5, (4, 5)), normal(seed, 6, (2, 5))
    for layer in (ColumnParallelLinear.from_dense(w, b, world),
                  RowParallelLinear.from_dense(w, b, world)):
        layer.forward(x1)
        layer.backward(g1)
        first = layer.weight.grad
        layer.forward(x2)
        layer.backward(g2, accumulate=True)
        assert layer.weight.grad is first, "accumulating writes into the existing gradient"
        dw, db = layer.full_grads()
        np.testing.assert_allclose(dw, g1.T @ x1 + g2.T @ x2, **TOL)
        np.testing.assert_allclose(db, g1.sum(0) + g2.sum(0), **TOL)
        layer.forward(x2)
        layer.backward(g2)  # without accumulate: overwritten
        np.testing.assert_allclose(layer.full_grads()[0], g2.T @ x2, **TOL)


@given(n=world_sizes(1, 4), seed=seeds)
@settings(max_examples=5)
def test_backward_can_accumulate_gradients(n, seed):
    run_world(_body_accumulate, n, seed)


# --- the MLP block ----------------------------------------------------------------------

C = np.sqrt(2.0 / np.pi)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def ref_act(name, h):
    """The activation and its derivative, written independently of the library
    (tanh-GELU as x * sigmoid(2z), since (1 + tanh z) / 2 = sigmoid(2z))."""
    if name == "relu":
        return np.maximum(h, 0), (h > 0).astype(h.dtype)
    z = C * (h + 0.044715 * h**3)
    s = _sigmoid(2 * z)
    return h * s, s + h * s * (1 - s) * 2 * C * (1 + 3 * 0.044715 * h**2)


def test_reference_activation_derivatives_match_finite_differences():
    h = np.linspace(-4, 4, 81)
    eps = 1e-6
    for name in ("gelu", "relu"):
        h_ = h[np.abs(h) > 1e-3] if name == "relu" else h
        fd = (ref_act(name, h_ + eps)[0] - ref_act(name, h_ - eps)[0]) / (2 * eps)
        np.testing.assert_allclose(ref_act(name, h_)[1], fd, rtol=1e-6, atol=1e-8)


def dense_mlp(x, w1, b1, w2, b2, act, gy):
    """y, dx and the four dense gradients of ``act(x W1^T + b1) W2^T + b2``."""
    h = x @ w1.T + b1
    a, da = ref_act(act, h)
    y = a @ w2.T + b2
    ga = gy @ w2
    gh = ga * da
    return y, gh @ w1, {"fc1": (rows(gh).T @ rows(x), rows(gh).sum(0)),
                        "fc2": (rows(gy).T @ rows(a), rows(gy).sum(0))}


def _body_mlp(world, seed, n_in, hidden, n_out, batch, act):
    w1, b1 = normal(seed, 1, (hidden, n_in)), normal(seed, 2, (hidden,))
    w2, b2 = normal(seed, 3, (n_out, hidden)), normal(seed, 4, (n_out,))
    x, gy = normal(seed, 5, batch + (n_in,)), normal(seed, 6, batch + (n_out,))
    want_y, want_dx, want_grads = dense_mlp(x, w1, b1, w2, b2, act, gy)

    mlp = TensorParallelMLP.from_dense(w1, b1, w2, b2, world, activation=act)
    assert [p.name for p in mlp.parameters()] == ["fc1.weight", "fc1.bias", "fc2.weight",
                                                   "fc2.bias"]
    np.testing.assert_allclose(mlp.forward(x), want_y, **TOL)
    np.testing.assert_allclose(mlp.backward(gy), want_dx, **TOL)
    grads = mlp.full_grads()
    weights = mlp.full_weights()
    for name, dense in (("fc1", (w1, b1)), ("fc2", (w2, b2))):
        for got, want in zip(grads[name], want_grads[name]):
            np.testing.assert_allclose(got, want, **TOL)
        for got, want in zip(weights[name], dense):
            np.testing.assert_array_equal(got, want)
    mine = bounds(world, hidden)
    np.testing.assert_allclose(mlp.fc1.weight.grad, want_grads["fc1"][0][mine], **TOL)
    np.testing.assert_allclose(mlp.fc2.weight.grad, want_grads["fc2"][0][:, mine], **TOL)


@given(n=world_sizes(1, 6), seed=seeds, n_in=features, hidden=st.integers(1, 13),
       n_out=features, batch=batch_shapes, act=st.sampled_from(["gelu", "relu"]))
@settings(max_examples=30)
def test_mlp_matches_dense(n, seed, n_in, hidden, n_out, batch, act):
    run_world(_body_mlp, n, seed, n_in, hidden, n_out, batch, act)


# --- seeded construction ---------------------------------------------------------------

def _body_seeded(world, seed, n_in, n_out):
    solo = ad.World.mock()  # a one-rank world: the dense layer the seed stands for
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(n_in, n_out, group=world, dtype=np.float64, seed=seed)
        dense = cls(n_in, n_out, group=solo, dtype=np.float64, seed=seed)
        w, b = layer.full_weights()
        np.testing.assert_array_equal(w, dense.weight.data)
        np.testing.assert_array_equal(b, dense.bias.data)
        assert w.shape == (n_out, n_in) and layer.weight.dtype == np.float64
        bound = 1 / np.sqrt(n_in)
        assert np.all(np.abs(w) <= bound) and np.all(np.abs(b) <= bound)
        other = cls(n_in, n_out, group=solo, dtype=np.float64, seed=seed + 1)
        assert not np.array_equal(other.weight.data, dense.weight.data)
    mlp = TensorParallelMLP(n_in, 7, n_out, world, dtype=np.float64, seed=seed)
    solo_mlp = TensorParallelMLP(n_in, 7, n_out, solo, dtype=np.float64, seed=seed)
    full = mlp.full_weights()
    for name, layer in (("fc1", solo_mlp.fc1), ("fc2", solo_mlp.fc2)):
        np.testing.assert_array_equal(full[name][0], layer.weight.data)
        np.testing.assert_array_equal(full[name][1], layer.bias.data)
    assert not np.array_equal(full["fc1"][1][:1], full["fc2"][1][:1]), "layers draw distinct seeds"
    # a custom initializer sees the full shape, and its result is sliced
    col = ColumnParallelLinear(n_in, n_out, group=world, dtype=np.float64,
                               init=lambda rng, shape: np.arange(np.prod(shape)).reshape(shape))
    np.testing.assert_array_equal(col.full_weights()[0],
                                  np.arange(n_out * n_in).reshape(n_out, n_in))


@given(n=world_sizes(1, 6), seed=st.integers(0, 2**30), n_in=features, n_out=features)
@settings(max_examples=15)
def test_seeded_layers_are_the_same_dense_layer_at_any_world_size(n, seed, n_in, n_out):
    run_world(_body_seeded, n, seed, n_in, n_out)


# --- errors -----------------------------------------------------------------------------

def _body_errors(world):
    n = world.world_size
    col = ColumnParallelLinear(4, 6, group=world)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(in_features=4, out_features=6, "
                                         r"rank \d+ of \d+.*input of shape \(3, 5\) has last "
                                         r"dimension 5, expected in_features=4"):
        col.forward(np.ones((3, 5)))
    with pytest.raises(ValueError, match="input of shape \\(\\) has last dimension none"):
        col.forward(np.float64(1.0))
    with pytest.raises(RuntimeError, match="ColumnParallelLinear.*backward: called before forward"):
        col.backward(np.ones((3, 6)))
    col.forward(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"grad_y of shape \(3, 5\), expected the forward "
                                         r"output's shape \(3, 6\)"):
        col.backward(np.ones((3, 5)))

    row = RowParallelLinear(6, 4, group=world, input_is_parallel=True)
    local = comm.split_sizes(6, n)[world.rank]
    with pytest.raises(ValueError, match=rf"RowParallelLinear\(in_features=6.*input of shape "
                                         rf"\(2, {local + 1}\).*expected "
                                         rf"shard_sizes\[{world.rank}\]={local}"):
        row.forward(np.ones((2, local + 1)))
    with pytest.raises(ValueError, match=r"RowParallelLinear.*\(2, 3\).*expected in_features=6"):
        RowParallelLinear(6, 4, group=world).forward(np.ones((2, 3)))

    with pytest.raises(ValueError, match=r"from_dense: weight of shape \(4,\) must be 2-D"):
        ColumnParallelLinear.from_dense(np.ones(4), None, world)
    with pytest.raises(ValueError, match=r"from_dense: bias of shape \(3,\) does not match "
                                         r"weight \(4, 2\); expected \(4,\)"):
        RowParallelLinear.from_dense(np.ones((4, 2)), np.ones(3), world)
    with pytest.raises(ValueError, match="activation='tanh' is not supported; choose one of "
                                         r"\['gelu', 'relu'\]"):
        TensorParallelMLP(2, 4, 2, world, activation="tanh")
    with pytest.raises(ValueError, match="must be positive"):
        ColumnParallelLinear(0, 3, group=world)

    with pytest.raises(ValueError, match=rf"make_mesh: tp_size={n + 1} does not divide the "
                                         rf"world size {n}"):
        make_mesh(world, n + 1)
    with pytest.raises(ValueError, match=rf"DeviceMesh: shape=\(2, {n}\) holds {2 * n} ranks"):
        DeviceMesh(world, (2, n))
    with pytest.raises(ValueError, match="one distinct name per axis"):
        DeviceMesh(world, (1, n), names=("tp", "tp"))


@given(n=world_sizes(1, 4))
@settings(max_examples=4)
def test_errors_name_the_layer_and_the_shapes(n):
    run_world(_body_errors, n)


# --- the 2-D mesh and TP x DP training ------------------------------------------------

def _body_mesh(world, tp, seed):
    n = world.world_size
    layout = mesh_layout(n, tp)
    mesh = make_mesh(world, tp)
    tp_group, dp_group = mesh.group("tp"), mesh["dp"]
    assert tp_group.ranks in layout.tp_groups and world.rank in tp_group.ranks
    assert dp_group.ranks in layout.dp_groups and world.rank in dp_group.ranks
    assert mesh.coords == layout.coords(world.rank) == (dp_group.rank, tp_group.rank)
    assert mesh.size("tp") == tp and mesh.size("dp") == n // tp
    # the groups really communicate among exactly their members
    for group in (tp_group, dp_group):
        got = comm.all_reduce_sum(normal(seed, 1, (3,), world.rank), group)
        np.testing.assert_allclose(got, sum(normal(seed, 1, (3,), k) for k in group.ranks),
                                   **TOL)
    # a 3-D mesh: one group per axis, each the line of the rank grid through this rank
    grid = np.arange(n).reshape(n // tp, 1, tp)
    cube = DeviceMesh(world, grid.shape, names=("dp", "pp", "tp"))
    i, j, k = np.argwhere(grid == world.rank)[0]
    assert cube.group("dp").ranks == tuple(grid[:, j, k].tolist())
    assert cube.group("pp").ranks == (world.rank,)
    assert cube.group("tp").ranks == tuple(grid[i, j, :].tolist())
    assert cube.coords == (i, j, k)
    with pytest.raises(KeyError, match=r"no axis named 'ep'; the axes are \('dp', 'pp', 'tp'\)"):
        cube.group("ep")


@given(n=world_sizes(1, 6), data=st.data(), seed=seeds)
@settings(max_examples=12)
def test_make_mesh_builds_the_layout_groups(n, data, seed):
    tp = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    run_world(_body_mesh, n, tp, seed)


LR = 0.1


def _dense_training(seed, dims, steps, act, x, t):
    n_in, hidden, n_out = dims
    w = [normal(seed, 1, (hidden, n_in)), normal(seed, 2, (hidden,)),
         normal(seed, 3, (n_out, hidden)), normal(seed, 4, (n_out,))]
    for _ in range(steps):
        h = x @ w[0].T + w[1]
        y = ref_act(act, h)[0] @ w[2].T + w[3]
        _, _, grads = dense_mlp(x, *w, act, (y - t) / len(x))
        for p, g in zip(w, grads["fc1"] + grads["fc2"]):
            p -= LR * g
    return w


def _body_tp_dp(world, tp, seed, steps, act):
    mesh = make_mesh(world, tp)
    tp_group, dp_group = mesh.group("tp"), mesh.group("dp")
    rng = np.random.default_rng([seed, 99])
    dims = tuple(int(d) for d in rng.integers(1, 8, size=3))
    batch = int(rng.integers(dp_group.world_size, 4 * dp_group.world_size + 1))  # uneven shares
    x, t = normal(seed, 5, (batch, dims[0])), normal(seed, 6, (batch, dims[2]))
    w = [normal(seed, k, s) for k, s in enumerate(
        [(dims[1], dims[0]), (dims[1],), (dims[2], dims[1]), (dims[2],)], start=1)]

    mlp = TensorParallelMLP.from_dense(*w, group=tp_group, activation=act)
    ddp = DistributedDataParallel(mlp, dp_group)  # replicas of the same shards average grads
    opt = SGD(ddp.parameters(), lr=LR)
    share = bounds(dp_group, batch)
    n_local = share.stop - share.start
    for _ in range(steps):
        y = mlp.forward(x[share])
        mlp.backward((y - t[share]) / n_local)  # the gradient of this replica's mean loss
        ddp.sync_gradients(num_samples=n_local)  # sample-weighted: the full batch's mean
        opt.step()
        opt.zero_grad()

    want = _dense_training(seed, dims, steps, act, x, t)
    full = mlp.full_weights()
    got = list(full["fc1"]) + list(full["fc2"])
    for g, wnt in zip(got, want):
        np.testing.assert_allclose(g, wnt, rtol=1e-9, atol=1e-10)


@given(n=world_sizes(1, 6), data=st.data(), seed=seeds, act=st.sampled_from(["gelu", "relu"]))
@settings(max_examples=12)
def test_tp_x_dp_training_matches_dense_training(n, data, seed, act):
    tp = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    run_world(_body_tp_dp, n, tp, seed, 3, act)


@mock_only
@pytest.mark.parametrize("n, tp", [(4, 2), (6, 2), (6, 3)])
def test_tp_x_dp_training_on_the_issue_meshes(n, tp):
    run_world(_body_tp_dp, n, tp, 2024, 4, "gelu")


# --- the attention block --------------------------------------------------------------

def dense_attention(x, w_qkv, b_qkv, w_out, b_out, heads, causal):
    """Y of the dense attention block, one head at a time (the textbook loop)."""
    d = x.shape[-1]
    dh = d // heads
    qkv = x @ w_qkv.T + (0 if b_qkv is None else b_qkv)
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    t = x.shape[-2]
    outs = []
    for h in range(heads):
        f = slice(h * dh, (h + 1) * dh)
        s = q[..., f] @ np.swapaxes(k[..., f], -1, -2) / np.sqrt(dh)
        if causal:
            s = s + np.triu(np.full((t, t), -np.inf), 1)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        outs.append((e / e.sum(axis=-1, keepdims=True)) @ v[..., f])
    return np.concatenate(outs, axis=-1) @ w_out.T + (0 if b_out is None else b_out)


def numeric_grad(f, a, eps=1e-6):
    """Central differences of the scalar f() with respect to every element of ``a`` (in place)."""
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        old = a[i]
        a[i] = old + eps
        hi = f()
        a[i] = old - eps
        lo = f()
        a[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


@given(seed=seeds, t=st.integers(1, 4), dh=st.integers(1, 3), causal=st.booleans())
@settings(max_examples=15)
def test_attention_backward_matches_finite_differences(seed, t, dh, causal):
    q, k, v = (normal(seed, tag, (2, t, dh)) for tag in (1, 2, 3))
    grad_o = normal(seed, 4, (2, t, dh))
    o, p = tp.scaled_dot_product_attention(q, k, v, causal)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, **TOL)
    if causal:
        assert np.all(np.triu(p[0], 1) == 0), "no position sees a later one"
    got = tp.scaled_dot_product_attention_backward(q, k, v, p, grad_o)

    def loss():
        return float(np.sum(tp.scaled_dot_product_attention(q, k, v, causal)[0] * grad_o))

    for a, g in zip((q, k, v), got):
        np.testing.assert_allclose(g, numeric_grad(loss, a), rtol=1e-6, atol=1e-7)


def _dense_attention_params(seed, d, use_bias):
    w_qkv, w_out = normal(seed, 11, (3 * d, d)) / np.sqrt(d), normal(seed, 12, (d, d)) / np.sqrt(d)
    b_qkv = normal(seed, 13, (3 * d,)) if use_bias else None
    b_out = normal(seed, 14, (d,)) if use_bias else None
    return w_qkv, b_qkv, w_out, b_out


def _body_attention(world, seed, heads, dh, t, batch, use_bias, causal):
    d = heads * dh
    dense = _dense_attention_params(seed, d, use_bias)
    x, gy = normal(seed, 15, (*batch, t, d)), normal(seed, 16, (*batch, t, d))
    layer = tp.TensorParallelAttention.from_dense(*dense, num_heads=heads, group=world,
                                                  causal=causal)
    mine = bounds(world, heads)
    assert layer.heads == range(mine.start, mine.stop)
    assert layer.qkv_weight.shape == (3 * len(layer.heads) * dh, d)
    y = layer.forward(x.copy())
    np.testing.assert_allclose(y, dense_attention(x, *dense, heads, causal), **TOL)
    gx = layer.backward(gy.copy())

    def loss():
        return float(np.sum(dense_attention(x, *dense, heads, causal) * gy))

    np.testing.assert_allclose(gx, numeric_grad(loss, x), rtol=1e-6, atol=1e-6)
    grads = layer.full_grads()
    want = {"qkv": (dense[0], dense[1]), "out": (dense[2], dense[3])}
    for name, (w, b) in want.items():
        np.testing.assert_allclose(grads[name][0], numeric_grad(loss, w), rtol=1e-6, atol=1e-6)
        if b is not None:
            np.testing.assert_allclose(grads[name][1], numeric_grad(loss, b), rtol=1e-6,
                                       atol=1e-6)
        else:
            assert grads[name][1] is None
        got_w, got_b = layer.full_weights()[name]
        np.testing.assert_array_equal(got_w, w)
        assert (got_b is None) == (b is None)
    # this rank's shards are its heads' rows of W_qkv and columns of W_o
    f = slice(mine.start * dh, mine.stop * dh)
    rows = np.concatenate([grads["qkv"][0][i * d:(i + 1) * d][f] for i in range(3)])
    np.testing.assert_allclose(layer.qkv_weight.grad, rows, **TOL)
    np.testing.assert_allclose(layer.out_weight.grad, grads["out"][0][:, f], **TOL)
    # accumulate adds a second backward's gradients
    layer.forward(x.copy())
    layer.backward(gy.copy(), accumulate=True)
    np.testing.assert_allclose(layer.qkv_weight.grad, 2 * rows, **TOL)


@given(n=world_sizes(1, 5), seed=seeds, heads=st.integers(1, 4), dh=st.integers(1, 3),
       t=st.integers(1, 4), batch=st.lists(st.integers(1, 2), max_size=1).map(tuple),
       use_bias=st.booleans(), causal=st.booleans())
@settings(max_examples=20, deadline=None)
def test_attention_matches_dense(n, seed, heads, dh, t, batch, use_bias, causal):
    """Any head count on any group (ranks with no heads included) against dense NumPy."""
    run_world(_body_attention, n, seed, heads, dh, t, batch, use_bias, causal)


def _body_attention_seeded(world, seed, heads, dh):
    solo = ad.World.mock()
    layer = tp.TensorParallelAttention(heads * dh, heads, world, dtype=np.float64, seed=seed)
    ref = tp.TensorParallelAttention(heads * dh, heads, solo, dtype=np.float64, seed=seed)
    full = layer.full_weights()
    np.testing.assert_array_equal(full["qkv"][0], ref.qkv_weight.data)
    np.testing.assert_array_equal(full["out"][1], ref.out_bias.data)
    assert [p.name for p in layer.parameters()] == ["qkv.weight", "qkv.bias", "out.weight",
                                                    "out.bias"]
    assert layer.heads_per_rank == comm.split_sizes(heads, world.world_size)


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**30), heads=st.integers(1, 4),
       dh=st.integers(1, 3))
@settings(max_examples=8, deadline=None)
def test_seeded_attention_is_the_same_dense_layer_at_any_world_size(n, seed, heads, dh):
    run_world(_body_attention_seeded, n, seed, heads, dh)


def _body_attention_errors(world):
    with pytest.raises(ValueError, match=r"TensorParallelAttention: embed_dim=6 must be a "
                                         r"positive multiple of num_heads=4"):
        tp.TensorParallelAttention(6, 4, world)
    layer = tp.TensorParallelAttention(4, 2, world, dtype=np.float64)
    with pytest.raises(RuntimeError, match=r"TensorParallelAttention\(embed_dim=4, num_heads=2, "
                                           rf"rank {world.rank} of {world.world_size}.*"
                                           r"backward: called before forward"):
        layer.backward(np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"forward: input of shape \(4,\), expected "
                                         r"\(..., T, embed_dim=4\)"):
        layer.forward(np.zeros(4))
    with pytest.raises(ValueError, match=r"forward: input of shape \(3, 5\)"):
        layer.forward(np.zeros((3, 5)))
    layer.forward(np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"backward: grad_y of shape \(2, 4\), expected the "
                                         r"forward output's shape \(3, 4\)"):
        layer.backward(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"from_dense: qkv_weight \(4, 4\) and out_weight "
                                         r"\(4, 4\) must be \(3d, d\)"):
        tp.TensorParallelAttention.from_dense(np.zeros((4, 4)), None, np.zeros((4, 4)), None, 2,
                                              world)
    with pytest.raises(ValueError, match="pass both biases or neither"):
        tp.TensorParallelAttention.from_dense(np.zeros((12, 4)), np.zeros(12), np.zeros((4, 4)),
                                              None, 2, world)
    with pytest.raises(RuntimeError, match="full_grads: out.weight has no gradient"):
        tp.TensorParallelAttention(4, 2, world).full_grads()


@given(n=world_sizes(1, 3))
@settings(max_examples=3, deadline=None)
def test_attention_errors_name_the_layer_and_the_shapes(n):
    run_world(_body_attention_errors, n)


def _body_attention_tp_dp(world, tp_size, seed, steps):
    """Attention split over tp, replicas averaged over dp: the one-rank layer's training."""
    mesh = make_mesh(world, tp_size)
    tp_group, dp_group = mesh.group("tp"), mesh.group("dp")
    heads, dh, t = 3, 2, 4
    dense = _dense_attention_params(seed, heads * dh, True)
    batch = 2 * dp_group.world_size
    x, gy = normal(seed, 21, (batch, t, heads * dh)), normal(seed, 22, (batch, t, heads * dh))
    layer = tp.TensorParallelAttention.from_dense(*dense, num_heads=heads, group=tp_group)
    ddp = DistributedDataParallel(layer, dp_group)
    opt = SGD(ddp.parameters(), lr=LR)
    solo = tp.TensorParallelAttention.from_dense(*dense, num_heads=heads, group=ad.World.mock())
    solo_opt = SGD(solo.parameters(), lr=LR)
    share = bounds(dp_group, batch)
    for _ in range(steps):
        layer.forward(x[share].copy())
        layer.backward(gy[share] / (share.stop - share.start))
        ddp.sync_gradients()
        opt.step()
        opt.zero_grad()
        solo.forward(x.copy())
        solo.backward(gy / batch)
        solo_opt.step()
        solo_opt.zero_grad()
    got, want = layer.full_weights(), solo.full_weights()
    for name in ("qkv", "out"):
        for g, w in zip(got[name], want[name]):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@given(n=world_sizes(1, 6), data=st.data(), seed=seeds)
@settings(max_examples=8, deadline=None)
def test_attention_tp_x_dp_training_matches_one_rank(n, data, seed):
    tp_size = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    run_world(_body_attention_tp_dp, n, tp_size, seed, 3)


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1),
       norm_type=st.sampled_from([1.0, 2.0, 3.0, float("inf")]),
       max_norm=st.floats(0.01, 10.0), poison=st.sampled_from([None, "nan", "inf"]))
def test_clip_grad_norm_equals_clipping_the_dense_model(n, seed, norm_type, max_norm, poison):
    """The global norm counts each shard once and the replicated bias once, as the dense
    model's; NaN and inf follow torch.nn.utils.clip_grad_norm_."""
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((6, 4)), rng.standard_normal(6)
    w2, b2 = rng.standard_normal((3, 6)), rng.standard_normal(3)
    x = rng.standard_normal((5, 4))

    def body(world):
        mlp = tp.TensorParallelMLP.from_dense(w1, b1, w2, b2, world)
        y = mlp.forward(x)
        mlp.backward(np.ones_like(y) * 0.3)
        if poison is not None:
            mlp.fc2.bias.grad[0] = np.nan if poison == "nan" else np.inf  # replicated
        dense = mlp.full_grads()
        grads = [g for pair in dense.values() for g in pair]
        flat = np.concatenate([g.ravel() for g in grads])
        with np.errstate(invalid="ignore"):
            want = (np.max(np.abs(flat)) if np.isinf(norm_type)
                    else np.sum(np.abs(flat) ** norm_type) ** (1 / norm_type))
        got = tp.clip_grad_norm([mlp], max_norm, norm_type)
        if np.isnan(want):
            assert np.isnan(got)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-12)
        coef = min(1.0, max_norm / (want + 1e-6)) if np.isfinite(want) else None
        after = mlp.full_grads()
        for key, (dw, db) in after.items():
            if coef is not None:
                np.testing.assert_allclose(dw, dense[key][0] * coef, rtol=1e-12)
                np.testing.assert_allclose(db, dense[key][1] * coef, rtol=1e-12)
        if poison is not None:
            with pytest.raises(ad.NonFiniteNormError):
                tp.clip_grad_norm([mlp], max_norm, norm_type, error_if_nonfinite=True)

    run_world(body, n)
