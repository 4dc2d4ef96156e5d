"""FLOP and memory budget of one speedrun training step, by component (records/README.md, "Step budget").

    python tests/benchmarks/step_budget.py [--world_size 8] [--measure_tokens 2048]

FLOPs are counted from the shapes (2 per multiply-add, backward = 2 x forward), per stage at its global
batch; attention assumes every document is at least as long as the window (an upper bound). Memory is
per rank: parameters, gradients and optimizer state counted from the shapes; activations of the layer
stack measured with saved-tensor hooks on this machine's CPU path at the speedrun's width (small vocab),
scaled to the stage's tokens per rank; the head's logits and their gradient counted from the shapes.
"""
import argparse
import dataclasses
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import train_gpt as T  # noqa: E402

GIB = 2 ** 30


def flops_per_token(args: T.Hyperparameters, model: T.GPT, stage: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) by component at a stage's windows."""
    D, H, hd, Vp = args.model_dim, args.num_heads, args.head_dim, args.padded_vocab_size
    bs = args.window_block_size
    short, long = (w * bs for w in args.stages[stage].windows)
    rows = [model.layers[i] for i in model.attn_layers]
    score = sum(12 * H * hd * ((long if r.window == "long" else short) + 1) for r in rows)
    return {
        "Q/K/V/O projections": 6 * 4 * D * D * len(rows),
        "MLP": 6 * 2 * D * args.mlp_hidden * args.num_layers,
        "LM head": 6 * D * Vp,
        "attention scores and values": score,
        "DC": sum(12 * H * hd * args.dc_window for r in rows if r.dc),
        "MUDD gates and layers": 6 * sum(args.mudd_hidden * (D + n) for n in (*model.gate_outputs, *T.MUDD_LAYER_OUTPUTS)),
    }


def optimizer_flops(model: T.GPT) -> float:
    """Polar Express over every bank matrix, padding included (it runs too), per step."""
    return sum(T.orthogonalization_flops(*getattr(model, label).shape[-2:]) * getattr(model, label).shape[0]
               for label in ("qk_bank", "vo_bank", "mlp_bank"))


def state_bytes(model: T.GPT, world_size: int) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state (sharded labels split over ranks)."""
    args = model.args
    configs = T.optimizer_configs(args, model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    adam = normuon = 0.0
    for label, p in model.params_by_label().items():
        share = 1 / world_size if configs[label].comms != "replicated" else 1.0
        if configs[label].optimizer == "adam":
            adam += 2 * 4 * p.numel() * share                       # exp_avg, exp_avg_sq in fp32
        else:
            rows, cols = p.shape[-2:]
            stat = rows if rows >= cols else cols
            per = rows * cols * (4 + 2) + 4 * stat                  # fp32 momentum, uint16 mantissa, 2nd moment
            normuon += per * p.shape[0] * share
    fp8 = 2 * args.num_layers * args.mlp_hidden * args.model_dim    # e4m3 copies of W1 and W2
    return {"parameters": params, "gradients": params, "Adam state": adam, "NorMuon state": normuon,
            "FP8 weight copies": fp8}


def activation_bytes_per_token(args: T.Hyperparameters, tokens: int) -> float:
    """Bytes autograd saves per token in the layer stack (final_hidden) on this CPU, bf16 weights,
    the speedrun's table and width with a small vocabulary (distinct storages counted once)."""
    small = dataclasses.replace(args, vocab_size=1000, padded_vocab_size=1024, ngram_rows=1024)
    torch.manual_seed(0)
    model = T.GPT(small, 1)
    ids = torch.randint(0, 1000, (tokens,))
    cu = torch.tensor([0, tokens // 3, tokens // 2] + [tokens] * 5, dtype=torch.int32)
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        T.final_hidden(model, ids, cu, T.bigram_hash(ids, small.ngram_rows))
    return sum(n for ptr, n in seen.items() if ptr not in params) / tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world_size", type=int, default=8)
    ap.add_argument("--measure_tokens", type=int, default=2048)
    a = ap.parse_args(argv)
    args = T.Hyperparameters()
    with torch.device("meta"):
        model = T.GPT(args, a.world_size)
    stages = ("stage 1", "stage 2", "stage 3", "extension")
    batch = [row.batch_tokens for row in args.stages]
    per_token = [flops_per_token(args, model, s) for s in range(4)]
    print("FLOPs of one training step (all ranks), by component; GFLOP per token in brackets")
    print(f"{'component':<30}" + "".join(f"{s:>22}" for s in stages))
    for name in per_token[0]:
        print(f"{name:<30}" + "".join(f"{per_token[s][name] * batch[s] / 1e12:>11.1f} TF ({per_token[s][name] / 1e9:.3f})"
                                      for s in range(4)))
    opt = optimizer_flops(model)
    print(f"{'NorMuon (Polar Express)':<30}" + "".join(f"{opt / 1e12:>11.1f} TF{'':>9}" for _ in range(4)))
    totals = [sum(p.values()) * batch[s] + opt for s, p in enumerate(per_token)]
    print(f"{'total':<30}" + "".join(f"{t / 1e12:>11.1f} TF{'':>9}" for t in totals))
    bounds = T.stage_bounds(args)
    steps = [hi - lo for lo, hi in zip(bounds, bounds[1:])]  # 423, 424, 423, 15
    run = sum(t * n for t, n in zip(totals, steps))
    print(f"whole run (1285 steps): {run / 1e15:.1f} PFLOP; at {a.world_size} x 989 TFLOP/s (H100 bf16 dense) "
          f"that is {run / (a.world_size * 989e12):.1f} s of peak compute")

    print(f"\nMemory per rank ({a.world_size} ranks), GiB")
    for name, b in state_bytes(model, a.world_size).items():
        print(f"  {name:<28}{b / GIB:8.2f}")
    act = activation_bytes_per_token(args, a.measure_tokens)
    print(f"  activations of the layer stack: {act / 1024:.1f} KiB per token (measured, CPU path, "
          f"{a.measure_tokens} tokens)")
    for s in range(3):
        tokens = args.stages[s].batch_tokens // a.world_size // max(1, args.micro_batches // a.world_size)
        head = tokens * args.padded_vocab_size * 2 * 2  # bf16 logits and their gradient
        print(f"  {stages[s]}: {tokens} tokens per micro-batch: layer stack {act * tokens / GIB:.2f},"
              f" logits + gradient {head / GIB:.2f}")


if __name__ == "__main__":
    main()
