"""The checkpoint formats on one rank: round trips, range reads, refusal of damaged files,
atomic re-saves, the writer's lock, asynchronous saves.

(Saving and loading across world sizes and layouts is in tests/world/test_fsdp.py and
tests/world/test_checkpoint_world.py; killed and failing multi-process saves in
tests/faults/test_checkpoint_faults.py.)
"""

from __future__ import annotations

import json
import os
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
    ShardedState,
    TensorSpec,
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
    write_sharded,
)
from axondist.optim import Adam


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
