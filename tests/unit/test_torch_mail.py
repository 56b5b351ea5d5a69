"""The torch backend's mailbox (its point-to-point messages on connections of their own),
between two mailboxes of one process joined by a socket pair: matching by group and tag,
order within one, receipts, and what a closed or silent connection raises. The backend's
sends and receives through it run under torchrun in the world runs and the fault cases."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.backends.torch.mail import Mailbox


def pair(limit: float = 5.0) -> tuple[Mailbox, Mailbox]:
    """Mailboxes of world ranks 0 and 1, connected."""
    a, b = socket.socketpair()
    for conn in (a, b):
        conn.settimeout(limit)
    return Mailbox({1: a}, limit), Mailbox({0: b}, limit)


@pytest.fixture
def boxes():
    zero, one = pair()
    yield zero, one
    zero.close(settle=0)
    one.close(settle=0)


messages = st.lists(st.tuples(st.sampled_from(["world", "world.0"]), st.integers(0, 3),
                              st.integers(0, 70_000)), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None)
@given(messages)
def test_messages_match_by_group_and_tag_in_order_within_each(sent):
    zero, one = pair()
    try:
        receipts = []
        for k, (group, tag, size) in enumerate(sent):
            payload = np.full(size, k % 251, np.uint8)
            receipts.append(zero.send(1, group, tag, payload))
        # received by (group, tag) in reverse order of first use: earlier kinds wait filed
        for group, tag in reversed(list(dict.fromkeys((g, t) for g, t, _ in sent))):
            for k, (g, t, size) in enumerate(sent):
                if (g, t) == (group, tag):
                    got = one.receive(0, group, tag)
                    np.testing.assert_array_equal(got, np.full(size, k % 251, np.uint8))
        for receipt in receipts:
            zero.wait(receipt, 1)  # each send is done once received
    finally:
        zero.close(settle=0)
        one.close(settle=0)


def test_a_send_is_done_when_received_not_when_written(boxes):
    zero, one = boxes
    receipt = zero.send(1, "world", 1, np.arange(8, dtype=np.uint8))
    time.sleep(0.1)  # written and filed on rank 1 long since
    assert not receipt.done()
    one.receive(0, "world", 1)
    zero.wait(receipt, 1)
    assert receipt.done() and receipt.exception() is None


def test_a_receive_waits_for_its_message_and_a_silent_peer_times_out():
    zero, one = pair(limit=0.3)
    try:
        threading.Timer(0.1, lambda: zero.send(1, "world", 5, np.ones(3, np.uint8))).start()
        np.testing.assert_array_equal(one.receive(0, "world", 5), np.ones(3, np.uint8))
        with pytest.raises(RuntimeError, match=r"recv from rank 0: nothing arrived; timed out "
                                               r"after 0\.3 s"):
            one.receive(0, "world", 5)
        receipt = one.send(0, "world", 1, np.ones(2, np.uint8))
        with pytest.raises(RuntimeError, match=r"send to rank 0: no receive took the message; "
                                               r"timed out after 0\.3 s"):
            one.wait(receipt, 0)
    finally:
        zero.close(settle=0)
        one.close(settle=0)


def test_a_closed_peer_fails_waits_and_sends_in_gloos_words_after_what_arrived(boxes):
    zero, one = boxes
    zero.send(1, "world", 1, np.arange(4, dtype=np.uint8))
    unreceived = one.send(0, "world", 1, np.ones(4, np.uint8))
    zero.close(settle=0)
    # what arrived before the close is still received
    np.testing.assert_array_equal(one.receive(0, "world", 1), np.arange(4, dtype=np.uint8))
    with pytest.raises(RuntimeError, match=r"Connection closed by peer \(rank 0: "):
        one.receive(0, "world", 1)
    with pytest.raises(RuntimeError, match=r"Connection closed by peer \(rank 0: "):
        one.wait(unreceived, 0)
    with pytest.raises(RuntimeError, match=r"Connection closed by peer \(rank 0: "):
        one.send(0, "world", 1, np.ones(4, np.uint8))


def test_close_waits_for_the_receipts_of_what_was_sent(boxes):
    zero, one = boxes
    receipt = zero.send(1, "world", 1, np.ones(4, np.uint8))
    threading.Timer(0.1, lambda: one.receive(0, "world", 1)).start()
    zero.close(settle=5)  # a correct program's last send: received, not failed by the close
    assert receipt.done() and receipt.exception() is None


def test_a_peer_outside_the_mailbox_is_not_reached(boxes):
    zero, _ = boxes
    assert zero.reaches(1) and not zero.reaches(0) and not zero.reaches(2)
