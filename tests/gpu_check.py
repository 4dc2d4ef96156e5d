"""The GPU check: every CUDA path of train_gpt.py and triton_kernels.py on one CUDA GPU, then the
speedrun preset's step times and a short profile, written to records/gpu_check/<date>_<gpu>.md and
.json (tests/README.md, "GPU check").

    ./run.sh gpu-check --plan             # the next lease's commands (LEASE), each check's cap, their sums
    ./run.sh gpu-check --lease 1          # the lease's first command (then --lease 2 on the same machine)
    ./run.sh gpu-check                    # every group, one after the other
    ./run.sh gpu-check --group kernels    # one group (each fits in 9 minutes: a 10-minute GPU lease)
    ./run.sh gpu-check --dry-run          # list the groups, checks and the CUDA paths each covers
    ./run.sh gpu-check --only a,b         # some checks (a check run alone gets its whole time cap)

Groups: kernels (the Triton kernels, FP8 ops, flex attention), model (the compiled model against an
independent reference, the sync-free step), run (NCCL optimizer, the train script, the kernel choice
table), speedrun (step times of every stage, the profile), tune (tile configurations of the kernels that
dominate a step). Each check runs in a process of its own (a
CUDA error or a hang in one cannot take the others down), killed at its time cap (about twice its
measured cold time); a group stops starting checks at GROUP_LIMIT_S so that it ends within 9 minutes.
All checks share the inductor and Triton caches in .cache/, so a kernel compiled by one check, or by an
earlier run on the same machine, is not compiled again. A failing check is reported with its error and
its full traceback (in the report itself) and the rest still run; a run of some groups keeps the other
groups' results of the same day's report. Exit status: 0 when every check run passed, 1 otherwise, 2 for
bad usage or no CUDA GPU.

This file is the list of checks: the table CHECKS (name, time cap, what is compared against what
and within which tolerance, the CUDA paths covered, group), the lease plan LEASE (which checks each
command of a GPU lease runs, in lanes side by side, within LEASE_LIMITS_S), the references the checks
compare against (plain torch: none of the code they check), and one function per check,
check_<name with _>, in the table's order. A new check is one Check row and one function. The
runner and the report writer are in gpu_check_runner.py (its `main` is this file's command line, and
each check's process runs this file with --run-one); the coverage scan in gpu_check_coverage.py;
speedrun-default's recorder of train_gpt.py's own run in gpu_check_train.py.

Every check declares what it covers: the @triton.jit kernels ("kernel:"), the custom ops by their
registered names ("op:speedrun::"), and the public functions of train_gpt.py and triton_kernels.py
holding a CUDA-only branch ("cuda:<file>:"); a branch in a private helper counts for the public
functions, ops or kernels that reach it, and a function registered to an op (its fake, autograd or a
device's kernel) counts for the op, so no row names a private helper.
tests/test_gpu_check.py fails when a path is covered by no check.

Imports here are the standard library's only: the list, the coverage scan and the report writer
run on any Python; torch is imported by the checks themselves.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

# tests/ is on sys.path (run as a script it comes first); the runner puts the repository there too
from gpu_check_runner import (GPUS_PROJECTED, REPO, SHARD_DIR, TESTS, Check, LeaseCommand, Result, check_env,
                              last_error_line, main, mfu, project)

# ----------------------------------------------------------------------------------------------
# The checks: name, time cap, what each proves, what it covers
# ----------------------------------------------------------------------------------------------

K, OP = "kernel:", "op:speedrun::"
TK, TG = "cuda:triton_kernels.py:", "cuda:train_gpt.py:"

CHECKS: tuple[Check, ...] = (
    # -- kernels: every Triton kernel, the FP8 ops and flex attention against references ------------------
    Check("triton-symmetric", 40, "XXT, XTX, ba_plus_cAA kernels on the NorMuon banks (64x256x768, 24x768x768, "
          "24x3072x768) in bf16 and fp32 against float64; outputs bitwise symmetric; the public functions (which "
          "may take torch at a listed shape) and Polar Express on CUDA against the CPU path; the optimizer's "
          "compiled NorMuon update (inductor, fullgraph) with every product on the kernel, traced into its graph, "
          "against the same update eager with a float64 Polar Express of plain torch matmuls "
          "(polar_express_reference: no kernel) (the vo and mlp banks: XXT and XTX)",
          (K + "_sym_mm_kernel", TK + "XXT", TK + "XTX", TK + "ba_plus_cAA", TK + "gpu_name_of")),
    Check("triton-mlp", 60, "relu2_mlp forward and backward (49152 x 768 -> 3072) in bf16 and fp32 against float64",
          (K + "_mm_epilogue_kernel", K + "_grouped_tile", OP + "relu2_mlp_fwd", OP + "relu2_mlp_bwd",
           TK + "relu2_mlp")),
    Check("triton-cross-entropy", 35, "softcapped_ce_mtp (4096 x 50304, 3 MTP weights, the prefix term) loss and the "
          "record's gradient in bf16 and fp32 against the float64 reference and its CPU twin run on the GPU; the "
          "FP8 head's e5m2 gradient against the float64 gradient rounded to e5m2, saturating; the CPU head fused "
          "with its loss, run on the GPU, against the kernel through x @ w; then at the speedrun's micro-batches "
          "(16384 rows, bf16 gradient; 49152 rows, e5m2 gradient), 5 runs each, targets repeated across the MTP "
          "slots and the prefix: every target column's gradient (rewritten after the barrier) against a "
          "float64 loss and gradient of plain torch (ce_reference_rows), every run, and every run bitwise equal",
          (K + "_ce_mtp_kernel", K + "_tanh", K + "_round_to_bf16", K + "_softcap_sigma", OP + "softcapped_ce_mtp_fwd",
           OP + "softcapped_ce_mtp_rows", OP + "softcapped_ce_mtp_head_rows", TK + "softcapped_ce_mtp", TK + "softcapped_ce_mtp_e5m2",
           TK + "ce_kernel_args")),
    Check("loss-kernel", 40, "the loss kernel alone at 16384 and 49152 rows (bf16 and e5m2 gradient): its bytes per "
          "second against the GPU's peak memory bandwidth, and, from its own SASS (instructions and MUFU operations "
          "per logit in each pass over the row, registers, so programs per SM), the bound that stops it when below "
          "half the peak (tests/bench_kernels.py's loss_kernel_limits); then `tests/bench_kernels.py --only ce` "
          "itself in what time is left", ()),
    Check("triton-transpose", 30, "transpose_copy and transpose_add of the LM head (768 x 50304) in bf16 and fp32, "
          "and of float8 operands as bytes, exact",
          (K + "_transpose_kernel", OP + "transpose_copy", OP + "transpose_add", TK + "transpose_copy", TK + "transpose_add")),
    Check("fp8-up", 40, "relu2_fp8_up kernel (49152 x 768 -> 3072, e4m3): with fast accumulation (the record's) "
          "within the bound of a 13-bit running sum of the float64 result; with fp32 promotion within it too and "
          "at most half the fast error against the fp32 reference; the e4m3 copy and the amax, and the partial "
          "maxima the FP8 MLP reduces after all layers (their count, their max equal to the amax)",
          (K + "_fp8_relu2_kernel", TK + "fp8_up_kernel_args", TK + "relu2_fp8_up_partials",
           TK + "relu2_fp8_up_partial_count")),
    Check("fp8-head", 30, "fp8_head_loss (16384 x 768 x 50304, the head's scales) against float64 products of its "
          "dequantized e4m3 operands and torch's own cross-entropy in fp32 (reference_fp8_head_rows): loss, "
          "next-token loss, the e5m2 gradient (against the reference's rounded to e5m2), dx and dw (against float64 "
          "products of the reference's e5m2 gradient, and of its exact one); the plain fp8_mm op likewise",
          (OP + "fp8_mm", OP + "fp8_mm_backward", OP + "fp8_head_loss", OP + "fp8_head_loss_backward",
           TG + "fp8_matmul_grads")),
    Check("fp8-mlp", 25, "FP8MLPState.mlp / speedrun::fp8_mlp (16384 x 768 -> 3072, 3 layers: the third, its scales "
          "32 bytes into their buffers) forward and backward against float64 products of its dequantized operands "
          "(reference_fp8_mlp: post, post's e4m3 copy and y with the op's roundings; the bf16 backward from post "
          "in float64)",
          (OP + "fp8_mlp",)),
    Check("flex-attention", 35, "flex_attention forward and backward through the one compiled flex_attention, with "
          "the record's block masks (causal, window, documents, paired slots), against SDPA with the dense mask; "
          "no host sync in the eager call",
          (TG + "flex_attend", TG + "block_mask_indices")),
    Check("varlen-attention", 25, "torch's varlen_attn (varlen_attend, the record's FA3 call) forward and backward "
          "against fp32 SDPA with the dense mask, at 8,192 tokens: each layer kind (plain, paired slots) at stage "
          "1's and stage 3's windows, documents cut at 896 and 2,048 tokens, cu_seqlens padded with empty "
          "documents at the end as the loader pads them, and one document of every token", ()),
    Check("attention-kernels", 150, "per layer kind of the speedrun (plain short, plain long, paired short) at stage "
          "1's and stage 3's micro-batch (16,384 and 49,152 tokens, documents cut at 896 / 2,048): flex_attention "
          "with the loader's host-built block masks against torch's varlen_attn, forward + backward ms each, the "
          "faster per kind (the ATTENTION_KERNEL_CHOICE entry)",
          (TG + "attention_kernels",)),
    # -- model: the compiled model against an independent reference, the sync-free step -----------------
    Check("compiled-model", 350, "the speedrun model (FP8 on, near its init: loss near ln(vocab)) compiled whole "
          "(fullgraph, masks as inputs) against the eager model with fp32 SDPA, dense masks and the FP8 ops' "
          "bodies replaced by plain torch (reference_fp8_mlp, reference_fp8_head_loss): loss and every "
          "gradient; graphs compiled, graph breaks, no recompilation on a second batch",
          (TG + "GPT.forward", TG + "Batch.to"), "model"),
    Check("sync-free-step", 150, "training steps under torch.cuda.set_sync_debug_mode('error'): "
          "test_training_step_never_waits_for_the_gpu (eager), then compiled model and optimizer with FP8 "
          "re-quantisation and the loader's host-built flex masks in pinned staging buffers, with any "
          "recompilation an error",
          (TG + "hyperparam_tensors", TG + "adam_update_group_sliced", TG + "build_optimizer", TG + "copy_from_host_",
           TG + "batch_request", TG + "DocumentLoader.__init__", TG + "stage_batch"), "model"),
    Check("cuda-graphs", 300, "the speedrun model compiled, steps 0, 1 (stage 1) and 423, 424 (stage 2) from one state "
          "through train_step and through StepGraphs (each key captured on its first step and checked against "
          "the uncaptured step): losses and parameters the same (bitwise where two uncaptured runs are); ms/step "
          "both ways at both stages",
          (TG + "use_cuda_graphs", TG + "StepGraphs.__init__", TG + "StepGraphs.step", TG + "stage_step"), "model"),
    # -- run: the script end to end, NCCL, the kernel choice table ------------------------------------
    Check("speedrun-default", 480, "torchrun train_gpt.py with the speedrun preset's defaults (CUDA graphs, compile, "
          "FP8, --attention_kernel auto) on this GPU, stages cut to 3 steps each and the extension to 2 "
          "(DEFAULT_RUN_FLAGS; tinyshakespeare), then the same steps with --cuda_graphs false --compile false: "
          "the graphs captured in the warm-up, the run learns, compiles nothing after its warm-up; each step's "
          "losses and every parameter after it (sampled; all of them after the last) against the eager run's "
          "within DEFAULT_RUN_BOUNDS, and against the warm-up's own run of the same steps; ms per step on the "
          "device and one stage-1 step's host dispatches under the profiler, both runs "
          "(tests/gpu_check_train.py records them)",
          (TG + "train", TG + "hardware_line", TG + "peak_memory", TG + "cuda_synchronize", TG + "compute_dtype",
           TG + "use_cuda_graphs", TG + "StepGraphs.__init__", TG + "StepGraphs.step", TG + "stage_step",
           TG + "Trainer.__init__", TG + "batch_request", TG + "DocumentLoader.__init__", TG + "stage_batch",
           TG + "GPT.forward", TG + "Batch.to"), "run"),
    Check("normuon-nccl", 60, "NorMuonAdam on a single-rank NCCL group (and 2 ranks where 2 GPUs exist) "
          "against the single-process result; on that group, StopOnSignal's step-late read of the combined "
          "stop requests returns while the previous step's work is still queued, and sees a request a step later",
          (TG + "setup_distributed", TG + "ShardExchange.declare_rows", TG + "ShardExchange.scatter",
           TG + "StopOnSignal.__init__"), "run"),
    Check("train-script", 240, "train_gpt.py --preset test --compile true through torchrun on this GPU (FP8, NCCL, "
          "compile warm-up, run log): learns, and compiles nothing after the warm-up",
          (TG + "train", TG + "hardware_line", TG + "peak_memory", TG + "cuda_synchronize", TG + "compute_dtype"),
          "run"),
    Check("kernel-choice", 120, "Triton against torch at every bank shape (triton_kernels.KERNEL_TIMES) and "
          "Polar Express against Gram Newton-Schulz per bank (ORTHOGONALIZER_MS): this GPU's tables' picks within "
          "10% of the faster", (), "run"),
    # -- speedrun: the preset's step times, rank 0 of 8, a profile ------------------------------------
    Check("rank8-warmup", 250, "compiles and captures rank 0 of 8's step (the model's banks padded for 8 ranks, rank "
          "0's optimizer shards: step_timing --as_rank_of 8) for every stage, 2 steps each, into the shared "
          "caches, so that speedrun-timing finds them compiled (its steps run beside other checks: no timings)",
          (), "speedrun"),
    Check("speedrun-timing", 180, "the speedrun preset on generated shards, through the step train() runs "
          "(Trainer.step: CUDA graphs captured in the warm-up steps), its graphs compiled by speedrun-default and "
          "rank8-warmup: first this GPU as rank 0 of 8 (step_timing --as_rank_of 8), 2 warm-up + 2 timed steps per "
          "stage, its ms/step, bytes sent and the 8-GPU projection from them; then one GPU (accumulation 8), 2 "
          "warm-up + 4 timed steps per stage: compile time, recompiles, ms/step, tokens/s, MFU, peak memory, "
          "projections", (TG + "Trainer.__init__",), "speedrun"),
    Check("speedrun-profile", 150, "2 stage-1 steps of the speedrun preset (one GPU, accumulation 8) under "
          "torch.profiler after 2 warm-up + 2 timed steps: GPU busy fraction, top kernels, host ops and where the "
          "host's time goes", (), "speedrun"),
    # -- tune: tile configurations of the kernels that dominate a step -----------------------------------
    Check("kernel-tuning", 400, "the loss kernel, the dpre epilogue, the bf16 relu2 forward and the FP8 up-projection "
          "at 16,384 and 49,152 tokens under every tile configuration of MM_SWEEP / CE_SWEEP: committed against the "
          "best (within 10%), every timing for updating the config functions",
          (K + "_tanh_approx", OP + "relu2_mlp_fwd", OP + "softcapped_ce_mtp_fwd", TK + "fp8_up_kernel_args"), "tune"),
)

# The next GPU lease (records/gpu_check/README.md, "Next lease"): `./run.sh gpu-check --plan` prints it and
# checks it against LEASE_LIMITS_S, `./run.sh gpu-check --lease N` runs its command N. A command's lanes run
# side by side (lane 0 the main one), each lane's checks one after another; every cap above is cut to what is
# left of the command's budget. Command 1 first answers whether the default speedrun trains (speedrun-default,
# its whole budget: the compiled run, then the eager one); beside it, the loss kernel's bandwidth while the GPU
# is still idle (the first minute of speedrun-default compiles on the host), rank 0 of 8's step compiled
# while the compiled run compiles its own (two compiled steps' memory: about 60 GB at stage 3), then the
# pieces no GPU has run yet while the eager run runs (its memory and one check's). Command 2 times the
# stages with those compiled graphs (inductor's and Triton's caches in .cache/).
LEASE_LIMITS_S = (480.0, 180.0)  # one command of at most 8 minutes, one of at most 3: 11 minutes in all
LEASE = (
    LeaseCommand(480, (("speedrun-default",),
                       ("loss-kernel", "rank8-warmup", "triton-cross-entropy", "fp8-head", "fp8-mlp", "triton-symmetric",
                        "flex-attention", "varlen-attention")),
                 note="does the default speedrun train; beside it, what no GPU has run yet"),
    LeaseCommand(180, (("speedrun-timing",),), note="rank 0 of 8's stages and the projection, then one GPU's stages"),
)


def check_function(check: Check):
    return globals()[check.fn or "check_" + check.name.replace("-", "_")]



# ----------------------------------------------------------------------------------------------
# Helpers shared by the checks
# ----------------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in float64; inf when got has a NaN or inf."""
    import torch
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _gen(seed: int):
    import torch
    return torch.Generator(device="cuda").manual_seed(seed)


# Tolerances, relative Frobenius error against float64 (METHOD: bf16 operands land between 1e-3 and
# 1e-2, fp32 far under 1e-3).
TOL = {"bf16": 1e-2, "fp32": 1e-4}


def _dtypes():
    import torch
    return (("bf16", torch.bfloat16), ("fp32", torch.float32))



# ----------------------------------------------------------------------------------------------
# References: plain torch, none of the code they check (no Triton kernel, no custom op body, no
# torch._scaled_mm); tests/test_gpu_check.py runs each on CPU tensors against the CPU paths
# ----------------------------------------------------------------------------------------------

E5M2_MAX = 57344.0  # largest finite float8_e5m2


def ce_reference_rows(logits, targets, mtp_weights, prefix_ids=None, prefix_weight=None, grad_scale: float = 1.0,
                      rows: int = 2048, dtype=None):
    """The loss kernel's specification (triton_kernels, "Softcapped cross-entropy") in plain torch, `rows`
    rows of logits (T, V) at a time, in float64 by default: yields (row slice, loss (R,), next-token loss
    (R,), dlogits (R, V)), with sigma = bf16(sigmoid((l + 5) / 7.5)), z = 23 sigma, loss = sum over
    the MTP targets t + k < T of w_k (lse(z) - z[target]) + pi (lse(z) - z[prefix]) where the prefix id
    is >= 0, and dlogits = grad_scale (S p - the weights whose target is the column) 23/7.5 sigma (1 - sigma),
    S = every MTP weight (also past the end) + pi where the prefix is valid."""
    import torch
    dtype = dtype or torch.float64
    T = logits.shape[0]
    dev = logits.device
    w = mtp_weights.to(dtype)
    for a in range(0, T, rows):
        b = min(T, a + rows)
        n = b - a
        r = torch.arange(n, device=dev)
        sigma = torch.sigmoid((logits[a:b].to(dtype) + 5.0) / 7.5).to(torch.bfloat16).to(dtype)
        z = 23.0 * sigma
        lse = torch.logsumexp(z, dim=1)
        loss = torch.zeros(n, dtype=dtype, device=dev)
        hits = torch.zeros_like(z)  # the one-hot terms: the weights of the targets naming each column
        S = w.sum().expand(n).clone()
        for k in range(w.numel()):
            ok = a + r + k < T
            col = targets[(a + r + k).clamp(max=T - 1)].long()
            loss += torch.where(ok, w[k] * (lse - z[r, col]), 0.0)
            hits.index_put_((r[ok], col[ok]), w[k].expand(int(ok.sum())), accumulate=True)
        if prefix_ids is not None:
            pid = prefix_ids[a:b].long()
            ok, col, pi = pid >= 0, pid.clamp(min=0), prefix_weight.to(dtype)
            loss += torch.where(ok, pi * (lse - z[r, col]), 0.0)
            hits.index_put_((r[ok], col[ok]), pi.expand(int(ok.sum())), accumulate=True)
            S = S + torch.where(ok, pi, 0.0)
        p = torch.exp(z - lse[:, None])
        grad = grad_scale * (S[:, None] * p - hits) * ((23.0 / 7.5) * sigma * (1.0 - sigma))
        yield slice(a, b), loss, lse - z[r, targets[a:b].long()], grad


def target_entries(targets, prefix_ids, K: int):
    """(rows, columns) of every target of the loss: row t's MTP targets targets[t + k] (t + k < T, k < K)
    and its prefix id where >= 0. These are the columns the loss kernel writes again after its barrier."""
    import torch
    T = targets.numel()
    t = torch.arange(T, device=targets.device)
    rows, cols = [], []
    for k in range(K):
        ok = t + k < T
        rows.append(t[ok])
        cols.append(targets[(t + k)[ok]].long())
    if prefix_ids is not None:
        ok = prefix_ids >= 0
        rows.append(t[ok])
        cols.append(prefix_ids[ok].long())
    return torch.cat(rows), torch.cat(cols)


def softcapped_mtp_ce_torch(logits, targets, mtp_weights, prefix_ids=None, prefix_weight=None, first_row: int = 0):
    """The training loss of rows first_row.. of a sequence (targets (T,), prefix_ids (T,)) from their
    logits (R, V) through torch's own F.cross_entropy in fp32, on z = 23 sigma, sigma = sigmoid((l + 5) /
    7.5) rounded to bf16 and differentiated as the record does (sigma (1 - sigma) / 7.5 of the rounded
    sigma): (loss (R,), next-token loss (R,), objective (R,)). objective adds w_k lse(z) for the MTP
    targets past the sequence's end: its gradient is the record's (every MTP weight in S_t); backward
    through objective, report loss."""
    import torch
    import torch.nn.functional as F
    R, T = logits.shape[0], targets.numel()
    l = logits.float()
    s = torch.sigmoid((l.detach() + 5.0) / 7.5).bfloat16().float()
    z = 23.0 * (s + (l - l.detach()) * (s * (1.0 - s) / 7.5))
    rows = first_row + torch.arange(R, device=logits.device)
    loss = torch.zeros(R, device=logits.device)
    extra = torch.zeros(R, device=logits.device)
    lse = None
    for k, w in enumerate(mtp_weights.float()):
        ok = rows + k < T
        ce = F.cross_entropy(z, targets[(rows + k).clamp(max=T - 1)].long(), reduction="none")
        loss = loss + torch.where(ok, w * ce, 0.0)
        if not bool(ok.all()):
            lse = torch.logsumexp(z, dim=1) if lse is None else lse
            extra = extra + torch.where(ok, 0.0, w * lse)
    if prefix_ids is not None:
        pid = prefix_ids[rows].long()
        ce = F.cross_entropy(z, pid.clamp(min=0), reduction="none")
        loss = loss + torch.where(pid >= 0, prefix_weight.float() * ce, 0.0)
    next_token = F.cross_entropy(z.detach(), targets[rows].long(), reduction="none")
    return loss, next_token, loss + extra


def bf16_values(t):
    """t's values rounded to bf16, its dtype kept, the gradient passed through unchanged."""
    return t + (t.bfloat16().to(t.dtype) - t).detach()


def _e5m2_gradient():
    import torch

    class E5M2Gradient(torch.autograd.Function):
        """Identity forward; backward rounds the incoming gradient g to e5m2 as g / grad_s, saturating at
        +-57344, and returns it times grad_s: the FP8 head's gradient operand, in plain torch."""

        @staticmethod
        def forward(ctx, t, grad_s):
            ctx.grad_s = grad_s
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            q = (g.double() / ctx.grad_s).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)
            return q.to(g.dtype) * ctx.grad_s, None
    return E5M2Gradient


def dequantized_logits(x, w, x_f8, w_f8, x_s: float, w_s: float, grad_s: float | None = None):
    """The FP8 head's logits as float64 products of its dequantized operands (x_f8 (T, D) * x_s, w_f8 (D, V)
    * w_s), rounded to bf16 values (the op's output), dtype float64; gradients reach x and w as the op
    sends them (dx from w's e4m3 copy, dw from x's), the incoming one rounded to e5m2 first (grad_s given)."""
    xd, wd = x_f8.double() * x_s, w_f8.double() * w_s
    xs = x.double() + (xd - x.double()).detach()
    ws = w.double() + (wd - w.double()).detach()
    logits = xs @ ws
    if grad_s is not None:
        logits = _e5m2_gradient().apply(logits, grad_s)
    return bf16_values(logits)


def reference_fp8_head_loss(x, w, x_f8, w_f8, targets, mtp_weights, prefix_ids, prefix_weight, x_s, w_s, grad_s,
                            grad_scale):
    """speedrun::fp8_head_loss's signature and outputs in plain torch (no kernel, no _scaled_mm):
    (loss (T,), next-token loss (T,), an empty tensor for the e5m2 gradient); differentiable in x and w,
    with the op's gradient rule (the record's, e5m2 operand) for sum(loss) * grad_scale."""
    import torch
    logits = dequantized_logits(x, w, x_f8, w_f8, x_s, w_s, grad_s)
    loss, next_token, objective = softcapped_mtp_ce_torch(logits, targets, mtp_weights, prefix_ids, prefix_weight)
    return objective - (objective - loss).detach(), next_token, torch.empty(0, device=x.device)


def reference_fp8_head_rows(x_f8, w_f8, x_s: float, w_s: float, targets, mtp_weights, prefix_ids, prefix_weight,
                            grad_scale: float, rows: int = 2048):
    """reference_fp8_head_loss a block of rows at a time, without x and w: yields (row slice, loss,
    next-token loss, dlogits (R, V) fp32 of sum(loss) * grad_scale by the record's rule, float64
    dequantized x rows (R, D)); the caller forms dx and dw from dlogits (the check: float64 products)."""
    import torch
    wd = w_f8.double() * w_s
    for a in range(0, x_f8.shape[0], rows):
        b = min(x_f8.shape[0], a + rows)
        xd = x_f8[a:b].double() * x_s
        logits = bf16_values(xd @ wd).float().requires_grad_()
        loss, next_token, objective = softcapped_mtp_ce_torch(logits, targets, mtp_weights, prefix_ids, prefix_weight,
                                                              first_row=a)
        (objective.sum() * grad_scale).backward()
        yield slice(a, b), loss.detach(), next_token, logits.grad, xd


def fp8_mlp_reference_forward(x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale):
    """speedrun::fp8_mlp's forward from its operands in float64: pre = (x_f8 @ up_f8^T) * up_dequant rounded
    to bf16, post = relu(pre)^2 rounded to bf16, post's e4m3 copy min(post / act_scale, 448), y = post_f8 @
    down_f8_t^T * act_scale * down_scale (float64). Returns (pre float64 before its rounding, post, y)."""
    import torch
    pre = (x_f8.double() @ up_f8.double().mT) * up_dequant.double()
    r = torch.relu(pre.bfloat16().double())
    post = (r * r).bfloat16()  # r * r exact in float64, rounded once
    post_f8 = (post.double() / act_scale.double()).clamp(max=448.0).to(torch.float8_e4m3fn)
    y = (post_f8.double() @ down_f8_t.double().mT) * (act_scale.double() * down_scale.double())
    return pre, post, y


def mlp_backward_reference(dy, x, w_up, w_down, post):
    """The FP8 MLP's backward (bf16 from post: triton_kernels.relu2_mlp_backward's rule) in float64:
    dpre = (dy @ w_down^T) * 2 sqrt(post), dx = dpre @ w_up, dw_up = dpre^T @ x, dw_down = post^T @ dy."""
    dy64, p64 = dy.double(), post.double()
    dpre = (dy64 @ w_down.double().mT) * (2.0 * p64.sqrt())
    return dpre @ w_up.double(), dpre.mT @ x.double(), p64.mT @ dy64


def _reference_mlp_function():
    import torch

    class ReferenceFP8MLP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w_up, w_down, x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale):
            _, post, y = fp8_mlp_reference_forward(x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale)
            ctx.save_for_backward(x, w_up, w_down, post)
            ctx.mark_non_differentiable(post)
            return y.to(x.dtype), post, post.float().amax().reshape(1)

        @staticmethod
        def backward(ctx, dy, _dpost, _dmax):
            x, w_up, w_down, post = ctx.saved_tensors
            dx, dw_up, dw_down = mlp_backward_reference(dy, x, w_up, w_down, post)
            return dx.to(x.dtype), dw_up.to(w_up.dtype), dw_down.to(w_down.dtype), *(None,) * 6
    return ReferenceFP8MLP


def reference_fp8_mlp(x, w_up, w_down, x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale, fast_accum=True):
    """speedrun::fp8_mlp's signature and outputs (y, post, post's maximum as one partial) in plain torch:
    fp8_mlp_reference_forward, and mlp_backward_reference as its backward."""
    return _reference_mlp_function().apply(x, w_up, w_down, x_f8, up_f8, up_dequant, down_f8_t, down_scale, act_scale)


def polar_express_reference(G, coeffs):
    """Polar Express (train_gpt.polar_express's iteration) in float64 with torch's matmuls: X = G / (||G||_F
    * 1.02 + 1e-6), then per (a, b, c): A = X X^T (wide) or X^T X (tall), X = a X + (b A + c A^2) X (or X (...)).
    Returns fp32 with G's shape."""
    X = G.reshape(-1, *G.shape[-2:]).double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    wide = X.shape[-2] <= X.shape[-1]
    for a, b, c in coeffs:
        A = X @ X.mT if wide else X.mT @ X
        B = b * A + c * (A @ A)
        X = a * X + (B @ X if wide else X @ B)
    return X.reshape(G.shape).float()


class reference_fp8_ops:
    """Within the block, train_gpt's two FP8 custom ops, as the model calls them (FP8MLPState.mlp calls
    train_gpt.fp8_mlp, fp8_head calls train_gpt.fp8_head_loss), are their plain-torch references
    (reference_fp8_mlp, reference_fp8_head_loss): the model's own code around them, none of their bodies."""

    def __enter__(self):
        import train_gpt as T
        self.saved = (T.fp8_mlp, T.fp8_head_loss)
        T.fp8_mlp, T.fp8_head_loss = reference_fp8_mlp, reference_fp8_head_loss
        return self

    def __exit__(self, *exc):
        import train_gpt as T
        T.fp8_mlp, T.fp8_head_loss = self.saved


# ----------------------------------------------------------------------------------------------
# The checks (each runs in its own process, on cuda:0)
# ----------------------------------------------------------------------------------------------

def check_triton_symmetric(res: Result) -> None:
    import torch
    import train_gpt as T
    import triton_kernels as tk
    worst = {}
    banks = {"qk": (64, 256, 768), "vo": (24, 768, 768), "mlp": (24, 3072, 768)}  # the banks on one GPU
    for dname, dtype in _dtypes():
        g = _gen(0)
        for bank, shape in banks.items():
            A = (torch.randn(shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(dtype)
            left = shape[1] <= shape[2]
            n = shape[1] if left else shape[2]
            A64 = A.double()
            ref = A64 @ A64.mT if left else A64.mT @ A64
            name = "XXT" if left else "XTX"
            for how, fn in (("kernel", getattr(tk, name + "_triton")), ("public", getattr(tk, name))):
                out = torch.full((shape[0], n, n), float("nan"), device="cuda", dtype=dtype)
                fn(A, out)
                e = rel_err(out, ref)
                require(e < TOL[dname], f"{name} {how} {bank} {dname}: relative error {e:.2e}")
                if how == "kernel":
                    require(torch.equal(out, out.mT), f"{name} {bank} {dname}: not bitwise symmetric")
                worst[f"{name.lower()}_{how}_{bank}_{dname}"] = e
            S = (out.double() / out.double().norm(dim=(-2, -1), keepdim=True) * 4).to(dtype)  # symmetric input
            S = (S + S.mT) / 2
            S64 = S.double()
            for how, fn in (("kernel", tk.ba_plus_cAA_triton), ("public", tk.ba_plus_cAA)):
                out2 = torch.full_like(S, float("nan"))
                fn(S, -2.7, 3.9, out2)
                e = rel_err(out2, -2.7 * S64 @ S64 + 3.9 * S64)
                require(e < TOL[dname], f"ba_plus_cAA {how} {bank} {dname}: relative error {e:.2e}")
                if how == "kernel":
                    require(torch.equal(out2, out2.mT), f"ba_plus_cAA {bank} {dname}: not bitwise symmetric")
                worst[f"aa_{how}_{bank}_{dname}"] = e
    # Polar Express and auto end to end: the GPU path (kernels or torch per shape) against the CPU's bmm path
    g = _gen(1)
    for bank, shape in banks.items():
        G = torch.randn((4, *shape[1:]), device="cuda", generator=g)
        for name, fn in (("polar_express", T.polar_express), ("auto", T.orthogonalize_auto)):
            e = rel_err(fn(G), fn(G.cpu()).cuda())
            require(e < 5e-2, f"{name} {bank}: CUDA vs CPU relative difference {e:.2e}")  # 5 bf16 iterations
            worst[f"{name}_{bank}"] = e
    # The compiled update as the optimizer runs it, every product on the kernel: the launches traced into
    # one graph (a graph break is an error), against the same update eager with a float64 Polar Express
    # of torch's matmuls (polar_express_reference: no kernel on that side)
    import triton.testing
    compiled_ms = {}
    normuon = T.update_functions(compile=True)["normuon"]
    hp = torch.tensor([0.02, 0.0, 0.95, 0.95, 0.0], device="cuda")

    def reference(G):
        return polar_express_reference(G, T.POLAR_EXPRESS_COEFFS)

    saved, tk.USE_KERNEL_TABLE = tk.USE_KERNEL_TABLE, False
    try:
        for bank, (k, rows, cols) in (("vo", banks["vo"]), ("mlp", banks["mlp"])):  # XXT, XTX: 2 compiles
            side = (k, 1, cols) if rows < cols else (k, rows, 1)
            state = [torch.randn(k, rows, cols, device="cuda", generator=g), torch.zeros(k, rows, cols, device="cuda"),
                     torch.zeros(side, device="cuda"),
                     torch.randn(k, rows, cols, device="cuda", generator=g)]  # an fp32 parameter: the update exact
            runs = {}
            for how, fn, ortho in (("eager", T._normuon_update, reference), ("compiled", normuon, T.polar_express)):
                grad, buf, sm, p = (t.clone() for t in state)
                fn(grad, buf, sm, p, None, torch.ones(k, 1, 1, device="cuda"), hp, ortho)
                runs[how] = p
            e = rel_err(runs["compiled"] - state[3], runs["eager"] - state[3])
            compiled_ms[bank] = triton.testing.do_bench(
                lambda: normuon(*state, None, torch.ones(k, 1, 1, device="cuda"), hp, T.polar_express), warmup=10, rep=50)
            require(e < 5e-2, f"compiled NorMuon update, {bank} bank: the update differs from the float64 "
                    f"reference's by {e:.2e}")
            worst[f"compiled_update_{bank}"] = e
    finally:
        tk.USE_KERNEL_TABLE = saved
    res.set(errors=worst, compiled_update_ms=compiled_ms,
            summary=f"worst relative error bf16 {max(v for k, v in worst.items() if 'bf16' in k):.1e}, "
            f"fp32 {max(v for k, v in worst.items() if 'fp32' in k):.1e}; Polar Express / auto CUDA vs CPU "
            f"{max(v for k, v in worst.items() if 'polar' in k or 'auto' in k):.1e}; compiled update (kernels "
            f"traced) vs float64 reference {max(v for k, v in worst.items() if 'compiled' in k):.1e}")


def check_triton_mlp(res: Result) -> None:
    import torch
    import triton_kernels as tk
    T_, D, H = 49152, 768, 3072  # stage 3's tokens per micro-batch on one GPU
    errs = {}
    for dname, dtype in _dtypes():
        g = _gen(2)
        x = torch.nn.functional.rms_norm(torch.randn(T_, D, device="cuda", generator=g), (D,)).to(dtype)
        w_up = ((torch.rand(H, D, device="cuda", generator=g) * 2 - 1) * (3 / D) ** 0.5 * 0.5).to(dtype)
        w_down = (0.05 * torch.randn(H, D, device="cuda", generator=g)).to(dtype)
        dy = torch.randn(T_, D, device="cuda", generator=g).to(dtype)
        ins = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
        y = tk.relu2_mlp(*ins)
        y.backward(dy)
        ref_ins = [t.double().requires_grad_() for t in (x, w_up, w_down)]
        y64 = tk.relu2_mlp_reference(*ref_ins)
        y64.backward(dy.double())
        for what, got, want in (("y", y, y64), ("dx", ins[0].grad, ref_ins[0].grad),
                                ("dw_up", ins[1].grad, ref_ins[1].grad), ("dw_down", ins[2].grad, ref_ins[2].grad)):
            e = rel_err(got, want)
            errs[f"{what}_{dname}"] = e
            require(e < TOL[dname], f"relu2_mlp {what} {dname}: relative error {e:.2e}")
        del ins, ref_ins, y, y64
    res.set(errors=errs, summary=f"worst relative error bf16 {max(v for k, v in errs.items() if 'bf16' in k):.1e}, "
            f"fp32 {max(v for k, v in errs.items() if 'fp32' in k):.1e}")


CE_RUNS = 5  # runs of the loss kernel per speedrun shape: an ordering bug between its threads can be intermittent
CE_SHAPES = ((16384, "bf16"), (49152, "e5m2"))  # stage 1's micro-batch (bf16 head), stage 3's (the FP8 head's form)


def ce_targets(T_: int, V: int, g):
    """Targets and prefix ids for the loss kernel's target columns: random, with a tenth of the rows' next
    MTP target equal to their own (the same column in two slots), a tenth of the prefix ids equal to the
    row's target, four tenths without a prefix (-1)."""
    import torch
    dev = g.device
    targets = torch.randint(0, min(V, 50257), (T_,), device=dev, generator=g)
    same = torch.rand(T_ - 1, device=dev, generator=g) < 0.1
    targets[1:] = torch.where(same, targets[:-1], targets[1:])
    prefix = torch.randint(0, min(V, 50257), (T_,), device=dev, generator=g)
    u = torch.rand(T_, device=dev, generator=g)
    prefix = torch.where(u < 0.1, targets, torch.where(u < 0.5, -1, prefix))
    return targets, prefix


def ce_target_runs(T_: int, V: int, form: str, runs: int, g, kernel: bool | None = None, corrupt=None) -> dict:
    """The loss kernel (kernel=False: its CPU twin) on (T_, V) bf16 logits, `runs` times, with a bf16 gradient
    (form "bf16", softcapped_ce_mtp) or the FP8 head's e5m2 one ("e5m2"), against ce_reference_rows (float64,
    plain torch): the loss, the next-token loss and the whole gradient once, every target column's gradient
    (target_entries: written again after the kernel's barrier) in every run, and every run's gradient
    bitwise against the first's. corrupt(run, gradient) may change a run's gradient (tests). Returns the
    figures: target_off (per run, columns off), unequal_runs, loss, next_token, gradient_error, differ."""
    import torch
    import triton_kernels as tk
    dev = g.device
    w = torch.tensor([1.0, 0.5, 0.25], device=dev)
    pi = torch.tensor(0.25, device=dev)
    logits = torch.randn(T_, V, device=dev, generator=g, dtype=torch.bfloat16).mul_(3)
    targets, prefix = ce_targets(T_, V, g)
    grad_scale = 1 / 8
    grad_s = grad_scale * 0.75 / 448

    def run(i):  # (loss, next-token loss, gradient as the kernel stores it)
        if form == "e5m2":
            out = tk.softcapped_ce_mtp_e5m2(logits, targets, w, prefix, pi, grad_scale, grad_s, kernel=kernel)
        else:
            x = logits.clone().requires_grad_()
            loss, next_token = tk.softcapped_ce_mtp(x, targets, w, prefix, pi, grad_scale=grad_scale, next_token=True,
                                                    kernel=kernel)
            loss.sum().backward()
            out = (loss.detach(), next_token, x.grad)
        if corrupt is not None:
            corrupt(i, out[2])
        return out

    rows, cols = target_entries(targets, prefix, w.numel())
    first = run(0)
    ref_loss, ref_next, full = [], [], {"differ": 0, "err2": 0.0, "ref2": 0.0}
    want_cols = torch.empty(rows.numel(), dtype=torch.float64, device=dev)
    for sl, l64, n64, g64 in ce_reference_rows(logits, targets, w, prefix, pi, grad_scale):
        ref_loss.append(l64)
        ref_next.append(n64)
        got = first[2][sl].float().double()
        want = g64 if form == "bf16" else (g64 / grad_s).clamp(-E5M2_MAX, E5M2_MAX)
        if form == "e5m2":  # the reference's gradient rounded to e5m2, as the kernel stores its own
            full["differ"] += int((got != want.to(torch.float8_e5m2).double()).sum())
        full["err2"] += float(((got - want) ** 2).sum())
        full["ref2"] += float((want ** 2).sum())
        in_block = (rows >= sl.start) & (rows < sl.stop)
        want_cols[in_block] = want[rows[in_block] - sl.start, cols[in_block]]
        del g64, got, want
    f = dict(rows=T_, gradient=form, runs=runs, targets=int(rows.numel()),
             loss=rel_err(first[0], torch.cat(ref_loss)), next_token=rel_err(first[1], torch.cat(ref_next)),
             gradient_error=(full["err2"] / full["ref2"]) ** 0.5,
             differ=full["differ"] / (T_ * V) if form == "e5m2" else None, target_off=[], unequal_runs=0)
    # a target column: within 5% (bf16: its rounding, the kernel's tanh against torch's sigmoid) or one e5m2
    # step (25%) of the reference; without its one-hot term it is off by the column's whole weight
    tol = (0.05 if form == "bf16" else 0.25) * want_cols.abs() + (1e-6 if form == "bf16" else 1e-6 / grad_s)
    for i in range(runs):
        out = first if i == 0 else run(i)
        grad = out[2]  # float8 indexed as its bytes
        got_cols = (grad.view(torch.uint8)[rows, cols].view(grad.dtype) if grad.element_size() == 1
                    else grad[rows, cols]).float().double()
        f["target_off"].append(int(((got_cols - want_cols).abs() > tol).sum()))
        if i and not torch.equal(out[2].view(torch.uint8), first[2].view(torch.uint8)):
            f["unequal_runs"] += 1
        del out
    return f


def ce_target_summary(key: str, f: dict) -> str:
    return (f"{key}: {f['targets']:,} target columns x {f['runs']} runs, {sum(f['target_off'])} off, "
            f"{f['unequal_runs']} runs not bitwise equal to the first, loss {f['loss']:.1e}, gradient "
            f"{f['gradient_error']:.1e}" + (f", {100 * f['differ']:.3f}% of e5m2 values off" if f["differ"] is not None else ""))


def _ce_float64_checks(res: Result) -> dict:
    """triton-cross-entropy's first part (4,096 rows): the kernel against the float64 autograd reference,
    its CPU twin and the fused CPU head, both dtypes, and the e5m2 gradient, saturating."""
    import torch
    import triton_kernels as tk
    V = 50304
    T_ = 4096  # the float64 autograd reference: 8 (T, V) float64 tensors
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    pi = torch.tensor(0.25, device="cuda")
    errs = {}
    for dname, dtype in _dtypes():
        g = _gen(3)
        logits = (3 * torch.randn(T_, V, device="cuda", generator=g)).to(dtype)
        targets = torch.randint(0, min(V, 50257), (T_,), device="cuda", generator=g)
        prefix = torch.randint(-1, min(V, 50257), (T_,), device="cuda", generator=g)  # -1: no prefix token
        x = logits.clone().requires_grad_()
        loss = tk.softcapped_ce_mtp(x, targets, w, prefix, pi, grad_scale=0.5)
        loss.sum().backward()  # the kernel's gradient ignores the upstream one (the record's)
        x64 = logits.double().requires_grad_()
        loss64 = tk.softcapped_ce_mtp_reference(x64, targets, w.double(), prefix, pi.double(), grad_scale=0.5)
        loss64.sum().backward()
        errs[f"loss_{dname}"] = e = rel_err(loss, loss64)
        require(e < TOL["fp32"], f"cross-entropy loss {dname}: relative error {e:.2e}")  # the loss is fp32 either way
        errs[f"grad_{dname}"] = e = rel_err(x.grad, x64.grad)
        require(e < TOL[dname], f"cross-entropy gradient {dname}: relative error {e:.2e}")
        twin = logits.clone().requires_grad_()  # the CPU path's torch twin, on the GPU's tensors
        tk.softcapped_ce_mtp_rows(twin, targets, w, prefix, pi, grad_scale=0.5).sum().backward()
        errs[f"twin_grad_{dname}"] = e = rel_err(x.grad, twin.grad)
        require(e < TOL[dname], f"cross-entropy kernel vs its CPU twin {dname}: gradient difference {e:.2e}")
        # the CPU head fused with its loss, on the GPU's tensors, against the kernel through x @ w
        hx = (torch.randn(T_, 128, device="cuda", generator=g) * 0.25).to(dtype)
        hw = (torch.randn(128, V, device="cuda", generator=g) * 0.5).to(dtype)
        fx, fw, kx, kw = (t.clone().requires_grad_() for t in (hx, hw, hx, hw))
        fused = tk.softcapped_ce_mtp_head_rows(fx, fw, targets, w, prefix, pi, grad_scale=0.5)
        fused.sum().backward()
        kernel = tk.softcapped_ce_mtp(kx @ kw, targets, w, prefix, pi, grad_scale=0.5)
        kernel.sum().backward()
        for part, got, want_ in (("loss", fused, kernel), ("dx", fx.grad, kx.grad), ("dw", fw.grad, kw.grad)):
            errs[f"head_{part}_{dname}"] = e = rel_err(got, want_)
            require(e < TOL["fp32" if part == "loss" else dname], f"fused CPU head vs kernel {part} {dname}: {e:.2e}")
        if dtype == torch.bfloat16:  # the FP8 head's form: e5m2 gradient / grad_s, saturating
            for tag, grad_s in (("e5m2", 0.5 * 0.75 / 448), ("e5m2_saturated", 1e-9)):
                l8, _, g8 = tk.softcapped_ce_mtp_e5m2(logits, targets, w, prefix, pi, 0.5, grad_s)
                want = (x64.grad / grad_s).clamp(-57344, 57344).to(torch.float8_e5m2)
                differ = float((g8.float() != want.float()).double().mean())
                errs[f"{tag}_differ"] = differ
                require(g8.dtype == torch.float8_e5m2 and bool(torch.isfinite(g8.float()).all()), f"{tag}: not finite e5m2")
                require(differ < 1e-3, f"{tag} gradient: {100 * differ:.3f}% of values differ from float64 rounded to e5m2")
                require(rel_err(l8, loss64) < TOL["fp32"], f"{tag} loss differs from the reference")
        del x, x64, twin, loss64, fx, fw, kx, kw
    return errs


def check_triton_cross_entropy(res: Result) -> None:
    import torch
    import triton_kernels as tk
    # At the speedrun's micro-batches, several runs: the target columns, which the kernel writes again
    # after a barrier (the interpreter runs one program at a time and cannot see an ordering bug there),
    # against a float64 loss and gradient of plain torch
    speedrun, V = {}, 50304
    for T_, form in CE_SHAPES:
        speedrun[f"{T_} rows, {form}"] = ce_target_runs(T_, V, form, CE_RUNS, _gen(30 + T_))
        res.set(speedrun_shapes=speedrun)
        torch.cuda.empty_cache()
    res.set(summary="; ".join(ce_target_summary(k, f) for k, f in speedrun.items()))
    problems = [m for k, f in speedrun.items() for m in ce_target_problems(k, f)]
    try:
        errs = _ce_float64_checks(res)
    except AssertionError as e:  # the speedrun shapes' verdicts are reported too
        require(not problems, "; ".join([str(e), *problems]))
        raise
    res.set(errors=errs, speedrun_shapes=speedrun,
            summary=f"loss {max(errs['loss_bf16'], errs['loss_fp32']):.1e}, gradient bf16 "
            f"{errs['grad_bf16']:.1e}, fp32 {errs['grad_fp32']:.1e}, kernel vs twin {errs['twin_grad_bf16']:.1e}, "
            f"vs the fused CPU head dw {errs['head_dw_bf16']:.1e}; "
            f"e5m2 gradient {100 * errs['e5m2_differ']:.3f}% off float64 (saturated: {100 * errs['e5m2_saturated_differ']:.3f}%); "
            + "; ".join(ce_target_summary(k, f) for k, f in speedrun.items()))
    require(not problems, "; ".join(problems))


def ce_target_problems(key: str, f: dict) -> list[str]:
    """ce_target_runs' figures against their bounds: every target column of every run within its
    tolerance, every run bitwise the first, the losses within fp32's and the gradient within bf16's (e5m2:
    0.1, and under 0.1% of its values other than the reference's rounded to e5m2)."""
    checks = (
        (sum(f["target_off"]) == 0, f"loss kernel at {key}: target columns off the float64 reference in runs "
                                    f"{[i for i, n in enumerate(f['target_off']) if n]} ({f['target_off']} of {f['targets']:,})"),
        (f["unequal_runs"] == 0, f"loss kernel at {key}: {f['unequal_runs']} of {f['runs'] - 1} runs differ from the "
                                 "first (the kernel is deterministic: a race)"),
        (f["loss"] < TOL["fp32"] and f["next_token"] < TOL["fp32"],
         f"loss kernel at {key}: loss {f['loss']:.2e}, next-token loss {f['next_token']:.2e} off the float64 reference"),
        (f["gradient_error"] < (TOL["bf16"] if f["differ"] is None else 0.1),
         f"loss kernel at {key}: gradient {f['gradient_error']:.2e} off the float64 reference"),
        (f["differ"] is None or f["differ"] < 1e-3,
         f"loss kernel at {key}: {100 * (f['differ'] or 0):.3f}% of the e5m2 gradient differs from the float64 "
         "reference's rounded to e5m2"),
    )
    return [message for ok, message in checks if not ok]


LOSS_BENCH_S = 34  # of loss-kernel's 40 s cap: `bench_kernels.py --only ce` (its loss kernel figures come first)


def run_capped(cmd, timeout_s: float) -> tuple[int | None, str]:
    """cmd in a process group of its own, killed whole after timeout_s (None for the exit code then): the
    exit code and the output."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=check_env())
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
        out.seek(0)
        return code, out.read()


def loss_kernel_line(f: dict) -> str:
    share = f["gb_per_s"] / f["peak_gbs"] if f.get("peak_gbs") else None
    text = (f"{f['gradient']} {f['tokens']}: {f['ms']:.2f} ms, {f['gb_per_s']:.0f} GB/s"
            + (f" = {share:.0%} of peak" if share is not None else ""))
    lim = f.get("limits")
    if lim:
        text += (f" ({lim['instructions_per_logit']:.0f} instructions, {lim['mufu_per_logit']:.0f} MUFU per logit; "
                 f"{lim.get('verdict', lim['bound'] + '-bound')})")
    return text


def check_loss_kernel(res: Result) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ce.json")
        code, output = run_capped([sys.executable, os.path.join(TESTS, "bench_kernels.py"), "--only", "ce", "--json", path],
                                  LOSS_BENCH_S)
        figures = json.load(open(path)) if os.path.exists(path) else {}
    print(output[-6000:])
    kernels = figures.get("kernels", [])
    res.set(bench_output=output[-6000:], bench_exit=code, **{k: v for k, v in figures.items() if k != "kernels"},
            kernels=kernels, summary="; ".join(loss_kernel_line(f) for f in kernels)
            + ("" if code == 0 else f"; bench_kernels.py --only ce {'stopped at ' + str(LOSS_BENCH_S) + ' s' if code is None else 'exit ' + str(code)}"))
    require(len(kernels) == 4, f"bench_kernels.py --only ce timed {len(kernels)} of 4 loss-kernel cases: "
            f"{last_error_line(output) if code else 'stopped'}")
    unexplained = [f"{f['gradient']} {f['tokens']}" for f in kernels
                   if f["gb_per_s"] < 0.5 * (f.get("peak_gbs") or 0) and "verdict" not in f.get("limits", {})]
    require(not unexplained, f"below half the peak bandwidth with no analysis of its limits: {unexplained}")
    require(code in (0, None), f"bench_kernels.py --only ce failed after the loss kernel's figures: {last_error_line(output)}")


def check_triton_transpose(res: Result) -> None:
    import torch
    import triton_kernels as tk
    for dname, dtype in _dtypes():
        g = _gen(4)
        src = torch.randn(768, 50304, device="cuda", generator=g).to(dtype)
        dst = torch.full((50304, 768), float("nan"), device="cuda", dtype=dtype)
        tk.transpose_copy(src, dst)
        require(torch.equal(dst, src.mT), f"transpose_copy {dname}: not exact")
        base = torch.randn(50304, 768, device="cuda", generator=g).to(dtype)
        acc = base.clone()
        tk.transpose_add(src, acc)
        want = (base.float() + src.mT.float()).to(dtype)  # one rounding of the fp32 sum
        require(torch.equal(acc, want), f"transpose_add {dname}: differs from the fp32 sum rounded once "
                f"in {int((acc != want).sum())} elements")
    g = _gen(4)
    for shape in ((16384, 50304), (16384, 768)):  # the FP8 head's dlogits and activations, as bytes
        src = torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=g)
        dst = torch.empty(shape[::-1], device="cuda", dtype=torch.uint8)
        tk.transpose_copy(src, dst)
        require(torch.equal(dst, src.mT), f"transpose_copy of {shape} bytes: not exact")
    res.set(summary="bitwise equal in bf16, fp32 and float8 (bytes)")


def check_fp8_up(res: Result) -> None:
    """Fast accumulation (Triton's default on sm_90, the record's) keeps the tensor cores' running sum
    with a reduced mantissa: modelled as a relative error of at most 2^-11 of sum_k |x_k w_k| on the
    accumulated value (13 bits, with margin), before the bf16 rounding of pre. fp32 promotion (after every
    32-deep wgmma, whose own sum is still reduced-precision) must stay within the same bound and be
    measurably closer to the fp32 reference: at most half the fast mode's error. On an H200 (2026-11-26)
    1.2% of its outputs were a bf16 neighbour of the reference's (fast: 5.4%), errors 8.4e-4 and 2.7e-3."""
    import torch
    import triton_kernels as tk
    T_, D, H = 49152, 768, 3072
    g = _gen(5)
    x = torch.nn.functional.rms_norm(torch.randn(T_, D, device="cuda", generator=g), (D,))
    ax = x.abs().amax()
    x_f8 = (x * (448 / ax)).to(torch.float8_e4m3fn)
    w = (torch.rand(H, D, device="cuda", generator=g) * 2 - 1) / 32
    s1 = w.abs().amax() / 448
    w_f8 = (w / s1).to(torch.float8_e4m3fn)
    dequant = (s1 * ax / 448).float().reshape(1)
    act = torch.full((1,), 0.05, device="cuda")
    rp, rq, ra = tk.relu2_fp8_up_reference(x_f8, w_f8, dequant, act)
    bound = (x_f8.float().abs() @ w_f8.float().abs().mT) * dequant * 2.0 ** -11  # modelled accumulation error
    exact = (x_f8.float() @ w_f8.float().mT) * dequant
    figures = {}
    for mode, fast in (("fast", True), ("precise", False)):
        post, post_f8, amax = tk.relu2_fp8_up(x_f8, w_f8, dequant, act, fast_accum=fast)
        parts = tk.relu2_fp8_up_partials(x_f8, w_f8, dequant, act, fast_accum=fast)[2]
        require(parts.shape == (tk.relu2_fp8_up_partial_count(T_, H, x_f8.device),) and torch.equal(parts.amax(), amax),
                f"{mode}: partial maxima {tuple(parts.shape)} (max {float(parts.amax())}) against the amax {float(amax)}")
        r = post.float().sqrt()  # relu(pre) from post, within half a bf16 ulp of pre's rounding
        excess = ((r - exact.clamp_min(0)).abs() - bound - 2.0 ** -7 * exact.abs() - 1e-30).clamp_min(0)
        figures[mode] = dict(post=rel_err(post, rp), differ=float((post != rp).double().mean()),
                             outside_bound=float((excess > 0).double().mean()), post_f8=rel_err(post_f8.float(), rq.float()),
                             amax=abs(float(amax) - float(ra)) / float(ra))
        res.set(**figures)
        f = figures[mode]
        require(f["outside_bound"] == 0, f"{mode}: {100 * f['outside_bound']:.4f}% of pre values outside the modelled bound")
        require(f["post"] < 1e-2 and f["post_f8"] < 2e-2 and f["amax"] < 1e-2, f"{mode}: {f}")
    require(figures["precise"]["post"] <= figures["fast"]["post"] / 2,
            f"precise: relative error {figures['precise']['post']:.1e} against the fp32 reference, not below half "
            f"the fast accumulation's {figures['fast']['post']:.1e}: the fp32 promotion is not taking effect")
    res.set(summary="; ".join(f"{m}: post {f['post']:.1e}, {100 * f['differ']:.2f}% differ from exact fp32, all within "
                              f"the 13-bit bound, e4m3 copy {f['post_f8']:.1e}" for m, f in figures.items()))


def fp8_head_figures(x, w, targets, mtp, prefix, pi, grad_scale: float, rows: int = 2048) -> dict:
    """speedrun::fp8_head_loss (its CUDA body on CUDA tensors, its CPU one on CPU tensors) on x (M, K) and
    w (K, N) bf16 with the head's scales, loss sum * grad_scale, against reference_fp8_head_rows (float64
    products of the op's dequantized e4m3 operands, torch's cross-entropy in fp32): relative errors of the
    loss, the next-token loss, the e5m2 gradient (the reference's / grad_s rounded to e5m2: the share of
    values that differ; the e5m2 values times grad_s against the reference's exact dlogits), dx and dw
    (against float64 products of the reference's e5m2 gradient, and of its exact one)."""
    import torch
    import train_gpt as T
    x_s, w_s = T.FP8_HEAD_X_SCALE, T.FP8_HEAD_W_SCALE
    grad_s = T.FP8_HEAD_GRAD_SCALE * grad_scale
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    x_f8, w_f8 = T.fp8_head_input(a), T.fp8_head_weight(b.detach()).T  # the operands, as the model makes them
    loss, next_token, g8 = T.fp8_head_loss(a, b, x_f8, w_f8, targets, mtp, prefix, pi, x_s, w_s, grad_s, grad_scale)
    (loss.sum() * grad_scale).backward()
    wd = w_f8.double() * w_s
    dev = x.device
    ref = dict(loss=[], next_token=[], dx=torch.empty(x.shape, dtype=torch.float64, device=dev),
               dx_exact=torch.empty(x.shape, dtype=torch.float64, device=dev),
               dw=torch.zeros(w.shape, dtype=torch.float64, device=dev),
               dw_exact=torch.zeros(w.shape, dtype=torch.float64, device=dev))
    differ, err2, ref2 = 0, 0.0, 0.0
    for sl, l, nt, dl, xd in reference_fp8_head_rows(x_f8, w_f8, x_s, w_s, targets, mtp, prefix, pi, grad_scale, rows):
        ref["loss"].append(l)
        ref["next_token"].append(nt)
        exact = dl.double()
        q = (exact / grad_s).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)
        differ += int((q.float() != g8[sl].float()).sum())
        err2 += float(((g8[sl].double() * grad_s - exact) ** 2).sum())
        ref2 += float((exact ** 2).sum())
        dq = q.double() * grad_s
        ref["dx"][sl], ref["dx_exact"][sl] = dq @ wd.mT, exact @ wd.mT
        ref["dw"] += xd.mT @ dq
        ref["dw_exact"] += xd.mT @ exact
    return dict(loss=rel_err(loss, torch.cat(ref["loss"])), next_token=rel_err(next_token, torch.cat(ref["next_token"])),
                e5m2_differ=differ / g8.numel(), dlogits_e5m2=(err2 / ref2) ** 0.5,
                dx=rel_err(a.grad, ref["dx"]), dw=rel_err(b.grad, ref["dw"]),
                dx_exact=rel_err(a.grad, ref["dx_exact"]), dw_exact=rel_err(b.grad, ref["dw_exact"]))


def fp8_mm_figures(x, w, dy) -> dict:
    """The plain FP8 matmul (fp8_matmul: speedrun::fp8_mm and its backward) against float64 products of its
    dequantized operands: y from e4m3(x / x_s) and e4m3(w / w_s), dx and dw from e5m2(dy / grad_s)."""
    import torch
    import train_gpt as T
    x_s, w_s, grad_s = T.FP8_HEAD_X_SCALE, T.FP8_HEAD_W_SCALE, T.FP8_HEAD_GRAD_SCALE
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = T.fp8_matmul(a, b, x_s, w_s, grad_s)
    y.backward(dy)
    xd = (x / x_s).to(torch.float8_e4m3fn).double() * x_s
    wd = (w / w_s).to(torch.float8_e4m3fn).double() * w_s
    gd = (dy / grad_s).to(torch.float8_e5m2).double() * grad_s
    return dict(mm_y=rel_err(y, xd @ wd), mm_dx=rel_err(a.grad, gd @ wd.mT), mm_dw=rel_err(b.grad, xd.mT @ gd))


# the FP8 head against its float64 reference: relative errors (the e5m2 share: of the gradient's values)
FP8_HEAD_TOL = dict(loss=1e-3, next_token=1e-3, e5m2_differ=0.01, dlogits_e5m2=0.1, dx=1e-2, dw=1e-2,
                    dx_exact=0.1, dw_exact=0.1, mm_y=1e-2, mm_dx=1e-2, mm_dw=1e-2)


def check_fp8_head(res: Result) -> None:
    import torch
    import train_gpt as T
    require(T._native_fp8(torch.device("cuda")), "this GPU has no FP8 tensor cores (compute capability < 8.9)")
    M, K_, N = 16384, 768, 50304
    g = _gen(6)
    x = T.norm(torch.randn(M, K_, device="cuda", generator=g)).bfloat16()
    w = (0.005 * torch.randn(K_, N, device="cuda", generator=g)).bfloat16()
    targets, prefix = ce_targets(M, N, g)
    mtp, pi = torch.tensor([1.0, 0.5, 0.25], device="cuda"), torch.tensor(0.25, device="cuda")
    errs = fp8_head_figures(x, w, targets, mtp, prefix, pi, grad_scale=1 / 8)
    res.set(errors=errs)
    torch.cuda.empty_cache()
    rows = 4096  # the plain op's float64 reference holds (rows, N) products
    dy = (torch.randn(rows, N, device="cuda", generator=g) * 1e-3).bfloat16()
    errs.update(fp8_mm_figures(x[:rows], w, dy))
    res.set(errors=errs, summary="against float64 products of the dequantized operands and torch's cross-entropy: "
            + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    off = [f"{k} {errs[k]:.2e} (bound {tol:g})" for k, tol in FP8_HEAD_TOL.items() if not errs[k] < tol]
    require(not off, "fp8 head against its float64 reference: " + ", ".join(off))


def fp8_mlp_figures(state, layer: int, x, w_up, w_down, dy) -> dict:
    """FP8MLPState.mlp for `layer` (speedrun::fp8_mlp: its CUDA body on CUDA tensors) forward and backward
    against reference_fp8_mlp on the operands the state gives the op (x's e4m3 copy by its current amax,
    the layer's e4m3 weights and scales): relative errors of post, y, dx, dw_up, dw_down; and y against
    the bf16 MLP in float64 without FP8 (what FP8 costs)."""
    import torch
    import train_gpt as T
    ins = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
    saved, posts = T.fp8_mlp, []

    def keep_post(*args):  # the op as FP8MLPState.mlp calls it, its post kept
        out = saved(*args)
        posts.append(out[1])
        return out

    T.fp8_mlp = keep_post
    try:
        y = state.mlp(layer, *ins)[0]
    finally:
        T.fp8_mlp = saved
    y.backward(dy)
    amax = x.abs().amax().float()  # the op's operands (FP8MLPState.mlp's own, written out)
    x_f8 = (x.float() * (T.E4M3_MAX / amax)).to(torch.float8_e4m3fn)
    dequant = state.up_scale[layer, 0] * amax / T.E4M3_MAX
    _, post, y64 = fp8_mlp_reference_forward(x_f8, state.up_f8[layer], dequant, state.down_f8_t[layer],
                                             state.down_scale[layer, 0], state.act_scale[layer, 0])
    dx, dw_up, dw_down = mlp_backward_reference(dy, x, w_up, w_down, post)
    exact = torch.relu(x.double() @ w_up.double().mT) ** 2 @ w_down.double()
    return dict(post=rel_err(posts[0], post), post_differ=float((posts[0] != post).double().mean()), y=rel_err(y, y64),
                dx=rel_err(ins[0].grad, dx), dw_up=rel_err(ins[1].grad, dw_up), dw_down=rel_err(ins[2].grad, dw_down),
                y_vs_bf16_mlp=rel_err(y, exact))


FP8_MLP_TOL = dict(post=1e-2, y=1e-2, dx=1e-2, dw_up=1e-2, dw_down=1e-2)


def check_fp8_mlp(res: Result) -> None:
    import torch
    import train_gpt as T
    require(T._native_fp8(torch.device("cuda")), "this GPU has no FP8 tensor cores (compute capability < 8.9)")
    T_, D, H, L = 16384, 768, 3072, 3
    g = _gen(7)
    x = T.norm(torch.randn(T_, D, device="cuda", generator=g)).bfloat16()
    bank = torch.stack([((torch.rand(H, D, device="cuda", generator=g) * 2 - 1) * D ** -0.5) if i % 2 == 0 else
                        0.05 * torch.randn(H, D, device="cuda", generator=g) for i in range(2 * L)]).bfloat16()
    dy = torch.randn(T_, D, device="cuda", generator=g).bfloat16()
    state = T.FP8MLPState(L, H, D).cuda()
    state.quantize(bank, bootstrap=True)
    with torch.no_grad():  # sets the delayed activation scales from this input's amax
        state.update_act_scales([state.mlp(layer, x, bank[2 * layer], bank[2 * layer + 1])[1] for layer in range(L)])
    layer = L - 1  # its scales sit 32 bytes into their buffers
    errs = fp8_mlp_figures(state, layer, x, bank[2 * layer], bank[2 * layer + 1], dy)
    res.set(errors=errs, summary=f"{L} layers, the last; against float64 products of the dequantized operands: "
            + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    off = [f"{k} {errs[k]:.2e} (bound {tol:g})" for k, tol in FP8_MLP_TOL.items() if not errs[k] < tol]
    require(not off, "fp8 mlp against its float64 reference: " + ", ".join(off))


def _layout(T_: int, seed: int, mean_doc: int = 700):
    """Document ids (T,) on the GPU for documents of random (geometric) lengths."""
    import numpy as np
    import torch
    lengths = np.random.default_rng(seed).geometric(1.0 / mean_doc, T_)
    starts = np.cumsum(lengths) - lengths
    first = np.zeros(T_, dtype=np.int64)
    first[starts[(starts > 0) & (starts < T_)]] = 1
    return torch.from_numpy(np.cumsum(first)).cuda()


def check_flex_attention(res: Result) -> None:
    import torch
    import torch.nn.functional as F
    import train_gpt as T
    torch.manual_seed(8)
    T_, H, hd = 8192, 6, 128
    cases = {  # name: (document ids, window in slots, slots per token)
        "causal": (torch.zeros(T_, dtype=torch.long, device="cuda"), 2 * T_, 1),
        "window 384": (torch.zeros(T_, dtype=torch.long, device="cuda"), 384, 1),
        "documents, window 1408": (_layout(T_, 1), 1408, 1),
        "paired slots, documents, window 640": (_layout(T_, 2), 640, 2),
    }
    errs = {}
    for name, (doc, window, r) in cases.items():
        n, heads = T_ * r, H // r
        w = torch.tensor(window, dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(1, heads, n, hd, device="cuda").bfloat16() for _ in range(3))
        dy = torch.randn(1, heads, n, hd, device="cuda").bfloat16()
        scale = 0.12
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = T.attention_mask(doc, w, window, r, "flex")
        # the model's eager CUDA call (one compiled kernel), the fp32 scale applied to the fp32 scores
        y = T.flex_attend(ins[0], ins[1], ins[2], mask, torch.tensor(scale, device="cuda"))
        y.backward(dy)
        dense = T.dense_attention_mask(doc, w, r)
        ref = [t.float().requires_grad_() for t in (q, k, v)]
        y32 = F.scaled_dot_product_attention(*ref, attn_mask=dense, scale=scale)
        y32.backward(dy.float())
        low = [t.clone().requires_grad_() for t in (q, k, v)]  # SDPA in bf16: what bf16 alone costs
        y16 = F.scaled_dot_product_attention(*low, attn_mask=dense, scale=scale)
        y16.backward(dy)
        for what, a, b, c in (("y", y, y32, y16), ("dq", ins[0].grad, ref[0].grad, low[0].grad),
                              ("dk", ins[1].grad, ref[1].grad, low[1].grad), ("dv", ins[2].grad, ref[2].grad, low[2].grad)):
            e, e16 = rel_err(a, b), rel_err(c, b)
            errs[f"{name}: {what}"] = (e, e16)
            require(e < max(2 * e16, 2e-3) and e < TOL["bf16"],
                    f"flex attention {name} {what}: relative error {e:.2e} (SDPA in bf16: {e16:.2e})")
        del ins, ref, low, y, y32, y16, dense
    # the eager call never waits for the host once compiled: masks built and attention run with syncs as errors
    doc, window, r = cases["paired slots, documents, window 640"]
    q = torch.randn(1, H // r, T_ * r, hd, device="cuda").bfloat16()
    scale = torch.full((), 0.12, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w = torch.full((), window, dtype=torch.int32, device="cuda")
        T.flex_attend(q, q, q, T.attention_mask(doc, w, window, r, "flex"), scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    worst = max(errs.items(), key=lambda kv: kv[1][0])
    res.set(errors={k: v[0] for k, v in errs.items()}, sdpa_bf16={k: v[1] for k, v in errs.items()},
            summary=f"{len(cases)} masks, worst relative error {worst[1][0]:.1e} ({worst[0]}; SDPA in bf16 {worst[1][1]:.1e}); "
            "eager call with no host sync")


def _documents(T_: int, max_doc_len: int, seed: int):
    """(cu_seqlens int32 padded as the loader pads them, document ids int64) on the CPU for documents of
    geometric lengths (mean 700 tokens) cut at max_doc_len, as the loader cuts FineWeb's."""
    import numpy as np
    import torch
    import train_gpt as T
    lengths = np.minimum(np.random.default_rng(seed).geometric(1.0 / 700, T_), max_doc_len)
    starts = (np.cumsum(lengths) - lengths)
    starts = starts[(starts > 0) & (starts < T_)][: T.max_docs_for(T_) - 1]
    cu = torch.full((T.max_docs_for(T_) + 1,), T_, dtype=torch.int32)
    cu[0] = 0
    cu[1: 1 + len(starts)] = torch.from_numpy(starts.astype(np.int32))
    return cu, T.document_ids(cu, T_)


VARLEN_STAGES = {"stage 1": (896, (128, 384)), "stage 3": (2048, (640, 1408))}  # documents cut at, (short, long) windows
ATTENTION_KINDS = {"plain short": (False, 1), "plain long": (True, 1), "paired short": (False, 2)}


def varlen_errors(q, k, v, dy, cu, doc, window: int, r: int, max_len: int, scale: float) -> dict:
    """varlen_attend (torch's varlen_attn) of (n, heads, hd) bf16 q, k, v over the documents of cu (starts
    in tokens, padded with empty documents) at r slots per token, forward and backward, against SDPA with
    dense_attention_mask in fp32 and in bf16 (what bf16 alone costs): {part: (error, SDPA bf16's error)}."""
    import torch
    import torch.nn.functional as F
    import train_gpt as T

    def as_seq(t):  # (n, heads, hd) -> (1, heads, n, hd), SDPA's layout
        return t.transpose(0, 1).unsqueeze(0)

    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    y = T.varlen_attend(*ins, T.VarlenMask((cu * r).to(q.device), max_len * r, window), scale)
    y.backward(dy)
    dense = T.dense_attention_mask(doc.to(q.device), torch.tensor(window, device=q.device), r)
    out = {}
    grads = {}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ref = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        y_ref = F.scaled_dot_product_attention(*map(as_seq, ref), attn_mask=dense, scale=scale)
        y_ref.backward(as_seq(dy.to(dtype)))
        grads[tag] = [y_ref] + [as_seq(t.grad) for t in ref]
    for i, part in enumerate(("y", "dq", "dk", "dv")):
        got = as_seq(y) if i == 0 else as_seq(ins[i - 1].grad)
        out[part] = (rel_err(got, grads["fp32"][i]), rel_err(grads["bf16"][i], grads["fp32"][i]))
    return out


def check_varlen_attention(res: Result) -> None:
    import torch
    H, hd, scale, T_ = 6, 128, 0.12, 8192
    g = _gen(11)
    errs, cases = {}, []
    for stage, (max_len, windows) in VARLEN_STAGES.items():
        cu, doc = _documents(T_, max_len, 11 if stage == "stage 1" else 13)
        for name, (long, r) in ATTENTION_KINDS.items():
            cases.append((f"{stage} {name}", cu, doc, windows[int(long)], r, max_len))
    whole = torch.full_like(cases[0][1], T_)  # one document of every token, the rest of cu_seqlens empty
    whole[0] = 0
    cases.append(("one document, long window", whole, torch.zeros(T_, dtype=torch.long), 1408, 1, T_))
    for name, cu, doc, window, r, max_len in cases:
        n, heads = T_ * r, H // r
        q, k, v, dy = (torch.randn(n, heads, hd, device="cuda", generator=g).bfloat16() for _ in range(4))
        e = varlen_errors(q, k, v, dy, cu, doc, window, r, max_len, scale)
        empty = int((cu[1:] == cu[:-1]).sum())
        for part, (err, err16) in e.items():
            errs[f"{name}: {part}"] = (err, err16)
        res.set(errors={k: v[0] for k, v in errs.items()}, sdpa_bf16={k: v[1] for k, v in errs.items()})
        cases_done = len({k.split(":")[0] for k in errs})
        print(f"{name}: window {window}, {r} slot(s) per token, {empty} empty documents in cu_seqlens: "
              + ", ".join(f"{p} {a:.1e} (SDPA bf16 {b:.1e})" for p, (a, b) in e.items()), flush=True)
        del q, k, v, dy
    worst = max(errs.items(), key=lambda kv: kv[1][0])
    res.set(summary=f"{cases_done} cases (windows, paired slots, cu_seqlens padded with empty documents, one document), "
            f"y and dq, dk, dv: worst relative error {worst[1][0]:.1e} ({worst[0]}; SDPA in bf16 {worst[1][1]:.1e})")
    off = [f"{k} {e:.2e} (SDPA bf16 {e16:.2e})" for k, (e, e16) in errs.items() if not (e < max(2 * e16, 2e-3) and e < TOL["bf16"])]
    require(not off, "varlen attention against fp32 SDPA: " + "; ".join(off))


def check_attention_kernels(res: Result) -> None:
    import torch
    import triton
    import train_gpt as T
    H, hd, scale = 6, 128, 0.12

    def qkv(n, heads, grad=True):  # (n, heads, hd) bf16 leaves
        return [torch.randn(n, heads, hd, device="cuda").bfloat16().requires_grad_(grad) for _ in range(3)]

    def as_seq(t):  # (n, heads, hd) -> (1, heads, n, hd), flex's layout
        return t.transpose(0, 1).unsqueeze(0)

    # forward + backward per kind at the stages' micro-batches, masks built on the host as the loader does
    # (varlen against SDPA: varlen-attention)
    times, total = {}, {}
    for stage, (T_, max_len, windows) in {"stage 1": (16384, 896, (128, 384)), "stage 3": (49152, 2048, (640, 1408))}.items():
        cu, doc = _documents(T_, max_len, 12)
        for name, (long, r) in ATTENTION_KINDS.items():
            window = windows[int(long)]
            q, k, v = qkv(T_ * r, H // r)
            dy = torch.randn_like(q)
            ind = T.block_mask_indices(doc, window, r)  # on the host, as make_batch builds it
            bm = T.block_attention_mask(doc.to(torch.int32).cuda(), torch.tensor(window, dtype=torch.int32, device="cuda"),
                                        r, indices=T.BlockMaskIndices(*(t.cuda() for t in ind)))
            vm = T.VarlenMask((cu * r).cuda(), max_len * r, window)
            s = torch.tensor(scale, device="cuda")

            def flex():
                T.flex_attend(as_seq(q), as_seq(k), as_seq(v), bm, s).backward(as_seq(dy))

            def varlen():
                T.varlen_attend(q, k, v, vm, scale).backward(dy)

            ms = {"flex": triton.testing.do_bench(flex, warmup=5, rep=30),
                  "varlen": triton.testing.do_bench(varlen, warmup=5, rep=30)}
            times[f"{stage} {name}"] = ms
            for kernel, t in ms.items():  # both stages' micro-batches together (each stage a third of the steps)
                total.setdefault((long, r), {}).setdefault(kernel, 0.0)
                total[long, r][kernel] += t
            res.set(times_ms=times)
            del q, k, v, dy, bm
    table = {kind: min(ms, key=ms.get) for kind, ms in total.items()}
    res.set(times_ms=times, choice={str(k): v for k, v in table.items()},
            summary="; ".join(f"{k} flex {v['flex']:.2f} / varlen {v['varlen']:.2f} ms" for k, v in times.items())
            + f"; ATTENTION_KERNEL_CHOICE entry: {table}")


def near_init(model, seed: int) -> None:
    """The model's own initialisation, with the parameters that start at zero (MLP down-projections,
    MUDD second layers, gates, bigram table) given small random values, so that every path carries a
    gradient while the loss stays near its initial ln(vocab) per weighted target."""
    import torch
    g = torch.Generator(device=model.lm_head.device).manual_seed(seed)
    with torch.no_grad():
        for name in ("vo_bank", "mlp_bank"):
            bank = getattr(model, name)
            for idx, role in enumerate(model.bank_roles[name]):
                if role.startswith("down."):
                    bank[idx] = (0.01 * torch.randn(bank[idx].shape, device=bank.device, generator=g)).to(bank.dtype)
        for p, std in ((model.mudd_w2, 0.02), (model.mudd_gate_w2, 0.02), (model.bigram_embed, 0.01),
                       (model.ve_gate_bank, 0.1), (model.smear_gate, 0.1)):
            p.copy_((std * torch.randn(p.shape, device=p.device, generator=g)).to(p.dtype))


def check_compiled_model(res: Result) -> None:
    import math
    import torch
    import train_gpt as T
    args = T.parse_args(["--preset", "speedrun"])
    torch.manual_seed(0)
    model = T.GPT(args).cuda()
    near_init(model, seed=1)
    model.set_windows(*args.stages[1].windows)
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    model.quantize_fp8(bootstrap=True)
    fp8_state = {k: v.clone() for k, v in model.fp8_mlp.state_dict().items()}
    T_ = 4096

    def batch(seed):
        doc = _layout(T_ + 1, seed)
        tokens = torch.randint(0, 50256, (T_ + 1,), device="cuda", generator=_gen(seed))
        tokens[torch.nonzero(doc[1:] != doc[:-1]).view(-1) + 1] = T.BOS_ID
        return T.make_batch(tokens.cpu().numpy().astype("uint16"), args.ngram_rows).to(torch.device("cuda"))

    b = batch(3)
    mtp = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    prefix = torch.tensor(0.25, device="cuda")

    def run(fn, b, kernel):
        model.zero_grad(set_to_none=True)
        model.fp8_mlp.load_state_dict(fp8_state)  # the forward moves the delayed activation scales
        masks = model.attention_masks(b.cu_seqlens, T_, kernel)
        loss, _ = fn(b.inputs, b.targets, b.cu_seqlens, b.ngram_ids, mtp_weights=mtp, loss_scale=1 / 8,
                     prefix_weight=prefix, masks=masks)
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with reference_fp8_ops():  # the reference: eager, fp32 SDPA with the dense masks, the FP8 ops in plain torch
        loss_r, grads_r = run(model, b, "sdpa_fp32")
    loss_e, grads_e = run(model, b, "flex")       # eager with the compiled flex kernel
    compiled = T.compile_model(model)
    before = T.compile_counts()
    t = time.perf_counter()
    loss_c, grads_c = run(compiled, b, "flex")
    compile_s = time.perf_counter() - t
    first = T.compile_counts()
    run(compiled, batch(4), "flex")  # another batch of the same shape: must not compile again
    second = T.compile_counts()
    graphs, recompiles = first["graphs"] - before["graphs"], second["graphs"] - first["graphs"]
    breaks = second["graph_breaks"] - before["graph_breaks"]
    with torch.no_grad():  # the plain next-token loss per token: near ln(vocab) at init
        per_token = float(model(b.inputs, b.targets, b.cu_seqlens, b.ngram_ids,
                                masks=model.attention_masks(b.cu_seqlens, T_, "sdpa_fp32")))
    figures = dict(loss_reference=loss_r, loss_eager=loss_e, loss_compiled=loss_c, eval_loss=per_token,
                   compile_s=compile_s, graphs=graphs, recompiles=recompiles, graph_breaks=breaks)
    for name, grads in (("eager", grads_e), ("compiled", grads_c)):
        require(set(grads) == set(grads_r), f"{name}: gradients differ in which parameters get one: {set(grads) ^ set(grads_r)}")
        errs = {n: rel_err(grads[n], grads_r[n]) for n in grads_r if grads_r[n].abs().max() > 0}
        figures[f"grads_{name}"] = errs
    res.set(**figures)
    dl = abs(loss_c - loss_r) / abs(loss_r)
    errs = figures["grads_compiled"]
    # a gradient of a few numbers (gates, lambdas) is a sum over every token with cancellation, so its
    # relative error says little: those only have to agree in rough size
    big = {n: e for n, e in errs.items() if grads_r[n].numel() >= 4096}
    worst = max(big.items(), key=lambda kv: kv[1])
    worst_e = max(v for n, v in figures["grads_eager"].items() if n in big)
    res.set(summary=f"eval loss per token {per_token:.3f} (ln 50304 = {math.log(50304):.3f}); compiled {loss_c:.4f} vs "
            f"reference {loss_r:.4f} ({dl:.1e}); worst gradient {worst[1]:.1e} ({worst[0]}; eager flex {worst_e:.1e}); "
            f"{graphs} graph, {breaks} breaks, {recompiles} recompiles; first compiled call {compile_s:.0f} s")
    require(abs(per_token - math.log(50304)) < 0.5, f"eval loss per token {per_token:.3f} is not near ln(vocab)")
    require(graphs == 1 and breaks == 0, f"the training forward and backward compiled into {graphs} graphs with {breaks} breaks")
    require(recompiles == 0, f"a second batch of the same shape compiled {recompiles} new graphs")
    require(dl < 1e-2, f"compiled loss {loss_c} vs reference {loss_r}: relative difference {dl:.2e}")
    require(worst[1] < 0.1, f"gradient of {worst[0]}: compiled vs reference relative difference {worst[1]:.2e}")
    for n, e in errs.items():
        if n not in big:
            require(e < 0.5, f"gradient of {n} ({grads_r[n].numel()} numbers): compiled vs reference {e:.2e}")


def check_sync_free_step(res: Result) -> None:
    import torch
    import train_gpt as T
    import test_training
    test_training.test_training_step_never_waits_for_the_gpu()  # eager, the test as it stands
    res.set(eager="pass")
    # the way train() runs it: compiled model and optimizer, FP8 weights re-quantised after every step
    args = T.parse_args(["--preset", "test", "--compile", "true"])
    device = torch.device("cuda")
    model = T.GPT(args).to(device)
    opt = T.build_optimizer(args, model, device)
    compiled_model = T.compile_model(model)
    loader = T.DocumentLoader(args.train_files, args.ngram_rows, device=device)
    mtp = torch.zeros(len(args.stages[0].mtp_start), device=device)
    prefix = torch.zeros((), device=device)
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    slots = T.check_batch_split(args, 1)
    model.quantize_fp8(bootstrap=True)

    def step(i):
        plan = T.plan_step(args, i)
        model.set_windows(*plan.windows)
        batches = loader.next_step(*T.batch_request(args, plan, slots, device))  # masks built by the loader
        loss, _ = T.train_step(compiled_model, opt, batches, plan, mtp, prefix, T.grad_scale_for(args, 1), device)
        model.quantize_fp8(bootstrap=i < T.FP8_BOOTSTRAP_STEPS)
        return loss

    step(2), step(3)  # compile stage 2's shapes, both parities: no recompilation below
    warm = T.compile_counts()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    torch._dynamo.config.error_on_recompile = True
    try:
        losses = [step(2), step(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch._dynamo.config.error_on_recompile = False
    after = T.compile_counts()
    finite = all(bool(torch.isfinite(x)) for x in losses)
    res.set(compiled="pass", graphs_warmup=warm["graphs"], graphs_after=after["graphs"],
            summary=f"eager and compiled steps (NorMuon, then NorMuon + Adam) ran with no host sync; {warm['graphs']} "
            f"graphs in the warm-up steps, {after['graphs'] - warm['graphs']} after, {after['graph_breaks']} graph breaks")
    require(finite, f"non-finite training loss: {[float(x) for x in losses]}")
    require(after == warm and after["graph_breaks"] == 0, f"compiles after the warm-up: {warm} -> {after}")


# ---- speedrun-default: train_gpt.py as a user runs it, against the same steps eager -------------------------

TEXT_TRAIN = os.path.join("data", "tinyshakespeare", "tinyshakespeare_train_*.bin")  # real text: the loss falls
TEXT_VAL = os.path.join("data", "tinyshakespeare", "tinyshakespeare_val_*.bin")
# The speedrun preset's defaults but for the schedule's length (each stage 3 steps, the extension 2: every
# step shape, window and Adam parity of the run, and the untie) and validation's size (one sequence at the
# default length, at the end only); the compile warm-up then runs every step of the schedule, in order.
DEFAULT_RUN_FLAGS = ("--num_iterations", "9", "--extension_iterations", "2", "--val_tokens", "262144",
                     "--val_loss_every", "0")
DEFAULT_RUN_EAGER = ("--cuda_graphs", "false", "--compile", "false")  # the reference run: no graphs, no compiler
DEFAULT_RUN_PROFILE_STEP = 2  # stage 1's last step, run under torch.profiler: the host's dispatches
# Bounds, relative. Losses: step 0 starts from the same weights on the same batch, so only the compiler's
# fusions round differently (the compiled model against fp32 SDPA: 1.2e-5 on 2026-12-04); later steps
# follow updates that differ by as much. Parameters: the update since before step 0, compiled against
# eager, ||d_graphs - d_eager|| / ||d_eager|| per parameter tensor: its direction is NorMuon's
# orthogonalised momentum or Adam's normalised one (whose near-zero gradients may flip sign: the first Adam
# step moves every entry by +-lr), so a bound that passes bf16 noise and fails a wrong or missing update;
# tensors under SMALL_PARAM numbers (gates, lambdas, scalars) sum their gradients over every token, with
# cancellation: a looser one. Replay: the timed run repeats the warm-up's steps from the restored state, on
# the same graphs: step 0 equal, the rest apart only by the embeddings' atomic adds.
DEFAULT_RUN_BOUNDS = dict(first_loss=1e-3, loss=1e-2, update=0.25, update_small=0.5, replay_first=1e-6, replay=1e-3)
SMALL_PARAM = 4096


def text_val_shard(directory: str, tokens: int = 300_000) -> str:
    """A validation shard of at least `tokens` tokens: tinyshakespeare's val shard repeated (whole
    documents, each from BOS); written once into `directory`. Returns its glob pattern."""
    import glob
    import numpy as np
    import train_gpt as T
    path = os.path.join(directory, "tinyshakespeare_val_000000.bin")
    if not os.path.exists(path):
        text = np.concatenate([T.read_shard(p).numpy() for p in sorted(glob.glob(os.path.join(REPO, TEXT_VAL)))])
        os.makedirs(directory, exist_ok=True)
        T.write_shard(path, np.tile(text, -(-tokens // len(text))).astype(np.int64))
    return os.path.join(directory, "tinyshakespeare_val_*.bin")


def run_training(flags, tmp: str, label: str, profile_step: int = DEFAULT_RUN_PROFILE_STEP, nproc: int = 1) -> dict:
    """`torchrun tests/gpu_check_train.py` (train_gpt.main recorded) with train_gpt.py's `flags`, its log in
    tmp/<label>.txt: the exit code, seconds, the record (gpu_check_train.py), the tensors' file, the run
    log, the output's end."""
    record, tensors = os.path.join(tmp, f"{label}.json"), os.path.join(tmp, f"{label}.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(TESTS, "gpu_check_train.py"), "--record", record, "--tensors", tensors,
           "--profile_step", str(profile_step), "--", *flags, "--log_dir", tmp, "--run_id", label,
           "--checkpoint_dir", os.path.join(tmp, "checkpoints")]
    t = time.perf_counter()
    out_path = os.path.join(tmp, f"{label}.out")
    with open(out_path, "w") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=check_env()).returncode
    seconds = time.perf_counter() - t
    output = open(out_path, errors="replace").read()
    rec = json.load(open(record)) if os.path.exists(record) else {}
    log_path = os.path.join(tmp, f"{label}.txt")
    log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
    return dict(code=code, seconds=seconds, record=rec, tensors=tensors if os.path.exists(tensors) else None, log=log,
                output=output[-8000:])


def log_facts(log: str, console: str = "") -> dict:
    """What a train_gpt.py run log says beyond the steps: validation losses, the compile warm-up's line (on
    the console, not in the log: from `console`), the CUDA graphs' notes, the hardware, the torch.compile
    line after the run, peak memory."""
    warmup = re.findall(r"compile warm-up: [^\r\n]*", console)
    env = re.search(r"^==== environment ====$", log, re.M)  # after the sources the log starts with
    log = log[env.start():] if env else log
    def line(pattern):
        m = re.search(pattern, log, re.M)
        return m.group(0) if m else ""
    compiled = re.search(r"^torch.compile: (\d+) graphs compiled during the timed run.*, (\d+) graph breaks$", log, re.M)
    return dict(val_losses=parse_val_losses(log), warmup_line=warmup[-1].strip() if warmup else "",
                graphs_notes=re.findall(r"^cuda graphs.*$", log, re.M), hardware=line(r"^hardware: .*$"),
                compile_line=compiled.group(0) if compiled else "",
                graphs_after_warmup=int(compiled.group(1)) if compiled else None,
                graph_breaks=int(compiled.group(2)) if compiled else None, peak_memory=line(r"^peak memory allocated.*$"))


def stage_of_steps(steps: list[dict]) -> list[str]:
    """Each recorded step's stage name, by its (batch tokens, windows) in order of appearance: the
    schedule's stages and the extension (the same batch as stage 3, wider windows)."""
    seen = {}
    for st in steps:
        seen.setdefault((st["batch_tokens"], tuple(st["windows"])), len(seen))
    names = [f"stage {i + 1}" for i in range(len(seen))]
    if len(names) == 4:
        names[-1] = "extension"
    return [names[seen[st["batch_tokens"], tuple(st["windows"])]] for st in steps]


def update_error(got, want, first) -> float:
    """||(got - first) - (want - first)|| / ||want - first|| in float64: 0 where neither moved, inf where
    only got did."""
    d_got, d_want = got.double() - first.double(), want.double() - first.double()
    norm = float(d_want.norm())
    diff = float((d_got - d_want).norm())
    return 0.0 if diff == 0 else (diff / norm if norm else float("inf"))


def compare_default_runs(graphs: dict, eager: dict, t_graphs: dict | None, t_eager: dict | None,
                         bounds: dict = DEFAULT_RUN_BOUNDS) -> dict:
    """The graphs-and-compile run against the eager one (records of gpu_check_train.py; tensors as it saved
    them, or None): per step the losses' relative differences and the worst parameter's update error (on
    the samples), after the last step every parameter's (whole), the weights before step 0 equal, and the
    graphs run's timed steps against its own warm-up's. Returns the figures and `problems`, each a bound
    not met."""
    import torch
    problems, rows = [], []
    steps_g, steps_e = graphs.get("steps", []), eager.get("steps", [])
    if [s["step"] for s in steps_g] != [s["step"] for s in steps_e] or not steps_g:
        problems.append(f"the runs recorded different steps: {[s['step'] for s in steps_g]} and "
                        f"{[s['step'] for s in steps_e]}")
        return dict(steps=rows, problems=problems)
    names = [n for n, _ in graphs.get("sample_names", [])]
    counts = [c for _, c in graphs.get("sample_names", [])]
    sizes = {n: int(t.numel()) for n, t in (t_eager or {}).get("first", {}).items()}
    out = dict(steps=rows, problems=problems)
    if t_graphs and t_eager:
        out["first_equal"] = all(torch.equal(t_graphs["first"][n], t_eager["first"][n]) for n in t_eager["first"])
        if not out["first_equal"]:
            problems.append("the two runs start from different weights (the warm-up's reset, or the initialisation)")
    for i, (g, e) in enumerate(zip(steps_g, steps_e)):
        row = dict(step=g["step"])
        for key in ("next_token", "objective"):
            row[key] = (g[key], e[key])
            row[f"{key}_diff"] = abs(g[key] - e[key]) / max(abs(e[key]), 1e-30)
        bound = bounds["first_loss"] if i == 0 else bounds["loss"]
        worst_loss = max(row["next_token_diff"], row["objective_diff"])
        if not worst_loss <= bound:  # NaN fails too
            problems.append(f"step {g['step']}: losses {row['next_token']} and {row['objective']} (graphs, eager) differ "
                            f"by {worst_loss:.2e}, over {bound:g}")
        if t_graphs and t_eager:
            sg, se = t_graphs["samples"][i].split(counts), t_eager["samples"][i].split(counts)
            s0 = t_eager["sample0"].split(counts)
            errs = {n: update_error(a, b, f) for n, a, b, f in zip(names, sg, se, s0)}
            name = max(errs, key=lambda n: errs[n])
            row["update"] = (name, errs[name])
            for n, err in errs.items():
                lim = bounds["update_small"] if sizes.get(n, SMALL_PARAM) < SMALL_PARAM else bounds["update"]
                if not err <= lim:
                    problems.append(f"step {g['step']}: the update of {n} (sampled) differs from eager's by {err:.2e}, "
                                    f"over {lim:g}")
        rows.append(row)
    if t_graphs and t_eager:  # every parameter whole, on the GPU where there is one (bigram_embed: 290M numbers)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        final = {n: update_error(*(t[key][n].to(dev) for t, key in ((t_graphs, "final"), (t_eager, "final"), (t_eager, "first"))))
                 for n in t_eager["final"]}
        out["final"] = dict(sorted(final.items(), key=lambda kv: -kv[1]))
        for n, err in final.items():
            lim = bounds["update_small"] if sizes[n] < SMALL_PARAM else bounds["update"]
            if not err <= lim:
                problems.append(f"after the last step: {n} has moved from the start by {err:.2e} other than eager's, "
                                f"over {lim:g}")
    # the timed run against the warm-up's run of the same steps (when the warm-up ran every step, in order)
    warm = graphs.get("warmup", [])
    if warm and [w["step"] for w in warm] == [s["step"] for s in steps_g]:
        replay = []
        for i, (w, g) in enumerate(zip(warm, steps_g)):
            diff = max(abs(w[k] - g[k]) / max(abs(w[k]), 1e-30) for k in ("next_token", "objective"))
            replay.append(diff)
            bound = bounds["replay_first"] if i == 0 else bounds["replay"]
            if not diff <= bound:
                problems.append(f"step {g['step']}: the timed run's losses differ from the warm-up's run of the same "
                                f"step by {diff:.2e}, over {bound:g}")
        out["replay"] = replay
    return out


def default_run_summary(label: str, run: dict) -> dict:
    """The report's figures of one recorded run: exit code, seconds, error, the CUDA graphs' state, its
    log's facts, per-step losses and times, ms/step per stage (its profiled step left out), host dispatches."""
    rec = run["record"]
    steps = rec.get("steps", [])
    stages = stage_of_steps(steps) if steps else []
    per_stage = {}
    for st, name in zip(steps, stages):
        if not st.get("profiled") and st.get("device_ms") is not None:
            per_stage.setdefault(name, []).append(st["device_ms"])
    return dict(label=label, code=run["code"], seconds=run["seconds"], error=rec.get("error", ""),
                flags=rec.get("flags", []), graphs=rec.get("graphs"), dispatch=rec.get("dispatch"),
                steps=[dict(st, stage=name) for st, name in zip(steps, stages)], warmup=rec.get("warmup", []),
                ms_per_stage={k: sum(v) / len(v) for k, v in per_stage.items()}, **log_facts(run["log"], run["output"]))


def default_run_problems(s: dict, cuda: bool = True) -> list[str]:
    """The graphs-and-compile run's own verdicts: it ran, captured every step shape in the warm-up, learns
    (the objective falls, the validation loss is finite and under step 0's next-token loss) and compiles
    nothing after the warm-up."""
    problems = []
    if s["code"] != 0 or s["error"]:
        problems.append(f"train_gpt.py exited with {s['code']}: {s['error'] or 'no record'}")
    steps = s["steps"]
    if steps:
        keys = {(st["batch_tokens"], tuple(st["windows"])) for st in steps}
        g = s["graphs"] or {}
        if cuda and not (g.get("enabled") and g.get("kept") and not g.get("failure") and g.get("captured") == len(keys)):
            problems.append(f"CUDA graphs: {g} after the warm-up, expected {len(keys)} step shapes captured; "
                            f"the log: {s['graphs_notes']}")
        first, last = steps[0], steps[-1]
        finite = all(v == v and abs(v) != float("inf") for st in steps for v in (st["next_token"], st["objective"]))
        if not finite or not last["objective"] < first["objective"]:
            problems.append(f"the objective went from {first['objective']} to {last['objective']}")
        vals = s["val_losses"]
        if not vals or not vals[-1] < first["next_token"]:
            problems.append(f"validation losses {vals}, step 0's next-token loss {first['next_token']}")
    if cuda:
        if s["graphs_after_warmup"] != 0 or s["graph_breaks"] != 0:
            problems.append(f"compiled after the warm-up: {s['compile_line'] or 'no torch.compile line in the log'}")
        if not s["hardware"] or "CPU" in s["hardware"]:
            problems.append(f"the log's hardware line names no GPU: {s['hardware']!r}")
        if not s["peak_memory"]:
            problems.append("no peak memory line in the run log")
    return problems


def check_speedrun_default(res: Result) -> None:
    import torch
    val = text_val_shard(os.path.join(SHARD_DIR, "text"))
    flags = [*DEFAULT_RUN_FLAGS, "--train_files", os.path.join(REPO, TEXT_TRAIN), "--val_files", val]
    data = dict(flags=flags, eager_flags=list(DEFAULT_RUN_EAGER), bounds=DEFAULT_RUN_BOUNDS)
    summaries, records, tensors, problems = {}, {}, {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("graphs", ()), ("eager", DEFAULT_RUN_EAGER)):
            run = run_training([*flags, *extra], tmp, label)
            summaries[label], records[label], tensors[label] = default_run_summary(label, run), run["record"], run["tensors"]
            data["runs"] = summaries
            if run["code"] != 0:  # the run's own traceback, whole, for the report
                print(f"==== the {label} run's output (end) ====\n{run['output']}", flush=True)
                tb = run["record"].get("traceback") or run["output"]
                data["traceback"] = (data.get("traceback", "") + f"train_gpt.py ({label} run) failed:\n{tb}\n").strip()
            if label == "graphs":
                problems += default_run_problems(summaries[label])
                data["problems"] = problems
            res.set(**data, summary=default_run_line(data))
        loaded = {k: torch.load(v) if v else None for k, v in tensors.items()}
        comparison = compare_default_runs(records["graphs"], records["eager"], loaded["graphs"], loaded["eager"])
    problems += comparison.pop("problems")
    data.update(comparison=comparison, problems=problems)
    res.set(**data, summary=default_run_line(data))
    require(not problems, "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))


def default_run_line(data: dict) -> str:
    """The report's one line of speedrun-default: capture, learning, compilation after the warm-up, ms/step
    per stage and host dispatches per step both ways, then the comparison's worst figures."""
    runs = data.get("runs", {})
    parts = []
    for label, s in runs.items():
        if s["code"] != 0 and not s["steps"]:
            parts.append(f"{label}: failed ({s['error'] or 'exit ' + str(s['code'])})")
            continue
        g = s.get("graphs") or {}
        d = s.get("dispatch") or {}
        steps = s["steps"]
        text = f"{label}: " + (f"{g.get('captured', 0)} step shapes captured, " if g.get("enabled") else "")
        if steps:
            text += f"next-token loss {steps[0]['next_token']:.3f} -> {steps[-1]['next_token']:.3f}"
        if s["val_losses"]:
            text += f", val {s['val_losses'][-1]:.3f}"
        if s.get("ms_per_stage"):
            text += ", ms/step " + " / ".join(f"{v:.0f}" for v in s["ms_per_stage"].values())
        if d:
            text += f", {d['host_dispatches']:,} host dispatches ({d['aten_ops']:,} aten ops) in step {d['step']}"
        parts.append(text)
    c = data.get("comparison")
    if c and c.get("steps"):
        worst_loss = max(max(r["next_token_diff"], r["objective_diff"]) for r in c["steps"])
        parts.append(f"against eager: losses within {worst_loss:.1e}")
        ups = [r["update"] for r in c["steps"] if "update" in r]
        if ups:
            name, err = max(ups, key=lambda u: u[1])
            parts.append(f"worst update {err:.2e} ({name})")
        if c.get("final"):
            name, err = next(iter(c["final"].items()))
            parts.append(f"after the last step {err:.2e} ({name})")
        if c.get("replay"):
            parts.append(f"timed vs warm-up {max(c['replay']):.1e}")
    return "; ".join(parts)


def _nccl_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    import torch.distributed as dist
    import train_gpt as T
    d = T.setup_distributed()
    try:
        out = _optimizer_steps(d.device, world_size, rank)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        if world_size == 1:
            with open(os.path.join(out_dir, "stop_on_signal.json"), "w") as f:
                json.dump(_stop_read_while_busy(d.device), f)
    finally:
        dist.destroy_process_group()


def _stop_read_while_busy(device, busy_s: float = 0.3) -> dict:
    """StopOnSignal on CUDA as train() drives it with several ranks (forced here on a one-rank group):
    step 0 shares no request; step 1 is `busy_s` of GPU sleep, then a SIGTERM request is shared.
    agreed(2) must return 0 while step 1 is still running (it reads step 0's slot); agreed(3), after
    the device finished, SIGTERM. Also the wait of a plain .item() of the same slot, for scale."""
    import signal
    import time
    import torch
    import train_gpt as T
    stop = T.StopOnSignal(True, world_size=2, device=device)
    stop.share(0)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    torch.cuda._sleep(10 ** 8)  # calibrates the sleep kernel: seconds per cycle
    torch.cuda.synchronize(device)
    per_cycle = (time.perf_counter() - t) / 10 ** 8
    torch.cuda._sleep(int(busy_s / per_cycle))  # step 1's work
    stop.request(signal.SIGTERM, None)
    stop.share(1)
    t = time.perf_counter()
    before = stop.agreed(2)
    wait_s = time.perf_counter() - t
    still_busy = not torch.cuda.current_stream(device).query()
    t = time.perf_counter()
    item = int(stop.shared[1].item())  # what the read would cost without the host copy and event
    item_s = time.perf_counter() - t
    after = stop.agreed(3)
    return dict(agreed_2=before, agreed_3=after, wait_s=wait_s, still_busy=still_busy, item=item, item_s=item_s,
                busy_s=busy_s)


NCCL_ARGS = ["--preset", "test", "--bank_ownership", "balanced", "--compile", "false"]


def _optimizer_steps(device, world_size: int, rank: int) -> dict:
    """Two optimizer steps (NorMuon, then NorMuon + Adam) of the test preset's model on gradients whose
    mean over ranks is exact in bf16 (multiples of 1/16), so any world size has the same mean gradient."""
    import torch
    import train_gpt as T
    args = T.parse_args(NCCL_ARGS)
    torch.manual_seed(0)
    model = T.GPT(args, world_size).to(device)
    opt = T.build_optimizer(args, model, device)
    params = model.params_by_label()
    for step in range(2):
        for i, (label, p) in enumerate(params.items()):
            gen = torch.Generator().manual_seed(10 * step + i)
            target = torch.randint(-2, 3, p.shape, generator=gen).float() / 16
            rest = [torch.randint(-2, 3, p.shape, generator=gen).float() / 16 for _ in range(world_size - 1)]
            mine = rest[rank] if rank < world_size - 1 else world_size * target - sum(rest, torch.zeros(p.shape))
            p.grad = mine.to(p.dtype).to(device)
        opt.step(do_adam=step == 1)
    T.cuda_synchronize(device)
    return {label: p.detach().cpu() for label, p in params.items()}


def check_normuon_nccl(res: Result) -> None:
    import signal
    import socket
    import torch
    import torch.multiprocessing as mp
    ref = _optimizer_steps(torch.device("cuda"), 1, 0)  # no process group at all
    summary = []
    sizes = [1] + ([2] if torch.cuda.device_count() >= 2 else [])
    for world in sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_nccl_worker, args=(world, port, tmp), nprocs=world, start_method="spawn")
            got = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
            if world == 1:
                with open(os.path.join(tmp, "stop_on_signal.json")) as f:
                    stop = json.load(f)
        for r, params in enumerate(got):
            bitwise = all(torch.equal(params[k], ref[k]) for k in ref)
            worst = max((rel_err(params[k].float(), ref[k].float()), k) for k in ref)
            res.set(**{f"ranks_{world}_rank{r}": dict(bitwise=bitwise, worst=worst[0], worst_label=worst[1])})
            if world == 1:  # the same code on the same shapes: nothing may differ
                require(bitwise, f"1-rank NCCL group differs from one process: {worst[1]} by {worst[0]:.2e}")
            else:  # other banks per rank: the kernels' tiles may differ, so rounding may too
                require(worst[0] < 1e-3, f"{world} ranks, rank {r}: {worst[1]} differs by {worst[0]:.2e}")
        summary.append(f"{world} rank(s): " + ("bitwise equal" if all(
            torch.equal(p[k], ref[k]) for p in got for k in ref) else f"within {worst[0]:.1e}"))
    if len(sizes) == 1:
        summary.append("2 ranks: not run (1 GPU)")
    res.set(stop_on_signal=stop)
    summary.append(f"StopOnSignal: the step-late read took {1000 * stop['wait_s']:.2f} ms with {stop['busy_s']:.1f} s "
                   f"of the previous step queued (a plain .item(): {1000 * stop['item_s']:.0f} ms)")
    res.set(summary="; ".join(summary))
    require(stop["agreed_2"] == 0 and stop["agreed_3"] == signal.SIGTERM and stop["item"] == signal.SIGTERM,
            f"StopOnSignal read the wrong slot: agreed(2) {stop['agreed_2']}, agreed(3) {stop['agreed_3']} "
            f"(expected 0, then {int(signal.SIGTERM)})")
    require(stop["still_busy"] and stop["wait_s"] < stop["busy_s"] / 3,
            f"StopOnSignal.agreed waited {stop['wait_s']:.3f} s for the step in flight ({stop['busy_s']} s of "
            f"GPU sleep; still running after it: {stop['still_busy']})")


def check_train_script(res: Result) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               os.path.join(REPO, "train_gpt.py"), "--preset", "test", "--compile", "true", "--run_id", "gpu_check",
               "--log_dir", tmp, "--checkpoint_dir", os.path.join(tmp, "ckpt")]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=check_env())
        log_path = os.path.join(tmp, "gpu_check.txt")
        log = open(log_path).read() if os.path.exists(log_path) else ""
    print(r.stdout[-3000:], r.stderr[-6000:], sep="\n")
    require(r.returncode == 0, f"train_gpt.py exited with {r.returncode}: {last_error_line(r.stderr)}")
    vals = parse_val_losses(log)
    hardware = re.search(r"^hardware: .*$", log, re.M)
    res.set(val_losses=vals, summary=f"val loss {vals[0]:.3f} -> {vals[-1]:.3f} over {len(vals)} validations; "
            f"{hardware.group(0) if hardware else 'no hardware line'}")
    require(hardware and "CPU" not in hardware.group(0), "the run log names no GPU")
    require(len(vals) >= 2 and all(v == v for v in vals) and vals[-1] < vals[0], f"validation losses {vals}")
    require("peak memory allocated" in log, "no peak memory line in the run log")
    compiled = re.search(r"^torch.compile: (\d+) graphs compiled during the timed run.*, (\d+) graph breaks$", log, re.M)
    require(compiled is not None, "no torch.compile line in the run log")
    res.set(summary=res.data["summary"] + f"; {compiled.group(0)}")
    require(compiled.group(1) == "0" and compiled.group(2) == "0", compiled.group(0))


def parse_val_losses(log: str) -> list[float]:
    """The validation losses of a run log's record lines ("step:N/T val_loss:X ..."), in order; the
    source code the log starts with is not read (its format strings look like record lines)."""
    return [float(m) for m in re.findall(r"^step:\d+/\d+ val_loss:([0-9.]+|nan|inf)\b", log, re.M)]


def check_kernel_choice(res: Result) -> None:
    import torch
    import triton.testing
    import train_gpt as T
    import triton_kernels as tk
    import bench_kernels

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    gpu = torch.cuda.get_device_name()
    rows, wrong = [], []
    for name, b, m, n, t, r in bench_kernels.time_sym(tk, bench):
        pick = tk.kernel_choice(name, (b, m, n), gpu)
        picked, other = (r, t) if pick == "torch" else (t, r)
        rows.append(dict(function=name, shape=[b, m, n], triton_ms=t, torch_ms=r, pick=pick,
                         listed=(name, b, m, n) in tk.measured_table(tk.KERNEL_TIMES, gpu)))
        if rows[-1]["listed"] and picked > 1.1 * other:
            wrong.append(f"{name} {b}x{m}x{n}: {pick} {picked:.3f} ms, the other {other:.3f} ms")
        res.set(kernels=rows)
    ortho = []
    for rows_, cols_, count in ((256, 768, 8), (768, 768, 3), (3072, 768, 3), (256, 768, 64), (768, 768, 24),
                                (3072, 768, 24)):
        G = torch.randn(count, rows_, cols_, device="cuda")
        ms = {name: bench(lambda: fn(G)) for name, fn in (("polar_express", T.polar_express),
                                                           ("gram_newton_schulz", T.gram_newton_schulz),
                                                           ("auto", T.orthogonalize_auto))}
        pick = T.auto_orthogonalizer(rows_, cols_, gpu)
        best = min(("polar_express", "gram_newton_schulz"), key=ms.get)
        ortho.append(dict(shape=[count, rows_, cols_], **{k + "_ms": v for k, v in ms.items()}, auto_pick=pick, faster=best))
        if (rows_, cols_) in tk.measured_table(T.ORTHOGONALIZER_MS, gpu) and ms[pick] > 1.1 * ms[best]:
            wrong.append(f"auto at {count}x{rows_}x{cols_}: {pick} {ms[pick]:.3f} ms, {best} {ms[best]:.3f} ms")
        res.set(orthogonalizers=ortho)
    torch_faster = [f"{r['function']} {'x'.join(map(str, r['shape']))}" for r in rows if r["torch_ms"] < r["triton_ms"]]
    res.set(summary=f"torch faster at {len(torch_faster)} of {len(rows)} shapes ({', '.join(torch_faster) or 'none'}); "
            "auto: " + ", ".join(f"{'x'.join(map(str, o['shape']))} {o['auto_pick']} (faster: {o['faster']})" for o in ortho))
    require(not wrong, "the committed tables pick the slower one: " + "; ".join(wrong))


def make_shards(directory: str, num_shards: int = 2, tokens_per_shard: int = 4_000_000, seed: int = 0,
                mean_doc_len: int = 1000, vocab: int = 50257) -> list[str]:
    """Random-token training shards in the repo's format (train_gpt.write_shard): documents of
    geometric lengths (mean mean_doc_len, at least 2 tokens), each starting with BOS. Returns the paths
    (fineweb_train_<i>.bin); shards already there with the right size are kept."""
    import numpy as np
    import train_gpt as T
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(num_shards):
        path = os.path.join(directory, f"fineweb_train_{i:06d}.bin")
        paths.append(path)
        if os.path.exists(path) and os.path.getsize(path) == T.SHARD_HEADER_BYTES + 2 * tokens_per_shard:
            continue
        tokens = rng.integers(0, T.BOS_ID, tokens_per_shard, dtype=np.int64)  # never BOS inside a document
        lengths = np.maximum(rng.geometric(1.0 / mean_doc_len, tokens_per_shard // 2 + 1), 2)
        starts = np.cumsum(lengths) - lengths
        tokens[starts[starts < tokens_per_shard]] = T.BOS_ID
        T.write_shard(path, tokens)
    return paths



def timing_args():
    """The speedrun preset on generated shards (step_timing's timing of every stage), compiled."""
    import train_gpt as T
    make_shards(SHARD_DIR)
    args = T.parse_args(["--preset", "speedrun", "--train_files", os.path.join(SHARD_DIR, "fineweb_train_*.bin")])
    return dataclasses_replace(args, compile=True)


def check_rank8_warmup(res: Result) -> None:
    """rank 0 of 8's step graphs compiled into the shared caches (speedrun-timing times them next)."""
    import torch
    import train_gpt as T
    sys.path.insert(0, os.path.join(TESTS, "benchmarks"))
    import step_timing
    d = T.setup_distributed()
    stages = []

    def on_stage(r):
        stages.append({k: r[k] for k in ("stage", "warmup_s", "graphs_warmup", "graphs_timed", "cuda_graphs") if k in r})
        res.set(stages=stages, summary=", ".join(f"{x['stage']} {x['warmup_s']:.0f} s" for x in stages)
                + " of compilation and capture (beside other checks: no timings)")

    step_timing.run(timing_args(), d, 2, 2, None, on_stage=on_stage, split_steps=0, as_rank_of=GPUS_PROJECTED)
    total = len(step_timing.stage_table(timing_args()))
    require(len(stages) == total, f"{len(stages)} of {total} stages compiled")
    torch.cuda.synchronize()


def check_speedrun_timing(res: Result) -> None:
    import torch
    import train_gpt as T
    sys.path.insert(0, os.path.join(TESTS, "benchmarks"))
    import step_timing
    args = timing_args()
    d = T.setup_distributed()
    peak = step_timing.peak_tflops(d.device, None)
    warmup, steps = 2, 4
    stages_total = len(step_timing.stage_table(args))
    stages, rank_stages = [], []  # rank_stages: this GPU as rank 0 of GPUS_PROJECTED (step_timing --as_rank_of)
    bus = step_timing.bus_gb_per_s(d.device, None)
    compiles = {"graphs_warmup": 0, "graphs_timed": 0, "graph_breaks": 0}

    def publish():
        data = dict(world_size=d.world_size, accumulation=T.check_batch_split(args, d.world_size), warmup=warmup,
                    steps=steps, peak_tflops=peak, stages=stages, stages_total=stages_total, compiles=compiles,
                    peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
        parts = []
        if rank_stages:
            data["rank_projection"] = q = step_timing.rank_projection(rank_stages, bus)
            data.update(rank_of=GPUS_PROJECTED, rank_stages=rank_stages)
            parts.append(f"as rank 0 of {GPUS_PROJECTED} ({len(rank_stages)} of {stages_total} stages): "
                         + ", ".join(f"{s['stage']} {s['ms']:.0f} ms/step" for s in rank_stages)
                         + f", projected {q['compute_s']:.0f} s" + (f" + {q['comm_s']:.1f} s communication (estimate) = "
                                                                    f"{q['total_s']:.0f} s" if q["total_s"] is not None else ""))
        if stages:
            data["projection"] = p = project(stages)
            parts.append(f"one GPU: {len(stages)} of {stages_total} stages; "
                         + ", ".join(f"{s['stage']} {s['ms']:.0f} ms/step" for s in stages)
                         + f"; projected {p['this_gpu_s']:.0f} s on this GPU, {p[f'{GPUS_PROJECTED}_gpus_s']:.0f} s on "
                         f"{GPUS_PROJECTED}; {compiles['graphs_timed']} recompiles in timed steps")
        data["summary"] = "; ".join(parts)
        res.set(**data)

    def on_rank_stage(r):
        rank_stages.append(r)
        publish()

    def on_stage(r):
        r["mfu"] = mfu(r["flops_per_token"], r["tokens_per_s"], peak)
        for key in compiles:
            compiles[key] += r.pop(key, 0)
        stages.append(r)
        publish()

    publish()
    # rank 0 of 8 first: its graphs were compiled by rank8-warmup, and one GPU's by speedrun-default
    step_timing.run(args, d, 2, 2, peak, on_stage=on_rank_stage, as_rank_of=GPUS_PROJECTED, bus=bus)
    import gc
    gc.collect()  # the first timing's model and step graphs
    torch.cuda.empty_cache()
    step_timing.run(args, d, steps, warmup, peak, on_stage=on_stage)
    require(len(stages) == stages_total == len(rank_stages), f"{len(stages)} and {len(rank_stages)} (as rank 0) of "
            f"{stages_total} stages timed")
    require(compiles["graphs_timed"] == 0 and compiles["graph_breaks"] == 0,
            f"compiles in the timed steps: {compiles}")


def check_speedrun_profile(res: Result) -> None:
    import train_gpt as T
    sys.path.insert(0, os.path.join(TESTS, "benchmarks"))
    import step_timing
    d = T.setup_distributed()
    found = {}

    def on_stage(r):
        found.update(r)
        prof = r.get("profile")
        if prof:
            res.set(profile=prof, summary=f"{prof['what']}: {prof['step_ms']:.0f} ms/step under the profiler, GPU busy "
                    f"{100 * prof['busy']:.0f}%, {prof['kernels_per_step']:.0f} kernels and {prof['ops_per_step']:.0f} aten "
                    f"ops per step")

    step_timing.run(timing_args(), d, 2, 2, None, on_stage=on_stage, profile_stage="stage 1", profile_steps=2,
                    split_steps=0, only=("stage 1",))
    require("profile" in found, "no profile of stage 1")


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


# Tile configurations the kernel-tuning sweep times (the usual Hopper GEMM tiles around the committed
# ones); the FP8 up-projection takes each with K tiles twice as deep, as _fp8_up_config does.
MM_SWEEP = tuple(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=st) for m, n, k, g, w, st in (
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3), (64, 256, 64, 8, 4, 4), (128, 256, 64, 4, 8, 3)))
# FAST_TANH: the loss kernel's sigma through the GPU's approximate tanh (record #89's fast math).
CE_SWEEP = tuple(dict(BLOCK_V=v, num_warps=w, **fast) for v in (1024, 2048, 4096, 8192) for w in (4, 8, 16)
                 for fast in ({}, {"FAST_TANH": True}))
TUNE_TOKENS = (16384, 49152)  # one GPU's micro-batch in stage 1 and in stage 3 on 8 GPUs


def _config_name(cfg: dict) -> str:
    if "BLOCK_V" in cfg:
        return f"V{cfg['BLOCK_V']} w{cfg['num_warps']}" + (" fast-tanh" if cfg.get("FAST_TANH") else "")
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} g{cfg['GROUP_M']} w{cfg['num_warps']} s{cfg['num_stages']}"


def sweep_configs(run, configs, current: dict, bench) -> dict:
    """Time run(config) for the committed config and every one of `configs`; each output is checked
    against the committed config's (relative error < 1e-2), and a config that fails to compile or
    launch (shared memory, registers) is listed with its error. Returns the figures of one kernel."""
    want = run(current)
    rows = []
    for cfg in [current] + [c for c in configs if c != current]:
        try:
            err = max(rel_err(a, b) for a, b in zip(run(cfg), want))
            ms = bench(lambda: run(cfg))
            rows.append(dict(config=_config_name(cfg), ms=ms, error=err, ok=err < 1e-2))
        except Exception as e:  # noqa: BLE001 -- an out-of-resources config is a figure, not a failure
            rows.append(dict(config=_config_name(cfg), ms=None, error=None, ok=False,
                             failed=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"))
    good = [r for r in rows if r["ok"]]
    best = min(good, key=lambda r: r["ms"])
    return dict(current=rows[0]["config"], current_ms=rows[0]["ms"], best=best["config"], best_ms=best["ms"],
                speedup=rows[0]["ms"] / best["ms"], configs=rows)


def check_kernel_tuning(res: Result) -> None:
    """The Triton kernels that dominate a speedrun step (the first H200 profile: the loss kernel, the
    MLP backward's dpre epilogue, the FP8 up-projection) at the speedrun's shapes under every tile
    configuration of MM_SWEEP / CE_SWEEP: the committed config's time, the best, and every figure for
    updating _mm_config, _fp8_up_config and _ce_config. Fails where the committed config is more than
    10% slower than the best."""
    import torch
    import triton.testing
    import triton_kernels as tk

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50)

    def mm(a, b, out, epilogue, cfg, aux=None):  # the MLP kernel with tiles cfg
        grid, args, meta = tk._mm_args(a, b, out, epilogue, aux=aux, config=cfg)
        tk._mm_epilogue_kernel[grid](*args, **meta)
        return out

    D, H, V = 768, 3072, 50304
    g = _gen(12)
    found, slow = {}, []
    for M in TUNE_TOKENS:
        x = torch.randn(M, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(H, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        post = torch.rand(M, H, device="cuda", generator=g).bfloat16()
        dev = x.device
        kernels = {
            "relu2 forward (bf16)": (lambda cfg: (mm(x, w.mT, torch.empty(M, H, device=dev, dtype=x.dtype),
                                                     tk._EPI_RELU2, cfg),),
                                     MM_SWEEP, tk._mm_config(M, H, D, dev)),
            "dpre (MLP backward)": (lambda cfg: (mm(x, w.mT, torch.empty_like(post), tk._EPI_RELU2_GRAD, cfg, aux=post),),
                                    MM_SWEEP, tk._mm_config(M, H, D, dev)),
        }
        x_f8 = (x.float() * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_f8 = (w.float() * 1000).clamp(-448, 448).to(torch.float8_e4m3fn)
        dq, act = torch.full((1,), 1e-5, device=dev), torch.full((1,), 0.05, device=dev)
        fp8_sweep = tuple(dict(c, BLOCK_K=2 * c["BLOCK_K"]) for c in MM_SWEEP)
        kernels["FP8 up-projection"] = (lambda cfg: tk.relu2_fp8_up_triton(x_f8, w_f8, dq, act, config=cfg)[:2],
                                        fp8_sweep, tk._fp8_up_config(M, H, dev))
        logits = torch.empty(M, V, device=dev, dtype=torch.bfloat16).normal_(0, 3, generator=g)
        targets = torch.randint(0, V, (M,), device=dev, generator=g)
        mtp = torch.tensor([1.0, 0.5, 0.25], device=dev)
        def loss_kernel(cfg):  # the loss and the gradient's first 2,048 rows are compared (float64 copies)
            grid, args, meta, (loss, _, grad) = tk.ce_kernel_args(logits, targets, mtp, None, None, 1.0, 256.0,
                                                                  config=cfg)
            tk._ce_mtp_kernel[grid](*args, **meta)
            return loss, grad[:2048]

        kernels["loss (e5m2 gradient)"] = (loss_kernel, CE_SWEEP, tk._ce_config(V, dev))
        for name, (run, configs, current) in kernels.items():
            key = f"{name}, {M} tokens"
            found[key] = sweep_configs(run, configs, current, bench)
            res.set(kernels=found)
            f = found[key]
            if f["speedup"] > 1.1:
                slow.append(f"{key}: {f['current']} {f['current_ms']:.3f} ms, {f['best']} {f['best_ms']:.3f} ms")
        del x, w, post, x_f8, w_f8, logits, kernels
        torch.cuda.empty_cache()
    res.set(kernels=found, summary="; ".join(f"{k}: {f['current_ms']:.3f} ms, best {f['best_ms']:.3f} ({f['best']})"
                                             for k, f in found.items()))
    require(not slow, "committed tiles more than 10% slower than the best: " + "; ".join(slow))


def check_cuda_graphs(res: Result) -> None:
    import torch
    import train_gpt as T
    make_shards(SHARD_DIR)
    args = T.parse_args(["--preset", "speedrun", "--train_files", os.path.join(SHARD_DIR, "fineweb_train_*.bin")])
    device = torch.device("cuda")
    require(T.use_cuda_graphs(args, device), "the speedrun preset on CUDA does not use CUDA graphs")
    torch.manual_seed(0)
    model = T.GPT(args).to(device)
    opt = T.build_optimizer(args, model, device)
    compiled_model = T.compile_model(model)
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    model.quantize_fp8(bootstrap=True)
    accum = T.check_batch_split(args, 1)
    loader = T.DocumentLoader(args.train_files, args.ngram_rows, device=device)
    mtp, prefix = torch.zeros(len(args.stages[0].mtp_start), device=device), torch.zeros((), device=device)
    scale = T.grad_scale_for(args, 1)
    graphs = T.StepGraphs(model, compiled_model, opt, mtp, prefix, scale, device)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), loader.state_dict())

    def restore():  # as train() after its warm-up: in place, so the graphs keep their storages
        model.load_state_dict(saved[0])
        model.zero_grad(set_to_none=True)
        opt.load_state_dict(saved[1])
        loader.load_state_dict(saved[2])

    def run(steps, captured, capture=False):
        losses = []
        for i in steps:
            plan = T.plan_step(args, i)
            model.set_windows(*plan.windows)
            request = T.batch_request(args, plan, accum, device)
            batches = loader.next_step(*request)
            if captured:
                loss = torch.stack(graphs.step(batches, plan, T.step_graph_key(plan, request, accum), capture=capture))
                opt.step(**T.optimizer_schedule(plan))  # as Trainer.step does
            else:
                loss = torch.stack(T.train_step(compiled_model, opt, batches, plan, mtp, prefix, scale, device))
            if i == T.untie_step(args):
                opt.untie()
            model.quantize_fp8(bootstrap=i < T.FP8_BOOTSTRAP_STEPS)
            losses.append(loss)
        torch.cuda.synchronize()
        return {**{f"loss {s}": x for s, x in zip(steps, losses)},
                **{n: p.detach().clone() for n, p in model.named_parameters()}}

    steps = [0, 1, 423, 424]
    t = time.perf_counter()
    plain = run(steps, False)  # compiles both shapes
    compile_s = time.perf_counter() - t
    restore()
    again = run(steps, False)
    restore()
    graphed = run(steps, True, capture=True)
    require(not graphs.failure, f"capture: {graphs.failure}")
    require(graphs.captured() == 2, f"{graphs.captured()} keys captured, expected 2")
    exact = [k for k in plain if torch.equal(graphed[k], plain[k])]
    reproducible = [k for k in plain if torch.equal(again[k], plain[k])]
    ms = {}
    for stage, first in (("stage 1", 2), ("stage 2", 425)):
        for captured in (False, True):
            restore()
            run([first - 2, first - 1] if first > 2 else [0, 1], captured)
            t = time.perf_counter()
            run(range(first, first + 8), captured)
            ms[f"{stage} {'graphs' if captured else 'no graphs'}"] = (time.perf_counter() - t) / 8 * 1000
    res.set(compile_s=compile_s, ms_per_step=ms, exact=len(exact), reproducible=len(reproducible), compared=len(plain),
            losses={k: v.tolist() for k, v in graphed.items() if k.startswith("loss")},
            summary=f"{len(exact)} of {len(plain)} losses and parameters bitwise equal with graphs ({len(reproducible)} "
            "between two uncaptured runs); ms/step " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    why = T.replay_mismatch(graphed, plain, again)
    require(not why, f"graphs vs no graphs: {why}")


if __name__ == "__main__":
    sys.exit(main(CHECKS, check_function, __doc__, lease=LEASE, lease_limits_s=LEASE_LIMITS_S))
