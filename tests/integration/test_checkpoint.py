"""The checkpoint formats on one rank: round trips, range reads, refusal of damaged files,
atomic re-saves, the writer's lock, asynchronous saves.

(Saving and loading across world sizes and layouts is in tests/world/test_fsdp.py and
tests/world/test_checkpoint_world.py; killed and failing multi-process saves in
tests/faults/test_checkpoint_faults.py.)
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist._array import bfloat16
from axondist.checkpoint import (
    CheckpointError,
    CheckpointReader,
    FlatShard,
    ShardedOptimizer,
    ShardedState,
    TensorSpec,
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
    write_sharded,
)
from axondist.checkpoint.types import optimizer_class_name
from axondist.optim import SGD, Adam
from axondist.zero import ZeroRedundancyOptimizer


@pytest.fixture
def world() -> ad.World:
    return ad.World.mock()


def model(seed: int) -> list[ad.Parameter]:
    rng = np.random.default_rng(seed)
    return [ad.Parameter(rng.standard_normal((3, 4)).astype(np.float32), "fc.w"),
            ad.Parameter(rng.standard_normal(4).astype(np.float32), "fc.b"),
            ad.Parameter(rng.standard_normal(()).astype(np.float64), "scale"),
            ad.Parameter(rng.standard_normal(5).astype(bfloat16), "emb")]


def trained(seed: int) -> tuple[list[ad.Parameter], Adam]:
    params = model(seed)
    opt = Adam(params[:3], lr=0.1)  # "emb" has no optimizer state
    for p in params[:3]:
        p.grad = np.ones_like(p.data)
    opt.step()
    return params, opt


def latest_dir(root) -> Path:
    return Path(CheckpointReader(root).path)


def test_plain_sharded_round_trip_with_optimizer(tmp_path, world) -> None:
    params, opt = trained(0)
    save_sharded_checkpoint(tmp_path, params, opt, group=world, metadata={"epoch": 3})
    ckpt = latest_dir(tmp_path)
    index = json.loads((ckpt / "index.json").read_text())
    assert index["tensors"]["emb"]["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == sorted(["latest", ckpt.name])
    assert sorted(os.listdir(ckpt)) == sorted(
        ["index.json"] + [s["file"] for f in index["flats"].values() for s in f["shards"]])
    other, other_opt = model(1), Adam(model(1)[:3], lr=0.5)
    other_opt = Adam(other[:3], lr=0.5)
    assert load_sharded_checkpoint(tmp_path, other, other_opt) == {"epoch": 3}
    for a, b in zip(params, other):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.data, b.data)
    want, got = opt.state_dict(), other_opt.state_dict()
    assert got["hyperparameters"] == want["hyperparameters"] and got["step_count"] == 1
    for k in want["state"]:
        for name, v in want["state"][k].items():
            np.testing.assert_array_equal(got["state"][k][name], v)
    # the files are plain .npy anyone can read
    f = index["flats"][index["tensors"]["fc.w"]["flat"]]["shards"][0]["file"]
    np.testing.assert_array_equal(np.load(ckpt / f).reshape(3, 4), params[0].data)


@given(numel=st.integers(1, 60), cuts=st.lists(st.integers(1, 59), max_size=5),
       a=st.integers(0, 60), b=st.integers(0, 60), offset=st.integers(0, 5))
@settings(max_examples=30)
def test_reader_reads_any_range_across_shard_files(tmp_path_factory, numel: int, cuts: list,
                                                   a: int, b: int, offset: int) -> None:
    path = tmp_path_factory.mktemp("ranges")
    flat = np.arange(numel + offset, dtype=np.float32)
    bounds = sorted({0, numel + offset, *[c for c in cuts if c < numel + offset]})
    shards = [FlatShard("f", flat.size, lo, flat[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    write_sharded(path, ShardedState([TensorSpec("t", (numel,), "float32", "f", offset)], shards),
                  group=ad.World.mock())
    lo, hi = sorted((min(a, numel), min(b, numel)))
    reader = CheckpointReader(path)
    assert reader.step == 0 and reader.world_size == 1
    np.testing.assert_array_equal(reader.read("t", lo, hi), flat[offset + lo:offset + hi])
    with pytest.raises(CheckpointError, match="outside tensor 't'"):
        reader.read("t", 0, numel + 1)


def _shard_file(root) -> tuple[Path, str]:
    ckpt = latest_dir(root)
    index = json.loads((ckpt / "index.json").read_text())
    return ckpt, index["flats"][index["tensors"]["fc.w"]["flat"]]["shards"][0]["file"]


def test_corrupted_shard_is_refused_naming_the_file(tmp_path, world) -> None:
    params, opt = trained(0)
    save_sharded_checkpoint(tmp_path, params, opt, group=world)
    ckpt, name = _shard_file(tmp_path)
    raw = bytearray((ckpt / name).read_bytes())
    raw[-1] ^= 0xFF
    (ckpt / name).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{name} fails its sha256 check .checksum mismatch"):
        load_sharded_checkpoint(tmp_path, model(1))
    # without verification the bytes are read as they are
    load_sharded_checkpoint(tmp_path, model(1), verify=False)


def test_truncated_or_missing_shard_is_refused(tmp_path, world) -> None:
    params, _ = trained(0)
    save_sharded_checkpoint(tmp_path, params, group=world)
    ckpt, name = _shard_file(tmp_path)
    raw = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(raw[:-8])
    with pytest.raises(CheckpointError, match=f"{name} is {len(raw) - 8} bytes but the index says "
                                              f"{len(raw)} .size mismatch"):
        load_sharded_checkpoint(tmp_path, model(1))
    os.remove(ckpt / name)
    with pytest.raises(CheckpointError, match=f"shard file {name} is missing"):
        CheckpointReader(tmp_path).verify_all()


def test_incomplete_or_foreign_checkpoints_are_refused(tmp_path, world) -> None:
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        load_sharded_checkpoint(tmp_path, model(0))
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json is not valid JSON"):
        CheckpointReader(tmp_path)
    (tmp_path / "index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="index.json holds a JSON list, expected an object"):
        CheckpointReader(tmp_path)
    save_sharded_checkpoint(tmp_path, model(0), group=world)  # the pointer now rules
    small = [ad.Parameter(np.zeros((2, 2), np.float32), "fc.w")]
    with pytest.raises(CheckpointError, match="'fc.w' has shape \\(3, 4\\) in the checkpoint"):
        load_sharded_checkpoint(tmp_path, small)
    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        load_sharded_checkpoint(tmp_path, [ad.Parameter(np.zeros(1), "nope")])
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        p = model(0)
        load_sharded_checkpoint(tmp_path, p, Adam(p[:3]))


def test_resave_leaves_no_temporary_files(tmp_path, world) -> None:
    for seed in (0, 1):
        save_sharded_checkpoint(tmp_path, model(seed), group=world)
    assert not [f for root, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    target = model(2)
    load_sharded_checkpoint(tmp_path, target)
    np.testing.assert_array_equal(target[0].data, model(1)[0].data)


def test_full_checkpoint_round_trip_and_corruption(tmp_path, world) -> None:
    path = tmp_path / "model.npz"
    params = model(0)
    save_full_checkpoint(path, params, group=world, metadata={"note": "x"})
    with np.load(path) as npz:  # plain NumPy can read it
        np.testing.assert_array_equal(npz["fc.w"], params[0].data)
    state, meta = load_full_checkpoint(path, metadata=True)
    assert meta == {"note": "x"} and state["emb"].dtype == bfloat16
    target = model(1)
    load_full_checkpoint(path, target)
    for a, b in zip(params, target):
        np.testing.assert_array_equal(a.data, b.data)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="model.npz cannot be read.*truncated or corrupted"):
        load_full_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_full_checkpoint(tmp_path / "missing.npz")


def test_full_checkpoint_checksum_catches_a_changed_array(tmp_path, world) -> None:
    path = tmp_path / "model.npz"
    save_full_checkpoint(path, model(0), group=world)
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["fc.b"] = arrays["fc.b"] + 1  # a consistent zip, but not what was saved
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match="array 'fc.b' in .* fails its sha256 check"):
        load_full_checkpoint(path)


def test_full_checkpoint_takes_any_parameter_name(tmp_path, world) -> None:
    # names that np.savez(**arrays) would mistake for its own arguments
    params = {"file": ad.Parameter(np.arange(3.0)),
              "allow_pickle": ad.Parameter(np.ones((2, 2), np.float32))}
    path = tmp_path / "names.npz"
    save_full_checkpoint(path, params, group=world)
    state = load_full_checkpoint(path)
    np.testing.assert_array_equal(state["file"], np.arange(3.0))
    np.testing.assert_array_equal(state["allow_pickle"], np.ones((2, 2), np.float32))


# --- the index: checksum and schema --------------------------------------------------------

_TEMPLATE: dict[str, Path] = {}


def _saved(root, world) -> tuple[Path, bytes]:
    """A checkpoint of ``trained(0)`` in ``root`` (saved once, then copied: no fsyncs)."""
    if "root" not in _TEMPLATE:
        template = Path(tempfile.mkdtemp(prefix="axondist-ckpt-template-"))
        params, opt = trained(0)
        save_sharded_checkpoint(template, params, opt, group=world, metadata={"epoch": 1})
        _TEMPLATE["root"] = template
        atexit.register(shutil.rmtree, template, True)
    shutil.copytree(_TEMPLATE["root"], root, dirs_exist_ok=True)
    ckpt = latest_dir(root)
    return ckpt, (ckpt / "index.json").read_bytes()


def _load_fresh(root) -> None:
    p = model(5)
    load_sharded_checkpoint(root, p, Adam(p[:3]))


def _leaves(obj, path=()):
    """Every (path, value) leaf of a JSON value, containers included."""
    yield path, obj
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _leaves(v, (*path, k))


def _edit(obj, path, change):
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    change(parent, path[-1])


@given(bit=st.integers(0, 10**9))
@settings(max_examples=50)
def test_any_flipped_bit_of_the_index_is_refused(tmp_path_factory, bit: int) -> None:
    root = tmp_path_factory.mktemp("flip")
    ckpt, raw = _saved(root, ad.World.mock())
    flipped = bytearray(raw)
    flipped[(bit // 8) % len(raw)] ^= 1 << (bit % 8)
    (ckpt / "index.json").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="index.json"):
        _load_fresh(root)


EDITS = {
    "int+1": lambda parent, k: parent.__setitem__(k, parent[k] + 1),
    "to string": lambda parent, k: parent.__setitem__(k, str(parent[k])),
    "to null": lambda parent, k: parent.__setitem__(k, None),
    "delete": lambda parent, k: parent.__delitem__(k),
}


def _load_all(root) -> tuple[list[np.ndarray], dict]:
    p = model(5)
    opt = Adam(p[:3])
    load_sharded_checkpoint(root, p, opt)
    return _values(p), opt.state_dict()


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(a[k][n], b[k][n]) for k in a for n in a[k])


@given(data=st.data())
@settings(max_examples=60)
def test_any_edited_field_is_refused_with_or_without_a_fresh_checksum(tmp_path_factory,
                                                                       data) -> None:
    """Every edit is caught by the checksum. An edit whose author also recomputed the checksum
    and that removes a field or changes its type is refused by the schema, or (an optional
    field) changes nothing that loads: never silently different values."""
    from axondist.checkpoint.index import with_checksum

    root = tmp_path_factory.mktemp("edit")
    ckpt, raw = _saved(root, ad.World.mock())
    want, want_opt = _load_all(root)
    index = json.loads(raw)
    leaves = [p for p, v in _leaves(index) if p and p[0] not in ("checksum",)]
    path = data.draw(st.sampled_from(leaves), label="field")
    value = dict(_leaves(index))[path]
    kinds = ["delete", "to null"] + (["int+1"] if type(value) is int else []) + \
        (["to string"] if not isinstance(value, str) else [])
    kind = data.draw(st.sampled_from(kinds), label="edit")
    _edit(index, path, EDITS[kind])
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        _load_fresh(root)
    if kind == "int+1" or path[0] == "metadata":
        return  # a valid value in a re-checksummed file is a different, valid checkpoint
    (ckpt / "index.json").write_text(json.dumps(with_checksum(index)))
    try:
        got, got_opt = _load_all(root)
    except CheckpointError as exc:
        assert "index.json" in str(exc) or "no tensor named" in str(exc) or \
            "holds no optimizer state" in str(exc) or ".npy" in str(exc), str(exc)
        return
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert _same_state(got_opt["state"], want_opt["state"])
    assert got_opt["hyperparameters"] == want_opt["hyperparameters"] or "hyperparameters" in path


def test_the_issues_hand_edits_are_refused_even_with_a_fresh_checksum(tmp_path, world) -> None:
    from axondist.checkpoint.index import with_checksum

    ckpt, raw = _saved(tmp_path, world)

    def attempt(change, match: str) -> None:
        index = json.loads(raw)
        change(index)
        (ckpt / "index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="index.json fails its 'checksum' check"):
            _load_fresh(tmp_path)
        (ckpt / "index.json").write_text(json.dumps(with_checksum(index)))
        with pytest.raises(CheckpointError, match=match):
            _load_fresh(tmp_path)

    def offset(i):
        i["tensors"]["fc.w"]["offset"] += 1

    def dtype(i):
        i["tensors"]["fc.w"]["dtype"] = "int8"
        i["flats"][i["tensors"]["fc.w"]["flat"]]["dtype"] = "int8"

    def swap(i):
        a, b = (i["tensors"][n]["flat"] for n in ("fc.w", "fc.b"))
        i["flats"][a]["shards"], i["flats"][b]["shards"] = (i["flats"][b]["shards"],
                                                            i["flats"][a]["shards"])

    def drop_optim(i):
        del i["tensors"]["optim/fc.b/exp_avg"]

    attempt(offset, "run past the end of flat")
    attempt(dtype, "holds float32 .* the index says int8")
    attempt(swap, "index.json field flats.*stop: 12 is outside 1..4")
    attempt(drop_optim, "optimizer state 'exp_avg' of parameter 'fc.b'")


def test_swapped_shard_entries_of_one_flat_are_refused(tmp_path, world) -> None:
    from axondist.checkpoint.index import with_checksum

    flat = np.arange(10, dtype=np.float32)
    write_sharded(tmp_path, ShardedState([TensorSpec("t", (10,), "float32", "f", 0)],
                                         [FlatShard("f", 10, 0, flat[:4]),
                                          FlatShard("f", 10, 4, flat[4:])]), group=world)
    ckpt = latest_dir(tmp_path)
    index = json.loads((ckpt / "index.json").read_text())
    shards = index["flats"]["f"]["shards"]
    shards[0], shards[1] = shards[1], shards[0]
    (ckpt / "index.json").write_text(json.dumps(with_checksum(index)))
    with pytest.raises(CheckpointError, match="shards\\[1\\].start: 0 overlaps the previous "
                                              "shard"):
        CheckpointReader(tmp_path)
    for s in shards:  # the entries swapped back, their files swapped
        s["start"], s["stop"] = (0, 4) if s["start"] == 4 else (4, 10)
    (ckpt / "index.json").write_text(json.dumps(with_checksum(index)))
    with pytest.raises(CheckpointError, match="holds float32 \\((6|4),\\), the index says"):
        CheckpointReader(tmp_path, verify=False).read("t")


@given(data=st.data())
@settings(max_examples=40)
def test_any_flipped_bit_of_a_shard_file_is_refused(tmp_path_factory, data) -> None:
    root = tmp_path_factory.mktemp("shardflip")
    ckpt, raw = _saved(root, ad.World.mock())
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".npy"))
    name = data.draw(st.sampled_from(files), label="file")
    blob = bytearray((ckpt / name).read_bytes())
    bit = data.draw(st.integers(0, len(blob) * 8 - 1), label="bit")
    blob[bit // 8] ^= 1 << (bit % 8)
    (ckpt / name).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=name.replace(".", "\\.")):
        _load_fresh(root)


def test_corrupted_pointer_is_refused(tmp_path, world) -> None:
    save_sharded_checkpoint(tmp_path, model(0), group=world)
    raw = bytearray((tmp_path / "latest").read_bytes())
    raw[len(raw) // 2] ^= 4
    (tmp_path / "latest").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="latest (fails its 'checksum' check|is not valid)"):
        load_sharded_checkpoint(tmp_path, model(1))


def test_without_a_pointer_the_newest_complete_step_is_the_latest(tmp_path, world) -> None:
    ckpt = ad.checkpoint.Checkpointer(tmp_path, group=world)
    for step in (1, 2):
        ckpt.save(model(step), step=step)
    (tmp_path / "latest").unlink()
    (tmp_path / "step-00000005").mkdir()  # no index: debris of nothing, not a checkpoint
    assert ckpt.steps() == [1, 2] and ckpt.latest_step() == 2
    _assert_holds(tmp_path, _values(model(2)))
    save_sharded_checkpoint(tmp_path, model(3), group=world)  # step 3: after the newest on disk
    assert ckpt.steps() == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001", "step-00000002",
                                            "step-00000003"]
    (tmp_path / "latest").unlink()
    ad.checkpoint.Checkpointer(tmp_path, keep_last=1, group=world).save(model(4), step=4)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000004"]  # pruned after commit


def test_repair_moves_a_damaged_pointer_aside_and_keeps_every_step(tmp_path, world) -> None:
    for step in (1, 2):
        save_sharded_checkpoint(tmp_path, model(step), group=world, step=step)
    (tmp_path / "latest").write_text("not json")
    with pytest.raises(CheckpointError, match=r"steps \[1, 2\]: load one with "
                       r"load_sharded_checkpoint\(.*step=2\), or rebuild the pointer"):
        ad.checkpoint.Checkpointer(tmp_path).steps()
    with pytest.raises(CheckpointError, match=r"cannot start a save .*steps \[1, 2\]"):
        save_sharded_checkpoint(tmp_path, model(3), group=world, step=3)
    target = model(9)
    load_sharded_checkpoint(tmp_path, target, step=1)  # an explicit step needs no pointer
    np.testing.assert_array_equal(target[0].data, model(1)[0].data)
    done = ad.checkpoint.repair(tmp_path)
    assert done.steps == (1, 2) and done.rewritten and "not valid JSON" in done.problem
    assert (tmp_path / "latest.corrupt").read_text() == "not json"
    _assert_holds(tmp_path, _values(model(2)))
    again = ad.checkpoint.repair(tmp_path)
    assert not again.rewritten and again.moved_aside is None and again.steps == (1, 2)


# --- atomic re-saves, keep_last, the lock ----------------------------------------------------

def _values(params) -> list[np.ndarray]:
    return [np.asarray(p.data).copy() for p in params]


def _assert_holds(root, want: list[np.ndarray]) -> None:
    got = model(9)
    load_sharded_checkpoint(root, got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.data, w)


@pytest.mark.parametrize("kind", ["enospc", "erofs"])
def test_a_failing_resave_at_any_point_leaves_the_old_checkpoint(tmp_path, world, monkeypatch,
                                                                 kind: str) -> None:
    """A full disk or read-only file system at the k-th change of the directory, for every k:
    the old checkpoint stays the latest, and the next save cleans up and succeeds."""
    from axondist.checkpoint import files

    old = model(0)
    save_sharded_checkpoint(tmp_path, old, group=world, step=1)
    k = 1
    while True:
        monkeypatch.setattr(files, "_events", __import__("itertools").count(1))
        monkeypatch.setenv(files.FAULT_ENV, f"{kind}:{k}")
        try:
            save_sharded_checkpoint(tmp_path, model(k), group=world, step=2)
        except CheckpointError as exc:
            assert "(injected)" in str(exc) and "save_sharded_checkpoint" in str(exc)
            _assert_holds(tmp_path, _values(old))
            k += 1
            continue
        finally:
            monkeypatch.delenv(files.FAULT_ENV)
        break
    assert k > 6  # the fault hit every file, the rename, the pointer and the clean-up
    # the save whose fault fell after its commit (pruning) succeeded: it is the latest
    _assert_holds(tmp_path, _values(model(k)))
    save_sharded_checkpoint(tmp_path, model(100), group=world, step=3)
    # a faulted save whose step-2 was complete but uncommitted left it on disk (adopted, never
    # deleted); the next save of step 2 took a fresh name and superseded it
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "latest" and re.fullmatch(
        r"step-00000001 step-00000002(\.\d+)? step-00000003", " ".join(names[1:])), names
    assert ad.checkpoint.Checkpointer(tmp_path).steps() == [1, 2, 3]
    _assert_holds(tmp_path, _values(model(100)))


def test_keep_last_and_loading_an_earlier_step(tmp_path, world) -> None:
    ckpt = ad.checkpoint.Checkpointer(tmp_path, keep_last=2, group=world)
    assert ckpt.latest_step() is None and ckpt.steps() == []
    for step in range(5):
        ckpt.save(model(step), step=step, metadata={"at": step})
    assert ckpt.steps() == [3, 4] and ckpt.latest_step() == 4
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000003", "step-00000004"]
    target = model(9)
    assert ckpt.load(target, step=3) == {"at": 3}
    np.testing.assert_array_equal(target[0].data, model(3)[0].data)
    with pytest.raises(CheckpointError, match="no checkpoint of step 1; it holds steps \\[3, 4\\]"):
        ckpt.load(target, step=1)
    ckpt.save(model(7), step=4)  # a re-save of a step replaces it, atomically
    assert ckpt.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000003", "step-00000004.1"]
    with pytest.raises(ValueError, match="keep_last=0 must be an int >= 1"):
        ad.checkpoint.Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="step=-1 must be an int >= 0"):
        save_sharded_checkpoint(tmp_path, model(0), group=world, step=-1)


def test_a_second_writer_is_refused_naming_the_first(tmp_path, world) -> None:
    import socket
    import subprocess
    import sys

    save_sharded_checkpoint(tmp_path, model(0), group=world)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".lock").write_text(json.dumps(
            {"host": socket.gethostname(), "pid": holder.pid, "token": "x", "since": 0}))
        with pytest.raises(CheckpointError, match=f"another writer \\(host {socket.gethostname()}, "
                                                  f"pid {holder.pid}"):
            save_sharded_checkpoint(tmp_path, model(1), group=world)
        _assert_holds(tmp_path, _values(model(0)))
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its stale lock is taken over
    save_sharded_checkpoint(tmp_path, model(1), group=world)
    _assert_holds(tmp_path, _values(model(1)))
    assert not (tmp_path / ".lock").exists()


def test_two_worlds_of_one_process_saving_to_one_root_are_serialised(tmp_path) -> None:
    def job(world: ad.World, seed: int) -> str:
        params = model(seed + world.rank * 0)
        return save_sharded_checkpoint(tmp_path, params, step=seed).wait()

    import threading

    done: list[str] = []
    threads = [threading.Thread(target=lambda s=s: done.extend(ad.spawn(job, 2, s)))
               for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(done) == 4
    assert sorted(ad.checkpoint.Checkpointer(tmp_path).steps()) == [1, 2]  # in either order


# --- asynchronous saves ----------------------------------------------------------------------

def test_async_save_snapshots_the_state_and_commits_on_wait(tmp_path, world) -> None:
    params, opt = trained(0)
    want = _values(params)
    ckpt = ad.checkpoint.Checkpointer(tmp_path, group=world)
    handle = ckpt.save(params, opt, step=1, async_save=True)
    for p in params:  # training goes on: the checkpoint keeps the values at save time
        p.data[...] = 0
    deadline = time.monotonic() + 30
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ckpt.latest_step() == 1  # committed in the background, before wait()
    path = handle.wait()
    assert handle.done() and path.endswith("step-00000001")
    _assert_holds(tmp_path, want)
    ckpt.save(params, opt, step=2, async_save=True)
    ckpt.save(params, opt, step=3, async_save=True)  # waits for step 2 first
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3]


def test_async_save_failure_is_reported_by_wait(tmp_path, world, monkeypatch) -> None:
    from axondist.checkpoint import files

    params, opt = trained(0)
    ckpt = ad.checkpoint.Checkpointer(tmp_path, group=world)
    ckpt.save(params, opt, step=1)
    monkeypatch.setattr(files, "_events", __import__("itertools").count(1))
    monkeypatch.setenv(files.FAULT_ENV, "enospc:3")
    handle = ckpt.save(model(3), step=2, async_save=True)
    with pytest.raises(CheckpointError, match="failed on 1 rank.*rank 0: .*No space left"):
        handle.wait()
    with pytest.raises(CheckpointError, match="No space left"):
        handle.wait()  # the outcome stays
    monkeypatch.delenv(files.FAULT_ENV)
    ckpt.wait()  # nothing pending: the error was collected by handle.wait()
    assert ckpt.steps() == [1]
    _assert_holds(tmp_path, _values(params))


# --- optimizer entries ----------------------------------------------------------------------

def test_missing_optimizer_entry_is_an_error_unless_not_strict(tmp_path, world) -> None:
    params, opt = trained(0)
    save_sharded_checkpoint(tmp_path, params[:2], Adam(params[:2]), group=world)
    target = model(1)
    opt2 = Adam(target[:3])
    with pytest.raises(CheckpointError, match="no tensor named 'scale'"):
        load_sharded_checkpoint(tmp_path, target, opt2)
    target = target[:2] + [ad.Parameter(np.zeros(2), "extra")]
    opt2 = Adam(target)
    with pytest.raises(CheckpointError, match="no tensor named 'extra'"):
        load_sharded_checkpoint(tmp_path, target, opt2)
    # the same model, its optimizer over one more parameter than was saved
    p2 = model(2)[:2]
    save_sharded_checkpoint(tmp_path, p2, Adam(p2[:1]), group=world)
    q = model(3)[:2]
    with pytest.raises(CheckpointError, match="no optimizer entry for parameter 'fc.b'; pass "
                                              "strict=False"):
        load_sharded_checkpoint(tmp_path, q, Adam(q))
    opt3 = Adam(q)
    load_sharded_checkpoint(tmp_path, q, opt3, strict=False)
    assert list(opt3.state_dict()["state"]) == []  # Adam(p2[:1]) had taken no step


# --- the documented NumPy-only reader --------------------------------------------------------

def _numpy_only_reader() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    blocks = re.findall(r"```python\n(# numpy-only reader\n.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, "docs/checkpoints.md must hold one '# numpy-only reader' block"
    return blocks[0]


def test_the_documented_numpy_only_reader_reads_every_tensor(tmp_path) -> None:
    import subprocess
    import sys

    reader = _numpy_only_reader()
    assert len(reader.splitlines()) <= 35

    def save(world: ad.World) -> None:
        params = model(0)[:3]
        f = ad.FSDP(params, world, sharding_strategy="full_shard")
        opt = Adam(f.sharded_parameters(), lr=0.1)
        for p in f.sharded_parameters():
            p.grad = np.ones_like(p.data)
        opt.step()
        save_sharded_checkpoint(tmp_path, f, opt, step=1)
        save_sharded_checkpoint(tmp_path, f, opt, step=2)

    ad.spawn(save, 3)
    program = reader + (
        "\nimport sys\nout = read_checkpoint(sys.argv[1])\n"
        "assert not [m for m in sys.modules if m.startswith('axondist')]\n"
        "np.savez(sys.argv[2], **{k.replace('/', '|'): v for k, v in out.items()})\n")
    dump = tmp_path.parent / "dump.npz"
    run = subprocess.run([sys.executable, "-I", "-c", program, str(tmp_path), str(dump)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    want = CheckpointReader(tmp_path)
    with np.load(dump) as got:
        assert sorted(k.replace("|", "/") for k in got.files) == sorted(want.names)
        for name in want.names:
            np.testing.assert_array_equal(got[name.replace("/", "|")], want.read_full(name))
    ckpt, name = latest_dir(tmp_path), "unit0.rank1.npy"
    blob = bytearray((ckpt / name).read_bytes())
    blob[-1] ^= 1
    (ckpt / name).write_bytes(bytes(blob))
    run = subprocess.run([sys.executable, "-I", "-c", program, str(tmp_path), str(dump)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and f"{name}: checksum mismatch" in run.stderr


class _Wrapper:
    """A wrapper describing its own shards; rank ``bad`` hands over an unwritable one."""

    def __init__(self, world: ad.World, bad: int) -> None:
        self.group, self.bad = world, bad

    def sharded_checkpoint_state(self, optimizer) -> ShardedState:
        r = self.group.rank
        data = np.arange(4.0) + 4 * r
        if r == self.bad:
            data = np.array([object()] * 4)  # .npy refuses object arrays without pickle
        return ShardedState([TensorSpec("t", (8,), "float64", "f", 0)],
                            [FlatShard("f", 8, 4 * r, data)])


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("bad", [0, 1])
def test_a_rank_failing_to_write_fails_the_save_on_every_rank(tmp_path, bad: int,
                                                              async_save: bool) -> None:
    write_sharded(tmp_path, ShardedState([TensorSpec("t", (8,), "float64", "f", 0)],
                                         [FlatShard("f", 8, 0, np.zeros(8))]),
                  group=ad.World.mock(), step=1)

    def body(world: ad.World) -> str:
        try:
            save_sharded_checkpoint(tmp_path, _Wrapper(world, bad), step=2,
                                    async_save=async_save).wait()
        except CheckpointError as exc:
            return str(exc)
        return "saved"

    errors = ad.spawn(body, 2)
    assert all(f"failed on 1 rank(s): rank {bad}: ValueError" in e for e in errors), errors
    np.testing.assert_array_equal(CheckpointReader(tmp_path).read("t"), np.zeros(8))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001"]
    ad.spawn(lambda w: save_sharded_checkpoint(tmp_path, _Wrapper(w, -1), step=3), 2)
    np.testing.assert_array_equal(CheckpointReader(tmp_path).read("t"), np.arange(8.0))


# --- sharded optimizers and FSDP's optimizer shards ----------------------------------------------

def test_zero_is_a_sharded_optimizer_saved_as_the_class_it_wraps(tmp_path, world) -> None:
    params, _ = trained(0)
    zero = ZeroRedundancyOptimizer(params[:3], Adam, world, lr=0.1)
    assert isinstance(zero, ShardedOptimizer) and not isinstance(Adam(params[:3]), ShardedOptimizer)
    assert optimizer_class_name(zero) == "Adam" == optimizer_class_name(Adam(params[:3]))
    for p in params[:3]:
        p.grad = np.ones_like(p.data)
    zero.step()
    save_sharded_checkpoint(tmp_path, params, zero, group=world, async_save=True).wait()
    meta = CheckpointReader(tmp_path).optimizer
    assert meta["class"] == "Adam" and sorted(meta["params"]) == ["fc.b", "fc.w", "scale"]
    other = model(1)
    plain = Adam(other[:3])
    load_sharded_checkpoint(tmp_path, other, plain)
    want = zero.state_dict()
    for k, entry in plain.state_dict()["state"].items():
        np.testing.assert_array_equal(entry["exp_avg"], want["state"][k]["exp_avg"])
    with pytest.raises(CheckpointError, match="the checkpoint's optimizer is Adam, not SGD"):
        load_sharded_checkpoint(tmp_path, other, ZeroRedundancyOptimizer(other[:3], SGD, world,
                                                                         lr=0.1))


def test_fsdp_optimizer_shards_are_owned_copies(world) -> None:
    """Optimizer state_dict() arrays are private copies: an async save need not copy them
    again; the parameter shards are live and must be copied."""
    f = ad.FSDP(model(0)[:3], world)
    opt = Adam(f.sharded_parameters())
    for p in f.sharded_parameters():
        p.grad = np.ones_like(p.data)
    opt.step()
    state = f.sharded_checkpoint_state(opt)
    owned = {s.flat: s.owned for s in state.shards}
    assert owned and all(v == ("." in flat) for flat, v in owned.items())
    assert state.optimizer["params"] == f.parameter_names()
