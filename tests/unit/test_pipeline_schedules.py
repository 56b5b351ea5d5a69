"""Pipeline schedules: generation, validation, communication plan, simulation, rendering."""

from __future__ import annotations

import ast
import itertools
import pathlib
import sys
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist.pipeline as pipeline_pkg
from axondist.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    CommKind,
    CommOp,
    Payload,
    PipelineMemoryStats,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    build_schedule,
    check_channels,
    communication_plan,
    interleaved_rounds,
    parse_schedule,
    render_image,
    render_text,
    schedule_names,
    simulate,
    validate,
)

K = PipelineSchedule
SINGLE_CHUNK = tuple(kind for kind, spec in SCHEDULES.items() if not spec.multi_chunk)
FAST = settings(max_examples=120, deadline=None)


@st.composite
def shapes(draw, kinds=tuple(SCHEDULES)):
    kind = draw(st.sampled_from(kinds))
    p = draw(st.integers(1, 6))
    m = draw(st.integers(1, 12))
    v = 1 if kind in SINGLE_CHUNK else draw(st.integers(1, 3))
    return kind, p, m, v


# ---------------------------------------------------------------- generation


@FAST
@given(shapes())
def test_generated_schedules_are_valid_complete_and_simulate(shape):
    kind, p, m, v = shape
    s = build_schedule(kind, p, m, v)
    assert (s.kind, s.num_ranks, s.num_microbatches, s.chunks) == (kind, p, m, v)
    validate(s)
    for r, row in enumerate(s.actions):
        assert [a.step for a in row] == list(range(len(row)))
        assert all(a.rank == r for a in row)
    counts = Counter((a.kind, a.microbatch, s.stage_of(a)) for a in s)
    split = SCHEDULES[kind].split_backward
    assert s.uses_split_backward == split
    backward_kinds = (ActionKind.I, ActionKind.W) if split else (ActionKind.B,)
    for stage in range(p * v):
        assert s.rank_of_stage(stage) == stage % p
        for mb in range(m):
            assert counts[(ActionKind.F, mb, stage)] == 1
            for bk in backward_kinds:
                assert counts[(bk, mb, stage)] == 1
    assert sum(counts.values()) == m * p * v * (1 + len(backward_kinds))
    result = simulate(s)
    assert result.makespan > 0
    assert 0.0 <= result.bubble_fraction < 1.0
    assert sum(len(row) for row in result.timeline) == sum(counts.values())
    for row in result.timeline:  # a rank runs one action at a time, in list order
        for prev, nxt in itertools.pairwise(row):
            assert prev.end <= nxt.start
    for t in (t for row in result.timeline for t in row):  # dependencies respected
        for _, dep in s.dependencies(t.action):
            assert dep is not None and result.end(dep) <= t.start


@FAST
@given(shapes())
def test_render_text_shows_every_action(shape):
    kind, p, m, v = shape
    s = build_schedule(kind, p, m, v)
    text = render_text(s)
    lines = text.splitlines()
    assert len(lines) == p + 2  # header, one row per rank, summary
    for r in range(p):
        cells = set(lines[1 + r].split("|", 1)[1].split())
        assert {a.text(v) for a in s.actions[r]} <= cells
    if p > 1:
        assert "." in text  # the bubble is visible


def test_string_kind_and_bad_arguments():
    assert build_schedule("1f1b", 2, 3).kind is K.ONE_F_ONE_B
    for kind in SINGLE_CHUNK:
        with pytest.raises(ValueError, match="INTERLEAVED_ONE_F_ONE_B") as info:
            build_schedule(kind, 2, 4, chunks=2)
        assert f"build_schedule: {kind.name} runs one chunk per rank, got chunks=2" in str(
            info.value)
    with pytest.raises(ValueError, match="num_microbatches"):
        build_schedule(K.GPIPE, 2, 0)
    with pytest.raises(ValueError, match="num_ranks"):
        build_schedule(K.GPIPE, 0, 2)
    with pytest.raises(ValueError, match=r"build_schedule: chunks must be an int >= 1, got 1\.5"):
        build_schedule(K.GPIPE, 2, 2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_ranks must be an int >= 1, got True"):
        build_schedule(K.GPIPE, True, 2)


# ---------------------------------------------------------------- the table and names


def test_the_table_lists_every_kind_once():
    assert list(SCHEDULES) == list(PipelineSchedule)
    assert schedule_names() == tuple(kind.value for kind in PipelineSchedule)
    for spec in SCHEDULES.values():
        assert spec.summary and callable(spec.builder)
        assert not spec.interleaved or spec.multi_chunk  # interleaving needs chunks
        with pytest.raises(AttributeError):
            spec.multi_chunk = not spec.multi_chunk  # type: ignore[misc]
    with pytest.raises(TypeError):
        SCHEDULES[K.GPIPE] = SCHEDULES[K.ONE_F_ONE_B]  # type: ignore[index]


@st.composite
def spellings(draw):
    """A kind and one way of writing it: its value or name, in a random case, maybe padded."""
    kind = draw(st.sampled_from(list(SCHEDULES)))
    word = draw(st.sampled_from([kind.value, kind.name]))
    flips = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    word = "".join(c.upper() if f else c.lower() for c, f in zip(word, flips))
    pad = draw(st.sampled_from(["", " ", "\t"]))
    return kind, pad + word + pad


@FAST
@given(spellings(), st.integers(1, 4), st.integers(1, 6))
def test_names_parse_in_any_case(spelled, p, m):
    kind, word = spelled
    assert PipelineSchedule.parse(word) is kind
    assert PipelineSchedule.parse(kind) is kind
    assert build_schedule(word, p, m).actions == build_schedule(kind, p, m).actions


NAMES = {name for kind in PipelineSchedule for name in (kind.value, kind.name.lower())}


@FAST
@given(st.one_of(st.text(max_size=12).filter(lambda w: w.strip().lower() not in NAMES),
                 st.integers(), st.none(), st.floats(allow_nan=False)))
def test_unknown_names_are_refused_with_the_valid_ones_listed(word):
    with pytest.raises(ValueError) as info:
        build_schedule(word, 2, 2)
    msg = str(info.value)
    assert msg.startswith(f"build_schedule: schedule={word!r} is not one of")
    for name in schedule_names():
        assert repr(name) in msg


def test_zb_alone_is_not_a_name():
    with pytest.raises(ValueError, match="'zb' is not one of .*'zb_h1'"):
        build_schedule("zb", 2, 2)


def test_known_orders():
    assert build_schedule(K.ONE_F_ONE_B, 3, 4).text().splitlines() == [
        "0: F0 F1 F2 B0 F3 B1 B2 B3",
        "1: F0 F1 B0 F2 B1 F3 B2 B3",
        "2: F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert build_schedule(K.GPIPE, 2, 2).text().splitlines() == [
        "0: F0 F1 B0 B1",
        "1: F0 F1 B0 B1",
    ]
    # Interleaved with one chunk is exactly 1F1B.
    assert (
        build_schedule(K.INTERLEAVED_ONE_F_ONE_B, 4, 6).actions
        == build_schedule(K.ONE_F_ONE_B, 4, 6).actions
    )


def test_action_text():
    assert str(Action(0, 0, ActionKind.F, 3)) == "F3"
    assert str(Action(1, 2, ActionKind.B, 0, chunk=1)) == "1B0"
    assert Action(0, 0, ActionKind.F, 3).text(chunks=2) == "0F3"
    assert str(Action(0, 0, ActionKind.W, 7)) == "W7"


def test_parse_schedule_round_trips():
    s = build_schedule(K.INTERLEAVED_ONE_F_ONE_B, 3, 5, 2)
    rows = [" ".join(a.text(s.chunks) for a in row) for row in s.actions]
    again = parse_schedule(rows, kind=s.kind)
    assert again == s
    with pytest.raises(ValueError, match="expected an action"):
        parse_schedule(["F0 X1"])


# ---------------------------------------------------------------- memory


@FAST
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 3))
def test_peak_activations(p, m, v):
    gpipe = simulate(build_schedule(K.GPIPE, p, m, v))
    assert gpipe.peak_activations == (v * m,) * p
    one = simulate(build_schedule(K.ONE_F_ONE_B, p, m))
    assert list(one.peak_activations) == [min(p - r, m) for r in range(p)]
    assert list(one.peak_activations) == PipelineMemoryStats.one_f_one_b_peak_activations_per_stage(
        p, m
    )
    assert max(one.peak_activations) == PipelineMemoryStats.one_f_one_b_peak_activations(p, m)
    zb = simulate(build_schedule(K.ZERO_BUBBLE_H1, p, m))
    # ZB-H1 lets every rank hold as many activations as 1F1B's first rank, never more.
    assert max(zb.peak_activations) <= max(one.peak_activations)
    assert all(peak <= min(p, m) for peak in zb.peak_activations)


def test_memory_stats_formulas():
    assert PipelineMemoryStats.gpipe_peak_activations(4, 8) == 8
    assert PipelineMemoryStats.one_f_one_b_peak_activations(4, 8) == 4
    assert PipelineMemoryStats.one_f_one_b_peak_activations(4, 2) == 2
    assert PipelineMemoryStats.one_f_one_b_peak_activations_per_stage(4, 3) == [3, 3, 2, 1]
    assert PipelineMemoryStats.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert PipelineMemoryStats.bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)
    assert PipelineMemoryStats.bubble_fraction(1, 5) == 0.0


def test_zero_bubble_releases_activation_after_w():
    s = build_schedule(K.ZERO_BUBBLE_H1, 3, 5)
    assert not any(a.kind is ActionKind.B for a in s)
    for row in s.actions:
        pos = {(a.kind, a.microbatch): a.step for a in row}
        for mb in range(5):
            assert pos[(ActionKind.F, mb)] < pos[(ActionKind.I, mb)] < pos[(ActionKind.W, mb)]


# ---------------------------------------------------------------- bubble / timing


@FAST
@given(
    st.sampled_from([K.GPIPE, K.ONE_F_ONE_B]),
    st.integers(1, 6),
    st.integers(1, 12),
    st.sampled_from([(1, 2), (1, 1), (2, 3), (3, 1)]),
)
def test_gpipe_and_1f1b_makespan(kind, p, m, cost):
    tf, tb = cost
    r = simulate(build_schedule(kind, p, m), {"F": tf, "B": tb})
    assert r.makespan == (m + p - 1) * (tf + tb)
    assert r.bubble_fraction == pytest.approx(PipelineMemoryStats.bubble_fraction(p, m))


def test_comm_latency():
    for p, m in [(1, 3), (2, 3), (4, 8)]:
        c = 0.5
        g = simulate(build_schedule(K.GPIPE, p, m), comm=c)
        assert g.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * c)
        one = simulate(build_schedule(K.ONE_F_ONE_B, p, m), comm=c)
        assert one.makespan >= (m + p - 1) * 3 + 2 * (p - 1) * c
    with pytest.raises(ValueError, match="comm"):
        simulate(build_schedule(K.GPIPE, 2, 2), comm=-1)


@FAST
@given(st.integers(2, 6), st.integers(1, 3), st.integers(2, 3))
def test_interleaved_shrinks_bubble(p, groups, v):
    m = p * groups
    # Same total work: a chunk costs 1/v of a whole stage (F=1, B=2 per chunk).
    inter = simulate(build_schedule(K.INTERLEAVED_ONE_F_ONE_B, p, m, v), {"F": 1, "B": 2})
    one = simulate(build_schedule(K.ONE_F_ONE_B, p, m), {"F": v, "B": 2 * v})
    assert inter.makespan == (m * v + p - 1) * 3
    assert inter.makespan < one.makespan
    assert inter.bubble_fraction < one.bubble_fraction
    assert inter.bubble_fraction == pytest.approx(PipelineMemoryStats.bubble_fraction(p, m, v))


def torch_interleaved_order(p, m, v, rank):
    """torch.distributed.pipelining's ScheduleInterleaved1F1B order of one rank, without its
    idle slots, from its published algorithm: ``max(1, m // p)`` rounds of ``m / rounds``
    microbatches (None when torch refuses ``m``); op ``i`` of the warm-up and steady phases
    runs a forward on chunk ``(i // per_round) % v``, op ``j`` after the warm-up a backward on
    chunk ``v - 1 - (j // per_round) % v``; each chunk takes its microbatches in order."""
    rounds = max(1, m // p)
    if m % rounds:
        return None
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    next_mb = {ActionKind.F: defaultdict(int), ActionKind.B: defaultdict(int)}
    order = []

    def take(kind, chunk):
        order.append((kind, next_mb[kind][chunk], chunk))
        next_mb[kind][chunk] += 1

    for op in range(m * v + warmup):
        if op < m * v:
            take(ActionKind.F, (op // per_round) % v)
        if op >= warmup:
            take(ActionKind.B, v - 1 - ((op - warmup) // per_round) % v)
    return order


def torch_schedule(p, m, v):
    rows = [torch_interleaved_order(p, m, v, r) for r in range(p)]
    if rows[0] is None:
        return None
    return Schedule(kind=None, num_ranks=p, num_microbatches=m, chunks=v, actions=[
        [Action(r, k, kind, mb, c) for k, (kind, mb, c) in enumerate(row)]
        for r, row in enumerate(rows)])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 7), st.integers(1, 24), st.integers(2, 4))
def test_interleaved_is_torchs_order_where_torch_runs_and_reaches_its_bubble(p, m, v):
    ours = build_schedule(K.INTERLEAVED_ONE_F_ONE_B, p, m, v)
    validate(ours)
    sim = simulate(ours, {"F": 1, "B": 2})
    theirs = torch_schedule(p, m, v)
    if theirs is not None:
        assert [[(a.kind, a.microbatch, a.chunk) for a in row] for row in ours.actions] == [
            [(a.kind, a.microbatch, a.chunk) for a in row] for row in theirs.actions]
    if m >= p and not (p == 2 and m % len(interleaved_rounds(p, m))):
        # (p - 1) / (v m + p - 1): the makespan is v m (F + B) plus p - 1 stage steps.
        assert sim.makespan == (v * m + p - 1) * 3
        assert sim.bubble_fraction == pytest.approx(PipelineMemoryStats.bubble_fraction(p, m, v))


@FAST
@given(st.integers(1, 7), st.integers(1, 30), st.integers(1, 4))
def test_interleaved_rounds(p, m, v):
    sizes = interleaved_rounds(p, m)
    assert sum(sizes) == m and len(sizes) == max(1, m // p)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    if m >= p:
        assert min(sizes) >= p
    if m % len(sizes) == 0:  # torch's microbatches_per_round
        assert set(sizes) == {m // max(1, m // p)}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(1, 24), st.integers(2, 4))
def test_lean_interleaved_trades_bubble_for_activations(p, m, v):
    full = build_schedule(K.INTERLEAVED_ONE_F_ONE_B, p, m, v)
    lean = build_schedule(K.INTERLEAVED_ONE_F_ONE_B_LEAN, p, m, v)
    validate(lean)
    a, b = simulate(full), simulate(lean)
    assert all(x <= y for x, y in zip(b.peak_activations, a.peak_activations))
    if m % p == 0 or (p == 2 and m % len(interleaved_rounds(p, m))):
        assert lean.actions == full.actions  # the same rounds of p microbatches
    elif m > p:
        assert max(b.peak_activations) < max(a.peak_activations)
    if m >= p:
        assert a.bubble_fraction <= b.bubble_fraction + 1e-12


def test_issue_shapes_reach_torchs_bubble():
    for (p, m, v), want in {(3, 4, 2): 0.2, (4, 6, 2): 0.2, (4, 10, 2): 3 / 23}.items():
        got = simulate(build_schedule(K.INTERLEAVED_ONE_F_ONE_B, p, m, v)).bubble_fraction
        assert got == pytest.approx(want)
        assert got == pytest.approx(PipelineMemoryStats.bubble_fraction(p, m, v))


@FAST
@given(st.integers(2, 6), st.integers(0, 8))
def test_zero_bubble_beats_1f1b(p, extra):
    m = p + extra
    zb = simulate(build_schedule(K.ZERO_BUBBLE_H1, p, m))  # F=1, I=1, W=1
    one = simulate(build_schedule(K.ONE_F_ONE_B, p, m))  # F=1, B=2
    assert sum(zb.busy) == sum(one.busy)
    assert zb.bubble_fraction < one.bubble_fraction
    # ZB-H1's bubble is (p - 1) * (tF + tI - tW) per rank instead of (p - 1) * (tF + tB).
    assert zb.makespan == 3 * m + p - 1
    assert one.makespan == 3 * (m + p - 1)


def test_costs_as_function_and_bad_costs():
    s = build_schedule(K.ONE_F_ONE_B, 2, 2)
    r = simulate(s, lambda a: 2.0 if a.kind is ActionKind.B else 1.0)
    assert r.makespan == simulate(s).makespan
    assert r.start(s.actions[1][0]) == 1.0
    with pytest.raises(ValueError, match="cost of F"):
        simulate(s, {"F": 0})


# ---------------------------------------------------------------- communication plan


@FAST
@given(shapes())
def test_communication_plan(shape):
    kind, p, m, v = shape
    s = build_schedule(kind, p, m, v)
    plan = communication_plan(s)
    check_channels(plan)
    n_stages = p * v
    expected_messages = 0 if p == 1 else 2 * m * (n_stages - 1)
    sends = [o for o in plan if o.op is CommKind.SEND]
    recvs = [o for o in plan if o.op is CommKind.RECV]
    assert len(sends) == len(recvs) == expected_messages
    assert len({o.tag for o in sends}) == len(sends)
    for a, b in ((a, b) for a in range(p) for b in range(p) if a != b):
        assert [o.message for o in plan.sends(a, b)] == [o.message for o in plan.recvs(b, a)]
        assert [o.tag for o in plan.sends(a, b)] == [o.tag for o in plan.recvs(b, a)]
    for r, prog in enumerate(plan.program):
        assert [x for x in prog if isinstance(x, Action)] == list(s.actions[r])
        assert [x for x in prog if isinstance(x, CommOp)] == list(plan.ops[r])
        current = None
        for i, x in enumerate(prog):
            if isinstance(x, Action):
                current = x
                continue
            if x.op is CommKind.RECV:  # right before the action that consumes it
                nxt = next(y for y in prog[i:] if isinstance(y, Action))
                assert nxt.step == x.step and nxt.microbatch == x.microbatch
                assert s.stage_of(nxt) == x.dst_stage
                payload = Payload.ACTIVATION if nxt.kind is ActionKind.F else Payload.GRADIENT
                assert x.payload is payload
            else:  # right after the action that produced it
                assert current is not None and current.step == x.step
                assert s.stage_of(current) == x.src_stage
            assert x.rank == r and x.peer != r


# ---------------------------------------------------------------- negative cases


def test_backward_before_forward_is_refused():
    s = parse_schedule(["B0 F0", "F0 B0"])
    with pytest.raises(ScheduleError) as info:
        validate(s)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.rank, err.step, str(err.action)) == (0, 0, "B0")
    assert "rank 0" in str(err) and "B0" in str(err) and "F0" in str(err)


def test_swapped_recv_order_is_refused():
    # Rank 1 consumes microbatch 1's activation before microbatch 0's, but rank 0
    # sends them the other way round: no deadlock, yet an in-order transport
    # would deliver the wrong tensor.
    s = parse_schedule(["F0 F1 B0 B1", "F1 B1 F0 B0"])
    simulate(s)  # the dependency-level dry run alone is fine
    with pytest.raises(ScheduleError) as info:
        validate(s)
    err = info.value
    assert (err.rank, err.step, str(err.action)) == (1, 0, "F1")
    msg = str(err)
    assert "rank 1" in msg and "F1" in msg
    assert "activation of microbatch 1" in msg and "activation of microbatch 0" in msg


def test_missing_and_duplicate_actions_are_refused():
    with pytest.raises(ScheduleError, match="missing the backward"):
        validate(parse_schedule(["F0 F1 B0", "F0 B0 F1 B1"]))
    with pytest.raises(ScheduleError, match="duplicate") as info:
        validate(parse_schedule(["F0 B0 F0", "F0 B0"]))
    assert (info.value.rank, info.value.step) == (0, 2)
    with pytest.raises(ScheduleError, match="no W"):
        validate(parse_schedule(["F0 I0", "F0 I0 W0"]))
    with pytest.raises(ScheduleError, match="both a full backward"):
        validate(parse_schedule(["F0 B0 I0 W0", "F0 B0"]))
    with pytest.raises(ScheduleError, match="microbatch must be in"):
        validate(parse_schedule(["F0 B0 F1 B1"], num_microbatches=1))
    with pytest.raises(ScheduleError, match="I0 of stage 0"):
        validate(parse_schedule(["F0 W0 I0"]))


def test_deadlock_is_detected_with_stuck_actions():
    # Rank 0 waits for rank 1's B0 before sending F1; rank 1 waits for F1 first.
    s = parse_schedule(["F0 B0 F1 B1", "F0 F1 B1 B0"])
    with pytest.raises(ScheduleError, match="deadlock") as info:
        simulate(s)
    err = info.value
    assert {r: str(a) for r, a in err.stuck.items()} == {0: "B0", 1: "F1"}
    assert "rank 0 step 1 (B0)" in str(err) and "rank 1 step 1 (F1)" in str(err)
    with pytest.raises(ScheduleError):
        validate(s)


def test_missing_dependency_is_reported_by_simulate():
    with pytest.raises(ScheduleError, match="not in the schedule"):
        simulate(parse_schedule(["F0 B0", "B0"]))


def test_generated_channel_order_holds_for_two_ranks_with_chunks():
    # With 2 ranks and several chunks one channel carries activations and
    # gradients at once; the generated order must still match send for recv.
    for m in range(1, 13):
        for v in (2, 3):
            validate(build_schedule(K.INTERLEAVED_ONE_F_ONE_B, 2, m, v))


# ---------------------------------------------------------------- rendering


def test_render_text_layout():
    text = render_text(build_schedule(K.ONE_F_ONE_B, 2, 2))
    assert text.splitlines()[1:3] == [
        "rank 0 | F0 F1 .  .  B0 B0 .  B1 B1",
        "rank 1 | .  F0 B0 B0 F1 B1 B1 .  .",
    ]
    assert "bubble" in text.splitlines()[-1]
    with pytest.raises(TypeError):
        render_text("not a schedule")  # type: ignore[arg-type]


def test_render_image_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        render_image(simulate(build_schedule(K.GPIPE, 2, 2)), tmp_path / "x.png")


def test_render_image_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    render_image(simulate(build_schedule(K.ZERO_BUBBLE_H1, 3, 4)), path)
    assert path.stat().st_size > 0


# ---------------------------------------------------------------- layering


def pipeline_imports():
    """Pipeline module -> the pipeline modules it imports anywhere (function bodies too)."""
    root = pathlib.Path(pipeline_pkg.__file__).parent
    graph = {}
    for path in root.glob("*.py"):
        if path.stem == "__init__":
            continue
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if node.level == 0 else [f"axondist.pipeline.{node.module}"]
            found |= {n.split(".")[2] for n in names if n.startswith("axondist.pipeline.")}
        graph[path.stem] = found
    return graph


def test_the_pipeline_modules_import_without_cycles():
    graph = pipeline_imports()
    assert graph["schedules"] == set()  # the values know nothing of checks or messages
    assert {"communication", "simulate"} <= graph["validation"]
    state = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle: {' -> '.join(path + [module])}"
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            visit(dep, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
