"""``python -m axondist trace DIR``: a trace folder as a Perfetto JSON, a PNG and a
straggler report."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .export import write_perfetto, write_png
from .report import format_report, straggler_report
from .timeline import read_timeline


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m axondist trace",
        description="Read the rank files of a trace folder (AXONDIST_TRACE=DIR or "
                    "axondist.trace.start(DIR)), write a Chrome/Perfetto trace JSON and a PNG "
                    "of the timeline, and print who kept the others waiting.")
    parser.add_argument("directory", metavar="DIR", help="the trace folder")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="where the trace JSON goes (default: DIR/trace.json)")
    parser.add_argument("--png", metavar="PATH", default=None,
                        help="where the PNG goes (default: DIR/timeline.png)")
    parser.add_argument("--no-png", action="store_true", help="skip the picture")
    parser.add_argument("--worst", type=int, default=5, metavar="N",
                        help="collectives listed that held the job longest (default: 5)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand; 0 on success, 2 when the folder holds no trace."""
    args = _parser().parse_args(argv)
    try:
        timeline = read_timeline(args.directory)
    except FileNotFoundError as exc:
        print(f"axondist {exc}", file=sys.stderr)
        return 2
    json_path = args.json or os.path.join(args.directory, "trace.json")
    write_perfetto(timeline, json_path)
    print(f"trace JSON: {json_path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if not args.no_png:
        png_path = args.png or os.path.join(args.directory, "timeline.png")
        try:
            write_png(timeline, png_path)
            print(f"timeline PNG: {png_path}")
        except ModuleNotFoundError as exc:
            print(f"timeline PNG skipped: {exc}", file=sys.stderr)
    skipped = sum(t.skipped_lines for t in timeline.ranks.values())
    if skipped:
        print(f"skipped {skipped} unreadable lines (a rank's torn last write)")
    print(format_report(straggler_report(timeline, args.worst)))
    return 0


__all__ = ["main"]
