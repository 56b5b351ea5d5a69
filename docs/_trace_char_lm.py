"""Record the trace shown in docs/tracing.md: the char-LM example, traced, with spans.

    mpiexec -n 3 python docs/_trace_char_lm.py TRACE_DIR [char_lm.py options]
    python -m axondist trace TRACE_DIR --json docs/img/trace_char_lm.json \
        --png docs/img/trace_char_lm.png

Every rank starts tracing before the example trains (``axondist.trace.start``,
with its clock exchange) and stops after; each strategy's run and each model
piece's forward and backward become spans. The example itself is unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import char_lm  # noqa: E402

import axondist as ad  # noqa: E402


def spanned(name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside ``trace_span(name)`` (``name(*args)`` when callable)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with ad.trace_span(name(*args) if callable(name) else name):
            return fn(*args, **kwargs)
    return run


def main(directory: str, argv: list[str]) -> int:
    char_lm.RUNNERS.update({k: spanned(k, f) for k, f in char_lm.RUNNERS.items()})
    char_lm.piece_forward = spanned(lambda kind, *a: f"forward {kind}", char_lm.piece_forward)
    char_lm.piece_backward = spanned(lambda kind, *a: f"backward {kind}",
                                     char_lm.piece_backward)
    train = char_lm.train

    def traced_train(world: ad.World, *args: Any) -> Any:
        ad.trace.start(directory)
        try:
            return train(world, *args)
        finally:
            ad.trace.stop()

    char_lm.train = traced_train
    return char_lm.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
