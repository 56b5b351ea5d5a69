"""Which checkpoints of a root count, read from the disk with the ``latest`` pointer as a
hint: hypothesis draws the steps the pointer lists and the steps whose folders are on disk
(a root copied without some of them, or holding steps the pointer never listed), and the
committed history is exactly the steps on disk, the pointer's latest last while it is there,
else the newest on disk. No communication: folders of minimal valid indexes in a temporary
directory.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import given
from hypothesis import strategies as st

from axondist.checkpoint.directory import (
    Pointer,
    history_on_disk,
    resolve,
    step_dir_name,
    step_of,
    write_pointer,
)
from axondist.checkpoint.index import FORMAT, INDEX_FILE, VERSION, canonical_json, with_checksum
from axondist.errors import CheckpointError

steps = st.lists(st.integers(0, 30), unique=True, max_size=6)


def _save(root: str, step: int) -> None:
    folder = os.path.join(root, step_dir_name(step))
    os.mkdir(folder)
    index = with_checksum({"format": FORMAT, "version": VERSION, "world_size": 1, "step": step,
                           "tensors": {}, "flats": {}, "optimizer": None, "metadata": {}})
    with open(os.path.join(folder, INDEX_FILE), "wb") as f:
        f.write(canonical_json(index))


@given(listed=steps, on_disk=steps)
def test_the_history_is_the_steps_on_disk_with_the_pointer_as_a_hint(listed: list[int],
                                                                     on_disk: list[int]) -> None:
    with tempfile.TemporaryDirectory() as root:
        for step in on_disk:
            _save(root, step)
        pointer = None
        if listed:
            pointer = Pointer(step_dir_name(listed[-1]), tuple(map(step_dir_name, listed)))
            write_pointer(root, pointer)
        history = [step_of(name) for name in history_on_disk(root, pointer)]
        assert sorted(history) == sorted(on_disk)
        if listed and listed[-1] in on_disk:
            assert history[-1] == listed[-1]  # a save killed before its swap is not the latest
        elif on_disk:
            assert history[-1] == max(on_disk)
        for step in set(listed) - set(on_disk):
            try:
                resolve(root, step)
            except CheckpointError as exc:
                assert f"holds no checkpoint of step {step}; it holds steps" in str(exc) or (
                    not on_disk and "holds no complete checkpoint" in str(exc)), exc
                assert not on_disk or str(sorted(on_disk)) in str(exc), exc
            else:
                raise AssertionError(f"step {step} is not on disk, yet it resolved")
