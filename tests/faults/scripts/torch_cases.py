"""Many torch fault cases in one ``torchrun`` job, torch imported once per rank:
``torchrun --nproc-per-node N torch_cases.py CASES.json OUT`` (see ``faults/runner.py``).

``CASES.json`` lists cases (``script``, ``case``, ``args``, ``env``, ``limit``). Each rank
runs them in turn: for case K it forks a process (before any torch.distributed state exists)
that joins a world of its own on a port rank 0 writes to ``OUT/K/port``, with the case's
variables set, its output in ``OUT/K/rank{R}.txt``, and runs ``script CASE torch ARGS`` as
a script's own ``__main__``: it ends through the interpreter's own exit, its excepthook,
``sys.exit`` or ``os._exit``, as a torchrun rank does. The rank then does what torchrun's
agent does for its workers: past the case's limit it kills the process (a hang); when
another rank's process of the case failed, it sends SIGTERM, then SIGKILL after
:data:`STOP_GRACE` seconds. It writes ``OUT/K/rank{R}.json`` (exit status, start and end
times, whether it hung, whether it was stopped for another rank's failure) and waits for
every rank's before the next case.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 0.05
#: Seconds between another rank's failure and this rank's SIGTERM (torchrun's agent sees a
#: failed worker at its next look), and between SIGTERM and SIGKILL.
STOP_AFTER = 0.5
STOP_GRACE = 30.0
WAIT_FOR_PEERS_S = 600.0


def _wait_for(path: Path, seconds: float, what: str) -> None:
    give_up = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > give_up:
            raise SystemExit(f"torch_cases: {what} never appeared ({path})")
        time.sleep(POLL_S)


def _port(folder: Path, rank: int) -> str:
    path = folder / "port"
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = str(probe.getsockname()[1])
        _write_whole(path, port)
        return port
    _wait_for(path, WAIT_FOR_PEERS_S, "rank 0's port")
    return path.read_text()


def _write_whole(path: Path, text: str) -> None:
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").rename(path)


def _become_the_case(item: dict[str, Any], folder: Path, rank: int, port: str) -> None:
    """In the forked process: output to the case's file, the case's variables, then the
    script as ``__main__``. Whatever it raises ends this process as it ends a script."""
    out = os.open(folder / f"rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.update(item["env"])
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")
    script = item["script"]
    sys.argv = [script, item["case"], "torch", *item["args"]]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _supervise(pid: int, folder: Path, rank: int, size: int, limit: float,
               ) -> tuple[int, bool, bool]:
    """Wait for the case's process as torchrun's agent would; its exit status, whether it
    was killed at ``limit``, and whether it was stopped because another rank's failed."""
    started = time.monotonic()
    failed_peer_seen = stop_sent = None
    hung = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), hung, stop_sent is not None
        now = time.monotonic()
        if not hung and now - started > limit:
            os.kill(pid, signal.SIGKILL)
            hung = True
        elif failed_peer_seen is None and any((folder / f"failed{r}").exists()
                                              for r in range(size) if r != rank):
            failed_peer_seen = now
        elif stop_sent is None and failed_peer_seen is not None \
                and now - failed_peer_seen > STOP_AFTER:
            os.kill(pid, signal.SIGTERM)
            stop_sent = now
        elif stop_sent is not None and now - stop_sent > STOP_GRACE:
            os.kill(pid, signal.SIGKILL)
            stop_sent = float("inf")
        time.sleep(POLL_S)


def main(cases_file: str, out_dir: str) -> None:
    import torch  # noqa: F401  # once, in the rank: every forked case has it already

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    items = json.loads(Path(cases_file).read_text())
    for k, item in enumerate(items):
        folder = Path(out_dir) / str(k)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        else:
            _wait_for(folder, WAIT_FOR_PEERS_S, f"case {k}'s folder")
        port = _port(folder, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.time()
        # the case's exit then collects only what the case made: its last collection would
        # otherwise walk torch's whole heap, copying every page the fork shares (0.6 s a case
        # on an idle core, seconds on a loaded one)
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            _become_the_case(item, folder, rank, port)
        status, hung, stopped = _supervise(pid, folder, rank, size, float(item["limit"]))
        if status != 0:
            (folder / f"failed{rank}").touch()
        _write_whole(folder / f"rank{rank}.json", json.dumps(
            {"status": status, "hung": hung, "stopped": stopped, "started": started,
             "ended": time.time()}))
        for r in range(size):
            _wait_for(folder / f"rank{r}.json", WAIT_FOR_PEERS_S, f"rank {r}'s end of case {k}")
    print(f"torch_cases OK rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
