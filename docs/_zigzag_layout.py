"""Draw docs/img/context_parallel_zigzag.png: which rank holds each token, and which rank
computes each (query, key) pair of a causal mask, in the contiguous and zigzag layouts.

    python docs/_zigzag_layout.py docs/img/context_parallel_zigzag.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axondist import context_parallel as cp  # noqa: E402

N, W = 16, 4


def owners(layout: str) -> np.ndarray:
    """The rank holding each position."""
    owner = np.empty(N, dtype=int)
    for r in range(W):
        owner[cp.layout_indices(N, W, r, layout)] = r
    return owner


def main(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    colors = ListedColormap(["#4c72b0", "#dd8452", "#55a868", "#c44e52"])
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.6), height_ratios=[1, 5])
    for col, layout in enumerate(("contiguous", "zigzag")):
        owner = owners(layout)
        top = axes[0, col]
        top.imshow(owner[None, :], cmap=colors, vmin=0, vmax=W - 1, aspect="auto")
        for t in range(N):
            top.text(t, 0, str(owner[t]), ha="center", va="center", color="white", fontsize=9)
        top.set_yticks([])
        top.set_xticks(range(N))
        top.set_title(f"{layout}: rank holding each of {N} tokens ({W} ranks)", fontsize=10)
        pairs = np.where(np.tril(np.ones((N, N), bool)), owner[:, None], np.nan)
        grid = axes[1, col]
        grid.imshow(pairs, cmap=colors, vmin=0, vmax=W - 1)
        work = [int((cp.layout_indices(N, W, r, layout) + 1).sum()) for r in range(W)]
        grid.set_title("causal pairs, by the rank that computes them\n"
                       f"pairs per rank: {work}", fontsize=10)
        grid.set_xlabel("key position")
        grid.set_ylabel("query position")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "docs/img/context_parallel_zigzag.png"))
