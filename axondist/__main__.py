"""The command line: ``axondist demo`` and ``axondist run`` (also ``python -m axondist``).

``demo`` trains a small NumPy MLP with a parallel strategy and checks the
result against single-process training on the full batch. By default the
ranks are threads of a mock world in this process; under
``mpiexec -n K python -m axondist demo`` each process is one rank of the MPI
world and only rank 0 prints.

``run`` launches a script on N processes through mpiexec, or torchrun with
``--launcher torchrun`` (see :mod:`axondist.launching.supervisor`); it exits with the
failed rank's status. ``tune``
measures all-reduce bandwidth per size and saves DDP's bucket size (see
:mod:`axondist.tune`). ``checkpoint repair ROOT`` rebuilds a checkpoint root's
``latest`` pointer from the complete steps on disk (see
:func:`axondist.checkpoint.repair`). ``trace DIR`` turns a trace folder into a
Perfetto JSON, a PNG and a straggler report (see :mod:`axondist.trace`).

Exit status of ``demo``: 0 when the check passed, 1 when it failed, 2 when
the arguments are invalid.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import tune
from .launching import supervisor as launcher
from .pipeline.schedules import schedule_names
from .trace import cli as trace_cli


def _parser() -> argparse.ArgumentParser:
    from .demo import PROGRESS_MODES, STRATEGIES, DemoConfig

    d = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m axondist", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="train a small MLP in parallel and check it against one process",
        description="Train a small NumPy MLP with a parallel strategy and check the parameters "
                    "against single-process training on the full batch (exit status 1 when "
                    "they differ by more than the tolerance).")
    demo.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                      help="ddp: data parallel; fsdp: sharded data parallel; pipeline: one "
                           "stage per rank; tp: tensor parallel layers (default: ddp)")
    demo.add_argument("--world-size", type=int, default=d.world_size, metavar="N",
                      help="ranks of the mock world (default: %(default)s; under mpiexec the "
                           "launch decides)")
    demo.add_argument("--steps", type=int, default=d.steps, help="optimizer steps "
                      "(default: %(default)s)")
    demo.add_argument("--batch-size", type=int, default=d.batch_size,
                      help="samples per rank and step (default: %(default)s)")
    demo.add_argument("--lr", type=float, default=d.lr, help="learning rate (default: "
                      "%(default)s)")
    demo.add_argument("--seed", type=int, default=d.seed, help="seed of data and weights")
    demo.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype)
    demo.add_argument("--tol", type=float, default=None,
                      help="largest accepted parameter difference (default: 1e-4 for float32, "
                           "1e-10 for float64)")
    demo.add_argument("--schedule", choices=schedule_names(), type=str.lower,
                      default=d.schedule, help="pipeline schedule, in any case (default: "
                      "%(default)s; the interleaved ones put 2 stages on each rank)")
    demo.add_argument("--backend", choices=("auto", "mock", "mpi", "torch"), default="auto",
                      help="auto: MPI when launched by mpiexec, torch under torchrun, else "
                           "the mock world")
    demo.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                      help="auto: a bar on a terminal, a plain line every tenth of the run "
                           "elsewhere (logs, pipes, mpiexec); bar: a bar even through a pipe "
                           "(mpiexec from a terminal); only rank 0 shows it (default: auto)")
    demo.add_argument("--no-progress", dest="progress", action="store_const", const="off",
                      help="same as --progress off")
    sub.add_parser("run", add_help=False,
                   help="launch a script on N processes through mpiexec (or --launcher "
                        "torchrun): axondist run -n N script.py args (axondist run --help for "
                        "the options)")
    sub.add_parser("tune", add_help=False,
                   help="measure all-reduce bandwidth per size and save DDP's bucket size: "
                        "mpiexec -n N python -m axondist tune (tune --help for the options)")
    sub.add_parser("trace", add_help=False,
                   help="a trace folder as a Perfetto JSON, a PNG and a straggler report: "
                        "axondist trace DIR (trace --help for the options)")
    sub.add_parser("checkpoint", add_help=False,
                   help="checkpoint repair ROOT: rebuild a damaged or missing 'latest' pointer "
                        "from the complete steps on disk")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None), run the command, return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after the script belongs to the script
        return launcher.main(argv[1:])
    if argv[:1] == ["tune"]:
        return tune.main(argv[1:])
    if argv[:1] == ["trace"]:
        return trace_cli.main(argv[1:])
    if argv[:1] == ["checkpoint"]:
        from .checkpoint import recovery

        return recovery.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        try:
            return run_demo(world_size=args.world_size, strategy=args.strategy,
                            steps=args.steps, backend=args.backend,
                            progress=args.progress,
                            batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                            dtype=args.dtype, tol=args.tol, schedule=args.schedule)
        except ValueError as exc:
            print(f"axondist {exc}", file=sys.stderr)  # the message starts with "demo:"
            return 2
    return 2  # pragma: no cover - argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
