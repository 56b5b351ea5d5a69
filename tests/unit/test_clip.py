"""The shared gradient clipping (axondist.clip), without communication: norm terms, the
coefficient, NaN and inf as torch.nn.utils.clip_grad_norm_, and the argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist import clip
from axondist.errors import NonFiniteNormError


@given(seed=st.integers(0, 1000), p=st.sampled_from([1.0, 2.0, 3.5, math.inf]),
       parts=st.integers(1, 4))
@settings(max_examples=30)
def test_local_norm_terms_combine_to_the_norm(seed: int, p: float, parts: int) -> None:
    g = np.random.default_rng(seed).standard_normal(37).astype(np.float32)
    pieces = np.array_split(g, parts)
    terms = [clip.local_norm_term([x], p) for x in pieces]
    combined = max(terms) if math.isinf(p) else sum(terms) ** (1 / p)
    assert combined == pytest.approx(np.linalg.norm(g.astype(np.float64), ord=p), rel=1e-12)
    assert clip.global_norm(pieces, p, None) == pytest.approx(combined, rel=1e-12)
    # any shape: the norm is that of every element
    assert clip.global_norm([g.reshape(37, 1)], p, None) == clip.global_norm([g], p, None)


def test_clip_coefficient_and_norm_type() -> None:
    assert clip.clip_coefficient(10.0, 1.0) == pytest.approx(1 / (10 + 1e-6))
    assert clip.clip_coefficient(0.5, 1.0) == 1.0
    assert clip.check_norm_type("inf", "f") == math.inf
    assert clip.check_norm_type(np.float32(3), "f") == 3.0
    for bad in (0, -1.0, -math.inf, math.nan, True, "2", None):
        with pytest.raises(ValueError, match=r"f: norm_type must be > 0 or inf \(a number"):
            clip.check_norm_type(bad, "f")


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_local_norm_term_keeps_nan_and_inf(p: float) -> None:
    """Python's max(0.5, nan) is 0.5; the norm of a NaN gradient must be NaN, for every p."""
    nan_last = [np.array([0.5], np.float32), np.array([np.nan], np.float32)]
    nan_first = nan_last[::-1]
    for grads in (nan_last, nan_first):
        assert math.isnan(clip.local_norm_term(grads, p))
    assert clip.local_norm_term([np.array([1.0, -np.inf])], p) == math.inf
    assert math.isnan(clip.local_norm_term([np.array([np.inf, np.nan])], p))


def test_nonfinite_norms_scale_as_torch() -> None:
    assert math.isnan(clip.clip_coefficient(math.nan, 1.0))
    assert clip.clip_coefficient(math.inf, 1.0) == 0.0
    g = np.array([1.0, np.inf, np.nan])
    clip.scale([g], 0.0)  # no RuntimeWarning for inf * 0 (warnings are errors here)
    assert g[0] == 0 and np.isnan(g[1]) and np.isnan(g[2])
    clip.check_finite(3.0, 2.0, "clip_grad_norm")
    with pytest.raises(RuntimeError, match="clip_grad_norm: the total norm of order inf of the "
                                           "gradients is nan.*error_if_nonfinite=False"):
        clip.check_finite(math.nan, math.inf, "clip_grad_norm")


@given(seed=st.integers(0, 1000), p=st.sampled_from([1.0, 2.0, math.inf]),
       max_norm=st.sampled_from([0.01, 1.0, 1e9]))
@settings(max_examples=30)
def test_clip_grad_norm_returns_the_norm_as_a_float_and_scales_only_above_it(seed, p, max_norm):
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(5), rng.standard_normal((2, 3)).astype(np.float32)]
    before = [g.copy() for g in grads]
    want = np.linalg.norm(np.concatenate([g.astype(np.float64).ravel() for g in grads]), ord=p)
    got = clip.clip_grad_norm(grads, max_norm, p)
    assert type(got) is float and got == pytest.approx(want, rel=1e-12)
    coef = min(max_norm / (want + clip.CLIP_EPS), 1.0)
    for g, b in zip(grads, before):
        np.testing.assert_allclose(g, (b * coef).astype(b.dtype), rtol=1e-6)


def test_clip_grad_norm_counts_only_counted_and_scales_every_gradient():
    """FSDP counts shards without padding, tensor parallel a replicated gradient once."""
    grads = [np.array([3.0, 4.0, 100.0]), np.array([12.0])]
    counted = [grads[0][:2], grads[1]]
    assert clip.clip_grad_norm(grads, 1.0, counted=counted) == 13.0
    np.testing.assert_allclose(grads[0], np.array([3.0, 4.0, 100.0]) / (13 + clip.CLIP_EPS))


def test_clip_grad_norm_errors_name_the_caller_and_leave_the_gradients():
    g = np.array([np.inf, 1.0])
    with pytest.raises(NonFiniteNormError, match=r"^W.clip: the total norm of order 2.0 of the "
                                                 r"gradients is inf.*error_if_nonfinite=False"):
        clip.clip_grad_norm([g], 1.0, error_if_nonfinite=True, where="W.clip")
    assert g.tolist() == [np.inf, 1.0]
    with pytest.raises(TypeError, match="W.clip: max_norm must be a number, got str '1'"):
        clip.clip_grad_norm([g], "1", where="W.clip")
    with pytest.raises(ValueError, match="W.clip: max_norm=-1.0 must be a finite number > 0"):
        clip.clip_grad_norm([g], -1.0, where="W.clip")
    with pytest.raises(ValueError, match="W.clip: norm_type must be > 0 or inf"):
        clip.clip_grad_norm([g], 1.0, 0, where="W.clip")
    assert clip.clip_grad_norm([], 1.0) == 0.0
