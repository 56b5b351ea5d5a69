"""A torch.distributed job's world: the backend every rank makes at ``axondist.init("torch")``
(torchrun, a Kubernetes operator or Slurm setting ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``), its watchdog, and the hook that ends the job when one rank fails."""

from __future__ import annotations

import atexit
import datetime
import os
import secrets
import socket
import sys
import traceback
from typing import Any

from ..._validate import positive_seconds
from ...errors import CollectiveTimeoutError, WorldAbortedError
from ..base import checks_enabled, debug_enabled, default_timeout, stall_warning_after
from ..recording.recorder import FlightRecorder
from ..rendezvous import LaunchEnv
from ..watchdog.diagnostics import diagnostics_address, diagnostics_ports
from ..watchdog.watchdog import Watchdog, exit_soon, print_and_flush, silence_all
from .backend import FREED_GROUPS, TorchBackend
from .interop import load_torch
from .mail import Mailbox
from .wires import Wiring

_OPTIONS = ("timeout", "checks", "debug", "abort_on_exception")
#: Seconds torch.distributed's own timeout runs past axondist's (at most; as much as the
#: timeout itself when it is shorter): the watchdog, which names the ranks, speaks first.
_TORCH_TIMEOUT_MARGIN = 30.0
_HOOK_INSTALLED = False
#: Seconds a rank at its exit waits for the receivers of its last sends to take them (gloo's
#: send waits for its receive, and a receiver may lag behind) before it names them unreceived.
_SENDS_SETTLE = 2.0


def create_world_backend(**options: Any) -> TorchBackend:
    """This process's endpoint in the world of a torch.distributed job.

    Joins the default process group when the program made one already
    (``torch.distributed.init_process_group``), else makes it from the environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrun's, a Kubernetes
    operator's) with gloo for host arrays and, where CUDA is present, NCCL for device
    arrays; without those variables, a one-rank world. With more than one rank it starts
    the rank's watchdog, as the MPI backend does: a call that waits past ``timeout``
    seconds, or for a rank that left, ends the job with one message naming the ranks.

    Args:
        **options: ``timeout`` (seconds a call may wait; ``AXONDIST_TIMEOUT``, default
            600), ``checks`` and ``debug`` (``AXONDIST_CHECKS``, ``AXONDIST_DEBUG``), and
            ``abort_on_exception`` (default True: an uncaught exception on a rank ends the
            job, see :func:`install_abort_hook`).

    Raises:
        BackendUnavailableError: torch is not installed.
        TypeError: an unknown option.
        ValueError: a malformed environment (names the variable), or ranks started with
            different settings.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"torch backend: unknown options {unknown}; accepted: {list(_OPTIONS)}")
    torch, dist = load_torch()
    timeout = options.get("timeout")
    wait = default_timeout() if timeout is None else positive_seconds(timeout, "init")
    checks = bool(options.get("checks", checks_enabled()))
    debug = bool(options.get("debug", debug_enabled()))
    limit = None
    made_default = not dist.is_initialized()
    if made_default:
        limit = _init_default_group(torch, dist, wait)
    live: dict[str, TorchBackend] = {}
    # runs after the watchdog's farewell and the unreceived sends' report (atexit: last in,
    # first out), before the interpreter finalizes: see TorchBackend.release
    atexit.register(_release_at_exit, dist, live, made_default)
    rank, size = dist.get_rank(), dist.get_world_size()
    if options.get("abort_on_exception", True) and size > 1:
        install_abort_hook(rank, size)
    recorder = FlightRecorder(rank, size, socket.gethostname())
    watchdog = None
    box = [secrets.token_hex(16) if rank == 0 else None]
    if size > 1:
        dist.broadcast_object_list(box, src=0)
        watchdog = Watchdog(recorder, timeout=wait, stall=stall_warning_after(wait),
                            abort=_abort_job, token=str(box[0]))
    settings = (checks, debug, wait)
    wire_address = diagnostics_address() if size > 1 else None
    table: list[Any] = [None] * size
    dist.all_gather_object(table, (settings, socket.gethostname(),
                                   watchdog.address if watchdog else None, wire_address))
    if any(t[0] != settings for t in table):
        detail = ", ".join(f"rank {k}: checks={t[0][0]}, debug={t[0][1]}, timeout={t[0][2]:g}"
                           for k, t in enumerate(table))
        raise ValueError("init: the ranks were started with different axondist settings "
                         f"({detail}); set AXONDIST_CHECKS, AXONDIST_DEBUG and AXONDIST_TIMEOUT "
                         "alike on every rank")
    if watchdog is not None:
        watchdog.start([t[2] for t in table])
    # the check's own sockets where every rank can listen (not under AXONDIST_DIAGNOSTICS=off)
    wiring = (Wiring(wire_address, diagnostics_ports(), str(box[0]).encode(),
                     wait + min(wait, _TORCH_TIMEOUT_MARGIN))
              if wire_address is not None and all(t[3] is not None for t in table) else None)
    backend = TorchBackend(dist.group.WORLD, recorder=recorder, members=range(size),
                           hosts=[t[1] for t in table], uid=str(box[0])[:12], timeout=limit,
                           checks=checks, debug=debug, live=live, wiring=wiring)
    backend.watchdog = watchdog
    if wiring is not None:
        store = dist.distributed_c10d._get_default_store()
        backend.mail = Mailbox.connect(wiring, store, f"axondist-mail/{backend.uid}", rank, size)
    if size > 1:
        atexit.register(report_unreceived, backend)  # runs before the group's destruction
    return backend


def report_unreceived(backend: TorchBackend) -> None:
    """At a clean exit: name this rank's sends that no rank received, and end with status 1
    (a send without its receive is a bug the mock world and MPI report too)."""
    found = backend.outbox.unreceived(_SENDS_SETTLE)
    if not found:
        return
    silence_all()  # this rank ends the job: its peers must not read it as a departure
    rank, size = backend.rank, backend.world_size
    detail = "; ".join(f"{count} from rank {source} to rank {dst} (tag {tag})"
                       for (source, dst, tag), count in sorted(found.items()))
    print_and_flush(f"[axondist rank {rank}/{size}] ",
                    f"messages were sent but never received: {detail}; every send needs a "
                    "matching recv (with the same tag) on its destination")
    os._exit(1)


def _init_default_group(torch: Any, dist: Any, wait: float) -> datetime.timedelta:
    """torch's default process group from the launcher's variables (a one-rank group
    without them): gloo for CPU tensors, plus NCCL for CUDA ones where CUDA is usable."""
    engines = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() \
        else "gloo"
    seconds = wait + min(wait, _TORCH_TIMEOUT_MARGIN)
    limit = datetime.timedelta(seconds=seconds)
    if LaunchEnv.present(os.environ):
        env = LaunchEnv.from_environ(os.environ, who="torch backend")
        try:
            dist.init_process_group(engines, init_method="env://", rank=env.rank,
                                    world_size=env.world_size, timeout=limit)
        except (RuntimeError, TimeoutError) as exc:  # torch's DistError classes derive these
            raise CollectiveTimeoutError(
                f"init: rank {env.rank} of {env.world_size} could not join the torch.distributed "
                f"world at {env.endpoint} within {seconds:g} s ({str(exc).splitlines()[0]}); "
                "check that every rank was started and that this host reaches MASTER_ADDR "
                "(AXONDIST_TIMEOUT sets the wait)") from exc
    else:
        dist.init_process_group(engines, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=limit)
    return limit


def _release_at_exit(dist: Any, live: dict[str, TorchBackend], default_group: bool) -> None:
    """Destroy this rank's groups, and torch's default group when ``init`` made it, before
    the interpreter finalizes (:meth:`TorchBackend.release`), and wait for the groups
    closed earlier to be freed (a world destroyed before is no longer in ``live``)."""
    FREED_GROUPS.drain()
    world = live.get("world")
    if world is not None:
        world.release(default_group)
    elif default_group and dist.is_initialized():  # init failed before its backend was made
        dist.destroy_process_group()


def install_abort_hook(rank: int, size: int) -> None:
    """Make an uncaught exception on this rank end the whole job: the traceback is printed
    with each line prefixed by ``[axondist rank R/N]``, the watchdog is silenced (this rank
    fails; its peers must not read a mere departure), and the process ends with status 1,
    at which torchrun stops the other ranks. Installed once per process."""
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    previous = sys.excepthook

    def end_job(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
            return
        silence_all()
        if isinstance(exc, WorldAbortedError):  # caused by another rank: no traceback
            text = f"{exc}\nending this rank"
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            text += f"rank {rank} failed: ending the job so the other ranks do not wait"
        print_and_flush(f"[axondist rank {rank}/{size}] ", text)
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = end_job
    _HOOK_INSTALLED = True


def _abort_job(message: str) -> None:
    """Print ``message`` on this rank and end its process (the watchdog's end); the
    launcher (torchrun) then stops the others, whose own watchdogs see this rank gone."""
    silence_all()
    torch, dist = load_torch()
    rank, size = dist.get_rank(), dist.get_world_size()
    print_and_flush(f"[axondist rank {rank}/{size}] ", message)
    exit_soon(1, 0.0)
    os._exit(1)


__all__ = ["create_world_backend", "install_abort_hook"]
