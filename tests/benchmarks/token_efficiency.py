"""How much validation loss the recipe buys per training token, against a tuned classic GPT-2 recipe,
with seed spread; and what each component of the recipe contributes (records/README.md, "Token efficiency").

Every run is saved as one JSON (curve + configuration) in a results folder (--save), so runs can be
split over processes (one per core, OMP_NUM_THREADS=1), resumed (a saved run is not trained again; a
run stopped midway continues from the state it keeps in DIR/partial/: a classic's at every evaluation,
every 10 minutes and on Ctrl-C or kill, the recipe's train_gpt checkpoints, 32 over the run) and
joined (--load prints every table the folder supports and plots the curves):

    D='--train data/sympy/sympy_train_*.bin --val data/sympy/sympy_val_*.bin --tokens 500000 --save DIR'
    python tests/benchmarks/token_efficiency.py $D --run search        # classic: lr x batch x context grid, seed 0
    python tests/benchmarks/token_efficiency.py $D --run recipe --seeds 0,1,2
    python tests/benchmarks/token_efficiency.py $D --run classic --seeds 1,2   # the search winner, more seeds
    python tests/benchmarks/token_efficiency.py $D --ablate --seeds 0,1 --only dc,xsa
    python tests/benchmarks/token_efficiency.py --load DIR             # floor, search, seeds, ratio, ablations; DIR/curves.png
    python tests/benchmarks/token_efficiency.py --load DIR --compare A,B   # two saved runs, evaluation by evaluation
    python tests/benchmarks/token_efficiency.py $D --seeds 0,1,2 --floor   # the validation set and floors only
    python tests/benchmarks/token_efficiency.py --smoke                # a few steps of each (the test suite runs this)

Recipe: train_gpt.train() itself (model, NorMuon + Adam, loader, schedule, every component) at the
--preset model size (demo by default; --model_dim widens both sides), with num_iterations chosen so
that the whole schedule, extension included, consumes --tokens training tokens. Its validation losses
are read back from its run log.

Classic: GPT-2 as published, written small and plain below at the same depth and width: learned
absolute positions, pre-LayerNorm blocks, GELU MLP, full causal attention over fixed-length windows of
the token stream, tied embeddings, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear
warm-up then cosine decay to 10%, gradient clipping at 1.0, constant batch size. On a CPU its matmuls
run in the recipe's --cpu_dtype (auto: the classic runs' dtype already in the folder, else the faster of
bf16 and fp32 on this CPU; bf16 autocast costs ~13x on an AVX2-only CPU); on GPUs in bf16. --run search trains
the grid of --search_lr x --search_batch x --search_seq; --run classic then uses the winner (lowest
best val loss) found in the same folder, or in --classic_from, unless --classic_* flags say otherwise.

Both read the same shards, written by this script into a temporary folder: the validation documents
(--val_set even, the default: documents chosen evenly over every val shard until they hold --val_tokens,
65,536 by default, or the whole held-out split when it holds fewer; --val_set first: the first
val_tokens tokens, as runs saved before the choice was recorded) and, per seed, a copy of the training
shards with the documents permuted by that seed (--train_order shuffled, the default, seed 0 included;
--train_order file keeps the shards' order for every seed). So a seed sets the initialisation and the
data order of both sides, and both are scored on the same tokens (mean next-token cross-entropy).

Beside every table: the count-model floor on those validation tokens, fitted on the first --tokens
training tokens the runs read (unigram with add-one smoothing; bigram interpolated with it, its weight
chosen on the last tenth of those tokens). The ratio, per seed:
    tokens the recipe needs to reach the tuned classic's best val loss / tokens the classic needed
(the best, not the last, classic loss: on a small corpus both eventually overfit); then the mean,
standard deviation and range over seeds. It is stated only when the tuned classic's best is at least
FLOOR_MARGIN (0.3 nats) below the bigram floor: a baseline that a table of token-pair counts matches
is measured at the start of training, where any ratio says little. Ablations: the final val loss of
each switched-off component over seeds, its delta against the full recipe's seeds and Welch's t-test;
the per-seed deltas against the full recipe's run of the same seed, their mean, the paired t-test and
its Holm adjustment over the rows shown (records/summarize.py).

Every saved run records the commit (git rev-parse HEAD, -dirty with uncommitted changes to tracked
files), its command line, its validation set and training order, the floor, and its log in DIR/logs/
(committed with the results): the recipe's train_gpt log, and a classic run's printed output as it
goes, each sitting under a line with its date, commit, threads and command.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
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

DEFAULT_TOKENS = 500_000
SPEEDRUN = T.Hyperparameters()  # the recipe's learning rates default to the speedrun's
SMOKE_TOKENS = 3_072
# A ratio against a baseline that is not this far (nats) below the count bigram on the same validation
# tokens measures the first steps of training, not what either recipe learns.
FLOOR_MARGIN = 0.3
EVEN_VAL_TOKENS = 65_536  # --val_set even: enough documents that one file's style cannot dominate
HELDOUT_FRACTION = 0.1    # the tail of the floor's training tokens that chooses the bigram's weight
GPT2_VOCAB = 50_257       # token ids a GPT-2 tokenizer emits: the add-one unigram's support
SHARD_TOKENS = 100_000_000  # at most this many tokens per written training shard (FineWeb's shard size)
VAL_SETS = ("even", "first", "tune")
TRAIN_ORDERS = ("shuffled", "file")

# (component, what switches it off): Hyperparameters overrides (a dict), or an edit of the rows, a
# function of the preset's args applied before the run is sized to its token budget (train_gpt's
# ABLATIONS by name, and the constant batch).
ABLATIONS: list[tuple[str, object]] = [
    ("full recipe", {}),
    ("NorMuon -> Muon (no variance reduction)", {"matrix_optimizer": "muon"}),
    # AdamW on the banks, stepped every step, over a grid of its learning rate (x the Adam lr): the
    # best row is the comparison (runs saved before the grid, "NorMuon -> AdamW on the matrices",
    # stepped the banks on odd steps at x0.25). x0.0625: at 12M tokens x0.125 beat x0.25, the short
    # regime's best, so the grid reaches below it
    *((f"NorMuon -> AdamW on the matrices, bank lr x{m:g}", {"matrix_optimizer": "adamw", "adamw_bank_lr_mul": m})
      for m in (0.0625, 0.125, 0.25, 0.5, 1.0)),
    ("Polar Express -> Gram Newton-Schulz", {"orthogonalizer": "gram_newton_schulz"}),
    ("multi-token prediction", lambda a: T.ablated(a, ["mtp"])),
    ("prefix-token loss", lambda a: T.ablated(a, ["prefix_loss"])),
    ("value embeddings", {"value_embeds": False}),
    ("bigram hash embedding", {"bigram_embed": False}),
    ("bigram sign table", {"bigram_signs": False}),
    ("smear", {"smear": False}),
    ("U-net skip", {"unet_skip": False}),
    ("post-loop MUDD (backout)", {"backout": False}),
    ("MUDD per-token coefficients", {"mudd": False}),
    ("paired-head attention", lambda a: T.ablated(a, ["paired_heads"])),
    ("XSA", lambda a: T.ablated(a, ["xsa"])),
    ("attention output gates", lambda a: T.ablated(a, ["attn_gates"])),
    ("DC", lambda a: T.ablated(a, ["dc"])),
    ("key offset", lambda a: T.ablated(a, ["key_offset"])),
    ("attention from h", lambda a: T.ablated(a, ["from_h"])),
    ("window schedule", lambda a: T.ablated(a, ["window_schedule"])),
    ("batch schedule", lambda a: dataclasses.replace(
        a, stages=T.restaged(a.stages, batch_tokens=(constant_batch(a),) * len(a.stages)))),
]


def constant_batch(args: T.Hyperparameters) -> int:
    """The constant batch with the same total tokens as the scheduled stages (weighted by their shares),
    rounded to whole 128-token attention blocks per micro-batch."""
    quantum = args.micro_batches * 128
    mean = sum(row.share * row.batch_tokens for row in args.stages[:-1])
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


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The seeds' curves averaged point by point: at every evaluation token count of any of them (up to
    the shortest curve's end), the mean of each curve's loss there (linear between its evaluations)."""
    end = min(c[-1][0] for c in curves)
    grid = sorted({t for c in curves for t, _ in c if t <= end})
    return [(t, sum(loss_at(c, t) for c in curves) / len(curves)) for t in grid]


def mean_curve_ratio(recipe: list[list[tuple[int, float]]], classic: list[list[tuple[int, float]]],
                     resamples: int = 1000) -> tuple[float | None, list[float]]:
    """efficiency_ratio of the seed-mean curves, and its bootstrap over seeds: the same resampled seeds
    (with replacement, a fixed generator) for both sides, which share a seed's data order; resamples
    whose mean recipe curve never reaches the classic's best are left out."""
    ratio = efficiency_ratio(mean_curve(recipe), mean_curve(classic))
    rng, n, boot = np.random.default_rng(0), len(recipe), []
    for _ in range(resamples if n > 1 else 0):
        pick = rng.integers(0, n, n)
        r = efficiency_ratio(mean_curve([recipe[i] for i in pick]), mean_curve([classic[i] for i in pick]))
        if r is not None:
            boot.append(r)
    return ratio, boot


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


def model_args(preset: str, model_dim: int = 0) -> T.Hyperparameters:
    """The preset's hyperparameters at width model_dim (0: the preset's own): heads of the preset's
    head size and an MLP four times as wide. Both sides take their depth and width from these."""
    base = dataclasses.replace(T.Hyperparameters(), **T.PRESETS[preset])
    if not model_dim or model_dim == base.model_dim:
        return base
    heads, rest = divmod(model_dim, base.head_dim)
    if model_dim < 1 or rest or heads % 2:
        raise SystemExit(f"error: --model_dim {model_dim} must be an even multiple of the --preset {preset} head "
                         f"size ({base.head_dim}): {2 * base.head_dim}, {4 * base.head_dim}, ...")
    return dataclasses.replace(base, model_dim=model_dim, num_heads=heads, mlp_hidden=4 * model_dim)


def recipe_args(preset: str, train: str, val: str, tokens: int, evals: int, val_tokens: int | None,
                device: torch.device, overrides: dict | None = None, log_dir: str = "",
                edit=None, model_dim: int = 0) -> T.Hyperparameters:
    """The preset (at width model_dim when given) sized to `tokens`, with `edit` (args -> args: rows
    changed, e.g. an ablation) applied before sizing (a changed batch changes the step count) and
    `overrides` after. Without log_dir the run logs go where the preset's do (callers that train set
    their own)."""
    base = model_args(preset, model_dim)
    base = dataclasses.replace(base, train_files=train or base.train_files, val_files=val or base.val_files)
    if val_tokens:
        base = dataclasses.replace(base, val_tokens=val_tokens, val_seq_len=min(base.val_seq_len, val_tokens))
    if edit is not None:
        base = edit(base)
    args = sized_for_tokens(base, tokens)
    steps = T.total_steps(args)
    return dataclasses.replace(
        args, **dict(overrides or {}),
        val_loss_every=max(1, steps // evals) if evals else 0,
        compile=device.type == "cuda", checkpoint_dir="", log_dir=log_dir or args.log_dir)


VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+)", re.M)
CPU_DTYPE_LINE = re.compile(r"^cpu dtype (bf16|fp32) \(", re.M)  # train_gpt.compute_dtype's log line


# A recipe run with a state folder checkpoints this many times (train_gpt's --save_every), keeping the newest
# RECIPE_CHECKPOINTS_KEPT: about every 10 minutes of a 5-hour run on a 2-core CPU, so a stop loses little.
RECIPE_CHECKPOINTS = 32
RECIPE_CHECKPOINTS_KEPT = 2
STEP_LINE = re.compile(r"^step:(\d+)/\d+ (?:val_loss:\S+ )?train_time:(\d+)ms", re.M)


def recipe_checkpoints(state_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every whole checkpoint train_gpt wrote under state_dir/<run_id>/ (a run_id per
    sitting), oldest first."""
    runs = [os.path.join(state_dir, run) for run in sorted(os.listdir(state_dir))]
    return sorted(c for run in runs if os.path.isdir(run) for c in T.whole_checkpoints(run))


def newest_checkpoint(state_dir: str) -> tuple[int, str]:
    """(step, path) of the newest whole checkpoint under state_dir ((0, "") when none)."""
    return max(recipe_checkpoints(state_dir), default=(0, ""))


def run_recipe(args: T.Hyperparameters, device: torch.device, run_id: str, state_dir: str = "",
               sitting: dict | None = None) -> dict:
    """Train with train_gpt.train() (world size 1). Returns {"curve": [(tokens, val loss)], "seconds": the
    last sitting's wall time plus each earlier sitting's training time up to the checkpoint the next one
    continued from, "sittings": [{"step": the step it started at, "log": its run log, **sitting}], "dtype":
    the compute dtype (bf16 on GPUs, on CPUs the first log's 'cpu dtype' line; a resumed sitting keeps the
    checkpoint's)}; the validation losses are read back from the run logs.

    With state_dir, train() checkpoints there RECIPE_CHECKPOINTS times over the run (--save_every, the
    newest RECIPE_CHECKPOINTS_KEPT kept), and a run that finds a checkpoint continues from the newest
    (--resume: bit for bit the run it would have been; train_gpt refuses a checkpoint of another
    configuration), the older ones deleted; SIGINT or SIGTERM makes train() checkpoint after the step
    in flight and exit; the curve joins every sitting's log."""
    sittings, start = [], 0
    if state_dir:
        os.makedirs(state_dir, exist_ok=True)
        book = os.path.join(state_dir, "sittings.json")
        if os.path.exists(book):
            with open(book, encoding="utf-8") as f:
                sittings = json.load(f)
            run_id = f"{run_id}_part{len(sittings) + 1}"  # a log of its own (logs are never overwritten)
        checkpoints = recipe_checkpoints(state_dir)
        start, resume = checkpoints[-1] if checkpoints else (0, "")
        if resume:
            print(f"  resuming at step {start} of {T.total_steps(args)} from {resume}", flush=True)
            for _, older in checkpoints[:-1]:  # earlier sittings' (this one keeps its own)
                shutil.rmtree(older)
        args = dataclasses.replace(args, resume=resume, checkpoint_dir=state_dir,
                                   save_every=max(1, T.total_steps(args) // RECIPE_CHECKPOINTS),
                                   keep_checkpoints=RECIPE_CHECKPOINTS_KEPT)
    args = dataclasses.replace(args, run_id=run_id)
    log = os.path.join(args.log_dir, f"{run_id}.txt")
    sittings = [*sittings, {"step": start, "log": os.path.abspath(log), **(sitting or {})}]
    if state_dir:
        save_json(book, sittings)
    t = time.perf_counter()
    d = T.DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the loop's progress line; the log has the record
            T.train(args, d)
    except SystemExit as e:  # a signal's stop (after train() saved a checkpoint) or a refusal
        if state_dir and isinstance(e.code, int) and e.code > 128:
            print(f"  stopped at step {newest_checkpoint(state_dir)[0]} of {T.total_steps(args)}; "
                  f"the same command continues from {state_dir}", flush=True)
        raise
    seconds = time.perf_counter() - t
    done = np.cumsum([0] + schedule_tokens(args))
    losses = {}
    for i, s in enumerate(sittings):  # a later sitting's evaluations replace an earlier one's (the same)
        text = open(s["log"], encoding="utf-8").read()
        until = sittings[i + 1]["step"] if i + 1 < len(sittings) else None
        losses.update({int(step): float(loss) for step, _, loss in VAL_LINE.findall(text)
                       if until is None or int(step) <= until})
        if until is not None:  # the training time up to the checkpoint the next sitting continued from
            seconds += next((int(ms) / 1000 for step, ms in STEP_LINE.findall(text) if int(step) == until), 0.0)
    if not losses:
        raise RuntimeError(f"no 'step:N/M val_loss:X' lines in {log}")
    dtype = CPU_DTYPE_LINE.search(open(sittings[0]["log"], encoding="utf-8").read()) if device.type == "cpu" else None
    return {"curve": [(int(done[step]), loss) for step, loss in sorted(losses.items())], "seconds": seconds,
            "sittings": sittings, "dtype": dtype.group(1) if dtype else "bf16" if device.type != "cpu" else None}


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
def classic_eval(model: ClassicGPT, val: np.ndarray, val_tokens: int, device: torch.device, dtype: str = "bf16") -> float:
    """Mean cross-entropy over the first val_tokens next-token predictions, in seq_len windows, computed
    in dtype (autocast)."""
    S = model.c.seq_len
    total = 0.0
    for s in range(0, val_tokens, S):
        n = min(S, val_tokens - s)
        chunk = torch.from_numpy(val[s:s + n + 1]).to(device)
        with autocast(device, dtype):
            total += model(chunk[None, :-1], chunk[None, 1:]).item() * n
    return total / val_tokens


def autocast(device: torch.device, dtype: str = "bf16"):
    """bf16: bf16 matmuls with fp32 master weights, as GPT-2 is trained today (and as the recipe computes
    on GPUs and on CPUs with fast bf16); fp32: no autocast, everything in the fp32 weights' dtype (the
    recipe's --cpu_dtype fp32, for CPUs where bf16 is emulated)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


CLASSIC_DTYPES = tuple(T.CPU_DTYPES)  # bf16, fp32
SAVED_BEFORE_DTYPE = "bf16"  # every classic run saved before its dtype was recorded computed in bf16 autocast


def classic_dtype_of(run_or_identity: dict) -> str:
    """The compute dtype a saved classic run (or resume state) used."""
    return run_or_identity.get("classic_dtype", run_or_identity.get("dtype", SAVED_BEFORE_DTYPE))


def slow_dtype_warning(name: str, c: ClassicConfig | T.Hyperparameters) -> str:
    """'' when this CPU runs the model's MLP matmul in `name` at least a quarter as fast as in the other
    CPU dtype, else a clause saying how much slower: a folder's (or a resumed state's) bf16 on a CPU without
    bf16 units (AVX2 only: ~90x slower) is told at the start, not when the first evaluation never comes."""
    rates, figures = T.cpu_dtype_rates(c.model_dim, c.mlp_hidden)
    fastest = max(rates, key=rates.get)
    if rates[name] * 4 >= rates[fastest]:
        return ""
    return (f"; WARNING: this CPU runs {name} {rates[fastest] / rates[name]:.0f}x slower than {fastest} ({figures}): "
            f"the run takes about that many times longer; in a new --save folder auto takes {fastest}")


def folder_dtype(side: str, cpu_dtype: str, used: list[str], folder: str,
                 c: ClassicConfig | T.Hyperparameters) -> tuple[str, str] | None:
    """--cpu_dtype against the dtypes `used` by the `side` runs already saved in folder: (dtype, why) when
    the flag or the folder settles it (auto: the folder's, so that runs compared in one folder compute
    alike), None when auto finds no saved run to follow. A forced dtype other than the folder's, or auto
    over a folder of two, stops with one line."""
    if cpu_dtype != "auto":
        if used and used != [cpu_dtype]:
            raise SystemExit(f"error: --save {folder} holds {side} runs computed in {', '.join(used)}, not --cpu_dtype "
                             f"{cpu_dtype}; pass --cpu_dtype {used[0]} (or auto), or save into a new folder")
        return cpu_dtype, f"{side} dtype {cpu_dtype} (--cpu_dtype)"
    if len(used) == 1:
        return used[0], f"{side} dtype {used[0]} (auto: that of the {side} runs saved in {folder})" + slow_dtype_warning(used[0], c)
    if used:
        raise SystemExit(f"error: --save {folder} holds {side} runs computed in {' and '.join(used)}; "
                         "pass --cpu_dtype to say which the new runs use")
    return None


def classic_dtype(cpu_dtype: str, c: ClassicConfig, device: torch.device, folder: str, state_file: str = "") -> tuple[str, str]:
    """The classic's compute dtype and a line saying why. GPUs: bf16. CPUs: --cpu_dtype bf16 or fp32; auto:
    the dtype of the classic runs already saved in the results folder (a search compares like with like;
    another dtype there is refused), else that of the run's saved state, else the faster of the two at the
    model's MLP matmul, timed as train_gpt times it for the recipe (fastest_cpu_dtype)."""
    if device.type != "cpu":
        return "bf16", "classic dtype bf16 (GPU)"
    runs = read_runs(folder, "classic_", "--save") if os.path.isdir(folder) else {}
    settled = folder_dtype("classic", cpu_dtype, sorted({classic_dtype_of(r) for r in runs.values()}), folder, c)
    if settled:
        return settled
    if state_file and os.path.exists(state_file):
        with contextlib.suppress(Exception):  # run_classic reports an unreadable state in one line
            name = classic_dtype_of(torch.load(state_file, map_location="cpu", weights_only=False)["identity"])
            return name, f"classic dtype {name} (auto: that of the state it resumes, {state_file})" + slow_dtype_warning(name, c)
    name, why = T.fastest_cpu_dtype(c.model_dim, c.mlp_hidden)
    return name, f"classic dtype {why}"


def recipe_cpu_dtype(cpu_dtype: str, args: T.Hyperparameters, device: torch.device, folder: str,
                     state_dir: str = "") -> tuple[str, str]:
    """The --cpu_dtype the recipe's train_gpt.train() runs under, and a line saying why. GPUs: the flag
    (train_gpt computes in bf16). CPUs: a run resuming a checkpoint under auto keeps the flag the
    checkpoint was written under, ahead of the folder (unlike the classic's state: train_gpt refuses any
    other flag, and continues in the checkpoint's dtype); otherwise --cpu_dtype bf16 or fp32, auto: the
    dtype of the recipe runs (seeds, search points, ablations) already saved in the folder, else
    train_gpt's own timing at the start. A timed choice per run would let a native-bf16 CPU, where the two dtypes time close, mix them in one
    folder; runs saved before the dtype was recorded are not counted."""
    if device.type != "cpu":
        return cpu_dtype, "recipe dtype bf16 (GPU)"
    resume = newest_checkpoint(state_dir)[1] if state_dir and os.path.isdir(state_dir) else ""
    if resume and cpu_dtype == "auto":
        with contextlib.suppress(Exception):  # train_gpt reports an unreadable checkpoint in one line
            flag = torch.load(os.path.join(resume, "model.pt"), map_location="cpu", weights_only=False)["args"]["cpu_dtype"]
            return flag, f"recipe --cpu_dtype {flag} (that of the checkpoint it resumes, {resume})"
    runs = read_runs(folder, "", "--save") if os.path.isdir(folder) else {}
    used = sorted({r["recipe_dtype"] for r in runs.values() if "recipe_muon_lr" in r and r.get("recipe_dtype")})
    return folder_dtype("recipe", cpu_dtype, used, folder, args) or (
        "auto", "recipe dtype auto (timed by train_gpt at the start; later recipe runs in this folder follow it)")


RESUME_SECONDS = 600.0  # a classic run with a state file saves it at least this often, and at every evaluation


def stream_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:16]


def write_whole(path: str, write) -> None:
    """write(a temporary path), then rename it to path: an interruption leaves the previous file whole,
    never a half-written one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


def run_classic(c: ClassicConfig, train: str, val: str, tokens: int, evals: int, val_tokens: int,
                device: torch.device, seed: int = 0, state_file: str = "", sitting: dict | None = None,
                dtype: str = "bf16") -> dict:
    """Train the classic recipe on `tokens` tokens of the train stream, its matmuls in dtype (bf16
    autocast or fp32). Returns {"curve": [(tokens, val loss)], "seconds": training time over every
    sitting, "sittings": [{"step": the step it started at, **sitting}]}.

    With state_file, everything a step depends on (weights, AdamW moments, stream position, curve so far)
    is saved there at every evaluation, at least every RESUME_SECONDS and when SIGINT or SIGTERM asks the
    run to stop (it then exits after the step); a run that finds it continues from it, bit for bit the
    run it would have been, and removes it when done. A state saved by another configuration, budget,
    data or dtype is refused."""
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
    identity = {"config": dataclasses.asdict(c), "tokens": tokens, "evals": evals, "val_tokens": val_tokens,
                "seed": seed, "train_digest": stream_digest(stream), "val_digest": stream_digest(val_stream[:val_tokens + 1]),
                "dtype": dtype}
    start, pos, seconds, sittings, curve = 0, 0, 0.0, [], None
    if state_file and os.path.exists(state_file):
        try:
            state = torch.load(state_file, map_location=device, weights_only=False)
        except Exception as e:  # torch.load raises many types for a damaged file
            raise SystemExit(f"error: cannot resume from {state_file}: unreadable ({type(e).__name__}); "
                             "delete it to start the run again") from None
        saved_identity = {**state["identity"], "dtype": classic_dtype_of(state["identity"])}
        differ = [k for k in identity if saved_identity.get(k) != identity[k]]
        if differ:
            raise SystemExit(f"error: {state_file} was saved by another run ({', '.join(differ)} differ); "
                             "delete it to start this one from the beginning")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, pos, seconds, sittings, curve = (state[k] for k in ("step", "pos", "seconds", "sittings", "curve"))
        print(f"  resuming at step {start} of {steps} from {state_file}", flush=True)
    sittings = [*sittings, {"step": start, **(sitting or {})}]
    t0 = last_save = time.monotonic()

    def save(step):
        nonlocal last_save
        state = {"identity": identity, "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                 "pos": pos, "curve": curve, "sittings": sittings, "seconds": seconds + time.monotonic() - t0}
        write_whole(state_file, lambda tmp: torch.save(state, tmp))
        last_save = time.monotonic()

    if curve is None:
        curve = [(0, classic_eval(model, val_stream, val_tokens, device, dtype))]
    with T.StopOnSignal(bool(state_file)) as stop:  # Ctrl-C or kill: save, then exit
        for step in range(start, steps):
            rows = []
            for _ in range(B):  # consecutive windows of the stream, wrapping around at its end
                if pos + c.seq_len + 1 > len(stream):
                    pos = 0
                rows.append(stream[pos:pos + c.seq_len + 1])
                pos += c.seq_len
            batch = torch.from_numpy(np.stack(rows)).to(device)
            for g in opt.param_groups:
                g["lr"] = classic_lr(c, step, steps)
            with autocast(device, dtype):
                loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            evaluated = (step + 1) % every == 0 or step + 1 == steps
            if evaluated:
                curve.append(((step + 1) * c.batch_tokens, classic_eval(model, val_stream, val_tokens, device, dtype)))
                print(f"  step {step + 1:,} of {steps:,}: {curve[-1][0]:,} tokens, val {curve[-1][1]:.4f}, "
                      f"{seconds + time.monotonic() - t0:,.0f} s", flush=True)  # hours-long runs show progress
            if state_file and step + 1 < steps and (evaluated or stop.signum
                                                    or time.monotonic() - last_save >= RESUME_SECONDS):
                save(step + 1)
            if stop.signum and step + 1 < steps:
                print(f"  stopped at step {step + 1} of {steps}; the same command continues from {state_file}", flush=True)
                raise SystemExit(128 + stop.signum)  # the shell's status for a process the signal stopped
    return {"curve": curve, "seconds": seconds + time.monotonic() - t0, "sittings": sittings}


# ------------------------------------------------------------------------------------------------
# the data both sides read: validation documents, training order per seed, the count-model floor
# ------------------------------------------------------------------------------------------------

def split_documents(tokens: np.ndarray) -> list[np.ndarray]:
    """A token stream cut before every BOS: one piece per document (tokens before the first BOS, if any,
    are a document of their own)."""
    starts = np.flatnonzero(tokens == T.BOS_ID)
    return [d for d in np.split(tokens, starts[starts > 0]) if len(d)]


def shard_documents(pattern: str, what: str) -> list[list[np.ndarray]]:
    """The documents of every shard matching the glob, shard by shard in the loader's (sorted) order."""
    out = []
    for path in T.find_shards(pattern, what):
        try:
            out.append(split_documents(T.read_shard(path).numpy()))
        except T.ShardError as e:
            raise SystemExit(f"error: --{what} {pattern}: {e}") from None
    return out


def even_picks(num_docs: int, k: int) -> list[int]:
    """k document indices spread evenly over 0 .. num_docs - 1: the middle one of each of k equal strides."""
    return [(2 * j + 1) * num_docs // (2 * k) for j in range(k)]


@dataclasses.dataclass
class ValidationSet:
    """The val_tokens + 1 tokens whose val_tokens next-token predictions both sides are scored on."""
    tokens: np.ndarray
    val_tokens: int
    how: str                    # "even", "whole" (even, but the split holds fewer tokens) or "first"
    documents: tuple[int, int]  # (documents scored, documents in the val shards)
    shards: tuple[int, int]     # (val shards they come from, val shards)

    def digest(self) -> str:
        return stream_digest(self.tokens.astype("<u2"))

    def meta(self) -> dict:
        return {"val_tokens": self.val_tokens, "val_set": self.how, "val_documents": list(self.documents),
                "val_shards": list(self.shards), "val_digest": self.digest()}


def choose_validation(pattern: str, how: str, val_tokens: int, seq_len: int) -> ValidationSet:
    """--val_set even: the fewest documents, spread evenly over the document index of all val shards
    together, that hold val_tokens + 1 tokens (the last one cut); the whole split, cut to whole seq_len
    sequences, when it holds fewer. --val_set first: the first val_tokens + 1 tokens of the shards.
    --val_set tune: chosen the same way as even, but among the documents even does not score, for
    choosing learning rates and the like on tokens the reported figures are not scored on."""
    per_shard = shard_documents(pattern, "val")
    docs = [(s, d) for s, ds in enumerate(per_shard) for d in ds]
    lengths = np.array([len(d) for _, d in docs])
    total = int(lengths.sum())
    if how == "first":
        if total < val_tokens + 1:
            raise SystemExit(f"error: --val_tokens {val_tokens} needs {val_tokens + 1} tokens but the val shards "
                             f"{pattern!r} hold {total}; lower --val_tokens")
        touched = int(np.searchsorted(np.cumsum(lengths), val_tokens + 1) + 1)  # documents with a scored token
        stream = np.concatenate([d for _, d in docs[:touched]])[:val_tokens + 1]
        return ValidationSet(stream, val_tokens, "first", (touched, len(docs)),
                             (len({s for s, _ in docs[:touched]}), len(per_shard)))
    if total < val_tokens + 1:
        if how == "tune":
            raise SystemExit(f"error: --val_set tune: the val shards {pattern!r} hold {total} tokens, so --val_set even "
                             f"scores all of them at --val_tokens {val_tokens}; lower --val_tokens below half of that")
        n = (total - 1) // seq_len * seq_len or total - 1
        if n < 1:
            raise SystemExit(f"error: --val {pattern}: the val shards hold {total} token(s); nothing to score")
        stream = np.concatenate([d for _, d in docs])[:n + 1]
        return ValidationSet(stream, n, "whole", (len(docs), len(docs)), (len(per_shard), len(per_shard)))
    picks = fewest_even_picks(lengths, range(len(docs)), val_tokens + 1)
    if how == "tune":
        scored = set(picks)
        rest = [i for i in range(len(docs)) if i not in scored]
        if lengths[rest].sum() < val_tokens + 1:
            raise SystemExit(f"error: --val_set tune: the val documents that --val_set even does not score hold "
                             f"{int(lengths[rest].sum())} tokens, fewer than --val_tokens {val_tokens} + 1; lower --val_tokens")
        picks = fewest_even_picks(lengths, rest, val_tokens + 1)
    stream = np.concatenate([docs[i][1] for i in picks])[:val_tokens + 1]
    return ValidationSet(stream, val_tokens, how, (len(picks), len(docs)),
                         (len({docs[i][0] for i in picks}), len(per_shard)))


def fewest_even_picks(lengths: np.ndarray, candidates, need: int) -> list[int]:
    """The fewest of the candidate documents, spread evenly over them (even_picks), holding >= need tokens."""
    candidates = list(candidates)
    for k in range(1, len(candidates) + 1):
        picks = [candidates[j] for j in even_picks(len(candidates), k)]
        if lengths[picks].sum() >= need:
            return picks
    return candidates


def training_documents(pattern: str, order: str, seed: int) -> list[np.ndarray]:
    """The documents of the training shards: in the shards' order (--train_order file) or permuted by
    the seed (shuffled; seed 0 too, so no seed keeps whatever order the shards were written in)."""
    docs = [d for ds in shard_documents(pattern, "train") for d in ds]
    if order == "shuffled":
        docs = [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]
    return docs


def write_training_shards(docs: list[np.ndarray], folder: str) -> str:
    """Documents into folder/train_000001.bin ... (whole documents, at most SHARD_TOKENS per shard);
    returns their glob."""
    os.makedirs(folder, exist_ok=True)
    shard, size, n = [], 0, 1
    for d in docs:
        if shard and size + len(d) > SHARD_TOKENS:
            T.write_shard(os.path.join(folder, f"train_{n:06d}.bin"), np.concatenate(shard))
            shard, size, n = [], 0, n + 1
        shard.append(d)
        size += len(d)
    T.write_shard(os.path.join(folder, f"train_{n:06d}.bin"), np.concatenate(shard))
    return os.path.join(folder, "train_*.bin")


def count_probabilities(train: np.ndarray, prev: np.ndarray, nxt: np.ndarray,
                        vocab: int = GPT2_VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """Fitted on the token stream `train`, for each pair (prev[i], nxt[i]): the add-one unigram P(nxt)
    over `vocab` ids, and the maximum-likelihood bigram P(nxt | prev) (0 where prev never precedes a
    token in train)."""
    train, prev, nxt = (np.asarray(x, dtype=np.int64) for x in (train, prev, nxt))
    vocab = max(vocab, int(max(train.max(), prev.max(initial=0), nxt.max(initial=0))) + 1)
    unigram = (np.bincount(train, minlength=vocab)[nxt] + 1) / (len(train) + vocab)
    keys, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    want = prev * vocab + nxt
    at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    pair = np.where(keys[at] == want, counts[at], 0)
    context = np.bincount(train[:-1], minlength=vocab)[prev]
    return unigram, np.where(context > 0, pair / np.maximum(context, 1), 0.0)


def interpolation_weight(bigram: np.ndarray, unigram: np.ndarray, tol: float = 1e-10) -> float:
    """The weight w in [0, 1] that maximises mean log(w bigram + (1 - w) unigram) (unigram > 0), by EM:
    w <- mean of the bigram's share of each mixture, which never lowers the likelihood."""
    w = 0.5
    for _ in range(10_000):
        new = float(np.mean(w * bigram / (w * bigram + (1 - w) * unigram)))
        if abs(new - w) < tol:
            return new
        w = new
    return w


def count_floor(train: np.ndarray, scored: np.ndarray, vocab: int = GPT2_VOCAB) -> dict:
    """Mean next-token cross-entropy (nats) of two count models on the predictions of scored[1:] from
    scored[:-1], both fitted on `train` only: the add-one unigram, and the bigram interpolated with it.
    The bigram's weight comes from deleted interpolation: counts from all but the last HELDOUT_FRACTION
    of train, the weight that best predicts that tail, then the counts refitted on all of train."""
    train = np.asarray(train, dtype=np.int64)
    if len(train) < 4 or len(scored) < 2:
        raise ValueError(f"count_floor: {len(train)} training and {len(scored)} scored tokens; need >= 4 and >= 2")
    cut = len(train) - max(2, round(HELDOUT_FRACTION * len(train)))
    held = train[cut:]
    unigram, bigram = count_probabilities(train[:cut], held[:-1], held[1:], vocab)
    weight = interpolation_weight(bigram, unigram)
    unigram, bigram = count_probabilities(train, scored[:-1], scored[1:], vocab)
    return {"unigram": float(-np.log(unigram).mean()),
            "bigram": float(-np.log(weight * bigram + (1 - weight) * unigram).mean()),
            "bigram_weight": weight, "train_tokens": int(len(train))}


class BenchData:
    """The shards both sides of this invocation read, in a temporary folder: one validation shard and,
    per seed, the training shards in that seed's order; with the floor each seed's runs are set against."""

    def __init__(self, a, folder: str):
        base = dataclasses.replace(T.Hyperparameters(), **T.PRESETS[a.preset])
        self.train_glob, self.val_glob = a.train or base.train_files, a.val or base.val_files
        self.order, self.tokens, self.folder = a.train_order, a.tokens, folder
        wanted = a.val_tokens or (base.val_tokens if a.val_set == "first" else EVEN_VAL_TOKENS)
        self.val = choose_validation(self.val_glob, a.val_set, wanted, base.val_seq_len)
        seq = min(base.val_seq_len, self.val.val_tokens)
        if self.val.val_tokens % seq:
            raise SystemExit(f"error: --val_tokens {self.val.val_tokens} must be a multiple of the --preset "
                             f"{a.preset} validation sequence length {seq}")
        os.makedirs(folder, exist_ok=True)
        self.val_path = os.path.join(folder, "val_000000.bin")
        T.write_shard(self.val_path, self.val.tokens)
        self._train: dict = {}
        self._floor: dict = {}
        self._train_shards_digest = None

    def _key(self, seed: int):
        return seed if self.order == "shuffled" else None  # file order: one copy for every seed

    def _documents(self, seed: int) -> list[np.ndarray]:
        return training_documents(self.train_glob, self.order, seed)

    def train(self, seed: int) -> str:
        """Glob of the training shards of this seed (written on first use)."""
        key = self._key(seed)
        if key not in self._train:
            if self.order == "file":
                self._train[key] = self.train_glob
            else:
                self._train[key] = write_training_shards(self._documents(seed), os.path.join(self.folder, f"train_s{seed}"))
        return self._train[key]

    def floor(self, seed: int) -> dict:
        """count_floor of the first --tokens training tokens this seed's runs read (all of them when the
        budget repeats the split) on the validation tokens."""
        key = self._key(seed)
        if key not in self._floor:
            stream = np.concatenate(self._documents(seed))[:self.tokens]
            self._floor[key] = count_floor(stream, self.val.tokens)
        return self._floor[key]

    def train_shards_digest(self) -> str:
        """A digest of the training shards' tokens in the loader's order, whatever glob names them: what a
        results folder compares its runs' training data by (data_conflict)."""
        if self._train_shards_digest is None:
            tokens = np.concatenate(training_documents(self.train_glob, "file", 0))
            self._train_shards_digest = stream_digest(tokens.astype("<u2"))
        return self._train_shards_digest

    def meta(self, seed: int) -> dict:
        return {"train": self.train_glob, "val": self.val_glob, **self.val.meta(), "train_order": self.order,
                "train_shards_digest": self.train_shards_digest(), "floor": self.floor(seed)}


def git_commit(repo: str = REPO) -> str:
    """The checkout's commit (git rev-parse HEAD), with "-dirty" when tracked files differ from it
    (untracked files do not count: results folders being written are untracked)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=60)
        if head.returncode:
            return "unknown (not a git checkout)"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e.__class__.__name__})"
    return head.stdout.strip() + ("-dirty" if status.returncode or status.stdout.strip() else "")


# ------------------------------------------------------------------------------------------------
# results folders: one JSON per run (curve + configuration), joined by --load
# ------------------------------------------------------------------------------------------------

FLOOR_FILE = "floor.json"  # the floor of runs that record none (older runs), beside them
# the state of runs not finished yet: DIR/partial/NAME.pt (classic), DIR/partial/NAME/ (recipe); not committed
PARTIAL_DIR = "partial"


def classic_name(c: ClassicConfig, seed: int) -> str:
    return f"classic_lr{c.lr:g}_b{c.batch_tokens}_ctx{c.seq_len}_s{seed}"


def save_json(path: str, data: dict) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    write_whole(path, write)


def save_curve(folder: str, name: str, curve: list[tuple[int, float]], meta: dict) -> None:
    """Write one learning curve and its configuration as JSON."""
    save_json(os.path.join(folder, f"{name}.json"), {"curve": curve, **meta})


def read_runs(folder: str, prefix: str = "", flag: str = "--load") -> dict[str, dict]:
    """Every saved run of a results folder whose name starts with prefix, by name
    ({"curve": [(tokens, loss)], ...meta})."""
    if not os.path.isdir(folder):
        raise SystemExit(f"error: {flag} {folder}: no such folder; run --run ... --save {folder} first")
    runs = {}
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".json") or not f.startswith(prefix) or f == FLOOR_FILE:
            continue
        try:
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                data = json.load(fh)
            data["curve"] = [(int(t), float(v)) for t, v in data["curve"]]
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {flag} {folder}: {f} is not a saved curve ({e})") from None
        runs[f[:-5]] = data
    return runs


def data_of(r: dict) -> dict:
    """What a saved run was trained and scored on; runs saved before these were recorded were scored
    on the first val_tokens tokens and trained in the shards' order."""
    return {"train": r.get("train"), "val": r.get("val"), "val_tokens": r.get("val_tokens"),
            "val_set": r.get("val_set", "first"), "train_order": r.get("train_order", "file")}


def data_conflict(runs: list[dict]) -> str | None:
    """Why these runs cannot be compared (different shards, validation sets or training orders), or None.
    Runs that all record the digests of their training shards and validation tokens are compared by
    those contents, not by how their globs were spelled; older runs, by the globs."""
    by_contents = all("train_shards_digest" in r and "val_digest" in r for r in runs)
    kinds = {}
    for r in runs:
        d = data_of(r)
        key = {k: v for k, v in d.items() if not (by_contents and k in ("train", "val"))}
        kinds.setdefault(json.dumps(key, sort_keys=True), d)
    if len(kinds) > 1:
        return "; ".join(describe_data(kinds[k]) for k in sorted(kinds))
    for field, what in (("train_shards_digest", "training shards"), ("val_digest", "validation tokens")):
        digests = {r[field] for r in runs if field in r}
        if len(digests) > 1:
            return f"{what} with different contents ({', '.join(sorted(digests))})"
    return None


def describe_data(d: dict) -> str:
    order = "training documents shuffled per seed" if d["train_order"] == "shuffled" else "training documents in the shards' order"
    return f"val {d['val']} ({d['val_set']}, {d['val_tokens']:,} tokens), train {d['train']} ({order})"


def load_runs(folder: str, tokens: int | None) -> dict[str, dict]:
    """read_runs, for a report: runs of either side (a tuning folder may hold one), one token budget and
    one kind of data per folder."""
    runs = read_runs(folder)
    if not any(n.startswith(("recipe_", "classic_", RECIPE_SEARCH_PREFIX)) for n in runs):
        raise SystemExit(f"error: --load {folder}: needs recipe_s*.json or classic_*.json; "
                         f"run --run recipe, classic or search with --save {folder} first")
    budgets = {r.get("tokens") for r in runs.values()}
    if len(budgets) > 1:
        raise SystemExit(f"error: --load {folder}: runs of different --tokens budgets {sorted(map(str, budgets))}; "
                         "keep one budget per folder")
    if tokens is not None and budgets != {tokens}:
        raise SystemExit(f"error: --load {folder}: measured at --tokens {budgets.pop()}, not {tokens}; pass the same --tokens")
    conflict = data_conflict(list(runs.values()))
    if conflict:
        raise SystemExit(f"error: --load {folder}: runs on different data: {conflict}; keep one kind per folder")
    return runs


def check_folder(folder: str, data: BenchData, seed: int, model_dim: int) -> None:
    """New runs join a results folder only if its runs were trained and scored on the same data, at the
    same width (runs saved before --model_dim have the preset's)."""
    if not os.path.isdir(folder):
        return
    runs = list(read_runs(folder, flag="--save").values())
    widths = sorted({r.get("model_dim") or model_args(r["preset"]).model_dim for r in runs} - {model_dim})
    if widths:
        raise SystemExit(f"error: --save {folder} holds runs of width {widths[0]}, not --model_dim {model_dim}; "
                         f"save into a new folder, or pass --model_dim {widths[0]}")
    conflict = data_conflict(runs + [data.meta(seed)]) if runs else None
    if conflict:
        raise SystemExit(f"error: --save {folder} holds runs on other data ({conflict}); save into a new folder, or "
                         "pass the --train, --val, --val_tokens, --val_set and --train_order they ran with "
                         "(--val_set first --train_order file for runs that record neither)")


@dataclasses.dataclass
class Floors:
    """The count-model floor of each seed's runs (count_floor), and where it comes from or why it is missing."""
    by_seed: dict
    source: str

    def bigram(self, seeds) -> float | None:
        values = [self.by_seed[s]["bigram"] for s in seeds if s in self.by_seed]
        return sum(values) / len(values) if values and len(values) == len(list(seeds)) else None


def folder_floors(folder: str, runs: dict[str, dict]) -> Floors:
    """The runs' own floors; for runs that record none (trained in the shards' order, so one floor for
    every seed), the one saved in FLOOR_FILE, else computed from the shards and saved there so that
    --load prints it where the corpus is not built."""
    seeds = sorted({r.get("seed", 0) for r in runs.values()})
    if all("floor" in r for r in runs.values()):
        return Floors({r.get("seed", 0): r["floor"] for r in runs.values()}, "recorded by the runs")
    d = data_of(next(iter(runs.values())))
    want = {**d, "tokens": next(iter(runs.values())).get("tokens")}
    path = os.path.join(folder, FLOOR_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if all(saved.get(k) == v for k, v in want.items()):
            return Floors({s: saved["floor"] for s in seeds}, f"saved in {FLOOR_FILE}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not (d["train"] and d["val"] and d["val_tokens"] and want["tokens"]):
        return Floors({}, "not known: the runs name no train and val shards")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            val = choose_validation(d["val"], "first", d["val_tokens"], d["val_tokens"])
            docs = training_documents(d["train"], "file", 0)
    except SystemExit as e:
        return Floors({}, f"not known: {str(e).removeprefix('error: ')}")
    floor = count_floor(np.concatenate(docs)[:want["tokens"]], val.tokens)
    with contextlib.suppress(OSError):
        save_json(path, {**want, "floor": floor, "commit": git_commit(), "command": sys.argv})
    return Floors({s: floor for s in seeds}, f"computed from the shards (saved in {FLOOR_FILE})")


def floor_line(floors: Floors) -> str:
    if not floors.by_seed:
        return f"floor: {floors.source}"
    fl = list(floors.by_seed.values())
    mean = lambda k: sum(f[k] for f in fl) / len(fl)  # noqa: E731
    spread = "" if len({f["bigram"] for f in fl}) == 1 else \
        f"; bigram {min(f['bigram'] for f in fl):.4f} .. {max(f['bigram'] for f in fl):.4f} over seeds {sorted(floors.by_seed)}"
    return (f"floor, count models fitted on {fl[0]['train_tokens']:,} training tokens, on the same validation tokens: "
            f"unigram {mean('unigram'):.4f}, interpolated bigram {mean('bigram'):.4f} (weight {mean('bigram_weight'):.3f}, "
            f"chosen on held-out training tokens{spread}); {floors.source}")


def ratio_refusal(classic: dict[int, float], floors: Floors) -> str | None:
    """Why no ratio may be stated (one line), or None: the classic's best val loss (mean over its seeds)
    must be FLOOR_MARGIN below the bigram floor of the same seeds."""
    bigram = floors.bigram(sorted(classic))
    if bigram is None:
        return f"ratio: not stated: no bigram floor for these runs ({floors.source})"
    best = sum(classic.values()) / len(classic)
    if best > bigram - FLOOR_MARGIN:
        return (f"ratio: not stated: the classic's best val loss {best:.4f} is not {FLOOR_MARGIN} below the interpolated "
                f"bigram's {bigram:.4f} on the same tokens: these runs measure the start of training")
    return None


def search_winner(runs: dict[str, dict]) -> dict | None:
    """The classic configuration (as saved meta) whose seed-0 run has the lowest best val loss."""
    seed0 = [r for n, r in runs.items() if n.startswith("classic_") and r.get("seed", 0) == 0]
    return min(seed0, key=lambda r: best_point(r["curve"])[1]) if seed0 else None


def floor_margin(runs: dict[str, dict], floors: Floors) -> str:
    """For a folder of classic runs alone: how far the best seed-0 run is from the bigram floor and from the
    FLOOR_MARGIN a ratio needs, so that a search run to find a budget says how far it still has to go."""
    win = search_winner(runs)
    bigram = floors.bigram([win.get("seed", 0)]) if win else None
    if bigram is None:
        return ""
    best, need = best_point(win["curve"])[1], bigram - FLOOR_MARGIN
    side = f"{bigram - best:.3f} below" if best < bigram else f"{best - bigram:.3f} above"
    gap = f"{best - need:.3f} more" if best > need else f"cleared by {need - best:.3f}"
    return (f"the classic's best {best:.4f} (seed 0) is {side} the interpolated bigram's {bigram:.4f}; "
            f"a ratio needs {need:.4f} or below ({FLOOR_MARGIN} below it): {gap}")


def _summarize():
    """records/summarize.py, the records tool that holds the statistical tests."""
    if os.path.join(REPO, "records") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "records"))
    import summarize
    return summarize


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test for equal means (the records tool's t distribution)."""
    return _summarize().welch_t_test(a, b)[1]


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan"))


# ------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------

def search_table(runs: dict[str, dict]) -> str:
    rows = sorted((r for n, r in runs.items() if n.startswith("classic_") and r.get("seed", 0) == 0),
                  key=lambda r: (r["classic_lr"], r["classic_batch_tokens"], r["classic_seq_len"]))
    win = search_winner(runs)
    lines = [f"classic configurations (seed 0; more than one: the search): {len(rows)}",
             f"{'lr':>8} {'batch':>7} {'context':>7} {'steps':>6} {'best val':>9} {'@ tokens':>10}"]
    for r in rows:
        t, v = best_point(r["curve"])
        lines.append(f"{r['classic_lr']:8g} {r['classic_batch_tokens']:7,} {r['classic_seq_len']:7} "
                     f"{r['tokens'] // r['classic_batch_tokens']:6} {v:9.4f} {t:10,}" + ("  <- best" if r is win else ""))
    if len(rows) > 1:
        lines += search_edges(rows, win)
    return "\n".join(lines)


RECIPE_SEARCH_PREFIX = "rsearch_"  # not "recipe_": those are the compared recipe runs
SEARCH_AXES = (("classic_lr", "--search_lr"), ("classic_batch_tokens", "--search_batch"),
               ("classic_seq_len", "--search_seq"))
RECIPE_SEARCH_AXES = (("recipe_muon_lr", "--search_muon_lr"), ("recipe_adam_lr", "--search_adam_lr"))


def search_edges(rows: list[dict], win: dict, axes=SEARCH_AXES) -> list[str]:
    """One line per axis on which the winner sits at the smallest or largest value searched along the line
    through it (the runs that share its other settings), or is the only value there: its optimum may lie
    beyond, so the search is not done there. Values tried only at other settings do not count: a rate that
    lost at another batch says little about the winner's batch.

    A classic batch holds whole context windows, so at batch == context a smaller batch and a longer
    context do not exist: the line goes on along the diagonal instead (batch and context halved or doubled
    together), and that end counts as searched once a run there, at the winner's lr, exists."""
    def fmt(v):
        return f"{v:,}" if isinstance(v, int) else f"{v:g}"

    out = []
    for key, flag in axes:
        line = [r for r in rows if all(r[k] == win[k] for k, _ in axes if k != key)]
        values = sorted({r[key] for r in line})
        if win[key] not in (values[0], values[-1]):
            continue
        side = "only" if len(values) == 1 else "smallest" if win[key] == values[0] else "largest"
        others = ", ".join(f"{k.split('_', 1)[1]} {fmt(win[k])}" for k, _ in axes if k != key)
        edge = f"the winner's {key.split('_', 1)[1]} {fmt(win[key])} is the {side} value searched at {others}"
        if side != "only":
            edge += f" ({', '.join(fmt(v) for v in values)})"
        one_window = ((key, side) in (("classic_batch_tokens", "smallest"), ("classic_seq_len", "largest"))
                      and win["classic_batch_tokens"] == win["classic_seq_len"])
        if not one_window:
            out.append(f"{edge}: extend {flag} past it")
            continue
        below = key == "classic_batch_tokens"  # a smaller batch needs a shorter context; a longer context a larger batch
        seq = win["classic_seq_len"]
        if not any(r["classic_lr"] == win["classic_lr"] and r["classic_batch_tokens"] == r["classic_seq_len"]
                   and (r["classic_seq_len"] < seq if below else r["classic_seq_len"] > seq) for r in rows):
            out.append(f"{edge}, and one window a step: extend --search_batch and --search_seq "
                       f"{'below' if below else 'above'} it together (batch = context)")
    if not out:
        out.append("the winner is inside the searched grid on every axis")
    return out


def recipe_search_winner(runs: dict[str, dict]) -> dict | None:
    """The recipe search run (--run recipe_search) with the lowest best val loss."""
    rows = [r for n, r in runs.items() if n.startswith(RECIPE_SEARCH_PREFIX)]
    return min(rows, key=lambda r: best_point(r["curve"])[1]) if rows else None


def recipe_search_table(runs: dict[str, dict]) -> str:
    rows = sorted((r for n, r in runs.items() if n.startswith(RECIPE_SEARCH_PREFIX)),
                  key=lambda r: (r["recipe_muon_lr"], r["recipe_adam_lr"]))
    if not rows:
        return ""
    win = recipe_search_winner(runs)
    lines = [f"recipe learning-rate search (seed 0): {len(rows)}", f"{'NorMuon lr':>10} {'Adam lr':>8} {'best val':>9} {'@ tokens':>10}"]
    for r in rows:
        t, v = best_point(r["curve"])
        lines.append(f"{r['recipe_muon_lr']:10g} {r['recipe_adam_lr']:8g} {v:9.4f} {t:10,}" + ("  <- best" if r is win else ""))
    return "\n".join(lines + search_edges(rows, win, RECIPE_SEARCH_AXES))


def searches_preview(runs: dict[str, dict], floors: Floors) -> str:
    """A tuning folder holding both sides' searches states no ratio (one seed, and the split its rates
    were chosen on), but where the recipe search's winner reaches the classic search's winner's best says
    early whether the goal is in reach: a preview, refused on the same floor rule as the ratio."""
    classic, recipe = search_winner(runs), recipe_search_winner(runs)
    if classic is None or recipe is None:
        return ""
    tokens, best = best_point(classic["curve"])
    head = ("preview of the ratio (the two searches' winners, seed 0, this tuning split; the ratio is scored on "
            "another split, 3+ seeds a side): ")
    refusal = ratio_refusal({classic.get("seed", 0): best}, floors)
    if refusal:
        return head + refusal.removeprefix("ratio: ")
    reach = tokens_to_reach(recipe["curve"], best)
    head += f"the recipe (NorMuon {recipe['recipe_muon_lr']:g}, Adam {recipe['recipe_adam_lr']:g}) "
    if reach is None:
        return head + f"does not reach the classic's best {best:.4f} ({tokens:,} tokens)"
    return head + (f"reaches the classic's best {best:.4f} at {reach:,.0f} tokens, {reach / tokens:.4f} of the "
                   f"classic's {tokens:,}")


# Two runs are compared at the same evaluations only where these sit at nearly the same token counts
# (runs of one side with one --evals; batches that divide the budget differently move them by < 1%).
COMPARE_TOKENS_APART = 0.02


def run_settings(run: dict) -> str:
    """What a saved run was trained with, in a few words: the classic's lr, batch and context, or the
    recipe's two rates."""
    if "classic_lr" in run:
        return (f"lr {run['classic_lr']:g}, batch {run['classic_batch_tokens']:,}, context {run['classic_seq_len']:,}, "
                f"seed {run.get('seed', 0)}")
    if "recipe_muon_lr" in run:
        return f"NorMuon lr {run['recipe_muon_lr']:g}, Adam lr {run['recipe_adam_lr']:g}, seed {run.get('seed', 0)}"
    return f"seed {run.get('seed', 0)}"


def compare_runs(folder: str, names: str) -> str:
    """--load DIR --compare A,B: two saved runs of a folder at each evaluation (A's val loss minus B's,
    negative where A leads), then where A leads and trails and by how much, both runs' best and last
    losses, and how far each best is below its seed's bigram floor and from the FLOOR_MARGIN a ratio needs."""
    runs = load_runs(folder, None)
    pair = [n.strip().removesuffix(".json") for n in names.split(",")]
    if len(pair) != 2 or not all(pair) or pair[0] == pair[1]:
        raise SystemExit(f"error: --compare {names!r}: give two different runs of {folder}, comma-separated "
                         "(JSON names without .json, e.g. classic_lr0.003_b2048_ctx128_s0,classic_lr0.0015_b2048_ctx128_s0)")
    for n in pair:
        if n not in runs:
            raise SystemExit(f"error: --compare: {folder} holds no run {n} (its runs: {', '.join(sorted(runs))})")
    a, b = (runs[n]["curve"] for n in pair)
    if len(a) != len(b):
        raise SystemExit(f"error: --compare: {pair[0]} has {len(a) - 1} evaluations after step 0 and {pair[1]} "
                         f"{len(b) - 1}; compare runs of one side saved with the same --evals")
    for i, ((ta, _), (tb, _)) in enumerate(zip(a, b)):
        if abs(ta - tb) > COMPARE_TOKENS_APART * max(ta, tb):
            raise SystemExit(f"error: --compare: evaluation {i} is at {ta:,} tokens in {pair[0]} and {tb:,} in "
                             f"{pair[1]}, over {COMPARE_TOKENS_APART:.0%} apart; compare runs of one side saved "
                             "with the same --evals")
    lines = [f"{side} {n}: {run_settings(runs[n])}" for side, n in zip("AB", pair)]
    lines += [f"{folder}: val loss at each evaluation; A - B is negative where A leads",
              f"{'eval':>4} {'A tokens':>11} {'A val':>8} {'B tokens':>11} {'B val':>8} {'A - B':>8}"]
    diffs = []
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b)):
        d = round(la - lb, 4) + 0.0  # + 0.0: a difference that rounds to zero prints +0.0000, not -0.0000
        lines.append(f"{i:4} {ta:11,} {la:8.4f} {tb:11,} {lb:8.4f} {d:+8.4f}")
        if ta and tb:  # not step 0 (a run saved with --evals 0 has its final evaluation alone)
            diffs.append(d)
    lead, trail = [-d for d in diffs if d < 0], [d for d in diffs if d > 0]
    span = lambda xs: f", by {min(xs):.4f} to {max(xs):.4f}" if xs else ""  # noqa: E731
    lines.append(f"A leads at {len(lead)} of the {len(diffs)} evaluations after step 0{span(lead)}; trails at "
                 f"{len(trail)}{span(trail)}; level at {len(diffs) - len(lead) - len(trail)}")
    (a_at, a_best), (b_at, b_best) = best_point(a), best_point(b)
    ahead = lambda x, y: f"A {abs(x - y):.4f} {'ahead' if x < y else 'behind' if x > y else 'level'}"  # noqa: E731
    lines.append(f"best: A {a_best:.4f} at {a_at:,} tokens, B {b_best:.4f} at {b_at:,} tokens: {ahead(a_best, b_best)}")
    lines.append(f"last: A {a[-1][1]:.4f}, B {b[-1][1]:.4f}: {ahead(a[-1][1], b[-1][1])}")
    floors = folder_floors(folder, runs)
    for side, n, best in (("A", pair[0], a_best), ("B", pair[1], b_best)):
        seed = runs[n].get("seed", 0)
        bigram = floors.bigram([seed])
        if bigram is not None:
            need = bigram - FLOOR_MARGIN
            lines.append(f"{side}'s best is {abs(bigram - best):.4f} {'below' if best < bigram else 'above'} the "
                         f"interpolated bigram of seed {seed} ({bigram:.4f}); a ratio needs {need:.4f}: "
                         + (f"cleared by {need - best:.4f}" if best <= need else f"{best - need:.4f} short"))
    return "\n".join(lines)


def spread_line(name: str, col: list[float]) -> str:
    """Mean, sample std and range of one figure over the seeds (one seed has no spread yet)."""
    m, sd = mean_std(col)
    if len(col) == 1:
        return f"{name}: {m:.4f} (1 seed: no spread yet)"
    return f"{name}: mean {m:.4f}, std {sd:.4f}, range {min(col):.4f} .. {max(col):.4f} ({len(col)} seeds)"


def seeds_table(runs: dict[str, dict], floors: Floors | None = None) -> tuple[str, list[float]]:
    """Per seed: the recipe's and the tuned classic's best val loss, the bigram floor and the ratio (when
    ratio_refusal allows one); then mean and spread."""
    floors = floors or Floors({}, "not known")
    win = search_winner(runs)
    key = classic_name(ClassicConfig(lr=win["classic_lr"], batch_tokens=win["classic_batch_tokens"],
                                     seq_len=win["classic_seq_len"]), 0)[:-1]
    recipe = {r["seed"]: r for n, r in runs.items() if n.startswith("recipe_")}
    classic = {r["seed"]: r for n, r in runs.items() if n.startswith(key)}
    refusal = ratio_refusal({s: best_point(r["curve"])[1] for s, r in classic.items()}, floors)
    searched = sum(n.startswith("classic_") and r.get("seed", 0) == 0 for n, r in runs.items()) > 1
    lines = [f"{'tuned classic (the search winner)' if searched else 'classic'}: lr {win['classic_lr']:g}, "
             f"batch {win['classic_batch_tokens']:,}, context {win['classic_seq_len']}",
             f"{'seed':>4} {'recipe best':>19} {'classic best':>19} {'bigram floor':>12} {'ratio':>6}"]
    ratios, rb, cb = [], [], []
    for seed in sorted(set(recipe) | set(classic)):
        cells = []
        for side, col in ((recipe, rb), (classic, cb)):
            if seed in side:
                t, v = best_point(side[seed]["curve"])
                col.append(v)
                cells.append(f"{v:8.4f} @{t:>9,}")
            else:
                cells.append(f"{'-':>19}")
        floor = f"{floors.by_seed[seed]['bigram']:12.4f}" if seed in floors.by_seed else f"{'-':>12}"
        ratio = efficiency_ratio(recipe[seed]["curve"], classic[seed]["curve"]) \
            if seed in recipe and seed in classic and refusal is None else None
        if ratio is not None:
            ratios.append(ratio)
        lines.append(f"{seed:4} {cells[0]} {cells[1]} {floor} " + (f"{ratio:6.3f}" if ratio is not None else f"{'-':>6}"))
    budget = next(iter(runs.values()))["tokens"]
    lines.append(f"val loss at equal tokens, mean over seeds: {'tokens':>10} {'recipe':>8} {'classic':>8}")
    for frac in (0.25, 0.5, 0.75, 1.0):
        at = [sum(loss_at(r["curve"], frac * budget) for r in side.values()) / len(side) if side else float("nan")
              for side in (recipe, classic)]
        lines.append(f"{'':42} {frac * budget:10,.0f} {at[0]:8.4f} {at[1]:8.4f}")
    lines += [spread_line(name, col) for name, col in (("recipe best val", rb), ("classic best val", cb), ("ratio", ratios)) if col]
    paired = sorted(set(recipe) & set(classic))
    if refusal:
        lines.append(refusal)
    elif paired:
        ratio, boot = mean_curve_ratio([recipe[s]["curve"] for s in paired], [classic[s]["curve"] for s in paired])
        spread = (f"; bootstrap over the {len(paired)} seeds: std {np.std(boot):.4f}, 95% "
                  f"{np.percentile(boot, 2.5):.4f} .. {np.percentile(boot, 97.5):.4f}" if len(boot) > 1 else "")
        lines.append("ratio of the seed-mean curves: " + (f"{ratio:.4f}{spread}" if ratio is not None else
                                                          "none (the mean recipe curve never reaches the classic's best)"))
    return "\n".join(lines), ratios


def ablation_table(runs: dict[str, dict], floors: Floors | None = None) -> str:
    """Per component: final val loss over seeds, delta and Welch's p against the full recipe; the
    per-seed deltas against the full recipe's run of the same seed (same initialisation and data order,
    so what the seed moves cancels), their mean, the paired t-test and its Holm adjustment over the rows
    shown."""
    by, full = {}, {}
    for n, r in runs.items():
        if n.startswith("ablate_"):
            by.setdefault(r["component"], {})[r["seed"]] = r["curve"][-1][1]
        elif n.startswith("recipe_"):
            full[r["seed"]] = r["curve"][-1][1]
    if not by or not full:
        return ""
    stats = _summarize()
    fm, fs = mean_std(list(full.values()))
    rows = []
    listed = [name for name, _ in ABLATIONS]
    # in ABLATIONS' order; components saved under a name no longer listed (an older arm) after them
    for name in listed + sorted(set(by) - set(listed)):
        if name not in by:
            continue
        xs = list(by[name].values())
        m, sd = mean_std(xs)
        p = welch_p(xs, list(full.values())) if len(xs) > 1 and len(full) > 1 else float("nan")
        pairs = sorted(s for s in by[name] if s in full)
        deltas = [by[name][s] - full[s] for s in pairs]
        paired_p = stats.paired_t_test([by[name][s] for s in pairs], [full[s] for s in pairs])[1]
        rows.append((name, xs, m, sd, p, pairs, deltas, paired_p))
    adjusted = stats.holm([r[-1] for r in rows])
    lines = [f"ablations: final val loss over seeds; full recipe {fm:.4f} +- {fs:.4f} ({len(full)} seeds)"]
    if floors is not None:
        lines.append(floor_line(floors))
    w = max([42] + [len(r[0]) for r in rows])  # the name column fits the longest name shown
    lines.append(f"{'switched off / replaced':{w}s} {'n':>2} {'final val':>16} {'delta':>8} {'Welch p':>7} {'pairs':>5} "
                 f"{'paired':>8} {'paired p':>8} {'Holm p':>7} Holm < 0.05  per-seed deltas (seed: delta)")
    def num(x: float, width: int, sign: str = "") -> str:  # a spread or p-value one seed or one pair cannot give: "-"
        return "-".rjust(width) if math.isnan(x) else f"{x:{sign}{width}.4f}"

    for (name, xs, m, sd, p, pairs, deltas, paired_p), holm_p in zip(rows, adjusted):
        pm = sum(deltas) / len(deltas) if deltas else float("nan")
        significant = "-" if math.isnan(holm_p) else "yes" if holm_p < 0.05 else "no"
        per_seed = " ".join(f"{s}:{d:+.4f}" for s, d in zip(pairs, deltas))
        lines.append(f"{name:{w}s} {len(xs):2} {m:8.4f} +- {num(sd, 6)} {m - fm:+8.4f} {num(p, 7)} "
                     f"{len(pairs):5} {num(pm, 8, '+')} {num(paired_p, 8)} {num(holm_p, 7)} "
                     f"{significant:11s}  {per_seed}")
    tested = sum(not math.isnan(a) for a in adjusted)
    lines.append("delta > 0: the component helps. delta and Welch p: against the full recipe's seeds (Welch's two-sided "
                 "t-test); paired: the mean of the per-seed deltas (seeds both have) and its two-sided paired t-test; "
                 + (f"Holm p: the paired p adjusted over the {tested} rows with one" if tested else
                    "Holm p: none yet (a paired p needs 2 pairs)")
                 + "; -: not defined for one seed or one pair (records/summarize.py)")
    return "\n".join(lines)


def curve_styles(runs: dict[str, dict]) -> dict[str, tuple[str, dict]]:
    """Each saved run's legend entry and line style in curves.png: the compared recipe runs, each side's
    search winner in colour, the other search points faint."""
    win, rwin = search_winner(runs), recipe_search_winner(runs)
    styles = {}
    for n, r in runs.items():
        if n.startswith("recipe_"):
            styles[n] = ("recipe", dict(color="tab:blue", marker=".", alpha=0.8))
        elif n.startswith(RECIPE_SEARCH_PREFIX):
            styles[n] = (("recipe (search winner)", dict(color="tab:blue", marker=".", alpha=0.8)) if r is rwin
                         else ("recipe, other search points", dict(color="tab:cyan", alpha=0.3)))
        elif n.startswith("classic_"):
            won = all(r[k] == win[k] for k, _ in SEARCH_AXES)
            styles[n] = (("classic (search winner)", dict(color="tab:orange", marker=".", alpha=0.8)) if won
                         else ("classic, other search points", dict(color="gray", alpha=0.3)))
    return styles


def plot_curves(runs: dict[str, dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    labelled = set()
    for n, (name, style) in sorted(curve_styles(runs).items()):
        xs, ys = zip(*runs[n]["curve"])
        ax.plot(xs, ys, label=None if name in labelled else name, **style)  # each kind once in the legend
        labelled.add(name)
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(out + ".tmp.png", dpi=110, bbox_inches="tight")
    os.replace(out + ".tmp.png", out)
    plt.close(fig)


def val_text(r: dict) -> str:
    """Which validation tokens a saved run was scored on."""
    n, how, val = r["val_tokens"], r.get("val_set"), r.get("val")
    docs, shards = r.get("val_documents", ["?", "?"]), r.get("val_shards", ["?", "?"])
    if how is None:
        return f"the first {n:,} tokens of {val} (runs saved before the validation set was recorded)"
    if how == "first":
        return f"the first {n:,} tokens of {val}: {docs[0]} of its {docs[1]} documents, from {shards[0]} of {shards[1]} shards"
    if how == "whole":
        return f"all of {val}, {n:,} tokens: its {docs[1]} documents, cut to whole validation sequences"
    among = "those --val_set even does not score" if how == "tune" else "all of them"
    return (f"{n:,} tokens of {val}: {docs[0]} of its {docs[1]} documents, chosen evenly over {among} "
            f"(from {shards[0]} of {shards[1]} shards)")


def order_text(r: dict) -> str:
    if "train_order" not in r:
        return "in the shards' order for every seed (runs saved before the order was recorded)"
    return "shuffled by each seed" if r["train_order"] == "shuffled" else "in the shards' order for every seed"


def unfinished_runs(folder: str) -> list[str]:
    """The runs stopped midway whose state is in DIR/partial/, each with the step it continues from."""
    part = os.path.join(folder, PARTIAL_DIR)
    found = []
    for entry in sorted(os.listdir(part)) if os.path.isdir(part) else []:
        path = os.path.join(part, entry)
        if entry.endswith(".pt"):  # a classic run's state
            with contextlib.suppress(Exception):  # a damaged state is reported when the run resumes
                state = torch.load(path, map_location="cpu", weights_only=False)
                steps = max(1, state["identity"]["tokens"] // state["identity"]["config"]["batch_tokens"])
                found.append(f"{entry[:-3]} at step {state['step']} of {steps}")
        elif os.path.isdir(path) and (newest := newest_checkpoint(path))[1]:  # a recipe run's checkpoints
            found.append(f"{entry} at step {newest[0]}")
    return found


def tunes_one_side(runs: dict[str, dict]) -> bool:
    """A folder that tunes a side: a search of more than one classic configuration, the recipe's search
    runs, or runs on the tuning split."""
    classic = {(r["classic_lr"], r["classic_batch_tokens"], r["classic_seq_len"])
               for n, r in runs.items() if n.startswith("classic_")}
    return len(classic) > 1 or any(n.startswith(RECIPE_SEARCH_PREFIX) for n in runs) \
        or all(r.get("val_set") == "tune" for r in runs.values())


def one_side_line(runs: dict[str, dict], ablations: bool) -> str:
    """Why a folder with one side's runs states no ratio: it tunes that side, it holds the recipe's
    ablations, or the other side's runs are not saved there yet (the scored split's folder while its
    seeds are being run)."""
    classic = any(n.startswith("classic_") for n in runs)
    side, other = ("classic", "recipe") if classic else ("recipe", "classic")
    kind = ("recipe runs and ablations" if ablations and not classic else
            f"{side} runs: a tuning folder" if tunes_one_side(runs) else f"{side} runs: no {other} run saved here yet")
    return f"one side only ({kind}): no comparison, no ratio"


def one_side_seeds(runs: dict[str, dict], floors: Floors) -> str:
    """The seeds saved so far in a scored folder whose other side is not run yet: each seed's best val
    loss, the tokens it was first reached at and the seed's bigram floor, then their mean and spread
    (seeds_table's columns, so the figures stay the same once the other side is saved)."""
    side = "classic" if any(n.startswith("classic_") for n in runs) else "recipe"
    seeds = {r["seed"]: r for n, r in runs.items() if n.startswith(f"{side}_")}
    if not seeds or tunes_one_side(runs):
        return ""
    lines = [f"{'seed':>4} {side + ' best':>19} {'bigram floor':>12}"]
    for seed, run in sorted(seeds.items()):
        t, v = best_point(run["curve"])
        floor = f"{floors.by_seed[seed]['bigram']:12.4f}" if seed in floors.by_seed else f"{'-':>12}"
        lines.append(f"{seed:4} {v:8.4f} @{t:>9,} {floor}")
    return "\n".join(lines + [spread_line(f"{side} best val", [best_point(r["curve"])[1] for r in seeds.values()])])


def report(folder: str, tokens: int | None, plot: bool = True) -> list[float]:
    """Print every table a results folder supports (search, seeds and ratio, ablations) with the floor
    beside them, and the runs stopped midway; plot the curves."""
    pending = unfinished_runs(folder) if os.path.isdir(folder) else []
    if pending:
        print(f"{folder}: stopped midway, continued by the same command: " + "; ".join(pending))
        if not any(n.startswith(("recipe_", "classic_", RECIPE_SEARCH_PREFIX)) for n in read_runs(folder)):
            return []
    runs = load_runs(folder, tokens)
    any_run = next(iter(runs.values()))
    print(f"{folder}: {any_run['tokens']:,} training tokens per run from {any_run['train']}, documents "
          f"{order_text(any_run)}; val loss on {val_text(any_run)}")
    commits = collections.Counter(r.get("commit", "not recorded") for r in runs.values())
    print("commit: " + ", ".join(f"{c} ({n} run{'s' * (n != 1)})" for c, n in sorted(commits.items())))
    lrs = {(r["recipe_muon_lr"], r["recipe_adam_lr"]) for n, r in runs.items() if "recipe_muon_lr" in r}
    base = model_args(any_run["preset"], any_run.get("model_dim", 0))
    classic = next((r for n, r in runs.items() if n.startswith("classic_")), None)
    recipe = any(n.startswith(("recipe_", RECIPE_SEARCH_PREFIX)) for n in runs)
    sides = ((("recipe", recipe_params(base)),) if recipe else ()) + \
        ((("classic", classic["classic_params"]),) if classic else ())
    for name, p in sides:
        print(f"{name} parameters: {p['non-embedding']:,} outside the embedding tables, {p['total']:,} in all")
    for name, dtypes in (("recipe", {r.get("recipe_dtype", "not recorded") for n, r in runs.items() if "recipe_muon_lr" in r}),
                         ("classic", {classic_dtype_of(r) for n, r in runs.items() if n.startswith("classic_")})):
        if dtypes:
            print(f"{name} compute dtype: {' and '.join(sorted(dtypes))}"
                  + (" (the runs differ by rounding as well as by their settings)" if len(dtypes - {"not recorded"}) > 1 else ""))
    if lrs:
        print("recipe learning rates: " + ", ".join(f"NorMuon {m:g}, Adam {a:g}" for m, a in sorted(lrs)))
    floors = folder_floors(folder, runs)
    print(floor_line(floors))
    if classic:
        print(search_table(runs) + "\n")
    rates = recipe_search_table(runs)
    if rates:
        print(rates + "\n")
    ratios = []
    two_sided = classic is not None and any(n.startswith("recipe_") for n in runs)
    if two_sided:
        table, ratios = seeds_table(runs, floors)
        print(table)
    abl = ablation_table(runs, floors)  # also in a folder of the recipe's ablations alone
    if abl:
        print(("\n" if two_sided else "") + abl)
    preview = "" if two_sided else searches_preview(runs, floors)
    if preview:
        print("both sides' searches (a tuning folder): no comparison of seeds, no ratio\n" + preview)
    elif not two_sided:
        print(("\n" if abl else "") + one_side_line(runs, bool(abl)))
        waiting = "" if abl else one_side_seeds(runs, floors)
        if waiting:
            print(waiting)
        margin = floor_margin(runs, floors) if classic else ""
        if margin:
            print(margin)
    if plot:
        out = os.path.join(folder, "curves.png")
        plot_curves(runs, out, f"{os.path.basename(os.path.normpath(folder))}")
        print(f"plot: {out}")
    return ratios


# ------------------------------------------------------------------------------------------------
# training runs
# ------------------------------------------------------------------------------------------------

def classic_configs(a, runs_dir: str) -> list[ClassicConfig]:
    """--run search: the grid of the --search_* lists; --run classic: the flags, or the search winner
    saved in --save when no classic flag is given."""
    if a.run == "search":
        grid = [(float(lr), int(b), int(ctx)) for lr in a.search_lr.split(",") for b in a.search_batch.split(",")
                for ctx in a.search_seq.split(",")]
    elif a.classic_lr is None and a.classic_batch_tokens is None and a.classic_seq_len is None and (
            a.classic_from or os.path.isdir(runs_dir) and any(f.startswith("classic_") for f in os.listdir(runs_dir))):
        source = a.classic_from or runs_dir
        win = search_winner(read_runs(source, "classic_", "--classic_from")) if os.path.isdir(source) else None
        if win is None:
            raise SystemExit(f"error: --classic_from {source}: no classic search runs there; run --run search --save {source} first")
        grid = [(win["classic_lr"], win["classic_batch_tokens"], win["classic_seq_len"])]
        print(f"classic: the search winner saved in {source}")
    else:
        grid = [(a.classic_lr or 1e-3, a.classic_batch_tokens or a.default_batch, a.classic_seq_len or a.default_seq)]
    return [ClassicConfig(lr=lr, batch_tokens=b, seq_len=ctx) for lr, b, ctx in grid]


def saved(folder: str, name: str) -> bool:
    """A run already in the results folder is kept, not trained again (an interrupted queue resumes)."""
    if os.path.exists(os.path.join(folder, f"{name}.json")):
        print(f"{name}: saved in {folder} already")
        return True
    return False


def run_meta(a, data: BenchData, seed: int, device: torch.device) -> dict:
    """What every saved run records besides its curve: budget, data and floor, provenance, and the
    machine it ran on."""
    return {"tokens": a.tokens, "preset": a.preset, "model_dim": a.model_dim, **data.meta(seed), "seed": seed,
            "commit": a.commit, "command": a.command, "device": device.type, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def relative_to(path: str, folder: str) -> str:
    """path relative to the results folder when it lies inside it (a run log), else absolute."""
    path = os.path.abspath(path)
    inside = path.startswith(os.path.abspath(folder) + os.sep)
    return os.path.relpath(path, folder) if inside else path


def run_copy(pattern: str, what: str, scratch: str, state_dir: str) -> str:
    """The shards of pattern, copied into state_dir/data/<what>/ when they lie in this invocation's scratch
    folder (the per-seed orders, the validation shard), which the next invocation names differently: the
    checkpoints of a resumable run name their shards, and train_gpt resumes only on the same paths."""
    files = T.find_shards(pattern, what)
    if not all(os.path.abspath(f).startswith(os.path.abspath(scratch) + os.sep) for f in files):
        return pattern
    folder = os.path.join(state_dir, "data", what)
    for f in files:
        write_whole(os.path.join(folder, os.path.basename(f)), lambda tmp, f=f: shutil.copyfile(f, tmp))
    return os.path.join(folder, os.path.basename(pattern))


def remove_state(path: str) -> None:
    """A finished run's state (a classic's file, a recipe's checkpoint folder), then partial/ once empty."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    with contextlib.suppress(OSError):  # another run's state may still be in it
        os.rmdir(os.path.dirname(path))


def this_sitting(a) -> dict:
    """What a run's sitting (one process's share of it) records: the code, the command and the CPU threads,
    which set the step's speed and, with a matmul's reduction order, its last bits."""
    return {"commit": a.commit, "command": a.command, "threads": torch.get_num_threads()}


class _Tee(io.TextIOBase):
    """Writes go to the terminal's stream and to an open log file alike."""
    def __init__(self, out, log):
        self.out, self.log = out, log

    def write(self, text: str) -> int:
        self.out.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.out.flush()
        self.log.flush()

    def isatty(self) -> bool:  # a terminal still gets what a terminal gets
        return self.out.isatty()


@contextlib.contextmanager
def printed_into(path: str, header: str):
    """Everything printed inside also goes to the end of path, after a header line: a classic run's log
    beside its JSON, each sitting appended under its own header, kept whether or not the terminal was
    redirected anywhere (the recipe's train_gpt writes its own)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as log:
        log.write(header + "\n")
        log.flush()
        with contextlib.redirect_stdout(_Tee(sys.stdout, log)):
            yield


def sitting_header(sitting: dict) -> str:
    """The line that opens a sitting (this_sitting's record) in a classic run's log: when, on what code,
    how many threads, and the command that continues it."""
    return (f"# sitting {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, commit {sitting['commit']}, "
            f"{sitting['threads']} threads: {' '.join(sitting['command'])}")


def sittings_meta(sittings: list[dict]) -> dict:
    """A saved run's commit and command: its first sitting's; and every sitting when there were several."""
    return {"commit": sittings[0]["commit"], "command": sittings[0]["command"],
            **({"sittings": sittings} if len(sittings) > 1 else {})}


def save_recipe_run(a, data: BenchData, seed: int, device: torch.device, name: str, args: T.Hyperparameters,
                    extra: dict, diverging_is_a_result: bool = False) -> list[tuple[int, float]]:
    """Train the recipe (resumable: its state in DIR/partial/<name>/) and save it as DIR/<name>.json with
    the run's provenance; returns the curve. With diverging_is_a_result, a run train_gpt stops (a
    non-finite loss) is saved with a NaN final loss instead of stopping the benchmark; a run a signal
    stops is not saved (its state continues it)."""
    state_dir = os.path.join(a.save, PARTIAL_DIR, name)
    run_id = f"{name}_{os.getpid()}"
    t = time.perf_counter()
    cpu_dtype, note = recipe_cpu_dtype(a.cpu_dtype, args, device, a.save, state_dir)
    print(f"  {note}", flush=True)
    args = dataclasses.replace(args, cpu_dtype=cpu_dtype, train_files=run_copy(args.train_files, "train", a.data_dir, state_dir),
                               val_files=run_copy(args.val_files, "val", a.data_dir, state_dir))
    try:
        run = run_recipe(args, device, run_id, state_dir, this_sitting(a))
    except SystemExit as e:  # a signal's stop (code > 128) keeps its state in partial/ for the next sitting
        if not diverging_is_a_result or (isinstance(e.code, int) and e.code > 128):
            raise
        print(f"  {name}: stopped ({e})")
        log = os.path.join(args.log_dir, f"{run_id}.txt")
        run = {"curve": [(a.tokens, float("nan"))], "seconds": time.perf_counter() - t,
               "sittings": [{"step": 0, "log": log, **this_sitting(a)}]}
    sittings = [{**s, "log": relative_to(s["log"], a.save)} for s in run["sittings"]]
    save_curve(a.save, name, run["curve"], {
        **run_meta(a, data, seed, device), **sittings_meta(sittings), **extra, "seconds": run["seconds"],
        "recipe_muon_lr": args.muon_lr, "recipe_adam_lr": args.adam_lr, "log": sittings[0]["log"],
        **({"recipe_dtype": run["dtype"]} if run.get("dtype") else {})})
    remove_state(state_dir)
    return run["curve"]


def prepare(a, check: bool = True) -> BenchData:
    """The shards of this invocation, checked against the runs already in the results folder."""
    seeds = [int(x) for x in a.seeds.split(",")]
    data = BenchData(a, a.data_dir)
    if check:
        check_folder(a.save, data, seeds[0], a.model_dim)
    v = data.val.meta()
    print(f"val: {val_text({**v, 'val': data.val_glob})}; train: {data.train_glob}, documents "
          f"{order_text({'train_order': data.order})}")
    print(floor_line(Floors({s: data.floor(s) for s in seeds}, "of this invocation's seeds")), flush=True)
    return data


def run_sides(a, device: torch.device) -> None:
    """Train what --run asks for, one JSON per run in the results folder, then report it."""
    seeds = [int(x) for x in a.seeds.split(",")]
    data = prepare(a)
    if a.cpu_dtype != "auto":  # a forced dtype the folder's runs do not share: refused now, not after hours
        if a.run in ("both", "classic", "search"):
            classic_dtype(a.cpu_dtype, ClassicConfig(), device, a.save)
        if a.run in ("both", "recipe", "recipe_search"):
            recipe_cpu_dtype(a.cpu_dtype, T.Hyperparameters(), device, a.save)
    args = recipe_args(a.preset, data.train_glob, data.val_path, a.tokens, a.evals, data.val.val_tokens, device,
                       a.recipe_overrides, a.log_dir, model_dim=a.model_dim)
    folder = a.save
    if a.run == "recipe_search":
        grid = [(float(m), float(ad)) for m in a.search_muon_lr.split(",") for ad in a.search_adam_lr.split(",")]
        for m, ad in grid:
            name = f"{RECIPE_SEARCH_PREFIX}m{m:g}_a{ad:g}_s0"
            if saved(folder, name):
                continue
            run_args = dataclasses.replace(args, muon_lr=m, adam_lr=ad, train_files=data.train(0))
            print(f"recipe search: NorMuon lr {m:g}, Adam lr {ad:g}, seed 0", flush=True)
            t = time.perf_counter()
            curve = save_recipe_run(a, data, 0, device, name, run_args, {})
            print(f"  best val {best_point(curve)[1]:.4f} in {time.perf_counter() - t:.0f}s", flush=True)
    if a.run in ("both", "recipe"):
        for seed in seeds:
            if saved(folder, f"recipe_s{seed}"):
                continue
            print(f"recipe seed {seed}: --preset {a.preset} {args.num_layers} layers x {args.model_dim}, "
                  f"{args.num_iterations}+{args.extension_iterations} steps, {sum(schedule_tokens(args)):,} tokens, "
                  f"NorMuon lr {args.muon_lr:g}, Adam lr {args.adam_lr:g}", flush=True)
            t = time.perf_counter()
            seeded = dataclasses.replace(args, seed=seed, train_files=data.train(seed))
            curve = save_recipe_run(a, data, seed, device, f"recipe_s{seed}", seeded, {})
            print(f"  best val {best_point(curve)[1]:.4f} in {time.perf_counter() - t:.0f}s", flush=True)
    if a.run in ("both", "classic", "search"):
        for c in classic_configs(a, folder):
            c = dataclasses.replace(c, vocab_size=args.padded_vocab_size, num_layers=args.num_layers,
                                    model_dim=args.model_dim, num_heads=args.num_heads, mlp_hidden=args.mlp_hidden)
            for seed in ([0] if a.run == "search" else seeds):
                name = classic_name(c, seed)
                if saved(folder, name):
                    continue
                log, sitting = os.path.join(a.log_dir, f"{name}.txt"), this_sitting(a)
                with printed_into(log, sitting_header(sitting)):
                    print(f"classic seed {seed}: {c.num_layers} layers x {c.model_dim}, context {c.seq_len}, batch "
                          f"{c.batch_tokens:,} tokens, AdamW lr {c.lr:g}, {max(1, a.tokens // c.batch_tokens)} steps",
                          flush=True)
                    state_file = os.path.join(folder, PARTIAL_DIR, name + ".pt")
                    dtype, note = classic_dtype(a.cpu_dtype, c, device, folder, state_file)
                    print(f"  {note}", flush=True)
                    run = run_classic(c, data.train(seed), data.val_path, a.tokens, a.evals, data.val.val_tokens,
                                      device, seed, state_file, sitting, dtype)
                    save_curve(folder, name, run["curve"],
                               {**run_meta(a, data, seed, device), **sittings_meta(run["sittings"]),
                                "seconds": run["seconds"], "classic_lr": c.lr, "classic_batch_tokens": c.batch_tokens,
                                "classic_seq_len": c.seq_len, "classic_dtype": dtype, "classic_params": classic_params(c),
                                "log": relative_to(log, folder)})
                    remove_state(state_file)
                    print(f"  best val {best_point(run['curve'])[1]:.4f} in {run['seconds']:.0f}s", flush=True)
    report(folder, a.tokens)


def classic_params(c: ClassicConfig) -> dict:
    """Parameter counts of the classic model: the (tied) token table and positions apart."""
    with torch.device("meta"):
        model = ClassicGPT(c)
    total = sum(p.numel() for p in model.parameters())
    tables = model.wte.weight.numel() + model.wpe.weight.numel()
    return {"total": total, "embedding tables": tables, "non-embedding": total - tables}


def recipe_params(args: T.Hyperparameters) -> dict:
    with torch.device("meta"):
        model = T.GPT(args)
    total = sum(p.numel() for p in model.parameters())
    vocab_sized = {args.padded_vocab_size, args.ngram_rows}  # token, value, bigram tables and the head
    tables = sum(p.numel() for p in model.parameters() if vocab_sized & set(p.shape))
    return {"total": total, "embedding tables": tables, "non-embedding": total - tables}


def selected_ablations(only: str) -> list[int]:
    """Indices into ABLATIONS that --only picks, the full recipe (0) always first: every row whose name
    contains one of the comma-separated substrings, or the one row whose name contains the whole value
    (a name may hold a comma itself)."""
    if not only:
        return list(range(len(ABLATIONS)))
    names = [name.lower() for name, _ in ABLATIONS]
    whole = only.strip().lower()
    parts = [whole] if sum(whole in n for n in names) == 1 else [o.strip() for o in whole.split(",") if o.strip()]
    unmatched = [o for o in parts if not any(o in n for n in names)]
    if unmatched:
        raise SystemExit(f"error: --only {', '.join(map(repr, unmatched))} names no ablation row; the rows: "
                         + "; ".join(name for name, _ in ABLATIONS[1:]))
    return [0] + [i for i, n in enumerate(names) if i and any(o in n for o in parts)]


def run_ablations(a, device: torch.device) -> None:
    """One recipe run per switched-off component and seed, each saved; then the table."""
    rows = selected_ablations(a.only)
    seeds = [int(x) for x in a.seeds.split(",")]
    data = prepare(a)
    base = recipe_args(a.preset, data.train_glob, data.val_path, a.tokens, 0, data.val.val_tokens, device,
                       a.recipe_overrides, a.log_dir, model_dim=a.model_dim)
    print(f"ablations: --preset {a.preset}, {base.num_iterations}+{base.extension_iterations} steps, "
          f"{sum(schedule_tokens(base)):,} train tokens each, seeds {seeds}, final val loss on {base.val_tokens:,} val tokens")
    for i in rows:
        name, spec = ABLATIONS[i]
        overrides, edit = ({}, spec) if callable(spec) else (spec, None)
        for seed in seeds:
            file = "recipe" if i == 0 else "ablate_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
            if saved(a.save, f"{file}_s{seed}"):
                continue
            # a full recipe run not saved yet is trained as --run recipe trains it (its --evals curve), so the
            # ratio can use it; the rows need only their final loss
            args = recipe_args(a.preset, data.train(seed), data.val_path, a.tokens, a.evals if i == 0 else 0,
                               data.val.val_tokens, device, {**a.recipe_overrides, **overrides, "seed": seed},
                               a.log_dir, edit, model_dim=a.model_dim)
            t = time.perf_counter()
            curve = save_recipe_run(a, data, seed, device, f"{file}_s{seed}", args, {"component": name},
                                    diverging_is_a_result=True)  # a diverging variant is a result, not a crash
            print(f"  {name:42s} seed {seed} {curve[-1][1]:8.4f}  ({time.perf_counter() - t:.0f}s)", flush=True)
    runs = read_runs(a.save, flag="--save")
    print(ablation_table(runs, folder_floors(a.save, runs)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="", help="train shard glob (default: the preset's, tiny Shakespeare)")
    ap.add_argument("--val", default="", help="val shard glob (default: the preset's)")
    ap.add_argument("--tokens", type=int, default=None, help=f"training tokens per run (default {DEFAULT_TOKENS:,})")
    ap.add_argument("--preset", default="demo", choices=sorted(T.PRESETS), help="model size of both recipes")
    ap.add_argument("--model_dim", type=int, default=0,
                    help="width of both sides (default: the preset's); heads of the preset's head size, MLP 4x as wide")
    ap.add_argument("--evals", type=int, default=8, help="validation points per curve")
    ap.add_argument("--val_tokens", type=int, default=None,
                    help=f"validation tokens (default: {EVEN_VAL_TOKENS:,} for --val_set even and tune, the preset's for first)")
    ap.add_argument("--val_set", default="even", choices=VAL_SETS,
                    help="even: documents chosen evenly over every val shard (the whole split when it holds fewer "
                         "than --val_tokens); tune: chosen the same way among the documents even leaves out, for choosing "
                         "rates; first: the first --val_tokens tokens (as runs saved before this flag)")
    ap.add_argument("--train_order", default="shuffled", choices=TRAIN_ORDERS,
                    help="shuffled: each seed permutes the training documents (seed 0 too) for both sides; "
                         "file: the shards' order for every seed (as runs saved before this flag)")
    ap.add_argument("--muon_lr", type=float, default=SPEEDRUN.muon_lr,
                    help="recipe NorMuon lr (default: the speedrun's; the demo preset's higher rates suit only its 63 steps)")
    ap.add_argument("--adam_lr", type=float, default=SPEEDRUN.adam_lr, help="recipe Adam lr (default: the speedrun's)")
    ap.add_argument("--classic_lr", type=float, default=None, help="default: the search winner in --save, else 1e-3")
    ap.add_argument("--classic_seq_len", type=int, default=None, help="default: the search winner, else 1024")
    ap.add_argument("--classic_batch_tokens", type=int, default=None, help="default: the search winner, else 16384")
    ap.add_argument("--classic_from", default="", help="use the search winner saved in this results folder")
    ap.add_argument("--search_lr", default="0.003,0.006", help="--run search: classic learning rates")
    ap.add_argument("--search_batch", default="4096,8192", help="--run search: classic batch sizes (tokens)")
    ap.add_argument("--search_seq", default="256,1024", help="--run search: classic contexts")
    ap.add_argument("--search_muon_lr", default="0.0115,0.023,0.046", help="--run recipe_search: NorMuon lrs")
    ap.add_argument("--search_adam_lr", default="0.004,0.008,0.016", help="--run recipe_search: Adam lrs")
    ap.add_argument("--recipe_from", default="",
                    help="recipe learning rates: the --run recipe_search winner saved in this results folder")
    ap.add_argument("--run", default="both", choices=("both", "recipe", "classic", "search", "recipe_search"),
                    help="train one side only (processes can then share the machine and one --save folder)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (recipe, classic and ablation runs)")
    ap.add_argument("--save", default="", help="results folder: one JSON per run (default: a temporary one)")
    ap.add_argument("--load", default="", help="print the tables of a results folder and plot it (no training)")
    ap.add_argument("--no_plot", action="store_true", help="--load: tables only")
    ap.add_argument("--compare", default="", metavar="A,B",
                    help="--load: instead of the tables, two of the folder's runs at each evaluation (A - B), where A "
                         "leads and trails, their best and last losses and the floor")
    ap.add_argument("--floor", action="store_true",
                    help="print the validation set and each --seeds floor of these data flags, then stop (no training)")
    ap.add_argument("--ablate", action="store_true", help="run the ablation table instead of the comparison")
    ap.add_argument("--only", default="", help="--ablate: comma-separated substrings of component names, or one whole name (commas and all)")
    ap.add_argument("--log_dir", default="", help="keep the run logs here: the recipe's train_gpt logs and each "
                    "classic run's printed output, <run>.txt (default: the results folder's logs/)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--cpu_dtype", default="auto", choices=("auto", *T.CPU_DTYPES),
                    help="CPU compute dtype of both sides, each settled per results folder: the recipe's train_gpt "
                         "--cpu_dtype (auto: that of the recipe runs in --save, else timed at the run's start) and the "
                         "classic's (auto: that of the classic runs in --save, else timed the same way)")
    ap.add_argument("--smoke", action="store_true", help="a few steps of the test preset (checks the tooling only)")
    a = ap.parse_args(argv)
    a.command = sys.argv if argv is None else [sys.argv[0], *argv]
    if a.val_tokens is not None and a.val_tokens < 1:
        raise SystemExit(f"error: --val_tokens {a.val_tokens} must be >= 1")
    if a.compare and not a.load:
        raise SystemExit("error: --compare A,B needs --load DIR, the results folder holding both runs")
    if a.load:
        if a.compare:
            print(compare_runs(a.load, a.compare))
        else:
            report(a.load, a.tokens, plot=not a.no_plot)
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available; use --device cpu")
    device = torch.device("cuda" if a.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        T.keep_freed_memory()  # the classic's (T, 50304) logits would be mapped and page-faulted every step
    if a.smoke:
        a.preset, a.evals, a.search_seq, a.search_batch = "test", 1, "128", "1024"
        a.tokens, a.val_tokens = a.tokens or SMOKE_TOKENS, a.val_tokens or 1024
    a.default_batch, a.default_seq = (1024, 128) if a.smoke else (16_384, 1024)
    a.tokens = a.tokens or DEFAULT_TOKENS
    a.model_dim = model_args(a.preset, a.model_dim).model_dim  # checked, and recorded even when the preset's
    a.recipe_overrides = {"muon_lr": a.muon_lr, "adam_lr": a.adam_lr, "cpu_dtype": a.cpu_dtype}
    if a.recipe_from:
        win = recipe_search_winner(read_runs(a.recipe_from, RECIPE_SEARCH_PREFIX, "--recipe_from")) \
            if os.path.isdir(a.recipe_from) else None
        if win is None:
            raise SystemExit(f"error: --recipe_from {a.recipe_from}: no recipe search runs there; run "
                             f"--run recipe_search --save {a.recipe_from} first")
        a.recipe_overrides.update(muon_lr=win["recipe_muon_lr"], adam_lr=win["recipe_adam_lr"])
        print(f"recipe: the search winner saved in {a.recipe_from}: NorMuon lr {win['recipe_muon_lr']:g}, "
              f"Adam lr {win['recipe_adam_lr']:g}")
    if a.tokens < 1 or a.evals < 0:
        raise SystemExit("error: --tokens must be >= 1 and --evals >= 0")
    try:
        [int(x) for x in a.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"error: --seeds {a.seeds!r}: give comma-separated integers, e.g. 0,1,2") from None
    a.commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        a.save = a.save or os.path.join(tmp, "results")
        a.log_dir = a.log_dir or os.path.join(a.save, "logs")
        a.data_dir = os.path.join(tmp, "data")
        if a.floor:
            data = prepare(a, check=False)
            for seed in (int(x) for x in a.seeds.split(",")):
                f = data.floor(seed)
                print(f"seed {seed}: unigram {f['unigram']:.4f}, interpolated bigram {f['bigram']:.4f} "
                      f"(weight {f['bigram_weight']:.3f})")
            return
        (run_ablations if a.ablate else run_sides)(a, device)


if __name__ == "__main__":
    main()
