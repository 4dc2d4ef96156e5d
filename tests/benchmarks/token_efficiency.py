"""How much validation loss the recipe buys per training token, against the classic GPT-2 recipe,
and what each component of the recipe contributes.

    python tests/benchmarks/token_efficiency.py                      # recipe vs classic, 2M tokens, tiny Shakespeare
    python tests/benchmarks/token_efficiency.py --train 'data/NAME/NAME_train_*.bin' \\
        --val 'data/NAME/NAME_val_*.bin' --tokens 5000000            # any other shards
    python tests/benchmarks/token_efficiency.py --ablate             # one recipe run per switched-off component
    python tests/benchmarks/token_efficiency.py --smoke              # a few steps of each (the test suite runs this)

The two sides can train in separate processes (e.g. one per core, OMP_NUM_THREADS=1) and be joined later:
    python tests/benchmarks/token_efficiency.py --run recipe --save DIR &
    python tests/benchmarks/token_efficiency.py --run classic --save DIR; wait
    python tests/benchmarks/token_efficiency.py --load DIR          # the table and the ratio

Recipe: train_gpt.train() itself (model, NorMuon + Adam, loader, schedule, every component) at the
--preset model size (demo by default), with num_iterations chosen so that the whole schedule, extension
included, consumes --tokens training tokens. Its validation losses are read back from its run log.

Classic: GPT-2 as published, written small and plain below at the same depth and width: learned
absolute positions, pre-LayerNorm blocks, GELU MLP, full causal attention over fixed-length windows of
the token stream, tied embeddings, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear
warm-up then cosine decay to 10%, gradient clipping at 1.0, constant batch size.

Both see the same shards and the same token budget and are scored on the same validation tokens (the
first val_tokens of the val shards; mean next-token cross-entropy). The ratio printed is
    tokens the recipe needs to reach the classic recipe's best val loss / tokens the classic recipe needed
using the best (not the last) classic loss, because on a small corpus both eventually overfit.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import train_gpt as T  # noqa: E402

DEFAULT_TOKENS = 2_000_000
SPEEDRUN = T.Hyperparameters()  # the recipe's learning rates default to the speedrun's
# Ablations on a CPU: a row of ~50k tokens (two steps per stage of the demo schedule, scored on 8k val
# tokens) took ~70 s on one core, so the 14 rows fit in under 30 minutes on 2 cores with room to spare.
# On a GPU the comparison budget is affordable.
ABLATE_CPU_TOKENS = 49_152
ABLATE_CPU_VAL_TOKENS = 8_192
SMOKE_TOKENS = 3_072

# (component, Hyperparameters overrides that switch it off). A callable gets the base args.
ABLATIONS: list[tuple[str, object]] = [
    ("full recipe", {}),
    ("full recipe, seed 1 (noise)", {"seed": 1}),
    ("NorMuon -> Muon (no variance reduction)", {"matrix_optimizer": "muon"}),
    ("NorMuon -> AdamW on the matrices", {"matrix_optimizer": "adamw"}),
    ("Polar Express -> Gram Newton-Schulz", {"orthogonalizer": "gram_newton_schulz"}),
    ("multi-token prediction", {"mtp": False}),
    ("prefix-token loss", {"prefix_loss": False}),
    ("value embeddings", {"value_embeds": False}),
    ("bigram hash embedding", {"bigram_embed": False}),
    ("bigram sign table", {"bigram_signs": False}),
    ("smear", {"smear": False}),
    ("U-net skip", {"unet_skip": False}),
    ("post-loop MUDD (backout)", {"backout": False}),
    ("MUDD per-token coefficients", {"mudd": False}),
    ("paired-head attention", {"paired_heads": False}),
    ("XSA", {"xsa": False}),
    ("attention output gates", {"attn_gates": False}),
    ("DC", {"dc": False}),
    ("key offset", {"key_offset": False}),
    ("attention from h", {"from_h": False}),
    ("window schedule", {"window_schedule": False}),
    ("batch schedule", lambda a: {"stage_batch_tokens": (constant_batch(a),) * len(a.stage_batch_tokens)}),
]


def constant_batch(args: T.Hyperparameters) -> int:
    """The constant batch with the same total tokens as the staged one (stages have equal step counts),
    rounded to whole 128-token attention blocks per micro-batch."""
    quantum = args.micro_batches * 128
    mean = sum(args.stage_batch_tokens) / len(args.stage_batch_tokens)
    return max(quantum, int(round(mean / quantum)) * quantum)


# ------------------------------------------------------------------------------------------------
# learning curves
# ------------------------------------------------------------------------------------------------

def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First token count at which the curve (tokens, val loss) reaches `target`, interpolating linearly
    between evaluations; None if it never does."""
    for i, (tok, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(tok)
            t0, l0 = curve[i - 1]
            return t0 + (tok - t0) * (l0 - target) / (l0 - loss)
    return None


def loss_at(curve: list[tuple[int, float]], tokens: float) -> float:
    """Validation loss at a token count, linear between the two nearest evaluations."""
    xs, ys = [t for t, _ in curve], [v for _, v in curve]
    return float(np.interp(tokens, xs, ys))


def best_point(curve: list[tuple[int, float]]) -> tuple[int, float]:
    """(tokens, loss) of the lowest validation loss; the earliest one on ties."""
    return min(curve, key=lambda p: (p[1], p[0]))


def efficiency_ratio(recipe: list[tuple[int, float]], classic: list[tuple[int, float]]) -> float | None:
    """tokens the recipe needs to reach the classic's best val loss / tokens the classic needed."""
    tokens, loss = best_point(classic)
    reach = tokens_to_reach(recipe, loss)
    return None if reach is None or tokens == 0 else reach / tokens


# ------------------------------------------------------------------------------------------------
# the recipe: train_gpt.train() itself
# ------------------------------------------------------------------------------------------------

def schedule_tokens(args: T.Hyperparameters) -> list[int]:
    """Global batch tokens of every step of the schedule, extension included."""
    return [T.plan_step(args, s).batch_tokens for s in range(T.total_steps(args))]


def sized_for_tokens(base: T.Hyperparameters, tokens: int) -> T.Hyperparameters:
    """The preset with num_iterations (and the extension, in proportion) set so that the whole
    schedule consumes as close to `tokens` training tokens as whole steps allow."""
    ext_frac = base.extension_iterations / base.num_iterations

    def sized(n):
        return dataclasses.replace(base, num_iterations=n, extension_iterations=round(ext_frac * n))

    best = None
    for n in range(3, 1_000_000):
        total = sum(schedule_tokens(sized(n)))
        if best is None or abs(total - tokens) < best[0]:
            best = (abs(total - tokens), n)
        if total >= tokens:
            break
    return sized(best[1])


def recipe_args(preset: str, train: str, val: str, tokens: int, evals: int, val_tokens: int | None,
                device: torch.device, overrides: dict | None = None, log_dir: str = "") -> T.Hyperparameters:
    base = dataclasses.replace(T.Hyperparameters(), **T.PRESETS[preset])
    base = dataclasses.replace(base, train_files=train or base.train_files, val_files=val or base.val_files)
    if val_tokens:
        base = dataclasses.replace(base, val_tokens=val_tokens, val_seq_len=min(base.val_seq_len, val_tokens))
    overrides = dict(overrides or {})
    base = dataclasses.replace(base, **{k: v for k, v in overrides.items() if k == "stage_batch_tokens"})
    args = sized_for_tokens(base, tokens)
    steps = T.total_steps(args)
    return dataclasses.replace(
        args, **{k: v for k, v in overrides.items() if k != "stage_batch_tokens"},
        val_loss_every=max(1, steps // evals) if evals else 0,
        compile=device.type == "cuda", checkpoint_dir="", log_dir=log_dir or tempfile.mkdtemp(prefix="bench_logs_"))


VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+)", re.M)


def run_recipe(args: T.Hyperparameters, device: torch.device, run_id: str) -> list[tuple[int, float]]:
    """Train with train_gpt.train() (world size 1) and return its validation curve (tokens, loss)."""
    args = dataclasses.replace(args, run_id=run_id)
    d = T.DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    with contextlib.redirect_stdout(io.StringIO()):  # the loop's progress line; the log has the record
        T.train(args, d)
    text = open(os.path.join(args.log_dir, f"{run_id}.txt"), encoding="utf-8").read()
    done = np.cumsum([0] + schedule_tokens(args))
    curve = [(int(done[int(step)]), float(loss)) for step, _, loss in VAL_LINE.findall(text)]
    if not curve:
        raise RuntimeError(f"no 'step:N/M val_loss:X' lines in {args.log_dir}/{run_id}.txt")
    return curve


# ------------------------------------------------------------------------------------------------
# the classic GPT-2 recipe, small and plain
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ClassicConfig:
    vocab_size: int = 50304
    seq_len: int = 1024
    num_layers: int = 6
    model_dim: int = 256
    num_heads: int = 4
    mlp_hidden: int = 1024
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.05
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_tokens: int = 16_384


class ClassicBlock(nn.Module):
    def __init__(self, c: ClassicConfig):
        super().__init__()
        self.heads = c.num_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(c.model_dim), nn.LayerNorm(c.model_dim)
        self.attn_in = nn.Linear(c.model_dim, 3 * c.model_dim)
        self.attn_out = nn.Linear(c.model_dim, c.model_dim)
        self.fc = nn.Linear(c.model_dim, c.mlp_hidden)
        self.proj = nn.Linear(c.mlp_hidden, c.model_dim)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.attn_in(self.ln_1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, S, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, S, D))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class ClassicGPT(nn.Module):
    """GPT-2: token + learned position embeddings, pre-LN blocks, final LayerNorm, tied LM head."""

    def __init__(self, c: ClassicConfig):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab_size, c.model_dim)
        self.wpe = nn.Embedding(c.seq_len, c.model_dim)
        self.blocks = nn.ModuleList(ClassicBlock(c) for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.model_dim)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:  # GPT-2: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)
                std = 0.02 / math.sqrt(2 * c.num_layers) if name.endswith(("attn_out.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, 0.01 if name == "wpe.weight" else std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy of (B, S) inputs against (B, S) targets; logits without targets."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def classic_lr(c: ClassicConfig, step: int, steps: int) -> float:
    """Linear warm-up to c.lr, then cosine decay to c.min_lr_frac * c.lr at the last step."""
    warmup = max(1, round(c.warmup_frac * steps))
    if step < warmup:
        return c.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def token_stream(pattern: str, what: str) -> np.ndarray:
    return np.concatenate([T.read_shard(p).numpy() for p in T.find_shards(pattern, what)]).astype(np.int64)


@torch.no_grad()
def classic_eval(model: ClassicGPT, val: np.ndarray, val_tokens: int, device: torch.device) -> float:
    """Mean cross-entropy over the first val_tokens next-token predictions, in seq_len windows."""
    S = model.c.seq_len
    total = 0.0
    for s in range(0, val_tokens, S):
        n = min(S, val_tokens - s)
        chunk = torch.from_numpy(val[s:s + n + 1]).to(device)
        with autocast(device):
            total += model(chunk[None, :-1], chunk[None, 1:]).item() * n
    return total / val_tokens


def autocast(device: torch.device):
    """bf16 matmuls with fp32 master weights, as GPT-2 is trained today, on GPU and CPU alike (the recipe
    computes in bf16 too; fp32 matmuls would make the CPU comparison ~2x slower for nothing)."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


def run_classic(c: ClassicConfig, train: str, val: str, tokens: int, evals: int, val_tokens: int,
                device: torch.device, seed: int = 0) -> list[tuple[int, float]]:
    """Train the classic recipe on `tokens` tokens of the train stream; return (tokens, val loss)."""
    if c.batch_tokens % c.seq_len:
        raise SystemExit(f"error: --classic_batch_tokens {c.batch_tokens} must be a multiple of --classic_seq_len {c.seq_len}")
    torch.manual_seed(seed)
    stream, val_stream = token_stream(train, "train"), token_stream(val, "val")
    if len(val_stream) < val_tokens + 1:
        raise SystemExit(f"error: the val shards {val!r} hold {len(val_stream)} tokens, fewer than --val_tokens {val_tokens} + 1")
    model = ClassicGPT(c).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=c.betas)
    B = c.batch_tokens // c.seq_len
    steps = max(1, tokens // c.batch_tokens)
    every = max(1, steps // evals) if evals else steps
    curve, pos = [(0, classic_eval(model, val_stream, val_tokens, device))], 0
    for step in range(steps):
        rows = []
        for _ in range(B):  # consecutive windows of the stream, wrapping around at its end
            if pos + c.seq_len + 1 > len(stream):
                pos = 0
            rows.append(stream[pos:pos + c.seq_len + 1])
            pos += c.seq_len
        batch = torch.from_numpy(np.stack(rows)).to(device)
        for g in opt.param_groups:
            g["lr"] = classic_lr(c, step, steps)
        with autocast(device):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0 or step + 1 == steps:
            curve.append(((step + 1) * c.batch_tokens, classic_eval(model, val_stream, val_tokens, device)))
    return curve


# ------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------

def efficiency_table(recipe, classic, budget: int) -> str:
    lines = [f"{'train tokens':>14} {'recipe val loss':>16} {'classic val loss':>17}"]
    for frac in (0.125, 0.25, 0.5, 0.75, 1.0):
        tok = frac * budget
        lines.append(f"{tok:14,.0f} {loss_at(recipe, tok):16.4f} {loss_at(classic, tok):17.4f}")
    (rt, rl), (ct, cl) = best_point(recipe), best_point(classic)
    lines.append(f"{'best':>14} {rl:8.4f} @{rt:>7,} {cl:9.4f} @{ct:>7,}")
    return "\n".join(lines)


def save_curve(folder: str, name: str, curve: list[tuple[int, float]], meta: dict) -> None:
    """Write one learning curve as JSON (temporary file + rename: never a half-written curve)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"curve": curve, **meta}, f, indent=1)
    os.replace(path + ".tmp", path)


def load_curve(folder: str, name: str, budget: int) -> tuple[list[tuple[int, float]], dict]:
    path = os.path.join(folder, f"{name}.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: --load {folder}: no {name}.json; run --run {name} --save {folder} first") from None
    except ValueError as e:
        raise SystemExit(f"error: --load {folder}: {name}.json is not a saved curve ({e})") from None
    if data.get("tokens") != budget:
        raise SystemExit(f"error: --load {folder}: {name}.json was measured at --tokens {data.get('tokens')}, "
                         f"not {budget}; pass the same --tokens")
    return [(int(t), float(v)) for t, v in data["curve"]], data


def run_comparison(a, device: torch.device) -> float | None:
    """Train the recipe and/or the classic baseline (--run), keep their curves (--save), and when both
    curves are at hand (trained now or --load'ed) print the table and the ratio."""
    args = recipe_args(a.preset, a.train, a.val, a.tokens, a.evals, a.val_tokens, device, a.recipe_lrs, a.log_dir)
    val_tokens = args.val_tokens
    meta = {"tokens": a.tokens, "val_tokens": val_tokens, "preset": a.preset, "train": args.train_files,
            "val": args.val_files, "device": device.type, "recipe_muon_lr": args.muon_lr, "recipe_adam_lr": args.adam_lr}
    c = ClassicConfig(vocab_size=args.padded_vocab_size, seq_len=a.classic_seq_len, num_layers=args.num_layers,
                      model_dim=args.model_dim, num_heads=args.num_heads, mlp_hidden=args.mlp_hidden,
                      lr=a.classic_lr, batch_tokens=a.classic_batch_tokens)
    curves, seconds = {}, {}
    if a.load:
        for name in ("recipe", "classic"):
            curves[name], data = load_curve(a.load, name, a.tokens)
            seconds[name] = data.get("seconds", float("nan"))
    if a.run in ("both", "recipe") and not a.load:
        print(f"recipe: --preset {a.preset} {args.num_layers} layers x {args.model_dim}, {args.num_iterations}+"
              f"{args.extension_iterations} steps, {sum(schedule_tokens(args)):,} tokens, NorMuon lr {args.muon_lr:g}, "
              f"Adam lr {args.adam_lr:g}; train {args.train_files}", flush=True)
        t = time.perf_counter()
        curves["recipe"] = run_recipe(args, device, f"recipe_{os.getpid()}_{int(time.time())}")
        seconds["recipe"] = time.perf_counter() - t
    if a.run in ("both", "classic") and not a.load:
        print(f"classic: {c.num_layers} layers x {c.model_dim}, seq {c.seq_len}, batch {c.batch_tokens:,} tokens, "
              f"AdamW lr {c.lr:g}, {max(1, a.tokens // c.batch_tokens)} steps", flush=True)
        t = time.perf_counter()
        curves["classic"] = run_classic(c, args.train_files, args.val_files, a.tokens, a.evals, val_tokens, device, a.seed)
        seconds["classic"] = time.perf_counter() - t
    if a.save:
        for name, curve in curves.items():
            save_curve(a.save, name, curve, {**meta, "seconds": seconds[name]})
        print(f"curves saved in {a.save}")
    if len(curves) < 2:
        name = next(iter(curves))
        print(f"{name}: best val loss {best_point(curves[name])[1]:.4f} in {seconds[name]:.0f}s; "
              f"the ratio needs both curves: --load {a.save or 'DIR'} once the other half is saved there")
        return None
    recipe, classic = curves["recipe"], curves["classic"]
    print(f"\nvalidation loss on the first {val_tokens:,} val tokens (linear between evaluations; wall time "
          f"recipe {seconds['recipe']:.0f}s, classic {seconds['classic']:.0f}s on {device.type})")
    print(efficiency_table(recipe, classic, a.tokens))
    ratio = efficiency_ratio(recipe, classic)
    best_tok, best_loss = best_point(classic)
    if ratio is None:
        print(f"token-efficiency ratio: not reached (the recipe never got to the classic best {best_loss:.4f})")
    else:
        print(f"token-efficiency ratio: {ratio:.3f} (recipe reaches the classic best {best_loss:.4f} at "
              f"{ratio * best_tok:,.0f} tokens; classic needed {best_tok:,})")
    return ratio


def run_ablations(a, device: torch.device) -> list[tuple[str, float, float]]:
    only = [s.strip().lower() for s in a.only.split(",")] if a.only else None
    base = recipe_args(a.preset, a.train, a.val, a.tokens, 0, a.val_tokens, device, a.recipe_lrs, a.log_dir)
    print(f"ablations: --preset {a.preset}, {base.num_iterations}+{base.extension_iterations} steps, "
          f"{sum(schedule_tokens(base)):,} train tokens each, final val loss on {base.val_tokens:,} val tokens")
    rows, full = [], None
    for name, spec in ABLATIONS:
        if only and name != "full recipe" and not any(o in name.lower() for o in only):
            continue
        overrides = spec(base) if callable(spec) else spec
        args = recipe_args(a.preset, a.train, a.val, a.tokens, 0, a.val_tokens, device, {**a.recipe_lrs, **overrides}, a.log_dir)
        t = time.perf_counter()
        try:
            loss = run_recipe(args, device, f"ablate_{len(rows)}_{os.getpid()}_{int(time.time())}")[-1][1]
        except SystemExit as e:  # a diverging variant is a result, not a crash of the benchmark
            print(f"  {name}: stopped ({e})")
            loss = float("nan")
        seconds = time.perf_counter() - t
        full = loss if name == "full recipe" else full
        rows.append((name, loss, seconds))
        print(f"  {name:42s} {loss:8.4f}  ({seconds:.0f}s)", flush=True)
    print(f"\n{'switched off / replaced':42s} {'final val loss':>14s} {'delta vs full':>14s}")
    for name, loss, _ in rows:
        delta = "" if name == "full recipe" else f"{loss - full:+14.4f}"
        print(f"{name:42s} {loss:14.4f} {delta:>14s}")
    print("delta > 0: the component helps (the run without it is worse); compare with the seed-1 row for noise")
    return [(n, loss, loss - full) for n, loss, _ in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="", help="train shard glob (default: the preset's, tiny Shakespeare)")
    ap.add_argument("--val", default="", help="val shard glob (default: the preset's)")
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"training tokens per run (default {DEFAULT_TOKENS:,}; --ablate on a CPU: {ABLATE_CPU_TOKENS:,}"
                         f" with {ABLATE_CPU_VAL_TOKENS:,} val tokens)")
    ap.add_argument("--preset", default="demo", choices=sorted(T.PRESETS), help="model size of both recipes")
    ap.add_argument("--evals", type=int, default=24, help="validation points per curve")
    ap.add_argument("--val_tokens", type=int, default=None, help="validation tokens (default: the preset's)")
    ap.add_argument("--muon_lr", type=float, default=SPEEDRUN.muon_lr,
                    help="recipe NorMuon lr (default: the speedrun's; the demo preset's higher rates suit only its 63 steps)")
    ap.add_argument("--adam_lr", type=float, default=SPEEDRUN.adam_lr, help="recipe Adam lr (default: the speedrun's)")
    ap.add_argument("--classic_lr", type=float, default=1e-3)
    ap.add_argument("--classic_seq_len", type=int, default=1024)
    ap.add_argument("--classic_batch_tokens", type=int, default=16_384)
    ap.add_argument("--run", default="both", choices=("both", "recipe", "classic"),
                    help="train only one side of the comparison (two processes can then share the machine)")
    ap.add_argument("--save", default="", help="write the learning curves here as JSON")
    ap.add_argument("--load", default="", help="print the comparison from curves saved with --save (no training)")
    ap.add_argument("--ablate", action="store_true", help="run the ablation table instead of the comparison")
    ap.add_argument("--only", default="", help="--ablate: comma-separated substrings of component names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log_dir", default="", help="keep the recipe's run logs here (default: a temporary directory)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--smoke", action="store_true", help="a few steps of the test preset (checks the tooling only)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available; use --device cpu")
    device = torch.device("cuda" if a.device != "cpu" and torch.cuda.is_available() else "cpu")
    if a.smoke:
        a.preset, a.evals, a.classic_seq_len, a.classic_batch_tokens = "test", 1, 128, 1024
        a.tokens, a.val_tokens = a.tokens or SMOKE_TOKENS, a.val_tokens or 1024
    if a.ablate and device.type == "cpu" and a.tokens is None:
        a.tokens, a.val_tokens = ABLATE_CPU_TOKENS, a.val_tokens or ABLATE_CPU_VAL_TOKENS
    a.tokens = a.tokens or DEFAULT_TOKENS
    a.recipe_lrs = {"muon_lr": a.muon_lr, "adam_lr": a.adam_lr}
    if a.tokens < 1 or a.evals < 0:
        raise SystemExit("error: --tokens must be >= 1 and --evals >= 0")
    with tempfile.TemporaryDirectory(prefix="bench_logs_") as tmp:
        a.log_dir = a.log_dir or tmp
        if a.ablate:
            run_ablations(a, device)
        else:
            run_comparison(a, device)


if __name__ == "__main__":
    main()
