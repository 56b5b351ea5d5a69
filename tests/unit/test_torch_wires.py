"""The torch backend's check sockets (``backends/torch/wires.py``) without torch: members
in threads, meeting through a dictionary that stands in for torch's store."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.backends.checks import agreed
from axondist.backends.torch.wires import GroupWires, Wiring

TOKEN = b"0123456789abcdef0123456789abcdef"


class _Store:
    """torch's store as the wires use it: ``set``, and a ``get`` that waits for the key."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        with self._changed:
            assert self._changed.wait_for(lambda: key in self._values, 30), key
            return self._values[key].encode()


def _group(size: int, limit: float = 30.0) -> list[GroupWires]:
    """Every member's wires of one group of ``size``, made at once as the members do."""
    store, wiring = _Store(), Wiring("127.0.0.1", None, TOKEN, limit)
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        made = [pool.submit(wiring.connect, store, "g", rank, size) for rank in range(size)]
        return [m.result(timeout=60) for m in made]


@contextlib.contextmanager
def _connected(size: int, limit: float = 30.0) -> Iterator[list[GroupWires]]:
    """:func:`_group`'s wires, every connection closed when the block ends."""
    wires = _group(size, limit)
    try:
        yield wires
    finally:
        for w in wires:
            w.close()


def _check(wires: list[GroupWires], words: list[list[int]]) -> list[np.ndarray]:
    sent = [np.array(w, np.int64) for w in words]
    with concurrent.futures.ThreadPoolExecutor(len(wires)) as pool:
        list(pool.map(lambda k: wires[k].largest(sent[k]), range(len(wires)), timeout=60))
    return sent


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 4).flatmap(lambda n: st.lists(
    st.tuples(st.integers(-2**62, 2**62), st.integers(-2**62, 2**62)), min_size=n,
    max_size=n)))
def test_every_member_gets_the_elementwise_largest_words(words):
    with _connected(len(words)) as wires:
        for _ in range(3):  # one message per peer per check, in order
            got = _check(wires, [list(w) for w in words])
            expected = np.max(np.array(words, np.int64), axis=0)
            for g in got:
                np.testing.assert_array_equal(g, expected)


def test_the_same_call_agrees_and_a_different_one_does_not():
    with _connected(3) as wires:
        same = _check(wires, [[7, -7]] * 3)
        assert all(agreed(s) for s in same)
        differ = _check(wires, [[7, -7], [7, -7], [9, -9]])
        assert not any(agreed(s) for s in differ)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 4), root=st.integers(0, 3), count=st.sampled_from([0, 1, 7, 3 << 17]),
       dtype=st.sampled_from(["float32", "int8", "complex128"]))
def test_a_broadcast_gives_every_member_the_roots_bytes(n, root, count, dtype):
    """Checks and broadcasts interleaved on the same connections, the large ones (6 MiB of
    complex128) past what a socket buffers: each member reads the bytes meant for it."""
    root %= n
    with _connected(n) as wires:
        data = [np.arange(count, dtype=dtype) * (k + 1) for k in range(n)]
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            for _ in range(2):
                list(pool.map(lambda k: wires[k].broadcast(data[k], root), range(n),
                              timeout=60))
                _check(wires, [[k, -k] for k in range(n)])
        for k in range(n):
            np.testing.assert_array_equal(data[k], np.arange(count, dtype=dtype) * (root + 1))


def test_a_broadcast_whose_root_left_is_named_as_gloo_names_it():
    with _connected(3) as wires:
        wires[0].close()
        with pytest.raises(RuntimeError, match=r"Connection closed by peer \(group rank 0"):
            wires[2].broadcast(np.zeros(1000), 0)


def test_a_peer_whose_connection_closes_is_named_as_gloo_names_it():
    wires = _group(2)
    wires[1].close()
    with pytest.raises(RuntimeError, match=r"Connection closed by peer \(group rank 1"):
        wires[0].largest(np.zeros(2, np.int64))
    wires[0].close()


def test_a_silent_peer_times_out_after_the_limit():
    with _connected(2, limit=0.2) as wires:
        with pytest.raises(RuntimeError, match=r"connection to group rank 1 timed out after "
                                               r"0.2 s"):
            wires[0].largest(np.zeros(2, np.int64))


def test_a_connection_without_the_token_is_dropped_and_the_member_still_joins():
    store, wiring = _Store(), Wiring("127.0.0.1", None, TOKEN, 30.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(wiring.connect, store, "g", 0, 2)
        host, port = store.get("g/0").decode().rsplit(":", 1)
        with socket.create_connection((host, int(port))) as stranger:
            stranger.sendall(b"x" * (len(TOKEN) + 8))
            second = wiring.connect(store, "g", 1, 2)
            wires = [first.result(timeout=60), second]
    try:
        assert all(agreed(s) for s in _check(wires, [[3, -3], [3, -3]]))
    finally:
        for w in wires:
            w.close()


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 4).flatmap(lambda n: st.lists(
    st.lists(st.sampled_from([0, 1, 13, 3 << 18]), min_size=n, max_size=n),
    min_size=n, max_size=n)))
def test_an_exchange_delivers_what_each_member_sends_each_other(counts):
    """counts[i][j] float64 values go from member i to member j, every member at once, some
    (6 MiB) past what a socket buffers, in whatever order the threads start; checks on the
    same connections before and after: each member reads exactly the bytes meant for it."""
    n = len(counts)
    wires = _group(n)
    sent = [{j: np.arange(counts[i][j], dtype=np.float64) + 1000 * i + j
             for j in range(n) if j != i} for i in range(n)]
    got = [{j: np.full(counts[j][i], np.nan) for j in range(n) if j != i} for i in range(n)]
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            _check(wires, [[k, -k] for k in range(n)])
            list(pool.map(lambda k: wires[k].exchange(sent[k], got[k]), range(n), timeout=60))
            assert all(agreed(s) for s in _check(wires, [[5, -5]] * n))
        for i in range(n):
            for j in range(n):
                if i != j:
                    np.testing.assert_array_equal(got[i][j], sent[j][i])
    finally:
        for w in wires:
            w.close()


def test_an_exchange_with_a_member_that_left_names_it_as_gloo_does():
    with _connected(3) as wires:
        wires[1].close()
        with pytest.raises(RuntimeError, match=r"Connection closed by peer \(group rank 1"):
            wires[0].exchange({1: np.zeros(1 << 20), 2: np.zeros(4)},
                              {1: np.zeros(1 << 20), 2: np.zeros(4)})


def test_an_exchange_names_the_first_member_still_silent_after_the_limit():
    """Member 2 answers, member 1 sends nothing: the wait ends at the limit, naming 1."""
    with _connected(3, limit=0.3) as wires:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answered = pool.submit(wires[2].exchange, {0: np.ones(8)}, {0: np.zeros(8)})
            with pytest.raises(RuntimeError, match=r"connection to group rank 1 timed out "
                                                   r"after 0.3 s"):
                wires[0].exchange({1: np.ones(8), 2: np.ones(8)},
                                  {1: np.zeros(8), 2: np.zeros(8)})
            answered.result(timeout=30)
