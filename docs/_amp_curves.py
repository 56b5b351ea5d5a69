"""Draw docs/img/amp_loss_curves.png: the float16 test's problem
(tests/world/test_amp_training.py) trained in float32, in plain float16 and in float16
with a LossScaler, on 3 ranks of the mock world with DDP.

    python docs/_amp_curves.py docs/img/amp_loss_curves.png
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "world")]

import test_amp_training as problem  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.amp import LossScaler  # noqa: E402
from axondist.optim import SGD  # noqa: E402

WORLD = 3


def scaled_run(world: ad.World) -> tuple[list[float], list[int], list[float]]:
    """DDP with the scaler: the loss before each step, the skipped steps, the scales."""
    x, y = problem.rank_data(world.rank)
    data = [problem.rank_data(r) for r in range(world.world_size)]
    xs, ys = [d[0] for d in data], [d[1] for d in data]
    w = ad.Parameter(problem.W0.copy(), "w")
    scaler = LossScaler(growth_interval=problem.GROWTH_INTERVAL)

    def grad_fn(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> Any:
        g = problem.gradient(params[0], x, y, np.float16, scaler.scale)
        return 0.0, [g.astype(np.float32)]

    ddp = ad.DDP([w], world, grad_fn=grad_fn, init_sync=False)
    opt = SGD(ddp.parameters(), lr=problem.LR)
    losses, skipped, scales = [], [], []
    for step in range(problem.STEPS):
        losses.append(problem.loss_of(w.data, xs, ys))
        scales.append(scaler.scale)
        ddp.backward(x, y)
        if not scaler.step(opt, replicated=True):
            skipped.append(step)
        scaler.update()
        opt.zero_grad()
    return losses, skipped, scales


def main(path: str) -> None:
    from matplotlib.figure import Figure

    losses, skipped, scales = ad.spawn(scaled_run, WORLD)[0]
    fp32, _ = problem.single_process(np.float32, WORLD)
    fp16, _ = problem.single_process(np.float16, WORLD)
    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    steps = np.arange(problem.STEPS)
    left.semilogy(steps, fp32, color="black", linewidth=3, alpha=0.35, label="float32")
    left.semilogy(steps, fp16, "--", label="float16")
    left.semilogy(steps, losses, label="float16 + LossScaler")
    left.semilogy(skipped, [losses[k] for k in skipped], "rx", markersize=5,
                  label=f"skipped ({len(skipped)} steps: inf in float16)")
    left.set(xlabel="step", ylabel="loss", title=f"least squares, DDP on {WORLD} ranks")
    left.legend(fontsize=8)
    right.semilogy(steps, scales, drawstyle="steps-post")
    right.semilogy(skipped, [scales[k] for k in skipped], "rx", markersize=5)
    right.set(xlabel="step", ylabel="loss scale",
              title=f"scale (x2 every {problem.GROWTH_INTERVAL} good steps, x0.5 on inf)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"{path}: float32 ends at {fp32[-1]:.3g}, float16 at {fp16[-1]:.3g}, scaled "
          f"float16 at {losses[-1]:.3g}; skipped steps {skipped}")


if __name__ == "__main__":
    main(sys.argv[1])
