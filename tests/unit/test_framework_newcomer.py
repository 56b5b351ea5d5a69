"""What a torch or JAX user meets first: each kind of tensor through a collective, on a
two-rank mock world, with the result (or the refusal's text) checked."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import Parameter
from axondist._array import bfloat16
from axondist._frameworks import JAX, TORCH, framework_of
from axondist.errors import InvalidBufferError, UnsupportedDTypeError
from axondist.optim import SGD, Adam, AdamW

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def on_two_ranks(body):
    """``body(world)`` on both ranks of a mock world; rank 0's result."""
    return ad.spawn(body, 2)[0]


# --- the newcomer's table, row by row ---------------------------------------------------

def test_torch_float32_is_reduced_in_place_and_returned():
    def body(world):
        t = torch.full((3,), float(world.rank + 1))
        got = ad.all_reduce(t, group=world)
        return got is t, t.tolist()

    assert on_two_ranks(body) == (True, [3.0, 3.0, 3.0])


def test_torch_bfloat16_is_reduced_in_place_and_returned():
    def body(world):
        t = torch.full((2, 2), 1.5 * (world.rank + 1), dtype=torch.bfloat16)
        got = ad.all_reduce(t, "max", world)
        return got is t, t.dtype, t.tolist()

    assert on_two_ranks(body) == (True, torch.bfloat16, [[3.0, 3.0], [3.0, 3.0]])


def test_torch_tensor_that_requires_grad_is_reduced_through_its_data():
    def body(world):
        t = torch.full((3,), float(world.rank + 1), requires_grad=True)
        got = ad.all_reduce_mean(t, world)
        return got is t, t.requires_grad, t.grad, t.detach().tolist()

    assert on_two_ranks(body) == (True, True, None, [1.5, 1.5, 1.5])


def test_jax_array_gives_a_new_jax_array_and_stays_as_it_was():
    def body(world):
        x = jnp.full((3,), float(world.rank + 1))
        got = ad.all_reduce(x, group=world)
        return isinstance(got, jax.Array), got is x, got.tolist(), x.tolist()

    assert on_two_ranks(body) == (True, False, [3.0, 3.0, 3.0], [1.0, 1.0, 1.0])


def test_non_contiguous_torch_tensor_is_refused_with_what_to_do():
    def body(world):
        t = torch.zeros(3, 4).t()
        with pytest.raises(InvalidBufferError) as info:
            ad.all_reduce(t, group=world)
        fixed = t.contiguous()
        return str(info.value), ad.all_reduce(fixed, group=world) is fixed

    message, ok = on_two_ranks(body)
    assert message == ("all_reduce: the torch tensor of shape (4, 3) is not contiguous, so it "
                       "cannot be written in place; pass t.contiguous() and use the tensor "
                       "returned")
    assert ok


# --- beyond the table ---------------------------------------------------------------------

def test_gradients_from_jax_grad_sync_in_one_call():
    def loss(params, x):
        return jnp.sum((x @ params[0] + params[1]) ** 2)

    def body(world):
        params = [jnp.ones((2, 2)), jnp.zeros(2)]
        grads = jax.grad(loss)(params, jnp.full((1, 2), float(world.rank + 1)))
        synced = ad.sync_gradients(grads, world)
        return [type(g).__name__ for g in synced], [np.asarray(g).tolist() for g in synced]

    kinds, values = on_two_ranks(body)
    assert kinds == ["ArrayImpl", "ArrayImpl"]
    # rank r's row x is (c, c) with c = r + 1, so xW + b = (2c, 2c): each entry of dL/dW is
    # 4c^2 (4 and 16, averaged 10) and of dL/db 4c (4 and 8, averaged 6)
    assert values == [[[10.0, 10.0], [10.0, 10.0]], [6.0, 6.0]]


def test_torch_gradients_sync_in_place():
    def body(world):
        grads = [torch.full((2,), float(world.rank)), torch.ones(3, dtype=torch.bfloat16)]
        synced = ad.sync_gradients(grads, world)
        return [s is g for s, g in zip(synced, grads)], grads[0].tolist(), grads[1].dtype

    assert on_two_ranks(body) == ([True, True], [0.5, 0.5], torch.bfloat16)


def test_new_arrays_come_back_in_the_callers_framework():
    def body(world):
        r = world.rank
        t = torch.arange(4.0) + r
        gathered = ad.all_gather(t, world)
        scattered = ad.reduce_scatter(t, "sum", world)
        exchanged = ad.all_to_all(t, world)
        into = torch.empty(8)
        gathered_into = ad.all_gather(t, world, out=into)
        at_root = ad.gather_tensor(jnp.asarray([r]), world, dst=0)
        piece = ad.scatter_tensor(torch.arange(4) if r == 0 else torch.empty(0), world, src=0)
        work = ad.all_gather(jnp.asarray([r]), world, async_op=True)
        return (type(gathered), gathered.tolist(), scattered.tolist(), exchanged.tolist(),
                gathered_into is into, type(at_root).__name__,
                None if at_root is None else at_root.tolist(),
                type(piece), piece.tolist(), type(work.wait()).__name__)

    assert on_two_ranks(body) == (
        torch.Tensor, [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0], [1.0, 3.0], [0.0, 1.0, 1.0, 2.0],
        True, "ArrayImpl", [0, 1], torch.Tensor, [0, 1], "ArrayImpl")


def test_recv_and_prepared_calls_write_torch_tensors():
    def body(world):
        r = world.rank
        out = torch.zeros(2, dtype=torch.bfloat16)
        if r == 0:
            ad.send(torch.tensor([1.5, -2.0], dtype=torch.bfloat16), 1, world)
            got = out
        else:
            got = ad.recv(0, world, out=out)
        t = torch.full((3,), float(r))
        prepared = ad.prepare("all_reduce", t, group=world)
        return got is out, out.tolist(), prepared(t) is t, t.tolist()

    results = ad.spawn(body, 2)
    assert results[1] == (True, [1.5, -2.0], True, [1.0, 1.0, 1.0])


def test_a_jax_out_is_refused():
    def body(world):
        with pytest.raises(InvalidBufferError) as info:
            ad.all_gather(jnp.ones(2), world, out=jnp.zeros(4))
        ad.barrier(world)
        return str(info.value)

    assert on_two_ranks(body) == ("all_gather: out is a jax array, which cannot be written; "
                                  "leave out=None and use the array returned")


def test_torch_dtypes_without_a_counterpart_are_refused_by_name():
    with pytest.raises(UnsupportedDTypeError,
                       match=r"as_array: a torch tensor of dtype torch.float8_e4m3fn does not "
                             r"cross to NumPy .*; convert it first, e.g. t.to\(torch.float32\)"):
        ad.as_array(torch.zeros(2, dtype=torch.float8_e4m3fn))

    def body(world):  # int16 crosses, but no collective carries it
        with pytest.raises(UnsupportedDTypeError, match="all_reduce: dtype int16 is not supported"):
            ad.all_reduce(torch.zeros(2, dtype=torch.int16), group=world)

    ad.spawn(body, 2)


@pytest.mark.parametrize("opt_cls", [SGD, Adam, AdamW])
@pytest.mark.parametrize("make_grad", [torch.tensor, jnp.asarray, np.asarray],
                         ids=["torch", "jax", "numpy"])
def test_optimizers_step_on_a_grad_set_by_hand_in_any_framework(opt_cls, make_grad):
    values = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    reference = Parameter(np.ones(3, dtype=np.float32))
    reference.grad = values.copy()
    param = Parameter(np.ones(3, dtype=np.float32))
    param.grad = make_grad(values)
    ref_opt, opt = opt_cls([reference], lr=0.1), opt_cls([param], lr=0.1)
    for _ in range(3):
        ref_opt.step()
        opt.step()
    assert param.data.tolist() == reference.data.tolist()
    assert param.data.tolist() != [1.0, 1.0, 1.0]
    assert np.asarray(param.grad).tolist() == values.tolist()  # the user's grad is untouched


def test_an_optimizer_refuses_a_torch_grad_of_the_wrong_shape_by_name():
    param = Parameter(np.ones(3, dtype=np.float32), name="w")
    param.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"parameter 0 \(w\) has shape \(3,\) but its "
                                         r"\.grad has shape \(4,\)"):
        SGD([param], lr=0.1).step()


@pytest.mark.parametrize("make_grad", [torch.tensor, jnp.asarray], ids=["torch", "jax"])
def test_zero_grad_keeping_the_gradient_zeroes_it_in_its_framework(make_grad):
    param = Parameter(np.ones(3, dtype=np.float32))
    given_grad = make_grad(np.array([1.0, np.nan, -2.0], dtype=np.float32))
    param.grad = given_grad
    param.zero_grad(set_to_none=False)
    assert framework_of(param.grad) is framework_of(given_grad)
    assert np.asarray(param.grad).tolist() == [0.0, 0.0, 0.0]
    if framework_of(given_grad).writable:
        assert param.grad is given_grad  # zeroed in place, its memory kept


def test_frameworks_are_told_apart_without_imports():
    assert framework_of(np.zeros(2)) is None
    assert framework_of(torch.zeros(2)) is TORCH
    assert framework_of(torch.nn.Parameter(torch.zeros(2))) is TORCH
    assert framework_of(jnp.zeros(2)) is JAX
    code = ("import sys, numpy as np, axondist as ad; "
            "ad.spawn(lambda w: ad.sync_gradients([ad.all_reduce(np.ones(2), group=w)], w), 2); "
            "bad = [m for m in ('torch', 'jax') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@given(shape=st.lists(st.integers(0, 4), max_size=3),
       values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=8))
def test_bfloat16_crosses_both_ways_as_the_same_bits_without_copies(shape, values):
    n = int(np.prod(shape, dtype=int))
    t = torch.tensor((values * (n // len(values) + 1))[:n], dtype=torch.bfloat16).reshape(shape)
    view = ad.as_array(t)
    assert view.dtype == bfloat16 and view.shape == tuple(shape)
    assert view.view(np.int16).tolist() == t.view(torch.int16).tolist()
    if n:
        assert view.ctypes.data == t.data_ptr()
    back = TORCH.wrap(view, t)
    assert back.dtype is torch.bfloat16 and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))
