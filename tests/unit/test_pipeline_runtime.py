"""Pipeline runtime, single-process mode: every schedule against sequential full-batch training.

The model is a chain of affine + tanh layers in float64 with hand-written
backward passes (full, and split into input and weight halves for the
zero-bubble schedule).  The reference runs the same layers one after the
other on the whole batch.
"""

from __future__ import annotations

import logging
import math

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
    make_optimizer,
    make_stages,
    mse,
    sequential,
    state_of,
    train_sequential,
)

import axondist as ad
from axondist.errors import NonFiniteNormError
from axondist.optim import SGD
from axondist.pipeline import (
    SCHEDULES,
    ActionKind,
    Pipeline,
    PipelineMemoryStats,
    PipelineSchedule,
    PipelineStage,
    ScheduleError,
    build_schedule,
    parse_schedule,
    render_text,
    schedule_names,
    simulate,
)

K = PipelineSchedule
SINGLE_CHUNK = tuple(kind for kind, spec in SCHEDULES.items() if not spec.multi_chunk)
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
    for kind in SCHEDULES:
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


# ---------------------------------------------------------------- the calls shared with DDP/FSDP


@settings(max_examples=10, deadline=None)
@given(shapes(), st.sampled_from(["one_call", "accumulate"]), st.sampled_from([None, 0.05]),
       st.sampled_from(["sgd", "adam"]))
def test_step_and_no_sync_accumulation_equal_sequential_training(shape, style, max_norm,
                                                                 opt_kind):
    p, v, m, rows, dims, seed = shape
    for kind, chunks, split in variants(p, v):
        d = dims[: p * chunks + 1]
        count = 2 if style == "accumulate" else 1
        steps = [[data(seed + 10 * k + j, rows, d[0], d[-1]) for j in range(count)]
                 for k in range(2)]
        ref = make_stages(seed, d)
        want_losses, _ = train_sequential(ref, steps, max_norm, opt_kind)
        pipe = Pipeline.from_stages(make_stages(seed, d, split), num_microbatches=m,
                                    schedule=kind, chunks=chunks, loss_fn=mse)
        opt = make_optimizer(opt_kind, pipe.parameters())
        for batches, want in zip(steps, want_losses):
            with pipe.no_sync():
                for x, t in batches[:-1]:
                    pipe.backward(x, t)
            assert pipe.step(*batches[-1], optimizer=opt, max_norm=max_norm) == (
                pytest.approx(want, rel=1e-10))
        state = pipe.state_dict()
        for name, value in state_of(ref).items():
            np.testing.assert_allclose(state[name], value, rtol=1e-9, atol=1e-11,
                                       err_msg=f"{kind} {split} {name}")


@settings(max_examples=10, deadline=None)
@given(shapes())
def test_backward_adds_into_grad_and_train_step_replaces(shape):
    p, v, m, rows, dims, seed = shape
    for kind, chunks, split in variants(p, v):
        stages = make_stages(seed, dims[: p * chunks + 1], split)
        x, t = data(seed, rows, dims[0], dims[p * chunks])
        _, want, _ = sequential(make_stages(seed, dims[: p * chunks + 1]), x, t)
        pipe = Pipeline.from_stages(stages, num_microbatches=m, schedule=kind, chunks=chunks)
        with pipe.no_sync():
            pipe.backward(x, t, loss_fn=mse)
            pipe.backward(x, t, loss_fn=mse)
        check_grads(stages, want, 2, f"{kind} {split}: two backward calls")
        pipe.train_step(x, t, mse)
        check_grads(stages, want, 1, f"{kind} {split}: train_step after them")
        pipe.zero_grad(set_to_none=False)
        assert all(not prm.grad.any() for prm in pipe.parameters())
        pipe.backward(x, t, loss_fn=mse)
        check_grads(stages, want, 1, f"{kind} {split}: backward after zero_grad(False)")
        pipe.zero_grad()
        assert all(prm.grad is None for prm in pipe.parameters())


def check_grads(stages, want, factor, where):
    for stage, gs in zip(stages, want):
        for prm, g in zip(stage.params, gs):
            np.testing.assert_allclose(prm.grad, factor * g, rtol=1e-10, atol=1e-12,
                                       err_msg=where)


def test_state_dict_in_one_process_names_a_shared_parameter_once():
    rng = np.random.default_rng(4)
    W = ad.Parameter(rng.standard_normal((3, 3)) / 2, "W")
    b = [ad.Parameter(np.zeros(3)), ad.Parameter(np.ones(3), "b1")]
    stages = [PipelineStage(fwd, bwd, [W, b[0]]), PipelineStage(fwd, bwd, [W, b[1]])]
    pipe = Pipeline.from_stages(stages, num_microbatches=2, loss_fn=mse)
    state = pipe.state_dict()
    assert list(state) == ["W", "param1", "b1"]
    np.testing.assert_array_equal(state["b1"], np.ones(3))
    state["b1"] = state["b1"] + 1  # a copy: the model is unchanged
    np.testing.assert_array_equal(b[1].data, np.ones(3))
    pipe.load_state_dict({"W": np.eye(3), "param1": np.full(3, 2.0), "b1": np.zeros(3)})
    np.testing.assert_array_equal(W.data, np.eye(3))
    np.testing.assert_array_equal(b[0].data, np.full(3, 2.0))
    with pipe.summon_full_params() as held:
        assert held == [W, b[0], b[1]]
    with pytest.raises(ValueError, match=r"Pipeline.load_state_dict: 'W' has shape \(2, 3\)"):
        pipe.load_state_dict({"W": np.eye(3)[:2], "param1": np.zeros(3), "b1": np.zeros(3)})
    np.testing.assert_array_equal(b[1].data, np.zeros(3))  # nothing written by the failed load


def test_clip_grad_norm_error_if_nonfinite_is_also_positional():
    pipe = Pipeline.from_stages(make_stages(2, [2, 2, 2]), num_microbatches=2, loss_fn=mse)
    pipe.backward(*data(2, 4, 2, 2))
    pipe.parameters()[0].grad[0, 0] = math.inf
    with pytest.raises(NonFiniteNormError, match="is inf"):
        pipe.clip_grad_norm(1.0, 2.0, True)
    assert pipe.clip_grad_norm(1.0, 2.0, False) == math.inf


# ---------------------------------------------------------------- memory


@EXAMPLES
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 3))
def test_measured_peak_activations_equal_the_formulas(p, m, v):
    dims = [2] * (p * v + 1)
    x, t = data(0, m + 1, 2, 2)
    for kind in SCHEDULES:
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
    with pytest.raises(ValueError) as info:
        Pipeline.from_stages(stages, num_microbatches=2, schedule="fast")
    assert str(info.value).startswith("Pipeline.from_stages: schedule='fast' is not one of")
    assert all(repr(name) in str(info.value) for name in schedule_names())
    with pytest.raises(TypeError, match="schedule must be a PipelineSchedule, one of"):
        Pipeline.from_stages(stages, num_microbatches=2, schedule=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_microbatches is required"):
        Pipeline.from_stages(stages)
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1, got 0"):
        Pipeline.from_stages(stages, num_microbatches=0)
    with pytest.raises(ValueError, match="chunks must be an int >= 1, got 0"):
        Pipeline.from_stages(stages, num_microbatches=2, chunks=0)
    with pytest.raises(ValueError, match="at least one PipelineStage"):
        Pipeline.from_stages([], num_microbatches=1)
    for bad in (None, 3, "stage"):
        with pytest.raises(TypeError, match="Pipeline.from_stages: stages must be a "
                                            "PipelineStage or a list of them, got"):
            Pipeline.from_stages(bad, num_microbatches=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stage 1 is a function"):
        Pipeline.from_stages([stages[0], fwd], num_microbatches=1)


# ---------------------------------------------------------------- schedules by name or by value


def test_schedule_names_in_any_case():
    for word, kind, chunks in (("ZB_H1", K.ZERO_BUBBLE_H1, 1), ("GPipe", K.GPIPE, 1),
                               (" Interleaved_1F1B ", K.INTERLEAVED_ONE_F_ONE_B, 2),
                               ("INTERLEAVED_ONE_F_ONE_B_LEAN", K.INTERLEAVED_ONE_F_ONE_B_LEAN, 2)):
        pipe = Pipeline.from_stages(make_stages(0, [2] * (2 * chunks + 1), "both"),
                                    num_microbatches=3, schedule=word, chunks=chunks)
        assert pipe.schedule.kind is kind


@settings(max_examples=25, deadline=None)
@given(shapes(), st.sampled_from(list(SCHEDULES)))
def test_a_hand_made_schedule_runs_like_the_generated_one(shape, kind):
    p, v, m, rows, dims, seed = shape
    v = 1 if kind in SINGLE_CHUNK else v
    dims = dims[: p * v + 1]
    generated = build_schedule(kind, p, m, v)
    by_hand = parse_schedule([" ".join(a.text(v) for a in row) for row in generated.actions],
                             num_microbatches=m, chunks=v)
    assert by_hand.kind is None and by_hand.actions == generated.actions
    x, t = data(seed, rows, dims[0], dims[-1])
    want_loss, want_grads, _ = sequential(make_stages(seed, dims, "both"), x, t)
    stages = make_stages(seed, dims, "both")
    pipe = Pipeline.from_stages(stages, schedule=by_hand)
    assert pipe.schedule is by_hand and (pipe.num_microbatches, pipe.chunks) == (m, v)
    assert "custom" in repr(pipe)
    np.testing.assert_allclose(pipe.train_step(x, t, mse), want_loss, rtol=1e-12)
    for st_, grads in zip(stages, want_grads):
        for prm, g in zip(st_.params, grads):
            np.testing.assert_allclose(prm.grad, g, rtol=1e-10, atol=1e-12)
    # Every full backward split into its halves, I then W, on any number of chunks.
    split = parse_schedule(
        [" ".join(f"{a.chunk}I{a.microbatch} {a.chunk}W{a.microbatch}"
                  if a.kind is ActionKind.B else a.text(v) for a in row)
         for row in generated.actions], num_microbatches=m, chunks=v)
    stages = make_stages(seed, dims, "both")
    pipe = Pipeline.from_stages(stages, schedule=split)
    assert pipe.schedule.uses_split_backward
    np.testing.assert_allclose(pipe.train_step(x, t, mse), want_loss, rtol=1e-12)
    for st_, grads in zip(stages, want_grads):
        for prm, g in zip(st_.params, grads):
            np.testing.assert_allclose(prm.grad, g, rtol=1e-10, atol=1e-12)


def test_a_hand_made_order_no_generator_makes():
    # Rank 0 runs its forwards first, like GPipe, while rank 1 alternates.
    custom = parse_schedule(["F0 F1 F2 B0 B1 B2", "F0 B0 F1 B1 F2 B2"])
    stages = make_stages(3, [2, 3, 2])
    x, t = data(3, 6, 2, 2)
    want_loss, want_grads, _ = sequential(make_stages(3, [2, 3, 2]), x, t)
    pipe = Pipeline.from_stages(stages, schedule=custom)
    assert pipe.train_step(x, t, mse) == pytest.approx(want_loss, rel=1e-12)
    for st_, grads in zip(stages, want_grads):
        for prm, g in zip(st_.params, grads):
            np.testing.assert_allclose(prm.grad, g, rtol=1e-10, atol=1e-12)


def test_a_bad_hand_made_schedule_is_refused_before_running():
    calls = []

    def counting_fwd(ps, x):
        calls.append(1)
        return fwd(ps, x)

    stages = [PipelineStage(counting_fwd, bwd, layer_params(0, s, 2, 2)) for s in range(2)]
    with pytest.raises(ScheduleError) as info:  # backward before its forward
        Pipeline.from_stages(stages, schedule=parse_schedule(["B0 F0", "F0 B0"]))
    assert (info.value.rank, info.value.step) == (0, 0)
    with pytest.raises(ScheduleError, match="in-order point-to-point delivery"):
        Pipeline.from_stages(stages, schedule=parse_schedule(["F0 B0 F1 B1", "F0 F1 B1 B0"]))
    with pytest.raises(ScheduleError, match="the schedule is for 3 rank"):
        Pipeline.from_stages(stages, schedule=parse_schedule(["F0 B0"] * 3))
    good = parse_schedule(["F0 F1 B0 B1", "F0 B0 F1 B1"])
    with pytest.raises(ScheduleError, match="num_microbatches=3 but the schedule has"):
        Pipeline.from_stages(stages, num_microbatches=3, schedule=good)
    with pytest.raises(ScheduleError, match="chunks=2 but the schedule has chunks=1"):
        Pipeline.from_stages(stages, chunks=2, schedule=good)
    with pytest.raises(TypeError, match="validate: schedule must be a Schedule"):
        ad.pipeline.validate("F0 B0")  # type: ignore[arg-type]
    assert calls == []
    pipe = Pipeline.from_stages(stages, num_microbatches=2, chunks=1, schedule=good)
    pipe.train_step(*data(0, 4, 2, 2), mse)
    assert len(calls) == 4


def test_building_a_pipeline_logs_its_schedule(caplog):
    with caplog.at_level(logging.INFO, logger="axondist.pipeline"):
        Pipeline.from_stages(make_stages(0, [2, 2, 2, 2]), num_microbatches=4, schedule="1f1b")
    records = [r for r in caplog.records if r.name == "axondist.pipeline"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    msg = records[0].getMessage()
    assert msg.startswith("pipeline schedule 1f1b: 3 rank(s) x 1 chunk(s), 4 microbatch(es)")
    assert "bubble 0.333" in msg and "peak activations per rank [3, 2, 1]" in msg
    assert build_schedule(K.ONE_F_ONE_B, 3, 4).text() in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="axondist.pipeline"):
        Pipeline.from_stages(make_stages(0, [2, 2, 2]), num_microbatches=2)
    assert not [r for r in caplog.records if r.name == "axondist.pipeline"]


# ---------------------------------------------------------------- clip_grad_norm


def torch_clip(grads, max_norm, norm_type):
    """torch.nn.utils.clip_grad_norm_ in NumPy: the norm of the per-tensor norms, then every
    gradient times clamp(max_norm / (norm + 1e-6), max=1), NaN included."""
    if math.isinf(norm_type):
        norms = [np.max(np.abs(g)) for g in grads]
        total = np.max(norms) if norms else 0.0
    else:
        norms = [np.sum(np.abs(g) ** norm_type) ** (1 / norm_type) for g in grads]
        total = np.sum(np.array(norms) ** norm_type) ** (1 / norm_type)
    coef = np.minimum(max_norm / (total + 1e-6), 1.0)  # np.minimum keeps NaN
    with np.errstate(invalid="ignore"):
        return float(total), [g * coef for g in grads]


def poison(grads, where, value):
    """``grads`` with ``value`` written at flat position ``where`` of the concatenation."""
    out = [g.copy() for g in grads]
    for g in out:
        if where < g.size:
            g.reshape(-1)[where] = value
            break
        where -= g.size
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1.0, 2.0, 3.5, math.inf, "inf"]),
       st.floats(0.01, 100), st.sampled_from([None, math.nan, math.inf, -math.inf]),
       st.integers(0, 40), st.integers(2, 3))
def test_clip_grad_norm_matches_torch_including_nan_and_inf(seed, norm_type, max_norm, bad,
                                                             where, p):
    stages = make_stages(seed, [3] * (p + 1))
    x, t = data(seed, 5, 3, 3)
    pipe = Pipeline.from_stages(stages, num_microbatches=2)
    pipe.train_step(x, t, mse)
    params = pipe.parameters()
    grads = [prm.grad for prm in params]
    if bad is not None:
        grads = poison(grads, where % sum(g.size for g in grads), bad)
        for prm, g in zip(params, grads):
            prm.grad = g
    order = math.inf if norm_type == "inf" else norm_type
    want_norm, want_grads = torch_clip([g.copy() for g in grads], max_norm, order)
    norm = pipe.clip_grad_norm(max_norm, norm_type)
    if math.isnan(want_norm):
        assert math.isnan(norm)
    else:
        assert norm == pytest.approx(want_norm, rel=1e-12)
    for prm, g in zip(params, want_grads):
        np.testing.assert_allclose(prm.grad, g, rtol=1e-12, atol=0, equal_nan=True)
    if bad is not None:
        assert not math.isfinite(norm)


def test_clip_grad_norm_scales_only_above_max_norm():
    stages = make_stages(1, [2, 2, 2])
    pipe = Pipeline.from_stages(stages, num_microbatches=2)
    pipe.train_step(*data(1, 4, 2, 2), mse)
    before = [prm.grad.copy() for prm in pipe.parameters()]
    norm = pipe.clip_grad_norm(1e9)
    assert norm == pytest.approx(math.sqrt(sum(float(np.sum(g * g)) for g in before)))
    for prm, g in zip(pipe.parameters(), before):
        np.testing.assert_array_equal(prm.grad, g)
    assert pipe.clip_grad_norm(norm / 2) == pytest.approx(norm)
    assert pipe.clip_grad_norm(1e9) == pytest.approx(norm / 2, rel=1e-5)


def test_clip_grad_norm_error_if_nonfinite_leaves_the_gradients():
    pipe = Pipeline.from_stages(make_stages(2, [2, 2, 2]), num_microbatches=2)
    pipe.train_step(*data(2, 4, 2, 2), mse)
    pipe.parameters()[1].grad[0] = math.nan
    before = [prm.grad.copy() for prm in pipe.parameters()]
    for norm_type in (2.0, math.inf):
        with pytest.raises(NonFiniteNormError, match="error_if_nonfinite=False") as info:
            pipe.clip_grad_norm(1.0, norm_type, error_if_nonfinite=True)
        assert isinstance(info.value, RuntimeError)
        assert str(info.value).startswith("Pipeline.clip_grad_norm: the total norm of order")
        for prm, g in zip(pipe.parameters(), before):
            np.testing.assert_array_equal(prm.grad, g)
    assert math.isnan(pipe.clip_grad_norm(1.0, math.inf))  # Python's max would say 0.5 or so
    assert all(np.isnan(prm.grad).all() for prm in pipe.parameters())


def test_clip_grad_norm_argument_errors():
    pipe = Pipeline.from_stages(make_stages(0, [2, 2, 2]), num_microbatches=2)
    assert pipe.clip_grad_norm(1.0) == 0.0  # no gradients yet
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"Pipeline.clip_grad_norm: max_norm=.* finite"):
            pipe.clip_grad_norm(bad)
    with pytest.raises(TypeError, match="Pipeline.clip_grad_norm: max_norm must be a number"):
        pipe.clip_grad_norm("1")  # type: ignore[arg-type]
    for bad in (0, -2.0, math.nan, -math.inf, "two", None, True):
        with pytest.raises(ValueError, match="Pipeline.clip_grad_norm: norm_type must be"):
            pipe.clip_grad_norm(1.0, bad)  # type: ignore[arg-type]
