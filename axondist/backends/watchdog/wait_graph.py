"""The wait-for graph of a stalled job: which rank waits for which, and a cycle through a rank.

A rank blocked in a call waits for every rank the call needs that has not joined it: the
peer of a ``send``/``recv`` (unless that peer is in the matching ``recv``/``send``), the
members of a collective's group that have not issued its number. A cycle of such waits
through blocked ranks, of any length (0 -> 1 -> 0, or 0 -> 1 -> 2 -> 0), can never
resolve: every rank in it waits for the next. Statuses are the flight recorders' (see
:meth:`axondist.backends.recording.recorder.FlightRecorder.status`); the functions are pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..recording.recorder import describe_call

Status = Mapping[str, Any]
#: One step of a cycle: the rank, the call it is blocked in, the rank that call waits for.
Step = tuple[int, dict[str, Any], int]

_MATCHING = {"send": "recv", "recv": "send"}


def _pairs_with(entry: Mapping[str, Any], rank: int, other: Status | None) -> bool:
    """Whether ``other`` is blocked in the point-to-point call that completes ``entry``."""
    if other is None:
        return False
    want = _MATCHING.get(str(entry["op"]))
    return any(e.get("peer") == rank and e["op"] == want for e in other.get("running", []))


def waits_for(status: Status, known: Mapping[int, Status],
              groups: Mapping[str, Sequence[int]]) -> list[tuple[dict[str, Any], int]]:
    """``(call, rank)`` for every rank that a blocked call of ``status``'s rank waits for.

    A member whose status is not in ``known`` counts as waited for (ask it to find out);
    a member known to have issued the call does not.
    """
    rank = int(status["rank"])
    out: list[tuple[dict[str, Any], int]] = []
    for entry in status.get("running", []):
        if "peer" in entry:
            peer = int(entry["peer"])
            if not _pairs_with(entry, rank, known.get(peer)):
                out.append((entry, peer))
            continue
        for member in groups.get(entry["group"], ()):
            other = known.get(member)
            if member != rank and (other is None or int(
                    other.get("issued", {}).get(entry["group"], 0)) < int(entry["seq"])):
                out.append((entry, member))
    return out


def find_cycle(me: int, known: Mapping[int, Status],
               groups: Mapping[str, Sequence[int]]) -> list[Step] | None:
    """The shortest cycle of waits from ``me`` back to ``me`` through blocked ranks of
    ``known``, as its steps in order (``me``'s first), or None when the statuses show none."""
    if me not in known:
        return None
    came_from: dict[int, Step] = {}
    frontier = [me]
    while frontier:
        following = []
        for rank in frontier:
            for entry, nxt in waits_for(known[rank], known, groups):
                if nxt == me:
                    steps = [(rank, entry, nxt)]
                    while steps[0][0] != me:
                        steps.insert(0, came_from[steps[0][0]])
                    return steps
                if nxt not in came_from and known.get(nxt, {}).get("running"):
                    came_from[nxt] = (rank, entry, nxt)
                    following.append(nxt)
        frontier = following
    return None


def describe_cycle(me: int, cycle: Sequence[Step]) -> str:
    """``deadlock: ...`` naming each step of ``cycle`` (from :func:`find_cycle`), as rank
    ``me`` (its first step) says it, and what to do."""
    mine = describe_call(cycle[0][1])
    steps = [f"rank {rank} waits in {describe_call(entry)}, which needs "
             + ("this rank" if nxt == me else f"rank {nxt}") for rank, entry, nxt in cycle[1:]]
    ring = " -> ".join(f"rank {rank}" for rank, _, _ in cycle) + f" -> rank {me}"
    return ("deadlock: " + "; ".join(steps) + f"; while this rank waits in {mine}, which "
            f"needs rank {cycle[0][2]} (wait cycle {ring}). Every rank must issue the same "
            "collectives on the same groups in the same order, and each receive needs a "
            "matching send")


def unknown_waited_for(known: Mapping[int, Status],
                       groups: Mapping[str, Sequence[int]]) -> set[int]:
    """Ranks some blocked rank of ``known`` waits for whose status is not known yet."""
    return {r for status in known.values() for _, r in waits_for(status, known, groups)
            if r not in known}


def different_calls(me: int, call: Mapping[str, Any], mine: Sequence[Mapping[str, Any]],
                    statuses: Mapping[int, Any]) -> str | None:
    """Text naming the ranks whose collective of ``call``'s number on its group differs
    from this rank's (``me``; ``mine``: its recent entries), from the peers' ``statuses``,
    or None. The cross-rank check cannot see a blocking call meet a non-blocking one: MPI
    never matches them, so both wait."""
    group, seq = call["group"], call["seq"]

    def issued(entries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
        return next((e for e in entries if e["group"] == group and e["seq"] == seq
                     and not e["op"].startswith("wait ")), None)

    found = issued(mine)
    if found is None:
        return None
    calls = {me: found}
    for r, status in statuses.items():
        if isinstance(status, dict):
            theirs = issued(list(status.get("recent", [])) + list(status.get("running", [])))
            if theirs is not None:
                calls[r] = theirs
    if len({(e["op"], e.get("detail"), bool(e["blocking"])) for e in calls.values()}) < 2:
        return None
    described = "; ".join(f"rank {r}: {e['op']} ({e.get('detail') or 'no arguments'}, "
                          f"{'blocking' if e['blocking'] else 'async_op=True'})"
                          for r, e in sorted(calls.items()))
    return (f"ranks called different collectives as call #{seq} on {group}: {described}. "
            "Every rank must make the same call with the same arguments, and pass the same "
            "async_op: MPI never matches a non-blocking collective with a blocking one")


__all__ = ["describe_cycle", "different_calls", "find_cycle", "unknown_waited_for",
           "waits_for"]
