"""Pipeline runtime, distributed: one pipeline rank per world rank, messages over send/recv.

The pipeline has as many ranks as the world (``chunks`` stages each); every
rank builds all stages from the seed so it can run the sequential full-batch
reference itself, then checks the loss, its own stages' gradients, its
measured peak activations and (on the last rank) the inference output.
The same bodies run on the mock world and under ``mpiexec -n K``. The
training calls shared with DDP and FSDP (``backward``, ``step``,
``no_sync``, ``state_dict``...) are checked against single-process training
for every schedule kind, and their bad inputs fail on every rank alike.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import mock_only, run_world, world_sizes
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pipeline_toy import (
    bwd,
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
    Pipeline,
    PipelineMemoryStats,
    PipelineSchedule,
    PipelineStage,
    build_schedule,
    parse_schedule,
    simulate,
)

K = PipelineSchedule
SINGLE_CHUNK = tuple(kind for kind, spec in SCHEDULES.items() if not spec.multi_chunk)
MAX_STAGES = 4 * 3

def variants(p, v):
    for kind in SCHEDULES:
        for split in ("full", "halves", "both"):
            yield kind, (1 if kind in SINGLE_CHUNK else v), split


def local_stages(stages, p, rank, chunks):
    """Rank ``rank``'s stages: virtual stages rank, rank + p, ..."""
    return [stages[c * p + rank] for c in range(chunks)]


# ---------------------------------------------------------------- bodies


def body_train_and_forward(world, v, m, extra_rows, dims_all, seed):
    p, r = world.world_size, world.rank
    rows = m + extra_rows
    for kind, chunks, split in variants(p, v):
        dims = dims_all[: p * chunks + 1]
        last = (p * chunks - 1) % p
        stages = make_stages(seed, dims, split)
        x, t = data(seed, rows, dims[0], dims[-1])
        want_loss, want_grads, want_y = sequential(make_stages(seed, dims), x, t)

        # A message of the caller's on the world group must not meet the pipeline's.
        if p > 1:
            ad.send(np.array([r, 7]), (r + 1) % p, world, tag=0)
        pipe = Pipeline(local_stages(stages, p, r, chunks), world, num_microbatches=m,
                        schedule=kind, chunks=chunks)
        assert pipe.rank == r and pipe.holds_first_stage == (r == 0)
        assert pipe.holds_last_stage == (r == last)
        loss = pipe.train_step(x if r == 0 else None, t if r == last else None, mse)
        assert loss == pytest.approx(want_loss, rel=1e-12), (kind, split)
        for c in range(chunks):
            s = c * p + r
            for prm, g in zip(stages[s].params, want_grads[s]):
                np.testing.assert_allclose(prm.grad, g, rtol=1e-10, atol=1e-12)
        stats = pipe.last_stats
        assert stats.ranks == (r,)
        peak = stats.peak_activations[r]
        assert peak == simulate(pipe.schedule).peak_activations[r]
        if kind is K.GPIPE:
            assert peak == chunks * PipelineMemoryStats.gpipe_peak_activations(p, m)
        if kind is K.ONE_F_ONE_B:
            assert peak == min(p - r, m)
        if p > 1:
            got = ad.recv((r - 1) % p, world, tag=0)
            assert got.tolist() == [(r - 1) % p, 7]

        y = pipe.forward(x if r == 0 else None)
        if r == last:
            np.testing.assert_allclose(y, want_y, rtol=1e-13, atol=1e-14)
        else:
            assert y is None
        pipe.close()
    return True


def body_sgd(world, v, m, extra_rows, dims_all, seed, lr=0.1):
    p, r = world.world_size, world.rank
    rows = m + extra_rows
    for kind, chunks, split in variants(p, v):
        dims = dims_all[: p * chunks + 1]
        last = (p * chunks - 1) % p
        stages = make_stages(seed, dims, split)
        ref = make_stages(seed, dims)
        pipe = Pipeline(local_stages(stages, p, r, chunks), world, num_microbatches=m,
                        schedule=kind, chunks=chunks)
        opt = SGD(pipe, lr=lr, momentum=0.9)
        ref_params = [q for s in ref for q in s.params]
        ref_opt = SGD(ref_params, lr=lr, momentum=0.9)
        for it in range(3):
            x, t = data(seed + it, rows, dims[0], dims[-1])
            loss = pipe.train_step(x if r == 0 else None, t if r == last else None, mse)
            want, grads, _ = sequential(ref, x, t)
            assert loss == pytest.approx(want, rel=1e-10)
            for s, gs in zip(ref, grads):
                for prm, g in zip(s.params, gs):
                    prm.grad = g
            opt.step()
            ref_opt.step()
        for c in range(chunks):
            s = c * p + r
            for pa, pb in zip(stages[s].params, ref[s].params):
                np.testing.assert_allclose(pa.data, pb.data, rtol=1e-10, atol=1e-12)
        pipe.close()
    return True


def body_batch_errors(world):
    """Bad batches raise the same error on every rank (no rank is left waiting)."""
    p, r = world.world_size, world.rank
    pipe = Pipeline(make_stages(0, [2] * (p + 1))[r], world, num_microbatches=3)
    x, t = data(0, 6, 2, 2)
    messages = []
    for xb, tb in ((None, t), (x[:2], t[:2]), (x, t[:5])):
        try:
            pipe.train_step(xb if r == 0 else None, tb if r == p - 1 else None, mse)
        except ValueError as exc:
            messages.append(str(exc))
    assert len(messages) == 3
    assert "passed x=None" in messages[0]
    assert "x has 2 rows, fewer than num_microbatches=3" in messages[1]
    assert "target has 5 rows but x has 6" in messages[2]
    # Still usable afterwards.
    want = sequential(make_stages(0, [2] * (p + 1)), x, t)[0]
    assert pipe.train_step(x if r == 0 else None, t if r == p - 1 else None, mse) == (
        pytest.approx(want, rel=1e-12))
    pipe.close()
    return True


def body_clip(world, chunks, norm_type, bad_rank, seed):
    """clip_grad_norm over the ranks equals the single-process pipeline's, NaN/inf included."""
    p, r = world.world_size, world.rank
    dims = [3] * (p * chunks + 1)
    kind = K.INTERLEAVED_ONE_F_ONE_B if chunks > 1 else K.ONE_F_ONE_B
    x, t = data(seed, 6, 3, 3)
    ref = make_stages(seed, dims)
    Pipeline.from_stages(ref, num_microbatches=3, schedule=kind, chunks=chunks).train_step(
        x, t, mse)
    stages = make_stages(seed, dims)
    pipe = Pipeline(local_stages(stages, p, r, chunks), world, num_microbatches=3,
                    schedule=kind, chunks=chunks)
    pipe.train_step(x if r == 0 else None, t if r == (p * chunks - 1) % p else None, mse)
    if bad_rank is not None:
        ref[bad_rank].params[0].grad[0, 0] = math.inf if seed % 2 else math.nan
        if bad_rank % p == r:
            stages[bad_rank].params[0].grad[0, 0] = ref[bad_rank].params[0].grad[0, 0]
        with pytest.raises(NonFiniteNormError):  # on every rank alike
            pipe.clip_grad_norm(0.5, norm_type, error_if_nonfinite=True)
    single = Pipeline.from_stages(ref, num_microbatches=3, schedule=kind, chunks=chunks)
    want = single.clip_grad_norm(0.5, norm_type)
    got = pipe.clip_grad_norm(0.5, norm_type)
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, rel=1e-12)
    for c in range(chunks):
        for pa, pb in zip(stages[c * p + r].params, ref[c * p + r].params):
            np.testing.assert_allclose(pa.grad, pb.grad, rtol=1e-12, equal_nan=True)
    pipe.close()
    return got


def body_hand_made(world, kind, m):
    """A Schedule value (parsed from text) runs like the kind it was written from."""
    p, r = world.world_size, world.rank
    generated = build_schedule(kind, p, m)
    custom = parse_schedule([" ".join(map(str, row)) for row in generated.actions])
    stages = make_stages(4, [2] * (p + 1), "both")
    x, t = data(4, m + 2, 2, 2)
    pipe = Pipeline(stages[r], world, schedule=custom)
    assert pipe.schedule.kind is None and pipe.num_microbatches == m
    loss = pipe.train_step(x if r == 0 else None, t if r == p - 1 else None, mse)
    assert loss == pytest.approx(sequential(make_stages(4, [2] * (p + 1)), x, t)[0], rel=1e-12)
    pipe.close()
    pipe.close()  # a second close is a no-op
    assert pipe.group.backend is None
    return True


def step_batches(seed, step, rows, dims, style):
    """The (x, t) batches of one step: two (accumulated) with style "accumulate", else one."""
    count = 2 if style == "accumulate" else 1
    return [data(seed + 1000 * step + k, rows, dims[0], dims[-1]) for k in range(count)]


def body_one_loop(world, v, m, extra_rows, dims_all, seed, split, style, max_norm, opt_kind):
    """backward/clip/step, step, and no_sync accumulation train like one process, for every
    schedule kind; state_dict() then holds the whole trained model on every rank."""
    p, r = world.world_size, world.rank
    rows, steps = m + extra_rows, 2
    for kind in SCHEDULES:
        chunks = 1 if kind in SINGLE_CHUNK else v
        dims = dims_all[: p * chunks + 1]
        last = (p * chunks - 1) % p
        batches = [step_batches(seed, k, rows, dims, style) for k in range(steps)]
        ref = make_stages(seed, dims)
        want_losses, want_norms = train_sequential(ref, batches, max_norm, opt_kind)
        stages = make_stages(seed, dims, split)
        pipe = Pipeline(local_stages(stages, p, r, chunks), world, num_microbatches=m,
                        schedule=kind, chunks=chunks, loss_fn=mse)
        opt = make_optimizer(opt_kind, pipe.parameters())
        for k, step in enumerate(batches):
            if style == "two_calls":  # x and target only where they are read
                (x, t), = step
                loss = pipe.backward(x if r == 0 else None, t if r == last else None)
                if max_norm is not None:
                    assert pipe.clip_grad_norm(max_norm) == pytest.approx(want_norms[k],
                                                                          rel=1e-10)
                opt.step()
                opt.zero_grad()
            else:  # every rank passes the whole batch, as a data-parallel loop does
                with pipe.no_sync():
                    for x, t in step[:-1]:
                        pipe.backward(x, t)
                loss = pipe.step(*step[-1], optimizer=opt, max_norm=max_norm)
            assert loss == pytest.approx(want_losses[k], rel=1e-10), (kind, k)
            assert all(prm.grad is None for prm in pipe.parameters())
        state = pipe.state_dict()
        want = state_of(ref)
        assert list(state) == list(want), kind
        for name in want:
            np.testing.assert_allclose(state[name], want[name], rtol=1e-9, atol=1e-11,
                                       err_msg=f"{kind} {split} {style} {name}")
        pipe.close()
    return True


def unnamed_every_other(stages):
    """The same stages with the odd stages' parameters unnamed (global names param{i})."""
    for s, stage in enumerate(stages):
        if s % 2:
            for prm in stage.params:
                prm.name = None
    return stages


def body_state_dict(world, chunks, seed):
    """state_dict() is the whole model on every rank, as the one-process pipeline's; it loads
    into a pipeline of other values (each rank taking its own stages), which then trains the
    same."""
    p, r = world.world_size, world.rank
    n = p * chunks
    dims = [3] * (n + 1)
    kind = K.INTERLEAVED_ONE_F_ONE_B if chunks > 1 else K.ONE_F_ONE_B
    last = (n - 1) % p
    single = Pipeline.from_stages(unnamed_every_other(make_stages(seed, dims)),
                                  num_microbatches=2, schedule=kind, chunks=chunks)
    want = single.state_dict()
    names = [name for s in range(n) for name in (
        (f"param{2 * s}", f"param{2 * s + 1}") if s % 2 else (f"W{s}", f"b{s}"))]
    assert list(want) == names

    src = Pipeline(local_stages(unnamed_every_other(make_stages(seed, dims)), p, r, chunks),
                   world, num_microbatches=2, schedule=kind, chunks=chunks, loss_fn=mse)
    state = src.state_dict()
    assert list(state) == names
    for name in names:
        np.testing.assert_array_equal(state[name], want[name])
        assert isinstance(state[name], np.ndarray)

    mine = local_stages(unnamed_every_other(make_stages(seed + 1, dims)), p, r, chunks)
    dst = Pipeline(mine, world, num_microbatches=2, schedule=kind, chunks=chunks, loss_fn=mse)
    dst.load_state_dict(state)
    with dst.summon_full_params() as held:
        assert held == dst.parameters() == [q for st_ in mine for q in st_.params]
    for c, stage in enumerate(mine):
        s = c * p + r
        for k, prm in enumerate(stage.params):
            np.testing.assert_array_equal(prm.data, want[names[2 * s + k]])
    x, t = data(seed, 4, 3, 3)
    args = (x if r == 0 else None, t if r == last else None)
    assert dst.backward(*args) == src.backward(*args)
    src.close()
    dst.close()
    return True


def body_api_errors(world):
    """Bad arguments to the training calls raise the same clear error on every rank, and the
    pipeline works afterwards; a bad state on one rank does not leave the others waiting."""
    p, r = world.world_size, world.rank
    dims = [2] * (p + 1)
    stage = make_stages(0, dims)[r]
    with pytest.raises(TypeError, match=r"Pipeline: loss_fn must be a callable loss_fn\(y, "
                                        r"target\) -> \(loss, grad_y\), got str 'mse'"):
        Pipeline(stage, world, num_microbatches=2, loss_fn="mse")
    pipe = Pipeline(stage, world, num_microbatches=2)
    x, t = data(0, 4, 2, 2)
    opt = SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=rf"Pipeline.backward: no loss_fn where the last stage "
                                        rf"lives \(rank {p - 1}\); pass loss_fn=\.\.\."):
        pipe.backward(x, t)
    with pytest.raises(TypeError, match="Pipeline.step: no loss_fn"):
        pipe.step(x, t, optimizer=opt)
    with pytest.raises(TypeError, match="Pipeline.backward: loss_fn must be a callable"):
        pipe.backward(x, t, loss_fn=3)
    with pytest.raises(TypeError, match=r"Pipeline.step: optimizer= must be an optimizer.*got "
                                        "NoneType"):
        pipe.step(x, t, optimizer=None, loss_fn=mse)
    with pytest.raises(TypeError, match="Pipeline.step: max_norm must be a number, got str '1'"):
        pipe.step(x, t, optimizer=opt, max_norm="1", loss_fn=mse)
    with pytest.raises(ValueError, match="Pipeline.step: max_norm=-1.0 must be a finite number"):
        pipe.step(x, t, optimizer=opt, max_norm=-1.0, loss_fn=mse)
    with pipe.no_sync(), pytest.raises(RuntimeError, match="Pipeline.step: cannot step inside "
                                                          "no_sync"):
        pipe.step(x, t, optimizer=opt, loss_fn=mse)
    with pytest.raises(ValueError, match=r"Pipeline.backward: x has 1 rows, fewer than "
                                         "num_microbatches=2"):
        pipe.backward(x[:1], t[:1], loss_fn=mse)
    assert all(prm.grad is None for prm in pipe.parameters())  # nothing ran
    pipe.backward(x, t, loss_fn=mse)
    with pytest.raises(TypeError, match="clip_grad_norm: max_norm must be a number, got str"):
        pipe.clip_grad_norm("1")
    with pytest.raises(ValueError, match="clip_grad_norm: norm_type must be"):
        pipe.clip_grad_norm(1.0, "two")

    state = pipe.state_dict()
    with pytest.raises(TypeError, match="load_state_dict: state must be a dict"):
        pipe.load_state_dict([1, 2])
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['q9'\]"):
        pipe.load_state_dict({**state, "q9": np.zeros(1)})
    with pytest.raises(ValueError, match=r"'b0' has shape \(7,\), the parameter has \(2,\)"):
        pipe.load_state_dict({**state, "b0": np.zeros(7)})
    partial = dict(state)
    del partial[f"W{p - 1}"]
    with pytest.raises(ValueError, match=rf"missing \['W{p - 1}'\]"):
        pipe.load_state_dict(partial)
    # A bad state on rank 0 alone: rank 0 raises, the others load (nobody waits).
    if r == 0:
        with pytest.raises(TypeError, match="state must be a dict"):
            pipe.load_state_dict(None)
    else:
        pipe.load_state_dict(state)
    for prm in pipe.parameters():
        np.testing.assert_array_equal(prm.data, state[prm.name])
    pipe.close()

    # Only the last stage's rank needs a loss_fn; when it lacks one, every rank says so.
    only_last = Pipeline(make_stages(0, dims)[r], world, num_microbatches=2,
                         loss_fn=mse if r == p - 1 else None)
    want = sequential(make_stages(0, dims), x, t)[0]
    assert only_last.backward(x, t) == pytest.approx(want, rel=1e-12)
    only_last.close()
    not_last = Pipeline(make_stages(0, dims)[r], world, num_microbatches=2,
                        loss_fn=mse if r != p - 1 or p == 1 else None)
    if p > 1:
        with pytest.raises(TypeError, match=rf"no loss_fn where the last stage lives \(rank "
                                            rf"{p - 1}\)"):
            not_last.backward(x, t)
    assert not_last.backward(x, t, loss_fn=mse) == pytest.approx(want, rel=1e-12)
    not_last.close()

    clash = make_stages(0, dims)[r]
    for prm in clash.params:
        prm.name = "w"
    twins = Pipeline(clash, world, num_microbatches=2)
    with pytest.raises(ValueError, match=r"Pipeline.state_dict: two parameters are named 'w' "
                                         r"\(in stages 0 and 0\); name them uniquely"):
        twins.state_dict()
    twins.close()
    return True


# ---------------------------------------------------------------- tests


@settings(max_examples=6, deadline=None)
@given(world_sizes(1, 3), st.integers(1, 2), st.sampled_from([2.0, 1.0, math.inf]),
       st.integers(-1, 5), st.integers(0, 100))
def test_clip_grad_norm_over_the_ranks_equals_one_process(size, chunks, norm_type, bad, seed):
    bad_stage = None if bad < 0 else bad % (size * chunks)
    norms = run_world(body_clip, size, chunks, norm_type, bad_stage, seed)
    assert all(n == norms[0] or (math.isnan(n) and math.isnan(norms[0])) for n in norms)


@given(world_sizes(1, 3), st.sampled_from(list(SCHEDULES)), st.integers(1, 5))
@settings(max_examples=4, deadline=None)
def test_a_hand_made_schedule_runs_on_every_rank(size, kind, m):
    assert all(run_world(body_hand_made, size, kind, m))


@st.composite
def world_shapes(draw):
    size = draw(world_sizes(1, 4))
    v = draw(st.integers(1, 3))
    m = draw(st.integers(1, 7))  # includes fewer microbatches than stages
    extra_rows = draw(st.integers(0, 6))  # uneven splits
    dims = draw(st.lists(st.integers(1, 4), min_size=MAX_STAGES + 1, max_size=MAX_STAGES + 1))
    seed = draw(st.integers(0, 2**31 - 1))
    return size, v, m, extra_rows, dims, seed


@settings(max_examples=10, deadline=None)
@given(world_shapes())
# One rank with 3 chunks (stages pass tensors locally), and fewer microbatches than stages.
@example((1, 3, 2, 1, [3, 2, 4, 1, 2, 3, 4, 2, 1, 3, 2, 4, 3], 7))
@example((4, 2, 3, 4, [2, 3, 1, 4, 2, 2, 3, 1, 4, 2, 3, 3, 2], 11))
def test_every_schedule_equals_sequential_full_batch(shape):
    size, *args = shape
    assert all(run_world(body_train_and_forward, size, *args))


@settings(max_examples=3, deadline=None)
@given(world_shapes())
def test_sgd_steps_equal_sequential_training(shape):
    size, *args = shape
    assert all(run_world(body_sgd, size, *args))


@given(world_sizes(1, 4))
@settings(max_examples=4, deadline=None)
def test_bad_batches_fail_on_every_rank(size):
    assert all(run_world(body_batch_errors, size))


@mock_only
def test_wrong_number_of_chunks_and_failing_stage():
    def wrong_chunks(world):
        Pipeline(make_stages(0, [2, 2, 2]), world, num_microbatches=2, chunks=1)

    with pytest.raises(ValueError, match="passed 2 stage"):
        run_world(wrong_chunks, 2)

    def failing(world):
        def boom(params, x):
            raise FloatingPointError("stage blew up")

        stage = PipelineStage(boom if world.rank == 1 else fwd, bwd, layer_params(0, 0, 2, 2))
        pipe = Pipeline(stage, world, num_microbatches=4)
        x, t = data(0, 4, 2, 2)
        pipe.train_step(x, t, mse)

    # Rank 1 fails; the others are woken instead of waiting for its messages.
    with pytest.raises(FloatingPointError, match="stage blew up"):
        run_world(failing, 3, timeout=20)


def diag_fwd(params, x):
    w, b = params
    y = np.tanh(x * w + b)
    return y, (x, y)


def diag_bwd(params, saved, gy):
    x, y = saved
    gz = gy * (1.0 - y * y)
    return gz * params[0], [(x * gz).sum(axis=0), gz.sum(axis=0)]


def diag_stages(n, width):
    """Element-wise stages (no BLAS, so threads of the mock world do not oversubscribe it)."""
    out = []
    for s in range(n):
        rng = np.random.default_rng([5, s])
        out.append(PipelineStage(diag_fwd, diag_bwd, [ad.Parameter(rng.standard_normal(width)),
                                                      ad.Parameter(rng.standard_normal(width))]))
    return out


def body_large_messages(world, width):
    """Activations above MPI's eager limit: 1F1B ranks send to each other at the same
    time, which deadlocks unless sends are buffered."""
    p, r = world.world_size, world.rank
    x, t = data(1, 64, width, width)
    for kind, chunks in ((K.ONE_F_ONE_B, 1), (K.ZERO_BUBBLE_H1, 1),
                         (K.INTERLEAVED_ONE_F_ONE_B, 2)):
        stages = diag_stages(p * chunks, width)
        h = x
        for st_ in stages:
            h = diag_fwd(st_.param_arrays(), h)[0]
        want = mse(h, t)[0]
        last = (p * chunks - 1) % p
        pipe = Pipeline(local_stages(stages, p, r, chunks), world, num_microbatches=4,
                        schedule=kind, chunks=chunks)
        loss = pipe.train_step(x if r == 0 else None, t if r == last else None, mse)
        assert loss == pytest.approx(want, rel=1e-12)
        pipe.close()
    return True


def test_large_activations_do_not_deadlock():
    # 16 rows x 256 float64 = 32 KiB per microbatch activation.
    assert all(run_world(body_large_messages, 3, 256))


@st.composite
def one_loop_cases(draw):
    size, v, m, extra_rows, dims, seed = draw(world_shapes())
    return (size, v, m, extra_rows, dims, seed, draw(st.sampled_from(["full", "halves", "both"])),
            draw(st.sampled_from(["two_calls", "one_call", "accumulate"])),
            draw(st.sampled_from([None, 0.05, 100.0])), draw(st.sampled_from(["sgd", "adam"])))


@settings(max_examples=8, deadline=None)
@given(one_loop_cases())
@example((2, 2, 3, 1, [2, 3, 1, 4, 2, 2, 3, 1, 4, 2, 3, 3, 2], 5, "halves", "accumulate", 0.05,
          "adam"))
def test_the_one_loop_calls_train_like_one_process(case):
    size, *args = case
    assert all(run_world(body_one_loop, size, *args))


@settings(max_examples=4, deadline=None)
@given(world_sizes(1, 3), st.integers(1, 2), st.integers(0, 100))
def test_state_dict_is_the_whole_model_and_loads_back(size, chunks, seed):
    assert all(run_world(body_state_dict, size, chunks, seed))


@given(world_sizes(1, 3))
@settings(max_examples=3, deadline=None)
def test_training_call_errors_are_clear_on_every_rank(size):
    assert all(run_world(body_api_errors, size))
