"""Draw docs/img/expert_dispatch.png: one MoE dispatch on 3 ranks of the mock world.

Each rank's tokens (coloured by the expert the router chose, top-1), its send buffer
sorted by expert (so by destination rank), the all-to-all, and the rows each rank's
experts receive, grouped by source rank. The sizes are the plan plan_dispatch makes.

    python docs/_expert_dispatch.py docs/img/expert_dispatch.png
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import axondist as ad  # noqa: E402
from axondist.expert_parallel import plan_dispatch  # noqa: E402

WORLD, EXPERTS = 3, 6
TOKENS = [5, 7, 4]  # uneven on purpose


def choices(rank: int) -> np.ndarray:
    return np.random.default_rng([7, rank]).integers(0, EXPERTS, (TOKENS[rank], 1))


def plan_of(world: ad.World) -> dict[str, Any]:
    mine = choices(world.rank)
    plan = plan_dispatch(mine, EXPERTS, world)
    order = np.argsort(plan.send_index[:, 0])
    return {"experts": mine[:, 0], "send": mine[order, 0], "send_sizes": plan.send_sizes,
            "recv_sizes": plan.recv_sizes}


def draw(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    plans = ad.spawn(plan_of, WORLD)
    colours = plt.get_cmap("tab10").colors
    local = EXPERTS // WORLD
    fig, ax = plt.subplots(figsize=(10, 6.2))
    band, box = 9.0, 1.0
    xs = {"tokens": 0.0, "send": 3.2, "recv": 8.6}

    def cell(x: float, y: float, expert: int) -> None:
        ax.add_patch(Rectangle((x, y), 1.4, box * 0.9, facecolor=colours[expert],
                               edgecolor="black", linewidth=0.6))
        ax.text(x + 0.7, y + 0.45, f"e{expert}", ha="center", va="center", fontsize=7,
                color="white")

    def top(rank: int) -> float:
        return (WORLD - 1 - rank) * band + 8.0

    send_top: dict[tuple[int, int], float] = {}  # (source, destination) -> block's top
    recv_top: dict[tuple[int, int], float] = {}  # (destination, source) -> block's top
    for r, p in enumerate(plans):
        t = top(r)
        ax.text(-1.0, t - 3.5, f"rank {r}", ha="right", va="center", fontsize=11,
                fontweight="bold")
        for i, e in enumerate(p["experts"]):
            cell(xs["tokens"], t - (i + 1) * box, int(e))
        y = t
        for dest, size in enumerate(p["send_sizes"]):
            for k in range(size):
                e = int(p["send"][sum(p["send_sizes"][:dest]) + k])
                cell(xs["send"], y - (k + 1) * box, e)
            send_top[(r, dest)] = y
            y -= size * box + 0.25
        # what this rank receives: from each source, its rows for experts of this rank
        y = t
        for src, size in enumerate(p["recv_sizes"]):
            rows = [int(e) for e in plans[src]["send"] if e // local == r]
            for k, e in enumerate(rows):
                cell(xs["recv"], y - (k + 1) * box, e)
            if size:
                ax.text(xs["recv"] + 1.6, y - size * box / 2, f"from rank {src}", va="center",
                        fontsize=7)
            recv_top[(r, src)] = y
            y -= size * box + 0.25
        ax.text(xs["recv"] + 0.7, t + 0.5, f"experts {r * local}-{r * local + local - 1}",
                ha="center", fontsize=8)
    for src in range(WORLD):
        for dest in range(WORLD):
            size = plans[src]["send_sizes"][dest]
            if not size:
                continue
            y0 = send_top[(src, dest)] - size * box / 2
            y1 = recv_top[(dest, src)] - size * box / 2
            ax.add_patch(FancyArrowPatch((xs["send"] + 1.5, y0), (xs["recv"] - 0.1, y1),
                                         arrowstyle="-|>", mutation_scale=10, linewidth=0.8,
                                         color=colours[dest * local], alpha=0.8))
    for key, label in (("tokens", "this rank's tokens\n(router's top-1 expert)"),
                       ("send", "send buffer, sorted by\nexpert = by destination"),
                       ("recv", "received rows,\nby source rank")):
        ax.text(xs[key] + 0.7, top(0) + 1.5, label, ha="center", fontsize=9)
    ax.text(6.4, -1.2, "dispatch: one all-to-all, its sizes from the exchanged counts; "
            "combine: the same all-to-all, sizes swapped (arrows reversed)", ha="center",
            fontsize=9, style="italic")
    ax.set_xlim(-2.5, 11.5)
    ax.set_ylim(-2.0, top(0) + 3.0)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "docs" / "img" / "expert_dispatch.png"))
