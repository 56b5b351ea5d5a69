"""Pipeline runtime, single-process mode: every schedule against sequential full-batch training.

The model is a chain of affine + tanh layers in float64 with hand-written
backward passes (full, and split into input and weight halves for the
zero-bubble schedule).  The reference runs the same layers one after the
other on the whole batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pipeline_toy import (
    bwd,
    bwd_input,
    data,
    fwd,
    layer_params,
    make_stages,
    mse,
    sequential,
)

import axondist as ad
from axondist.optim import SGD
from axondist.pipeline import (
    ActionKind,
    Pipeline,
    PipelineMemoryStats,
    PipelineSchedule,
    PipelineStage,
    build_schedule,
    render_text,
    simulate,
)

K = PipelineSchedule
SINGLE_CHUNK = (K.ONE_F_ONE_B, K.ZERO_BUBBLE_H1)
EXAMPLES = settings(max_examples=40, deadline=None)

@st.composite
def shapes(draw):
    """(p, v, m, rows, dims, seed): v is used by the schedules that take chunks."""
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 3))
    m = draw(st.integers(1, 7))  # includes m < p * v and m not divisible by p
    rows = m + draw(st.integers(0, 9))  # uneven splits
    dims = draw(st.lists(st.integers(1, 5), min_size=p * v + 1, max_size=p * v + 1))
    seed = draw(st.integers(0, 2**31 - 1))
    return p, v, m, rows, dims, seed


def variants(p: int, v: int):
    """Every schedule with every backward form: (kind, chunks, split)."""
    for kind in PipelineSchedule:
        for split in ("full", "halves", "both"):
            yield kind, (1 if kind in SINGLE_CHUNK else v), split


# ---------------------------------------------------------------- equality with sequential


@EXAMPLES
@given(shapes())
@example((1, 3, 2, 5, [3, 2, 4, 1], 7))  # one rank, stages pass tensors locally
@example((4, 3, 5, 11, [2, 3, 1, 4, 2, 2, 3, 1, 4, 2, 3, 3, 2], 11))  # m < stages, uneven
def test_train_step_equals_sequential_full_batch(shape):
    p, v, m, rows, dims, seed = shape
    for kind, chunks, split in variants(p, v):
        check_train_step(kind, p, chunks, m, rows, dims[: p * chunks + 1], split, seed)


def check_train_step(kind, p, v, m, rows, dims, split, seed):
    stages = make_stages(seed, dims, split)
    x, t = data(seed, rows, dims[0], dims[-1])
    want_loss, want_grads, _ = sequential(stages, x, t)
    for st_ in stages:  # stale gradients are overwritten, not added to
        for prm in st_.params:
            prm.grad = np.full(prm.shape, 1e6)
    pipe = Pipeline.from_stages(stages, num_microbatches=m, schedule=kind, chunks=v)
    assert (pipe.num_ranks, pipe.num_stages, pipe.num_microbatches) == (p, p * v, m)
    loss = pipe.train_step(x, t, mse)
    assert isinstance(loss, float)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    for st_, grads in zip(stages, want_grads):
        for prm, g in zip(st_.params, grads):
            np.testing.assert_allclose(prm.grad, g, rtol=1e-10, atol=1e-12)
    stats = pipe.last_stats
    assert stats is not None and stats.training
    assert list(stats.microbatch_rows) == [len(c) for c in np.array_split(x, m)]
    # Every action ran once, on its rank.
    for r in range(p):
        assert [ta.action for ta in stats.timeline[r]] == list(pipe.schedule.actions[r])


@settings(max_examples=30, deadline=None)
@given(shapes())
def test_forward_equals_sequential_and_keeps_no_activations(shape):
    p, v, m, rows, dims, seed = shape
    for kind, chunks, split in variants(p, v):
        stages = make_stages(seed, dims[: p * chunks + 1], split)
        x, t = data(seed, rows, stages[0].params[0].shape[0], stages[-1].params[1].shape[0])
        _, _, want = sequential(stages, x, t)
        pipe = Pipeline.from_stages(stages, num_microbatches=m, schedule=kind, chunks=chunks)
        y = pipe.forward(x)
        np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-14)
        assert all(prm.grad is None for st_ in stages for prm in st_.params)
        stats = pipe.last_stats
        assert not stats.training
        assert set(stats.peak_activations.values()) == {0}
        assert all(ta.action.kind is ActionKind.F for r in range(p) for ta in stats.timeline[r])


def test_uneven_microbatches_give_the_full_batch_mean():
    # 7 rows in 3 microbatches of 3, 2, 2 rows: weights 3/7, 2/7, 2/7, not 1/3 each.
    stages = make_stages(5, [3, 4, 2])
    x, t = data(5, 7, 3, 2)
    want_loss, want_grads, _ = sequential(stages, x, t)
    pipe = Pipeline.from_stages(stages, num_microbatches=3)
    assert pipe.train_step(x, t, mse) == pytest.approx(want_loss, rel=1e-13)
    assert pipe.last_stats.microbatch_rows == (3, 2, 2)
    np.testing.assert_allclose(stages[0].params[0].grad, want_grads[0][0], rtol=1e-12)
    unweighted = np.mean([sequential(stages, xc, tc)[0]
                          for xc, tc in zip(np.array_split(x, 3), np.array_split(t, 3))])
    assert abs(unweighted - want_loss) > 1e-6  # the weighting matters for this batch


# ---------------------------------------------------------------- training


@settings(max_examples=10, deadline=None)
@given(shapes())
def test_sgd_steps_equal_sequential_training(shape):
    p, v, m, rows, dims, seed = shape
    for kind, chunks, split in variants(p, v):
        check_sgd(kind, chunks, m, rows, dims[: p * chunks + 1], split, seed)


def check_sgd(kind, v, m, rows, dims, split, seed, lr=0.1):
    piped = make_stages(seed, dims, split)
    ref = make_stages(seed, dims)
    pipe = Pipeline.from_stages(piped, num_microbatches=m, schedule=kind, chunks=v)
    opt = SGD(pipe, lr=lr, momentum=0.9)
    ref_opt = SGD([prm for s in ref for prm in s.params], lr=lr, momentum=0.9)
    for it in range(3):
        x, t = data(seed + it, rows, dims[0], dims[-1])
        loss = pipe.train_step(x, t, mse)
        want, grads, _ = sequential(ref, x, t)
        assert loss == pytest.approx(want, rel=1e-10)
        for s, gs in zip(ref, grads):
            for prm, g in zip(s.params, gs):
                prm.grad = g
        opt.step()
        ref_opt.step()
    for a, b in zip(piped, ref):
        for pa, pb in zip(a.params, b.params):
            np.testing.assert_allclose(pa.data, pb.data, rtol=1e-10, atol=1e-12)


def test_parameters_and_float32():
    stages = make_stages(1, [3, 3, 3, 3, 3])
    for s in stages:
        for prm in s.params:
            prm.data = prm.data.astype(np.float32)
    pipe = Pipeline.from_stages(stages, num_microbatches=4, schedule="interleaved_1f1b",
                                chunks=2)
    assert pipe.parameters() == [prm for s in stages for prm in s.params]
    x, t = data(1, 8, 3, 3)
    pipe.train_step(x.astype(np.float32), t.astype(np.float32), mse)
    assert all(prm.grad.dtype == np.float32 for prm in pipe.parameters())


def test_shared_parameter_gets_the_sum_over_its_stages():
    rng = np.random.default_rng(3)
    W = ad.Parameter(rng.standard_normal((3, 3)) / 2)
    b = [ad.Parameter(np.zeros(3)), ad.Parameter(np.zeros(3))]
    stages = [PipelineStage(fwd, bwd, [W, b[0]]), PipelineStage(fwd, bwd, [W, b[1]])]
    x, t = data(3, 4, 3, 3)
    _, grads, _ = sequential(stages, x, t)
    Pipeline.from_stages(stages, num_microbatches=2).train_step(x, t, mse)
    np.testing.assert_allclose(W.grad, grads[0][0] + grads[1][0], rtol=1e-12)


# ---------------------------------------------------------------- memory


@EXAMPLES
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 3))
def test_measured_peak_activations_equal_the_formulas(p, m, v):
    dims = [2] * (p * v + 1)
    x, t = data(0, m + 1, 2, 2)
    for kind in PipelineSchedule:
        chunks = 1 if kind in SINGLE_CHUNK else v
        pipe = Pipeline.from_stages(make_stages(0, dims[: p * chunks + 1], "both"),
                                    num_microbatches=m, schedule=kind, chunks=chunks)
        pipe.train_step(x, t, mse)
        stats = pipe.last_stats
        measured = [stats.peak_activations[r] for r in range(p)]
        assert measured == list(simulate(pipe.schedule).peak_activations)
        assert measured == [stats.expected_peak_activations[r] for r in range(p)]
        if kind is K.GPIPE:  # every microbatch, on every stage
            assert set(stats.peak_activations_per_stage.values()) == {
                PipelineMemoryStats.gpipe_peak_activations(p * chunks, m)}
            assert measured == [chunks * m] * p
        if kind is K.ONE_F_ONE_B:  # min(p - r, m) on rank r
            assert measured == PipelineMemoryStats.one_f_one_b_peak_activations_per_stage(p, m)
            assert max(measured) == PipelineMemoryStats.one_f_one_b_peak_activations(p, m)
        if kind is K.ZERO_BUBBLE_H1:
            assert max(measured) <= min(p, m)


# ---------------------------------------------------------------- rendering


def test_schedule_text_renders_the_schedule():
    pipe = Pipeline.from_stages(make_stages(0, [2] * 7), num_microbatches=4,
                                schedule=K.INTERLEAVED_ONE_F_ONE_B, chunks=2)
    assert pipe.schedule_text() == render_text(build_schedule(K.INTERLEAVED_ONE_F_ONE_B, 3, 4, 2))
    assert pipe.schedule_text(costs={"F": 1, "B": 1}) != pipe.schedule_text()
    x, t = data(0, 5, 2, 2)
    pipe.train_step(x, t, mse)
    measured = render_text(pipe.last_stats.as_simulation())
    assert len(measured.splitlines()) == 3 + 2 and "bubble" in measured
    assert "3 ranks x 2 chunk(s)" in repr(pipe)


# ---------------------------------------------------------------- errors


def test_batch_errors():
    pipe = Pipeline.from_stages(make_stages(0, [2, 2, 2]), num_microbatches=4)
    x, t = data(0, 3, 2, 2)
    with pytest.raises(ValueError, match=r"x has 3 rows, fewer than num_microbatches=4"):
        pipe.train_step(x, t, mse)
    with pytest.raises(ValueError, match="fewer than num_microbatches"):
        pipe.forward(x)
    with pytest.raises(ValueError, match="passed x=None"):
        pipe.train_step(None, t, mse)
    x, t = data(0, 8, 2, 2)
    with pytest.raises(ValueError, match="target has 7 rows but x has 8"):
        pipe.train_step(x, t[:7], mse)
    with pytest.raises(ValueError, match="0-d"):
        pipe.forward(np.float64(1.0))
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.train_step(x, t, None)
    with pytest.raises(TypeError, match=r"pair \(loss, grad_y\)"):
        pipe.train_step(x, t, lambda y, tt: 1.0)
    with pytest.raises(ValueError, match="scalar loss"):
        pipe.train_step(x, t, lambda y, tt: (np.ones(2), y))
    with pytest.raises(ValueError, match="grad_y of shape"):
        pipe.train_step(x, t, lambda y, tt: (1.0, y[:, :1]))
    # A failed step leaves a usable pipeline.
    want = sequential(list(pipe.stages.values()), x, t)[0]
    assert pipe.train_step(x, t, mse) == pytest.approx(want, rel=1e-13)


def test_stage_errors():
    p = layer_params(0, 0, 2, 2)
    with pytest.raises(TypeError, match="backward_input was given without backward_weight"):
        PipelineStage(fwd, bwd, p, backward_input=bwd_input)
    with pytest.raises(TypeError, match="needs backward"):
        PipelineStage(fwd, None, p)
    with pytest.raises(TypeError, match="forward must be callable"):
        PipelineStage(3, bwd, p)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an axondist.Parameter"):
        PipelineStage(fwd, bwd, [np.zeros(2)])
    x, t = data(0, 4, 2, 2)

    def run(stage0, stage1=None):
        stages = [stage0, stage1 or PipelineStage(fwd, bwd, layer_params(0, 1, 2, 2))]
        return Pipeline.from_stages(stages, num_microbatches=2).train_step(x, t, mse)

    with pytest.raises(TypeError, match=r"stage 0 .*forward must return a pair"):
        run(PipelineStage(lambda ps, x: x, bwd, p))
    with pytest.raises(TypeError, match="leading batch axis"):
        run(PipelineStage(lambda ps, x: (np.float64(1), None), bwd, p))
    with pytest.raises(ValueError, match=r"one gradient per parameter \(2"):
        run(PipelineStage(fwd, lambda ps, s, g: (None, [g]), p))
    with pytest.raises(ValueError, match=r"shape \(3,\) for parameter 1 \(b0\)"):
        run(PipelineStage(fwd, lambda ps, s, g: (None, [np.zeros((2, 2)), np.zeros(3)]), p))
    with pytest.raises(ValueError, match=r"stage 1 .*grad_x=None"):
        run(PipelineStage(fwd, bwd, p),
            PipelineStage(fwd, lambda ps, s, g: (None, bwd(ps, s, g)[1]),
                          layer_params(0, 1, 2, 2)))
    with pytest.raises(ValueError, match="must keep the leading"):
        run(PipelineStage(fwd, bwd, p),
            PipelineStage(lambda ps, x: fwd(ps, x[:1]), bwd, layer_params(0, 1, 2, 2)))


def test_pipeline_argument_errors():
    stages = make_stages(0, [2, 2, 2, 2])
    with pytest.raises(ValueError, match="do not split into chunks=2"):
        Pipeline.from_stages(stages, num_microbatches=2, chunks=2)
    with pytest.raises(ValueError, match="INTERLEAVED"):
        Pipeline.from_stages(stages[:2], num_microbatches=2, chunks=2)
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        Pipeline.from_stages(stages, num_microbatches=2, schedule="fast")
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1, got 0"):
        Pipeline.from_stages(stages, num_microbatches=0)
    with pytest.raises(ValueError, match="chunks must be an int >= 1, got 0"):
        Pipeline.from_stages(stages, num_microbatches=2, chunks=0)
    with pytest.raises(ValueError, match="at least one PipelineStage"):
        Pipeline.from_stages([], num_microbatches=1)
    with pytest.raises(TypeError, match="stage 1 is a function"):
        Pipeline.from_stages([stages[0], fwd], num_microbatches=1)
