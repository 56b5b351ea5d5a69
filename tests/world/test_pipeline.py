"""Pipeline runtime, distributed: one pipeline rank per world rank, messages over send/recv.

The pipeline has as many ranks as the world (``chunks`` stages each); every
rank builds all stages from the seed so it can run the sequential full-batch
reference itself, then checks the loss, its own stages' gradients, its
measured peak activations and (on the last rank) the inference output.
The same bodies run on the mock world and under ``mpiexec -n K``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import mock_only, run_world, world_sizes
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pipeline_toy import bwd, data, fwd, layer_params, make_stages, mse, sequential

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
