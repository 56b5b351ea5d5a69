"""Mock-world ranks are threads of one process, and they load checkpoints at the same time.

NumPy reads a ``.npy`` header with ``ast.literal_eval``, and CPython 3.11's AST constructor
counts its recursion in state every thread shares (CPython gh-106905): two ranks parsing at
once can raise ``SystemError``, which the reader would report as a damaged shard file. The
checkpoint readers parse headers under ``NPY_HEADER_LOCK``; these tests pin that every header
NumPy parses for them is parsed with the lock held, and that four ranks loading sharded and
full checkpoints together, many times over, read what was saved.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axondist as ad
from axondist.checkpoint import (
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
)
from axondist.checkpoint.files import NPY_HEADER_LOCK

RANKS = 4
SHAPES = {"w": (6, 5), "b": (6,), "v": (7,)}


def _params(seed: int) -> list[ad.Parameter]:
    rng = np.random.default_rng(seed)
    return [ad.Parameter(rng.standard_normal(shape), name) for name, shape in SHAPES.items()]


def _save_then_load_many(world: ad.World, root: str, rounds: int) -> list[str]:
    """Save once from every rank, then load ``rounds`` times on every rank at once; the
    names of the parameters that came back different (none, when the loads are right)."""
    saved = _params(1)
    save_sharded_checkpoint(f"{root}/sharded", saved, step=0)
    save_full_checkpoint(f"{root}/full.npz", {p.name: p.data for p in saved})
    wrong = []
    for _ in range(rounds):
        loaded = _params(99)
        load_sharded_checkpoint(f"{root}/sharded", loaded)
        full = load_full_checkpoint(f"{root}/full.npz")
        for want, got in zip(saved, loaded):
            if not (np.array_equal(want.data, got.data) and np.array_equal(want.data,
                                                                           full[want.name])):
                wrong.append(want.name)
        ad.barrier()
    return wrong


def test_ranks_on_threads_load_checkpoints_together() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = ad.spawn(_save_then_load_many, RANKS, root, 25, timeout=120)
    assert results == [[]] * RANKS


def test_every_header_numpy_parses_for_a_checkpoint_is_parsed_under_the_lock(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # the module whose header reader np.load calls (numpy.lib.format before NumPy 2)
    npy_format = importlib.import_module("numpy.lib._format_impl"
                                         if np.__version__ >= "2" else "numpy.lib.format")
    held: list[bool] = []
    parse = npy_format._read_array_header  # what np.load calls for every .npy header

    def spy(*args: Any, **kwargs: Any) -> Any:
        held.append(NPY_HEADER_LOCK.locked())
        return parse(*args, **kwargs)

    monkeypatch.setattr(npy_format, "_read_array_header", spy)
    assert ad.spawn(_save_then_load_many, 1, str(tmp_path), 1, timeout=60) == [[]]
    assert len(held) >= 2 * len(SHAPES) and all(held), held
