"""Train a one-layer attention character LM on a sequence split over ranks, and check it
against one process training on the whole sequence.

    python examples/context_parallel_char_lm.py                  # 4 mock ranks, ring, zigzag
    python examples/context_parallel_char_lm.py --method ulysses --layout contiguous
    axondist run -n 4 examples/context_parallel_char_lm.py       # 4 processes

Each rank holds a quarter of one long sequence (so the sequence is 4x what one rank
holds, at 4 ranks) in the zigzag layout: its token and position embeddings, queries,
keys and values. Attention over the whole sequence comes from
``axondist.context_parallel.attention`` and its backward from ``attention_backward``;
everything else is per token, so each rank's parameter gradients are its tokens' share,
summed over the group. After every step the example compares the loss and the weights
with the same model trained densely, in NumPy, on the whole sequence in one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist import comm
from axondist import context_parallel as cp

TEXT = ("the quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire and "
        "the rain keeps falling on the old tin roof of the quiet house at the end of the lane ")
DIM, HEADS, LR = 16, 4, 0.5
NAMES = ("embed", "pos", "wq", "wk", "wv", "wo", "unembed")


def init_params(vocab: int, seq_len: int) -> dict[str, np.ndarray]:
    """The model's weights, drawn from a fixed seed (the same on every rank)."""
    rng = np.random.default_rng(0)
    shapes = {"embed": (vocab, DIM), "pos": (seq_len, DIM), "wq": (DIM, DIM), "wk": (DIM, DIM),
              "wv": (DIM, DIM), "wo": (DIM, DIM), "unembed": (DIM, vocab)}
    return {n: rng.standard_normal(shapes[n]) / np.sqrt(shapes[n][0]) for n in NAMES}


def heads(a: np.ndarray) -> np.ndarray:
    """(T, DIM) -> (HEADS, T, DIM // HEADS)."""
    return a.reshape(a.shape[0], HEADS, -1).transpose(1, 0, 2)


def unheads(a: np.ndarray) -> np.ndarray:
    """(HEADS, T, dh) -> (T, DIM)."""
    return a.transpose(1, 0, 2).reshape(a.shape[1], DIM)


def dense_attention(q, k, v, go=None):
    """Causal attention over the whole sequence, and with ``go`` its backward."""
    scale = 1 / np.sqrt(q.shape[-1])
    n = q.shape[-2]
    s = np.where(np.tril(np.ones((n, n), bool)), q @ k.transpose(0, 2, 1) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    if go is None:
        return out
    ds = p * (go @ v.transpose(0, 2, 1) - (go * out).sum(-1, keepdims=True))
    return ds @ k * scale, ds.transpose(0, 2, 1) @ q * scale, p.transpose(0, 2, 1) @ go


def loss_and_grads(p: dict[str, np.ndarray], tokens: np.ndarray, positions: np.ndarray,
                   targets: np.ndarray, total: int, attend, attend_backward):
    """Loss (summed over these tokens, divided by ``total``) and the parameter gradients.

    ``attend(q, k, v) -> (out, state)`` and ``attend_backward(q, k, v, out, state, go) ->
    (dq, dk, dv)`` compute attention over the whole sequence, however it is held.
    """
    x = p["embed"][tokens] + p["pos"][positions]
    q, k, v = heads(x @ p["wq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    att, state = attend(q, k, v)
    y = unheads(att)
    z = x + y @ p["wo"]
    logits = z @ p["unembed"]
    logits -= logits.max(-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(-1, keepdims=True)
    loss = -np.log(probs[np.arange(len(targets)), targets]).sum() / total
    dlogits = probs
    dlogits[np.arange(len(targets)), targets] -= 1
    dlogits /= total
    g = {"unembed": z.T @ dlogits}
    dz = dlogits @ p["unembed"].T
    g["wo"] = y.T @ dz
    dq, dk, dv = (unheads(a) for a in attend_backward(q, k, v, att, state, heads(dz @ p["wo"].T)))
    g["wq"], g["wk"], g["wv"] = x.T @ dq, x.T @ dk, x.T @ dv
    dx = dz + dq @ p["wq"].T + dk @ p["wk"].T + dv @ p["wv"].T
    g["embed"] = np.zeros_like(p["embed"])
    np.add.at(g["embed"], tokens, dx)
    g["pos"] = np.zeros_like(p["pos"])
    np.add.at(g["pos"], positions, dx)
    return loss, g


def train(world: ad.World, args: argparse.Namespace) -> list[tuple[int, float, float, float]]:
    """Per-rank training; returns (step, loss, dense loss, max weight difference)."""
    vocab = sorted(set(TEXT))
    ids = np.array([vocab.index(c) for c in (TEXT * 10)], dtype=np.int64)
    seq_len = args.seq_len
    tokens, targets = ids[:seq_len], ids[1:seq_len + 1]
    w, r = world.world_size, world.rank
    mine = cp.layout_indices(seq_len, w, r, args.layout)
    opts = dict(causal=True, layout=args.layout, method=args.method)

    def attend(q, k, v):
        return cp.attention(q, k, v, world, **opts)

    def attend_backward(q, k, v, out, lse, go):
        return cp.attention_backward(q, k, v, out, lse, go, world, **opts)

    def dense_attend(q, k, v):
        return dense_attention(q, k, v), None

    def dense_backward(q, k, v, out, _, go):
        return dense_attention(q, k, v, go)

    params = init_params(len(vocab), seq_len)
    dense = {n: a.copy() for n, a in params.items()}
    all_positions = np.arange(seq_len)
    rows = []
    for step in range(args.steps):
        loss, grads = loss_and_grads(params, tokens[mine], mine, targets[mine], seq_len, attend,
                                     attend_backward)
        flat, layout = ad.flatten([grads[n] for n in NAMES] + [np.array([loss])])
        comm.all_reduce_sum(flat, world)  # each rank's tokens' share of every gradient
        *summed, total_loss = ad.unflatten(flat, layout)
        for n, g in zip(NAMES, summed):
            params[n] -= LR * g
        dense_loss, dense_grads = loss_and_grads(dense, tokens, all_positions, targets, seq_len,
                                                 dense_attend, dense_backward)
        for n in NAMES:
            dense[n] -= LR * dense_grads[n]
        diff = max(float(np.abs(params[n] - dense[n]).max()) for n in NAMES)
        rows.append((step, float(total_loss[0]), float(dense_loss), diff))
    return rows


def check(world: ad.World, args: argparse.Namespace) -> int:
    """Train on every rank; rank 0 prints the table. The exit status."""
    rows = train(world, args)
    worst = ad.all_reduce_scalar(max(r[3] for r in rows), "max", group=world)
    agree = worst < 1e-9 and all(abs(a - b) < 1e-9 for _, a, b, _ in rows)
    if world.rank == 0:
        per_rank = cp.token_counts(args.seq_len, world.world_size, args.layout)
        print(f"char LM, {args.seq_len} tokens over {world.world_size} ranks "
              f"({args.layout}, {args.method}: at most {max(per_rank)} tokens per rank)")
        print(f"{'step':>4} {'context-parallel loss':>22} {'one-process loss':>17} "
              f"{'max |W - W_dense|':>18}")
        for step, loss, dense_loss, diff in rows:
            print(f"{step:>4} {loss:>22.6f} {dense_loss:>17.6f} {diff:>18.2e}")
        print("matches one-process training:", "yes" if agree else "NO: FAILED")
    return 0 if agree else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world size")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--method", default="ring", choices=sorted(cp.METHODS))
    parser.add_argument("--layout", default="zigzag", choices=sorted(cp.LAYOUTS))
    args = parser.parse_args(argv)
    # python ...: --world-size threads; axondist run -n K: this process's rank of K
    return ad.run(check, args.world_size, args)[0]


if __name__ == "__main__":
    sys.exit(main())
