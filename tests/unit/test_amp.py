"""LossScaler without communication: the update rule against torch's, the defaults,
checkpoints, unscaling, the seed, and the argument checks; torch's own GradScaler where
torch is installed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist.amp import LossScaler, next_scale
from axondist.optim import SGD


def torch_rule(found: list[bool], init: float, growth: float, backoff: float,
               interval: int) -> list[float]:
    """The scale after each step under ``torch.amp.GradScaler``'s documented update
    (``_amp_update_scale_``), written apart from axondist."""
    scale, tracker, out = init, 0, []
    for inf in found:
        if inf:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * growth, 0
        out.append(scale)
    return out


def _replay(scaler: LossScaler, found: list[bool]) -> list[float]:
    """Drive ``scaler`` through steps whose gradients overflow where ``found`` says."""
    scales = []
    opt = SGD([ad.Parameter(np.zeros(2, np.float32))], lr=0.1)
    for inf in found:
        g = np.array([scaler.scale, np.inf if inf else 1.0], np.float32)
        opt.params[0].grad = g
        stepped = scaler.step(opt, replicated=True)
        assert stepped is (not inf)
        scaler.update()
        scales.append(scaler.scale)
    return scales


@given(st.lists(st.booleans(), max_size=60), st.sampled_from([1.0, 2.0**16]),
       st.sampled_from([2.0, 3.0]), st.sampled_from([0.5, 0.25]), st.integers(1, 5))
def test_update_rule_matches_torch(found: list[bool], init: float, growth: float,
                                   backoff: float, interval: int) -> None:
    scaler = LossScaler(init, growth, backoff, interval)
    assert _replay(scaler, found) == torch_rule(found, init, growth, backoff, interval)
    assert scaler.skipped_steps == sum(found)


def test_defaults_are_torchs() -> None:
    scaler = LossScaler()
    assert (scaler.scale, scaler.growth_factor, scaler.backoff_factor,
            scaler.growth_interval) == (2.0**16, 2.0, 0.5, 2000)
    assert _replay(scaler, [False] * 1999)[-1] == 2.0**16
    assert _replay(scaler, [False])[-1] == 2.0**17  # the 2000th good step doubles it
    assert _replay(scaler, [True])[-1] == 2.0**16


def test_a_scale_that_would_grow_to_inf_stays() -> None:
    assert next_scale(1e308, 0, False, 10.0, 0.5, 1) == (1e308, 0)


def test_checkpoint_resumes_the_same_scales() -> None:
    found = [i % 7 == 3 for i in range(40)]
    whole = _replay(LossScaler(growth_interval=3), found)
    first = LossScaler(growth_interval=3)
    head = _replay(first, found[:17])
    state = first.state_dict()
    resumed = LossScaler()  # other settings: the state brings its own
    resumed.load_state_dict(state)
    assert head + _replay(resumed, found[17:]) == whole
    assert resumed.skipped_steps == sum(found)
    assert set(state) >= {"scale", "growth_factor", "backoff_factor", "growth_interval",
                          "_growth_tracker"}


def test_unscale_gives_the_true_gradients_before_clipping() -> None:
    scaler = LossScaler(init_scale=1024.0)
    true = [np.array([3.0, 4.0], np.float32), np.array([[12.0]], np.float32)]
    grads = [g * np.float32(scaler.scale) for g in true]
    params = [ad.Parameter(np.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    assert scaler.unscale_(params, replicated=True) is False
    assert all(np.array_equal(p.grad, t) for p, t in zip(params, true))
    norm = math.sqrt(sum(float(np.sum(p.grad**2)) for p in params))
    assert norm == 13.0  # what a clip after unscale_ sees
    opt = SGD(params, lr=1.0)
    assert scaler.step(opt) is True  # unscaled once: step does not divide again
    assert np.array_equal(params[0].data, -true[0])
    with pytest.raises(RuntimeError, match="update"):
        scaler.unscale_(params)
    scaler.update()


def test_nan_counts_as_overflow_and_skips() -> None:
    scaler = LossScaler(init_scale=8.0)
    p = ad.Parameter(np.ones(3, np.float32))
    p.grad = np.array([1.0, np.nan, 2.0], np.float32)
    assert scaler.step(SGD([p], lr=1.0), replicated=True) is False
    assert np.array_equal(p.data, np.ones(3, np.float32)) and scaler.found_inf is True
    scaler.update()
    assert scaler.scale == 4.0 and scaler.found_inf is None


def test_the_seed_is_scaled_in_float32_and_cast_to_the_output() -> None:
    scaler = LossScaler()  # 2**16: inf in float16 itself
    y = np.zeros(3, np.float16)
    tiny = np.full(3, 2.0**-26, np.float32)  # 0 in float16
    assert not np.any(tiny.astype(np.float16))
    loss, grad_y = scaler.scale_loss_fn(lambda y, t: (0.5, tiny))(y, None)
    assert loss == 0.5 and grad_y.dtype == np.float16
    assert np.all(grad_y == np.float16(2.0**-10))
    assert scaler.scale_loss(3.0) == 3.0 * 2**16
    assert scaler.scale_seed(np.ones(2, np.float32)).dtype == np.float32


def test_disabled_scaler_passes_through() -> None:
    scaler = LossScaler(enabled=False)
    g = np.array([np.inf], np.float32)
    assert scaler.scale == 1.0 and scaler.scale_loss(2.0) == 2.0
    assert scaler.unscale_([g]) is False and np.isinf(g[0])
    scaler.update()
    assert scaler.scale == 1.0


def test_update_without_a_verdict_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no unscale_\\(\\) or step\\(\\)"):
        LossScaler().update()
    scaler = LossScaler()
    scaler.update(new_scale=8.0)
    assert scaler.scale == 8.0


@pytest.mark.parametrize("kwargs, error, text", [
    ({"init_scale": 0.0}, ValueError, "init_scale must be finite and > 0"),
    ({"init_scale": "big"}, TypeError, "init_scale must be a number"),
    ({"growth_factor": 1.0}, ValueError, "growth_factor must be finite and > 1"),
    ({"backoff_factor": 1.0}, ValueError, "backoff_factor must be < 1"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be an int >= 1"),
])
def test_bad_arguments_are_named(kwargs: dict, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        LossScaler(**kwargs)


def test_bad_gradients_and_optimizers_are_named() -> None:
    with pytest.raises(TypeError, match="gradient 0 is int64"):
        LossScaler().unscale_([np.ones(2, np.int64)], replicated=True)
    with pytest.raises(TypeError, match="must have a step\\(\\) method"):
        LossScaler().step(object())
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        LossScaler().scale_loss_fn(3)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no 'scale' in the state"):
        LossScaler().load_state_dict({"growth_factor": 2.0})


def test_torch_grad_scaler_skips_the_same_steps_and_ends_at_the_same_scale() -> None:
    torch = pytest.importorskip("torch")
    found = [i in (0, 1, 9, 10, 23) for i in range(40)]
    ours = LossScaler(growth_interval=4)
    theirs = torch.amp.GradScaler("cpu", growth_interval=4)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    skipped_torch = []
    for step, inf in enumerate(found):
        before = p.detach().clone()
        theirs.scale(torch.ones(()))  # as a loss would be: GradScaler sets its scale up here
        p.grad = torch.tensor([theirs.get_scale(), math.inf if inf else 1.0])
        theirs.step(opt)
        theirs.update()
        if torch.equal(before, p.detach()):
            skipped_torch.append(step)
    assert _replay(ours, found)[-1] == theirs.get_scale()
    assert skipped_torch == [i for i, inf in enumerate(found) if inf]
