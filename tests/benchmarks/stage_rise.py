"""Why the recipe's validation loss rises within stage 2 on tiny Shakespeare (records/README.md, "Why the loss rose within stage 2 on tiny Shakespeare").

The 2M-token benchmark schedule (demo preset, 231+9 steps) on tiny Shakespeare reaches 5.21 at step 110,
rises to 5.45 at step 150 and drops to 4.94 at step 160, right after stage 3 begins (the table in records/README.md). Stage 3 changes
several things at once (batch, windows, the lr multiplier, the untie), and the corpus repeats. Each
variant below trains that schedule up to --stop with one of them changed:

    python tests/benchmarks/stage_rise.py --variant as_is --save DIR     # one variant per process
    python tests/benchmarks/stage_rise.py --plot DIR                     # the curves in one plot + table

Variants:
    as_is        the benchmark's run
    sympy        the same schedule on the SymPy source corpus (data/sympy_source.py): under one epoch
    no_untie     embedding and head stay tied all run
    no_growth    stage 3 keeps stage 2's batch and windows (and the extension stage 2's windows)
    no_batch_growth  stage 3 keeps stage 2's batch; the windows grow as in the recipe
The table's walks column counts the loader's passes over tiny Shakespeare's documents, and its seen
column the share of the train text ever trained on, by each step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import token_efficiency as TE  # noqa: E402

T = TE.T
SYMPY = ("data/sympy/sympy_train_*.bin", "data/sympy/sympy_val_*.bin")
SCHEDULE_TOKENS = 2_000_000  # the 2M-token benchmark schedule whose curve rose (231+9 steps)
VARIANTS = ("as_is", "sympy", "no_untie", "no_growth", "no_batch_growth")


class Stop(Exception):
    pass


def variant_args(name: str, evals_every: int, val_tokens: int, preset: str = "demo",
                 tokens: int = SCHEDULE_TOKENS) -> T.Hyperparameters:
    train, val = SYMPY if name == "sympy" else ("", "")
    args = TE.recipe_args(preset, train, val, tokens, 0, val_tokens, torch.device("cpu"),
                          {"muon_lr": TE.SPEEDRUN.muon_lr, "adam_lr": TE.SPEEDRUN.adam_lr})
    if name == "no_growth":
        s = args.stages
        args = dataclasses.replace(args, stages=T.restaged(s, batch_tokens=(s[0].batch_tokens,) + (s[1].batch_tokens,) * 3,
                                                           windows=(s[0].windows,) + (s[1].windows,) * 3))
    if name == "no_batch_growth":
        s = args.stages
        args = dataclasses.replace(args, stages=T.restaged(s, batch_tokens=(s[0].batch_tokens,) + (s[1].batch_tokens,) * 3))
    if name == "no_untie":  # no row unties: untie_step is then a step past the run
        args = dataclasses.replace(args, stages=T.restaged(args.stages, untie=(False,) * len(args.stages)))
    return dataclasses.replace(args, val_loss_every=evals_every)


def coverage_by_step(args: T.Hyperparameters, steps: int) -> list[tuple[float, float]]:
    """(document walks, fraction of the train tokens trained on at least once) after each step. The
    loader (the record's) keeps a document's first max_doc_len tokens and cuts the last document of a
    micro-batch to fit, dropping the rest of both; which tokens it hands out is followed here."""
    loader = T.DocumentLoader(args.train_files, args.ngram_rows)
    shards = [T._load_shard_with_index(f) for f in loader.files]
    n_docs = sum(len(starts) for _, starts in shards)
    seen = [np.zeros(len(tokens), bool) for tokens, _ in shards]
    out, walked = [], 0
    for step in range(steps):
        plan = T.plan_step(args, step)
        for _ in range(args.micro_batches):
            need = plan.batch_tokens // args.micro_batches + 1
            while need > 0:
                tokens, loader.shard, loader.doc = loader._next_document(loader.shard, loader.doc)
                take = len(tokens[:min(plan.max_doc_len, need)])
                shard, doc = loader.shard, loader.doc - 1  # the document just taken (maybe in the next shard)
                start = shards[shard][1][doc]
                seen[shard][start:start + take] = True
                need -= take
                walked += 1
        out.append((walked / n_docs, sum(int(s.sum()) for s in seen) / sum(len(s) for s in seen)))
    return out


def run_variant(name: str, stop: int, every: int, val_tokens: int, out_dir: str, smoke: bool = False) -> None:
    args = variant_args(name, every, val_tokens, *(("test", TE.SMOKE_TOKENS) if smoke else ()))
    evaluate, calls = T.evaluate, [0]

    def counted(*a, **k):  # validation runs at steps 0, every, 2 every, ...: stop after --stop
        if calls[0] * every > stop:
            raise Stop
        calls[0] += 1
        return evaluate(*a, **k)

    T.evaluate = counted
    log_dir = os.path.join(out_dir, f"logs_{name}")
    os.makedirs(log_dir, exist_ok=True)
    args = dataclasses.replace(args, log_dir=log_dir)
    t = time.perf_counter()
    try:
        TE.run_recipe(args, torch.device("cpu"), name)
    except Stop:
        pass
    text = open(os.path.join(log_dir, f"{name}.txt"), encoding="utf-8").read()
    curve = [(int(s), float(v)) for s, _, v in TE.VAL_LINE.findall(text)]
    TE.save_curve(out_dir, name, curve, {"variant": name, "stop": stop, "every": every, "val_tokens": val_tokens,
                                         "seconds": time.perf_counter() - t, "train": args.train_files,
                                         "stage_starts": list(T.stage_bounds(args)[1:-2]), "untie_step": T.untie_step(args)})
    print(f"{name}: {len(curve)} validations up to step {curve[-1][0]} in {time.perf_counter() - t:.0f}s")


def plot(out_dir: str, write: bool = True) -> None:
    runs = {}
    for name in VARIANTS:
        path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                runs[name] = json.load(f)
    if not runs:
        raise SystemExit(f"error: --plot {out_dir}: no variant curves there; run --variant NAME --save {out_dir} first")
    any_run = next(iter(runs.values()))
    stop = max(r["curve"][-1][0] for r in runs.values())
    epochs = coverage_by_step(variant_args("as_is", 1, 1024), stop + 1)
    flat = coverage_by_step(variant_args("no_batch_growth", 1, 1024), stop + 1)
    table(runs, epochs, flat)
    if write:
        draw(runs, epochs, flat, any_run, os.path.join(out_dir, "stage_rise.png"))


LABELS = {"as_is": "tiny Shakespeare, as the benchmark runs", "sympy": "SymPy corpus (under one epoch)",
          "no_untie": "tiny Shakespeare, no untie", "no_growth": "tiny Shakespeare, stage 3 keeps stage 2's batch and windows",
          "no_batch_growth": "tiny Shakespeare, stage 3 keeps stage 2's batch"}


def draw(runs: dict, epochs: list, flat: list, any_run: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in runs.items():
        ax.plot(*zip(*r["curve"]), marker=".", label=LABELS[name])
    seen = ax.twinx()
    seen.plot(range(1, len(epochs) + 1), [100 * f for _, f in epochs], color="black", alpha=0.35,
              label="tiny Shakespeare text seen (%), recipe")
    seen.plot(range(1, len(flat) + 1), [100 * f for _, f in flat], color="black", alpha=0.35, linestyle="--",
              label="... stage 3 keeping stage 2's batch")
    seen.set_ylabel("share of the train text trained on so far (%)")
    seen.set_ylim(0, 100)
    seen.legend(loc="upper right")
    for s in any_run["stage_starts"]:
        ax.axvline(s, color="gray", linestyle="--", alpha=0.6)
    wraps = [s for s in range(1, len(epochs)) if int(epochs[s][0]) > int(epochs[s - 1][0])]
    for s in wraps:
        ax.axvline(s, color="tab:red", linestyle=":", alpha=0.4)
    ax.set_xlabel("step (dashed: stage starts; dotted: tiny Shakespeare loader wraps to its first document)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=7.0)
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    fig.savefig(out + ".tmp.png", dpi=110, bbox_inches="tight")
    os.replace(out + ".tmp.png", out)
    print(f"plot: {out}")


def table(runs: dict, epochs: list[tuple[float, float]], flat: list[tuple[float, float]]) -> None:
    steps = sorted({s for r in runs.values() for s, _ in r["curve"]})
    print("walks: passes of the loader over tiny Shakespeare's 270 documents; seen: share of its train tokens "
          "trained on at least once, by the recipe and with stage 2's batch kept in stage 3")
    print(f"{'step':>5} {'walks':>6} {'seen':>5} {'kept':>5} " + " ".join(f"{n:>9}" for n in runs))
    for s in steps:
        row = [dict(r["curve"]).get(s) for r in runs.values()]
        (walks, seen), kept = (epochs[s - 1], flat[s - 1][1]) if s else ((0.0, 0.0), 0.0)
        print(f"{s:5d} {walks:6.2f} {seen:5.0%} {kept:5.0%} "
              + " ".join(f"{v:9.4f}" if v is not None else f"{'':9}" for v in row))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--save", default="", help="folder for the curve (JSON) and the run log")
    ap.add_argument("--stop", type=int, default=180, help="last validated step")
    ap.add_argument("--every", type=int, default=5, help="validate every this many steps")
    ap.add_argument("--val_tokens", type=int, default=16_384)
    ap.add_argument("--plot", default="", help="plot and tabulate the curves saved in this folder")
    ap.add_argument("--table", default="", help="tabulate the curves saved in this folder")
    ap.add_argument("--smoke", action="store_true", help="the test preset for a few steps (checks the tooling only)")
    a = ap.parse_args(argv)
    if a.plot or a.table:
        return plot(a.plot or a.table, write=bool(a.plot))
    if not a.variant or not a.save:
        ap.error("give --variant NAME --save DIR, or --plot DIR")
    run_variant(a.variant, a.stop, a.every, a.val_tokens, a.save, a.smoke)


if __name__ == "__main__":
    main()
