"""``python -m axondist demo``: a small training run on the embedded mock world."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m axondist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="average gradients over a mock world and check them")
    demo.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(world_size=args.world_size)
    return 2


if __name__ == "__main__":
    sys.exit(main())
