"""Who orthogonalizes which bank matrix: padded vs balanced ownership (records/README.md "Ownership").
Computed from the optimizer's own planning functions, nothing is run; prints the figures, exits 0.

    python tests/bench_ownership.py [--orthogonalizer polar_express|gram_newton_schulz|auto]

For the speedrun banks (60 Q/K groups 256 x 768, 20 V/O 768 x 768, 22 MLP 3072 x 768, bf16) and each
world size: the orthogonalization FLOPs per rank and per step (max and mean over ranks; the ideal is
the real matrices' total / world size) and the bytes each rank sends per step for the banks
(max and mean). Padded: each bank rounded up to a multiple of the world size with zero matrices,
n / W consecutive matrices per rank, ring reduce_scatter + all_gather ((W-1)/W of the padded bank,
then the shard to W-1 ranks). Balanced: unpadded banks, longest-processing-time first over all
matrices, all_to_all with splits (the rows a rank does not own, then its own block to W-1 ranks).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt as T  # noqa: E402

SPEEDRUN_BANKS = {"qk_bank": (60, 256, 768), "vo_bank": (20, 768, 768), "mlp_bank": (22, 3072, 768)}
WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
BF16 = 2


def per_rank(banks, world_size, ownership, orthogonalizer):
    """(FLOPs per rank, bytes sent per rank) of one step."""
    W = world_size
    cost = {label: T.orthogonalization_flops(r, c, orthogonalizer) for label, (_, r, c) in banks.items()}
    matrix_bytes = {label: r * c * BF16 for label, (_, r, c) in banks.items()}
    if ownership == "padded":
        splits = {label: T.padded_splits(-(-n // W) * W, W, label) for label, (n, _, _) in banks.items()}
    else:
        splits = T.balanced_splits({label: (n, cost[label]) for label, (n, _, _) in banks.items()}, W)
    flops, sent = [0] * W, [0.0] * W
    for label, split in splits.items():
        n, mb = sum(split), matrix_bytes[label]
        for r, k in enumerate(split):
            flops[r] += k * cost[label]
            if W > 1:  # reduce-scatter: (W-1)/W of the bank for equal blocks, the rows not owned otherwise
                sent[r] += (n * (W - 1) / W if len(set(split)) == 1 else n - k) * mb + k * (W - 1) * mb
    return flops, sent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orthogonalizer", default="polar_express", choices=sorted(T.ORTHOGONALIZERS))
    a = ap.parse_args()
    ideal_total = sum(n * T.orthogonalization_flops(r, c, a.orthogonalizer) for n, r, c in SPEEDRUN_BANKS.values())
    print(f"# Bank ownership, speedrun banks, {a.orthogonalizer}: {ideal_total / 1e9:.1f} GFLOP of real matrices per step")
    print(f"{'ranks':>5s} | {'padded GFLOP/rank':>17s} {'x ideal':>7s} {'MB sent max':>11s} |"
          f" {'balanced GFLOP max':>18s} {'mean':>7s} {'x ideal':>7s} {'MB sent max':>11s} {'mean':>7s} | {'speed-up':>8s}")
    for W in WORLD_SIZES:
        ideal = ideal_total / W
        pf, ps = per_rank(SPEEDRUN_BANKS, W, "padded", a.orthogonalizer)
        bf, bs = per_rank(SPEEDRUN_BANKS, W, "balanced", a.orthogonalizer)
        print(f"{W:5d} | {max(pf) / 1e9:17.1f} {max(pf) / ideal:7.3f} {max(ps) / 1e6:11.1f} |"
              f" {max(bf) / 1e9:18.1f} {sum(bf) / W / 1e9:7.1f} {max(bf) / ideal:7.3f} {max(bs) / 1e6:11.1f}"
              f" {sum(bs) / W / 1e6:7.1f} | {max(pf) / max(bf):8.3f}")
    print("(padded: every rank does the same work, so max = mean; 'x ideal' = max / (real FLOPs / ranks);"
          " speed-up = padded max / balanced max, the orthogonalization time if FLOP-bound)")


if __name__ == "__main__":
    main()
