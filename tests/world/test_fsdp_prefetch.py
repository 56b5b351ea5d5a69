"""FSDP's layer-by-layer step (``FSDP.from_layers``) against single-process training.

The model is a random chain of layers (affine maps with tanh, elementwise
scales, parameter-free activations), each a PipelineStage with hand-written
forward and backward. Every rank's batch derives from (seed, rank, step) and
all local batches have the same size, so the ranks' averaged gradient is the
gradient on the concatenated batch: each rank computes alone what one process
gets, and checks its parameters, losses and how many units it ever held.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import mock_only, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist.fsdp import FSDP, MixedPrecision, ShardingStrategy
from axondist.fsdp._layers import LayerPlan
from axondist.optim import SGD, Adam
from axondist.pipeline import PipelineStage

STRATEGIES = list(ShardingStrategy)
BATCH = 3
KINDS = ("affine", "scale", "act")


# --- the model: layers and their reference ---------------------------------------------------

def layer_kinds(seed: int) -> list[str]:
    rng = np.random.default_rng([seed, 1])
    kinds = [KINDS[int(k)] for k in rng.integers(0, 3, size=int(rng.integers(1, 6)))]
    return kinds if any(k != "act" for k in kinds) else kinds + ["affine"]


def widths(seed: int) -> list[int]:
    rng = np.random.default_rng([seed, 2])
    kinds = layer_kinds(seed)
    out = [int(rng.integers(1, 5))]
    for kind in kinds:
        out.append(int(rng.integers(1, 5)) if kind == "affine" else out[-1])
    return out


def affine_forward(pa: list, x: np.ndarray) -> tuple:
    w, b = pa
    h = np.tanh(x @ w.astype(np.float64) + b.astype(np.float64))
    return h, (x, h)


def affine_backward(pa: list, saved: tuple, gy: np.ndarray) -> tuple:
    w, _ = pa
    x, h = saved
    d = gy * (1.0 - h * h)
    return d @ w.astype(np.float64).T, [(x.T @ d).astype(w.dtype), d.sum(0).astype(w.dtype)]


def scale_forward(pa: list, x: np.ndarray) -> tuple:
    return x * pa[0].astype(np.float64), x


def scale_backward(pa: list, x: np.ndarray, gy: np.ndarray) -> tuple:
    return gy * pa[0].astype(np.float64), [(gy * x).sum(0).astype(pa[0].dtype)]


def act_forward(_pa: list, x: np.ndarray) -> tuple:
    return np.sin(x), x


def act_backward(_pa: list, x: np.ndarray, gy: np.ndarray) -> tuple:
    return gy * np.cos(x), []


def make_layers(seed: int) -> list[PipelineStage]:
    rng = np.random.default_rng([seed, 3])
    dims = widths(seed)
    layers = []
    for k, kind in enumerate(layer_kinds(seed)):
        if kind == "affine":
            w = (rng.standard_normal((dims[k], dims[k + 1])) / math.sqrt(dims[k]))
            params = [ad.Parameter(w.astype(np.float32), f"l{k}.w"),
                      ad.Parameter(rng.standard_normal(dims[k + 1]).astype(np.float32) / 4,
                                   f"l{k}.b")]
            layers.append(PipelineStage(affine_forward, affine_backward, params, name=f"l{k}"))
        elif kind == "scale":
            s = 1.0 + rng.standard_normal(dims[k]).astype(np.float32) / 4
            layers.append(PipelineStage(scale_forward, scale_backward,
                                        [ad.Parameter(s, f"l{k}.s")], name=f"l{k}"))
        else:
            layers.append(PipelineStage(act_forward, act_backward, [], name=f"l{k}"))
    return layers


def loss_fn(y: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    d = y - target
    return 0.5 * float(np.mean(np.sum(d * d, axis=1))), d / len(y)


def batch(seed: int, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    dims = widths(seed)
    rng = np.random.default_rng([seed, 4, rank, step])
    return rng.standard_normal((BATCH, dims[0])), rng.standard_normal((BATCH, dims[-1]))


def global_batch(seed: int, ranks: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*(batch(seed, r, step) for r in range(ranks)))
    return np.concatenate(xs), np.concatenate(ys)


def run_layers(layers: list[PipelineStage], x: np.ndarray,
               target: np.ndarray) -> tuple[float, list[list]]:
    """One process: forward through every layer, the loss, backward; gradients per layer."""
    saved = []
    for layer in layers:
        x, s = layer.run_forward(x, "reference")
        saved.append(s)
    loss, grad = loss_fn(x, target)
    grads: list[list] = [[] for _ in layers]
    for k in reversed(range(len(layers))):
        grad, grads[k] = layers[k].run_backward(saved[k], grad, "reference")
    return loss, grads


def make_optimizer(kind: str, params: list) -> object:
    return SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.01)


def reference(seed: int, ranks: int, steps: int, opt_kind: str) -> tuple[list, list[float]]:
    """Parameters after ``steps`` one-process steps on the concatenated batches, and the
    losses of rank 0's local batches before each step (what FSDP's rank 0 reports)."""
    layers = make_layers(seed)
    params = [p for layer in layers for p in layer.parameters()]
    opt = make_optimizer(opt_kind, params)
    losses = []
    for step in range(steps):
        losses.append(run_layers(layers, *batch(seed, 0, step))[0])
        _, grads = run_layers(layers, *global_batch(seed, ranks, step))
        for p, g in zip(params, [g for gs in grads for g in gs]):
            p.grad = g
        opt.step()
        opt.zero_grad()
    return [p.data for p in params], losses


def rpn(strategy: ShardingStrategy, world_size: int, seed: int) -> int | None:
    if strategy is not ShardingStrategy.HYBRID_SHARD:
        return None
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return divisors[seed % len(divisors)]


def full_values(f: FSDP) -> list[np.ndarray]:
    with f.summon_full_params() as params:
        return [np.array(p.data, dtype=np.float64) for p in params]


def assert_close(got: list, want: list, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=rtol, atol=atol)


class Watch:
    """Wraps each layer's callables to record how many units are gathered while it runs."""

    def __init__(self) -> None:
        self.fsdp: FSDP | None = None
        self.most = 0

    def look(self) -> None:
        assert self.fsdp is not None
        held = sum(self.fsdp.is_gathered(u) or self.fsdp.is_gathering(u)
                   for u in range(len(self.fsdp.units)))
        self.most = max(self.most, held)

    def wrap(self, layer: PipelineStage) -> PipelineStage:
        fwd, bwd = layer.forward_fn, layer.backward_fn
        assert bwd is not None

        def forward(pa: list, x: np.ndarray) -> tuple:
            self.look()
            return fwd(pa, x)

        def backward(pa: list, saved: object, gy: np.ndarray) -> tuple:
            self.look()
            return bwd(pa, saved, gy)

        return PipelineStage(forward, backward, layer.parameters(), name=layer.name)


# --- training equals one process --------------------------------------------------------------

@given(world_size=world_sizes(1, 4), strategy=st.sampled_from(STRATEGIES),
       prefetch=st.booleans(), reshard_after_forward=st.booleans(),
       opt_kind=st.sampled_from(["sgd", "adam"]), seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_layered_step_matches_single_process(world_size: int, strategy: ShardingStrategy,
                                             prefetch: bool, reshard_after_forward: bool,
                                             opt_kind: str, seed: int) -> None:
    steps = 3
    want, want_losses = reference(seed, world_size, steps, opt_kind)

    def body(world: ad.World) -> None:
        watch = Watch()
        f = FSDP.from_layers([watch.wrap(layer) for layer in make_layers(seed)], world,
                             loss_fn=loss_fn, prefetch=prefetch,
                             reshard_after_forward=reshard_after_forward,
                             sharding_strategy=strategy,
                             ranks_per_node=rpn(strategy, world.world_size, seed))
        watch.fsdp = f
        opt = make_optimizer(opt_kind, f.sharded_parameters())
        losses = [f.step(*batch(seed, world.rank, step), optimizer=opt) for step in range(steps)]
        assert_close(full_values(f), want)
        if world.rank == 0:
            np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        units = len(f.units)
        if strategy.shards_parameters:  # FULL_SHARD, HYBRID_SHARD: units come and go
            bound = units if not reshard_after_forward else (2 if prefetch else 1)
            assert watch.most <= min(units, bound)
            assert not any(f.is_gathered(u) for u in range(units))  # all dropped after a step

    run_world(body, world_size)


@given(world_size=world_sizes(1, 4), strategy=st.sampled_from(STRATEGIES),
       prefetch=st.booleans(), seed=st.integers(0, 10_000))
@settings(max_examples=15, deadline=None)
def test_layered_step_equals_the_grad_fn_step(world_size: int, strategy: ShardingStrategy,
                                              prefetch: bool, seed: int) -> None:
    """The same wrapper stepped with a whole-model grad_fn gives the same parameters."""
    def grad_fn(arrays: list, x: np.ndarray, target: np.ndarray) -> tuple:
        layers = make_layers(seed)
        it = iter(arrays)
        for layer in layers:
            for p in layer.parameters():
                p.data = next(it)
        loss, grads = run_layers(layers, x, target)
        return loss, [g for gs in grads for g in gs]

    def body(world: ad.World) -> None:
        kw = {"sharding_strategy": strategy, "ranks_per_node": rpn(strategy, world.world_size,
                                                                     seed)}
        lean = FSDP.from_layers(make_layers(seed), world, loss_fn=loss_fn, prefetch=prefetch,
                                **kw)
        whole = FSDP.from_layers(make_layers(seed), world, loss_fn=loss_fn, **kw)
        opts = [Adam(f.sharded_parameters(), lr=0.01) for f in (lean, whole)]
        for step in range(2):
            x, y = batch(seed, world.rank, step)
            a = lean.step(x, y, optimizer=opts[0])
            b = whole.step(grad_fn, x, y, optimizer=opts[1])
            assert a == pytest.approx(b, rel=1e-9)
        assert_close(full_values(lean), full_values(whole), rtol=1e-6, atol=1e-7)

    run_world(body, world_size)


@given(world_size=world_sizes(1, 4), micro=st.integers(1, 3), prefetch=st.booleans(),
       seed=st.integers(0, 10_000))
@settings(max_examples=10, deadline=None)
def test_layered_accumulation_under_no_sync(world_size: int, micro: int, prefetch: bool,
                                            seed: int) -> None:
    """backward() per micro-batch (all but the last inside no_sync) then one optimizer step
    equals one process stepping on the micro-batches' mean gradient."""
    layers = make_layers(seed)
    params = [p for layer in layers for p in layer.parameters()]
    opt = SGD(params, lr=0.1)
    total: list = [None] * len(params)
    for m in range(micro):
        _, grads = run_layers(layers, *global_batch(seed, world_size, m))
        total = [g if t is None else t + g for t, g in zip(total, [g for gs in grads
                                                                   for g in gs])]
    for p, g in zip(params, total):
        p.grad = g / micro
    opt.step()
    want = [p.data for p in params]

    def body(world: ad.World) -> None:
        f = FSDP.from_layers(make_layers(seed), world, loss_fn=loss_fn, prefetch=prefetch)
        fopt = SGD(f.sharded_parameters(), lr=0.1 / micro)
        for m in range(micro):
            if m < micro - 1:
                with f.no_sync():
                    f.backward(*batch(seed, world.rank, m))
            else:
                f.backward(*batch(seed, world.rank, m))
        fopt.step()
        assert_close(full_values(f), want)

    run_world(body, world_size)


@given(world_size=world_sizes(1, 4), seed=st.integers(0, 10_000))
@settings(max_examples=10, deadline=None)
def test_layered_mixed_precision_within_tolerance(world_size: int, seed: int) -> None:
    want, _ = reference(seed, world_size, 2, "sgd")

    def body(world: ad.World) -> None:
        f = FSDP.from_layers(make_layers(seed), world, loss_fn=loss_fn,
                             mixed_precision=MixedPrecision("bfloat16", "float32"))
        opt = SGD(f.sharded_parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            f.step(*batch(seed, world.rank, step), optimizer=opt)
        assert_close(full_values(f), want, rtol=0.05, atol=0.05)

    run_world(body, world_size)


@given(world_size=world_sizes(1, 4), prefetch=st.booleans(), seed=st.integers(0, 10_000))
@settings(max_examples=10, deadline=None)
def test_forward_is_the_models_output_and_reshards(world_size: int, prefetch: bool,
                                                   seed: int) -> None:
    def body(world: ad.World) -> None:
        f = FSDP.from_layers(make_layers(seed), world, loss_fn=loss_fn, prefetch=prefetch)
        x, _ = batch(seed, world.rank, 0)
        y = f.forward(x)
        ref = x
        for layer in make_layers(seed):
            ref, _ = layer.run_forward(ref, "reference")
        np.testing.assert_allclose(y, ref, rtol=1e-6)
        assert not any(f.is_gathered(u) for u in range(len(f.units)))

    run_world(body, world_size)


# --- asynchronous gathers ------------------------------------------------------------------------

@given(world_size=world_sizes(1, 4), seed=st.integers(0, 10_000))
@settings(max_examples=10, deadline=None)
def test_async_gather_installs_on_wait_and_reshard_finishes_it(world_size: int,
                                                                seed: int) -> None:
    want = [p.data for layer in make_layers(seed) for p in layer.parameters()]

    def body(world: ad.World) -> None:
        f = FSDP.from_layers(make_layers(seed), world, loss_fn=loss_fn)
        handle = f.gather_parameters(0, async_op=True)
        assert handle is not None and not f.is_gathered(0)
        handle.wait()
        handle.wait()  # twice is harmless
        assert handle.is_completed() and f.is_gathered(0)
        n0 = len(f.units[0].param_indices)
        assert_close([p.data for p in f.full_parameters()[:n0]], want[:n0])
        f.reshard_parameters()
        every = f.gather_parameters(async_op=True)
        assert every is not None
        f.reshard_parameters()  # finishes the pending gathers first: no rank is left waiting
        assert every.is_completed() and not f.is_gathered(0)
        f.gather_parameters(async_op=True)
        f.gather_parameters()  # a second gather finishes the first one, then gathers again
        assert_close([p.data for p in f.full_parameters()], want)

    run_world(body, world_size)


# --- the plan (no communication) and bad input ------------------------------------------

def test_layer_plan_gives_one_unit_per_layer_with_parameters() -> None:
    a, b, c = (ad.Parameter(np.zeros(2), n) for n in "abc")
    layers = [PipelineStage(act_forward, act_backward, []),
              PipelineStage(act_forward, act_backward, [a, b]),
              PipelineStage(act_forward, act_backward, []),
              PipelineStage(act_forward, act_backward, [c])]
    plan, params, units = LayerPlan.of(layers, "here")
    assert params == [a, b, c] and units == [[0, 1], [2]]
    assert plan.unit_of_layer == (None, 0, None, 1)
    assert [plan.next_unit(k, +1) for k in range(4)] == [0, 1, 1, None]
    assert [plan.next_unit(k, -1) for k in range(4)] == [None, None, 0, 0]
    assert plan.last_unit == 1


@mock_only
def test_from_layers_refuses_bad_input() -> None:
    def body(world: ad.World) -> None:
        p = ad.Parameter(np.zeros(2), "p")
        layer = PipelineStage(scale_forward, scale_backward, [p])
        cases: list[tuple[dict, type, str]] = [
            ({"layers": "abc"}, TypeError, "layers must be a list of PipelineStage"),
            ({"layers": []}, ValueError, "layers is empty"),
            ({"layers": [object()]}, TypeError, r"layers\[0\] must be a PipelineStage"),
            ({"layers": [PipelineStage(act_forward, act_backward, [])]}, ValueError,
             "no layer has parameters"),
            ({"layers": [layer, PipelineStage(scale_forward, scale_backward, [p])]},
             ValueError, r"in layers\[0\] and layers\[1\]"),
            ({"loss_fn": 3}, TypeError, "loss_fn must be a callable"),
            ({"prefetch": 1}, TypeError, "prefetch must be True or False, got 1"),
            ({"units": [[0]]}, TypeError, "units= is not taken"),
            ({"grad_fn": loss_fn}, TypeError, "grad_fn= is not taken"),
        ]
        for change, exc, text in cases:
            kw: dict = {"layers": [PipelineStage(scale_forward, scale_backward,
                                                 [ad.Parameter(np.zeros(2), "q")])],
                        "loss_fn": loss_fn, **change}
            layers = kw.pop("layers")
            with pytest.raises(exc, match=text) as info:
                FSDP.from_layers(layers, world, **kw)
            assert "from_layers" in str(info.value)

    run_world(body, 2)


def test_layered_calls_refuse_bad_input() -> None:
    def body(world: ad.World) -> None:
        f = FSDP.from_layers(make_layers(7), world, loss_fn=loss_fn)
        x, y = batch(7, world.rank, 0)
        with pytest.raises(TypeError, match=r"backward\(x, target\).*got 3 arguments"):
            f.backward(x, y, y)
        bad = FSDP.from_layers(make_layers(7), world, loss_fn=lambda y, t: 1.0)
        with pytest.raises(TypeError, match=r"must return \(loss, grad_y\), got float"):
            bad.backward(x, y)
        assert not any(bad.is_gathered(u) for u in range(len(bad.units)))
        plain = FSDP([ad.Parameter(np.zeros(2), "p")], world)
        with pytest.raises(RuntimeError, match="forward: only a wrapper made by from_layers"):
            plain.forward(x)
        f.close()
        with pytest.raises(RuntimeError, match="closed"):
            f.backward(x, y)

    run_world(body, 2)


@mock_only
def test_a_layer_that_raises_leaves_nothing_gathered_or_pending() -> None:
    def boom(pa: list, x: np.ndarray) -> tuple:
        raise ArithmeticError("layer failed")

    def body(world: ad.World) -> None:
        layers = make_layers(3)
        broken = PipelineStage(boom, scale_backward, [ad.Parameter(np.ones(widths(3)[-1]), "z")])
        f = FSDP.from_layers([*layers, broken], world, loss_fn=loss_fn)
        with pytest.raises(ArithmeticError, match="layer failed"):
            f.backward(*batch(3, world.rank, 0))
        assert not any(f.is_gathered(u) for u in range(len(f.units)))
        opt = SGD(f.sharded_parameters(), lr=0.1)
        f.step(ad_grad_fn_zero, *batch(3, world.rank, 0), optimizer=opt)  # still usable

    run_world(body, 2)


def ad_grad_fn_zero(arrays: list, *_batch: object) -> tuple:
    return 0.0, [np.zeros_like(a) for a in arrays]
