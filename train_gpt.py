"""Speedrun GPT training: one file, read top to bottom in the order data flows.

    torchrun --standalone --nproc_per_node=8 train_gpt.py            # 8xH100 speedrun
    torchrun --standalone --nproc_per_node=2 train_gpt.py --preset demo   # CPU demo (gloo)
    python train_gpt.py --help                                         # every knob

Importing this file has no side effects (tests and data scripts import it): the process group,
devices, files and compilation all start in main(). Each section opens with record #89's code, then
the alternatives and ablations it may run instead, the tables that name them, and the argument checks
beside what they check. A section uses only what it or a section above it defines: copy the file from
the top through any section, put it beside triton_kernels.py, and it runs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import heapq
import math
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import triton_kernels

# ----------------------------------------------------------------------------------------------
# The recipe: stages, layers, per-parameter optimizer settings, run knobs, constants, presets, flags
# ----------------------------------------------------------------------------------------------

# Record #89 (modded-nanogpt PR #342) as data: the schedule and the forward read these rows, so a
# change of recipe is a change of a row, and an ablation a dataclasses.replace over rows (ABLATIONS).
# Below: the command line's words and columns, the ablations, the presets, the flags' ranges and checks.

# -- stages: what changes along the run ---------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """One row of record #89's schedule: stage s ends at step round(num_iterations x the shares up to s);
    the last row (share None) is the extension, extension_iterations more steps (plan_step)."""
    share: float | None        # share of num_iterations; None: the extension
    batch_tokens: int = 0      # global tokens per step, for any world size
    max_doc_len: int = 0       # documents are truncated to this many tokens
    windows: tuple = (1, 1)    # (short, long) attention windows in window_block_size blocks
    lr_mult: float = 1.0       # held until the cooldown; the extension's is its floor (0.15)
    mtp_start: tuple = (1.0,)  # weights of the targets t+1, t+2, t+3,
    mtp_end: tuple = (1.0,)    # linear from start to end over the row
    prefix_start: float = 0.0  # weight of the prefix-token term (record #89), likewise
    prefix_end: float = 0.0
    prefix_steps: int = 0      # 0: linear; k: k equal steps from prefix_start towards prefix_end (record #92)
    untie: bool = False        # the embedding unties from the head at this row's first step made odd

STAGES = (  # three equal stages (423, 424, 423 of 1270 steps), then the 15-step extension
    Stage(1 / 3, batch_tokens=131_072, max_doc_len=896, windows=(1, 3), lr_mult=1.0,
          mtp_start=(1.0, 0.5, 0.25), mtp_end=(1.0, 0.5, 0.0), prefix_start=0.25, prefix_end=0.25),
    Stage(1 / 3, batch_tokens=262_144, max_doc_len=2048, windows=(3, 7), lr_mult=1.52,
          mtp_start=(1.0, 0.5, 0.0), mtp_end=(1.0, 0.0, 0.0), prefix_start=0.25, prefix_end=0.0),
    Stage(1 / 3, batch_tokens=393_216, max_doc_len=2048, windows=(5, 11), lr_mult=1.73,
          mtp_start=(1.0, 0.0, 0.0), mtp_end=(1.0, 0.0, 0.0), untie=True),
    Stage(None, batch_tokens=393_216, max_doc_len=2048, windows=(6, 13), lr_mult=0.15,
          mtp_start=(1.0, 0.0, 0.0), mtp_end=(1.0, 0.0, 0.0)),
)

# Record #92's schedule (its TRAINING_STAGES; with num_iterations 1,174, extension_iterations 20 and
# cooldown_start 0.2 its stage ends 0, 320, 681, 1,107, 1,174, 1,194): batch 8 -> 16 -> 24 sequences of
# 16,384 tokens, a taper at 20 (lr x sqrt(20/24)), the extension at 8; the lr floor an absolute 0.30; the
# prefix term 0.25, then 0.20 / 0.15 / 0.10 / 0.05 by quarter of stage 1; the untie at 1,175.
RECORD92_STAGES = (
    Stage(320 / 1174, batch_tokens=131_072, max_doc_len=896, windows=(1, 3), lr_mult=1.0,
          mtp_start=(1.0, 0.5, 0.25), mtp_end=(1.0, 0.5, 0.0), prefix_start=0.25, prefix_end=0.25),
    Stage(361 / 1174, batch_tokens=262_144, max_doc_len=2048, windows=(3, 7), lr_mult=1.52,
          mtp_start=(1.0, 0.5, 0.0), mtp_end=(1.0, 0.0, 0.0), prefix_start=0.20, prefix_end=0.0, prefix_steps=4),
    Stage(426 / 1174, batch_tokens=393_216, max_doc_len=3072, windows=(5, 11), lr_mult=1.73,
          mtp_start=(1.0, 0.0, 0.0), mtp_end=(1.0, 0.0, 0.0)),
    Stage(67 / 1174, batch_tokens=327_680, max_doc_len=3072, windows=(5, 11), lr_mult=1.73 * (20 / 24) ** 0.5,
          mtp_start=(1.0, 0.0, 0.0), mtp_end=(1.0, 0.0, 0.0)),
    Stage(None, batch_tokens=131_072, max_doc_len=3072, windows=(6, 13), lr_mult=0.30,
          mtp_start=(1.0, 0.0, 0.0), mtp_end=(1.0, 0.0, 0.0), untie=True),
)

# -- layers: what each layer does ---------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    """One row of the per-layer table (record #89's layer roles)."""
    attention: str = "plain"   # plain heads | paired heads (two slots a token) | none: the U-net skip instead |
                               # off: no attention (record #92's), the residual x resid_lambda and its injections
    window: str = ""           # short | long sliding window ("" without attention)
    value_embed: bool = False  # a value-embedding table is added to V
    xsa: bool = False          # XSA: y loses its projection on the own value
    gate: bool = False         # linear per-head output gate
    dc: bool = False           # the dynamically composed heads term
    key_offset: bool = False   # K's unrotated half shifted one position back
    input: str = "x"           # attention reads norm(x) (the residual) or norm(h) (the save_h layer's output)
    mudd: bool = False         # the MUDD layer (MUDD, arXiv 2502.12170): the last one
    save_skip: bool = False    # output is the U-net skip source
    save_h: bool = False       # output is h
    post_gates: bool = False   # MUDD gate 1 runs on the residual entering this layer (gate 0 before it)
    x0: bool = True            # a gated x0 is added after attention (record #92 leaves rows out)
    ngram: bool = True         # a gated n-gram feature xb is added after attention (row 0: to x0 before it)
    mlp: bool = True           # False: no MLP (record #92's removed layer), the residual x resid_lambda; its bank
                               # slots stay, at lr 0
    parallel_mlp: bool = False # a second MLP on the same input, added at the same post lambda (record #92's layer 8);
                               # its bank slots follow every layer's
    narrow_qk: bool = False    # Q and K head_dim/2 wide, all of it rotating (record #92's d_qk 64): the first half
                               # of each head's rows in the bank
    narrow_v: bool = False     # V and O head_dim/2 wide too (#92's d_v 64 rows): the first half of V's rows, O's columns

    @property
    def has_attention(self) -> bool:
        return self.attention in ("plain", "paired")

LAYERS = (
    Layer("paired", "short"),                                                            # 0
    Layer("plain", "short", value_embed=True, xsa=True),                                 # 1
    Layer("paired", "short", value_embed=True),                                          # 2
    Layer("plain", "long", xsa=True, gate=True, key_offset=True, save_skip=True),        # 3
    Layer("plain", "short", xsa=True, post_gates=True),                                  # 4
    Layer("paired", "short"),                                                            # 5
    Layer("none"),                                                                       # 6: the skip from 3
    Layer("plain", "short", xsa=True, save_h=True),                                      # 7
    Layer("plain", "short", value_embed=True, input="h"),                                # 8
    Layer("paired", "short", value_embed=True, input="h"),                               # 9
    Layer("plain", "long", value_embed=True, gate=True, dc=True, key_offset=True, input="h", mudd=True),  # 10
)

# Record #92's rows: narrow (64-wide, fully rotating) Q/K on the paired rows and 1, 8, V/O 64 wide on 1 and 8; wide
# 3 and 10; no attention on 4 and 9, layer 7 removed (its residual bookkeeping kept: h is its output); x0 added on
# 0, 1, 2, 4, 5, 7 and the n-gram features on 0, 1, 4, 5, 9; a parallel MLP on 8; value embeddings on 1, 2, 8, 10.
RECORD92_LAYERS = (
    Layer("paired", "short", narrow_qk=True),                                                      # 0
    Layer("plain", "short", value_embed=True, xsa=True, narrow_qk=True, narrow_v=True),            # 1
    Layer("paired", "short", value_embed=True, narrow_qk=True, ngram=False),                       # 2
    Layer("plain", "long", xsa=True, gate=True, key_offset=True, save_skip=True, x0=False, ngram=False),  # 3
    Layer("off", post_gates=True),                                                                 # 4
    Layer("paired", "short", narrow_qk=True),                                                      # 5
    Layer("none"),                                                                                 # 6: the skip from 3
    Layer("off", mlp=False, save_h=True, ngram=False),                                             # 7
    Layer("plain", "short", value_embed=True, input="h", narrow_qk=True, narrow_v=True, parallel_mlp=True,
          x0=False, ngram=False),                                                                  # 8
    Layer("off", x0=False),                                                                        # 9
    Layer("plain", "long", value_embed=True, gate=True, dc=True, key_offset=True, input="h", mudd=True),  # 10
)

# -- the per-parameter optimizer table (record #89's param_table; ParamConfig's fields) ----------

GATE_BETAS, LAMBDA_BETAS, EMBED_BETAS, TABLE_BETAS = (0.9, 0.99), (0.9, 0.95), (0.5, 0.95), (0.75, 0.95)
MLP_DOWN_LR_MUL = 2.0  # the MLP bank's down-projections (odd entries, padding included) step at 2x
NORMUON_BETA2 = 0.9    # NorMuon's second-moment decay (the neuron-wise variance, arXiv 2510.05491)
ADAM_EPS = 1e-10
PARAM_TABLE = {
    "qk_bank": dict(optimizer="normuon", comms="sharded"),
    "vo_bank": dict(optimizer="normuon", comms="sharded"),
    "mlp_bank": dict(optimizer="normuon", comms="sharded"),
    "scalars": dict(optimizer="adam", comms="replicated", lr_mul=5.0, wd_mul=0.0, betas=GATE_BETAS),
    "smear_gate": dict(optimizer="adam", comms="replicated", lr_mul=0.01, wd_mul=0.0, betas=GATE_BETAS),
    "ve_gate_bank": dict(optimizer="adam", comms="replicated", lr_mul=1.0, wd_mul=1.0, betas=GATE_BETAS),
    "lm_head": dict(optimizer="adam", comms="sharded", lr_mul=1.0, wd_mul=150.0, betas=EMBED_BETAS),
    "bigram_embed": dict(optimizer="adam", comms="sharded_sparse", lr_mul=75.0, wd_mul=5.0, betas=TABLE_BETAS),
    "post_lambdas": dict(optimizer="adam", comms="replicated", lr_mul=1.0, wd_mul=0.0, betas=LAMBDA_BETAS),
    "resid_lambdas": dict(optimizer="adam", comms="replicated", lr_mul=5.0, wd_mul=0.0, betas=LAMBDA_BETAS),
    "value_embeds": dict(optimizer="adam", comms="sharded", lr_mul=75.0, wd_mul=5.0, betas=TABLE_BETAS),
    "embed": dict(optimizer="adam", comms="sharded", lr_mul=1.0, wd_mul=150.0, betas=EMBED_BETAS),
    "mudd_w1": dict(optimizer="adam", comms="replicated", lr_mul=0.25, wd_mul=1.0, betas=GATE_BETAS),
    "mudd_w2": dict(optimizer="adam", comms="replicated", lr_mul=0.25, wd_mul=1.0, betas=GATE_BETAS),
    "mudd_w2g": dict(optimizer="adam", comms="replicated", lr_mul=0.25, wd_mul=1.0, betas=GATE_BETAS),  # #92's mix
    "mudd_b2": dict(optimizer="adam", comms="replicated", lr_mul=0.25, wd_mul=0.0, betas=GATE_BETAS),
    "mudd_gate_w1": dict(optimizer="adam", comms="replicated", lr_mul=0.1, wd_mul=1.0, betas=GATE_BETAS),
    "mudd_gate_w2": dict(optimizer="adam", comms="replicated", lr_mul=0.1, wd_mul=1.0, betas=GATE_BETAS),
    "mudd_gate_b2": dict(optimizer="adam", comms="replicated", lr_mul=0.1, wd_mul=0.0, betas=GATE_BETAS),
    "_mudd_gate_scale": dict(optimizer="adam", comms="replicated", lr_mul=0.1, wd_mul=0.0, betas=GATE_BETAS),
}
TABLE_LABELS = ("value_embeds", "bigram_embed")  # the embedding tables (--table_cadence steps both)
# A label of the table or the orders whose parameter a model does not have (a switch's, off) is left out.
# The record's orders. Scatter: big banks' reductions start first. Work: small parameters are updated
# first so that the banks' reductions have landed before their (long) orthogonalization.
SCATTER_ORDER = ("qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "ve_gate_bank", "lm_head",
                 "bigram_embed", "post_lambdas", "resid_lambdas", "value_embeds", "embed", "mudd_w1", "mudd_w2",
                 "mudd_w2g", "mudd_b2", "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "_mudd_gate_scale")
WORK_ORDER = ("scalars", "smear_gate", "ve_gate_bank", "mudd_b2", "mudd_gate_b2", "_mudd_gate_scale",
              "post_lambdas", "resid_lambdas", "mudd_w2", "mudd_w2g", "mudd_gate_w2", "value_embeds", "bigram_embed",
              "mudd_w1", "mudd_gate_w1", "lm_head", "embed", "qk_bank", "vo_bank", "mlp_bank")

# -- run knobs ----------------------------------------------------------------------------------

@dataclass
class Hyperparameters:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760           # validation covers exactly these tokens, for any world size
    # model: the rows above, and the sizes
    stages: tuple = STAGES
    layers: tuple = LAYERS
    vocab_size: int = 50257
    padded_vocab_size: int = 50304
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 3072
    ngram_rows: int = 377_280              # rows of the hashed n-gram table (bigram_embed), every channel's
    ngram_channels: int = 1                # 1: record #89's bigram rows; 2: record #92's bigram and trigram halves
    gate_channels: int = 12                # input channels of the VE and smear gates
    mudd_hidden: int = 64                  # hidden width of the MUDD gate and layer MLPs
    dc_window: int = 112                   # DC's own window in tokens (keys t-111 .. t)
    window_block_size: int = 128           # sliding windows are counted in blocks of this many tokens
    windows_init: tuple = (1, 3)           # (short, long) in blocks at init; long = YaRN reference
    final_val_windows: tuple = (6, 20)     # the last validation's; YaRN stays at the extension's
    attn_scale: float = 0.1                # at windows_init, x sqrt(128 / head_dim); YaRN grows it
    yarn_chains: str = "long"              # long (record #89's): every row's rotary and scale follow the long
                                           # window; own (record #92's): a short-window row's follow the short one
    attn_scale_short: float = 0.1          # own: the short-window rows' attn_scale (#92: 0.13; its long rows 0.085)
    fp8: bool = True                       # FP8 LM head and MLPs in training (GPUs with FP8 tensor cores)
    fp8_up_fast_accum: bool = True         # the record's FP8 MLP up-projection: fast accumulation
    attention_kernel: str = "auto"         # CUDA: flex | varlen (the record's FA3) | auto (per kind)
    virtual_seq_cap: int = 0               # record #92's: training attention in segments of at most this many
                                           # tokens inside a document (#92: 2560); 0 (the record's): whole documents
    # schedule: stage boundaries scale with num_iterations
    num_iterations: int = 1270             # scheduled steps, then extension_iterations at the last row
    extension_iterations: int = 15
    micro_batches: int = 8                 # sequences per step over ranks x accumulation steps
    cooldown_start: float = 0.4            # lr decay starts at step int(cooldown_start * num_iterations)
    momentum_min: float = 0.85
    momentum_max: float = 0.95
    momentum_warmup: float = 300 / 1270    # x num_iterations steps: momentum_min -> max
    momentum_cooldown: float = 50 / 1270   # x num_iterations last steps of the run: back down
    # record #92's sampled softmax: ((first step as a fraction of num_iterations, P), ...), P candidate classes
    # in the training loss from there on (0: all); () (the record's): the full softmax on every step
    sampled_softmax: tuple = ()
    # optimizer: NorMuon (arXiv 2510.05491) with Polar Express (arXiv 2505.16932), Adam elsewhere
    muon_lr: float = 0.023
    muon_wd: float = 1.2
    adam_lr: float = 0.008
    adam_wd: float = 0.005
    orthogonalizer: str = "polar_express"  # or "gram_newton_schulz", "auto" (Gram N-S for the MLP bank)
    bank_ownership: str = "padded"         # the record's: banks padded to N x world size | "balanced"
    # evaluation, logging, checkpoints
    val_seq_len: int = 262_144             # one sequence per rank and val step on 8 GPUs (the record's)
    val_loss_every: int = 250              # 0: only at the end
    log_dir: str = "logs"
    save_every: int = 0                    # checkpoint every N steps and at the end (0: none)
    keep_checkpoints: int = 0              # keep only this run's newest N checkpoints (0: all)
    checkpoint_dir: str = "checkpoints"
    resume: str = ""                       # checkpoint directory to continue from
    compile: bool = True
    cuda_graphs: bool = True               # CUDA, compiled: steps replayed as CUDA graphs (StepGraphs)
    cpu_dtype: str = "auto"                # CPU only: bf16 | fp32 | auto (the faster, timed at start-up)
    sample_tokens: int = 0                 # after training, print a sampled continuation this long
    # component switches outside the rows (ABLATIONS edits rows for the others): off, parameters stay, frozen
    matrix_optimizer: str = "normuon"      # banks: normuon | muon (no variance reduction) | adamw | anvil
    # anvil (record #92's ANVIL): its decay, gated by the slow rail's sign; the rail beta (the Nesterov look-ahead,
    # in place of momentum_*): min -> max over the warm-up, back over the cool-down (fractions of num_iterations);
    # from `engage` x num_iterations on, the fast rail's beta and weight in the blend are fixed (before: the rail
    # beta, weight 1: plain Nesterov momentum); the slow rail's beta
    anvil_wd: float = 2.25
    anvil_rail_beta: tuple = (0.85, 0.93, 240 / 1174, 50 / 1174)  # (min, max, warm-up, cool-down)
    anvil_rails: tuple = (514 / 1174, 0.85, 0.4385, 0.98)         # (engage, fast beta, fast weight, slow beta)
    weight_blends: bool = False            # record #92's end-of-run weight blends (BLENDS) before the final validation
    # record #92's cadence of the tables (TABLE_LABELS), (start, period, phase): from step round(start x
    # num_iterations) the value embeddings and the n-gram table step only where step % period == phase, each
    # update with betas^(period/2) and wd_mul x period/2 (#92: (336 / 1174, 4, 3)); () (the record's): every Adam step
    table_cadence: tuple = ()
    ngram_optimizer: str = "adam"          # the n-gram table's: adam (record #89's) | row_adam (record #92's)
    table_lr_mul: float = PARAM_TABLE["value_embeds"]["lr_mul"]  # the tables' (TABLE_LABELS) Adam lr_mul (#92: 70)
    adamw_bank_lr_mul: float = 0.25        # adamw: the banks' lr, x adam_lr (Adam on every step)
    value_embeds: bool = True              # value-embedding tables added to V (the value_embed rows)
    bigram_embed: bool = True              # bigram hash embedding injected at every layer
    bigram_signs: bool = True              # the bigram rows times a +-1 table keyed on (prev XOR cur)
    smear: bool = True                     # one-token look-back on the embeddings
    unet_skip: bool = True                 # the attention-none row adds the save_skip layer's output
    backout: bool = True                   # the post-loop MUDD mixing (its h coefficient starts at -0.5)
    mudd: bool = True                      # false: MUDD coefficients are learned constants, not per token
    mudd_post_mix: int = 5                 # the post-loop MUDD mix: 5 sources, a coefficient per token (record #89's);
                                           # 10 (record #92's): MUDD_MIX10_SOURCES, per token and 64-channel group
    # run
    seed: int = 0
    run_id: str = ""                       # empty: a fresh uuid per run

    @property
    def num_layers(self) -> int:
        return len(self.layers)

# -- recipe constants: FP8 scales, Polar Express, MUDD biases, initial values -----------------

# FP8 (record #89): the LM head's static scales, and the FP8 MLPs' delayed-scale headroom (FP8 sections)
FP8_HEAD_X_SCALE = 100 / 448      # activations (rms-normed, |x| rarely above ~100)
FP8_HEAD_W_SCALE = 1.6 / 448      # head weights
FP8_HEAD_GRAD_SCALE = 0.75 / 448  # gradient of the summed loss, multiplied by the loss scale at run time
FP8_ACT_HEADROOM = 1.80           # post may grow this much over the previous forward's amax before clipping
FP8_DOWN_W_HEADROOM = 1.12        # W2 may grow this much over one optimizer step before clipping
FP8_BOOTSTRAP_STEPS = 16          # optimizer steps 0..15 quantise W2 with its current amax

# Polar Express's five iterations (a, b, c) of p(x) = a x + b x^3 + c x^5 (arXiv 2505.16932)
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

BIGRAM_SIGN_ROWS = 8192  # rows of the +-1 table the bigram embedding is multiplied by
MUDD_LAYER_SCALE = 0.1   # fixed output scale of the MUDD layer MLPs (biases are stored x10)
# MUDD (arXiv 2502.12170) layer MLP outputs in the record's order, and their biases before the x0.1 scale:
# layer 0 runs at the mudd row (x_gain: x's coefficient is 1 + x_gain), layer 1 after the loop (h: the backout).
MUDD_LAYER_NAMES = (
    ("v_cache0", "v_h", "v_x", "x_cache0", "x_h", "x_gain", "ve_gate_first_half", "ve_gate_second_half",
     "resid_attn", "post_attn", "x0", "bigram", "resid_mlp", "post_mlp"),
    ("cache0", "h", "mudd_input", "ve0", "skip_source"),
)
MUDD_LAYER_OUTPUTS = tuple(len(names) for names in MUDD_LAYER_NAMES)  # (14, 5)
MUDD_LAYER_BIASES = ({"ve_gate_first_half": 20.0, "ve_gate_second_half": 20.0, "resid_attn": 10 * math.sqrt(1.1),
                      "post_attn": 10.0, "bigram": 0.5, "resid_mlp": 10 * math.sqrt(1.1), "post_mlp": 10.0},
                     {"h": -5.0})
# MUDD gate biases before the gate scale (0.1 at init): output gates start at 0.25, bigram 0.05, skip 0.5, DC w1 1
MUDD_GATE_BIASES = {"gate": 2.5, "bigram": 0.5, "skip": 5.0, "dc_w1": 10.0}
# Record #92's post-loop mix (--mudd_post_mix 10): MUDD layer 1's coefficients for these sources (record #89's five
# first; "ve.k": value-embedding table k; mlp_input: the last MLP's normed input; h_normed: norm(h)), each plus a
# delta per MUDD_GROUP_WIDTH-channel group from the zero-initialised mudd_w2g (coefficient, group, hidden)
MUDD_MIX10_SOURCES = ("cache0", "h", "mudd_input", "ve.0", "skip_source", "ve.1", "ve.-1", "ve.-2", "mlp_input",
                      "h_normed")
MUDD_GROUP_WIDTH = 64
# Initial values (the record's; GPT.reset_parameters): projections' uniform std x sqrt(D), the tables' normal stds;
# draw_ranks: the MLP up-projections are drawn for a bank padded for this many ranks (the record's 8 GPUs: 12 for
# 11 layers, the padding's too), on any number of ranks, so that a seed gives every world size the same model
INIT = dict(projection_std=0.5, lm_head_std=0.005, value_embed_std=0.01, qkv_lambda=0.5, o_lambda=1.0,
            skip_lambda=-1.5, resid_lambda=math.sqrt(1.1), post_lambda=1.0, mudd_gate_scale=0.1, draw_ranks=8)

# ---- The command line: --layers words, --stage_<column> columns ------------------------------

# --layers takes the rows as words, one string a row: "attn long offset ve gate dc from_h mudd".
LAYER_WORDS = {
    "attn": ("attention", "plain"), "paired": ("attention", "paired"), "skip": ("attention", "none"),
    "no_attn": ("attention", "off"),
    "short": ("window", "short"), "long": ("window", "long"), "ve": ("value_embed", True), "xsa": ("xsa", True),
    "gate": ("gate", True), "dc": ("dc", True), "offset": ("key_offset", True), "from_h": ("input", "h"),
    "mudd": ("mudd", True), "save_skip": ("save_skip", True), "save_h": ("save_h", True),
    "post_gates": ("post_gates", True), "no_x0": ("x0", False), "no_ngram": ("ngram", False),
    "no_mlp": ("mlp", False), "parallel_mlp": ("parallel_mlp", True), "narrow_qk": ("narrow_qk", True),
    "narrow_v": ("narrow_v", True),
}

def layer_words(row: Layer) -> str:
    """The row in --layers words: 'attn long ve gate dc offset from_h mudd'."""
    return " ".join(word for word, (name, value) in LAYER_WORDS.items() if getattr(row, name) == value)

def layers_from_words(rows) -> tuple:
    """--layers' strings as Layer rows (check_layers checks them)."""
    if not isinstance(rows, (tuple, list)) or not rows or not all(isinstance(r, str) for r in rows):
        raise ValueError(f"--layers must be a non-empty tuple of strings (one row per layer), got {rows!r}")
    layers = []
    for i, row in enumerate(rows):
        unknown = [w for w in row.split() if w not in LAYER_WORDS]
        if unknown:
            raise ValueError(f"--layers row {i} ({row!r}): unknown word(s) {unknown}; known: {', '.join(LAYER_WORDS)}")
        fields = {}
        for word in row.split():
            name, value = LAYER_WORDS[word]
            if name in fields and fields[name] != value:
                raise ValueError(f"--layers row {i} ({row!r}): more than one {name} ({fields[name]!r}, {value!r})")
            fields[name] = value
        if "attention" not in fields:
            raise ValueError(f"--layers row {i} ({row!r}): needs exactly one of attn, paired, skip, no_attn")
        layers.append(Layer(**fields))
    return tuple(layers)

def restaged(stages: tuple, **columns) -> tuple:
    """The rows with whole columns replaced, one value per row: restaged(STAGES, batch_tokens=(...))."""
    for name, values in columns.items():
        if len(values) != len(stages):
            raise ValueError(f"--stage_{name} needs {len(stages)} values (one per stage, extension included),"
                             f" got {len(values)}")
    return tuple(dataclasses.replace(row, **{name: values[i] for name, values in columns.items()})
                 for i, row in enumerate(stages))

_STAGE_COLUMNS = [f.name for f in dataclasses.fields(Stage)]
_ROW_FIELDS = ("stages", "layers")  # set through --stage_<column> and --layers, not whole

# ---- Ablations (--ablate): each switches one component off by editing rows -------------------

def _layers_with(args: Hyperparameters, **fields) -> Hyperparameters:
    """args with the fields set on every attention row (other rows have nothing to switch off)."""
    return dataclasses.replace(args, layers=tuple(
        dataclasses.replace(row, **fields) if row.has_attention else row for row in args.layers))

def _fixed_windows(args: Hyperparameters) -> Hyperparameters:
    """The last scheduled stage's windows from step 0 to the end (final validation too), at the YaRN
    reference itself: no YaRN step ever."""
    last = args.stages[-2].windows
    return dataclasses.replace(args, stages=restaged(args.stages, windows=(last,) * len(args.stages)),
                               windows_init=last, final_val_windows=last)

ABLATIONS = {
    "xsa": lambda a: _layers_with(a, xsa=False),
    "attn_gates": lambda a: _layers_with(a, gate=False),
    "dc": lambda a: _layers_with(a, dc=False),
    "key_offset": lambda a: _layers_with(a, key_offset=False),
    "from_h": lambda a: _layers_with(a, input="x"),
    "paired_heads": lambda a: dataclasses.replace(a, layers=tuple(
        dataclasses.replace(r, attention="plain") if r.attention == "paired" else r for r in a.layers)),
    "mtp": lambda a: dataclasses.replace(a, stages=tuple(  # the next-token term only
        dataclasses.replace(r, mtp_start=r.mtp_start[:1], mtp_end=r.mtp_end[:1]) for r in a.stages)),
    "prefix_loss": lambda a: dataclasses.replace(a, stages=tuple(
        dataclasses.replace(r, prefix_start=0.0, prefix_end=0.0) for r in a.stages)),
    "window_schedule": _fixed_windows,
}

def ablated(args: Hyperparameters, names) -> Hyperparameters:
    """args with the named ABLATIONS applied in order (--ablate xsa,dc)."""
    for name in names:
        if name not in ABLATIONS:
            raise ValueError(f"--ablate {name!r} is not one of {', '.join(ABLATIONS)}")
        args = ABLATIONS[name](args)
    return args

# ---- Presets: "demo" trains on a CPU in minutes, "test" is tiny --------------------------------

PRESETS: dict[str, dict] = {  # --preset: the speedrun's is the defaults
    "speedrun": {},
    "demo": dict(
        train_files="data/tinyshakespeare/tinyshakespeare_train_*.bin",
        val_files="data/tinyshakespeare/tinyshakespeare_val_*.bin",
        val_tokens=32_768,
        # width 128: the 50,304-wide LM head is most of a CPU step, and at width 256 an fp32 step (CPUs
        # without fast bf16) took ~2.3x as long for the same final loss
        model_dim=128, num_heads=2, head_dim=64, mlp_hidden=512,
        ngram_rows=20_011,
        layers=layers_from_words(("paired short", "attn short ve xsa save_skip",
                                  "attn long offset xsa gate post_gates", "skip save_h",
                                  "paired short ve from_h parallel_mlp", "attn long offset ve gate dc from_h mudd")),
        # record #92's parallel MLP and 10-source post-loop mix: final val 4.8747 against 4.8955 over 3 seeds,
        # each seed lower (records/record92_model_demo)
        mudd_post_mix=10,
        mudd_hidden=32, dc_window=56, window_block_size=64,
        num_iterations=75, extension_iterations=3,
        stages=restaged(STAGES, batch_tokens=(4_096, 8_192, 12_288, 12_288), max_doc_len=(512, 1024, 1024, 1024)),
        val_seq_len=1024, val_loss_every=25,
        # 78 steps give Adam 39 updates: the speedrun's rates (tuned for 1285 steps) leave the embedding
        # tables undertrained. Measured on this demo at 63 steps: Adam 0.024 / 0.032 / 0.045 -> val 5.15 /
        # 4.99 / 5.34, NorMuon 0.05 4.99
        muon_lr=0.035, adam_lr=0.032,
        compile=False,  # inductor's CPU compile of every graph would take most of the demo's budget
        sample_tokens=48,
    ),
    # Record #92 (modded-nanogpt PR #360) as switches on this code: its schedule, rows, loss, optimizer and blends.
    # Deviations: the n-gram table has 16M rows, not 84,602,880 (every rank holds the whole table and its gradient
    # here: #92's size fits no GPU; see --dry_run), the FP8 head and MLPs are off (the sampled softmax trains in
    # bf16), and the MUDD gates' outputs follow the rows (#92 allocates 26 + 41 whatever the rows).
    "record92": dict(
        stages=RECORD92_STAGES, layers=RECORD92_LAYERS, num_iterations=1174, extension_iterations=20,
        cooldown_start=0.2, mlp_hidden=2816, mudd_post_mix=10, virtual_seq_cap=2560,
        yarn_chains="own", attn_scale=0.085, attn_scale_short=0.13,
        ngram_rows=16_000_000, ngram_channels=2, ngram_optimizer="row_adam", table_cadence=(336 / 1174, 4, 3),
        table_lr_mul=70.0, matrix_optimizer="anvil", weight_blends=True, fp8=False,
        sampled_softmax=((0, 10240), (681 / 1174, 14336), (965 / 1174, 24576), (1107 / 1174, 0)),
    ),
    "test": dict(
        train_files="data/tinyshakespeare/tinyshakespeare_train_*.bin",
        val_files="data/tinyshakespeare/tinyshakespeare_val_*.bin",
        model_dim=64, num_heads=2, head_dim=32, mlp_hidden=256,
        ngram_rows=4_001,
        layers=layers_from_words(("paired short save_skip", "attn long offset ve xsa gate post_gates", "skip save_h",
                                  "attn long offset ve gate dc from_h mudd")),
        mudd_hidden=16, dc_window=14, window_block_size=16,
        num_iterations=6, extension_iterations=1, micro_batches=4,
        stages=restaged(STAGES, batch_tokens=(512, 1024, 1536, 1536), max_doc_len=(64, 128, 128, 128)),
        val_tokens=2048, val_seq_len=512, val_loss_every=3,
    ),
}

# ---- Flag parsing and validation -------------------------------------------------------------

def _parse_value(name: str, text: str, default):
    """Parse a command-line value into the type of the field's default."""
    try:
        if isinstance(default, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, tuple):
            import ast
            value = ast.literal_eval(text)
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            return tuple(tuple(v) if isinstance(v, list) else v for v in value)
        return type(default)(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        raise SystemExit(f"error: --{name} {text!r} is not a valid {kind} (default: {default!r})")

def parse_args(argv: list[str] | None = None) -> Hyperparameters:
    """`--preset NAME`, then `--field value` for any Hyperparameters field, `--stage_<column>` with one
    value per stage row, `--layers` as words, and `--ablate` names (applied last)."""
    defaults = Hyperparameters()
    parser = argparse.ArgumentParser(
        description="Speedrun GPT training. Any hyperparameter can be overridden: --field value.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="speedrun", choices=sorted(PRESETS),
                        help="base configuration the overrides apply to")
    for f in dataclasses.fields(Hyperparameters):
        if f.name not in _ROW_FIELDS:
            parser.add_argument(f"--{f.name}", default=None, metavar=type(getattr(defaults, f.name)).__name__.upper(),
                                help=f"(speedrun default: {getattr(defaults, f.name)!r})")
    for name in _STAGE_COLUMNS:
        parser.add_argument(f"--stage_{name}", default=None, metavar="TUPLE",
                            help=f"one value per stage row, extension last (speedrun: "
                                 f"{tuple(getattr(r, name) for r in STAGES)!r})")
    parser.add_argument("--layers", default=None, metavar="TUPLE",
                        help=f"one string of words per layer; words: {', '.join(LAYER_WORDS)}")
    parser.add_argument("--ablate", default="", metavar="NAMES",
                        help=f"comma-separated components to switch off: {', '.join(ABLATIONS)}")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the stage ends, parameters and memory per GPU at 8, 4, 2 and 1 GPUs, and exit")
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise SystemExit(f"error: unknown argument {unknown[0]!r}; `python train_gpt.py --help` lists every field")
    args = dataclasses.replace(defaults, **PRESETS[ns.preset])
    overrides = {}
    for f in dataclasses.fields(Hyperparameters):
        text = getattr(ns, f.name, None) if f.name not in _ROW_FIELDS else None
        if text is not None:
            overrides[f.name] = _parse_value(f.name, text, getattr(args, f.name))
    columns = {name: _parse_value(f"stage_{name}", getattr(ns, f"stage_{name}"), ())
               for name in _STAGE_COLUMNS if getattr(ns, f"stage_{name}") is not None}
    try:
        if columns:
            overrides["stages"] = restaged(args.stages, **columns)
        if ns.layers is not None:
            overrides["layers"] = layers_from_words(_parse_value("layers", ns.layers, ()))
        return ablated(dataclasses.replace(args, **overrides), [n for n in ns.ablate.split(",") if n.strip()])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

@dataclass(frozen=True)
class FlagRange:
    """Allowed values of a number: every number in it is in [lo, hi] (hi excluded if hi_open), finite,
    an int if integer; a tuple value has `shape` (None: any length, the same for siblings)."""
    lo: float
    hi: float = math.inf
    hi_open: bool = False
    integer: bool = False
    shape: tuple = ()

    def numbers(self, value, shape=None) -> list | None:
        """The numbers in value, or None if it is not a number / a tuple of this shape."""
        shape = self.shape if shape is None else shape
        if not shape:
            return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if not isinstance(value, (tuple, list)) or shape[0] not in (None, len(value)):
            return None
        parts = [self.numbers(v, shape[1:]) for v in value]
        if any(p is None for p in parts) or len({len(p) for p in parts}) > 1:
            return None
        return [x for p in parts for x in p]

    def allows(self, value) -> bool:
        nums = self.numbers(value)
        return nums is not None and all(
            (isinstance(x, int) or not self.integer and math.isfinite(x))
            and self.lo <= x and (x < self.hi if self.hi_open else x <= self.hi) for x in nums)

    def column(self, rows: int) -> "FlagRange":
        """The range of a tuple with one such value per row (a stage column on the command line)."""
        return dataclasses.replace(self, shape=(rows, *self.shape))

    def __str__(self) -> str:
        bounds = f">= {self.lo}" if self.hi == math.inf else f"in [{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        if not self.shape:
            return bounds if self.integer else f"a finite number {bounds}"
        count = "a tuple of" if self.shape == (None,) else " x ".join(str(n or "K") for n in self.shape)
        return f"{count} {'integers' if self.integer else 'finite numbers'} {bounds}"

# Every numeric knob's allowed values (FlagRange's fields), by field name: Stage's columns (one row's
# value), then Hyperparameters'. check_args gives a one-line error naming the flag for any other value.
_AT_LEAST_0, _AT_LEAST_1 = dict(lo=0, integer=True), dict(lo=1, integer=True)
_RATE, _FRACTION, _MOMENTUM = dict(lo=0), dict(lo=0, hi=1), dict(lo=0, hi=1, hi_open=True)
_WINDOWS = dict(lo=1, integer=True, shape=(2,))
KNOB_RANGES = dict(
    batch_tokens=_AT_LEAST_1, max_doc_len=_AT_LEAST_1, windows=_WINDOWS, lr_mult=_RATE, mtp_start=dict(lo=0, shape=(None,)),
    mtp_end=dict(lo=0, shape=(None,)), prefix_start=_RATE, prefix_end=_RATE, prefix_steps=_AT_LEAST_0,
    val_tokens=_AT_LEAST_1, vocab_size=_AT_LEAST_1, padded_vocab_size=_AT_LEAST_1, model_dim=_AT_LEAST_1,
    num_heads=_AT_LEAST_1, head_dim=_AT_LEAST_1, mlp_hidden=_AT_LEAST_1, ngram_rows=dict(lo=2, integer=True),
    ngram_channels=dict(lo=1, hi=2, integer=True), virtual_seq_cap=_AT_LEAST_0,
    mudd_post_mix=dict(lo=5, hi=10, integer=True),
    gate_channels=_AT_LEAST_1, mudd_hidden=_AT_LEAST_1, dc_window=_AT_LEAST_1, window_block_size=_AT_LEAST_1,
    windows_init=_WINDOWS, final_val_windows=_WINDOWS, attn_scale=_RATE, attn_scale_short=_RATE, num_iterations=_AT_LEAST_1,
    extension_iterations=_AT_LEAST_0, micro_batches=_AT_LEAST_1, cooldown_start=_FRACTION, momentum_min=_MOMENTUM,
    momentum_max=_MOMENTUM, momentum_warmup=_FRACTION, momentum_cooldown=_FRACTION, muon_lr=_RATE, muon_wd=_RATE,
    adam_lr=_RATE, adam_wd=_RATE, val_seq_len=_AT_LEAST_1, val_loss_every=_AT_LEAST_0, save_every=_AT_LEAST_0,
    keep_checkpoints=_AT_LEAST_0, sample_tokens=_AT_LEAST_0, adamw_bank_lr_mul=_RATE, anvil_wd=_RATE, table_lr_mul=_RATE,
    anvil_rail_beta=dict(lo=0, hi=1, shape=(4,)), anvil_rails=dict(lo=0, hi=1, shape=(4,)),
    table_cadence=dict(lo=0, shape=(None,)),
    seed=dict(lo=0, hi=2**63 - 1, integer=True), sampled_softmax=dict(lo=0, shape=(None, 2)))

def flag_range(field: dataclasses.Field) -> FlagRange | None:
    """A knob's allowed values (KNOB_RANGES), None for a field without a range."""
    allowed = KNOB_RANGES.get(field.name)
    return FlagRange(**allowed) if allowed else None

def check_stages(stages) -> None:
    """One-line ValueErrors naming the flag: every column in range, the shares, one extension row last."""
    if not isinstance(stages, tuple) or len(stages) < 2 or not all(isinstance(r, Stage) for r in stages):
        raise ValueError("--stages must be a tuple of >= 2 Stage rows (scheduled stages, then the extension)")
    for f in dataclasses.fields(Stage):
        allowed = flag_range(f)
        column = tuple(getattr(r, f.name) for r in stages)
        if allowed and not allowed.column(len(stages)).allows(column):
            raise ValueError(f"--stage_{f.name} {column!r} must be {allowed.column(len(stages))}")
    shares = [r.share for r in stages]
    if shares[-1] is not None or any(not isinstance(s, (int, float)) or isinstance(s, bool) or not 0 < s <= 1
                                     for s in shares[:-1]):
        raise ValueError(f"--stage_share {tuple(shares)!r}: scheduled stages need shares in (0, 1] and the last"
                         " row (the extension) None")
    if abs(sum(shares[:-1]) - 1) > 1e-9:
        raise ValueError(f"--stage_share {tuple(shares)!r}: the scheduled stages' shares must add up to 1")
    if len({len(r.mtp_start) for r in stages} | {len(r.mtp_end) for r in stages}) != 1:
        raise ValueError("--stage_mtp_start and --stage_mtp_end must give the same number (>= 1) of weights")

ATTENTION_KINDS = ("plain", "paired", "none", "off")  # Layer.attention's values

def check_layers(layers) -> None:
    """One-line ValueErrors naming --layers and the row: a table the model can build."""
    if not isinstance(layers, tuple) or not layers or not all(isinstance(r, Layer) for r in layers):
        raise ValueError(f"--layers must be a non-empty tuple of Layer rows, got {layers!r}")

    def fail(i, msg):
        raise ValueError(f"--layers row {i} ({layer_words(layers[i])}): {msg}")

    for i, r in enumerate(layers):
        if r.attention not in ATTENTION_KINDS or r.input not in ("x", "h"):
            fail(i, f"attention must be one of {', '.join(ATTENTION_KINDS)} and input x or h")
        if not r.has_attention and (r.window or r.value_embed or r.xsa or r.gate or r.dc or r.key_offset
                                    or r.input != "x" or r.mudd):
            fail(i, "a skip or no_attn row has no attention, so no window/offset/ve/xsa/gate/dc/from_h/mudd")
        if r.has_attention and r.window not in ("short", "long"):
            fail(i, "an attention row needs a short or long window")
        if r.attention == "paired" and (r.key_offset or r.xsa or r.dc):
            fail(i, "paired rows take no offset, xsa or dc")
        if (r.attention == "none" or r.mudd) and not (r.x0 and r.ngram):
            fail(i, "no_x0 and no_ngram are for attention and no_attn rows (a skip row adds neither; the mudd row's"
                    " come from MUDD)")
        if r.narrow_v and not r.narrow_qk or r.narrow_qk and (r.key_offset or r.dc or not r.has_attention):
            fail(i, "narrow_qk is for attention rows without offset or dc (both read full-width heads), and"
                    " narrow_v needs narrow_qk")
        if r.mudd and not r.mlp or r.parallel_mlp and not r.mlp:
            fail(i, "the mudd row keeps its MLP (MUDD mixes it), and a parallel_mlp row needs its MLP")

    def where(role):
        return [i for i, r in enumerate(layers) if getattr(r, role)]

    for role in ("save_skip", "save_h", "post_gates", "mudd"):
        if len(where(role)) != 1:
            raise ValueError(f"--layers: exactly one row must be {role}, got rows {where(role)}")
    if where("mudd") != [len(layers) - 1]:
        fail(where("mudd")[0], "the mudd row must be the last layer")
    if where("post_gates")[0] == 0:
        fail(0, "post_gates must come after layer 0 (gate 0 covers the layers before it)")
    for i, r in enumerate(layers):
        if r.attention == "none" and i <= where("save_skip")[0]:
            fail(i, "a skip row must come after the save_skip row")
        if (r.input == "h" or r.mudd) and i <= where("save_h")[0]:
            fail(i, "from_h and mudd rows must come after the save_h row")
    if not where("value_embed"):
        raise ValueError("--layers: at least one row must take a value embedding (the post-loop MUDD mixing reads table 0)")

# ----------------------------------------------------------------------------------------------
# Distributed setup
# ----------------------------------------------------------------------------------------------

@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0

def setup_distributed(force_cpu: bool = False) -> DistInfo:
    """Process group from torchrun's environment (NCCL on CUDA, gloo on CPU); plain `python`: world size 1."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() and not force_cpu
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        keep_freed_memory()
    if world_size > 1 or "RANK" in os.environ:
        if use_cuda:  # NCCL for GPU tensors; gloo for the few CPU tensors (the sparse exchange's counts)
            dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
        else:
            dist.init_process_group("gloo")
    return DistInfo(rank, world_size, local_rank, device)

def cuda_synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) without making the host wait: a CUDA copy goes non-blocking through pinned memory (a copy
    from pageable memory would drain the queue of launched kernels; the caching allocator keeps the buffer)."""
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)

def keep_freed_memory() -> bool:
    """CPU training: tell glibc to keep freed memory in the process heap. By default it maps every large
    block (logits, their gradient: hundreds of MB a step) afresh and returns it on free, so each step
    page-faults them in again; a small GPT with an unfused full-vocabulary head ran 1.7x faster with it
    (0.60 against 1.01 s a step). mallopt(M_MMAP_MAX, 0), and M_TRIM_THRESHOLD at the largest value mallopt's
    int takes (2 GiB of free heap top kept), as the environment's MALLOC_MMAP_MAX_=0 and
    MALLOC_TRIM_THRESHOLD_ would set at start-up; values the user set there are left alone. False where
    the C library has no mallopt (not glibc) or the setting was the user's."""
    if "MALLOC_MMAP_MAX_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))

# ----------------------------------------------------------------------------------------------
# FP8 custom ops: y = x @ w with float8 inputs and static scales
# ----------------------------------------------------------------------------------------------

# The compiled training graph (GPUs with FP8 tensor cores) reads e4m3 weight copies made once per optimizer
# step (GPT.quantize_fp8) and quantises activations in plain torch that inductor fuses into the norm before;
# the custom ops below run only what inductor cannot (the cuBLAS FP8 GEMMs, the up-projection and loss
# kernels): every eager op inside one is a host launch, and the step is host-bound. q = (t / scale) cast to
# float8 (e4m3fn saturates at +-448; e5m2 overflows to inf, the loss kernel's saturates). The LM head (FP8
# since record #25) has static scales: its input is rms-normalised and its weights and gradients stay in
# predictable ranges. The MLPs' scales are delayed (record #89, PR #342). Forward GEMMs use cuBLAS's fast
# accumulation, the backward's (sums over 50,304 logits and over every token) do not, as in record #89.

SCALE_ALIGN_BYTES = 16  # cuBLASLt reads scale pointers as 16-byte aligned: offsets 4, 8, 12 fail on H100
FP8_SCALE_STRIDE = SCALE_ALIGN_BYTES // 4  # fp32 entries per per-layer scale: each scale starts a 16-byte block
FP8_SCALE_FLOOR = 1e-12  # an all-zero tensor (W2 at init) still gets a finite scale
E4M3_MAX = triton_kernels.E4M3_MAX

def _quantize_fp8(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """t / scale cast to `dtype`, always returned row-major contiguous whatever t's strides are."""
    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    torch.div(t, scale, out=buf)
    return buf.to(dtype)

def _native_fp8(device: torch.device) -> bool:
    """FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

def _scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: float | torch.Tensor, scale_b: float | torch.Tensor,
                   out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) for float8 a, b: cuBLAS where it can, else in fp32 (float8 products are
    exact there). Scales: Python floats (static) or 0-d fp32 tensors on a's device (delayed)."""
    # torch.full launches a fill kernel; torch.tensor(..., device="cuda") would be a blocking copy
    sa, sb = (s if isinstance(s, torch.Tensor) else torch.full((), s, dtype=torch.float32, device=a.device)
              for s in (scale_a, scale_b))
    check_scaled_mm_args(a, b, sa, sb)
    if a.is_cuda and _native_fp8(a.device):  # CPUs always emulate (oneDNN's float8 matmul needs AVX512-FP16 or AMX)
        return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() @ b.float()) * (sa * sb)).to(out_dtype)

def check_scaled_mm_args(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    """Raise ValueError unless the operands suit cuBLAS's tensor-wise FP8 GEMM, on every device (a CPU
    accepts layouts cuBLAS rejects): 2-D float8, not both e5m2; a (M, K) row-major, b (K, N) column-major;
    M, K, N multiples of 16; each scale one fp32 value at a 16-byte aligned address."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"fp8 matmul: operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in _FP8_DTYPES or b.dtype not in _FP8_DTYPES:
        raise ValueError(f"fp8 matmul: operands must be float8_e4m3fn/float8_e5m2, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("fp8 matmul: cuBLAS has no e5m2 x e5m2 GEMM; make one operand float8_e4m3fn")
    (M, K), (K2, N) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"fp8 matmul: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if M % 16 or K % 16 or N % 16:
        raise ValueError(f"fp8 matmul: M, K, N must be multiples of 16, got M={M} K={K} N={N};"
                         " pad the token count / dims to a multiple of 16")
    if a.stride(1) != 1 or a.stride(0) < K:
        raise ValueError(f"fp8 matmul: first operand must be row-major, got strides {a.stride()}; use .contiguous()")
    if b.stride(0) != 1 or b.stride(1) < K:
        raise ValueError(f"fp8 matmul: second operand must be column-major, got strides {b.stride()};"
                         " use .T.contiguous().T")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"fp8 matmul: {name} must be a single float32 value, got {s.dtype} with {s.numel()} elements")
        if s.data_ptr() % SCALE_ALIGN_BYTES:
            raise ValueError(f"fp8 matmul: {name} sits at byte offset {s.storage_offset() * s.element_size()} of its storage,"
                             f" not {SCALE_ALIGN_BYTES}-byte aligned (cuBLASLt rejects it with CUBLAS_STATUS_NOT_SUPPORTED);"
                             " keep every scale in its own 16-byte block (FP8MLPState) or pass a fresh tensor")

def _fp8_transposed(t: torch.Tensor) -> torch.Tensor:
    """t^T as a contiguous copy, through the tiled transpose kernel on CUDA (float8 moved as bytes)."""
    out = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device)
    triton_kernels.transpose_copy(t.view(torch.uint8), out.view(torch.uint8))
    return out

def fp8_matmul_grads(g_f8: torch.Tensor, x_f8: torch.Tensor, w_f8: torch.Tensor, x_s: float, w_s: float,
                     grad_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx bf16, dw fp32) of y = x @ w from the e5m2 dy (M, N), e4m3 x (M, K) and column-major w (K, N),
    without fast accumulation (record #89)."""
    grad_x = _scaled_matmul(g_f8, _fp8_transposed(w_f8.T).T, grad_s, w_s, torch.bfloat16, fast_accum=False)
    grad_w = _scaled_matmul(_fp8_transposed(x_f8), _fp8_transposed(g_f8).T, x_s, grad_s, torch.float32,
                            fast_accum=False)
    return grad_x, grad_w

# ---- FP8 LM head with the training loss (record #89) --------------------------------------------
# The head's matmul and the softcapped multi-token loss in one op: the loss kernel writes dlogits
# straight into e5m2 (divided by grad_s, saturating), the operand of the backward matmuls, so no
# logits-sized gradient is written in bf16, then scaled and cast in passes of its own. The op gets both
# operands already in e4m3: x_f8 = e4m3(x / x_s) from the compiled graph (fp8_head_input), w_f8 =
# e4m3(w / w_s) made once per optimizer step (GPT.quantize_fp8, fp8_head_weight), not per micro-batch.

def fp8_head_input(x: torch.Tensor) -> torch.Tensor:
    """x (T, D) / FP8_HEAD_X_SCALE cast to e4m3, the quotient rounded to x's dtype (bf16) first, as the
    eager division in x's dtype does: plain torch, so inductor fuses it into the final norm. The
    rounding is written out because inductor computes a bf16 division in fp32 and would skip it.
    Detached: x's gradient comes through fp8_head_loss's x argument."""
    return (x.detach().float() / FP8_HEAD_X_SCALE).to(x.dtype).to(torch.float8_e4m3fn)

def fp8_head_weight(w: torch.Tensor) -> torch.Tensor:
    """The LM head w (D, V) / FP8_HEAD_W_SCALE in e4m3, returned as its transpose (V, D) row-major, so
    that .T is the column-major (D, V) operand cuBLAS wants."""
    return _quantize_fp8(w.T, FP8_HEAD_W_SCALE, torch.float8_e4m3fn)

@torch.library.custom_op("speedrun::fp8_head_loss", mutates_args=())
def fp8_head_loss(x: torch.Tensor, w: torch.Tensor, x_f8: torch.Tensor, w_f8: torch.Tensor, targets: torch.Tensor,
                  mtp_weights: torch.Tensor, prefix_ids: torch.Tensor | None, prefix_weight: torch.Tensor | None,
                  x_s: float, w_s: float, grad_s: float,
                  grad_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token training loss (T,) fp32 of logits = x_f8 (T, K) @ w_f8 (K, N, column-major) in float8 with scales
    x_s, w_s (triton_kernels.softcapped_ce_mtp's loss), the per-token next-token loss (T,) fp32 (no gradient), and
    the loss's gradient dlogits / grad_s in e5m2, which the backward reads. x (T, K) and w (K, N) are the bf16
    tensors x_f8 and w_f8 were quantised from: the forward reads only their shapes; they receive dx (bf16) and
    dw (fp32 cast to w's dtype). The backward uses the stored gradient whatever gradient reaches the loss (the
    loss kernel's rule): use it as sum(loss) * grad_scale, grad_s = FP8_HEAD_GRAD_SCALE * grad_scale."""
    _check_fp8_head_args(x, w, x_f8, w_f8, grad_s)
    logits = _scaled_matmul(x_f8, w_f8, x_s, w_s, torch.bfloat16, fast_accum=True)
    grid, args, meta, outputs = triton_kernels.ce_kernel_args(logits, targets, mtp_weights, prefix_ids,
                                                             prefix_weight, grad_scale, 1.0 / grad_s)
    triton_kernels._ce_mtp_kernel[grid](*args, **meta)  # the loss kernel (CUDA; the CPU's twin: triton_kernels)
    return outputs

def _check_fp8_head_args(x: torch.Tensor, w: torch.Tensor, x_f8: torch.Tensor, w_f8: torch.Tensor, grad_s) -> None:
    if not (math.isfinite(grad_s) and grad_s > 0):  # the kernel stores the gradient times 1 / grad_s
        raise ValueError(f"fp8_head_loss: grad_s must be a finite number > 0, got {grad_s}")
    for name, t, ref in (("x_f8", x_f8, x), ("w_f8", w_f8, w)):
        if t.dtype != torch.float8_e4m3fn or t.shape != ref.shape:
            raise ValueError(f"fp8_head_loss: {name} must be float8_e4m3fn of shape {tuple(ref.shape)},"
                             f" got {t.dtype} {tuple(t.shape)}")

@fp8_head_loss.register_fake
def _fp8_head_loss_fake(x, w, x_f8, w_f8, targets, mtp_weights, prefix_ids, prefix_weight, x_s, w_s, grad_s,
                        grad_scale):
    _check_fp8_head_args(x, w, x_f8, w_f8, grad_s)
    (M, _), N = x.shape, w.shape[1]
    return (x.new_empty((M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32),
            x.new_empty((M, N), dtype=torch.float8_e5m2))

@torch.library.custom_op("speedrun::fp8_head_loss_backward", mutates_args=())
def fp8_head_loss_backward(g_f8: torch.Tensor, x_f8: torch.Tensor, w_f8: torch.Tensor, x_s: float, w_s: float,
                           grad_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx bf16, dw fp32) of fp8_head_loss from its saved e5m2 gradient (fp8_matmul_grads)."""
    return fp8_matmul_grads(g_f8, x_f8, w_f8, x_s, w_s, grad_s)

@fp8_head_loss_backward.register_fake
def _fp8_head_loss_backward_fake(g_f8, x_f8, w_f8, x_s, w_s, grad_s):
    return (x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.float32))

def _fp8_head_loss_setup_context(ctx, inputs, output):
    x, w, x_f8, w_f8, _, _, _, _, x_s, w_s, grad_s, _ = inputs
    _, next_token, g_f8 = output
    ctx.mark_non_differentiable(next_token, g_f8)
    ctx.save_for_backward(x_f8, w_f8, g_f8)
    ctx.scales = (x_s, w_s, grad_s)
    ctx.dtypes = (x.dtype, w.dtype)

def _fp8_head_loss_autograd(ctx, _grad_loss, _grad_next_token, _grad_g):
    x_f8, w_f8, g_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_head_loss_backward(g_f8, x_f8, w_f8, *ctx.scales)
    return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), *(None,) * 10

fp8_head_loss.register_autograd(_fp8_head_loss_autograd, setup_context=_fp8_head_loss_setup_context)

# ---- FP8 MLP (record #89, modded-nanogpt PR #342) ---------------------------------------------
# Training forward only. Up: x_f8 = e4m3(x * 448 / amax|x|) (its current amax, in the traced graph), W1 / s1 with s1 =
# amax|W1| / 448 per layer after every optimizer step; the kernel keeps post = relu(pre)^2 in bf16 and e4m3 and leaves
# per-program maxima of post, reduced once after the last layer into the next forward's act scales. Down:
# torch._scaled_mm with delayed scales, post / a_l with a_l = (the previous forward's amax of post) * 1.80 / 448, and
# W2 / w_l with w_l = (the previous quantisation's amax|W2|) * 1.12 / 448 (the current amax / 448 for the first
# FP8_BOOTSTRAP_STEPS steps: W2 starts at zero). The backward is bf16 from post (triton_kernels.relu2_mlp_backward).

@torch.library.custom_op("speedrun::fp8_mlp", mutates_args=())
def fp8_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, x_f8: torch.Tensor, up_f8: torch.Tensor,
            up_dequant: torch.Tensor, down_f8_t: torch.Tensor, down_scale: torch.Tensor, act_scale: torch.Tensor,
            fast_accum: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """relu(x w_up^T)^2 w_down in FP8 (e4m3 operands, 0-D fp32 scales): (y (T, D) bf16, post (T, H) bf16,
    maxima of post over parts (P,) fp32); x, w_up, w_down (bf16) serve the backward. CPU: _fp8_mlp_cpu."""
    grid, args, meta, (post, post_f8, post_max) = triton_kernels.fp8_up_kernel_args(x_f8, up_f8, up_dequant,
                                                                                    act_scale, fast_accum)
    triton_kernels._fp8_relu2_kernel[grid](*args, **meta)  # the up-projection kernel: post, post_f8, post_max
    y = _scaled_matmul(post_f8, down_f8_t.mT, act_scale, down_scale, torch.bfloat16, fast_accum=True)
    return y, post, post_max

@fp8_mlp.register_fake
def _fp8_mlp_fake(x, w_up, w_down, x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale, fast_accum=True):
    T, H = x.shape[0], up_f8.shape[0]
    return (x.new_empty((T, down_f8_t.shape[0]), dtype=torch.bfloat16), x.new_empty((T, H), dtype=torch.bfloat16),
            x.new_empty((triton_kernels.relu2_fp8_up_partial_count(T, H, x.device),), dtype=torch.float32))

def _fp8_mlp_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # post and its maxima
    ctx.save_for_backward(*inputs[:3], output[1])  # x, w_up, w_down, post

def _fp8_mlp_autograd(ctx, grad_y, grad_post, grad_max):
    x, w_up, w_down, post = ctx.saved_tensors
    return *triton_kernels.relu2_mlp_backward(grad_y, x, w_up, w_down, post), *(None,) * 7

fp8_mlp.register_autograd(_fp8_mlp_autograd, setup_context=_fp8_mlp_setup_context)

class FP8MLPState(nn.Module):
    """Per-layer FP8 state of the MLPs (persistent: the warm-up's reset and checkpoints restore it), its
    scales (L, FP8_SCALE_STRIDE) fp32 with the value at byte 16 * layer (cuBLASLt's alignment). quantize()
    after every optimizer step; per forward, mlp() per layer, then update_act_scales() once."""

    def __init__(self, num_layers: int, hidden: int, dim: int, fast_accum: bool = True):
        super().__init__()
        self.fast_accum = fast_accum  # of the up-projection kernel (the record's: fast)
        e4m3, scales = torch.float8_e4m3fn, (num_layers, FP8_SCALE_STRIDE)
        self.register_buffer("up_f8", torch.zeros(num_layers, hidden, dim, dtype=e4m3))
        self.register_buffer("up_scale", torch.ones(scales))
        self.register_buffer("down_f8_t", torch.zeros(num_layers, dim, hidden, dtype=e4m3))  # W2^T per layer
        self.register_buffer("down_scale", torch.ones(scales))       # the scale down_f8_t was made with
        self.register_buffer("down_next_scale", torch.ones(scales))  # headroom scale for the next quantize
        self.register_buffer("act_scale", torch.ones(scales))

    def mlp(self, layer: int, x: torch.Tensor, w_up, w_down) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s MLP on x (T, D) bf16 with its mlp_bank entries w_up, w_down (H, D): (y, maxima
        of post). x's amax and cast are plain torch, fused by the compiled graph into the norm before."""
        _check_fp8_mlp_args(self, x, w_up, w_down)
        xd = x.detach()  # x's gradient comes through the op's x argument (the bf16 backward)
        amax_x = xd.abs().amax().float()  # current scaling of the up-projection's input (record #89)
        x_f8 = (xd.float() * (E4M3_MAX / amax_x)).to(torch.float8_e4m3fn)
        up_dequant = self.up_scale[layer, 0] * amax_x / E4M3_MAX
        y, _, post_max = fp8_mlp(x, w_up, w_down, x_f8, self.up_f8[layer], up_dequant, self.down_f8_t[layer],
                                 self.down_scale[layer, 0], self.act_scale[layer, 0], self.fast_accum)
        return y, post_max

    def update_act_scales(self, post_maxima: list[torch.Tensor]) -> None:
        """Every layer's next act scale from mlp()'s maxima of post, in one write after the last MLP (PR #342);
        a layer without MLP (None) keeps its scale."""
        _check_post_maxima(self, post_maxima)
        rows = [i for i, m in enumerate(post_maxima) if m is not None]
        amax = torch.stack([post_maxima[i] for i in rows]).amax(dim=1)
        scale = amax.clamp_min(FP8_SCALE_FLOOR) * (FP8_ACT_HEADROOM / E4M3_MAX)
        if len(rows) == len(post_maxima):
            self.act_scale[:, 0] = scale
        else:
            self.act_scale[rows, 0] = scale

    @torch.no_grad()
    def quantize(self, mlp_bank: torch.Tensor, bootstrap: bool) -> None:
        """The e4m3 copies from mlp_bank ([2i] = W1, [2i+1] = W2, (H, D)); W2 by its current amax / 448
        when bootstrap (steps < FP8_BOOTSTRAP_STEPS), else by the headroom scale the last call took."""
        _check_mlp_bank(self, mlp_bank)
        L = self.up_f8.shape[0]
        w_up, w_down = mlp_bank[0: 2 * L: 2], mlp_bank[1: 2 * L: 2]
        s1 = w_up.abs().amax(dim=(1, 2)).clamp_min(FP8_SCALE_FLOOR) / E4M3_MAX  # in the bank's dtype, as the record
        self.up_f8.copy_((w_up / s1[:, None, None]).to(torch.float8_e4m3fn))
        self.up_scale[:, 0] = s1
        amax = w_down.abs().amax(dim=(1, 2)).float().clamp_min(FP8_SCALE_FLOOR)
        scale = amax / E4M3_MAX if bootstrap else self.down_next_scale[:, 0].clone()
        w_f8 = (w_down.float() / scale[:, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        self.down_f8_t.copy_(w_f8.mT)
        self.down_scale[:, 0] = scale
        self.down_next_scale[:, 0] = amax * (FP8_DOWN_W_HEADROOM / E4M3_MAX)

def _check_fp8_mlp_args(state: FP8MLPState, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    H, D = state.up_f8.shape[1:]
    dtypes = {x.dtype, w_up.dtype, w_down.dtype}
    if x.shape[1:] != (D,) or {w_up.shape, w_down.shape} != {(H, D)} or dtypes != {torch.bfloat16}:
        raise ValueError(f"FP8MLPState.mlp: x must be (T, {D}), w_up and w_down ({H}, {D}), all bf16; got x "
                         f"{tuple(x.shape)} {x.dtype}, w_up {tuple(w_up.shape)} {w_up.dtype}, "
                         f"w_down {tuple(w_down.shape)} {w_down.dtype}")

def _check_post_maxima(state: FP8MLPState, post_maxima: list) -> None:
    if len(post_maxima) != (L := state.act_scale.shape[0]):
        raise ValueError(f"FP8MLPState.update_act_scales: post_maxima must hold {L} layers' maxima,"
                         f" got {len(post_maxima)}")

def _check_mlp_bank(state: FP8MLPState, mlp_bank: torch.Tensor) -> None:
    L, H, D = state.up_f8.shape
    if mlp_bank.dim() != 3 or mlp_bank.shape[0] < 2 * L or tuple(mlp_bank.shape[1:]) != (H, D):
        raise ValueError(f"FP8MLPState.quantize: mlp_bank must be (>= {2 * L}, {H}, {D}), got {tuple(mlp_bank.shape)}")

# ---- The FP8 head on a CPU: emulated (tests, host-dispatch counts) ---------------------------------

@fp8_head_loss.register_kernel("cpu")
def _fp8_head_loss_cpu(x, w, x_f8, w_f8, targets, mtp_weights, prefix_ids, prefix_weight, x_s, w_s, grad_s,
                       grad_scale):
    """fp8_head_loss on CPU tensors: the float8 matmul emulated (_scaled_matmul), the loss kernel's CPU twin."""
    _check_fp8_head_args(x, w, x_f8, w_f8, grad_s)
    logits = _scaled_matmul(x_f8, w_f8, x_s, w_s, torch.bfloat16, fast_accum=True)
    return triton_kernels.softcapped_ce_mtp_e5m2(logits, targets, mtp_weights, prefix_ids, prefix_weight,
                                                 grad_scale, grad_s)

# ---- The FP8 MLP on a CPU: emulated (tests, host-dispatch counts) ---------------------------------

@fp8_mlp.register_kernel("cpu")
def _fp8_mlp_cpu(x, w_up, w_down, x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale, fast_accum=True):
    """fp8_mlp on CPU tensors: the up-projection's reference (its float8 products exact in fp32), the
    down-projection's float8 matmul emulated (_scaled_matmul)."""
    post, post_f8, post_max = triton_kernels.relu2_fp8_up_partials(x_f8, up_f8, up_dequant, act_scale,
                                                                   fast_accum=fast_accum)
    return _scaled_matmul(post_f8, down_f8_t.mT, act_scale, down_scale, torch.bfloat16, fast_accum=True), post, post_max

# ---- The generic FP8 matmul: any linear layer (the record's FP8 layers have their own ops) ------

@torch.library.custom_op("speedrun::fp8_mm", mutates_args=())
def fp8_mm(x: torch.Tensor, w: torch.Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = x @ w in float8. x (M, K), w (K, N) stored (in, out). Returns (y bf16, x_f8, w_f8).

    The float8 copies are returned so autograd can save them (half the memory of bf16) and the
    backward need not quantise again; w_f8 is column-major, the layout cuBLAS wants for it."""
    x_f8 = _quantize_fp8(x, x_s, torch.float8_e4m3fn)
    w_f8 = _quantize_fp8(w.T, w_s, torch.float8_e4m3fn).T
    y = _scaled_matmul(x_f8, w_f8, x_s, w_s, torch.bfloat16, fast_accum=True)
    return y, x_f8, w_f8

@fp8_mm.register_fake
def _fp8_mm_fake(x, w, x_s, w_s, grad_s):
    M, K = x.shape
    N = w.shape[1]
    return (x.new_empty((M, N), dtype=torch.bfloat16), x.new_empty((M, K), dtype=torch.float8_e4m3fn),
            w.new_empty((N, K), dtype=torch.float8_e4m3fn).T)

@torch.library.custom_op("speedrun::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(g: torch.Tensor, x_f8: torch.Tensor, w_f8: torch.Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of y = x @ w from dy (M, N): dx = dy @ w^T (bf16), dw = x^T @ dy (fp32).

    dy is quantised to e5m2 (wider range, the gradient's scale moves with the loss), then
    fp8_matmul_grads."""
    return fp8_matmul_grads(_quantize_fp8(g, grad_s, torch.float8_e5m2), x_f8, w_f8, x_s, w_s, grad_s)

@fp8_mm_backward.register_fake
def _fp8_mm_backward_fake(g, x_f8, w_f8, x_s, w_s, grad_s):
    return (x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16),
            w_f8.new_empty(w_f8.shape, dtype=torch.float32))

def _fp8_mm_setup_context(ctx, inputs, output):
    x, w, x_s, w_s, grad_s = inputs
    _, x_f8, w_f8 = output
    ctx.mark_non_differentiable(x_f8, w_f8)
    ctx.save_for_backward(x_f8, w_f8)
    ctx.scales = (x_s, w_s, grad_s)
    ctx.dtypes = (x.dtype, w.dtype)

def _fp8_mm_autograd(ctx, grad_y, grad_x_f8, grad_w_f8):
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_mm_backward(grad_y, x_f8, w_f8, *ctx.scales)
    return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None

fp8_mm.register_autograd(_fp8_mm_autograd, setup_context=_fp8_mm_setup_context)

def fp8_matmul(x: torch.Tensor, w: torch.Tensor, x_s: float, w_s: float, grad_s: float) -> torch.Tensor:
    """x (..., K) @ w (K, N) -> (..., N) bf16 through the float8 op (differentiable in x and w)."""
    y = fp8_mm(x.reshape(-1, x.shape[-1]), w, x_s, w_s, grad_s)[0]
    return y.view(*x.shape[:-1], w.shape[1])

# ----------------------------------------------------------------------------------------------
# Orthogonalization: Polar Express, then Gram Newton-Schulz and ANVIL's cascade
# ----------------------------------------------------------------------------------------------

# Polar Express: Amsel, Persson, Musco, Gower, arXiv 2505.16932 (Gram Newton-Schulz, an alternative, follows
# it). It maps a gradient-like G (..., m, n) to an approximation of its polar factor U V^T (G = U S V^T), in bf16,
# batched over the leading dims (a bank of matrices). Each iteration applies the odd polynomial
# p(x) = a x + b x^3 + c x^5 to the singular values; the coefficients (POLAR_EXPRESS_COEFFS, with the recipe) are
# tuned so that five iterations take every singular value in roughly [1e-3, 1] into a narrow band around 1.
# Dividing by ||G||_F * 1.02 first guarantees the spectral norm is < 1.

def _as_bank(G: torch.Tensor) -> torch.Tensor:
    """G (..., m, n) as a 3-D (batch, m, n) view, or a one-line error for a vector."""
    _check_matrices(G)
    return G.reshape(-1, G.size(-2), G.size(-1))

def _check_matrices(G: torch.Tensor) -> None:
    if G.ndim < 2:
        raise ValueError(f"orthogonalization needs matrices (..., m, n); got shape {tuple(G.shape)}")

def polar_express(G: torch.Tensor, coeffs=POLAR_EXPRESS_COEFFS, dtype: torch.dtype = torch.bfloat16,
                  trace_margin: float | None = None) -> torch.Tensor:
    """Polar Express orthogonalization of a matrix or a bank of matrices, in bf16 (the record's).

    X = bf16(G) / (||X||_F * 1.02 + 1e-6), norm and division in bf16. Wide and square matrices
    iterate X <- a X + (b A + c A^2) X with A = X X^T; tall ones the right-multiplied form
    X <- a X + X (b A + c A^2) with A = X^T X, so the Gram matrix is always the small side. For
    matrices of more than 1024 rows (the MLP bank) the product with X is rounded to bf16, then a X is added in
    fp32 and the sum rounded once (CUDA's add_ with alpha; the CPU's would round a); smaller ones use one fused
    multiply-add. Returns `dtype` (bf16) with G's shape; dtype=torch.float32: the same in fp32 (slow bf16 CPUs).
    trace_margin (anvil_cascade's): X and A / d^2 instead, d = trace_margin sqrt(trace A) + 1e-6 from the Gram
    matrix A of bf16(G) (its trace summed in fp32, both divisions rounded from fp32), the first iteration reusing A.
    """
    X = _as_bank(G).to(dtype)
    wide = X.size(-2) <= X.size(-1)
    split = X.size(-2) > 1024
    gram = triton_kernels.XXT if wide else triton_kernels.XTX  # symmetric Triton kernels on CUDA
    k = X.size(-2) if wide else X.size(-1)
    A = None
    if trace_margin is None:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    else:
        A = gram(X, X.new_empty(X.size(0), k, k))
        d = A.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None].sqrt() * trace_margin + 1e-6
        X, A = (X.float() / d).to(dtype), (A.float() / d.square()).to(dtype)
    for a, b, c in coeffs:
        A = gram(X, X.new_empty(X.size(0), k, k)) if A is None else A
        B = triton_kernels.ba_plus_cAA(A, c, b, torch.empty_like(A))  # b A + c A^2
        if split:
            X = (torch.bmm(B, X) if wide else torch.bmm(X, B)).float().add_(X, alpha=a).to(X.dtype)
        else:
            X = torch.baddbmm(X, B, X, beta=a) if wide else torch.baddbmm(X, X, B, beta=a)
        A = None
    return X.reshape(G.shape)

# ---- Gram Newton-Schulz and the measured "auto" choice (alternatives to polar_express) -------

# Gram Newton-Schulz: the iteration on the Gram matrix of Dao-AILab/gram-newton-schulz, with the
# polynomials of polar_express.

def _normalized_bank(G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """G / (||G||_F * 1.02 + 1e-6) per matrix, as a 3-D (batch, m, n) tensor of `dtype`.

    The norm is taken in fp32 whatever G's dtype: a bf16 norm of a large matrix is too coarse to
    keep the spectral norm safely below 1.
    """
    G3 = _as_bank(G)
    norm = G3.float().norm(dim=(-2, -1), keepdim=True)
    return (G3.float() / (norm * 1.02 + 1e-6)).to(dtype)

def gram_newton_schulz(G: torch.Tensor, coeffs=POLAR_EXPRESS_COEFFS, restart_after: int = 2,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same polynomial iteration, run on the small Gram matrix instead of the full matrix.

    Every iterate has the form X_k = Q_k X_0 (wide case; tall matrices are transposed views), so it
    suffices to track the s x s left factor Q and the Gram matrix R = X_k X_k^T:
        Z = a I + b R + c R^2,   Q <- Z Q,   R <- Z R Z.
    The long dimension is touched only to form R, at the restart and at the end (X = Q X_0). For a
    3072 x 768 MLP matrix that is ~30% fewer FLOPs than Polar Express. Errors in the accumulated Q
    grow fastest during the first, steep iterations, so after `restart_after` iterations X is formed
    explicitly and R recomputed from it. The Gram work runs in fp16 (all entries are bounded by a
    few units; fp16 keeps 3 more mantissa bits than bf16); the result is bf16 with G's shape.
    dtype=torch.float32 runs everything in fp32 and returns fp32 (the CPU fp32 mode).
    """
    X = _normalized_bank(G, torch.float16 if dtype == torch.bfloat16 else dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT.contiguous()
    s = X.size(-2)
    eye = torch.eye(s, dtype=X.dtype, device=X.device)
    R = triton_kernels.XXT(X, X.new_empty(X.size(0), s, s))
    Q = None
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        if i == restart_after and Q is not None:
            X = torch.bmm(Q, X)
            R = triton_kernels.XXT(X, X.new_empty(X.size(0), s, s))
            Q = None
        Z = triton_kernels.ba_plus_cAA(R, c, b, torch.empty_like(R)) + a * eye  # b R + c R^2 + a I
        Q = Z if Q is None else torch.bmm(Z, Q)
        if i < last:
            R = torch.bmm(torch.bmm(Z, R), Z)
    X = torch.bmm(Q, X)
    if tall:
        X = X.mT
    return X.to(dtype).reshape(G.shape)

# Measured choice of "auto", per GPU: (rows, cols) of a bank's matrices -> (Polar Express ms, Gram
# Newton-Schulz ms) for one rank's shard. Only repeatable measurements are listed: on one H100 80GB HBM3
# (tests/bench_optimizer.py, torch 2.11, 2026-11-24) the 768 x 768 banks gave 1.25 and 2.45 ms for the
# same Polar Express call in one run; on one H200 (the GPU check, 2026-11-26) every bank took 1.05 to
# 1.28 ms either way (launch-bound), and 3 and 24 matrices of 3072 x 768 favoured opposite ones, so none
# is listed. The rest follow the FLOP count. The GPU check's kernel-choice check times every bank again.
ORTHOGONALIZER_MS = {"H100": {(3072, 768): (1.971, 1.218)}, "H200": {}}

def auto_orthogonalizer(rows: int, cols: int, gpu_name: str = "") -> str:
    """The name "auto" runs for (rows, cols) matrices: the faster measured one on a GPU whose table has
    the shape, else the one with fewer FLOPs (orthogonalization_flops: Gram Newton-Schulz once the long
    side is at least twice the short one)."""
    times = triton_kernels.measured_table(ORTHOGONALIZER_MS, gpu_name).get((rows, cols))
    if times is not None:
        return "polar_express" if times[0] <= times[1] else "gram_newton_schulz"
    return "gram_newton_schulz" if max(rows, cols) >= 2 * min(rows, cols) else "polar_express"

def orthogonalize_auto(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per bank shape, Gram Newton-Schulz or Polar Express (auto_orthogonalizer).

    Per matrix with short side s and long side L, Polar Express costs ~20 s^2 L + 10 s^3 FLOPs
    and the Gram form ~8 s^2 L + 32 s^3: the Gram form wins once L > ~1.8 s (the 3072 x 768 MLP
    bank: -29%) and loses on square matrices (attention banks: +33%).
    """
    m, n = G.shape[-2:]
    name = auto_orthogonalizer(m, n, triton_kernels.gpu_name_of(G))
    return (gram_newton_schulz if name == "gram_newton_schulz" else polar_express)(G, dtype=dtype)

# ---- ANVIL's cascade (record #92): six quintic maps after a trace normalisation ---------------------
# Its six (a, b, c), composed in float64, take every singular value in [3e-3, 1/1.05] into [0.99507, 1.000401];
# there is no margin above 1/1.05 (a rank-1 matrix reaches it): f(0.9525) = 23, f(0.953) = 7.9e11.
ANVIL_MAPS: tuple[tuple[float, float, float], ...] = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)
ANVIL_TRACE_MARGIN = 1.05

def anvil_cascade(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """ANVIL's orthogonalization (record #92): polar_express's iteration with ANVIL_MAPS after normalising by
    1.05 sqrt(trace of the Gram matrix) (the trace is ||X||_F^2). Returns `dtype` with G's shape."""
    return polar_express(G, ANVIL_MAPS, dtype, trace_margin=ANVIL_TRACE_MARGIN)

# The orthogonalizers by name (--orthogonalizer); the record's is Polar Express.
ORTHOGONALIZERS = {"polar_express": polar_express, "gram_newton_schulz": gram_newton_schulz, "auto": orthogonalize_auto,
                   "anvil_cascade": anvil_cascade}

def orthogonalization_flops(rows: int, cols: int, orthogonalizer="polar_express") -> int:
    """FLOPs to orthogonalize one rows x cols matrix, counted like torch's FlopCounterMode (2 per
    multiply-add, symmetric products counted dense). With s the short side and L the long one:
    Polar Express 5 x (4 s^2 L + 2 s^3), ANVIL's cascade 6 x; Gram Newton-Schulz 8 s^2 L + 32 s^3 (module docstrings).
    orthogonalizer: a name, one of the functions (or a functools.partial of one); anything else is
    costed as Polar Express. Balanced ownership evens out these counts over the ranks."""
    fn = getattr(orthogonalizer, "func", orthogonalizer)
    name = next((k for k, f in ORTHOGONALIZERS.items() if fn is f or fn == k), "polar_express")
    s, L = min(rows, cols), max(rows, cols)
    if name == "auto":
        name = auto_orthogonalizer(rows, cols)
    if name == "gram_newton_schulz":
        return 8 * s * s * L + 32 * s ** 3
    return len(ANVIL_MAPS if name == "anvil_cascade" else POLAR_EXPRESS_COEFFS) * (4 * s * s * L + 2 * s ** 3)

def orthogonalizer_of(orthogonalizer):
    """A callable as it is, a name of ORTHOGONALIZERS as its function, else a one-line error."""
    return orthogonalizer if callable(orthogonalizer) else ORTHOGONALIZERS[_check_orthogonalizer(orthogonalizer)]

def _check_orthogonalizer(name) -> str:
    if name not in ORTHOGONALIZERS:
        raise ValueError(f"NorMuonAdam: orthogonalizer={name!r}; choose one of {sorted(ORTHOGONALIZERS)}")
    return name

# ----------------------------------------------------------------------------------------------
# Optimizer: one fused NorMuon + Adam step that owns all communication
# ----------------------------------------------------------------------------------------------

# Record #89's NorMuonAndAdam: NorMuon (Muon, Keller Jordan's blog post, with the neuron-wise second
# moment of arXiv 2510.05491) for the matrix banks, Adam for the rest. Every parameter has a label and a
# ParamConfig; one NorMuonAdam.step() does all communication, in three phases:
#   1 scatter (scatter_order, big banks first): launch each gradient's reduction: sharded reduce_scatter,
#     replicated all_reduce, sharded_sparse all_to_all of the touched rows (or from gradient hooks during
#     the backward: reductions_on_backward)
#   2 work (work_order, small labels first): Adam in at most two calls, then each NorMuon bank: wait for
#     the reduction, update the local shard, launch its all_gather
#   3 finalize: wait for the gathers; refresh the tied embedding from the head
# bf16 NorMuon parameters keep the low 16 bits of their fp32 master value in a uint16 "mantissa", so tiny
# updates accumulate as in fp32 at half the memory: the parameter is the value's top half (truncated).
# Adam computes in fp32 and rounds to nearest into the parameter (the record's two rules).

@dataclass(frozen=True)
class ParamConfig:
    """How one labelled parameter is optimized and communicated (a row of the record's param_table)."""
    optimizer: str = "adam"                         # "normuon", "anvil" (banks of matrices), "adam", "row_adam"
    comms: str = "replicated"                       # "none", "replicated", "sharded", "sharded_sparse"
    lr_mul: float = 1.0
    wd_mul: float = 1.0                             # the decay per step scales with lr^2 (record #89)
    betas: tuple[float, float] = (0.9, 0.95)        # Adam's
    matrix_lr_mul: tuple[float, ...] | None = None  # NorMuon: one lr multiplier per matrix of the bank
    every_step: bool = False                        # Adam: steps on every step(), not only do_adam ones

    def __post_init__(self):
        _check_param_config(self)

MATRIX_KINDS = ("normuon", "anvil")  # the optimizers of banks of matrices (ANVIL: record #92's, an alternative)
ADAM_KINDS = ("adam", "row_adam")  # steps on do_adam steps (row Adam: record #92's n-gram table's, an alternative)
OPTIMIZER_KINDS = (*MATRIX_KINDS, *ADAM_KINDS)
COMMS_MODES = ("none", "replicated", "sharded", "sharded_sparse")

def _check_param_config(cfg: ParamConfig) -> None:
    """ParamConfig's one-line errors; stores betas and matrix_lr_mul as tuples of floats."""
    if cfg.optimizer not in OPTIMIZER_KINDS:
        raise ValueError(f"ParamConfig: optimizer={cfg.optimizer!r} is not one of {', '.join(OPTIMIZER_KINDS)}")
    if cfg.comms not in COMMS_MODES:
        raise ValueError(f"ParamConfig: comms={cfg.comms!r} is not one of {', '.join(COMMS_MODES)}")
    if cfg.comms == "sharded_sparse" and cfg.optimizer not in ADAM_KINDS:
        raise ValueError(f"ParamConfig: comms='sharded_sparse' is for Adam embedding tables; use 'sharded' for "
                         f"{cfg.optimizer}")
    if cfg.matrix_lr_mul is not None and cfg.optimizer not in MATRIX_KINDS:
        raise ValueError("ParamConfig: matrix_lr_mul applies to normuon and anvil banks only; use lr_mul for adam")
    if cfg.every_step and cfg.optimizer not in ADAM_KINDS:
        raise ValueError(f"ParamConfig: every_step applies to adam labels ({cfg.optimizer} steps every step)")
    betas = tuple(float(b) for b in cfg.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"ParamConfig: betas={cfg.betas!r} must be two numbers in [0, 1)")
    if cfg.optimizer == "row_adam" and betas[0] != 0:
        raise ValueError(f"ParamConfig: row_adam keeps no momentum; use betas=(0, beta2), got {cfg.betas!r}")
    object.__setattr__(cfg, "betas", betas)
    if cfg.matrix_lr_mul is not None:
        object.__setattr__(cfg, "matrix_lr_mul", tuple(float(m) for m in cfg.matrix_lr_mul))

def lr_multipliers(cfg: ParamConfig, shape: tuple) -> torch.Tensor:
    """A label's lr over its optimizer's base lr x schedule, float64. NorMuon and ANVIL, shape (matrices, rows,
    cols): per matrix lr_mul x sqrt(max(1, rows/cols)) (record #89's shape factor) x matrix_lr_mul; Adam: lr_mul."""
    if cfg.optimizer not in MATRIX_KINDS:
        return torch.tensor(cfg.lr_mul, dtype=torch.float64)
    n, r, c = shape
    per_matrix = torch.tensor(cfg.matrix_lr_mul or [1.0] * n, dtype=torch.float64)
    return per_matrix * cfg.lr_mul * max(1.0, r / c) ** 0.5

# ---- Update math: pure functions of one shard, no communication -------------------------------

def _master_fp32(param: torch.Tensor, mantissa: torch.Tensor | None) -> torch.Tensor:
    """The exact fp32 value of a parameter: bf16 bits joined with the stored low 16 bits."""
    if mantissa is None:
        return param.float()
    high = param.view(torch.int16).to(torch.int32) << 16
    low = mantissa.view(torch.int16).to(torch.int32) & 0xFFFF
    return (high | low).view(torch.float32)

def _store_master(value: torch.Tensor, param: torch.Tensor, mantissa: torch.Tensor | None) -> None:
    """Write an fp32 value back: high half into the bf16 parameter, low half into the mantissa."""
    if mantissa is None:
        param.copy_(value)
        return
    bits = value.view(torch.int32)
    param.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.view(torch.int16).copy_(bits.to(torch.int16))  # int32 -> int16 keeps the low 16 bits

def normuon_variance_reduction(O: torch.Tensor, second_moment: torch.Tensor, beta2) -> torch.Tensor:
    """NorMuon's normalization of O (bf16, (k, rows, cols)), in place, as the record: O / sqrt(EMA of mean(O^2)
    per row of the longer side, no bias correction), rescaled to its Frobenius norm, the scale applied in bf16."""
    red = -1 if O.size(-2) >= O.size(-1) else -2
    mean_sq = O.float().square().mean(dim=red, keepdim=True)
    size = O.size(red)
    norm = (mean_sq.sum(dim=(-2, -1), keepdim=True) * size).sqrt()
    second_moment.lerp_(mean_sq, 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = ((mean_sq * size) * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return O.mul_((step * (norm / new_norm.clamp_min(1e-10))).to(O.dtype))

def _normuon_update(grad, momentum_buf, second_moment, param, mantissa, matrix_lr, hp, orthogonalize):
    """One NorMuon step on a shard of matrices (k, rows, cols), in place, as record #89. hp: the label's fp32
    row of hyperparam_tensors (a tensor: no recompiles as the schedules move), read by NorMuonHyperparams'
    names; matrix_lr (k, 1, 1)."""
    hp = hyperparams_of(NorMuonHyperparams, hp)
    g = _nesterov_momentum(grad, momentum_buf, hp.momentum)
    O = normuon_variance_reduction(orthogonalize(g), second_moment, hp.beta2).float()
    _cautious_step(O, param, mantissa, hp.lr * matrix_lr, hp.decay)

def _anvil_update(grad, fast_rail, slow_rail, second_moment, param, mantissa, matrix_lr, hp):
    """One ANVIL step (record #92) on a shard of matrices (k, rows, cols), in place. Two fp32 rails of the
    gradient (fast, slow: EMAs at hp.fast_beta, hp.slow_beta from zero, no bias correction), blended with
    weight hp.fast_weight on the fast one; the Nesterov look-ahead along the blend at hp.momentum (the rail
    beta); anvil_cascade in the parameter's dtype; NorMuon's lane equaliser; the cautious decay gated by the
    slow rail's sign. hp: the label's row of hyperparam_tensors, read by AnvilHyperparams' names."""
    hp = hyperparams_of(AnvilHyperparams, hp)
    g = grad.float()
    fast_rail.lerp_(g, 1 - hp.fast_beta)
    slow_rail.lerp_(g, 1 - hp.slow_beta)
    g = g.lerp(hp.fast_weight * fast_rail + (1 - hp.fast_weight) * slow_rail, hp.momentum)
    O = normuon_variance_reduction(anvil_cascade(g, dtype=param.dtype), second_moment, hp.beta2).float()
    _cautious_step(O, param, mantissa, hp.lr * matrix_lr, hp.decay, gate=slow_rail)

def _nesterov_momentum(grad, momentum_buf, momentum) -> torch.Tensor:
    """fp32 momentum EMA of grad, in place, and the Nesterov look-ahead along it (elementwise)."""
    g = grad.float()
    momentum_buf.lerp_(g, 1 - momentum)
    return g.lerp(momentum_buf, momentum)

def _cautious_step(O, param, mantissa, eff_lr, decay, gate=None) -> None:
    """P = P - P * [gate*P >= 0] * decay * eff_lr - O * eff_lr on the fp32 master, in place (elementwise);
    the gate is the update O unless given (ANVIL's: the slow rail)."""
    p = _master_fp32(param, mantissa)
    gate = O if gate is None else gate
    mask = (gate * p >= 0).float()  # cautious decay (>= 0: a zero update, e.g. bank padding, still decays)
    p = p - p * mask * (decay * eff_lr) - O * eff_lr
    _store_master(p, param, mantissa)

def _adam_update(grad, exp_avg, exp_avg_sq, param, hp):
    """One Adam step with cautious weight decay (arXiv 2411.16085) on a shard, in place, as record #89.
    hp: the label's row of hyperparam_tensors, read by AdamHyperparams' names; eps on the uncorrected root; a
    strict decay mask that reads the update."""
    hp = hyperparams_of(AdamHyperparams, hp)
    g = grad.float()
    exp_avg.mul_(hp.beta1).add_(g * (1 - hp.beta1))
    exp_avg_sq.mul_(hp.beta2).add_(g.square() * (1 - hp.beta2))
    u = hp.step_size * exp_avg / (exp_avg_sq.sqrt() + hp.eps)
    p = param.float()
    u = u + (u * p > 0).float() * hp.decay * p
    param.copy_(p - u)

def _adam_update_group(grads, exp_avgs, exp_avg_sqs, params, hps):
    """_adam_update per label, the same bits; compiled, one launch for all (a GPU step is host-bound)."""
    for grad, exp_avg, exp_avg_sq, param, hp in zip(grads, exp_avgs, exp_avg_sqs, params, hps):
        _adam_update(grad, exp_avg, exp_avg_sq, param, hp)

def _row_adam_update(grad, row_sq, param, hp):
    """Record #92's row Adam on a shard of table rows (rows, width), in place: no momentum (beta1 0), one fp32
    second moment per row, v = beta2 v + (1 - beta2) mean(g^2) over the row, u = step_size g / (sqrt(v) + eps),
    and _adam_update's cautious decay. A row without gradient keeps its value (u = 0, so no decay either) and
    its v decays by beta2: #92 replays the decays a row missed when it is next touched; here every row's v takes
    every step's, the same products in the same order, at 4 bytes a row. hp: AdamHyperparams' row."""
    hp = hyperparams_of(AdamHyperparams, hp)
    g = grad.float()
    row_sq.mul_(hp.beta2).add_(g.square().mean(dim=1) * (1 - hp.beta2))
    u = hp.step_size * g / (row_sq.sqrt() + hp.eps)[:, None]
    p = param.float()
    u = u + (u * p > 0).float() * hp.decay * p
    param.copy_(p - u)

# ---- CPU-only helpers of the optimizer --------------------------------------------------------

ADAM_CPU_CHUNK = 1 << 16  # elements per slice of the CPU Adam update (its temporaries stay in cache)

def _adam_update_sliced(grad, exp_avg, exp_avg_sq, param, hp):
    """_adam_update one flat slice at a time on a CPU. The update is elementwise, so the result is the
    same bits; full-size temporaries would instead be allocated, page-faulted and streamed from memory
    a dozen times per step, which made Adam over the embedding tables the CPU demo's slowest part."""
    tensors = (grad, exp_avg, exp_avg_sq, param)
    if grad.is_cuda or grad.numel() <= ADAM_CPU_CHUNK or not all(t.is_contiguous() for t in tensors):
        return _adam_update(grad, exp_avg, exp_avg_sq, param, hp)
    flat = [t.view(-1) for t in tensors]
    for a in range(0, grad.numel(), ADAM_CPU_CHUNK):
        _adam_update(*(t[a: a + ADAM_CPU_CHUNK] for t in flat), hp)

def adam_update_group_sliced(grads, exp_avgs, exp_avg_sqs, params, hps):
    """_adam_update_group on a CPU: label by label, each sliced (eager, one call per label costs the
    CPU nothing that grouping would save, and slicing keeps the temporaries in cache)."""
    for grad, exp_avg, exp_avg_sq, param, hp in zip(grads, exp_avgs, exp_avg_sqs, params, hps):
        _adam_update_sliced(grad, exp_avg, exp_avg_sq, param, hp)

def row_adam_update_sliced(grad, row_sq, param, hp):
    """_row_adam_update a block of whole rows at a time (rows are independent: the same bits), for a CPU's cache."""
    rows = max(1, ADAM_CPU_CHUNK // max(1, grad.size(1)))
    if grad.size(0) <= rows:
        return _row_adam_update(grad, row_sq, param, hp)
    for a in range(0, grad.size(0), rows):
        _row_adam_update(grad[a: a + rows], row_sq[a: a + rows], param[a: a + rows], hp)

# The updates uncompiled (update_functions(compile=False), CPUs), by kind: Adam sliced.
UNCOMPILED_UPDATES = {"normuon": _normuon_update, "anvil": _anvil_update, "adam": adam_update_group_sliced,
                      "row_adam": row_adam_update_sliced}

def update_functions(compile=False) -> dict:
    """The updates by kind (NorMuon's, ANVIL's, Adam's group update, row Adam's) compiled fullgraph (inductor for True, or
    the backend given), one graph per label and per Adam group; compile=False (the record always compiles):
    UNCOMPILED_UPDATES."""
    if not compile:
        return dict(UNCOMPILED_UPDATES)
    backend = "inductor" if compile is True else compile
    return {"normuon": torch.compile(_normuon_update, dynamic=False, backend=backend, fullgraph=True),
            "anvil": torch.compile(_anvil_update, dynamic=False, backend=backend, fullgraph=True),
            "adam": torch.compile(_adam_update_group, dynamic=True, backend=backend, fullgraph=True),
            "row_adam": torch.compile(_row_adam_update, dynamic=False, backend=backend, fullgraph=True)}

class NorMuonHyperparams(NamedTuple):
    """_normuon_update's numbers of a step: floats from normuon_hyperparams, 0-d tensors in the update."""
    lr: float
    decay: float  # wd * wd_mul * lr (the cautious decay multiplies it by lr * matrix_lr once more)
    momentum: float
    beta2: float

class AnvilHyperparams(NamedTuple):
    """_anvil_update's numbers of a step: floats from anvil_hyperparams, 0-d tensors in the update."""
    lr: float
    decay: float        # wd * wd_mul * lr, as NorMuon's
    momentum: float     # the Nesterov look-ahead's coefficient: the scheduled rail beta
    beta2: float        # the lane equaliser's
    fast_beta: float
    fast_weight: float  # the fast rail's weight in the blend
    slow_beta: float

class AdamHyperparams(NamedTuple):
    """_adam_update's numbers of its t-th update: floats from adam_hyperparams, 0-d tensors in the update."""
    step_size: float  # lr * sqrt(1 - beta2^t) / (1 - beta1^t): the bias corrections folded in
    decay: float      # lr^2 * wd * wd_mul
    beta1: float
    beta2: float
    eps: float

def hyperparams_of(kind: type, row: torch.Tensor):
    """kind's fields (0-d views) of a row of hyperparam_tensors, unbound inside the compiled update."""
    return kind(*row.unbind()[:len(kind._fields)])

def normuon_hyperparams(lr: float, wd: float, wd_mul: float, momentum: float, beta2: float) -> NorMuonHyperparams:
    return NorMuonHyperparams(lr, wd * wd_mul * lr, momentum, beta2)

def anvil_hyperparams(lr: float, wd: float, wd_mul: float, momentum: float, beta2: float, rails: tuple,
                      slow_beta: float) -> AnvilHyperparams:
    return AnvilHyperparams(*normuon_hyperparams(lr, wd, wd_mul, momentum, beta2), *rails, slow_beta)

def adam_hyperparams(lr: float, t: int, betas: tuple, wd: float, wd_mul: float, eps: float) -> AdamHyperparams:
    b1, b2 = betas  # t counts from 1
    return AdamHyperparams(lr * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t), lr * lr * wd * wd_mul, b1, b2, eps)

def hyperparam_tensors(labels, rows, device: torch.device) -> dict[str, torch.Tensor]:
    """Every label's row (NorMuonHyperparams, AnvilHyperparams or AdamHyperparams, padded with 0s to the
    longest) in one host->device copy (pinned, non-blocking on CUDA); a row view per label, its fields read by
    name in the update (hyperparams_of)."""
    width = max(map(len, rows), default=0)
    hp = torch.tensor([[*row, *[0.0] * (width - len(row))] for row in rows], dtype=torch.float32)
    if device.type == "cuda":
        hp = hp.pin_memory().to(device, non_blocking=True)
    return {label: hp[i] for i, label in enumerate(labels)}

# ---- Layout: which rank owns which rows of every label ------------------------------------

def padded_splits(n: int, world_size: int, label: str = "bank") -> tuple[int, ...]:
    """The record's ownership: n / world_size consecutive matrices of a bank per rank (GPT's bank_padding)."""
    _check_padded_bank(n, world_size, label)
    return (n // world_size,) * world_size

def _check_padded_bank(n: int, world_size: int, label: str) -> None:
    if n % world_size:
        raise ValueError(f"NorMuonAdam: bank {label!r} has {n} matrices, not divisible by the world size {world_size};"
                         f" pad the bank with zero matrices to a multiple of {world_size} or use ownership='balanced'")

# ---- Balanced ownership: banks without padding ----------------------------------------------
# OwnershipLayout(ownership="balanced") gives each rank whole matrices by FLOPs, for any world size;
# the record pads banks instead (padded_splits), so its runs never call this.

def balanced_splits(banks: dict[str, tuple[int, int]], world_size: int) -> dict[str, tuple[int, ...]]:
    """FLOP-balanced ownership of every matrix of every bank, for any world size, without padding.

    banks: label -> (number of matrices, FLOPs of one). Longest-processing-time first over all banks
    together: matrices by falling cost (ties in dict order), each to the rank with the least work so
    far (the lowest rank on ties). The result is per label the count each rank owns; ownership within
    a bank is contiguous in rank order, so the gradient rows a rank owns stay one slice of the bank.
    """
    counts = {label: [0] * world_size for label in banks}
    heap = [(0, r) for r in range(world_size)]  # (load, rank): the least-loaded rank, lowest on ties
    items = sorted(((cost, i, label) for i, (label, (n, cost)) in enumerate(banks.items()) for _ in range(n)),
                   key=lambda t: (-t[0], t[1]))
    for cost, _, label in items:
        work, r = heapq.heappop(heap)
        counts[label][r] += 1
        heapq.heappush(heap, (work + cost, r))
    return {label: tuple(c) for label, c in counts.items()}

def _balanced_ownership(banks: dict, world_size: int, orthogonalizer) -> dict[str, tuple[int, ...]]:
    """OWNERSHIPS["balanced"]: balanced_splits of the banks, a matrix costed by orthogonalization_flops (FLOP-
    sorted owners as in Motif-Technologies/optimizer)."""
    return balanced_splits({label: (placement.rows, orthogonalization_flops(*placement.shape[1:], orthogonalizer))
                            for label, placement in banks.items()}, world_size)

# Bank ownership by name (--bank_ownership): (sharded NorMuon banks' Placements, world size, orthogonalizer) ->
# label -> matrices per rank. The record's is "padded".
OWNERSHIPS = {"padded": lambda banks, world_size, orthogonalizer: {
    label: padded_splits(placement.rows, world_size, label) for label, placement in banks.items()},
    "balanced": _balanced_ownership}

def _check_ownership(ownership: str, what: str) -> None:
    """what: the error's start, naming the argument or the flag."""
    if ownership not in OWNERSHIPS:
        raise ValueError(f"{what}{ownership!r} is not one of {', '.join(OWNERSHIPS)}")

@dataclass(frozen=True)
class Placement:
    """Static layout of one labelled parameter: the 2-D+ view it is sharded along and this rank's shard."""
    label: str
    param: torch.Tensor
    cfg: ParamConfig
    shape: tuple          # (rows, *inner): normuon (matrices, r, c); adam (rows, last dim)
    shard_rows: int       # rows (matrices) this rank owns, padding included
    lo: int               # first owned row
    real_rows: int        # owned rows that exist (the rest is padding)
    sharded: bool         # split over ranks (sharded / sharded_sparse with more than one rank)
    world_size: int
    splits: tuple | None = None  # sharded NorMuon banks: matrices each rank owns

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def uneven(self) -> bool:  # owned blocks of different sizes (balanced banks): the collectives are all_to_alls
        return self.sharded and self.splits is not None and len(set(self.splits)) > 1

    @property
    def even(self) -> bool:  # sharded without padding: shards are slices of the parameter, gathers in place
        return self.sharded and not self.uneven and self.shard_rows * self.world_size == self.rows

    def view(self) -> torch.Tensor:
        return self.param.data.view(self.shape)

    def grad_view(self) -> torch.Tensor:
        """The gradient in the placement's shape (zeros when the parameter has none)."""
        g = self.param.grad
        if g is None:
            return torch.zeros(self.shape, dtype=self.param.dtype, device=self.param.device)
        return g.reshape(self.shape).contiguous()

    def local_shard(self) -> torch.Tensor:
        """The local shard to update in place: a view of the parameter, or a padded copy."""
        view = self.view()
        if not self.sharded:
            return view
        if self.even or self.uneven:
            return view[self.lo:self.lo + self.shard_rows]
        shard = view.new_zeros((self.shard_rows, *self.shape[1:]))
        shard[:self.real_rows] = view[self.lo:self.lo + self.real_rows]
        return shard

def placement_of(label: str, p: torch.Tensor, cfg: ParamConfig, world_size: int, rank: int) -> Placement:
    """A label's Placement before bank ownership: (matrices, rows, cols) or (rows, last dim); ceil(rows / W) a rank."""
    if cfg.optimizer in MATRIX_KINDS:
        shape = (p.numel() // (p.size(-2) * p.size(-1)), p.size(-2), p.size(-1))
    else:
        shape = (p.numel() // p.size(-1), p.size(-1)) if p.ndim >= 2 else (p.numel(), 1)
    sharded = cfg.comms in ("sharded", "sharded_sparse") and world_size > 1
    k = -(-shape[0] // world_size) if sharded else shape[0]
    lo = rank * k if sharded else 0
    real = max(0, min(k, shape[0] - lo))
    return Placement(label, p, cfg, shape, k, lo, real, sharded, world_size)

class OwnershipLayout:
    """Which rows of every label `rank` of `world_size` ranks owns (placements), planned without a process group;
    sharded NorMuon banks are split into whole matrices by OWNERSHIPS[ownership] (splits)."""

    def __init__(self, params: dict[str, torch.Tensor], configs: dict[str, ParamConfig], world_size: int = 1,
                 rank: int = 0, ownership: str = "balanced", orthogonalizer="polar_express", order=None):
        _check_ownership(ownership, "NorMuonAdam: ownership=")
        self.world_size, self.rank = world_size, rank
        self.placements = {label: placement_of(label, p, configs[label], world_size, rank) for label, p in params.items()}
        banks = {label: placement for label in (params if order is None else order)
                 if (placement := self.placements[label]).sharded and placement.cfg.optimizer in MATRIX_KINDS}
        self.splits = OWNERSHIPS[ownership](banks, world_size, orthogonalizer)
        for label, split in self.splits.items():
            k, lo = split[rank], sum(split[:rank])
            self.placements[label] = dataclasses.replace(self.placements[label], shard_rows=k, lo=lo, real_rows=k, splits=split)

    def matrix_lr(self, label: str) -> torch.Tensor:
        """A NorMuon label's lr_multipliers on the owned matrices, (shard_rows, 1, 1) fp32, 0 on padding."""
        placement = self.placements[label]
        per_matrix = lr_multipliers(placement.cfg, placement.shape)
        shard = torch.zeros(placement.shard_rows, dtype=torch.float64)
        shard[:placement.real_rows] = per_matrix[placement.lo:placement.lo + placement.real_rows]
        return shard.to(torch.float32).view(-1, 1, 1).to(placement.param.device)

    def new_state(self, label: str, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Zero state of the owned shard (on the parameter's device unless given; "meta": shapes and dtypes
        only); NorMuon's second moment has one entry per row of the longer side."""
        placement = self.placements[label]
        shard, dev = (placement.shard_rows, *placement.shape[1:]), device or placement.param.device
        if placement.cfg.optimizer == "adam":
            return {"exp_avg": torch.zeros(shard, dtype=torch.float32, device=dev),
                    "exp_avg_sq": torch.zeros(shard, dtype=torch.float32, device=dev)}
        if placement.cfg.optimizer == "row_adam":
            return {"row_sq": torch.zeros(shard[0], dtype=torch.float32, device=dev)}
        n, r, c = shard
        rails = ("fast_rail", "slow_rail") if placement.cfg.optimizer == "anvil" else ("momentum_buffer",)
        st = {**{name: torch.zeros(shard, dtype=torch.float32, device=dev) for name in rails},
              "second_moment": torch.zeros((n, r, 1) if r >= c else (n, 1, c), dtype=torch.float32, device=dev)}
        if placement.param.dtype == torch.bfloat16:
            st["mantissa"] = torch.zeros(shard, dtype=torch.uint16, device=dev)
        return st

    def shard_of(self, label: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard (padding zeroed) of a tensor of label's placement shape."""
        placement = self.placements[label]
        mine = full.new_zeros((placement.shard_rows, *placement.shape[1:]))
        mine[:placement.real_rows] = full[placement.lo:placement.lo + placement.real_rows]
        return mine

# ---- Comms: collectives per label, and the exchange each Placement needs ----------------------------

# torch >= 2.12 names these reduce_scatter_single / all_gather_single and deprecates the *_tensor names,
# the only ones torch 2.11 has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

class CommLayer:
    """Async collectives, counting the bytes this rank sends (as ring / direct algorithms do) per label and per
    (label, collective). All start in _launch, which SimulatedComm replaces."""

    def __init__(self, group, world_size: int, rank: int):
        self.group, self.world_size, self.rank = group, world_size, rank
        self.bytes_sent: dict[str, int] = {}
        self.bytes_by_op: dict[tuple[str, str], int] = {}

    @classmethod
    def of(cls, group=None) -> "CommLayer":
        """The layer of `group`; None means the default group once one is initialized, else one rank."""
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 1, 0)
        group = dist.group.WORLD if group is None else group
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def _count(self, label: str, op: str, nbytes: float) -> None:
        self.bytes_sent[label] = self.bytes_sent.get(label, 0) + int(nbytes)
        self.bytes_by_op[label, op] = self.bytes_by_op.get((label, op), 0) + int(nbytes)

    def _launch(self, collective, *args, **kw):
        return collective(*args, group=self.group, async_op=True, **kw)

    def reduce_scatter_avg(self, label, out, inp):
        self._count(label, "reduce_scatter", inp.nbytes * (self.world_size - 1) / self.world_size)
        return self._launch(_reduce_scatter, out, inp, op=dist.ReduceOp.AVG)

    def all_reduce_avg(self, label, t):
        self._count(label, "all_reduce", 2 * t.nbytes * (self.world_size - 1) / self.world_size)
        return self._launch(dist.all_reduce, t, op=dist.ReduceOp.AVG)

    def all_gather(self, label, out, shard):
        self._count(label, "all_gather", shard.nbytes * (self.world_size - 1))
        return self._launch(_all_gather, out, shard)

    def all_to_all(self, label, out, inp, out_splits=None, in_splits=None, op: str = "all_to_all"):
        """all_to_all_single, its bytes counted under `op` (balanced ownership's uneven collectives are these)."""
        if in_splits is None:
            sent = inp.nbytes * (self.world_size - 1) / self.world_size
        else:
            sent = (sum(in_splits) - in_splits[self.rank]) * (inp[:1].nbytes if inp.numel() else 0)
        self._count(label, op, sent)
        return self._launch(dist.all_to_all_single, out, inp, out_splits, in_splits)

def reduce_scatter_uneven(comm: CommLayer, label: str, out, inp, splits):
    """Each owner's block (splits[r] rows for rank r) to it by all_to_all: out stacks all ranks' copies."""
    mine = splits[comm.rank]
    return comm.all_to_all(label, out, inp, [mine] * comm.world_size, list(splits), op="reduce_scatter")

def all_gather_uneven(comm: CommLayer, label: str, out, shard, splits):
    """Every owner's block (splits[r] rows) into out on every rank, by all_to_all; returns the wait."""
    W = comm.world_size
    inp = shard.repeat(W, *([1] * (shard.ndim - 1)))
    work = comm.all_to_all(label, out, inp, list(splits), [shard.size(0)] * W, op="all_gather")
    return lambda: (work.wait(), inp)[0]  # inp lives until the exchange is done

def scatter_uneven(comm: CommLayer, placement: Placement, g: torch.Tensor):
    """ShardExchange.scatter of a bank with uneven owned blocks: every rank's copy of this rank's block by
    all_to_all, averaged in fp32 and rounded once to the gradient dtype (as the sparse exchange)."""
    W, k = comm.world_size, placement.shard_rows
    recv = g.new_empty((W * k, *placement.shape[1:]))
    work = reduce_scatter_uneven(comm, placement.label, recv, g, placement.splits)

    def average():
        work.wait()
        return (recv.view(W, k, *placement.shape[1:]).float().sum(0) / W).to(g.dtype)
    return average

@dataclass
class _SparsePlan:
    """Row exchange for one sharded_sparse table, planned from the rows touched since its last step."""
    dense: bool
    rows: torch.Tensor | None = None        # sorted unique touched row ids (comm device)
    send_counts: list | None = None
    recv_counts: list | None = None
    recv_rows: torch.Tensor | None = None
    rows_work: object = None

class ShardExchange:
    """A Placement's reduction (scatter) and all_gather (gather), each returning its wait. sharded_sparse tables
    send the rows declared since their last step (dense where a rank has more than sparse_threshold of them)."""

    def __init__(self, comm: CommLayer, sparse_threshold: float = 0.5):
        self.comm, self.world_size = comm, comm.world_size
        self.sparse_threshold = float(sparse_threshold)
        self.declared: dict[str, list[torch.Tensor]] = {}
        self.plans: dict[str, _SparsePlan] = {}

    def declare_rows(self, placement: Placement, row_ids, launch: bool = False) -> None:
        """Record rows of a sharded_sparse table; launch=True also starts its exchange (a collective)."""
        if self.world_size == 1:
            return
        _check_sparse_declaration(self, placement)
        ids = torch.as_tensor(row_ids).reshape(-1).to(device="cpu", dtype=torch.int64)
        self.declared.setdefault(placement.label, []).append(ids)
        if launch:
            self.plans[placement.label] = self._plan_sparse(placement)

    def _plan_sparse(self, placement: Placement, grad: torch.Tensor | None = None) -> _SparsePlan:
        """Exchange row counts per owner and per rank (every rank takes the same dense-or-sparse decision),
        then launch the row-id exchange."""
        W, k, dev = self.world_size, placement.shard_rows, placement.param.device
        pending = self.declared.pop(placement.label, None)
        if pending:
            rows = torch.unique(torch.cat(pending))
            _check_sparse_rows(placement, rows)
        else:  # nothing declared: send the rows where this rank's gradient is nonzero
            rows = (grad != 0).flatten(1).any(dim=1).nonzero().view(-1).cpu()
        send_counts = torch.bincount(rows // k, minlength=W)
        meta = torch.stack([send_counts, torch.full((W,), rows.numel(), dtype=torch.int64)], dim=1)
        # Counts travel as CPU tensors (gloo; on GPUs the process group is "cuda:nccl,cpu:gloo"), so the
        # host knows the split sizes without waiting for the GPU, as in the record.
        recv_meta = torch.empty_like(meta)
        self.comm.all_to_all(placement.label, recv_meta, meta).wait()
        if int(recv_meta[:, 1].max()) > self.sparse_threshold * placement.rows:
            return _SparsePlan(dense=True)
        send, recv = send_counts.tolist(), recv_meta[:, 0].tolist()
        rows = rows.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else rows
        recv_rows = torch.empty(sum(recv), dtype=torch.int64, device=dev)
        work = self.comm.all_to_all(placement.label, recv_rows, rows, recv, send)
        return _SparsePlan(False, rows, send, recv, recv_rows, work)

    def scatter(self, placement: Placement, g: torch.Tensor):
        """Launch the reduction of gradient g (the placement's shape); the wait yields the local shard's average."""
        label, W = placement.label, self.world_size
        if W == 1 or placement.cfg.comms == "none":
            return lambda: g
        if placement.cfg.comms == "replicated":
            work = self.comm.all_reduce_avg(label, g)
            return lambda: (work.wait(), g)[1]
        if placement.cfg.comms == "sharded_sparse":
            plan = self.plans.pop(label, None) or self._plan_sparse(placement, g)
            if not plan.dense:
                return self._scatter_sparse(placement, g, plan)
        if placement.uneven:  # balanced ownership
            return scatter_uneven(self.comm, placement, g)
        k = placement.shard_rows
        if not placement.even:
            padded = g.new_zeros((k * W, *placement.shape[1:]))
            padded[:placement.rows] = g
            g = padded
        out = g.new_empty((k, *placement.shape[1:]))
        work = self.comm.reduce_scatter_avg(label, out, g)
        return lambda: (work.wait(), out)[1]

    def _scatter_sparse(self, placement: Placement, g: torch.Tensor, plan: _SparsePlan):
        values = g[plan.rows]
        recv_values = g.new_empty((sum(plan.recv_counts), *placement.shape[1:]))
        work = self.comm.all_to_all(placement.label, recv_values, values, plan.recv_counts, plan.send_counts)

        def finish():
            plan.rows_work.wait()
            work.wait()
            acc = torch.zeros((placement.shard_rows, *placement.shape[1:]), dtype=torch.float32, device=g.device)
            acc.index_add_(0, plan.recv_rows - placement.lo, recv_values.float())
            return (acc / self.world_size).to(g.dtype)  # rounded like the dense reduce_scatter(AVG)
        return finish

    def gather(self, placement: Placement, shard: torch.Tensor):
        """Launch the all_gather of an updated local shard into the parameter (None: not sharded)."""
        if not placement.sharded:
            return None
        view = placement.view()
        if placement.uneven:
            return all_gather_uneven(self.comm, placement.label, view, shard, placement.splits)
        if placement.even:
            return self.comm.all_gather(placement.label, view, shard).wait  # in place: shard is a slice of view
        full = shard.new_empty((placement.shard_rows * self.world_size, *placement.shape[1:]))
        work = self.comm.all_gather(placement.label, full, shard)

        def finish():
            work.wait()
            view.copy_(full[:placement.rows])
        return finish

    def full_tensor(self, placement: Placement, shard: torch.Tensor) -> torch.Tensor:
        """All rows of a sharded fp32 state tensor (rows, *inner), gathered from every rank."""
        if not placement.sharded:
            return shard
        full = shard.new_empty((placement.shard_rows * self.world_size, *placement.shape[1:]))
        self.comm.all_gather(placement.label, full, shard.contiguous()).wait()
        return full[:placement.rows]

def _check_sparse_declaration(exchange: ShardExchange, placement: Placement) -> None:
    if placement.label in exchange.plans:
        raise ValueError(f"prepare_sparse: the row exchange of {placement.label!r} was already launched for this step;"
                         " declare every row before launch=True")

def _check_sparse_rows(placement: Placement, rows: torch.Tensor) -> None:
    """rows: the sorted unique row ids declared for placement's table."""
    if rows.numel() and (rows[0] < 0 or rows[-1] >= placement.rows):
        raise ValueError(f"prepare_sparse: row ids of {placement.label!r} must be in [0, {placement.rows});"
                         f" got {int(rows[0])}..{int(rows[-1])}")

# ---- NorMuonAdam: the orchestrator ----------------------------------------------------------

class NorMuonAdam:
    """Fused NorMuon (matrix banks) + Adam (the rest) that owns all communication: the phases above, on the
    shards of self.layout, through self.exchange on self.comm. params / configs: by label; each order lists
    every label once. tied=(embed, head) keeps embed == head^T (the head's Adam drives both) until untie().
    step() sets the gradients it consumes to None (Adam's accumulate over steps without Adam)."""

    def __init__(self, params: dict[str, nn.Parameter], configs: dict[str, ParamConfig], *, scatter_order,
                 work_order, normuon_lr: float = 0.023, normuon_wd: float = 1.2, normuon_momentum: float = 0.95,
                 normuon_beta2: float = 0.9, adam_lr: float = 0.008, adam_wd: float = 0.005, adam_eps: float = 1e-10,
                 orthogonalizer="polar_express", tied: tuple[str, str] | None = None, process_group=None,
                 sparse_threshold: float = 0.5, ownership: str = "balanced", compile=False,
                 comm: CommLayer | None = None, anvil_wd: float = 2.25, anvil_slow_beta: float = 0.98):
        params, configs, tied = dict(params), dict(configs), None if tied is None else tuple(tied)
        self.scatter_order, self.work_order = list(scatter_order), list(work_order)
        _check_optimizer_args(self, params, configs, tied)
        self.comm = comm if comm is not None else CommLayer.of(process_group)
        self.group, self.world_size, self.rank = self.comm.group, self.comm.world_size, self.comm.rank
        self.normuon_lr, self.normuon_wd, self.normuon_momentum = normuon_lr, normuon_wd, normuon_momentum
        self.normuon_beta2, self.anvil_wd, self.anvil_slow_beta = normuon_beta2, anvil_wd, anvil_slow_beta
        self.adam_lr, self.adam_wd, self.adam_eps = adam_lr, adam_wd, adam_eps
        self.orthogonalize = orthogonalizer_of(orthogonalizer)
        self.layout = OwnershipLayout(params, configs, self.world_size, self.rank, ownership,
                                      self.orthogonalize, self.scatter_order)
        self.placements: dict[str, Placement] = self.layout.placements
        self.exchange = ShardExchange(self.comm, sparse_threshold)
        self.tied = tied  # parameters are never touched here: a restored checkpoint may be untied
        self.state = {label: {} if self.tied and label == self.tied[0] else self.layout.new_state(label)
                      for label in self.placements}
        self.adam_steps = {label: 0 for label, placement in self.placements.items()
                           if placement.cfg.optimizer in ADAM_KINDS}
        self._matrix_lr = {label: self.layout.matrix_lr(label) for label, placement in self.placements.items()
                           if placement.cfg.optimizer in MATRIX_KINDS}
        updates = update_functions(compile)
        self._normuon_fn, self._anvil_fn, self._adam_fn = updates["normuon"], updates["anvil"], updates["adam"]
        self._row_adam_fn = updates["row_adam"]
        self._on_backward: tuple[bool, tuple, dict] | None = None  # (do_adam, held, reductions): reductions_on_backward

    def prepare_sparse(self, label: str, row_ids, launch: bool = False) -> None:
        """Declare all rows (or none: the nonzero ones are sent) that a micro-batch's gradient of a sharded_sparse
        table touches. launch=True starts the exchange before the backward: a collective every rank calls."""
        _check_sparse_label(self, label)
        self.exchange.declare_rows(self.placements[label], row_ids, launch)

    def _hyperparams(self, labels, lr_scale: float, momentum: float, rails: tuple,
                     stretch: dict) -> dict[str, torch.Tensor]:
        rows = []
        for label in labels:
            cfg = self.placements[label].cfg
            if cfg.optimizer == "normuon":
                rows.append(normuon_hyperparams(self.normuon_lr * lr_scale, self.normuon_wd, cfg.wd_mul,
                                                momentum, self.normuon_beta2))
            elif cfg.optimizer == "anvil":  # the matrix lr is NorMuon's; the decay and rails ANVIL's own
                rows.append(anvil_hyperparams(self.normuon_lr * lr_scale, self.anvil_wd, cfg.wd_mul, momentum,
                                              self.normuon_beta2, rails, self.anvil_slow_beta))
            else:
                lr_mul = float(lr_multipliers(cfg, self.placements[label].shape))
                s = stretch.get(label, 1.0)  # a sparser cadence: each update stands for s of them
                rows.append(adam_hyperparams(self.adam_lr * lr_scale * lr_mul, self.adam_steps[label] + 1,
                                             tuple(b ** s for b in cfg.betas), self.adam_wd, cfg.wd_mul * s,
                                             self.adam_eps))
        return hyperparam_tensors(labels, rows, next(iter(self.placements.values())).param.device)

    def _active(self, do_adam: bool, held=()) -> list[str]:
        """The step's labels in scatter_order: NorMuon's, Adam's on do_adam steps but the held ones; never the
        tied embedding."""
        skip = self.tied[0] if self.tied else None
        return [label for label in self.scatter_order
                if label != skip and (do_adam and label not in held
                                      or self.placements[label].cfg.optimizer in MATRIX_KINDS
                                      or self.placements[label].cfg.every_step)]

    def _launch_reduction(self, label: str, do_adam: bool):
        """Launch label's reduction; while tied, the head's gradient first takes in embed.grad^T."""
        if self.tied and do_adam and label == self.tied[1] and self.placements[self.tied[0]].param.grad is not None:
            embed, head = (self.placements[t].param for t in self.tied)
            if head.grad is None:
                head.grad = embed.grad.mT.contiguous()
            else:
                triton_kernels.transpose_add(embed.grad, head.grad)
            embed.grad = None
        placement = self.placements[label]
        return self.exchange.scatter(placement, placement.grad_view())

    def _adam_groups(self, active) -> list[list[str]]:
        """The step's Adam (and row Adam) labels in work_order, a group at a time: unsharded first (landed first)."""
        adam = [label for label in self.work_order if label in active and self.placements[label].cfg.optimizer in ADAM_KINDS]
        groups = ([label for label in adam if not self.placements[label].sharded],
                  [label for label in adam if self.placements[label].sharded])
        return [group for group in groups if group]

    def _adam_work(self, labels, reduced, hps) -> dict:
        """Wait for a group's reductions, update its Adam shards in one call (row Adam's one a label); returns the
        sharded ones' gathers."""
        placements = [self.placements[label] for label in labels]
        grads = [reduced[label]() for label in labels]
        shards = [placement.local_shard() for placement in placements]
        states = [self.state[label] for label in labels]
        adam = [i for i, placement in enumerate(placements) if placement.cfg.optimizer == "adam"]
        if adam:
            self._adam_fn([grads[i] for i in adam], [states[i]["exp_avg"] for i in adam],
                          [states[i]["exp_avg_sq"] for i in adam], [shards[i] for i in adam],
                          [hps[labels[i]] for i in adam])
        for i in (i for i in range(len(labels)) if i not in adam):
            self._row_adam_fn(grads[i], states[i]["row_sq"], shards[i], hps[labels[i]])
        gathers = {}
        for placement, shard in zip(placements, shards):
            self.adam_steps[placement.label] += 1
            done = self.exchange.gather(placement, shard)
            if done is not None:
                gathers[placement.label] = done
        return gathers

    @torch.no_grad()
    def step(self, do_adam: bool = True, lr_scale: float = 1.0, momentum: float | None = None,
             rails: tuple[float, float] | None = None, held=(), stretch: dict | None = None) -> None:
        """One optimizer step: NorMuon (or ANVIL) every call, Adam only when do_adam (odd steps). lr_scale
        multiplies every base learning rate (the lr schedule); momentum is the NorMuon momentum (ANVIL's rail
        beta) for this step (default: the constructor's); rails: ANVIL's (fast rail's beta, its weight in the
        blend), default (momentum, 1): plain Nesterov momentum. They reach the update functions as tensor
        entries: no recompiles as they change. held: Adam labels that skip this do_adam step, their gradients
        accumulating on; stretch: {Adam label: s}, its betas^s and wd_mul x s (an update standing for s)."""
        momentum = self.normuon_momentum if momentum is None else float(momentum)
        rails = (momentum, 1.0) if rails is None else tuple(float(r) for r in rails)
        held = tuple(held)
        active = self._active(do_adam, held)
        hps = self._hyperparams(active, float(lr_scale), momentum, rails, dict(stretch or {}))
        # phase 1: scatter, unless reductions_on_backward launched it during the backward
        reduced = launched_reductions(self, do_adam, held)
        if reduced is None:
            reduced = {label: self._launch_reduction(label, do_adam) for label in active}
        # phase 2: work. Adam in at most two calls (_adam_groups), then the NorMuon (ANVIL) banks in work_order.
        gathers = {}
        for group in self._adam_groups(active):
            gathers.update(self._adam_work(group, reduced, hps))
        for label in self.work_order:
            if label not in reduced or self.placements[label].cfg.optimizer not in MATRIX_KINDS:
                continue
            placement, st, grad = self.placements[label], self.state[label], reduced[label]()
            shard = placement.local_shard()
            if shard.size(0) and placement.cfg.optimizer == "anvil":  # a balanced bank may give this rank none
                self._anvil_fn(grad, st["fast_rail"], st["slow_rail"], st["second_moment"], shard,
                               st.get("mantissa"), self._matrix_lr[label], hps[label])
            elif shard.size(0):
                self._normuon_fn(grad, st["momentum_buffer"], st["second_moment"], shard, st.get("mantissa"),
                                 self._matrix_lr[label], hps[label], self.orthogonalize)
            done = self.exchange.gather(placement, shard)
            if done is not None:
                gathers[label] = done
        # phase 3: finalize. The head's gather is waited on first, so the tied embedding is refreshed
        # while the other gathers are still in flight.
        if self.tied and do_adam:
            embed, head = (self.placements[t].param for t in self.tied)
            gathers.pop(self.tied[1], lambda: None)()
            triton_kernels.transpose_copy(head.data, embed.data)
        for done in gathers.values():
            done()
        for label in active:
            self.placements[label].param.grad = None

    @torch.no_grad()
    def untie(self) -> None:
        """Give the embedding its own Adam state: the head's, transposed and resharded (a collective)."""
        _check_untie(self)
        e_label, h_label = self.tied
        e, h = self.placements[e_label], self.placements[h_label]
        self.state[e_label] = {name: self.layout.shard_of(e_label, self.exchange.full_tensor(h, shard)
                                                          .reshape(h.param.shape).mT.reshape(e.shape))
                               for name, shard in self.state[h_label].items()}
        self.adam_steps[e_label] = self.adam_steps[h_label]
        self.tied = None

    def state_dict(self) -> dict:
        """A deep copy of this rank's state, with the sparse rows declared since the last Adam step."""
        return {"world_size": self.world_size, "rank": self.rank,
                "tied": list(self.tied) if self.tied else None,
                "adam_steps": dict(self.adam_steps),
                "sparse_rows": {label: torch.cat(ids) for label, ids in self.exchange.declared.items()},
                "state": {label: {name: t.clone() for name, t in st.items()} for label, st in self.state.items()}}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore a state_dict() of the same layout (world size, rank, labels, shapes)."""
        _check_state_dict(self, sd)
        for label, saved in sd["state"].items():
            self.state[label] = self.layout.new_state(label) if saved else {}  # the tied embedding's stays empty
            for name, t in saved.items():
                self.state[label][name].copy_(t)
        self.tied = tuple(sd["tied"]) if sd["tied"] else None
        self.adam_steps = dict(sd["adam_steps"])
        self.exchange.declared = {label: [ids.clone()] for label, ids in sd["sparse_rows"].items()}
        self.exchange.plans.clear()

def _check_optimizer_args(opt: NorMuonAdam, params: dict, configs: dict, tied) -> None:
    """NorMuonAdam's one-line errors: configs and both orders name params' labels exactly once, parameters
    suit their optimizer, and tied names an Adam (embedding, head) pair of transposes."""
    for label in params:
        if label not in configs:
            raise ValueError(f"NorMuonAdam: no ParamConfig for parameter {label!r}; add configs[{label!r}]")
    for label in configs:
        if label not in params:
            raise ValueError(f"NorMuonAdam: config {label!r} names no parameter; labels are {sorted(params)}")
    for name in ("scatter_order", "work_order"):
        order = getattr(opt, name)
        for i, label in enumerate(order):
            if label not in params:
                raise ValueError(f"NorMuonAdam: {name} names unknown label {label!r}; labels are {sorted(params)}")
            if label in order[:i]:
                raise ValueError(f"NorMuonAdam: {name} lists {label!r} twice; list every label exactly once")
        missing = [label for label in params if label not in order]
        if missing:
            raise ValueError(f"NorMuonAdam: {name} is missing {missing}; list every label exactly once")
    for label, p in params.items():
        cfg = configs[label]
        if p.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"NorMuonAdam: parameter {label!r} is {p.dtype}; use bfloat16 or float32")
        if cfg.optimizer in MATRIX_KINDS and p.ndim < 2:
            raise ValueError(f"NorMuonAdam: {cfg.optimizer} parameter {label!r} has shape {tuple(p.shape)};"
                             " it needs matrices (..., rows, cols)")
        if cfg.optimizer == "row_adam" and p.ndim != 2:
            raise ValueError(f"NorMuonAdam: row_adam parameter {label!r} has shape {tuple(p.shape)}; it needs rows"
                             " (rows, width)")
        n = p.numel() // (p.size(-2) * p.size(-1)) if p.ndim >= 2 else 0
        if cfg.optimizer in MATRIX_KINDS and cfg.matrix_lr_mul is not None and len(cfg.matrix_lr_mul) != n:
            raise ValueError(f"NorMuonAdam: {label!r} has {n} matrices but matrix_lr_mul has"
                             f" {len(cfg.matrix_lr_mul)} entries")
    if tied is None:
        return
    if len(tied) != 2 or any(t not in params for t in tied):
        raise ValueError(f"NorMuonAdam: tied={tied!r} must be (embed_label, head_label), both existing labels")
    embed, head = (params[t] for t in tied)
    if any(configs[t].optimizer != "adam" for t in tied):
        raise ValueError("NorMuonAdam: tied embedding and head must both use optimizer='adam'")
    if embed.ndim != 2 or tuple(embed.shape) != tuple(head.shape)[::-1]:
        raise ValueError(f"NorMuonAdam: tied shapes {tuple(embed.shape)} and {tuple(head.shape)}"
                         " must be transposes of each other")
    if embed.dtype != head.dtype:
        raise ValueError("NorMuonAdam: tied embedding and head must have the same dtype")

def _check_state_dict(opt: NorMuonAdam, sd: dict) -> None:
    """NorMuonAdam.load_state_dict's one-line errors unless sd is a state_dict() of the same layout."""
    if sd.get("world_size") != opt.world_size or sd.get("rank") != opt.rank:
        raise ValueError(f"load_state_dict: saved on rank {sd.get('rank')} of {sd.get('world_size')}, loading on rank"
                         f" {opt.rank} of {opt.world_size}; optimizer shards need the same world size")
    if set(sd["state"]) != set(opt.state):
        raise ValueError(f"load_state_dict: labels {sorted(sd['state'])} differ from this optimizer's {sorted(opt.state)}")
    for label, saved in sd["state"].items():
        ref = opt.layout.new_state(label, torch.device("meta"))  # what load_state_dict allocates, unallocated
        if saved and set(saved) != set(ref):
            raise ValueError(f"load_state_dict: {label!r} has state {sorted(saved)}, expected {sorted(ref)}")
        for name, t in saved.items():
            if t.shape != ref[name].shape or t.dtype != ref[name].dtype:
                raise ValueError(f"load_state_dict: {label!r}.{name} is {tuple(t.shape)} {t.dtype},"
                                 f" expected {tuple(ref[name].shape)} {ref[name].dtype}")

def _check_sparse_label(opt: NorMuonAdam, label: str) -> None:
    placement = opt.placements.get(label)
    if placement is None or placement.cfg.comms != "sharded_sparse":
        raise ValueError(f"prepare_sparse: {label!r} is not a parameter with comms='sharded_sparse'")

def _check_untie(opt: NorMuonAdam) -> None:
    if opt.tied is None:
        raise ValueError("NorMuonAdam.untie(): embedding and head are not tied")
    if opt._on_backward is not None:
        raise ValueError("NorMuonAdam.untie(): reductions launched by reductions_on_backward are pending;"
                         " call step() first")

# ---- Reductions launched from gradient hooks (record #89 launches them after the backward) ----

class BackwardReductions:
    """Phase 1 from post-accumulate-grad hooks in the last backward, as modded-nanogpt's DistAdam before record
    #89 (which launches after it: the same numbers). In `order`, a label launches once its needs[label] hooks
    (the tied head's: the embedding's too) and every label before it have fired: the same order on every rank."""

    def __init__(self, order, needs: dict[str, tuple[str, ...]], launch):
        self.order, self.needs, self.launch = list(order), needs, launch
        self.fired: set[str] = set()
        self.launched: dict = {}  # label -> the function that waits for its reduction (ShardExchange.scatter)

    def hook(self, label: str):
        def on_final_grad(_param):
            self.fired.add(label)
            self.advance()
        return on_final_grad

    def advance(self, final: bool = False) -> None:
        """Launch, in order, every ready label (final: every label left, after the backward)."""
        while len(self.launched) < len(self.order):
            label = self.order[len(self.launched)]
            if not final and not self.fired.issuperset(self.needs[label]):
                return
            self.launched[label] = self.launch(label)

@contextlib.contextmanager
def reductions_on_backward(opt: NorMuonAdam, do_adam: bool, held=()):
    """Around the last micro-batch's backward: launch opt's reductions of the step from gradient hooks
    (BackwardReductions); the next opt.step(do_adam, held=held) takes them (launched_reductions). One rank:
    nothing."""
    do_adam, held = bool(do_adam), tuple(held)
    if opt._on_backward is not None:
        raise ValueError("reductions_on_backward: this step's reductions are already launched; call step() first")
    if opt.world_size == 1:
        yield
        return
    active = opt._active(do_adam, held)
    head = opt.tied[1] if opt.tied and do_adam else None
    needs = {label: (label, opt.tied[0]) if label == head else (label,) for label in active}
    launch = BackwardReductions(active, needs, functools.partial(opt._launch_reduction, do_adam=do_adam))
    handles = []
    try:
        for label in dict.fromkeys(n for ns in needs.values() for n in ns):
            p = opt.placements[label].param
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(launch.hook(label)))
            else:  # no gradient will come: ready now
                launch.fired.add(label)
        yield
    finally:
        for h in handles:
            h.remove()
    launch.advance(final=True)
    opt._on_backward = (do_adam, held, launch.launched)

def launched_reductions(opt: NorMuonAdam, do_adam: bool, held=()) -> dict | None:
    """The reductions reductions_on_backward launched for opt's next step (taken: launched once), else None."""
    if opt._on_backward is None:
        return None
    (launched_adam, launched_held, reduced), opt._on_backward = opt._on_backward, None
    if (launched_adam, launched_held) != (bool(do_adam), tuple(held)):
        raise ValueError(f"NorMuonAdam.step: do_adam={do_adam}, held={tuple(held)} but reductions_on_backward launched"
                         f" the reductions of a do_adam={launched_adam}, held={launched_held} step")
    return reduced

# ---- Every label's learning rate, as the updates apply it (tests) ----------------------------------

def learning_rates(opt: NorMuonAdam, lr_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Every label's lr at schedule multiplier lr_scale: its optimizer's base lr x lr_scale x lr_multipliers
    (float64; the updates apply them rounded to fp32)."""
    return {label: (opt.normuon_lr if placement.cfg.optimizer in MATRIX_KINDS else opt.adam_lr) * lr_scale
            * lr_multipliers(placement.cfg, placement.shape) for label, placement in opt.placements.items()}

# ---- One rank of a larger world, in one process ----------------------------------------------
# tests/benchmarks/step_timing.py --as_rank_of N times rank 0's share of an N-rank step on one device:
# NorMuonAdam(comm=SimulatedComm(N)) updates rank 0's shards and launches every collective an N-rank
# step launches, counted in bytes as CommLayer counts them, but none of them communicates.

class _CompletedWork:
    """The handle of a collective that is already done."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

class SimulatedComm(CommLayer):
    """Rank `rank` of `world_size` ranks in one process, no process group: every collective completes at
    once with the output a real group gives when every other rank holds the same tensors as this one.
    reduce_scatter (average): this rank's block of the input; all_reduce (average): the tensor as it is;
    all_gather: the local shard in every rank's block; all_to_all: each rank's block of the output is the
    block this rank addresses to itself, where their sizes agree, and is left as it is where they do not
    (the other owners' blocks of an uneven all_gather). Bytes are counted as the world_size-rank
    collectives send them (CommLayer's counts), so bytes_sent and bytes_by_op are a real rank's.

    With the same gradients on every rank, the shards this rank updates are a real run's rank `rank`'s
    to the bit; the rows other ranks own are not (they hold copies of this rank's rows)."""

    def __init__(self, world_size: int, rank: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"SimulatedComm: rank {rank} is not one of the {world_size} ranks")
        super().__init__(None, world_size, rank)

    def _launch(self, collective, *args, **kw):
        stand_in = {_reduce_scatter: self._reduce_scatter, dist.all_reduce: self._all_reduce,
                    _all_gather: self._all_gather, dist.all_to_all_single: self._all_to_all}[collective]
        stand_in(*args, **kw)
        return _CompletedWork()

    def _reduce_scatter(self, out, inp, op=None):
        out.copy_(inp.reshape(self.world_size, *out.shape)[self.rank])

    def _all_reduce(self, t, op=None):
        pass

    def _all_gather(self, out, shard):
        blocks, r = out.view(self.world_size, *shard.shape), self.rank
        if blocks[r].data_ptr() == shard.data_ptr():  # in place: this rank's block is the shard itself
            for others in (blocks[:r], blocks[r + 1:]):  # (two copies, not one per rank: launches count)
                others.copy_(shard.expand_as(others))
        else:
            blocks.copy_(shard.expand_as(blocks))

    def _all_to_all(self, out, inp, out_splits=None, in_splits=None):
        W = self.world_size
        in_splits = in_splits or [inp.size(0) // W] * W
        out_splits = out_splits or [out.size(0) // W] * W
        lo = sum(in_splits[:self.rank])
        mine = inp[lo:lo + in_splits[self.rank]]
        if all(n == mine.size(0) for n in out_splits):
            blocks = out.view(W, *mine.shape)
            blocks.copy_(mine.expand_as(blocks))
            return
        at = 0
        for n in out_splits:
            if n == mine.size(0):
                out[at:at + n].copy_(mine)
            at += n

# ---- QK-Clip (MuonClip) ----------------------------------------------------------------------
# Caps a head's attention logits by scaling its Q and K rows after the NorMuon update. No record
# uses it; `with after_update(opt, qk_clip_hooks(...)): opt.step(...)` applies it.

QK_CLIP_TAU = 100.0  # MuonClip's threshold on the largest pre-softmax attention logit

def qk_clip_(param, mantissa, max_logits, tau: float) -> None:
    """QK-Clip (MuonClip) on the owned matrices of a Q or K weight bank (k, rows, cols), in place:
    rows whose head's largest pre-softmax logit of the step exceeds tau are scaled by
    sqrt(tau / max_logit), so that q.k of that head, scaled on both sides, peaks at tau. max_logits
    broadcasts to (k, rows, 1) (one entry per head of those rows). Applied to the fp32 master value
    (MuonClip, Kimi K2, arXiv 2507.20534)."""
    scale = (tau / max_logits.float().clamp_min(tau)).sqrt()
    _store_master(_master_fp32(param, mantissa) * scale, param, mantissa)

@contextlib.contextmanager
def after_update(opt: NorMuonAdam, hooks: dict):
    """Around opt.step(): hooks[label](placement, shard, mantissa) runs on this rank's updated matrices of a NorMuon
    label (shard, in place) just before they are gathered, e.g. qk_clip_hooks: the hook wraps opt's gather."""
    _check_after_update(opt, hooks)
    gather, wrapped = opt.exchange.gather, vars(opt.exchange).get("gather")  # wrapped: an enclosing block's

    def gather_after_hook(placement: Placement, shard: torch.Tensor):
        if placement.label in hooks:
            hooks[placement.label](placement, shard, opt.state[placement.label].get("mantissa"))
        return gather(placement, shard)
    opt.exchange.gather = gather_after_hook
    try:
        yield opt
    finally:  # the enclosing block's gather again, else the class's
        if wrapped is None:
            del opt.exchange.gather
        else:
            opt.exchange.gather = wrapped

def qk_clip_hooks(max_logits: dict, tau: float = QK_CLIP_TAU) -> dict:
    """after_update's hooks for QK-Clip: label of a Q or K bank -> the step's largest
    logit per head, broadcastable to the bank's (matrices, rows, 1) and the same on every rank."""
    def clip(m):
        def hook(placement, shard, mantissa):
            full = torch.broadcast_to(torch.as_tensor(m, device=shard.device), (placement.rows, placement.shape[1], 1))
            qk_clip_(shard, mantissa, full[placement.lo: placement.lo + placement.shard_rows], tau)
        return hook
    return {label: clip(m) for label, m in max_logits.items()}

def _check_after_update(opt: NorMuonAdam, hooks: dict) -> None:
    for label in hooks:
        if label not in opt.placements or opt.placements[label].cfg.optimizer != "normuon":
            raise ValueError(f"after_update: hooks[{label!r}] needs a normuon label")

# ---- Tensor-parallel orthogonalization and NorMuon ------------------------------------------
# (the modes of Megatron-LM's TensorParallelMuon)

TP_MODES = ("duplicated", "distributed", "blockwise")

def tensor_parallel_orthogonalize(shard: torch.Tensor, mode: str, shard_dim: int, group=None,
                                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Polar Express of a matrix (or bank) split over the ranks of `group` along shard_dim (-2: row
    shards, -1: column shards, equal sizes); returns this rank's shard of the result
    (the modes of Megatron-LM's TensorParallelMuon).

    duplicated   all_gather the whole matrix, run polar_express on it on every rank, keep the shard
    distributed  the iteration on shards: the Gram matrix over the unsplit side, X^T X for row shards
                 or X X^T for column shards, is a sum of per-shard products, all_reduced (fp32, as
                 is the Frobenius norm); the same polynomial as polar_express, in fp32, cast to dtype
    blockwise    polar_express of the shard alone: no communication, an approximation
    """
    if mode not in TP_MODES:
        raise ValueError(f"tensor_parallel_orthogonalize: mode={mode!r}; choose one of {', '.join(TP_MODES)}")
    dim = shard_dim % shard.ndim
    if dim < shard.ndim - 2:
        raise ValueError(f"tensor_parallel_orthogonalize: shard_dim must be -2 or -1, got {shard_dim}")
    if mode == "blockwise":
        return polar_express(shard, dtype=dtype)
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    if mode == "duplicated":
        return polar_express(_gather_shards(shard, dim, group), dtype=dtype).chunk(W, dim=dim)[rank].contiguous()
    X = _as_bank(shard).float()
    sq = X.square().sum(dim=(-2, -1), keepdim=True)
    dist.all_reduce(sq, group=group)
    X = X / (sq.sqrt() * 1.02 + 1e-6)
    rows = dim == shard.ndim - 2  # row shards share the columns: X^T X is summed over the shards
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = X.mT @ X if rows else X @ X.mT
        dist.all_reduce(A, group=group)
        B = b * A + c * (A @ A)
        X = a * X + (X @ B if rows else B @ X)
    return X.to(dtype).reshape(shard.shape)

def _gather_shards(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole tensor from every rank's equal shard along dim (all_gather, concatenated in rank order)."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)

def _tp_layout(shard: torch.Tensor, mode: str, shard_dim: int, group) -> tuple[int, int, int, int]:
    """(dim, world size, rows, cols) of the matrix a shard belongs to; blockwise treats the shard as the matrix."""
    if mode not in TP_MODES:
        raise ValueError(f"tensor_parallel_normuon_update: mode={mode!r}; choose one of {', '.join(TP_MODES)}")
    dim = shard_dim % shard.ndim
    if shard.ndim < 2 or dim < shard.ndim - 2:
        raise ValueError(f"tensor_parallel_normuon_update: shard_dim must be -2 or -1 of (..., rows, cols), got {shard_dim}")
    W = 1 if mode == "blockwise" else dist.get_world_size(group)
    rows, cols = shard.size(-2) * (W if dim == shard.ndim - 2 else 1), shard.size(-1) * (W if dim == shard.ndim - 1 else 1)
    return dim, W, rows, cols

def tensor_parallel_normuon_state(shard: torch.Tensor, mode: str, shard_dim: int, group=None) -> dict[str, torch.Tensor]:
    """Zero state for tensor_parallel_normuon_update of this shard: the momentum (the shard's shape),
    the second moment and, for a bf16 shard, the mantissa. The second moment has one entry per row of
    the longer side of the whole matrix (of the shard, blockwise); distributed keeps only this rank's
    entries when those rows are the split ones, duplicated keeps all of them on every rank."""
    dim, W, rows, cols = _tp_layout(shard, mode, shard_dim, group)
    per_row = rows >= cols
    n = rows if per_row else cols
    if mode == "distributed" and (dim == shard.ndim - 2) == per_row:
        n //= W
    lead = shard.shape[:-2]
    st = {"momentum_buffer": torch.zeros(shard.shape, dtype=torch.float32, device=shard.device),
          "second_moment": torch.zeros((*lead, n, 1) if per_row else (*lead, 1, n), dtype=torch.float32, device=shard.device)}
    if shard.dtype == torch.bfloat16:
        st["mantissa"] = torch.zeros(shard.shape, dtype=torch.uint16, device=shard.device)
    return st

def _split_variance_reduction(O, second_moment, beta2, dim: int, rows: int, cols: int, group) -> torch.Tensor:
    """normuon_variance_reduction of the whole matrix, computed on its shard O: where the reduced dim
    is split the per-row sums of O^2 are all_reduced; where the kept dim is split, each rank holds
    its rows' statistics and the two Frobenius norms of the renormalisation are all_reduced."""
    red = O.ndim - 1 if rows >= cols else O.ndim - 2
    size = cols if rows >= cols else rows
    sq = O.float().square().sum(dim=red, keepdim=True)
    if red == dim:
        dist.all_reduce(sq, group=group)
    mean_sq = sq / size
    second_moment.lerp_(mean_sq, 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    norms = torch.stack([(mean_sq * size).sum(dim=(-2, -1), keepdim=True),
                         ((mean_sq * size) * step.square()).sum(dim=(-2, -1), keepdim=True)])
    if red != dim:
        dist.all_reduce(norms, group=group)
    norm, new_norm = norms.sqrt()
    return O.mul_((step * (norm / new_norm.clamp_min(1e-10))).to(O.dtype))

def tensor_parallel_normuon_update(grad, momentum_buf, second_moment, param, mantissa, matrix_lr, hp, mode: str,
                                   shard_dim: int, group=None, dtype: torch.dtype = torch.bfloat16) -> None:
    """One NorMuon step, as _normuon_update with Polar Express, on this rank's shard of a matrix (or
    bank) split over the ranks of `group` along shard_dim (-2: row shards, -1: column shards, equal
    sizes), in place. State from tensor_parallel_normuon_state; hp as _normuon_update's; matrix_lr
    with the whole matrix's shape factor. Momentum and the cautious update are elementwise on the shard.

    duplicated   all_gather the momentum-applied gradient; orthogonalization and variance reduction of
                 the whole matrix on every rank; the unsharded update, bit for bit
    distributed  tensor_parallel_orthogonalize's iteration on shards, then the variance reduction
                 with statistics combined over the shards (_split_variance_reduction)
    blockwise    _normuon_update of the shard as a matrix of its own: no communication, an approximation
    """
    dim, W, rows, cols = _tp_layout(grad, mode, shard_dim, group)
    orthogonalize = functools.partial(polar_express, dtype=dtype)
    if mode == "blockwise":
        return _normuon_update(grad, momentum_buf, second_moment, param, mantissa, matrix_lr, hp, orthogonalize)
    hp = hyperparams_of(NorMuonHyperparams, hp)
    g = _nesterov_momentum(grad, momentum_buf, hp.momentum)
    if mode == "duplicated":
        O = normuon_variance_reduction(orthogonalize(_gather_shards(g, dim, group)), second_moment, hp.beta2)
        O = O.chunk(W, dim=dim)[dist.get_rank(group)]
    else:
        O = tensor_parallel_orthogonalize(g, "distributed", shard_dim, group, dtype=dtype)
        O = _split_variance_reduction(O, second_moment, hp.beta2, dim, rows, cols, group)
    _cautious_step(O.float(), param, mantissa, hp.lr * matrix_lr, hp.decay)

# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

# Record #89's model (modded-nanogpt PR #342; MUDD connections, arXiv 2502.12170; YaRN, arXiv 2309.00071) on
# one packed sequence of T tokens; the layer table (Hyperparameters.layers) gives each layer's role:
#   x0 = norm(smear(embed[ids])); xb = bigram_embed[hash(prev, cur)] * sign row; x = cache0 = x0 + g xb
#   "skip" rows add a gated copy of the save_skip layer's output; attention rows
#   x = resid x + post attn(norm(x, or h)) + g x0 (+ g xb), the "mudd" row mixing cache0, h and x into x
#   and V; then x = resid x + post mlp(norm(x)); after the last layer MUDD layer 1 mixes the saved streams
#   back in, and logits = softcap(norm(x) @ lm_head). Per-token gates g come from MUDD gate MLPs 0 and 1.
# Attention: QK rms-norm, rotary on half of each head, key offset, gated value embeddings, masked softmax,
# DC term, XSA, linear output gate.
# The banks (bf16, padded with zero matrices to a multiple of the world size; model.bank_roles names each):
#   qk_bank  (Nqk, 2*hd, D)      per attention layer H/2 Q groups then H/2 K groups of two heads, (out, in)
#   vo_bank  (Nvo, D, D)         [2j] = V, [2j+1] = output projection, (out, in)
#   mlp_bank (Nmlp, hidden, D)   [2i] = up (out, in), [2i+1] = down stored (in, out)
# lm_head (D, Vp) is stored (in, out) for the FP8 op; embed is its transpose while tied (the optimizer folds
# embed.grad^T into lm_head.grad). reset_parameters is the record's initialisation.

FLEX_BLOCK_SIZE = 128  # block-sparsity granularity of the GPU attention kernel
EVAL_CHUNK_TOKENS = 8192  # evaluation computes logits and cross-entropy this many tokens at a time
RMS_NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's own default for bf16 inputs (the record's)
DC_CHUNK = 128  # query tokens per band of the DC term

def norm(x: torch.Tensor) -> torch.Tensor:
    """Weightless RMS norm over the last dim, eps = fp32 machine epsilon whatever the dtype."""
    return F.rms_norm(x, (x.size(-1),), eps=RMS_NORM_EPS)

def mudd_gate_layout(layers: tuple, num_heads: int) -> tuple[dict, dict]:
    """{(kind, layer): (start, width)} of each per-token coefficient in MUDD gates 0 and 1 (the layers before
    the post_gates row, the rest), in the record's order."""
    split = next(i for i, r in enumerate(layers) if r.post_gates)
    layouts = []
    for part in (range(split), range(split, len(layers))):
        entries = [(kind, i, num_heads) for kind in ("xsa", "gate") for i in part if getattr(layers[i], kind)]
        entries += [(kind, i, 1) for i in part if layers[i].attention != "none" and not layers[i].mudd
                    for kind, field in (("x0", "x0"), ("bigram", "ngram")) if getattr(layers[i], field)]
        entries += [("skip", i, 1) for i in part if layers[i].attention == "none"]
        entries += [(kind, i, num_heads) for kind in ("dc_w1", "dc_w2") for i in part if layers[i].dc]
        starts = np.cumsum([0] + [width for _, _, width in entries]).tolist()
        layouts.append({(kind, i): (start, width) for (kind, i, width), start in zip(entries, starts)})
    return layouts[0], layouts[1]

# -- embeddings ---------------------------------------------------------------------------------

def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values wrapped as int32 arithmetic would (two's complement)."""
    return (x + 2**31) % 2**32 - 2**31

def bigram_hash(tokens, rows: int) -> torch.Tensor:
    """int64 row of a bigram channel of `rows` rows per position, in the record's int32 arithmetic: h[0] = B-1
    (reserved), h[t] = ((36313 cur) XOR (27191 prev)) mod (B-1) (floor), prev the sentinel B-1 at t = 1 (the
    record's quirk, which record #92 keeps)."""
    mod = rows - 1
    t = torch.as_tensor(tokens).to(torch.int64)
    out = torch.full_like(t, mod)
    prev = t[:-1].clone()
    prev[:1] = mod
    out[1:] = _int32(_int32(36313 * t[1:]) ^ _int32(27191 * prev)) % mod
    return out

def trigram_hash(tokens, rows: int) -> torch.Tensor:
    """int64 row of record #92's trigram channel of `rows` rows per position, in int32 arithmetic: the sentinel
    R-1 at t < 2, then ((17351 x[t]) XOR (60961 x[t-1]) XOR (45259 x[t-2])) mod (R-1) (floor)."""
    mod = rows - 1
    t = torch.as_tensor(tokens).to(torch.int64)
    out = torch.full_like(t, mod)
    out[2:] = (_int32(17351 * t[2:]) ^ _int32(60961 * t[1:-1]) ^ _int32(45259 * t[:-2])) % mod
    return out

def ngram_rows_of(tokens, rows: int, channels: int) -> torch.Tensor:
    """(T, channels) int64 rows of the n-gram table (--ngram_rows, --ngram_channels): one channel, record #89's
    bigram over every row; two, record #92's: the bigram over the first half (rows // 2), the trigram over the
    rest. The hashes run across documents, as the records' over their packed streams."""
    if channels == 1:
        return bigram_hash(tokens, rows)[:, None]
    half = rows // 2
    return torch.stack([bigram_hash(tokens, half), half + trigram_hash(tokens, rows - half)], dim=1)

def bigram_sign_index(ids: torch.Tensor) -> torch.Tensor:
    """Row of the +-1 sign table per position: 0, then (tok[t-1] XOR tok[t]) mod 8192 (no sentinel)."""
    ids = ids.to(torch.int64)
    return torch.cat([torch.zeros_like(ids[:1]), torch.bitwise_xor(ids[:-1], ids[1:]) % BIGRAM_SIGN_ROWS])

def ngram_sign_index(ids: torch.Tensor, channels: int) -> torch.Tensor:
    """(T, channels) rows of the +-1 sign table: one channel, bigram_sign_index; two, record #92's own hashes,
    ((30011 x[t-1]) XOR (48271 x[t])) & 8191 (0 at t = 0) and ((26801 x[t-2]) XOR (39779 x[t-1]) XOR (58699 x[t]))
    & 8191 (0 at t < 2). The low 13 bits of the products do not depend on int32 wrap-around."""
    if channels == 1:
        return bigram_sign_index(ids)[:, None]
    x, mask = ids.to(torch.int64), BIGRAM_SIGN_ROWS - 1
    bigram = torch.cat([torch.zeros_like(x[:1]), ((30011 * x[:-1]) ^ (48271 * x[1:])) & mask])
    trigram = torch.cat([torch.zeros_like(x[:2]), ((26801 * x[:-2]) ^ (39779 * x[1:-1]) ^ (58699 * x[2:])) & mask])
    return torch.stack([bigram, trigram[:len(x)]], dim=1)

# -- attention masks ----------------------------------------------------------------------------
# Slot q sees slot k iff q >= k, q - k <= window (window + 1 keys, the record's window_size=(window, 0)) and
# their tokens q // r, k // r are in one document. r = 2 slots per token on paired rows (record #89): slot 2t
# holds the first half of token t's heads, slot 2t+1 the second; causality and the window count slots.

def document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Index of the document each position belongs to (int64, (T,)), from padded document starts."""
    pos = torch.arange(num_tokens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens, pos, right=True) - 1

def attention_mask_mod(doc_ids: torch.Tensor, window, pos_div: int = 1):
    """The one definition of who may attend to whom (above), as a flex_attention mask_mod."""
    def mask_mod(b, h, q_idx, kv_idx):
        dq, dk = (q_idx, kv_idx) if pos_div == 1 else (q_idx // pos_div, kv_idx // pos_div)
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window) & (doc_ids[dq] == doc_ids[dk])
    return mask_mod

def banded_attention_mask(doc_ids: torch.Tensor, window, pos_div: int, chunk: int, span: int) -> torch.Tensor:
    """attention_mask_mod in bands, (n/chunk, 1, chunk, chunk + span): band c holds query slots
    [c*chunk, (c+1)*chunk) and key slots [c*chunk - span, (c+1)*chunk); key slots before 0 never pass."""
    n = doc_ids.numel() * pos_div
    q = torch.arange(n, device=doc_ids.device).view(-1, chunk)
    k = q[:, :1] - span + torch.arange(chunk + span, device=doc_ids.device)
    allowed = attention_mask_mod(doc_ids, window, pos_div)(0, 0, q[:, :, None], k.clamp(min=0)[:, None, :])
    return (allowed & (k >= 0)[:, None, :])[:, None]

def _bands(t: torch.Tensor, chunk: int, span: int) -> torch.Tensor:
    """(n, F) -> (n/chunk, chunk + span, F), overlapping views: band c = rows [c*chunk - span, (c+1)*chunk)."""
    return F.pad(t, (0, 0, span, 0)).unfold(0, chunk + span, chunk).transpose(1, 2)

# A flex_attention BlockMask's eight int32 tensors, in its constructor's order: per query block the key
# blocks that are partial (the mask_mod decides) and full (every pair passes), counts (1, 1, nb) and
# indices (1, 1, nb, nb); then the same per key block (the backward's dk/dv loop).
BlockMaskIndices = NamedTuple("BlockMaskIndices", [(name, torch.Tensor) for name in (
    "kv_num", "kv_idx", "full_kv_num", "full_kv_idx", "q_num", "q_idx", "full_q_num", "full_q_idx")])

def block_mask_indices(doc_ids: torch.Tensor, window, pos_div: int = 1,
                       block_size: int = FLEX_BLOCK_SIZE) -> BlockMaskIndices:
    """attention_mask_mod's block structure in O(n/bs x window/bs), not create_block_mask's O(T^2): each
    block pair in the causal window's band is empty, full or partial by its slot ranges and document ids
    (non-decreasing). window: a Python int or CPU 0-d tensor. The loader builds it on the host."""
    n = doc_ids.numel() * pos_div
    _check_block_mask_args(n, block_size, window)
    nb, span, dev = n // block_size, int(window), doc_ids.device
    band = min(nb, (span + block_size - 1) // block_size + 2)
    first = torch.arange(nb, device=dev) * block_size
    last = first + block_size - 1
    d_first, d_last = doc_ids[first // pos_div], doc_ids[last // pos_div]
    rows, b = torch.arange(nb, device=dev)[:, None], torch.arange(band, device=dev)[None, :]
    valid, k = rows >= b, (rows - b).clamp(min=0)  # (nb, band): band entry b of query block i is key block i - b
    lo = first[:, None] - last[k]   # smallest q - k in the block pair (the largest is >= 0: k <= i)
    hi = last[:, None] - first[k]   # largest q - k
    any_pass = valid & (lo <= span) & (d_first[:, None] <= d_last[k]) & (d_first[k] <= d_last[:, None])
    one_doc = d_first == d_last
    all_pass = valid & (lo >= 0) & (hi <= span) & one_doc[:, None] & one_doc[k] & (d_first[:, None] == d_first[k])
    partial = any_pass & ~all_pass
    q = (rows + b).clamp(max=nb - 1)  # the backward's dk/dv loop: band entry b of key block c is query block c + b
    q_valid = rows + b < nb

    def listed(blocks, cols):
        # each row's blocks first, ascending (flex's kernels read a row, stride 1, only up to its count)
        out = torch.zeros(nb, nb, dtype=torch.int32, device=dev)
        out[:, :band] = cols.gather(1, torch.argsort((~blocks).to(torch.uint8), dim=1, stable=True))  # any device
        return blocks.sum(1, dtype=torch.int32)[None, None], out[None, None]

    kv = k.flip(1)  # key blocks ascending
    return BlockMaskIndices(*listed(partial.flip(1), kv), *listed(all_pass.flip(1), kv),
                            *listed(q_valid & partial[q, b], q), *listed(q_valid & all_pass[q, b], q))

def _check_block_mask_args(n: int, block_size: int, window) -> None:
    if n % block_size:
        raise ValueError(f"attention: sequence of {n} slots is not a multiple of the {block_size}-token"
                         " attention block; make the tokens per rank a multiple of 128")
    if isinstance(window, torch.Tensor) and window.device.type != "cpu":
        raise ValueError("block_mask_indices: pass the window as a Python int (reading a device tensor waits for the GPU)")

def block_attention_mask(doc_ids: torch.Tensor, window, pos_div: int = 1, block_size: int = FLEX_BLOCK_SIZE,
                         indices: BlockMaskIndices | None = None) -> BlockMask:
    """flex_attention's BlockMask: the block indices (block_mask_indices unless given) and the mask_mod,
    which reads window (on the GPU a device tensor: a new window is no new code)."""
    if indices is None:
        indices = block_mask_indices(doc_ids, window, pos_div, block_size)
    n = doc_ids.numel() * pos_div
    return BlockMask((n, n), *indices, BLOCK_SIZE=(block_size, block_size),
                     mask_mod=attention_mask_mod(doc_ids, window, pos_div))

def attention_kinds(layers: tuple) -> list[tuple[bool, int]]:
    """Every (long window?, slots per token) the layer table attends with, sorted: one mask each."""
    return sorted({(row.window == "long", 2 if row.attention == "paired" else 1)
                   for row in layers if row.has_attention})

def flex_mask_spec(args: "Hyperparameters", windows: tuple, kernels: dict | None = None) -> tuple | None:
    """(block size, ((long?, slots per token, window in slots), ...)) of the kinds that run flex (kernels;
    default all) at (short, long) windows in blocks, None if none: the loader's key for host-built masks."""
    kinds = tuple((long, r, windows[int(long)] * args.window_block_size) for long, r in attention_kinds(args.layers)
                  if kernels is None or kernels[long, r] == "flex")
    return (FLEX_BLOCK_SIZE, kinds) if kinds else None

def flex_mask(doc_ids: torch.Tensor, window: torch.Tensor, span: int, pos_div: int) -> BlockMask:
    """flex_attention's BlockMask of one layer kind, its block indices built here."""
    return block_attention_mask(doc_ids, window, pos_div, indices=block_mask_indices(doc_ids, span, pos_div))

def attention_mask(doc_ids: torch.Tensor, window: torch.Tensor, span: int, pos_div: int, kernel: str):
    """One layer kind's mask for the attention kernel that will run (ATTENTION_MASKS)."""
    _check_mask_kernel(kernel)
    return ATTENTION_MASKS[kernel](doc_ids, window, span, pos_div)

def _check_mask_kernel(kernel: str) -> None:
    if kernel in START_MASKS:
        raise ValueError(f"attention: {kernel} attention takes document starts, not ids: GPT.attention_masks builds it")
    if kernel not in ATTENTION_MASKS:
        raise ValueError(f"attention: kernel={kernel!r}; choose one of {', '.join([*START_MASKS, *ATTENTION_MASKS])}")

def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                scale: torch.Tensor) -> torch.Tensor:
    """flex_attention of (1, H, n, hd) q, k, v, the 0-d fp32 softmax scale applied to the fp32 scores
    (q is not rounded after scaling, as record #89's FA3 softmax_scale)."""
    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale

    fn = compiled_flex_attention() if _runs_compiled_flex(q) else flex_attention  # --compile false: below
    return fn(q, k, v, score_mod=scaled, block_mask=block_mask, scale=1.0)

def as_slots(t: torch.Tensor, r: int) -> torch.Tensor:
    """(T, H, hd) -> (1, H/r, r*T, hd): r slots per token, each holding H/r of its heads."""
    T, H, hd = t.shape
    return t.reshape(r * T, H // r, hd).transpose(0, 1).unsqueeze(0)

def from_slots(y: torch.Tensor, T: int) -> torch.Tensor:
    """as_slots undone: (1, H/r, r*T, hd) -> (T, H, hd)."""
    return y[0].transpose(0, 1).reshape(T, -1, y.shape[-1])

def flex_attend_tokens(q, k, v, mask: BlockMask, r: int, scale: torch.Tensor, scale_value: float) -> torch.Tensor:
    """flex_attend of (T, H, hd) q, k, v at r slots per token."""
    return from_slots(flex_attend(as_slots(q, r), as_slots(k, r), as_slots(v, r), mask, scale), q.shape[0])

# ---- On GPUs outside compiled graphs (--compile false): flex attention compiled once ------------

@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """flex_attention compiled once, for CUDA calls outside a compiled graph (eager, it materialises scores)."""
    return torch.compile(flex_attention, dynamic=False)

def _runs_compiled_flex(q: torch.Tensor) -> bool:
    """A CUDA call outside a compiled graph (inside one, flex_attention is traced into the graph)."""
    return q.is_cuda and not torch.compiler.is_compiling()

# ---- The CPU's attention: SDPA, banded where that saves work ---------------------------------

def dense_attention_mask(doc_ids: torch.Tensor, window, pos_div: int = 1) -> torch.Tensor:
    """(n, n) boolean mask from attention_mask_mod, n = T * pos_div (for SDPA on the CPU)."""
    idx = torch.arange(doc_ids.numel() * pos_div, device=doc_ids.device)
    return attention_mask_mod(doc_ids, window, pos_div)(0, 0, idx[:, None], idx[None, :])

CPU_ATTENTION_CHUNK = 256  # query slots per band of the CPU attention

def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, span: int,
                     scale: float = 1.0) -> torch.Tensor:
    """SDPA of (1, H, n, hd) q, k, v under a sliding-window mask, in O(n * (chunk + span)) instead of O(n^2).

    Exact when no query slot sees a key slot more than `span` slots back: each band of `chunk` queries
    attends to its own keys and the `span` before them, with the mask of banded_attention_mask
    (chunk = mask.shape[2])."""
    _, H, n, hd = q.shape
    chunk = mask.shape[2]

    def bands(t):  # (1, H, n, hd) -> (n/chunk, H, chunk + span, hd), overlapping views of the left-padded keys
        return F.pad(t, (0, 0, span, 0)).unfold(2, chunk + span, chunk)[0].permute(1, 0, 3, 2)

    qb = q[0].view(H, n // chunk, chunk, hd).transpose(0, 1)
    y = F.scaled_dot_product_attention(qb, bands(k), bands(v), attn_mask=mask, scale=scale)
    return y.transpose(0, 1).reshape(1, H, n, hd)

def attention_band(n: int, span: int) -> int:
    """Chunk for banded_attention of n slots with this span, or 0 where dense attention is as cheap."""
    for chunk in (CPU_ATTENTION_CHUNK, CPU_ATTENTION_CHUNK // 2, CPU_ATTENTION_CHUNK // 4):
        if n % chunk == 0 and chunk + span < n // 2:
            return chunk
    return 0

class SDPAMask(NamedTuple):
    """The CPU attention's mask of one layer kind: banded_attention_mask's bands (chunk > 0) or a dense
    (n, n) mask (chunk 0); span = the window in slots (a Python int: band shapes depend on it).
    fp32: attend in fp32 (the GPU check's independent reference)."""
    mask: torch.Tensor
    span: int
    chunk: int
    fp32: bool = False

def sdpa_mask(doc_ids: torch.Tensor, window: torch.Tensor, span: int, pos_div: int, fp32: bool = False) -> SDPAMask:
    """The SDPA kernel's mask of one layer kind: bands where attention_band finds them, else dense."""
    chunk = attention_band(doc_ids.numel() * pos_div, span)
    mask = banded_attention_mask(doc_ids, window, pos_div, chunk, span) if chunk else dense_attention_mask(doc_ids, window, pos_div)
    return SDPAMask(mask, span, chunk, fp32)

def sdpa_attend_tokens(q, k, v, mask: SDPAMask, r: int, scale: torch.Tensor, scale_value: float) -> torch.Tensor:
    """SDPA of (T, H, hd) q, k, v at r slots per token (banded where the mask is), the scale as a number:
    the same fp32 value, kept as a float by GPT.set_windows; in fp32 for the fp32 reference."""
    qs, ks, vs = (as_slots(t.float() if mask.fp32 else t, r) for t in (q, k, v))
    if mask.chunk:
        y = banded_attention(qs, ks, vs, mask.mask, mask.span, scale=scale_value)
    else:
        y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.mask, scale=scale_value)
    return from_slots(y.to(q.dtype), q.shape[0])

# ---- torch's varlen attention: the alternative GPU kernel (--attention_kernel varlen) -------------

class VarlenMask(NamedTuple):
    """varlen_attn's arguments for one layer kind: document starts in slots (padding entries equal to the
    end give empty documents), the longest document in slots, and the window in slots (causal, window + 1
    keys: the record's FA3 window_size=(window, 0))."""
    cu_seqlens: torch.Tensor
    max_seqlen: int
    window: int

def varlen_mask(cu_seqlens: torch.Tensor, max_doc_len: int, window: int, r: int) -> VarlenMask:
    """One layer kind's VarlenMask at r slots per token, from document starts in tokens."""
    return VarlenMask(cu_seqlens * r if r > 1 else cu_seqlens, max_doc_len * r, window)

def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask, scale: float) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn (flash attention on CUDA; torch >= 2.11) of (n, H, hd) q, k, v:
    the call record #89 makes to FA3's flash_attn_varlen_func (window_size=(window, 0), softmax_scale)."""
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(q, k, v, mask.cu_seqlens, mask.cu_seqlens, mask.max_seqlen, mask.max_seqlen,
                       scale=scale, window_size=(mask.window, 0))

def varlen_attend_tokens(q, k, v, mask: VarlenMask, r: int, scale: torch.Tensor, scale_value: float) -> torch.Tensor:
    """varlen_attend of (T, H, hd) q, k, v at r slots per token, the fp32 scale as a number."""
    T, H, hd = q.shape
    return varlen_attend(*(t.reshape(r * T, H // r, hd) for t in (q, k, v)), mask, scale_value).reshape(T, H, hd)

# One layer kind's mask by kernel name from (doc_ids, window as a 0-d int tensor and as an int, slots per
# token); START_MASKS from (cu_seqlens, longest document, window, slots per token); how each kernel
# attends, by the type of its mask. The record's is flex.
ATTENTION_MASKS = {"flex": flex_mask, "sdpa": sdpa_mask, "sdpa_fp32": functools.partial(sdpa_mask, fp32=True)}
START_MASKS = {"varlen": varlen_mask}
ATTEND = {BlockMask: flex_attend_tokens, SDPAMask: sdpa_attend_tokens, VarlenMask: varlen_attend_tokens}

# ---- Which kernel each layer kind attends with: SDPA on CPUs, flex or varlen on GPUs ------------

# {torch.cuda.get_device_name(): {(long window?, slots per token): "flex" | "varlen"}}, the faster at the
# speedrun's shapes as the GPU check times them; a GPU or kind not listed runs flex.
ATTENTION_KERNEL_CHOICE: dict[str, dict[tuple[bool, int], str]] = {}
GPU_ATTENTION_KERNELS = ("flex", "varlen")

def attention_kernels(args: Hyperparameters, device: torch.device) -> dict[tuple[bool, int], str]:
    """Every layer kind's attention kernel: SDPA on CPUs, else --attention_kernel ("auto": the GPU's table)."""
    kinds = attention_kinds(args.layers)
    if device.type != "cuda":
        return dict.fromkeys(kinds, "sdpa")
    if _check_attention_kernel(args.attention_kernel) in GPU_ATTENTION_KERNELS:
        return dict.fromkeys(kinds, args.attention_kernel)
    table = ATTENTION_KERNEL_CHOICE.get(torch.cuda.get_device_name(device), {})
    return {kind: table.get(kind, "flex") for kind in kinds}

def _check_attention_kernel(name: str) -> str:
    if name != "auto" and name not in GPU_ATTENTION_KERNELS:
        raise ValueError(f"--attention_kernel {name!r} is not one of auto, {', '.join(GPU_ATTENTION_KERNELS)}")
    return name

# -- rotary embeddings and YaRN -------------------------------------------------------------------

def rotary_base_frequencies(head_dim: int) -> torch.Tensor:
    """(head_dim/4,) angular frequencies (1/1024)^linspace(0, 1), one per rotated pair (half of each head)."""
    return (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float32)

def yarn_update(freq: torch.Tensor, attn_scale: float, old: int, new: int) -> tuple[torch.Tensor, float]:
    """The record's YaRN step (Yarn.apply) for a long window grown from `old` to `new` tokens: slow
    frequencies interpolated by old/new, fast ones kept; the softmax scale times 1 + 0.2 ln(new/old)."""
    ratio = old / new
    w = ((old * freq / (2 * math.pi) - 1) / 31).clamp(0, 1)
    return freq * (ratio + w * (1 - ratio)), attn_scale * (1 + 0.2 * math.log(new / old))

def yarn_state(args: Hyperparameters, long_blocks: int, side: int = 1) -> tuple[torch.Tensor, float]:
    """Rotary frequencies and softmax scale at a long window of `long_blocks` blocks: yarn_update at each
    growth of the long window along the schedule up to it, so warm-up and resume land on the same values.
    side 0: the short window's chain instead, from attn_scale_short (record #92's short rows, yarn_chains own)."""
    bs = args.window_block_size
    freq = rotary_base_frequencies(args.head_dim)
    scale = (args.attn_scale if side else args.attn_scale_short) * math.sqrt(128 / args.head_dim)
    chain = [args.windows_init[side]] + [row.windows[side] for row in args.stages]
    chain = [w for w in dict.fromkeys(chain) if w < long_blocks] + [long_blocks]
    old = chain[0]
    for new in chain[1:]:
        if new > old:
            freq, scale = yarn_update(freq, scale, old * bs, new * bs)
            old = new
    return freq, scale

def rotary_tables(freq: torch.Tensor, T: int, num_heads: int, dtype: torch.dtype) -> dict[str, tuple]:
    """cos/sin tables at packed-buffer positions (not reset per document, as in the record): "plain"
    (T, hd/4) at position t; "paired" (T, H, hd/4), head h at position 2t + (h mod 2) (record #89 rotates
    each token's head pairs at 2t and 2t+1 before slotting them)."""
    angles = torch.arange(2 * T, device=freq.device, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    parity = torch.arange(num_heads, device=freq.device) % 2
    return {"plain": (cos[:T], sin[:T]), "paired": tuple(t.view(T, 2, -1)[:, parity] for t in (cos, sin))}

def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2n dims of each head of x (T, H, width) as n interleaved pairs (2j, 2j+1), n the tables'
    frequencies (head_dim/4): half of a full head, all of a narrow_qk row's (record #92's fully rotating 64)."""
    T, H, width = x.shape
    n = cos.shape[-1]
    rot, rest = x.split([2 * n, width - 2 * n], dim=-1)
    x0, x1 = rot.view(T, H, n, 2).unbind(-1)
    c, s = (cos, sin) if cos.dim() == 3 else (cos[:, None, :], sin[:, None, :])
    rot = torch.stack([x0 * c + x1 * s, x1 * c - x0 * s], dim=-1).view(T, H, 2 * n)
    return torch.cat([rot, rest], dim=-1)

# -- attention extras: key offset, XSA, DC -------------------------------------------------------

def key_offset(k: torch.Tensor) -> torch.Tensor:
    """k (T, H, hd), its unrotated half from the previous packed position (across documents, the record's)."""
    rot, rest = k.split(k.shape[-1] // 2, dim=-1)
    return torch.cat([rot, torch.cat([rest[:1], rest[:-1]])], dim=-1)

def xsa(y: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """y - tanh(alpha) <y, v> / max(|v|^2, 1e-8) v per token and head; y, v (T, H, hd), alpha (T, H)."""
    vv = (v * v).sum(-1, keepdim=True).clamp_min(1e-8)
    return y - torch.tanh(alpha)[..., None] * ((y * v).sum(-1, keepdim=True) / vv) * v

def dc_term(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
            w1: torch.Tensor, w2: torch.Tensor, window: int, scale=1.0) -> torch.Tensor:
    """Record #89's DC term (T, H, hd) (after DCFormer, arXiv 2405.08553): over the keys s of t's document with
    0 <= t - s < window, head h gets w2[t, h] sum_s (sum_g w1[t, g] softmax_s(scale q_g(t).k_g(s))) v_h(s)."""
    T, H, hd = q.shape
    span = window - 1
    n = -(-T // DC_CHUNK) * DC_CHUNK
    if n != T:  # padding tokens sit after every real one, so causality hides them from real queries
        q, k, v, w1 = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, n - T)) for t in (q, k, v, w1))
        doc_ids = torch.cat([doc_ids, doc_ids[-1:].expand(n - T)])
    nb = n // DC_CHUNK
    mask = banded_attention_mask(doc_ids, span, 1, DC_CHUNK, span)[:, 0]           # (nb, chunk, chunk+span)
    kb = _bands(k.reshape(n, H * hd), DC_CHUNK, span).view(nb, DC_CHUNK + span, H, hd)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16 inputs
    scores = torch.einsum("bqhd,bkhd->bhqk", q.view(nb, DC_CHUNK, H, hd).to(acc), kb.to(acc)) * scale
    p = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    a = torch.einsum("bhqk,bqh->bqk", p, w1.view(nb, DC_CHUNK, H).to(acc)).to(v.dtype)
    out = torch.bmm(a, _bands(v.reshape(n, H * hd), DC_CHUNK, span)).view(n, H, hd)[:T]
    return out * w2[..., None]

# -- the model ------------------------------------------------------------------------------------

def padded_bank_size(n: int, ranks: int) -> int:
    """A bank of n matrices padded with zero matrices to a multiple of ranks (the record's ownership)."""
    return -(-n // ranks) * ranks

def bank_padding(n: int, world_size: int, args: Hyperparameters) -> int:
    """Matrices in a bank of n: a multiple of the world size (padded ownership, the record's), or n (balanced)."""
    _check_ownership(args.bank_ownership, "model config: --bank_ownership ")
    return padded_bank_size(n, world_size) if args.bank_ownership == "padded" else n

def _check_model_args(args: Hyperparameters, world_size: int) -> None:
    """One-line ValueErrors naming the flag, before any tensor is allocated."""
    def fail(msg):
        raise ValueError(f"model config: {msg}")

    if world_size < 1:
        fail(f"world_size must be >= 1, got {world_size}")
    for name in ("model_dim", "num_heads", "head_dim", "mlp_hidden", "window_block_size", "gate_channels",
                 "mudd_hidden", "dc_window"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.mudd_post_mix not in (5, len(MUDD_MIX10_SOURCES)):
        fail(f"--mudd_post_mix must be 5 (record #89's) or {len(MUDD_MIX10_SOURCES)} (record #92's), got {args.mudd_post_mix}")
    if args.mudd_post_mix != 5 and (args.model_dim % MUDD_GROUP_WIDTH
                                    or sum(r.value_embed for r in args.layers) < 2):
        fail(f"--mudd_post_mix {args.mudd_post_mix} mixes {MUDD_GROUP_WIDTH}-channel groups of two value-embedding"
             f" tables and more: --model_dim must be a multiple of {MUDD_GROUP_WIDTH} and two rows take ve")
    if args.num_heads * args.head_dim != args.model_dim:
        fail(f"--model_dim ({args.model_dim}) must equal --num_heads * --head_dim ({args.num_heads}*{args.head_dim});"
             " value embeddings and MUDD's V are added to V, and the banks hold square attention matrices")
    if args.head_dim % 4:
        fail(f"--head_dim must be a multiple of 4 (half of it rotates, in pairs), got {args.head_dim}")
    if args.padded_vocab_size < args.vocab_size:
        fail(f"--padded_vocab_size ({args.padded_vocab_size}) must be >= --vocab_size ({args.vocab_size})")
    least = 2 if args.ngram_channels == 1 else 6  # two channels: each half hashes into >= 2 rows beside its sentinel
    if args.ngram_rows < least:
        fail(f"--ngram_rows must be >= {least} with --ngram_channels {args.ngram_channels}, got {args.ngram_rows}")
    if args.gate_channels > args.model_dim:
        fail(f"--gate_channels ({args.gate_channels}) must be <= --model_dim ({args.model_dim})")
    if args.num_heads % 2:
        fail(f"--num_heads must be even (Q and K live in the qk_bank as groups of two heads; paired rows"
             f" put half of the heads in each slot), got {args.num_heads}")
    if args.gate_channels % 2:
        fail(f"--gate_channels must be even (value-embedding gates read half from x, half from ve), got {args.gate_channels}")
    if len(args.windows_init) != 2 or not all(isinstance(w, int) and w >= 1 for w in args.windows_init):
        fail(f"--windows_init must be (short, long) block counts >= 1, got {args.windows_init!r}")
    try:
        check_layers(args.layers)
    except ValueError as e:
        fail(str(e))

class GPT(nn.Module):
    """The speedrun transformer (the layout comment above), its banks padded for world_size ranks. dtype:
    that of the bf16 parameters (fp32 on CPUs without fast bf16 matmuls)."""

    def __init__(self, args: Hyperparameters, world_size: int = 1, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_model_args(args, world_size)
        self.args = args
        D, H, hd = args.model_dim, args.num_heads, args.head_dim
        V, C, M = args.padded_vocab_size, args.gate_channels, args.mudd_hidden
        self.layers = layers = args.layers
        L = len(layers)
        self.attn_layers = [i for i, r in enumerate(layers) if r.has_attention]
        self.attn_index = {layer: j for j, layer in enumerate(self.attn_layers)}
        self.ve_index = {layer: j for j, layer in enumerate(i for i, r in enumerate(layers) if r.value_embed)}
        self.post_gates_layer = next(i for i, r in enumerate(layers) if r.post_gates)
        self.gate_layout = mudd_gate_layout(layers, H)
        self.gate_outputs = tuple(sum(width for _, width in layout.values()) for layout in self.gate_layout)
        n_attn = len(self.attn_layers)
        # the MLP bank: every layer's (up, down), then the parallel MLPs' (record #92's takes #89's padding slots)
        self.mlp_slots = list(range(L)) + [i for i, r in enumerate(layers) if r.parallel_mlp]
        n_qk, n_vo, n_mlp = (bank_padding(n, world_size, args) for n in (H * n_attn, 2 * n_attn, 2 * len(self.mlp_slots)))
        n_ve = len(self.ve_index)
        fp32 = torch.float32
        self.lm_head = nn.Parameter(torch.empty(D, V, dtype=dtype))
        self.embed = nn.Parameter(torch.empty(V, D, dtype=dtype))
        self.value_embeds = nn.Parameter(torch.empty(n_ve, V, D, dtype=dtype))
        self.ve_gate_bank = nn.Parameter(torch.empty(n_ve, H, C, dtype=dtype))
        self.qk_bank = nn.Parameter(torch.empty(n_qk, 2 * hd, D, dtype=dtype))
        self.vo_bank = nn.Parameter(torch.empty(n_vo, H * hd, D, dtype=dtype))
        self.mlp_bank = nn.Parameter(torch.empty(n_mlp, args.mlp_hidden, D, dtype=dtype))
        self.smear_gate = nn.Parameter(torch.empty(1, C, dtype=dtype))
        self.bigram_embed = nn.Parameter(torch.empty(args.ngram_rows, D, dtype=dtype))
        self.post_lambdas = nn.Parameter(torch.empty(L, 2, dtype=fp32))
        self.resid_lambdas = nn.Parameter(torch.empty(L, 2, dtype=fp32))
        self.scalars = nn.Parameter(torch.empty(-(-(2 * L + 2) // 8) * 8, dtype=fp32))  # the record pads to 8
        self.mudd_w1 = nn.Parameter(torch.empty(2, M, D, dtype=dtype))
        self.mudd_w2 = nn.Parameter(torch.empty(2, max(MUDD_LAYER_OUTPUTS), M, dtype=dtype))
        self.mudd_b2 = nn.Parameter(torch.empty(2, max(MUDD_LAYER_OUTPUTS), dtype=dtype))
        if args.mudd_post_mix == len(MUDD_MIX10_SOURCES):
            self.mudd_w2g = nn.Parameter(torch.zeros(max(MUDD_LAYER_OUTPUTS), D // MUDD_GROUP_WIDTH, M, dtype=dtype))
        self._mudd_gate_scale = nn.Parameter(torch.empty((), dtype=fp32))
        self.mudd_gate_w1 = nn.Parameter(torch.empty(2, M, D, dtype=dtype))
        self.mudd_gate_w2 = nn.Parameter(torch.empty(2, max(self.gate_outputs), M, dtype=dtype))
        self.mudd_gate_b2 = nn.Parameter(torch.empty(2, max(self.gate_outputs), dtype=dtype))
        for name, p in self.named_parameters():
            p.label = name
        self.register_buffer("bigram_sign_table", torch.empty(BIGRAM_SIGN_ROWS, D, dtype=dtype))
        roles = {"qk_bank": [f"{kd}.{i}.{g}" for i in self.attn_layers for kd in ("q", "k") for g in range(H // 2)],
                 "vo_bank": [f"{kd}.{i}" for i in self.attn_layers for kd in ("v", "o")],
                 "mlp_bank": [f"{kd}.{i}" for i in range(L) for kd in ("up", "down")]
                 + [f"parallel_{kd}.{i}" for i in self.mlp_slots[L:] for kd in ("up", "down")]}
        self.bank_roles = {name: r + ["pad"] * (len(getattr(self, name)) - len(r)) for name, r in roles.items()}
        self.fp8_mlp = FP8MLPState(len(self.mlp_slots), args.mlp_hidden, D, fast_accum=args.fp8_up_fast_accum)
        # lm_head's e4m3 copy (fp8_head_weight), made by quantize_fp8 after every optimizer step; derived, so
        # not in the state dict: every load_state_dict (the warm-up reset, a resume) makes it again.
        self.register_buffer("lm_head_f8_t", torch.zeros(V, D, dtype=torch.float8_e4m3fn), persistent=False)
        self.register_load_state_dict_post_hook(GPT._quantize_fp8_head_after_load)
        # Window state: changed in place by set_windows so compiled graphs see new values, not new code.
        self.register_buffer("rotary_freq", rotary_base_frequencies(hd))
        self.register_buffer("attn_scale", torch.tensor(0.0, dtype=fp32))
        if args.yarn_chains == "own":  # record #92's: the short-window rows' own chain
            self.register_buffer("rotary_freq_short", rotary_base_frequencies(hd))
            self.register_buffer("attn_scale_short", torch.tensor(0.0, dtype=fp32))
        self.register_buffer("windows", torch.zeros(2, dtype=torch.int32))  # (short, long) in tokens / slots
        # prefix token of every token id (build_prefix_table), -1 until train() fills it in the timed region
        self.register_buffer("prefix_table", torch.full((V,), -1, dtype=torch.int64), persistent=False)
        self.reset_parameters()
        self.set_windows(*args.windows_init)

    def params_by_label(self) -> dict[str, nn.Parameter]:
        return {p.label: p for p in self.parameters()}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        L, D = self.args.num_layers, self.args.model_dim
        bound = math.sqrt(3) * INIT["projection_std"] / math.sqrt(D)  # uniform, std 0.5/sqrt(D): 1/32 at D = 768

        def fp32_draw(t, fill):  # drawn in fp32, then cast (the record's order for the banks), so a bf16
            t.copy_(fill(torch.empty(t.shape, dtype=torch.float32, device=t.device)))  # and an fp32 model match

        def uniform_(t, b=bound):
            fp32_draw(t, lambda x: x.uniform_(-b, b))

        for p in (self.qk_bank, self.vo_bank, self.mlp_bank, self.bigram_embed, self.scalars, self.smear_gate,
                  self.ve_gate_bank, self.mudd_w2, self.mudd_b2, self.mudd_gate_w2, self.mudd_gate_b2):
            p.zero_()  # all but what is drawn or set below
        uniform_(self.qk_bank[: self.args.num_heads * len(self.attn_layers)])  # H/2 Q + H/2 K groups per layer
        uniform_(self.vo_bank[: 2 * len(self.attn_layers)])  # V and the output projections alike (the record's)
        ups = self.mlp_bank[0::2]  # down stays zero; up: as many drawn as the bank padded for INIT's draw_ranks
        drawn = padded_bank_size(2 * len(self.mlp_slots), INIT["draw_ranks"]) // 2
        up = torch.empty(drawn, *ups.shape[1:], dtype=torch.float32, device=ups.device).uniform_(-bound, bound)
        kept = min(drawn, len(ups))  # this bank's own padding may hold fewer or more
        ups[:kept] = up[:kept]
        fp32_draw(self.lm_head, lambda x: x.normal_(0.0, INIT["lm_head_std"]))
        self.embed.copy_(self.lm_head.T)
        fp32_draw(self.value_embeds, lambda x: x.normal_(0.0, 1.0).mul_(INIT["value_embed_std"]))
        s = self.scalars
        s[0: 2 * L: 2] = INIT["qkv_lambda"]  # q and k are normed next, so in effect v's scale
        s[1: 2 * L: 2] = INIT["o_lambda"]
        s[2 * L + 1] = INIT["skip_lambda"]   # sigmoid 0.18; smear lambda s[2L] = 0: smear starts off
        self.resid_lambdas.fill_(INIT["resid_lambda"])
        self.post_lambdas.fill_(INIT["post_lambda"])
        for w1 in (self.mudd_w1, self.mudd_gate_w1):  # nn.Linear's default init: U(+-1/sqrt(fan_in))
            uniform_(w1, 1 / math.sqrt(D))
        for k, biases in enumerate(MUDD_LAYER_BIASES):
            for name, value in biases.items():
                self.mudd_b2[k, MUDD_LAYER_NAMES[k].index(name)] = value
        for k, layout in enumerate(self.gate_layout):
            for (kind, _), (start, width) in layout.items():
                self.mudd_gate_b2[k, start: start + width] = MUDD_GATE_BIASES.get(kind, 0.0)
        self._mudd_gate_scale.fill_(INIT["mudd_gate_scale"])
        fp32_draw(self.bigram_sign_table, lambda x: x.normal_().sign_())

    @torch.no_grad()
    def set_windows(self, short_blocks: int, long_blocks: int, yarn_blocks: int | None = None) -> None:
        """Set the sliding windows (in window_block_size blocks) and the YaRN state of the long window
        yarn_blocks (default long_blocks; the final validation widens the window without a YaRN step)."""
        _check_window_blocks(short=short_blocks, long=long_blocks, yarn=yarn_blocks)
        bs = self.args.window_block_size
        self.window_tokens = (int(short_blocks) * bs, int(long_blocks) * bs)  # as Python ints (mask shapes)
        copy_from_host_(self.windows, torch.tensor(self.window_tokens, dtype=torch.int32))
        freq, scale = yarn_state(self.args, int(long_blocks if yarn_blocks is None else yarn_blocks))
        copy_from_host_(self.rotary_freq, freq)
        self.attn_scale.fill_(scale)
        self.attn_scale_value = float(np.float32(scale))  # the buffer's fp32 value as a number (SDPA's scale)
        if self.args.yarn_chains == "own":  # the short chain follows the short window (the final validation's too)
            freq, scale = yarn_state(self.args, int(short_blocks), side=0)
            copy_from_host_(self.rotary_freq_short, freq)
            self.attn_scale_short.fill_(scale)
            self.attn_scale_short_value = float(np.float32(scale))

    def yarn_chain(self, row: Layer) -> str:
        """The YaRN chain a row's rotary and softmax scale follow: "long" (every row's, record #89's), or with
        yarn_chains own a short-window row's "short"."""
        return "short" if self.args.yarn_chains == "own" and row.window == "short" else "long"

    def softmax_scale(self, chain: str) -> tuple[torch.Tensor, float]:
        """A chain's softmax scale: the fp32 buffer (compiled graphs read it) and its value as a number."""
        if chain == "short":
            return self.attn_scale_short, self.attn_scale_short_value
        return self.attn_scale, self.attn_scale_value

    def _gate(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x[:, :gate_channels] W^T) in x's dtype, (T, out)."""
        return torch.sigmoid(F.linear(x[:, : self.args.gate_channels], weight.to(x.dtype)))

    # The ablation switches (Hyperparameters fields, all on in the record) are read where each component
    # acts: off, the component returns zeros where the forward adds it (x + 0 is x, to the bit) or the
    # identity where it transforms. Its parameters stay in the model (checkpoints keep one layout),
    # unread or multiplied by zero, and frozen by switched_off_configs.

    def _mudd_mlp(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, scale) -> torch.Tensor:
        """Per-token coefficients (T, n) = (W2 gelu(W1 x) + b2) * scale in x's dtype (exact erf GELU);
        --mudd false: the learned constants b2 * scale, the same for every token."""
        if not self.args.mudd:
            return (b2 * scale).expand(x.shape[0], b2.shape[0])
        return F.linear(F.gelu(F.linear(x, w1)), w2, b2) * scale

    def value_embeddings(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Every value-embedding table's rows of the tokens, [(T, D)] in table order (switched off: zeros)."""
        if not self.args.value_embeds:
            return [self.embed.new_zeros(ids.numel(), self.args.model_dim)] * self.value_embeds.shape[0]
        return [F.embedding(ids, t) for t in self.value_embeds.unbind(0)]

    def ngram_features(self, ids: torch.Tensor, ngram_ids: torch.Tensor) -> torch.Tensor:
        """xb (T, D): per channel the n-gram table's row (ngram_rows_of) times its +-1 sign row, the channels
        summed in fp32 and rounded once, as record #92 (--bigram_signs false: unsigned; --bigram_embed false:
        zeros). ngram_ids (T, channels), or (T,) for one."""
        if not self.args.bigram_embed:
            return self.embed.new_zeros(ids.numel(), self.args.model_dim)
        rows = F.embedding(ngram_ids.view(ids.numel(), -1), self.bigram_embed)  # (T, channels, D)
        if self.args.bigram_signs:
            rows = rows * self.bigram_sign_table[ngram_sign_index(ids, rows.size(1))]  # exact: +-1
        return rows[:, 0] if rows.size(1) == 1 else rows.float().sum(1).to(rows.dtype)

    def smear(self, e: torch.Tensor) -> torch.Tensor:
        """e[t] += smear_lambda * sigmoid(smear_gate . e[t][:12]) * e[t-1], across documents (the record's)."""
        if not self.args.smear:
            return e
        lam = self.scalars[2 * self.args.num_layers].to(e.dtype)
        return torch.cat([e[:1], e[1:] + lam * self._gate(self.smear_gate, e[1:]) * e[:-1]])

    def unet_skip(self, x: torch.Tensor, gate: torch.Tensor, skip_src: torch.Tensor) -> torch.Tensor:
        """The "skip" row: x + sigmoid(skip_lambda) * its skip gate * the save_skip layer's output."""
        if not self.args.unet_skip:
            return x
        return x + torch.sigmoid(self.scalars[2 * self.args.num_layers + 1]).to(x.dtype) * gate * skip_src

    def post_loop(self, x, cache0, h, mudd_in, ve0, skip_src) -> torch.Tensor:
        """Post-loop MUDD layer 1, whose h coefficient starts at -0.5 (the backout; --backout false: x)."""
        if not self.args.backout:
            return x
        m = self._mudd_coefficients(1, x)
        x = x + m["cache0"] * cache0 + m["h"] * h + m["mudd_input"] * mudd_in  # the record's order of sums
        return x + m["ve0"] * ve0 + m["skip_source"] * skip_src

    def post_loop_grouped(self, x: torch.Tensor, sources: dict) -> torch.Tensor:
        """Record #92's post-loop mix (--mudd_post_mix 10): x + sum_k c_k * source_k per MUDD_GROUP_WIDTH-channel
        group, c_k = MUDD layer 1's coefficient k + the group's delta (hidden . mudd_w2g[k, group]) x 0.1, over
        MUDD_MIX10_SOURCES (--backout false: x; --mudd false: the constants b2 x 0.1)."""
        if not self.args.backout:
            return x
        n, (T, D) = len(MUDD_MIX10_SOURCES), x.shape
        if self.args.mudd:
            hidden = F.gelu(F.linear(x, self.mudd_w1[1]))
            mu = F.linear(hidden, self.mudd_w2[1, :n], self.mudd_b2[1, :n]) * MUDD_LAYER_SCALE
            c = mu[:, :, None] + torch.einsum("tm,kgm->tkg", hidden, self.mudd_w2g[:n]) * MUDD_LAYER_SCALE
        else:
            c = (self.mudd_b2[1, :n] * MUDD_LAYER_SCALE)[None, :, None].expand(T, n, D // MUDD_GROUP_WIDTH)
        out = x.view(T, -1, MUDD_GROUP_WIDTH)
        for k, name in enumerate(MUDD_MIX10_SOURCES):
            out = out + c[:, k, :, None] * sources[name].view(T, -1, MUDD_GROUP_WIDTH)
        return out.reshape(T, D)

    def _mudd_gate(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """MUDD gate k's coefficients (T, n_k), scaled by the learnable gate scale cast to x's dtype."""
        n = self.gate_outputs[k]
        return self._mudd_mlp(x, self.mudd_gate_w1[k], self.mudd_gate_w2[k, :n], self.mudd_gate_b2[k, :n],
                              self._mudd_gate_scale.to(x.dtype))

    def _mudd_layer(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """MUDD layer MLP k's coefficients (T, n_k), fixed scale 0.1 (see MUDD_LAYER_BIASES)."""
        n = MUDD_LAYER_OUTPUTS[k]
        return self._mudd_mlp(x, self.mudd_w1[k], self.mudd_w2[k, :n], self.mudd_b2[k, :n], MUDD_LAYER_SCALE)

    def _mudd_coefficients(self, k: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """MUDD layer k's coefficients by name (MUDD_LAYER_NAMES), each a (T, 1) column."""
        mu = self._mudd_layer(k, x)
        return {name: mu[:, c: c + 1] for c, name in enumerate(MUDD_LAYER_NAMES[k])}

    def attention_masks(self, cu_seqlens: torch.Tensor, num_tokens: int, kernel: str | None = None,
                        max_doc_len: int | None = None, prebuilt: tuple | None = None) -> dict:
        """{(long window?, slots per token): mask} of one packed sequence at the current windows; prebuilt:
        (doc_ids, {kind: BlockMaskIndices}) from the loader. Outside the compiled model: inductor lowers flex's
        mask tensors only as graph inputs ("convert FlexibleLayout to FixedLayout first", PyTorch issue 139836)."""
        kinds = attention_kinds(self.layers)
        kernels = attention_kernels(self.args, cu_seqlens.device) if kernel is None else dict.fromkeys(kinds, kernel)
        _check_flex_outside_compile(kernels)
        doc_ids, indices = prebuilt or (None, {})
        masks = {}
        for (long, r), k in kernels.items():
            window, span = self.windows[int(long)], self.window_tokens[int(long)]
            if (long, r) in indices:
                masks[long, r] = block_attention_mask(doc_ids, window, r, indices=indices[long, r])
            elif k in START_MASKS:
                masks[long, r] = START_MASKS[k](cu_seqlens, max_doc_len or num_tokens, span, r)
            else:
                if doc_ids is None:
                    doc_ids = document_ids(cu_seqlens, num_tokens)
                masks[long, r] = attention_mask(doc_ids, window, span, r, k)
        return masks

    def batch_masks(self, batch: "Batch") -> dict:
        """attention_masks for one micro-batch, with the block masks the loader built on the host."""
        _check_batch_masks(self, batch)
        prebuilt = None if batch.block_masks is None else (batch.doc_ids, batch.block_masks)
        return self.attention_masks(batch.cu_seqlens, batch.inputs.numel(), max_doc_len=batch.max_doc_len,
                                    prebuilt=prebuilt)

    def _attend(self, q, k, v, mask, paired: bool, chain: str = "long") -> torch.Tensor:
        """Masked softmax attention of (T, H, width) q, k, v by the kernel of the mask's type (ATTEND); paired:
        head j attends over the stream of heads j and j + H/2 (record #89's paired heads), at the softmax scale
        of the YaRN chain. q and k narrower than v (a narrow_qk row's) are zero-padded to v's width: the same
        scores, one head width for every kernel."""
        if q.shape[-1] < v.shape[-1]:
            q, k = (F.pad(t, (0, v.shape[-1] - t.shape[-1])) for t in (q, k))
        return ATTEND[type(mask)](q, k, v, mask, 2 if paired else 1, *self.softmax_scale(chain))

    def _attention(self, i, xn, ve, ve_gate, aux_v, doc, rope, masks, coef, w) -> torch.Tensor:
        """Layer i's attention sublayer on the normed input xn (T, D); ve (T, D) or None is this row's
        value embedding with per-head gates ve_gate (T, H) (None: from ve_gate_bank); aux_v is MUDD's V."""
        a, row = self.args, self.layers[i]
        T, H, hd = xn.shape[0], a.num_heads, a.head_dim
        j = self.attn_index[i]

        def scaled(lam, weight):  # the fp32 lambda times the bf16 weight, rounded once (the record's)
            return (lam * weight.float()).to(weight.dtype)

        w_qkv, w_o = torch.cat([*w["qk"][H * j: H * j + H], w["vo"][2 * j]]), w["vo"][2 * j + 1]  # [Q; K; V], O
        qk_width, v_width = hd // 2 if row.narrow_qk else hd, hd // 2 if row.narrow_v else hd
        if row.narrow_qk:  # record #92's narrow rows: the first rows of each head's block (the rest get no gradient)
            blocks = w_qkv.view(3, H, hd, -1)
            w_qkv = torch.cat([blocks[:2, :, :qk_width].reshape(2 * H * qk_width, -1),
                               blocks[2, :, :v_width].reshape(H * v_width, -1)])
            w_o = w_o.view(-1, H, hd)[:, :, :v_width].reshape(-1, H * v_width)
        qkv = F.linear(xn, scaled(self.scalars[2 * i], w_qkv))
        q, k, v = (t.view(T, H, -1) for t in qkv.split([H * qk_width, H * qk_width, H * v_width], dim=-1))
        paired = row.attention == "paired"
        chain = self.yarn_chain(row)
        cos, sin = rope[chain]["paired" if paired else "plain"]
        q = apply_rotary(norm(q), cos, sin)  # the softmax scale is applied to the fp32 scores (_attend)
        k = apply_rotary(norm(k), cos, sin)
        if row.key_offset:
            k = key_offset(k)
        if ve is not None:
            if ve_gate is None:  # 2 sigmoid(W [x[:C/2], ve[:C/2]]): one gate per head, 1 at init
                half = a.gate_channels // 2
                gate_in = torch.cat([xn[:, :half], ve[:, :half]], dim=-1)
                ve_gate = 2 * self._gate(self.ve_gate_bank[self.ve_index[i]], gate_in)
            ve_v = ve_gate[..., None] * ve.view(T, H, hd)
            aux_v = ve_v if aux_v is None else ve_v + aux_v  # v + (g ve + MUDD's V): the record's order of sums
        if aux_v is not None:
            v = v + (aux_v[..., :v_width] if row.narrow_v else aux_v)  # a narrow V takes its heads' first half
        y = self._attend(q, k, v, masks[row.window == "long", 2 if paired else 1], paired, chain)
        if row.dc:
            w1 = F.rms_norm(coef("dc_w1", i).float(), (H,), eps=1e-6).to(xn.dtype)
            y = y + dc_term(q, k, v, doc, w1, coef("dc_w2", i), a.dc_window, self.softmax_scale(chain)[0])
        if row.xsa:
            y = xsa(y, v, coef("xsa", i))
        if row.gate:  # linear, no sigmoid: 0.25 at init
            y = y * coef("gate", i)[..., None]
        return F.linear(y.reshape(T, H * v_width), scaled(self.scalars[2 * i + 1], w_o))

    @torch.no_grad()
    def quantize_fp8(self, bootstrap: bool) -> None:
        """Refresh the FP8 forward's e4m3 weight copies: before step 0 and after every step (bootstrap = step <
        FP8_BOOTSTRAP_STEPS)."""
        self._quantize_fp8_head_after_load(self)
        self.fp8_mlp.quantize(self.mlp_bank, bootstrap=bootstrap)

    @staticmethod
    def _quantize_fp8_head_after_load(model: "GPT", incompatible_keys=None) -> None:
        """The LM head's e4m3 copy from lm_head (also load_state_dict's post-hook: the copy is derived)."""
        with torch.no_grad():
            model.lm_head_f8_t.copy_(fp8_head_weight(model.lm_head))

    def forward(self, input_ids, target_ids, cu_seqlens, ngram_ids, mtp_weights=None, loss_scale: float = 1.0,
                prefix_weight=None, masks: dict | None = None, candidates=None):
        """Training (mtp_weights (K,) given): (objective, next_token), 0-D fp32 sums over tokens: loss_scale x
        record #89's loss (softcapped multi-token CE, plus the prefix term with prefix_weight) and the plain
        next-token CE of the same logits (no gradient); FP8 head and MLPs on capable GPUs. Evaluation
        (mtp_weights None): mean next-token CE. target_ids None: the final normed hidden states (T, D).
        masks: attention_masks(cu_seqlens, T), built here when not given, required when compiled on CUDA.
        candidates (P,): the training softmax over these classes only (sampled softmax, candidate_columns)."""
        a = self.args
        H, hd = a.num_heads, a.head_dim
        ids = input_ids.view(-1)
        T = ids.numel()
        doc = document_ids(cu_seqlens, T)
        fp8 = mtp_weights is not None and a.fp8 and _native_fp8(ids.device)  # training on GPUs with FP8

        e = F.embedding(ids, self.embed)
        dt = e.dtype
        # One unbind per stacked parameter: its backward stacks all matrix gradients into one buffer,
        # where indexing bank[i] would allocate and add a whole-bank zero gradient per use.
        w = {"qk": self.qk_bank.unbind(0), "vo": self.vo_bank.unbind(0)}
        mlp = self.mlp_bank.unbind(0)
        ve = self.value_embeddings(ids)
        xb = self.ngram_features(ids, ngram_ids)
        x0 = norm(self.smear(e))
        gates = [self._mudd_gate(0, x0), None]

        def coef(kind, i):  # layer i's per-token coefficients from MUDD gate 0 or 1
            k = int(i >= self.post_gates_layer)
            start, width = self.gate_layout[k][kind, i]
            return gates[k][:, start: start + width]

        x = cache0 = x0 + coef("bigram", 0) * xb if self.layers[0].ngram else x0
        resid, post = self.resid_lambdas.to(dt), self.post_lambdas.to(dt)
        rope = {"long": rotary_tables(self.rotary_freq, T, H, dt)}
        if a.yarn_chains == "own":
            rope["short"] = rotary_tables(self.rotary_freq_short, T, H, dt)
        if masks is None:
            masks = self.attention_masks(cu_seqlens, T)
        skip_src = h = mudd_in = None
        mlp_layer, post_maxima = MLPS["fp8" if fp8 else "bf16"], [None] * len(self.mlp_slots)
        for i, row in enumerate(self.layers):
            if i == self.post_gates_layer:
                gates[1] = self._mudd_gate(1, x)  # from the raw residual entering this layer
            ve_i = ve[self.ve_index[i]] if i in self.ve_index else None
            if row.attention == "none":
                x = self.unet_skip(x, coef("skip", i), skip_src)
            elif row.mudd:
                mudd_in = x
                m = self._mudd_coefficients(0, x)
                aux_v = (m["v_cache0"] * cache0 + m["v_h"] * h + m["v_x"] * x).view(T, H, hd)
                x = (1 + m["x_gain"]) * x + m["x_cache0"] * cache0 + m["x_h"] * h
                ve_gate = torch.cat([m["ve_gate_first_half"].expand(T, H // 2),
                                     m["ve_gate_second_half"].expand(T, H // 2)], dim=1)
                y = self._attention(i, norm(h if row.input == "h" else x), ve_i, ve_gate, aux_v,
                                    doc, rope, masks, coef, w)
                x = m["resid_attn"] * x + m["post_attn"] * y + m["x0"] * cache0 + m["bigram"] * xb
            elif row.has_attention:
                y = self._attention(i, norm(h if row.input == "h" else x), ve_i, None, None, doc, rope, masks, coef, w)
                x = resid[i, 0] * x + post[i, 0] * y
            else:  # a no_attn row (record #92's): the residual's bookkeeping
                x = resid[i, 0] * x
            if row.attention != "none" and not row.mudd:  # the row's injections
                if row.x0:
                    x = x + coef("x0", i) * x0
                if i > 0 and row.ngram:
                    x = x + coef("bigram", i) * xb
            if not row.mlp:  # record #92's removed layer: its residual bookkeeping only
                x = resid[i, 1] * x
            else:
                xn, post_mlp = norm(x), m["post_mlp"] if row.mudd else post[i, 1]
                out, post_maxima[i] = mlp_layer(self.fp8_mlp, i, xn, mlp[2 * i], mlp[2 * i + 1])
                x = m["resid_mlp"] * x + post_mlp * out if row.mudd else resid[i, 1] * x + post_mlp * out
                if row.parallel_mlp:  # record #92's layer 8: a second MLP from its own bank slots
                    k = self.mlp_slots.index(i, len(self.layers))
                    out, post_maxima[k] = mlp_layer(self.fp8_mlp, k, xn, mlp[2 * k], mlp[2 * k + 1])
                    x = x + post_mlp * out
            if row.save_skip:
                skip_src = x
            if row.save_h:
                h = x
        if fp8:  # every layer has read its act scale: now the next forward's, in one write
            self.fp8_mlp.update_act_scales(post_maxima)
        if a.mudd_post_mix == len(MUDD_MIX10_SOURCES):  # record #92's
            x = self.post_loop_grouped(x, {"cache0": cache0, "h": h, "mudd_input": mudd_in, "ve.0": ve[0],
                                           "skip_source": skip_src, "ve.1": ve[1], "ve.-1": ve[-1], "ve.-2": ve[-2],
                                           "mlp_input": xn, "h_normed": norm(h)})
        else:
            x = self.post_loop(x, cache0, h, mudd_in, ve[0], skip_src)
        x = norm(x)
        if target_ids is None:
            return x
        if mtp_weights is None:
            return self.evaluation_loss(x, target_ids)
        targets, head = target_ids.view(-1), self.lm_head
        prefix_ids = None if prefix_weight is None else self.prefix_table[targets.long()]
        if candidates is not None:
            if fp8:
                raise ValueError("sampled softmax: the FP8 head trains on every column; add --fp8 false")
            head, targets, prefix_ids = candidate_columns(head, candidates, targets, prefix_ids)
        # the loss kernel's stored gradient assumes exactly this upstream gradient, loss_scale per token
        # (triton_kernels, "Softcapped cross-entropy")
        loss, next_token = HEAD_LOSSES["fp8" if fp8 else x.device.type](
            self, x, head, targets, mtp_weights, prefix_ids, prefix_weight, loss_scale)
        return loss.sum() * loss_scale, next_token.sum()

    def evaluation_loss(self, x: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token fp32 CE of the bf16 head on x (T, D), in chunks: full fp32 logits of a long
        sequence would take gigabytes."""
        targets = target_ids.view(-1).long()
        total = x.new_zeros((), dtype=torch.float32)
        for c in range(0, x.shape[0], EVAL_CHUNK_TOKENS):
            logits, t = x[c: c + EVAL_CHUNK_TOKENS] @ self.lm_head, targets[c: c + EVAL_CHUNK_TOKENS]
            total = total + EVALUATION_CE[logits.device.type](logits, t)
        return total / x.shape[0]

def _check_window_blocks(**blocks) -> None:
    for name, v in blocks.items():
        if v is not None and (not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"set_windows: {name} window must be a block count >= 1, got {v!r}")

def _check_flex_outside_compile(kernels: dict) -> None:
    if "flex" in kernels.values() and torch.compiler.is_compiling():
        raise RuntimeError("attention_masks: build the flex masks outside the compiled model and pass"
                           " forward(masks=model.attention_masks(cu_seqlens, T))")

def _check_batch_masks(model: GPT, batch: Batch) -> None:
    """A batch's host-built flex masks are the model's: its block size and current windows."""
    if batch.block_masks is None:
        return
    block_size, kinds = batch.mask_spec
    if block_size != FLEX_BLOCK_SIZE or any(window != model.window_tokens[int(long)] for long, _, window in kinds):
        raise ValueError(f"batch_masks: the batch's masks were built for (long?, slots per token, window) {kinds},"
                         f" the model attends at windows {model.window_tokens}; build batches with"
                         " flex_mask_spec(args, the step's windows) after set_windows")

def fp8_head(model: GPT, x, w, targets, mtp_weights, prefix_ids, prefix_weight, loss_scale):
    """The FP8 head's training loss (GPUs with FP8 tensor cores, record #89's): x quantised here, in the
    graph; lm_head's copy as quantize_fp8 made it after the last step (w: lm_head, every column).
    (loss, next-token loss) per token."""
    loss, next_token, _ = fp8_head_loss(
        x, w, fp8_head_input(x), model.lm_head_f8_t.T, targets, mtp_weights, prefix_ids, prefix_weight,
        FP8_HEAD_X_SCALE, FP8_HEAD_W_SCALE, FP8_HEAD_GRAD_SCALE * float(loss_scale), float(loss_scale))
    return loss, next_token

def bf16_evaluation_ce(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Evaluation's summed next-token CE of a chunk of bf16 logits, softcapped in fp32."""
    return F.cross_entropy(triton_kernels.softcap(logits), t, reduction="sum")

def bf16_mlp(state: FP8MLPState, layer: int, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
    """The bf16 MLP in FP8MLPState.mlp's form (its FP8 state unused): (y, None)."""
    return triton_kernels.relu2_mlp(x, w_up, w_down), None

def bf16_head(model: GPT, x, w, targets, mtp_weights, prefix_ids, prefix_weight, loss_scale):
    """The bf16 head's training loss: the logits x @ w (w: lm_head or its candidates' columns), then the loss
    kernel. (loss, next-token loss) per token."""
    return triton_kernels.softcapped_ce_mtp(x @ w, targets, mtp_weights, prefix_ids, prefix_weight,
                                            grad_scale=loss_scale, next_token=True)

# ---- The CPU's head and evaluation loss ------------------------------------------------------

def cpu_head(model: GPT, x, w, targets, mtp_weights, prefix_ids, prefix_weight, loss_scale):
    """The head's matmuls inside the loss's row blocks: no (T, V) tensor in memory. (loss, next-token loss)."""
    return triton_kernels.softcapped_ce_mtp_head_rows(x, w, targets, mtp_weights, prefix_ids, prefix_weight,
                                                      grad_scale=loss_scale, next_token=True)

def cpu_evaluation_ce(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The same bits as the GPU's, in cache-sized blocks (the plain form inside a compiled graph)."""
    if torch.compiler.is_compiling():
        return bf16_evaluation_ce(logits, t)
    return F.nll_loss(triton_kernels.softcap_log_probs(logits), t, reduction="sum")

# ---- Sampled softmax (record #92): the training loss over a candidate set of classes -------------------

def candidate_columns(head: torch.Tensor, candidates: torch.Tensor, targets: torch.Tensor, prefix_ids):
    """The head's columns of the sorted candidates (P,) (its gradient is zero in every other column), and
    the targets and prefix ids as indices among them: every target is a candidate (candidate_classes); a
    prefix that is not gets -1, which drops its term and its weight."""
    column = torch.full((head.shape[1],), -1, dtype=torch.int64, device=targets.device)
    column[candidates] = torch.arange(candidates.numel(), device=targets.device)
    if prefix_ids is not None:
        prefix_ids = torch.where(prefix_ids >= 0, column[prefix_ids.clamp_min(0)], -1)
    return head.index_select(1, candidates), column[targets.long()], prefix_ids

# The MLP of every layer by kind: "fp8" (training on a GPU with FP8 tensor cores, record #89), else "bf16".
MLPS = dict(fp8=FP8MLPState.mlp, bf16=bf16_mlp)
# The head's training loss by where it runs: "fp8" (args.fp8 on a GPU with FP8 tensor cores), else the
# device type (the bf16 head on GPUs without FP8; the CPU's fuses the head into the loss's row blocks);
# evaluation's summed CE of a chunk of logits by device type (the CPU's in cache-sized blocks).
HEAD_LOSSES = dict(fp8=fp8_head, cuda=bf16_head, cpu=cpu_head)
EVALUATION_CE = dict(cuda=bf16_evaluation_ce, cpu=cpu_evaluation_ce)

# ---- CPU compute dtype; the run log's hardware line -------------------------------------------

CPU_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

def cpu_model(cpu_name_file: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (for logs), or the platform's processor string."""
    import platform
    try:
        with open(cpu_name_file) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

def hardware_line(dist_info: DistInfo) -> str:
    """The run log's line on the machine: GPU model, memory and CUDA, or the CPU model, cores and threads."""
    if dist_info.device.type == "cuda":
        props = torch.cuda.get_device_properties(dist_info.device)
        return (f"hardware: {dist_info.world_size} x {props.name} ({props.total_memory / 2**30:.0f} GiB), "
                f"CUDA {torch.version.cuda}")
    return (f"hardware: {dist_info.world_size} CPU process(es) on {cpu_model()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} threads per process")

def matmul_gflops(dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 0.15) -> float:
    """GFLOP/s of an (m, k) x (k, n) matmul in `dtype` on this CPU, timed for about `seconds`."""
    import time
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b  # warm-up: thread pool, oneDNN primitive creation
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds or reps >= 1000:
            return 2 * m * k * n * reps / elapsed / 1e9

def cpu_dtype_rates(model_dim: int, mlp_hidden: int) -> tuple[dict[str, float], str]:
    """GFLOP/s of the MLP matmul of 256 tokens in each CPU dtype (by name), and the shape and rates as text."""
    shape = (256, model_dim, mlp_hidden)
    rates = {name: matmul_gflops(dtype, *shape) for name, dtype in CPU_DTYPES.items()}
    return rates, (f"{'x'.join(map(str, shape))} matmul GFLOP/s per process: "
                   + ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items()))

def fastest_cpu_dtype(model_dim: int, mlp_hidden: int) -> tuple[str, str]:
    """The CPU dtype (by name) that runs the MLP matmul faster here, and the timing as a log clause."""
    rates, figures = cpu_dtype_rates(model_dim, mlp_hidden)
    best = max(rates, key=rates.get)
    return best, f"{best} (auto: {figures}; capability {torch.backends.cpu.get_cpu_capability()}) on {cpu_model()}"

def choose_cpu_dtype(args: Hyperparameters) -> tuple[torch.dtype, str]:
    """The dtype of the model's bf16 parameters on a CPU, and a line saying why.

    --cpu_dtype bf16 / fp32 forces it; auto times the model's MLP matmul shape in both and takes the
    faster. CPU flags alone mislead: bf16 runs ~90x slower than fp32 on AVX2-only CPUs, a little slower
    on AVX512-BF16 CPUs without AMX, and faster with AMX."""
    if args.cpu_dtype != "auto":
        return CPU_DTYPES[args.cpu_dtype], f"cpu dtype {args.cpu_dtype} (--cpu_dtype) on {cpu_model()}"
    name, why = fastest_cpu_dtype(args.model_dim, args.mlp_hidden)
    return CPU_DTYPES[name], f"cpu dtype {why}"

def checkpoint_cpu_dtype(args: Hyperparameters) -> tuple[torch.dtype, str] | None:
    """With --resume and --cpu_dtype auto, the dtype the checkpoint's model was trained in (its weight
    banks: bf16 or fp32), so that a resumed run continues in it whatever a start-up timing would say;
    None otherwise, or when the checkpoint cannot be read (load_checkpoint then says why)."""
    if not args.resume or args.cpu_dtype != "auto":
        return None
    try:
        state = torch.load(os.path.join(args.resume, "model.pt"), map_location="cpu", weights_only=False)["model"]
        name = "bf16" if state["qk_bank"].dtype == torch.bfloat16 else "fp32"
    except Exception:  # noqa: BLE001 -- load_checkpoint reports a missing or damaged checkpoint in one line
        return None
    return CPU_DTYPES[name], f"cpu dtype {name} (the checkpoint's: --resume {args.resume}) on {cpu_model()}"

def compute_dtype(args: Hyperparameters, dist_info: DistInfo) -> tuple[torch.dtype, str | None]:
    """The model's compute dtype: bf16 on GPUs; on CPUs rank 0's choose_cpu_dtype, taken by every rank
    (timings differ between processes), with its log line."""
    if dist_info.device.type != "cpu":
        return torch.bfloat16, None
    choice = [None]
    if dist_info.is_master:
        dtype, note = checkpoint_cpu_dtype(args) or choose_cpu_dtype(args)
        choice = [(str(dtype).removeprefix("torch."), note)]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return getattr(torch, choice[0][0]), choice[0][1]

# ---- The model's hidden states and bf16 logits (sampling, tests) --------------------------------

def final_hidden(model: GPT, input_ids, cu_seqlens, ngram_ids, masks: dict | None = None) -> torch.Tensor:
    """Final normalised hidden states (T, D) (bf16 MLPs), the input of the LM head."""
    return model(input_ids, None, cu_seqlens, ngram_ids, masks=masks)

def bf16_logits(model: GPT, input_ids, cu_seqlens, ngram_ids, masks: dict | None = None) -> torch.Tensor:
    """Softcapped fp32 logits (T, Vp) of the plain bf16 head."""
    return triton_kernels.softcap(final_hidden(model, input_ids, cu_seqlens, ngram_ids, masks) @ model.lm_head)

# ---- Parameter shapes without memory (tests, the fidelity table) -------------------------------

def count_parameters(args: Hyperparameters, world_size: int = 1) -> dict[str, tuple[int, ...]]:
    """Shape of every labelled parameter, from a model built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = GPT(args, world_size)
    return {label: tuple(p.shape) for label, p in model.params_by_label().items()}

# ----------------------------------------------------------------------------------------------
# Shard files: 256 x int32 header + uint16 GPT-2 token ids
# ----------------------------------------------------------------------------------------------

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
BOS_ID = 50256  # <|endoftext|> starts every document

class ShardError(ValueError):
    """A shard file that is not what the format promises; the message names the file."""

def read_shard_header(path: str) -> int:
    """Validate a shard's header against its size; return its token count."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror})") from None
    if size < SHARD_HEADER_BYTES:
        what = "empty file" if size == 0 else f"{size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header"
        raise ShardError(f"{path}: not a token shard ({what}); re-create or re-download it")
    magic, version, num_tokens = np.fromfile(path, dtype="<i4", count=3).tolist()
    if magic != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic {magic} (expected {SHARD_MAGIC}); not a token shard")
    if version != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported shard version {version} (expected {SHARD_VERSION})")
    if num_tokens <= 0 or size != SHARD_HEADER_BYTES + 2 * num_tokens:
        need = SHARD_HEADER_BYTES + 2 * max(num_tokens, 0)
        raise ShardError(f"{path}: header says {num_tokens} tokens ({need} bytes) but the file has {size} bytes;"
                         " truncated or corrupt, re-create or re-download it")
    return num_tokens

def read_shard(path: str) -> torch.Tensor:
    """A whole shard as a uint16 tensor (read_shard_header validates it first)."""
    data = np.fromfile(path, dtype="<u2", count=read_shard_header(path), offset=SHARD_HEADER_BYTES)
    return torch.from_numpy(data.astype(np.uint16, copy=False))

def find_shards(pattern: str, what: str) -> list[str]:
    """Sorted shard paths for a glob, or a one-line error that says how to make them."""
    files = sorted(glob.glob(pattern))
    if not files and not os.path.isabs(pattern):  # presets name paths inside this checkout
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), pattern)))
    _check_shards_found(files, pattern, what)
    return files

def build_prefix_table(encoding, padded_vocab_size: int) -> torch.Tensor:
    """table[T] (int64, (padded_vocab_size,)) = id of the longest proper byte-prefix of token T that is a token
    below padded_vocab_size, else -1 (record #89's prefix-token loss; the record builds it in the timed region)."""
    _check_prefix_table_size(padded_vocab_size)
    ranks = encoding._mergeable_ranks  # token bytes -> id for the ordinary tokens (BOS is a special token)
    lookup, table = ranks.get, [-1] * padded_vocab_size
    for piece, token in ranks.items():
        if token >= padded_vocab_size:
            continue
        for end in range(len(piece) - 1, 0, -1):  # longest first; a single byte has no proper prefix
            prefix = lookup(piece[:end])
            if prefix is not None and prefix < padded_vocab_size:
                table[token] = prefix
                break
    return torch.tensor(table, dtype=torch.int64)

def _check_shards_found(files: list, pattern: str, what: str) -> None:
    if not files:
        hint = "cached_fineweb10B.py 9" if "fineweb" in pattern else "tokenize_text.py --help"
        raise SystemExit(f"error: no {what} shards match {pattern!r}; create them with `python data/{hint}`"
                         f" or point --{what}_files at existing shards")

def _check_prefix_table_size(padded_vocab_size) -> None:
    if isinstance(padded_vocab_size, bool) or not isinstance(padded_vocab_size, int) or padded_vocab_size < 1:
        raise ValueError(f"build_prefix_table: padded_vocab_size must be a positive int, got {padded_vocab_size!r}")

# ---- The offline GPT-2 tokenizer; writing a shard ------------------------------------------------

# GPT-2 BPE, built offline from the rank file shipped in data/ (same ranks as tiktoken's "gpt2").
GPT2_TIKTOKEN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken")
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

def gpt2_encoding(rank_file: str | None = GPT2_TIKTOKEN_FILE):
    """The GPT-2 tokenizer. With a rank file (default: the shipped copy, sha256-checked) no network is
    touched; rank_file=None asks tiktoken for its own "gpt2" encoding (which may download)."""
    import tiktoken
    if rank_file is None:
        return tiktoken.get_encoding("gpt2")
    import hashlib
    try:
        with open(rank_file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise SystemExit(f"error: cannot read GPT-2 rank file {rank_file} ({e.strerror})") from None
    if digest != GPT2_TIKTOKEN_SHA256:
        raise SystemExit(f"error: {rank_file} has sha256 {digest}, not the GPT-2 ranks ({GPT2_TIKTOKEN_SHA256})")
    from tiktoken.load import load_tiktoken_bpe
    return tiktoken.Encoding("gpt2", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=load_tiktoken_bpe(rank_file),
                             special_tokens={"<|endoftext|>": BOS_ID}, explicit_n_vocab=50257)

def write_shard(path: str, tokens) -> None:
    """Write tokens (any int sequence < 2**16) atomically: a temporary file renamed into place."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16 (got range {tokens.min()}..{tokens.max()})")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)

# ----------------------------------------------------------------------------------------------
# Data loader: BOS-aligned packed batches, document boundaries, n-gram rows
# ----------------------------------------------------------------------------------------------

@dataclass
class Batch:
    inputs: torch.Tensor      # (T,) int32 token ids
    targets: torch.Tensor     # (T,) int64, targets[t] = token after inputs[t]
    cu_seqlens: torch.Tensor  # (max_docs + 1,) int32 document starts then T, padded with T (static shape)
    ngram_ids: torch.Tensor   # (T, channels) int64 rows of the n-gram table (ngram_rows_of)
    # flex block masks built on the host (make_batch with a flex_mask_spec; None: the model builds them): the
    # spec, the int32 document id per position (the mask_mod reads it), {(long?, slots): BlockMaskIndices}
    mask_spec: tuple | None = None
    doc_ids: torch.Tensor | None = None
    block_masks: dict | None = None
    max_doc_len: int | None = None  # documents are at most this long (the stage's; varlen's launch grid)
    staged: torch.Tensor | None = None  # every tensor above packed into one pinned buffer (stage_batch)
    candidates: torch.Tensor | None = None  # (P,) int64 sorted classes of the sampled softmax (candidate_classes)

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device`: one non-blocking copy of its tensors staged in one pinned buffer (stage_batch;
        the record copies each tensor); a CPU batch, or one already on the device's kind: itself."""
        if device.type == "cpu" or self.inputs.device.type == device.type:
            return self
        staged = self.staged if self.staged is not None else stage_batch(self).staged
        return unstage(self, staged.to(device, non_blocking=True))  # pinned: asynchronous with the queued work

# ---- Staging: a batch's tensors in one pinned buffer, one host-to-device copy (Batch.to) ------------

STAGE_ALIGN = 128  # bytes between a staged batch's tensors: inductor, cuBLAS, Triton assume 16-byte alignment

def _staged_bytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // STAGE_ALIGN) * STAGE_ALIGN

def batch_tensors(b: Batch) -> list[torch.Tensor]:
    """Every tensor of the batch in a fixed order (the staging buffer's layout)."""
    masks = [t for key in sorted(b.block_masks) for t in b.block_masks[key]] if b.block_masks else []
    extra = [t for t in (b.doc_ids, b.candidates) if t is not None]
    return [b.inputs, b.targets, b.cu_seqlens, b.ngram_ids, *extra, *masks]

def batch_with_tensors(b: Batch, tensors) -> Batch:
    """b with its tensors replaced, in batch_tensors' order."""
    it = iter(tensors)
    inputs, targets, cu_seqlens, ngram_ids = (next(it) for _ in range(4))
    doc_ids, candidates = (next(it) if t is not None else None for t in (b.doc_ids, b.candidates))
    block_masks = {key: BlockMaskIndices(*(next(it) for _ in BlockMaskIndices._fields))
                   for key in sorted(b.block_masks)} if b.block_masks else None
    return Batch(inputs, targets, cu_seqlens, ngram_ids, b.mask_spec, doc_ids, block_masks, b.max_doc_len,
                 candidates=candidates)

def staged_bytes(b: Batch) -> int:
    """Bytes of b's staged buffer (a multiple of STAGE_ALIGN)."""
    return sum(map(_staged_bytes, batch_tensors(b)))

def stage_batch(b: Batch, into: torch.Tensor | None = None) -> Batch:
    """b with its tensors packed into one pinned host buffer, so that to(device) is one copy (the loader's
    thread does it). into: a uint8 buffer of staged_bytes(b) to pack into instead."""
    staged = into if into is not None else torch.empty(staged_bytes(b), dtype=torch.uint8,
                                                       pin_memory=torch.cuda.is_available())
    for view, t in zip(batch_tensors(unstage(b, staged)), batch_tensors(b)):
        view.copy_(t)
    return dataclasses.replace(b, staged=staged)

def unstage(b: Batch, staged: torch.Tensor) -> Batch:
    """b's tensors as views of `staged` (stage_batch's layout): a view per dtype, an as_strided each."""
    views, typed, start = [], {}, 0
    for t in batch_tensors(b):
        if t.dtype not in typed:  # the buffer's length is a multiple of STAGE_ALIGN: any dtype divides it
            typed[t.dtype] = staged.view(t.dtype)
        strides = [math.prod(t.shape[d + 1:]) for d in range(t.dim())]  # contiguous
        base = typed[t.dtype]  # as_strided counts from the storage's start: a slice's own offset first
        views.append(base.as_strided(t.shape, strides, base.storage_offset() + start // t.element_size()))
        start += _staged_bytes(t)
    return batch_with_tensors(b, views)

def step_slices(batches: list[Batch], **buffer_kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 buffer (torch.empty's buffer_kw) for every batch's staged bytes back to back, and each
    batch's slice of it: the layout stage_step packs on the host and StepGraphs copies into on the device."""
    sizes = [staged_bytes(b) for b in batches]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, **buffer_kw)
    starts = np.cumsum([0, *sizes]).tolist()
    return buf, [buf[a:a + n] for a, n in zip(starts, sizes)]

def stage_step(batches: list[Batch]) -> list[Batch]:
    """A step's micro-batches staged into consecutive slices of one pinned buffer (StepGraphs copies it whole)."""
    _, parts = step_slices(batches, pin_memory=torch.cuda.is_available())
    return [stage_batch(b, part) for b, part in zip(batches, parts)]

def max_docs_for(num_tokens: int) -> int:
    """Document-boundary capacity of T tokens (a static shape); rare extra documents merge into the last."""
    return num_tokens // 8 + 16

def candidate_classes(targets: np.ndarray, P: int, V: int, stride: int = 20011) -> torch.Tensor:
    """The sampled softmax's classes for a micro-batch (record #92's "shared negatives"): every target, then
    the first classes not among them of the sweep k -> stride * k mod V (a permutation: gcd(stride, V) = 1)
    from k = the targets' sum mod V, P in all, sorted. A function of the micro-batch alone: any world size
    draws the same sets. No logQ correction is applied; the negatives are uniform over the vocabulary."""
    present = np.unique(targets)
    if math.gcd(stride, V) != 1 or not len(present) <= P <= V:
        raise ValueError(f"sampled softmax: P={P} classes must hold the micro-batch's {len(present)} distinct"
                         f" targets and at most the {V} classes, and stride {stride} be coprime with {V}")
    sweep = stride * (int(targets.sum()) + np.arange(P, dtype=np.int64)) % V  # P - |targets| are enough
    negatives = sweep[~np.isin(sweep, present)][:P - len(present)]
    return torch.from_numpy(np.sort(np.concatenate([present, negatives])).astype(np.int64))

def make_batch(buf: np.ndarray, ngram_rows: int, mask_spec: tuple | None = None,
               max_doc_len: int | None = None, sampled: tuple | None = None, ngram_channels: int = 1,
               virtual_seq_cap: int = 0) -> Batch:
    """Batch from T + 1 consecutive tokens: inputs buf[:T], targets buf[1:], the n-gram table's rows of the
    inputs (ngram_rows_of); with a mask_spec (flex_mask_spec) also the flex block masks, built here on the host;
    with sampled (P, V) the sampled softmax's classes. virtual_seq_cap: attention segments start every that many
    tokens inside a document too (cu_seqlens only: the tokens, hashes and key offsets run on as they were)."""
    T = len(buf) - 1
    inputs = torch.from_numpy(buf[:T].astype(np.int32))
    starts = np.flatnonzero(buf[:T] == BOS_ID)
    if virtual_seq_cap:
        firsts = np.insert(starts[starts > 0], 0, 0)
        starts = np.sort(np.concatenate([firsts] + [np.arange(a + virtual_seq_cap, b, virtual_seq_cap)
                                                    for a, b in zip(firsts, np.append(firsts[1:], T))]))
        max_doc_len = min(max_doc_len or T, virtual_seq_cap)
    starts = starts[starts > 0][: max_docs_for(T) - 1]
    cu = np.full(max_docs_for(T) + 1, T, dtype=np.int32)
    cu[0] = 0
    cu[1:1 + len(starts)] = starts
    batch = Batch(inputs, torch.from_numpy(buf[1:].astype(np.int64)), torch.from_numpy(cu),
                  ngram_rows_of(inputs, ngram_rows, ngram_channels), max_doc_len=max_doc_len,
                  candidates=candidate_classes(buf[1:].astype(np.int64), *sampled) if sampled else None)
    if mask_spec is not None:
        block_size, kinds = mask_spec
        doc = document_ids(batch.cu_seqlens, T)
        masks = {(long, r): block_mask_indices(doc, window, r, block_size) for long, r, window in kinds}
        batch = dataclasses.replace(batch, mask_spec=mask_spec, doc_ids=doc.to(torch.int32), block_masks=masks)
    return batch

def _load_shard_with_index(path: str) -> tuple[np.ndarray, np.ndarray]:
    tokens = read_shard(path).numpy()
    return tokens, np.flatnonzero(tokens == BOS_ID)

class DocumentLoader:
    """BOS-aligned training batches. Every rank walks the same document index (all shards in order, looping):
    micro-batch g of a step goes to rank g % world_size, whatever the world size. Background threads read the
    next shard and build the next step's batches (look_ahead), masks and pinned staging buffer included."""

    def __init__(self, pattern: str, ngram_rows: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | None = None, ngram_channels: int = 1, virtual_seq_cap: int = 0):
        from concurrent.futures import ThreadPoolExecutor
        self.files = find_shards(pattern, "train")
        self.ngram, self.rank, self.world_size = (ngram_rows, ngram_channels), rank, world_size
        self.virtual_seq_cap = virtual_seq_cap
        self.stage = device is not None and device.type == "cuda"  # each step's batches in one pinned buffer
        self._pool = ThreadPoolExecutor(max_workers=1)   # shard reads
        self._steps = ThreadPoolExecutor(max_workers=1)  # look-ahead steps (they wait on shard reads)
        self._ahead = None  # (key, future) of the step look_ahead() is building
        self.shard, self.doc = 0, 0  # position: next document to hand out
        self._open(0)

    def _open(self, shard: int, data=None) -> None:
        """Make `shard` current (reading it now unless its data is given) and prefetch the next one."""
        self._current = (shard, data if data is not None else _load_shard_with_index(self.files[shard]))
        self._prefetch = self._pool.submit(_load_shard_with_index, self.files[(shard + 1) % len(self.files)])

    def _shard_data(self, shard: int):
        if self._current[0] != shard:
            prefetched = shard == (self._current[0] + 1) % len(self.files)
            self._open(shard, self._prefetch.result() if prefetched else None)
        return self._current[1]

    def _next_document(self, shard: int, doc: int) -> tuple[np.ndarray, int, int]:
        """The document at (shard, doc) or the first after it, and the position after it."""
        tokens, starts = self._shard_data(shard)
        while doc >= len(starts):
            shard, doc = (shard + 1) % len(self.files), 0
            tokens, starts = self._shard_data(shard)
        end = starts[doc + 1] if doc + 1 < len(starts) else len(tokens)
        return tokens[starts[doc]:end], shard, doc + 1

    def _build(self, position: tuple[int, int], request: tuple) -> tuple[list[Batch], tuple[int, int]]:
        """One step's micro-batches of this rank from `position`, and the position after them."""
        tokens_per_micro, max_doc_len, micro_batches, mask_spec, sampled = request
        shard, doc = position
        mine = []
        for g in range(micro_batches):
            pieces, need = [], tokens_per_micro + 1
            while need > 0:
                tokens, shard, doc = self._next_document(shard, doc)
                pieces.append(tokens[:min(max_doc_len, need)])
                need -= len(pieces[-1])
            if g % self.world_size == self.rank:
                mine.append(make_batch(np.concatenate(pieces), self.ngram[0], mask_spec, max_doc_len, sampled,
                                       ngram_channels=self.ngram[1], virtual_seq_cap=self.virtual_seq_cap))
        return (stage_step(mine) if self.stage else mine), (shard, doc)

    def _settle(self):
        """Wait for the look-ahead in flight (it reads shards), and take it: (key, (batches, position))."""
        ahead, self._ahead = self._ahead, None
        return None if ahead is None else (ahead[0], ahead[1].result())

    def next_step(self, tokens_per_micro: int, max_doc_len: int, micro_batches: int,
                  mask_spec: tuple | None = None, sampled: tuple | None = None) -> list[Batch]:
        """This rank's micro-batches of one step, each whole documents (truncated to max_doc_len, the last to
        fit) making tokens_per_micro + 1 tokens: the look_ahead() of exactly this step if there is one.
        sampled: (P, vocabulary) of the sampled softmax (make_batch)."""
        request = (tokens_per_micro, max_doc_len, micro_batches, mask_spec, sampled)
        key = ((self.shard, self.doc), request)
        ahead = self._settle()
        batches, (self.shard, self.doc) = ahead[1] if ahead and ahead[0] == key else self._build(*key)
        return batches

    def look_ahead(self, tokens_per_micro: int, max_doc_len: int, micro_batches: int,
                   mask_spec: tuple | None = None, sampled: tuple | None = None) -> None:
        """Start building the next step (next_step's arguments) on the loader's thread."""
        self._settle()
        key = ((self.shard, self.doc), (tokens_per_micro, max_doc_len, micro_batches, mask_spec, sampled))
        self._ahead = (key, self._steps.submit(self._build, *key))

    def state_dict(self) -> dict:
        return {"shard": self.shard, "doc": self.doc, "files": list(self.files)}

    def load_state_dict(self, state: dict) -> None:
        _check_same_shards(state["files"], self.files)
        self._settle()  # a look-ahead from the old position is of no use
        self.shard, self.doc = state["shard"], state["doc"]
        self._open(self.shard)

def _check_same_shards(saved: list, files: list) -> None:
    if saved != list(files):
        raise SystemExit(f"error: the checkpoint was written with other training shards ({len(saved)} "
                         f"files starting {saved[:1]}); resume with the same --train_files")

def validation_batches(pattern: str, num_tokens: int, seq_len: int, ngram_rows: int,
                       rank: int, world_size: int, ngram_channels: int = 1) -> list[Batch]:
    """The val shards' first num_tokens tokens in seq_len sequences dealt round-robin to ranks (any world size)."""
    _check_val_tokens(num_tokens, seq_len)
    chunks, have = [], 0
    for path in find_shards(pattern, "val"):
        chunks.append(read_shard(path).numpy())
        have += len(chunks[-1])
        if have > num_tokens:
            break
    stream = np.concatenate(chunks)
    _check_val_stream(num_tokens, len(stream), pattern)
    return [make_batch(stream[i * seq_len:(i + 1) * seq_len + 1], ngram_rows, ngram_channels=ngram_channels)
            for i in range(rank, num_tokens // seq_len, world_size)]

def _check_val_tokens(num_tokens: int, seq_len: int) -> None:
    if num_tokens % seq_len:
        raise SystemExit(f"error: --val_tokens {num_tokens} must be a multiple of the validation sequence length"
                         f" {seq_len}")

def _check_val_stream(num_tokens: int, have: int, pattern: str) -> None:
    """have: the tokens read from the val shards."""
    if have < num_tokens + 1:
        raise SystemExit(f"error: --val_tokens {num_tokens} needs {num_tokens + 1} tokens but the val shards"
                         f" {pattern!r} hold {have}; lower --val_tokens")

# ----------------------------------------------------------------------------------------------
# Schedule: what every step runs with
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPlan:
    step: int
    stage: int                # index of the stage row; the last row is the extension
    batch_tokens: int         # global tokens this step
    max_doc_len: int
    windows: tuple            # (short, long) in blocks
    lr_mult: float
    momentum: float           # NorMuon's momentum, ANVIL's rail beta
    mtp_weights: tuple        # weights of the targets t+1, t+2, t+3
    prefix_weight: float      # weight of the prefix-token term
    do_adam: bool             # Adam parameters step on odd steps; their gradients accumulate meanwhile
    candidates: int = 0       # classes in the training softmax (sampled softmax), 0: all
    rails: tuple = ()         # ANVIL: (fast rail's beta, its weight in the blend)
    held: tuple = ()          # Adam labels that skip this do_adam step (their gradients accumulate on)
    stretch: tuple = ()       # (Adam label, s): this step's betas^s and wd_mul x s for it

def stage_bounds(args: Hyperparameters) -> tuple[int, ...]:
    """First step of every stage row, then the run's end: (0, 423, 847, 1270, 1285) for the speedrun."""
    n, bounds, done = args.num_iterations, [0], 0.0
    for row in args.stages[:-2]:
        done += row.share
        bounds.append(round(done * n))
    return (*bounds, n, n + args.extension_iterations)

def untie_step(args: Hyperparameters) -> int:
    """The last tied step: the first step of the first `untie` row made odd (the speedrun's last scheduled
    stage: 847, an Adam step; record #92's extension: 1,175); the embedding then takes the head's Adam state,
    transposed, and its first own update is 849. No such row: never (a step past the run)."""
    rows = [i for i, row in enumerate(args.stages) if row.untie]
    step = stage_bounds(args)[rows[0]] if rows else total_steps(args)
    return step if step % 2 else step + 1

def total_steps(args: Hyperparameters) -> int:
    return args.num_iterations + args.extension_iterations

def plan_step(args: Hyperparameters, step: int) -> StepPlan:
    """Everything that changes with the step (record #89's schedule). Speedrun: lr multiplier the stage's until
    int(0.4 x 1270) = 508, then linear to 0.15 at 1270 (so it jumps up at 847), 0.15 in the extension; momentum
    0.85 -> 0.95 over steps 0-300, down over the last 50 of 1285 (ANVIL's rail beta: anvil_rail_beta's); MTP and
    prefix weights linear within a stage."""
    n, total = args.num_iterations, total_steps(args)
    bounds = stage_bounds(args)
    stage = sum(step >= b for b in bounds[1:-1])
    row, final = args.stages[stage], args.stages[-1]
    frac = (step - bounds[stage]) / max(1, bounds[stage + 1] - bounds[stage])
    mtp = tuple(a + (b - a) * frac for a, b in zip(row.mtp_start, row.mtp_end))
    ramp = math.floor(frac * row.prefix_steps) / row.prefix_steps if row.prefix_steps else frac
    prefix = row.prefix_start + (row.prefix_end - row.prefix_start) * ramp
    cooldown_at = int(args.cooldown_start * n)
    if step >= n:
        lr_mult = final.lr_mult
    elif step < cooldown_at:
        lr_mult = row.lr_mult
    else:
        w = min(1.0, (step - cooldown_at) / (n - cooldown_at))
        lr_mult = row.lr_mult * (1 - w) + final.lr_mult * w
    anvil = args.matrix_optimizer == "anvil"
    lo, hi, warmup, cooldown = args.anvil_rail_beta if anvil else (
        args.momentum_min, args.momentum_max, args.momentum_warmup, args.momentum_cooldown)
    warmup, cooldown = round(warmup * n), round(cooldown * n)
    if step < warmup:
        momentum = lo + (hi - lo) * step / warmup
    elif step > total - cooldown:
        momentum = hi - (hi - lo) * (step - (total - cooldown)) / cooldown
    else:
        momentum = hi
    candidates = ([int(p) for start, p in args.sampled_softmax if step + 1e-6 >= start * n] or [0])[-1]
    engage, fast_beta, fast_weight, _ = args.anvil_rails
    rails = ((fast_beta, fast_weight) if step >= round(engage * n) else (momentum, 1.0)) if anvil else ()
    held, stretch = (), ()
    if args.table_cadence and step >= round(args.table_cadence[0] * n):
        _, period, phase = args.table_cadence
        held = TABLE_LABELS if step % period != phase else ()
        stretch = tuple((label, period / 2) for label in TABLE_LABELS)
    return StepPlan(step, stage, row.batch_tokens, row.max_doc_len, tuple(row.windows), lr_mult, momentum,
                    tuple(float(w) for w in mtp), float(prefix), step % 2 == 1, candidates, rails, held, stretch)

def schedule_tokens(args: Hyperparameters) -> list[int]:
    """Global tokens trained before each step, then the run's total (total_steps + 1 entries)."""
    cumulative = [0]
    for step in range(total_steps(args)):
        cumulative.append(cumulative[-1] + plan_step(args, step).batch_tokens)
    return cumulative

def eta_seconds(cumulative: list[int], first: int, done: int, elapsed_ms: float) -> float:
    """Seconds left once steps first..done-1 took elapsed_ms: time per token so far x the tokens still to train."""
    trained = cumulative[done] - cumulative[first]
    return elapsed_ms / 1000 * (cumulative[-1] - cumulative[done]) / max(1, trained)

def batch_request(args: Hyperparameters, plan: StepPlan, batches_per_step: int, device: torch.device) -> tuple:
    """DocumentLoader.next_step's arguments for a step; on CUDA the loader also builds the flex block masks."""
    spec = flex_mask_spec(args, plan.windows, attention_kernels(args, device)) if device.type == "cuda" else None
    sampled = (plan.candidates, args.padded_vocab_size) if plan.candidates else None
    return plan.batch_tokens // batches_per_step, plan.max_doc_len, batches_per_step, spec, sampled

def warmup_steps(args: Hyperparameters) -> list[int]:
    """The steps the compile warm-up runs (the record's 14): 0, 1 and two either side of each stage start,
    which covers every batch size, window, Adam parity and the untie."""
    steps = {0, 1}
    for b in stage_bounds(args)[1:-1]:
        steps |= {b - 2, b - 1, b, b + 1}
    return sorted(s for s in steps if 0 <= s < total_steps(args))

def grad_accum_steps(args: Hyperparameters, world_size: int) -> int:
    """Accumulation steps per rank, so that the global batch is the same for any world size."""
    return max(1, -(-args.micro_batches // world_size))

def check_batch_split(args: Hyperparameters, world_size: int) -> int:
    """grad_accum_steps, or a start-up error where a stage's batch does not split into ranks x accumulation steps."""
    accum = grad_accum_steps(args, world_size)
    batches_per_step = world_size * accum
    for tokens in (row.batch_tokens for row in args.stages):
        if tokens % batches_per_step:
            raise SystemExit(f"error: the global batch of {tokens} tokens (--stage_batch_tokens) does not split into "
                             f"{world_size} ranks x {accum} accumulation steps; use a world size that divides "
                             f"{args.micro_batches} or batch sizes divisible by {batches_per_step}")
    return accum

# ----------------------------------------------------------------------------------------------
# Training: optimizer wiring, logging, evaluation, the step, CUDA graphs, checkpoints, the loop
# ----------------------------------------------------------------------------------------------

def optimizer_configs(args: Hyperparameters, model: "GPT") -> dict[str, ParamConfig]:
    """Per-label optimizer settings: PARAM_TABLE's rows, then CONFIG_CHANGES."""
    labels = model.params_by_label()
    configs = {label: ParamConfig(**row) for label, row in PARAM_TABLE.items() if label in labels}
    # every odd entry of the MLP bank: the down-projections (c_proj), and the record's padding; 0 for a no_mlp
    # row's two (record #92's: lr 0, so no decay either)
    dead = {f"{kind}.{i}" for i, row in enumerate(model.layers) if not row.mlp for kind in ("up", "down")}
    configs["mlp_bank"] = dataclasses.replace(configs["mlp_bank"], matrix_lr_mul=tuple(
        0.0 if role in dead else MLP_DOWN_LR_MUL if i % 2 else 1.0
        for i, role in enumerate(model.bank_roles["mlp_bank"])))
    for change in CONFIG_CHANGES:
        configs = change(args, configs)
    return configs

def build_optimizer(args: Hyperparameters, model: "GPT", device: torch.device,
                    comm: CommLayer | None = None) -> NorMuonAdam:
    _check_matrix_optimizer(args.matrix_optimizer)
    orthogonalizer = functools.partial(ORTHOGONALIZERS[args.orthogonalizer], dtype=model.qk_bank.dtype)
    return NorMuonAdam(model.params_by_label(), optimizer_configs(args, model),
                       scatter_order=[label for label in SCATTER_ORDER if hasattr(model, label)],
                       work_order=[label for label in WORK_ORDER if hasattr(model, label)], orthogonalizer=orthogonalizer,
                       normuon_beta2=NORMUON_BETA2_OF[args.matrix_optimizer], adam_eps=ADAM_EPS,
                       normuon_lr=args.muon_lr, normuon_wd=args.muon_wd, adam_lr=args.adam_lr, adam_wd=args.adam_wd,
                       tied=("embed", "lm_head"), ownership=args.bank_ownership,
                       compile=args.compile and device.type == "cuda", comm=comm, anvil_wd=args.anvil_wd,
                       anvil_slow_beta=args.anvil_rails[3])

def _check_matrix_optimizer(name: str) -> None:
    if name not in NORMUON_BETA2_OF:
        raise ValueError(f"--matrix_optimizer {name!r} is not one of {', '.join(NORMUON_BETA2_OF)}")

# ---- Ablations of the optimizer: the banks' optimizer, switched-off components ---------------

# matrix_optimizer='adamw' runs the banks through the recipe's Adam (cautious decay) on every step, at
# AdamW-like settings: adamw_bank_lr_mul x the embeddings' learning rate (a quarter, 0.002, by default;
# hidden matrices want much smaller Adam steps than embedding rows) and decoupled decay of 0.1 x lr.
ADAMW_BANK_DECAY = 0.1
ADAMW_BANK_BETAS = (0.9, 0.95)

def adamw_bank_configs(args: Hyperparameters, configs: dict[str, ParamConfig]) -> dict[str, ParamConfig]:
    """--matrix_optimizer adamw: the banks move to Adam, stepping on every step."""
    if args.matrix_optimizer != "adamw":
        return configs
    # Adam's decay is (lr * lr_mul)^2 * adam_wd * wd_mul: pick wd_mul so that it equals
    # ADAMW_BANK_DECAY times the bank's learning rate at the base lr.
    bank_lr = args.adam_lr * args.adamw_bank_lr_mul
    wd_mul = ADAMW_BANK_DECAY / (bank_lr * args.adam_wd) if bank_lr * args.adam_wd > 0 else 0.0
    return {**configs, **{label: ParamConfig("adam", "sharded", lr_mul=args.adamw_bank_lr_mul, wd_mul=wd_mul,
                                             betas=ADAMW_BANK_BETAS, every_step=True)
                          for label in ("qk_bank", "vo_bank", "mlp_bank")}}

def anvil_bank_configs(args: Hyperparameters, configs: dict[str, ParamConfig]) -> dict[str, ParamConfig]:
    """--matrix_optimizer anvil: the banks step with ANVIL (record #92) at NorMuon's learning rates."""
    if args.matrix_optimizer != "anvil":
        return configs
    return {**configs, **{label: dataclasses.replace(configs[label], optimizer="anvil")
                          for label in ("qk_bank", "vo_bank", "mlp_bank")}}

def table_lr_configs(args: Hyperparameters, configs: dict[str, ParamConfig]) -> dict[str, ParamConfig]:
    """--table_lr_mul: the embedding tables' lr multiplier (record #89's 75, record #92's 70)."""
    return {**configs, **{label: dataclasses.replace(configs[label], lr_mul=args.table_lr_mul)
                          for label in TABLE_LABELS if label in configs}}

NGRAM_OPTIMIZERS = ("adam", "row_adam")

def ngram_table_configs(args: Hyperparameters, configs: dict[str, ParamConfig]) -> dict[str, ParamConfig]:
    """--ngram_optimizer row_adam: the n-gram table steps with record #92's row Adam (its beta1 forced to 0)."""
    if args.ngram_optimizer != "row_adam":
        return configs
    table = configs["bigram_embed"]
    return {**configs, "bigram_embed": dataclasses.replace(table, optimizer="row_adam", betas=(0.0, table.betas[1]))}

def switched_off_configs(args: Hyperparameters, configs: dict[str, ParamConfig]) -> dict[str, ParamConfig]:
    """Parameters of a switched-off component get lr and decay multipliers of 0 (they receive no
    gradient and must not drift)."""
    off = {"value_embeds": not args.value_embeds, "ve_gate_bank": not args.value_embeds,
           "bigram_embed": not args.bigram_embed, "smear_gate": not args.smear,
           **{label: not args.mudd for label in ("mudd_w1", "mudd_w2", "mudd_gate_w1", "mudd_gate_w2")}}
    return {label: dataclasses.replace(cfg, lr_mul=0.0, wd_mul=0.0) if off.get(label) else cfg
            for label, cfg in configs.items()}

# The ablation flags' changes of the per-label configs, (args, configs) -> configs (the record's flags
# change nothing), and each --matrix_optimizer's NorMuon beta2. Plain Muon is NorMuon with beta2 = 1: the
# second moment never leaves its zero start, so the per-neuron scale is one constant that the Frobenius
# renormalisation cancels exactly.
CONFIG_CHANGES = (table_lr_configs, adamw_bank_configs, anvil_bank_configs, ngram_table_configs, switched_off_configs)
NORMUON_BETA2_OF = {"normuon": NORMUON_BETA2, "muon": 1.0, "adamw": NORMUON_BETA2, "anvil": NORMUON_BETA2}
MATRIX_OPTIMIZERS = tuple(NORMUON_BETA2_OF)

class RunLog:
    """What rank 0 reports: logs/<run_id>.txt (both source files, versions, hardware, hyperparameters, then
    the record's lines, each flushed: a crash keeps everything up to it) and a self-rewriting console line."""

    def __init__(self, args: Hyperparameters, run_id: str, dist_info: DistInfo, notes: list[str] = ()):
        self.file, self.path = None, os.path.join(args.log_dir, f"{run_id}.txt")
        self.console, self.tty = dist_info.is_master, sys.stdout.isatty()
        if not dist_info.is_master:
            return
        os.makedirs(args.log_dir, exist_ok=True)
        self.file = open(self.path, "x", encoding="utf-8")  # never overwrite an earlier run's log
        here = os.path.dirname(os.path.abspath(__file__))
        for name in ("train_gpt.py", "triton_kernels.py"):
            self.write(f"==== {name} ====\n" + open(os.path.join(here, name), encoding="utf-8").read().rstrip("\n"))
        import platform
        import triton
        self.write(f"==== environment ====\npython {platform.python_version()} torch {torch.__version__} "
                   f"triton {triton.__version__} numpy {np.__version__}")
        self.write(hardware_line(dist_info))  # GPUs or CPUs
        for line in notes:
            self.note(line)
        self.write("==== hyperparameters ====")
        for f in dataclasses.fields(args):
            value = getattr(args, f.name)  # the row fields: a row a line
            text = "(\n" + "".join(f"    {r!r},\n" for r in value) + ")" if f.name in _ROW_FIELDS else repr(value)
            self.write(f"{f.name} = {text}")
        self.write("==== training ====")

    def write(self, line: str) -> None:
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def show(self, text: str, final: bool = False) -> None:
        """The console line (a new line where final, or where stdout is not a terminal)."""
        if self.console and self.tty:
            print("\r" + text.ljust(100), end="\n" if final else "", flush=True)
        elif self.console:
            print(text, flush=True)

    def note(self, line: str) -> None:
        self.write(line)
        self.show(line, final=True)

@torch.no_grad()
def evaluate(compiled_model, batches: list[Batch], device: torch.device) -> float:
    """Mean next-token cross-entropy over every validation token (all ranks' sequences together)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss summed over tokens, tokens)
    for b in batches:
        b = b.to(device)
        masks = compiled_model.batch_masks(b)  # outside the compiled graph
        sums[0] += compiled_model(b.inputs, b.targets, b.cu_seqlens, b.ngram_ids, masks=masks).double() * b.inputs.numel()
    sums[1] = float(sum(b.inputs.numel() for b in batches))
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()

def grad_scale_for(args: Hyperparameters, world_size: int) -> float:
    """Loss scale of every micro-batch, world_size / micro_batches (1 on 8 GPUs): the loss is a sum over
    tokens (the record's), and this keeps the averaged gradient the record's at any world size."""
    return world_size / args.micro_batches

def begin_step(opt: NorMuonAdam, batches: list[Batch], plan: StepPlan, mtp: torch.Tensor, prefix: torch.Tensor) -> None:
    """What a step does before its first forward: the step's loss weights into the device tensors mtp
    (K,) and prefix (0-D), and the n-gram table's rows to exchange, known before backward, declared now (the
    exchange launched with the last micro-batch's on the table's steps: Adam's, but those the cadence holds)."""
    for value, dst in ((plan.mtp_weights, mtp), (plan.prefix_weight, prefix)):
        copy_from_host_(dst, torch.tensor(value, dtype=torch.float32))
    table_steps = plan.do_adam and "bigram_embed" not in plan.held
    for i, b in enumerate(batches):
        opt.prepare_sparse("bigram_embed", b.ngram_ids, launch=table_steps and i == len(batches) - 1)

def forward_backward(compiled_model, opt: NorMuonAdam, batches: list[Batch], plan: StepPlan, mtp: torch.Tensor,
                     prefix: torch.Tensor, grad_scale: float, device: torch.device,
                     into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of this rank's micro-batches (the optimizer step is the caller's): the one
    definition, which the step graphs (StepGraphs) run and capture. mtp (K,) and prefix (0-D) are device
    tensors that receive this step's loss weights. Returns this rank's (summed training objective times
    grad_scale, summed next-token loss), 0-D tensors; nothing here waits for the GPU. into: the 0-D tensors
    to write the sums into (the step graphs' static ones), whose caller has run begin_step and leaves the
    reductions to opt.step; otherwise begin_step here, and the last backward launches each gradient's
    reduction as soon as that gradient is final."""
    if into is None:
        begin_step(opt, batches, plan, mtp, prefix)
    loss, next_token = into or (torch.zeros((), device=device), torch.zeros((), device=device))
    for t in into or ():  # the step graphs' static sums start each run at 0
        t.zero_()
    for i, b in enumerate(batches):
        b = b.to(device)
        masks = compiled_model.batch_masks(b)  # outside the compiled graph; built by the loader when it could
        micro, micro_next_token = compiled_model(b.inputs, b.targets, b.cu_seqlens, b.ngram_ids, mtp_weights=mtp,
                                                 loss_scale=grad_scale, prefix_weight=prefix, masks=masks,
                                                 candidates=b.candidates)
        hooks = into is None and i == len(batches) - 1
        with reductions_on_backward(opt, plan.do_adam, plan.held) if hooks else contextlib.nullcontext():
            micro.backward()
        loss += micro.detach()
        next_token += micro_next_token
    return loss, next_token

def optimizer_schedule(plan: StepPlan) -> dict:
    """opt.step's arguments as the plan schedules them (after forward_backward or its graph's replay)."""
    return dict(do_adam=plan.do_adam, lr_scale=plan.lr_mult, momentum=plan.momentum, rails=plan.rails or None,
                held=plan.held, stretch=dict(plan.stretch))

def compile_model(model: nn.Module):
    """The model compiled whole (fullgraph: a graph break is an error), one graph per shape: the record
    raises dynamo's recompile limit to 64, every schedule variant being a graph of its own."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model, dynamic=False, fullgraph=True)

# ---- CUDA graphs (record #92): each step shape's forward+backward replayed (--cuda_graphs) --------

def use_cuda_graphs(args: Hyperparameters, device: torch.device) -> bool:
    """--cuda_graphs takes effect on a CUDA device with --compile true; elsewhere forward_backward runs."""
    return bool(args.cuda_graphs and args.compile and device.type == "cuda")

def graphs_kept(graphs: StepGraphs | None, notes: list[str]) -> StepGraphs | None:
    """The graphs after a warm-up step: None, with a note, if a capture failed its check (that step ran
    uncaptured; so does the rest of the run)."""
    if graphs is not None and graphs.failure:
        notes.append(f"cuda graphs off for this run: {graphs.failure}")
        return None
    return graphs

def graphs_captured_notes(graphs: StepGraphs | None) -> list[str]:
    """The warm-up's last note: how many step shapes it captured."""
    return [] if graphs is None else [f"cuda graphs: {graphs.captured()} step shapes captured in the warm-up, "
                                      "each replay equal to the uncaptured step"]

def step_graphs(trainer: Trainer) -> StepGraphs | None:
    """The Trainer's StepGraphs where use_cuda_graphs, else None (Trainer.step runs forward_backward)."""
    t = trainer
    if not use_cuda_graphs(t.args, t.dist_info.device):
        return None
    return StepGraphs(t.model, t.compiled_model, t.opt, t.mtp, t.prefix, t.grad_scale, t.dist_info.device)

def step_graph_key(plan: StepPlan, request: tuple, micro_batches: int) -> tuple:
    """What a step's captured forward+backward depends on beyond its buffers' values: the windows (numbers
    in the graph), the loader request's shapes and this rank's micro-batch count. Adam parity and the
    untie change only the optimizer step, which runs after the replay."""
    tokens, max_doc_len, _, spec, sampled = request
    return (tuple(plan.windows), tokens, max_doc_len, micro_batches, spec, sampled)

@dataclass
class _StepBuffers:
    input: torch.Tensor    # the whole step's staged bytes on the device (uint8)
    batches: list          # each micro-batch's tensors as views of `input`
    loss: torch.Tensor     # 0-D fp32: the step's summed objective, written by the forward+backward
    next_token: torch.Tensor  # 0-D fp32: the step's summed next-token loss
    graph: object = None   # torch.cuda.CUDAGraph of the forward+backward, once captured and checked

class StepGraphs:
    """forward_backward replayed as one CUDA graph per shape key (step_graph_key), as
    record #92 captures its steps (one GPU's step is host-bound). Per key, static buffers: the staged
    micro-batches (one host-to-device copy a step), the losses; every .grad is static too, zeroed in place
    once the optimizer consumed it. Not captured: the optimizer step (host-built hyperparameters, a
    data-dependent bigram exchange, NCCL, state replaced by untie and load_state_dict): Trainer.step runs
    it after the replay, and it launches the reductions itself. capture=False (CPUs) runs the same code without graphs."""

    def __init__(self, model: nn.Module, compiled_model, opt: NorMuonAdam, mtp: torch.Tensor, prefix: torch.Tensor,
                 grad_scale: float, device: torch.device, capture: bool | None = None):
        self.model, self.compiled_model, self.opt = model, compiled_model, opt
        self.mtp, self.prefix, self.grad_scale, self.device = mtp, prefix, grad_scale, device
        self.capture = device.type == "cuda" if capture is None else capture
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.grads = [torch.zeros_like(p) for _, p in self.named]  # the graphs accumulate into these
        self.buffers: dict[tuple, _StepBuffers] = {}
        self.pool = None
        self.failure = ""  # why a capture failed its check (the run then goes on without graphs)

    def captured(self) -> int:
        return sum(e.graph is not None for e in self.buffers.values())

    def _buffers(self, key: tuple, batches: list[Batch]) -> _StepBuffers:
        entry = self.buffers.get(key)
        if entry is None:
            buf, parts = step_slices(batches, device=self.device)
            views = [unstage(b, part) for b, part in zip(batches, parts)]
            entry = self.buffers[key] = _StepBuffers(buf, views, torch.zeros((), device=self.device),
                                                     torch.zeros((), device=self.device))
        return entry

    def _bind_grads(self) -> None:
        """Each .grad its static tensor: zeroed where the optimizer consumed it, loaded where a checkpoint set
        it (pending Adam gradients)."""
        fresh = []
        for (_, p), g in zip(self.named, self.grads):
            if p.grad is not g:
                if p.grad is None:
                    fresh.append(g)
                else:
                    g.copy_(p.grad)
                p.grad = g
        if fresh:
            torch._foreach_zero_(fresh)

    def _forward_backward(self, entry: _StepBuffers, plan: StepPlan) -> None:
        forward_backward(self.compiled_model, self.opt, entry.batches, plan, self.mtp, self.prefix, self.grad_scale,
                         self.device, into=(entry.loss, entry.next_token))

    def _state(self, entry: _StepBuffers) -> dict[str, torch.Tensor]:
        """What a forward+backward writes: the losses, the gradients, the model's buffers (FP8 scales)."""
        grads = {f"grad of {n}": g for (n, _), g in zip(self.named, self.grads)}
        return {"loss": entry.loss, "next-token loss": entry.next_token, **grads, **dict(self.model.named_buffers())}

    def _capture(self, entry: _StepBuffers, plan: StepPlan) -> None:
        """Capture entry's forward+backward after two uncaptured runs from the same state on a side stream
        (PyTorch's warm-up), and raise with the reason where a replay differs from them (replay_mismatch)."""
        state = self._state(entry)
        before = {k: t.clone() for k, t in state.items()}
        runs = []
        side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                for k, t in state.items():
                    t.copy_(before[k])
                self._forward_backward(entry, plan)
                runs.append({k: t.clone() for k, t in state.items()})
            for k, t in state.items():
                t.copy_(before[k])
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        try:
            # thread_local: the loader's threads may allocate pinned memory meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward_backward(entry, plan)
            graph.replay()
            why = replay_mismatch(state, *runs)
        except Exception as e:  # reported; the step runs uncaptured
            why = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why:
            for k, t in state.items():  # the uncaptured step's result stands
                t.copy_(runs[0][k])
            raise RuntimeError(why)
        entry.graph = graph

    def step(self, batches: list[Batch], plan: StepPlan, key: tuple, capture: bool = False) -> tuple:
        """forward_backward on the static buffers of `key`: replayed where captured, captured and checked
        first when `capture` (the untimed warm-up) and the key has no graph yet, run uncaptured otherwise;
        the optimizer step is the caller's. Returns forward_backward's (summed objective, summed next-token
        loss) as new 0-D tensors (the static ones: overwritten by the next replay)."""
        begin_step(self.opt, batches, plan, self.mtp, self.prefix)
        entry = self._buffers(key, batches)
        host = step_buffer(batches)
        if host.numel() != entry.input.numel():
            raise ValueError(f"StepGraphs: the step's batches take {host.numel()} staged bytes, key {key} was made"
                             f" for {entry.input.numel()}; the key must fix every micro-batch's shapes")
        self._bind_grads()
        entry.input.copy_(host, non_blocking=True)  # the step's one host-to-device copy
        if entry.graph is not None:
            entry.graph.replay()
        elif capture and self.capture and not self.failure:
            try:
                self._capture(entry, plan)
            except RuntimeError as e:
                self.failure = str(e)
        else:
            self._forward_backward(entry, plan)
        return entry.loss.clone(), entry.next_token.clone()

def step_buffer(batches: list[Batch]) -> torch.Tensor:
    """A step's staged bytes as one host buffer: stage_step's joint buffer itself, else a packed copy."""
    bufs = [b.staged if b.staged is not None else stage_batch(b).staged for b in batches]
    first, total = bufs[0], sum(buf.numel() for buf in bufs)
    at = first.data_ptr()
    for buf in bufs:
        if buf.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or buf.data_ptr() != at:
            return torch.cat(bufs)
        at += buf.numel()
    return first.as_strided((total,), (1,), first.storage_offset())

def replay_mismatch(got: dict, ref: dict, again: dict) -> str:
    """'' when a replay's results `got` are the uncaptured step's `ref`: bit-identical wherever two uncaptured
    runs (ref, again) are, elsewhere (an embedding backward's atomic adds) within 4x their spread."""
    def raw(t):  # torch.equal of float8 tensors: as bytes
        return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t

    def wide(t):
        return (t.float() if t.dtype in _FP8_DTYPES else t).double()

    for name, want in ref.items():
        if torch.equal(raw(got[name]), raw(want)):
            continue
        noise = float((wide(again[name]) - wide(want)).abs().max())
        off = float((wide(got[name]) - wide(want)).abs().max())
        if not noise or not off <= 4 * noise:
            return f"{name} differs from the uncaptured step's by {off:.3g} (two uncaptured runs: by {noise:.3g})"
    return ""

# ---- End-of-run weight blends (record #92's "ships", --weight_blends) ------------------------------
# fp32 averages of the run's tail, ticked after the optimizer step, blended into the weights just before the
# final validation (on the clock). They run on every rank's whole (replicated) parameters, so any world size
# gives the same weights. A window is a fraction of the run (record #92's, of its 1,194 steps), and each
# rate follows its window in steps W: TailEMA 2/(W+1), two steps folded into each odd one; the averages
# 2/(0.102 W + 1) (4/53 at W = 250); the bank blend 2/(W//4 + 1). The first tick of each seeds it by copy.
# The ships in BLENDS' order (the tail average replaces vo and MLP before the bank blend lerps them), then
# every renormed label is scaled back to its Frobenius norm before the ships (one bf16 rounding).

@dataclass(frozen=True)
class Blend:
    name: str
    labels: tuple
    window: float             # the last window x total steps of the run
    mix: float | dict | None  # ship: lerp(weights, average, mix) (by label if a dict); None: the average replaces them
    renormed: bool = True

BLENDS = (
    Blend("tail_ema", ("lm_head", "embed"), 298 / 1194, 0.65),
    Blend("tail_average", ("vo_bank", "mlp_bank"), 250 / 1194, None),
    Blend("value_embed_average", ("value_embeds",), 250 / 1194, None, renormed=False),
    Blend("bank_blend", ("qk_bank", "vo_bank", "mlp_bank"), 298 / 1194,
          {"qk_bank": 0.55, "vo_bank": 0.55 - 0.2007, "mlp_bank": 0.55 - 0.2007}),  # 0.2007: the average's lag
)

def _tail_ema_rate(step: int, total: int, window: int, value_embeds_updated: bool) -> float | None:
    r = 2 / (window + 1)
    if step % 2 == 0:  # the window's first step, and the last one where the run's length is odd
        return r if step in (total - window, total - 1) else None
    return r if step == total - 1 else 1 - (1 - r) ** 2

# Each blend's rate at a step of its window (None: no tick), by name.
BLEND_RATES = {
    "tail_ema": _tail_ema_rate,
    "tail_average": lambda step, total, window, _: 2 / (0.102 * window + 1) if (total - 1 - step) % 4 == 0 else None,
    "value_embed_average": lambda step, total, window, updated: 2 / (0.102 * window + 1) if updated else None,
    "bank_blend": lambda step, total, window, _: 2 / (window // 4 + 1) if step % 4 == 1 or step >= total - 2 else None,
}

class WeightBlends:
    """BLENDS over a run of `total` steps on params (by label): tick() after each optimizer step, ship() once."""

    def __init__(self, params: dict[str, torch.Tensor], total: int, blends=BLENDS):
        self.params, self.total, self.blends = params, total, blends
        self.windows = {b.name: round(b.window * total) for b in blends}
        self.reset()

    def reset(self) -> None:
        self.averages = {b.name: {} for b in self.blends}
        self.ticks = {b.name: 0 for b in self.blends}

    def window_start(self) -> int:
        return self.total - max(self.windows.values())

    def state_dict(self) -> dict:
        """The averages (copies) and tick counts: a checkpoint inside the window resumes with them."""
        return {"averages": {name: {label: t.clone() for label, t in a.items()} for name, a in self.averages.items()},
                "ticks": dict(self.ticks)}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s averages and ticks; a ValueError names the first that does not fit."""
        names = [b.name for b in self.blends]
        if sorted(state["averages"]) != sorted(names) or sorted(state["ticks"]) != sorted(names):
            raise ValueError(f"weight blends {sorted(state['averages'])}, this run blends {sorted(names)}")
        for b in self.blends:
            for label, t in state["averages"][b.name].items():
                if label not in b.labels or t.shape != self.params[label].shape:
                    raise ValueError(f"weight blend {b.name}: an average of {label} {tuple(t.shape)} does not fit")
        self.averages = {name: {label: t.clone() for label, t in a.items()} for name, a in state["averages"].items()}
        self.ticks = dict(state["ticks"])

    @torch.no_grad()
    def tick(self, step: int, value_embeds_updated: bool) -> None:
        for b in self.blends:
            window = self.windows[b.name]
            if step < self.total - window:
                continue
            rate = BLEND_RATES[b.name](step, self.total, window, value_embeds_updated)
            if rate is None:
                continue
            self.ticks[b.name] += 1
            averages = self.averages[b.name]
            for label in b.labels:
                if label in averages:
                    averages[label].lerp_(self.params[label].float(), rate)
                else:
                    averages[label] = self.params[label].detach().float().clone()

    @torch.no_grad()
    def ship(self) -> str:
        """Blend the averages into the parameters and renorm them; returns the log's line."""
        renormed = {label for b in self.blends if b.renormed for label in self.averages[b.name]}
        norms = {label: self.params[label].float().norm() for label in renormed}
        for b in self.blends:
            for label, average in self.averages[b.name].items():
                p = self.params[label]
                mix = b.mix.get(label) if isinstance(b.mix, dict) else b.mix
                p.copy_(average if mix is None else torch.lerp(p.float(), average, mix))
        for label, norm in norms.items():
            now = self.params[label].float().norm()
            self.params[label].mul_(float(norm / now) if now > 0 else 1.0)
        line = "weight blends shipped (ticks): " + ", ".join(f"{name} {n}" for name, n in self.ticks.items())
        self.reset()
        return line

class Trainer:
    """The step train() runs (the benchmarks and the GPU check time it), with what it needs built once:
    the compiled model, optimizer, loader, the loss weights' device buffers and, on CUDA, the step graphs."""

    def __init__(self, args: Hyperparameters, dist_info: DistInfo, model: "GPT", opt: NorMuonAdam, loader: DocumentLoader):
        self.args, self.dist_info, self.model, self.opt, self.loader = args, dist_info, model, opt, loader
        self.compiled_model = compile_model(model) if args.compile else model
        self.accum = grad_accum_steps(args, dist_info.world_size)  # train() checked the split
        self.batches_per_step = dist_info.world_size * self.accum
        self.total = total_steps(args)
        self.fp8 = args.fp8 and _native_fp8(dist_info.device)
        self.grad_scale = grad_scale_for(args, dist_info.world_size)
        self.mtp = torch.zeros(len(args.stages[0].mtp_start), dtype=torch.float32, device=dist_info.device)
        self.prefix = torch.zeros((), dtype=torch.float32, device=dist_info.device)
        self.graphs = step_graphs(self)  # record #92's CUDA graphs where --cuda_graphs applies
        self.blends = WeightBlends(model.params_by_label(), self.total) if args.weight_blends else None
        self.windows = None
        self.batches: list[Batch] = []

    def validate(self, step: int, batches: list[Batch]) -> float:
        """evaluate() with step `step`'s windows; after the last step the record's final validation's:
        wider windows, YaRN kept at the extension's."""
        if step < self.total:
            self.set_windows(plan_step(self.args, step).windows)
        else:
            self.set_windows(self.args.final_val_windows, plan_step(self.args, self.total - 1).windows[1])
        return evaluate(self.compiled_model, batches, self.dist_info.device)

    def set_windows(self, windows: tuple, yarn: int | None = None) -> None:
        """The model's windows; the YaRN update runs only when the windows actually change."""
        if (windows, yarn) != self.windows:
            self.model.set_windows(*windows, yarn_blocks=yarn)
            self.windows = (windows, yarn)

    def step(self, step: int, plan: StepPlan | None = None, next_step: int | None = None,
             warm_up: bool = False) -> tuple[StepPlan, torch.Tensor]:
        """One training step (plan: plan_step(step) unless given), then the untie right after the last
        tied step (the record's) and the FP8 weights' re-quantisation; the loader builds step
        `next_step`'s batches (default step + 1) on its thread meanwhile. warm_up: the untimed warm-up,
        where the step graphs are captured. Returns the plan and this rank's (mean next-token loss, mean
        objective) per token, a device tensor: nothing here waits for the GPU."""
        args, dist_info, graphs = self.args, self.dist_info, self.graphs
        plan = plan or plan_step(args, step)
        self.set_windows(plan.windows)
        request = batch_request(args, plan, self.batches_per_step, dist_info.device)
        batches = self.loader.next_step(*request)
        next_step = step + 1 if next_step is None else next_step
        # not while a warm-up step may capture a graph: the warm-up's next step is rarely its successor
        if next_step < self.total and not (warm_up and graphs is not None):
            self.loader.look_ahead(*batch_request(args, plan_step(args, next_step), self.batches_per_step, dist_info.device))
        if graphs is not None:  # the warm-up captures each key's graph (and checks it against the uncaptured step)
            objective, next_token = graphs.step(batches, plan, step_graph_key(plan, request, self.accum), capture=warm_up)
        else:
            objective, next_token = forward_backward(self.compiled_model, self.opt, batches, plan, self.mtp, self.prefix,
                                                     self.grad_scale, dist_info.device)
        self.opt.step(**optimizer_schedule(plan))
        if step == untie_step(args) and self.opt.tied:  # (a benchmark may have untied already)
            self.opt.untie()
        if self.blends is not None:
            self.blends.tick(step, value_embeds_updated=plan.do_adam and "value_embeds" not in plan.held)
        self.batches = batches  # the benchmarks count the step's documents
        if self.fp8:  # after the optimizer step (the record's per-step order), for the next forward
            self.model.quantize_fp8(bootstrap=step < FP8_BOOTSTRAP_STEPS)
        tokens = plan.batch_tokens / dist_info.world_size  # means per token of this rank's batch (no collective)
        return plan, torch.stack([next_token / tokens, objective / (self.grad_scale * tokens)])

    def warm_up(self, val_batch: list[Batch], prefix_table: torch.Tensor) -> list[str]:
        """Compile every graph the run needs (each stage, both Adam parities, untied, evaluation) and capture
        the step graphs on real batches, then restore model, optimizer and loader. Returns the log's notes."""
        args, model, opt, loader = self.args, self.model, self.opt, self.loader
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt, saved_loader = opt.state_dict(), loader.state_dict()
        saved_blends = None if self.blends is None else self.blends.state_dict()  # a resume's averages
        model.prefix_table.copy_(prefix_table)  # as in the timed steps
        notes = []
        for step in warmup_steps(args):
            self.validate(step, val_batch)
            self.step(step, warm_up=True)
            self.graphs = graphs_kept(self.graphs, notes)  # off for the run after a failed capture
        self.validate(self.total, val_batch)  # a graph of its own where a kernel takes the window as a number
        model.load_state_dict(saved_model)
        model.prefix_table.fill_(-1)  # not in the state dict; the timed run builds it again
        model.zero_grad(set_to_none=True)  # Adam gradients of an even last warm-up step must not leak in
        self.windows = None  # the restored buffers hold the initial windows again
        opt.load_state_dict(saved_opt)
        loader.load_state_dict(saved_loader)
        if self.blends is not None:
            self.blends.load_state_dict(saved_blends)
        return notes + graphs_captured_notes(self.graphs)

# ---- Checkpoints and signals (a speedrun saves none) -----------------------------------------

CHECKPOINT_FORMAT = 5  # 3: the record-#89 model (layer table, MUDD, FP8 MLP state); 4: FP8 scales in 16-byte
#                        blocks; 5: the stage and layer rows in the saved settings

# Fields that may differ between a checkpoint and the run resuming from it.
RESUMABLE_CHANGES = {"resume", "save_every", "keep_checkpoints", "val_loss_every", "log_dir", "checkpoint_dir",
                     "run_id", "compile", "cuda_graphs"}

def save_checkpoint(path: str, step: int, model: nn.Module, opt: NorMuonAdam, loader: DocumentLoader,
                    args: Hyperparameters, dist_info: DistInfo, blends: WeightBlends | None = None) -> None:
    """A directory written whole or not at all: every rank writes its files into path.tmp, rank 0
    renames it to path once all have finished. blends: --weight_blends' averages (every rank's alike)."""
    tmp = path + ".tmp"
    if dist_info.is_master:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier()
    # Adam gradients accumulate over even steps: this rank's pending ones are part of the state too.
    pending = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    torch.save({"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "grads": pending},
               os.path.join(tmp, f"rank{dist_info.rank:03d}.pt"))
    if dist_info.is_master:
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": dist_info.world_size,
                "args": dataclasses.asdict(args), "model": model.state_dict(), "loader": loader.state_dict()}
        if blends is not None:
            meta["blends"] = blends.state_dict()
        torch.save(meta, os.path.join(tmp, "model.pt"))
    if dist.is_initialized():
        dist.barrier()
    if dist_info.is_master:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()

def whole_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every whole checkpoint of a run (its step_N directories), oldest first; one still
    being written (step_N.tmp) and any other file are not checkpoints."""
    return sorted((int(e[5:]), os.path.join(run_dir, e)) for e in os.listdir(run_dir)
                  if e.startswith("step_") and e[5:].isdecimal())

def prune_checkpoints(run_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` whole checkpoints of a run, so that frequent checkpoints of a long
    run take bounded disk."""
    for _, path in whole_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path)

class StopOnSignal:
    """While enabled (a run that checkpoints, in the main thread), SIGINT (Ctrl-C) and SIGTERM (kill, a
    scheduler's preemption notice, torchrun passing either on) do not stop the process: they set `signum`,
    and the run saves where it is and exits; a second signal stops at once. Every rank must stop after the
    same step to write one checkpoint, so with several ranks each step's requests are combined (a
    one-element all-reduce, MAX) and read a step later through a page-locked host copy and an event: the
    host waits at most for the end of step - 2, with step - 1 still queued behind it, so the device never
    runs dry (a plain .item() would wait for everything queued). The caller's handlers are back on exit."""

    def __init__(self, enabled: bool, world_size: int = 1, device: torch.device = torch.device("cpu")):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum = 0
        self.shared = self.host = self.done = None
        if world_size > 1 and self.enabled:  # one flag per step parity
            cuda = device.type == "cuda"
            self.shared = [torch.zeros(1, device=device) for _ in range(2)]
            self.host = [torch.zeros(1, pin_memory=cuda) for _ in range(2)]
            self.done = [torch.cuda.Event() for _ in range(2)] if cuda else None

    def __enter__(self) -> StopOnSignal:
        if self.enabled:
            self.previous = {s: signal.signal(s, self.request) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            for s, handler in self.previous.items():
                signal.signal(s, handler)

    def request(self, signum, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"  {signal.Signals(signum).name}: stopping once this step's state is saved (again: at once)",
              file=sys.stderr, flush=True)

    def share(self, step: int) -> None:
        """After step `step`: this rank's request joins every rank's (queued, not waited for)."""
        if self.shared is not None:
            i = step % 2
            self.shared[i].fill_(self.signum)
            dist.all_reduce(self.shared[i], op=dist.ReduceOp.MAX)
            self.host[i].copy_(self.shared[i], non_blocking=True)  # lands after the all-reduce, in stream order
            if self.done is not None:
                self.done[i].record()

    def agreed(self, step: int) -> int:
        """The signal every rank stops for before step `step` (0: none): this rank's own with one rank, with
        several the combined requests of step - 2 (shared before the one in flight)."""
        if self.shared is None:
            return self.signum
        i = step % 2
        if self.done is not None:
            self.done[i].synchronize()  # the end of step - 2: step - 1 is queued behind it
        return int(self.host[i])

def load_checkpoint(path: str, model: nn.Module, opt: NorMuonAdam, loader: DocumentLoader,
                    args: Hyperparameters, dist_info: DistInfo, blends: WeightBlends | None = None) -> int:
    """Restore everything a step depends on (blends: --weight_blends' averages); returns the step to continue
    from. Refuses a checkpoint of another configuration or world size with a one-line reason."""
    def refuse(why):
        raise SystemExit(f"error: cannot resume from {path}: {why}")

    try:
        meta = torch.load(os.path.join(path, "model.pt"), map_location=dist_info.device, weights_only=False)
        mine = torch.load(os.path.join(path, f"rank{dist_info.rank:03d}.pt"), map_location=dist_info.device, weights_only=False)
    except FileNotFoundError as e:
        refuse(f"missing {os.path.basename(e.filename)} (not a checkpoint directory, or an unfinished one)")
    except Exception as e:  # torch.load raises many types for a damaged file
        refuse(f"unreadable checkpoint file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if meta.get("format") != CHECKPOINT_FORMAT:
        refuse(f"checkpoint format {meta.get('format')}, this script reads {CHECKPOINT_FORMAT}")
    if meta["world_size"] != dist_info.world_size:
        refuse(f"written by {meta['world_size']} ranks, this run has {dist_info.world_size}; resume with the same world size")
    now = dataclasses.asdict(args)  # rows as dicts, as saved
    changed = [k for k in [*meta["args"], *(k for k in now if k not in meta["args"])]  # in field order
               if k not in RESUMABLE_CHANGES and meta["args"].get(k) != now.get(k)]
    if changed:
        k = changed[0]
        refuse(f"--{k} was {meta['args'].get(k)!r}, now {now.get(k)!r} ({len(changed)} field(s) differ)")
    model.load_state_dict(meta["model"])
    try:
        opt.load_state_dict(mine["optimizer"])
    except ValueError as e:
        refuse(str(e))
    loader.load_state_dict(meta["loader"])
    if blends is not None:
        if "blends" in meta:
            try:
                blends.load_state_dict(meta["blends"])
            except ValueError as e:
                refuse(str(e))
        elif meta["step"] > blends.window_start():
            refuse(f"step {meta['step']} is inside --weight_blends' window (from step {blends.window_start()}) and the"
                   " checkpoint holds no averages (an older script's); resume from an earlier checkpoint")
    torch.set_rng_state(mine["rng"].cpu())
    for name, p in model.named_parameters():
        p.grad = mine["grads"].get(name)
    return meta["step"]

# ---- train()'s resume, checkpoints and signals ----------------------------------------------

def resume_step(args: Hyperparameters, dist_info: DistInfo, model: nn.Module, opt: NorMuonAdam,
                loader: DocumentLoader, blends: WeightBlends | None = None) -> int:
    """The step train() starts from: 0, or that of --resume's checkpoint, loaded."""
    if not args.resume:
        return 0
    step = load_checkpoint(args.resume, model, opt, loader, args, dist_info, blends)
    if opt.tied and step > untie_step(args):
        raise SystemExit(f"error: checkpoint at step {step} is past the untie step but still tied")
    return step

class RunCheckpoints(StopOnSignal):
    """train()'s --save_every checkpoints (the newest --keep_checkpoints kept) and, with them, its stop on
    SIGINT or SIGTERM: the run saves where it is, then exits (StopOnSignal)."""

    def __init__(self, args: Hyperparameters, dist_info: DistInfo, run_id: str, start_step: int, model: nn.Module,
                 opt: NorMuonAdam, loader: DocumentLoader, log: RunLog, blends: WeightBlends | None = None):
        super().__init__(bool(args.save_every), dist_info.world_size, dist_info.device)
        self.args, self.dist_info, self.start, self.total = args, dist_info, start_step, total_steps(args)
        self.state, self.blends, self.log = (model, opt, loader), blends, log
        self.run_dir = os.path.join(args.checkpoint_dir, run_id)

    def between_steps(self, step: int, flush) -> float:
        """Before step `step` (every rank): the previous step's stop requests shared, a checkpoint saved where
        due; on an agreed signal, flush() (the pending step's log line), a note, and SystemExit with the
        shell's status for the signal. Returns the seconds spent saving (not training time)."""
        import time
        args, dist_info, last = self.args, self.dist_info, step == self.total
        if step > self.start:
            self.share(step - 1)
        stopping = 0 if last else self.agreed(step)
        path, seconds = os.path.join(self.run_dir, f"step_{step:06d}"), 0.0
        if args.save_every and step > self.start and (step % args.save_every == 0 or last or stopping):
            cuda_synchronize(dist_info.device)
            t = time.perf_counter()
            save_checkpoint(path, step, *self.state, args, dist_info, self.blends)
            if args.keep_checkpoints and dist_info.is_master:
                prune_checkpoints(self.run_dir, args.keep_checkpoints)
            seconds = time.perf_counter() - t
        if stopping:
            flush()
            resume = path if step > self.start else args.resume  # nothing trained since the resume
            self.log.note(f"stopped by {signal.Signals(stopping).name} at step {step}: "
                          + (f"--resume {resume} continues the run" if resume else "nothing trained to save"))
            raise SystemExit(128 + stopping)
        return seconds

def generate(model: "GPT", prompt: str, new_tokens: int, device: torch.device, seed: int = 0) -> str:
    """Sample a continuation (top-k 40, temperature 0.8) with the offline GPT-2 tokenizer."""
    enc = gpt2_encoding()
    tokens = [BOS_ID] + enc.encode_ordinary(prompt)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(new_tokens):
            b = make_batch(np.asarray(tokens + [0], dtype=np.uint16), model.args.ngram_rows,
                           ngram_channels=model.args.ngram_channels).to(device)
            logits = bf16_logits(model, b.inputs, b.cu_seqlens, b.ngram_ids)[-1, :model.args.vocab_size].float().cpu()
            top = torch.topk(logits / 0.8, 40)
            tokens.append(int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)]))
    return enc.decode(tokens[1:])

# ---- train()'s last lines: compilation, the sample, peak memory -------------------------------------

def compile_counts() -> dict:
    """Graphs torch.compile has made and graph breaks it has met in this process so far."""
    from torch._dynamo.utils import counters
    return dict(graphs=int(counters["stats"]["unique_graphs"]),
                graph_breaks=int(sum(counters["graph_break"].values())))

def compile_report(before: dict) -> str:
    """train()'s log line on what the timed run compiled after the warm-up (before: compile_counts() then)."""
    after = compile_counts()
    return (f"torch.compile: {after['graphs'] - before['graphs']} graphs compiled during the timed run "
            f"(recompiles after the warm-up), {after['graph_breaks']} graph breaks")

def sample_after_training(model: GPT, args: Hyperparameters, device: torch.device) -> str:
    """--sample_tokens: a continuation of "ROMEO:\n", as train() prints it."""
    prompt = "ROMEO:\n"
    return (f"sample ({args.sample_tokens} tokens after {prompt!r}):\n"
            + generate(model, prompt, args.sample_tokens, device, seed=args.seed))

def peak_memory(device: torch.device) -> str:
    """train()'s last log line: the record's on a GPU, rank 0's max RSS on a CPU."""
    if device.type == "cuda":
        return (f"peak memory allocated: {torch.cuda.max_memory_allocated(device) // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved(device) // 2**20} MiB")
    import resource
    return f"peak memory (max RSS of rank 0): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB"

def _check_finite(what: str, values: tuple, step: int, log_path: str) -> None:
    for value in values:
        if not math.isfinite(value):
            raise SystemExit(f"error: {what} is {value} at step {step}; stopping (log: {log_path})")

def train(args: Hyperparameters, dist_info: DistInfo) -> float:
    """The whole run; returns the final validation loss."""
    import time
    import uuid
    run_id = [args.run_id or str(uuid.uuid4())]
    if dist.is_initialized():
        dist.broadcast_object_list(run_id, src=0)
    run_id = run_id[0]
    check_batch_split(args, dist_info.world_size)

    dtype, dtype_note = compute_dtype(args, dist_info)
    torch.manual_seed(args.seed)
    try:  # model and optimizer validate their configuration: a bad flag is one line, before any log
        model = GPT(args, dist_info.world_size, dtype=dtype).to(dist_info.device)
        opt = build_optimizer(args, model, dist_info.device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if dist.is_initialized():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    if args.fp8 and _native_fp8(dist_info.device):  # step 0's forward reads the e4m3 weights: quantised before the
        model.quantize_fp8(bootstrap=True)  # warm-up's snapshot, so that its reset brings them back too
    log = RunLog(args, run_id, dist_info, notes=[dtype_note] if dtype_note else [])
    loader = DocumentLoader(args.train_files, args.ngram_rows, dist_info.rank, dist_info.world_size, dist_info.device,
                            ngram_channels=args.ngram_channels, virtual_seq_cap=args.virtual_seq_cap)
    val_batches = validation_batches(args.val_files, args.val_tokens, min(args.val_seq_len, args.val_tokens),
                                     args.ngram_rows, dist_info.rank, dist_info.world_size, args.ngram_channels)
    encoding = gpt2_encoding()  # read before the clock; the prefix table built from it is timed (below)
    trainer = Trainer(args, dist_info, model, opt, loader)
    start_step = resume_step(args, dist_info, model, opt, loader, trainer.blends)  # 0 unless --resume
    total = trainer.total
    if args.compile:
        t = time.perf_counter()
        for note in trainer.warm_up(val_batches[:1], build_prefix_table(encoding, args.padded_vocab_size)):
            log.note(note)
        log.show(f"compile warm-up: {len(warmup_steps(args))} steps in {time.perf_counter() - t:.0f}s", final=True)

    compiled_before = compile_counts()  # what the timed run compiles on top of the warm-up: nothing, ideally
    cuda_synchronize(dist_info.device)
    train_ms, t0, val_loss = 0.0, time.perf_counter(), float("nan")
    # the record's order: the clock starts, then the prefix table is built, timed
    model.prefix_table.copy_(build_prefix_table(encoding, args.padded_vocab_size))
    pending = None  # (step, losses, train_ms, steps timed): losses are read a step late, the host never waits
    cumulative_tokens = schedule_tokens(args)

    def report(now: tuple | None = None) -> None:
        """The pending step's log line: train_loss, this rank's mean next-token loss per token (evaluation's
        measure, on the step's batch), and objective, the mean per token of the weighted loss trained on;
        given now = (steps done, train ms), the console's line too."""
        nonlocal pending
        if pending is None:
            return
        (step, losses, step_ms, timed), pending = pending, None
        train_loss, objective = losses.tolist()
        _check_finite("training loss", (objective, train_loss), step, log.path)
        log.write(f"step:{step + 1}/{total} train_time:{step_ms:.0f}ms step_avg:{step_ms / timed:.2f}ms "
                  f"train_loss:{train_loss:.4f} objective:{objective:.4f}")
        if now is not None:
            done, now_ms = now
            tokens = cumulative_tokens[done] - cumulative_tokens[start_step]
            log.show(f"step {step + 1}/{total}  train_loss {train_loss:.4f}  objective {objective:.4f}  "
                     f"{tokens / max(1e-9, now_ms / 1000):,.0f} tok/s  "
                     f"eta {eta_seconds(cumulative_tokens, start_step, done, now_ms):.0f}s")

    with RunCheckpoints(args, dist_info, run_id, start_step, model, opt, loader, log, trainer.blends) as checkpoints:
        for step in range(start_step, total + 1):
            last = step == total
            if last and trainer.blends is not None:
                log.write(trainer.blends.ship())  # on the clock, as record #92's
            if last or (args.val_loss_every and step % args.val_loss_every == 0):
                cuda_synchronize(dist_info.device)
                train_ms += 1000 * (time.perf_counter() - t0)
                report()
                val_loss = trainer.validate(step, val_batches)
                log.write(f"step:{step}/{total} val_loss:{val_loss:.4f} train_time:{train_ms:.0f}ms "
                          f"step_avg:{train_ms / max(1, step - start_step):.2f}ms")
                log.show(f"step {step}/{total}  val_loss {val_loss:.4f}  train_time {train_ms / 1000:.1f}s", final=True)
                _check_finite("validation loss", (val_loss,), step, log.path)
                cuda_synchronize(dist_info.device)
                t0 = time.perf_counter()
            t0 += checkpoints.between_steps(step, report)  # --save_every, signals; saving is not training time
            if last:
                break
            _, losses = trainer.step(step)
            now_ms = train_ms + 1000 * (time.perf_counter() - t0)
            report(now=(step + 1, now_ms))  # the previous step's: its kernels are done by now or nearly
            pending = (step, losses, now_ms, step + 1 - start_step)
    if args.compile:
        log.write(compile_report(compiled_before))
    log.write(peak_memory(dist_info.device))  # the record's line on GPUs
    if dist_info.is_master:
        print(f"final val_loss {val_loss:.4f}, train_time {train_ms / 1000:.1f}s, log {log.path}")
        if args.sample_tokens:
            print(sample_after_training(model, args, dist_info.device))
    return val_loss

# ---- One training step without a Trainer (tests, benchmarks, the GPU check) ----------------------

def train_step(compiled_model, opt: NorMuonAdam, batches: list[Batch], plan: StepPlan, mtp: torch.Tensor,
               prefix: torch.Tensor, grad_scale: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_backward, then the optimizer step, as Trainer.step runs them; forward_backward's losses."""
    loss, next_token = forward_backward(compiled_model, opt, batches, plan, mtp, prefix, grad_scale, device)
    opt.step(**optimizer_schedule(plan))
    return loss, next_token

# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def check_args(args: Hyperparameters, world_size: int) -> None:
    """Every flag and shard checked at start-up, before the process group, model, loader or log:
    a bad one stops the run with one line naming it (SystemExit), never a traceback from later on."""
    check_flags(args, world_size)
    check_batch_split(args, world_size)
    tokens = {"train": 0, "val": 0}
    for what in tokens:  # headers only (size and magic): the loaders read them after the log is open
        for path in find_shards(getattr(args, f"{what}_files"), what):
            try:
                tokens[what] += read_shard_header(path)
            except ShardError as e:
                raise SystemExit(f"error: {e}") from None
    if tokens["val"] < args.val_tokens + 1:  # validation_batches' own check, before the log
        raise SystemExit(f"error: --val_tokens {args.val_tokens} needs {args.val_tokens + 1} tokens but the val shards"
                         f" {args.val_files!r} hold {tokens['val']}; lower --val_tokens")

def check_flags(args: Hyperparameters, world_size: int) -> None:
    """check_args' checks of the flags alone (no shard is read)."""
    for f in dataclasses.fields(Hyperparameters):
        allowed, value = flag_range(f), getattr(args, f.name)
        if allowed and not allowed.allows(value):
            raise SystemExit(f"error: --{f.name} {value!r} must be {allowed}")
    for name, choices in (("matrix_optimizer", MATRIX_OPTIMIZERS), ("orthogonalizer", sorted(ORTHOGONALIZERS)),
                          ("cpu_dtype", ("auto", *CPU_DTYPES)), ("bank_ownership", OWNERSHIPS),
                          ("attention_kernel", ("auto", *GPU_ATTENTION_KERNELS)), ("ngram_optimizer", NGRAM_OPTIMIZERS),
                          ("yarn_chains", ("long", "own"))):
        if getattr(args, name) not in choices:
            raise SystemExit(f"error: --{name} {getattr(args, name)!r} is not one of {', '.join(choices)}")
    cadence = args.table_cadence
    if cadence and (len(cadence) != 3 or cadence[1] not in (2, 4, 6, 8) or cadence[2] != int(cadence[2])
                    or cadence[2] % 2 != 1 or cadence[2] >= cadence[1]):
        raise SystemExit(f"error: --table_cadence {cadence!r} must be (start, period, phase) with an even "
                         "period of at most 8 and an odd phase below it, e.g. (0.2862, 4, 3)")
    for start, P in args.sampled_softmax:
        if P != int(P) or P > args.padded_vocab_size or P and args.fp8:
            raise SystemExit(f"error: --sampled_softmax {args.sampled_softmax!r}: P must be an integer <= "
                             f"--padded_vocab_size, and the FP8 head trains on every class (add --fp8 false)")
    if args.val_tokens % min(args.val_seq_len, args.val_tokens):
        raise SystemExit(f"error: --val_tokens {args.val_tokens} must be a multiple of --val_seq_len {args.val_seq_len}")
    try:
        check_stages(args.stages)
        _check_model_args(args, world_size)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

# ---- --dry_run: what a run would train and hold per GPU, without training -----------------------

DRY_RUN_GPUS = (8, 4, 2, 1)

def dry_run_report(args: Hyperparameters) -> str:
    """The stage ends, the training softmax's classes by step, the parameters by label, and per GPU at
    DRY_RUN_GPUS the bytes of the weights (with buffers: FP8 copies, tables), their gradients and rank 0's
    optimizer state, from models and optimizers built on the meta device (shapes, no memory)."""
    lines = [f"steps: {total_steps(args)}; stage ends: {', '.join(map(str, stage_bounds(args)))}"]
    classes, last = [], None
    for step in range(total_steps(args)):
        if (P := plan_step(args, step).candidates) != last:
            classes.append(f"{P if P else f'all {args.padded_vocab_size}'} from step {step}")
            last = P
    lines.append("training softmax classes: " + ", ".join(classes))
    sizes = {}
    for gpus in DRY_RUN_GPUS:
        with torch.device("meta"):
            model = GPT(args, gpus)
            opt = build_optimizer(args, model, torch.device("meta"), comm=SimulatedComm(gpus))
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
        sizes[gpus] = (weights, grads, state)
        if gpus == 1:
            lines.append("parameters (banks padded to a multiple of the GPU count on more than one):")
            lines += [f"  {p.label:<16} {str(tuple(p.shape)):<22} {p.numel():>13,} {str(p.dtype)[6:]}"
                      for p in model.parameters()]
            lines.append(f"  {'total':<16} {'':<22} {sum(p.numel() for p in model.parameters()):>13,}")
    lines.append("GiB per GPU (activations not included: tests/benchmarks/step_budget.py):")
    lines.append("  GPUs  weights  gradients  optimizer  total")
    lines += [f"  {gpus:>4}  {w / 2**30:>7.2f}  {g / 2**30:>9.2f}  {o / 2**30:>9.2f}  {(w + g + o) / 2**30:>5.2f}"
              for gpus, (w, g, o) in sizes.items()]
    return "\n".join(lines)

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "--dry_run" in argv:
        check_flags(args, 1)
        print(dry_run_report(args))
        return
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    dist_info = setup_distributed()
    try:
        train(args, dist_info)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    main()
