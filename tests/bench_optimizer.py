"""Figures for the NorMuon + Adam optimizer; prints them and exits 0 (CPU or CUDA).

    python tests/bench_optimizer.py                 # all sections
    python tests/bench_optimizer.py --skip-comms    # without the multi-process bigram run

1. FLOPs per step of Polar Express vs Gram Newton-Schulz for each bank at speedrun shapes,
   counted by torch's FlopCounterMode on meta tensors (dense counts: the symmetric Triton kernels
   compute about half of each X X^T and A A).
2. Bytes each rank sends for the bigram table on one Adam step, dense reduce_scatter vs sparse
   row exchange, counted by the optimizer's comm layer on a real gloo run with the real table
   (377,280 x 768 bf16) and the bigram hashes of real text (tinyshakespeare tokens).
3. Optimizer step time on CPU vs torch.optim.AdamW on the same parameters (demo preset shapes),
   median of several runs.
4. On CUDA only: per-bank NorMuon update time in ms for both orthogonalizers (speedrun shapes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_gpt as T  # noqa: E402
from dist_utils import run_on_ranks  # noqa: E402

BIGRAM_MOD = 377_279  # hash modulus; the table has one more row for the first position
SPEEDRUN_BATCH = 393_216  # global tokens per step in the last stage


def speedrun_banks(args: T.Hyperparameters, world_size: int = 8) -> dict[str, tuple[int, int, int]]:
    """Bank shapes of the speedrun model: Q,K and V,O of every attention layer (one layer has no
    attention) and the MLP up/down pair of every layer, padded to a multiple of the world size."""
    attn_layers = args.num_layers - 1
    pad = lambda n: -(-n // world_size) * world_size  # noqa: E731
    d, h = args.model_dim, args.num_heads * args.head_dim
    return {"qk_bank": (pad(2 * attn_layers), h, d),
            "vo_bank": (pad(2 * attn_layers), h, d),
            "mlp_bank": (pad(2 * args.num_layers), args.mlp_hidden, d)}


def section_flops():
    from torch.utils.flop_counter import FlopCounterMode
    args = T.Hyperparameters()
    print("\n## 1. Orthogonalization FLOPs per step (speedrun shapes, 8 ranks)")
    print(f"{'bank':9s} {'matrices':>8s} {'matrix':>11s} {'PE GFLOP/mat':>13s} {'GNS GFLOP/mat':>14s}"
          f" {'GNS/PE':>7s} {'PE TFLOP/step':>14s} {'GNS TFLOP/step':>15s} {'per rank PE/GNS GFLOP':>22s}")
    for label, (n, r, c) in speedrun_banks(args).items():
        per = {}
        for name, fn in T.ORTHOGONALIZERS.items():
            with FlopCounterMode(display=False) as fc:
                fn(torch.empty(1, r, c, device="meta"))
            per[name] = fc.get_total_flops()
        pe, gns = per["polar_express"], per["gram_newton_schulz"]
        print(f"{label:9s} {n:8d} {f'{r}x{c}':>11s} {pe / 1e9:13.2f} {gns / 1e9:14.2f} {gns / pe:7.3f}"
              f" {n * pe / 1e12:14.3f} {n * gns / 1e12:15.3f} {f'{n * pe / 8e9:.1f} / {n * gns / 8e9:.1f}':>22s}")


def bigram_hashes(tokens: torch.Tensor) -> torch.Tensor:
    """h[0] = 377279; h[t] = (36313 * cur XOR 27191 * prev) mod 377279."""
    t = tokens.to(torch.int64)
    h = torch.empty_like(t)
    h[0] = BIGRAM_MOD
    h[1:] = torch.bitwise_xor(36313 * t[1:], 27191 * t[:-1]) % BIGRAM_MOD
    return h


def _bigram_worker(rank, world_size, tokens_per_rank, dim, shard_path):
    tokens = T.read_shard(shard_path)
    start = (rank * tokens_per_rank) % len(tokens)
    idx = (torch.arange(tokens_per_rank) + start) % len(tokens)
    rows = bigram_hashes(tokens[idx])
    vocab = BIGRAM_MOD + 1
    out = {"touched": int(rows.unique().numel()), "rows": vocab}
    for mode, threshold in (("sparse", 1.0), ("dense", 0.0)):
        p = torch.nn.Parameter(torch.zeros(vocab, dim, dtype=torch.bfloat16))
        opt = T.NorMuonAdam({"bigram": p}, {"bigram": T.ParamConfig("adam", "sharded_sparse")},
                            scatter_order=["bigram"], work_order=["bigram"], sparse_threshold=threshold)
        g = torch.zeros(vocab, dim, dtype=torch.bfloat16)
        g.index_add_(0, rows, torch.full((rows.numel(), dim), 0.01, dtype=torch.bfloat16))
        p.grad = g
        opt.prepare_sparse("bigram", rows, launch=True)
        t0 = time.perf_counter()
        opt.step(do_adam=True)
        elapsed = time.perf_counter() - t0
        out[mode] = {op: b for (label, op), b in opt.comm.bytes_by_op.items()}
        out[mode]["seconds"] = elapsed
        out[mode]["checksum"] = p.data.float().sum().item()
        del p, opt, g
    return out


def section_comms(world_size: int, dim: int):
    shard = "data/tinyshakespeare/tinyshakespeare_train_000001.bin"
    shard_path = os.path.join(T.__file__.rsplit("/", 1)[0], shard)
    print(f"\n## 2. Bigram table bytes sent per rank per Adam step (gloo, {world_size} ranks)")
    if not os.path.exists(shard_path):
        print(f"skipped: {shard} not found (the demo data creates it)")
        return
    # An Adam step sees two training steps: 2 x 393,216 tokens over all ranks, as at 8 ranks.
    tokens_per_rank = 2 * SPEEDRUN_BATCH // 8
    res = run_on_ranks(_bigram_worker, world_size, tokens_per_rank, dim, shard_path, timeout=600)
    r0 = res[0]
    print(f"table {r0['rows']} x {dim} bf16 = {r0['rows'] * dim * 2 / 1e6:.0f} MB; each rank holds"
          f" {tokens_per_rank} tokens of tinyshakespeare per Adam step, touching {r0['touched']} rows"
          f" ({100 * r0['touched'] / r0['rows']:.1f}% of the table; FineWeb text is more diverse)")
    for mode in ("dense", "sparse"):
        b = r0[mode]
        gather = b.get("all_gather", 0)
        reduce = b.get("reduce_scatter", 0) + b.get("all_to_all", 0)
        print(f"{mode:6s}: gradient exchange {reduce / 1e6:9.2f} MB + all_gather {gather / 1e6:7.2f} MB"
              f" = {(reduce + gather) / 1e6:8.2f} MB per rank   (CPU step {b['seconds'] * 1e3:.0f} ms)")
    print(f"sparse/dense gradient exchange: "
          f"{(r0['sparse'].get('all_to_all', 0)) / max(1, r0['dense'].get('reduce_scatter', 1)):.3f};"
          f" results identical: {all(r['sparse']['checksum'] == r['dense']['checksum'] for r in res)}")


def demo_params(args: T.Hyperparameters, device="cpu"):
    """A model-shaped parameter set (labels and dtypes as the model uses them) with its configs."""
    d, L, V = args.model_dim, args.num_layers, args.padded_vocab_size
    g = torch.Generator().manual_seed(0)
    mk = lambda *s, dtype=torch.bfloat16: torch.nn.Parameter(  # noqa: E731
        (torch.randn(*s, generator=g) * 0.02).to(dtype).to(device))
    banks = speedrun_banks(args, world_size=1)
    params = {label: mk(*shape) for label, shape in banks.items()}
    params.update(embed=mk(V, d), lm_head=mk(d, V), value_embed=mk(min(5, L), V, d),
                  bigram_embed=mk(args.ngram_rows, d), scalars=mk(4 * L, dtype=torch.float32),
                  gates=mk(L, 12, dtype=torch.float32))
    n_mlp = banks["mlp_bank"][0]
    configs = {
        "qk_bank": T.ParamConfig("normuon", "sharded"),
        "vo_bank": T.ParamConfig("normuon", "sharded"),
        "mlp_bank": T.ParamConfig("normuon", "sharded", matrix_lr_mul=(1.0, 2.0) * (n_mlp // 2)),
        "embed": T.ParamConfig("adam", "sharded", betas=(0.5, 0.95)),
        "lm_head": T.ParamConfig("adam", "sharded", betas=(0.5, 0.95)),
        "value_embed": T.ParamConfig("adam", "sharded", lr_mul=75.0, betas=(0.75, 0.95)),
        "bigram_embed": T.ParamConfig("adam", "sharded_sparse", lr_mul=75.0, betas=(0.75, 0.95)),
        "scalars": T.ParamConfig("adam", "replicated", betas=(0.9, 0.99)),
        "gates": T.ParamConfig("adam", "replicated"),
    }
    return params, configs


def section_cpu_step(reps: int):
    args = T.parse_args(["--preset", "demo"])
    params, configs = demo_params(args)
    labels = list(params)
    opt = T.NorMuonAdam(params, configs, scatter_order=labels, work_order=labels[::-1])
    adamw = torch.optim.AdamW(list(params.values()), lr=1e-3)
    grads = {k: torch.randn_like(p, dtype=torch.float32).to(p.dtype) for k, p in params.items()}
    numel = sum(p.numel() for p in params.values())

    def ours():
        for do_adam in (False, True):  # one even + one odd step: Adam runs every other step
            for k, p in params.items():
                if do_adam or configs[k].optimizer == "normuon" or p.grad is None:
                    p.grad = grads[k].clone()
            opt.step(do_adam=do_adam)

    def theirs():
        for _ in range(2):
            for k, p in params.items():
                p.grad = grads[k].clone()
            adamw.step()

    times = {}
    for name, fn in (("NorMuonAdam", ours), ("AdamW", theirs)):
        fn()  # warm-up
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) / 2)
        times[name] = statistics.median(runs)
    print(f"\n## 3. CPU optimizer step, demo preset ({numel / 1e6:.1f}M parameters,"
          f" {torch.get_num_threads()} threads, median of {reps}, per step incl. gradient copies)")
    for name, t in times.items():
        print(f"{name:12s} {t * 1e3:9.1f} ms")
    print(f"ratio NorMuonAdam / AdamW: {times['NorMuonAdam'] / times['AdamW']:.2f}"
          " (NorMuon runs 5 Polar Express iterations per matrix every step)")


def section_cuda(reps: int):
    print("\n## 4. CUDA NorMuon update per bank (speedrun shapes, one rank's shard of 8)")
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    dev = torch.device("cuda")
    args = T.Hyperparameters()
    for label, (n, r, c) in speedrun_banks(args).items():
        k = n // 8
        for name, orth in T.ORTHOGONALIZERS.items():
            fn = torch.compile(T._normuon_update, dynamic=False)
            g = torch.randn(k, r, c, device=dev, dtype=torch.bfloat16)
            p = (torch.randn(k, r, c, device=dev) * 0.02).bfloat16()
            buf = torch.zeros(k, r, c, device=dev)
            s = torch.zeros(k, r, 1, device=dev) if r >= c else torch.zeros(k, 1, c, device=dev)
            mant = torch.zeros(k, r, c, device=dev, dtype=torch.uint16)
            mlr = torch.ones(k, 1, 1, device=dev)
            hp = torch.tensor([0.023, 0.023 * 1.2, 0.95, 0.9], device=dev)
            for _ in range(3):
                fn(g, buf, s, p, mant, mlr, hp, orth)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(reps):
                start.record()
                fn(g, buf, s, p, mant, mlr, hp, orth)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            print(f"{label:9s} {k} x {r}x{c} {name:20s} {statistics.median(times):7.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2, help="gloo ranks for the bigram bytes run")
    ap.add_argument("--dim", type=int, default=768, help="bigram table width for the bytes run")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    ap.add_argument("--skip-comms", action="store_true", help="skip the multi-process bigram run")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, CUDA: {torch.cuda.is_available()}")
    section_flops()
    if not a.skip_comms:
        section_comms(a.world_size, a.dim)
    section_cpu_step(a.reps)
    section_cuda(a.reps)


if __name__ == "__main__":
    main()
