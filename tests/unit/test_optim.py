"""Optimizers against hand-written NumPy references of torch.optim's update formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist import Parameter
from axondist._array import bfloat16
from axondist.optim import SGD, Adam, AdamW, Optimizer

SHAPES = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
                  min_size=1, max_size=4)


# --- references, one parameter, float64, written as torch documents them ---------------

def ref_sgd(p, grads, lr, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0):
    p = p.astype(np.float64).copy()
    buf = None
    for g in grads:
        d = g + weight_decay * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p


def ref_adam(p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g**2
        mhat = m / (1 - betas[0] ** t)
        vhat = v / (1 - betas[1] ** t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
    return p


def make(shapes, seed, steps, dtype=np.float64):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s) for s in shapes]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]
    params = [Parameter(x.astype(dtype)) for x in init]
    return init, grads, params


def run(opt_cls, params, grads, **kw):
    opt = opt_cls(params, **kw)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.astype(p.dtype)
        opt.step()
    return opt


CASES = [
    (SGD, {"lr": 0.1}, lambda p, g: ref_sgd(p, g, 0.1)),
    (SGD, {"lr": 0.05, "momentum": 0.9}, lambda p, g: ref_sgd(p, g, 0.05, 0.9)),
    (SGD, {"lr": 0.05, "momentum": 0.8, "weight_decay": 0.1, "nesterov": True},
     lambda p, g: ref_sgd(p, g, 0.05, 0.8, 0.1, True)),
    (SGD, {"lr": 0.05, "momentum": 0.7, "dampening": 0.3},
     lambda p, g: ref_sgd(p, g, 0.05, 0.7, dampening=0.3)),
    (Adam, {"lr": 0.01}, lambda p, g: ref_adam(p, g, 0.01)),
    (Adam, {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
     lambda p, g: ref_adam(p, g, 0.02, (0.8, 0.99), 1e-6, 0.1)),
    (AdamW, {"lr": 0.01}, lambda p, g: ref_adam(p, g, 0.01, weight_decay=1e-2, decoupled=True)),
    (AdamW, {"lr": 0.03, "weight_decay": 0.2},
     lambda p, g: ref_adam(p, g, 0.03, weight_decay=0.2, decoupled=True)),
]


@pytest.mark.parametrize("opt_cls,kw,ref", CASES)
@settings(max_examples=15, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 2**31), steps=st.integers(1, 5))
def test_matches_reference_float64(opt_cls, kw, ref, shapes, seed, steps):
    init, grads, params = make(shapes, seed, steps)
    data_ids = [id(p.data) for p in params]
    run(opt_cls, params, grads, **kw)
    for i, p in enumerate(params):
        expected = ref(init[i], [g[i] for g in grads])
        np.testing.assert_allclose(p.data, expected, rtol=1e-12, atol=1e-12)
    assert [id(p.data) for p in params] == data_ids  # updated in place


@pytest.mark.parametrize("opt_cls,kw,ref", CASES)
def test_float32_within_float32_tolerance(opt_cls, kw, ref):
    init, grads, params = make([(5, 3), (7,)], 3, 4, dtype=np.float32)
    opt = run(opt_cls, params, grads, **kw)
    for i, p in enumerate(params):
        assert p.dtype == np.float32
        np.testing.assert_allclose(p.data, ref(init[i].astype(np.float32),
                                               [g[i].astype(np.float32) for g in grads]),
                                   rtol=1e-5, atol=1e-5)
    for s in opt.state.values():
        for k, v in s.items():
            if k != "step":
                assert v.dtype == np.float32


LOW = [np.float16] + ([bfloat16] if bfloat16 is not None else [])


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("opt_cls,kw,ref", CASES[:3] + CASES[4:7])
def test_low_precision_keeps_float32_state(dtype, opt_cls, kw, ref):
    """Each step: upcast to float32, update, round back. Reference does the same."""
    init, grads, params = make([(4, 4)], 5, 3, dtype=dtype)
    opt = run(opt_cls, params, grads, **kw)
    p = params[0]
    assert p.dtype == dtype
    # reference with the same per-step rounding of the weights
    x = init[0].astype(dtype).astype(np.float32)
    ref_opt = opt_cls([Parameter(x.copy())], **kw)
    for g in grads:
        ref_opt.params[0].grad = g[0].astype(dtype).astype(np.float32)
        ref_opt.step()
        ref_opt.params[0].data[...] = ref_opt.params[0].data.astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(p.data.astype(np.float32), ref_opt.params[0].data)
    # and close to the exact float64 answer (a loose check that rounding stays bounded)
    exact = ref(init[0].astype(dtype).astype(np.float64), [g[0] for g in grads])
    np.testing.assert_allclose(p.data.astype(np.float64), exact, atol=0.05, rtol=0.05)
    for s in opt.state.values():
        for k, v in s.items():
            if k != "step":
                assert v.dtype == np.float32


def test_skips_params_without_grad_and_counts_steps_per_param():
    init, grads, params = make([(3,), (2,)], 0, 3)
    opt = Adam(params, lr=0.1)
    for t, g in enumerate(grads):
        params[0].grad = g[0]
        params[1].grad = g[1] if t == 2 else None
        opt.step()
    np.testing.assert_allclose(params[0].data, ref_adam(init[0], [g[0] for g in grads], 0.1))
    # parameter 1 got one update, with bias correction of step 1
    np.testing.assert_allclose(params[1].data, ref_adam(init[1], [grads[2][1]], 0.1))
    assert opt.state[0]["step"] == 3 and opt.state[1]["step"] == 1 and opt.step_count == 3


def test_never_writes_into_user_grad():
    _, grads, params = make([(6,)], 1, 1)
    g = grads[0][0].copy()
    for cls, kw in [(SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
                    (Adam, {"weight_decay": 0.1}), (AdamW, {})]:
        params[0].grad = g
        opt = cls(params, **kw)
        opt.step()
        opt.step()
        np.testing.assert_array_equal(g, grads[0][0])


def test_zero_grad():
    _, grads, params = make([(3,), (2,)], 0, 1)
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt = SGD(params, lr=0.1)
    held = params[0].grad
    opt.zero_grad(set_to_none=False)
    assert params[0].grad is held and not held.any() and not params[1].grad.any()
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_lr_settable_and_used():
    _, _, params = make([(3,)], 0, 1)
    x0 = params[0].data.copy()
    opt = SGD(params, lr=0.1)
    opt.lr = 0.5
    params[0].grad = np.ones(3)
    opt.step()
    np.testing.assert_allclose(params[0].data, x0 - 0.5)
    with pytest.raises(ValueError,
                       match=r"lr=-1.0 \(the learning rate\) must be a finite number >= 0"):
        opt.lr = -1.0


@pytest.mark.parametrize("opt_cls,kw,ref", CASES)
def test_state_dict_round_trip_continues_identically(opt_cls, kw, ref):
    init, grads, params = make([(3, 2), (4,)], 9, 6)
    a = run(opt_cls, params, grads[:3], **kw)
    sd = a.state_dict()
    # the snapshot is a copy: more steps do not change it
    saved = {i: {k: (v.copy() if k != "step" else v) for k, v in s.items()}
             for i, s in sd["state"].items()}
    params_b = [Parameter(p.data.copy()) for p in params]
    b = opt_cls(params_b, **{**kw, "lr": 123.0})
    b.load_state_dict(sd)
    assert b.lr == kw["lr"] and b.step_count == 3
    for step in grads[3:]:
        for p, q, g in zip(params, params_b, step):
            p.grad, q.grad = g, g.copy()
        a.step()
        b.step()
    for p, q in zip(params, params_b):
        np.testing.assert_array_equal(p.data, q.data)
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.data, ref(init[i], [g[i] for g in grads]), rtol=1e-12)
    for i, s in saved.items():
        for k, v in s.items():
            if k != "step":
                np.testing.assert_array_equal(sd["state"][i][k], v)


def test_load_state_dict_errors():
    _, grads, params = make([(3,), (2,)], 0, 1)
    opt = run(Adam, params, grads, lr=0.1)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="optimizer 'Adam', not 'SGD'"):
        SGD(params, lr=0.1).load_state_dict(sd)
    bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "exp_avg": np.zeros(4)}}}
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 .* shape \(4,\).*\(3,\)"):
        Adam(params).load_state_dict(bad)
    with pytest.raises(ValueError, match="parameter index 5"):
        Adam(params).load_state_dict({**sd, "state": {5: sd["state"][0]}})
    with pytest.raises(ValueError, match="expected"):
        Adam(params).load_state_dict({**sd, "state": {0: {"step": 1, "exp_avg": np.zeros(3)}}})
    with pytest.raises(ValueError, match="expected a dict"):
        Adam(params).load_state_dict([1, 2])


def test_constructor_errors():
    p = [Parameter(np.zeros(2))]
    with pytest.raises(ValueError, match="nesterov"):
        SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="empty"):
        SGD([], lr=0.1)
    with pytest.raises(TypeError, match="int64 cannot be trained"):
        SGD([Parameter(np.zeros(2, dtype=np.int64))], lr=0.1)
    with pytest.raises(TypeError, match="not an axondist.Parameter"):
        SGD([np.zeros(2)], lr=0.1)
    opt = SGD(p, lr=0.1)
    p[0].grad = np.zeros(3)
    with pytest.raises(ValueError, match=r"shape \(2,\) but its .grad has shape \(3,\)"):
        opt.step()


def test_accepts_generators_and_models():
    ps = [Parameter(np.zeros(2)), Parameter(np.zeros(3))]
    assert SGD((p for p in ps), lr=1).params == ps

    class Model:
        def parameters(self):
            return iter(ps)

    assert Adam(Model()).params == ps
    assert isinstance(AdamW(ps), Optimizer)
    assert "Adam(2 parameters" in repr(Adam(ps))
    assert math.isclose(AdamW(ps).weight_decay, 1e-2)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
@pytest.mark.parametrize("params", [None, 5, "weights"])
def test_params_that_are_not_parameters_are_named_clearly(cls, params):
    with pytest.raises(TypeError, match=rf"{cls.__name__}: params must be a model, a Parameter "
                                        rf"or a list of Parameters .*got {type(params).__name__}"):
        cls(params, lr=0.1)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_gradients_are_refused_not_cast_to_real(cls, dtype):
    p = Parameter(np.ones(3), name="w")
    opt = cls([p], lr=0.1)
    p.grad = (np.ones(3) + 1j * np.ones(3)).astype(dtype)
    with pytest.raises(TypeError, match=rf"{cls.__name__}.step: the gradient of parameter 0 "
                                        rf"\(w\) is {np.dtype(dtype)}; complex gradients"):
        opt.step()
    np.testing.assert_array_equal(p.data, np.ones(3))  # nothing was updated
    assert opt.step_count == 0
