"""The GPU check: every CUDA path of train_gpt.py and triton_kernels.py on one CUDA GPU, then the
speedrun preset's step times and a short profile, written to records/gpu_check/<date>_<gpu>.md and
.json (tests/README.md, "GPU check").

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
and within which tolerance, the CUDA paths covered, group) and one function per check,
check_<name with _>, in the table's order. A new check is one Check row and one function. The
runner and the report writer are in gpu_check_runner.py (its `main` is this file's command line, and
each check's process runs this file with --run-one); the coverage scan in gpu_check_coverage.py.

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
from gpu_check_runner import (GPUS_PROJECTED, REPO, SHARD_DIR, TESTS, Check, Result, check_env, last_error_line,
                              main, mfu, project)

# ----------------------------------------------------------------------------------------------
# The checks: name, time cap, what each proves, what it covers
# ----------------------------------------------------------------------------------------------

K, OP = "kernel:", "op:speedrun::"
TK, TG = "cuda:triton_kernels.py:", "cuda:train_gpt.py:"

CHECKS: tuple[Check, ...] = (
    # -- kernels: every Triton kernel, the FP8 ops and flex attention against references ------------------
    Check("triton-symmetric", 120, "XXT, XTX, ba_plus_cAA kernels on the NorMuon banks (64x256x768, 24x768x768, "
          "24x3072x768) in bf16 and fp32 against float64; outputs bitwise symmetric; the public functions (which "
          "may take torch at a listed shape) and Polar Express on CUDA against the CPU path; the optimizer's "
          "compiled NorMuon update (inductor, fullgraph) with every product on the kernel, traced into its graph, "
          "against the same update eager (the vo and mlp banks: XXT and XTX)",
          (K + "_sym_mm_kernel", TK + "XXT", TK + "XTX", TK + "ba_plus_cAA", TK + "gpu_name_of")),
    Check("triton-mlp", 60, "relu2_mlp forward and backward (49152 x 768 -> 3072) in bf16 and fp32 against float64",
          (K + "_mm_epilogue_kernel", K + "_grouped_tile", OP + "relu2_mlp_fwd", OP + "relu2_mlp_bwd",
           TK + "relu2_mlp")),
    Check("triton-cross-entropy", 60, "softcapped_ce_mtp (8192 x 50304, 3 MTP weights, the prefix term) loss and the "
          "record's gradient in bf16 and fp32 against the float64 reference and its CPU twin run on the GPU; the "
          "FP8 head's e5m2 gradient against the float64 gradient rounded to e5m2, saturating; the CPU head fused "
          "with its loss, run on the GPU, against the kernel through x @ w",
          (K + "_ce_mtp_kernel", K + "_tanh", K + "_round_to_bf16", K + "_softcap_sigma", OP + "softcapped_ce_mtp_fwd",
           OP + "softcapped_ce_mtp_rows", OP + "softcapped_ce_mtp_head_rows", TK + "softcapped_ce_mtp", TK + "softcapped_ce_mtp_e5m2",
           TK + "ce_kernel_args")),
    Check("triton-transpose", 30, "transpose_copy and transpose_add of the LM head (768 x 50304) in bf16 and fp32, "
          "and of float8 operands as bytes, exact",
          (K + "_transpose_kernel", OP + "transpose_copy", OP + "transpose_add", TK + "transpose_copy", TK + "transpose_add")),
    Check("fp8-up", 40, "relu2_fp8_up kernel (49152 x 768 -> 3072, e4m3): with fast accumulation (the record's) "
          "within the bound of a 13-bit running sum of the float64 result; with fp32 promotion within it too and "
          "at most half the fast error against the fp32 reference; the e4m3 copy and the amax, and the partial "
          "maxima the FP8 MLP reduces after all layers (their count, their max equal to the amax)",
          (K + "_fp8_relu2_kernel", TK + "fp8_up_kernel_args", TK + "relu2_fp8_up_partials",
           TK + "relu2_fp8_up_partial_count")),
    Check("fp8-head", 60, "the FP8 LM head with the loss (16384 x 768 x 50304): loss, e5m2 gradient, dx and dw "
          "through torch._scaled_mm against the emulation; the plain fp8_mm op too",
          (OP + "fp8_mm", OP + "fp8_mm_backward", OP + "fp8_head_loss", OP + "fp8_head_loss_backward",
           TG + "fp8_matmul_grads")),
    Check("fp8-mlp", 30, "FP8MLPState / speedrun::fp8_mlp (16384 x 768 -> 3072, 3 layers: scales at offsets 0, 16, "
          "32 bytes) forward and backward against its emulation and float64",
          (OP + "fp8_mlp",)),
    Check("flex-attention", 80, "flex_attention forward and backward through the one compiled flex_attention, with "
          "the record's block masks (causal, window, documents, paired slots), against SDPA with the dense mask; "
          "no host sync in the eager call",
          (TG + "flex_attend", TG + "block_mask_indices")),
    Check("attention-kernels", 150, "per layer kind of the speedrun (plain short, plain long, paired short) at stage "
          "1's and stage 3's micro-batch (16,384 and 49,152 tokens, documents cut at 896 / 2,048): flex_attention "
          "with the loader's host-built block masks against torch's varlen_attn, forward + backward ms each, the "
          "faster per kind (ATTENTION_KERNEL_CHOICE); varlen against fp32 SDPA with the dense mask",
          (TG + "attention_kernels",)),
    # -- model: the compiled model against an independent reference, the sync-free step -----------------
    Check("compiled-model", 350, "the speedrun model (FP8 on, near its init: loss near ln(vocab)) compiled whole "
          "(fullgraph, masks as inputs) against the eager model with fp32 SDPA and dense masks: loss and every "
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
    # -- run: NCCL, the script end to end, the kernel choice table ------------------------------------
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
    # -- speedrun: the preset's step times and a profile ------------------------------------------------
    Check("speedrun-timing", 500, "the speedrun preset on one GPU (accumulation 8), generated shards: 2 warm-up + "
          "4 timed steps per stage; compile time, recompiles, ms/step, tokens/s, MFU, peak memory, projections; "
          "a torch.profiler trace of 2 stage-1 steps (GPU busy fraction, top kernels, host ops), through the step "
          "train() runs (Trainer.step: CUDA graphs captured in the warm-up steps); then this GPU as rank 0 of 8 "
          "(step_timing --as_rank_of 8), 2 warm-up + 2 timed steps per stage: its ms/step, bytes sent and the 8-GPU "
          "projection from them", (TG + "Trainer.__init__",), "speedrun"),
    # -- tune: tile configurations of the kernels that dominate a step -----------------------------------
    Check("kernel-tuning", 400, "the loss kernel, the dpre epilogue, the bf16 relu2 forward and the FP8 up-projection "
          "at 16,384 and 49,152 tokens under every tile configuration of MM_SWEEP / CE_SWEEP: committed against the "
          "best (within 10%), every timing for updating the config functions",
          (K + "_tanh_approx", OP + "relu2_mlp_fwd", OP + "softcapped_ce_mtp_fwd", TK + "fp8_up_kernel_args"), "tune"),
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
    # one graph (a graph break is an error), against the eager update from the same state
    import triton.testing
    compiled_ms = {}
    normuon, _ = T.update_functions(compile=True)
    hp = torch.tensor([0.02, 0.0, 0.95, 0.95, 0.0], device="cuda")
    saved, tk.USE_KERNEL_TABLE = tk.USE_KERNEL_TABLE, False
    try:
        for bank, (k, rows, cols) in (("vo", banks["vo"]), ("mlp", banks["mlp"])):  # XXT, XTX: 2 compiles
            side = (k, 1, cols) if rows < cols else (k, rows, 1)
            state = [torch.randn(k, rows, cols, device="cuda", generator=g), torch.zeros(k, rows, cols, device="cuda"),
                     torch.zeros(side, device="cuda"),
                     torch.randn(k, rows, cols, device="cuda", generator=g)]  # an fp32 parameter: the update exact
            runs = {}
            for how, fn in (("eager", T._normuon_update), ("compiled", normuon)):
                grad, buf, sm, p = (t.clone() for t in state)
                fn(grad, buf, sm, p, None, torch.ones(k, 1, 1, device="cuda"), hp, T.polar_express)
                runs[how] = p
            e = rel_err(runs["compiled"] - state[3], runs["eager"] - state[3])
            compiled_ms[bank] = triton.testing.do_bench(
                lambda: normuon(*state, None, torch.ones(k, 1, 1, device="cuda"), hp, T.polar_express), warmup=10, rep=50)
            require(e < 5e-2, f"compiled NorMuon update, {bank} bank: the update differs from eager by {e:.2e}")
            worst[f"compiled_update_{bank}"] = e
    finally:
        tk.USE_KERNEL_TABLE = saved
    res.set(errors=worst, compiled_update_ms=compiled_ms,
            summary=f"worst relative error bf16 {max(v for k, v in worst.items() if 'bf16' in k):.1e}, "
            f"fp32 {max(v for k, v in worst.items() if 'fp32' in k):.1e}; Polar Express / auto CUDA vs CPU "
            f"{max(v for k, v in worst.items() if 'polar' in k or 'auto' in k):.1e}; compiled update (kernels "
            f"traced) vs eager {max(v for k, v in worst.items() if 'compiled' in k):.1e}")


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


def check_triton_cross_entropy(res: Result) -> None:
    import torch
    import triton_kernels as tk
    T_, V = 8192, 50304
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
    res.set(errors=errs, summary=f"loss {max(errs['loss_bf16'], errs['loss_fp32']):.1e}, gradient bf16 "
            f"{errs['grad_bf16']:.1e}, fp32 {errs['grad_fp32']:.1e}, kernel vs twin {errs['twin_grad_bf16']:.1e}, "
            f"vs the fused CPU head dw {errs['head_dw_bf16']:.1e}; "
            f"e5m2 gradient {100 * errs['e5m2_differ']:.3f}% off float64 (saturated: {100 * errs['e5m2_saturated_differ']:.3f}%)")


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


class _Emulated:
    """Within the block, the FP8 ops take their non-native path: train_gpt's _scaled_matmul emulation
    (dequantise, fp32 matmul) and the up-projection's torch reference instead of the kernel."""

    def __enter__(self):
        import train_gpt as T
        import triton_kernels as tk
        self.saved = (T._native_fp8, tk.relu2_fp8_up_partials)
        T._native_fp8 = lambda device: False

        def up_reference(x_f8, w_up_f8, dequant, act_scale, fast_accum=True):  # its amax as one partial maximum
            post, post_f8, amax = tk.relu2_fp8_up_reference(x_f8, w_up_f8, dequant, act_scale)
            return post, post_f8, amax.reshape(1)
        tk.relu2_fp8_up_partials = up_reference

    def __exit__(self, *exc):
        import train_gpt as T
        import triton_kernels as tk
        T._native_fp8, tk.relu2_fp8_up_partials = self.saved


def check_fp8_head(res: Result) -> None:
    import torch
    import train_gpt as T
    require(T._native_fp8(torch.device("cuda")), "this GPU has no FP8 tensor cores (compute capability < 8.9)")
    M, K_, N = 16384, 768, 50304
    g = _gen(6)
    x = T.norm(torch.randn(M, K_, device="cuda", generator=g)).bfloat16()
    w = (0.005 * torch.randn(K_, N, device="cuda", generator=g)).bfloat16()
    targets = torch.randint(0, 50257, (M,), device="cuda", generator=g)
    prefix = torch.randint(-1, 50257, (M,), device="cuda", generator=g)
    mtp, pi = torch.tensor([1.0, 0.5, 0.25], device="cuda"), torch.tensor(0.25, device="cuda")
    grad_scale = 1 / 8
    scales = (T.FP8_HEAD_X_SCALE, T.FP8_HEAD_W_SCALE, T.FP8_HEAD_GRAD_SCALE * grad_scale)

    def head():
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, _, g8 = T.fp8_head_loss(a, b, T.fp8_head_input(a), T.fp8_head_weight(b).T, targets, mtp, prefix,
                                      pi, *scales, grad_scale)
        (loss.sum() * grad_scale).backward()
        return loss, g8.float(), a.grad, b.grad

    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16()

    def mm():
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = T.fp8_matmul(a, b, T.FP8_HEAD_X_SCALE, T.FP8_HEAD_W_SCALE, T.FP8_HEAD_GRAD_SCALE)
        y.backward(dy)
        return y, a.grad, b.grad

    native = head()
    with _Emulated():
        emulated = head()
    errs = {what: rel_err(n, e) for what, n, e in zip(("loss", "dlogits_e5m2", "dx", "dw"), native, emulated)}
    errs["e5m2_differ"] = float((native[1] != emulated[1]).double().mean())
    native, emulated = mm(), None
    with _Emulated():
        emulated = mm()
    errs.update({f"mm_{what}": rel_err(n, e) for what, n, e in zip(("y", "dx", "dw"), native, emulated)})
    res.set(errors=errs, summary="native vs emulation: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    require(errs["loss"] < 1e-3, f"fp8_head_loss loss: native vs emulation {errs['loss']:.2e}")
    # the logits differ by the forward's fast accumulation (~1e-3), so a few e5m2 gradient values (2
    # mantissa bits: 25% apart) round the other way; dx and dw sum those
    require(errs["e5m2_differ"] < 0.05, f"fp8 head: {100 * errs['e5m2_differ']:.2f}% of e5m2 gradient values differ")
    for what, tol in (("dlogits_e5m2", 0.1), ("dx", 5e-2), ("dw", 5e-2), ("mm_y", 1e-2), ("mm_dx", 1e-2), ("mm_dw", 1e-2)):
        require(errs[what] < tol, f"fp8 head {what}: native vs emulation relative difference {errs[what]:.2e}")


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
    act = state.act_scale.clone()
    layer = L - 1  # its scales sit 32 bytes into their buffers

    def run():
        state.act_scale.copy_(act)
        ins = [t.clone().requires_grad_() for t in (x, bank[2 * layer], bank[2 * layer + 1])]
        y = state.mlp(layer, *ins)[0]
        y.backward(dy)
        return [y] + [t.grad for t in ins]

    native = run()
    with _Emulated():
        emulated = run()
    names = ("y", "dx", "dw_up", "dw_down")
    errs = {n: rel_err(a, b) for n, a, b in zip(names, native, emulated)}
    w_up, w_down = bank[2 * layer].double(), bank[2 * layer + 1].double()
    exact = rel_err(native[0], torch.relu(x.double() @ w_up.T) ** 2 @ w_down)
    res.set(errors=errs, vs_exact=exact, summary=f"{L} layers; native vs emulation " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
            + f"; y vs float64 MLP {exact:.1e}")
    for n, e in errs.items():
        require(e < 2e-2, f"fp8_mlp {n}: native vs emulation relative difference {e:.2e}")
    require(exact < 0.08, f"fp8_mlp y vs the float64 MLP: {exact:.2e}")  # the CPU test's bound (tests/test_fp8.py)


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


def check_attention_kernels(res: Result) -> None:
    import torch
    import torch.nn.functional as F
    import triton
    import train_gpt as T
    H, hd, scale = 6, 128, 0.12
    kinds = {"plain short": (False, 1), "plain long": (True, 1), "paired short": (False, 2)}

    def qkv(n, heads, grad=True):  # (n, heads, hd) bf16 leaves
        return [torch.randn(n, heads, hd, device="cuda").bfloat16().requires_grad_(grad) for _ in range(3)]

    def as_seq(t):  # (n, heads, hd) -> (1, heads, n, hd), flex's and SDPA's layout
        return t.transpose(0, 1).unsqueeze(0)

    # correctness at 8,192 tokens: varlen against fp32 SDPA with the dense mask (bf16 SDPA: what bf16 costs)
    errs = {}
    cu, doc = _documents(8192, 896, 11)
    for name, (long, r) in kinds.items():
        window = 384 if long else 128
        q, k, v = qkv(8192 * r, H // r)
        dy = torch.randn_like(q)
        y = T.varlen_attend(q, k, v, T.VarlenMask((cu * r).cuda(), 896 * r, window), scale)
        y.backward(dy)
        dense = T.dense_attention_mask(doc.cuda(), torch.tensor(window, device="cuda"), r)
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        y32 = F.scaled_dot_product_attention(*map(as_seq, ref), attn_mask=dense, scale=scale)
        y32.backward(as_seq(dy.float()))
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        y16 = F.scaled_dot_product_attention(*map(as_seq, low), attn_mask=dense, scale=scale)
        y16.backward(as_seq(dy))
        for what, a, b, c in (("y", as_seq(y), y32, y16), ("dq", q.grad, ref[0].grad, low[0].grad),
                              ("dk", k.grad, ref[1].grad, low[1].grad), ("dv", v.grad, ref[2].grad, low[2].grad)):
            e, e16 = rel_err(a, b), rel_err(c, b)
            errs[f"{name}: {what}"] = e
            require(e < max(2 * e16, 2e-3) and e < TOL["bf16"],
                    f"varlen attention {name} {what}: relative error {e:.2e} (SDPA in bf16: {e16:.2e})")
        del q, k, v, ref, low, y, y32, y16, dense
    # timing: forward + backward per kind at the stages' micro-batches, masks built on the host as the loader does
    times, total = {}, {}
    for stage, (T_, max_len, windows) in {"stage 1": (16384, 896, (128, 384)), "stage 3": (49152, 2048, (640, 1408))}.items():
        cu, doc = _documents(T_, max_len, 12)
        for name, (long, r) in kinds.items():
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
            del q, k, v, dy, bm
    table = {kind: min(ms, key=ms.get) for kind, ms in total.items()}
    res.set(errors=errs, times_ms=times, choice={str(k): v for k, v in table.items()},
            summary="; ".join(f"{k} flex {v['flex']:.2f} / varlen {v['varlen']:.2f} ms" for k, v in times.items())
            + f"; worst varlen error {max(errs.values()):.1e}; ATTENTION_KERNEL_CHOICE entry: {table}")


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
        return T.make_batch(tokens.cpu().numpy().astype("uint16"), args.bigram_vocab_size).to(torch.device("cuda"))

    b = batch(3)
    mtp = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    prefix = torch.tensor(0.25, device="cuda")

    def run(fn, b, kernel):
        model.zero_grad(set_to_none=True)
        model.fp8_mlp.load_state_dict(fp8_state)  # the forward moves the delayed activation scales
        masks = model.attention_masks(b.cu_seqlens, T_, kernel)
        loss, _ = fn(b.inputs, b.targets, b.cu_seqlens, b.bigram_ids, mtp_weights=mtp, loss_scale=1 / 8,
                     prefix_weight=prefix, masks=masks)
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_r, grads_r = run(model, b, "sdpa_fp32")  # the reference: eager, fp32 SDPA with the dense masks
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
        per_token = float(model(b.inputs, b.targets, b.cu_seqlens, b.bigram_ids,
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
    loader = T.DocumentLoader(args.train_files, args.bigram_vocab_size, device=device)
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



def check_speedrun_timing(res: Result) -> None:
    import torch
    import train_gpt as T
    sys.path.insert(0, os.path.join(TESTS, "benchmarks"))
    import step_timing
    make_shards(SHARD_DIR)
    args = T.parse_args(["--preset", "speedrun", "--train_files", os.path.join(SHARD_DIR, "fineweb_train_*.bin")])
    d = T.setup_distributed()
    peak = step_timing.peak_tflops(d.device, None)
    warmup, steps = 2, 4
    stages_total = len(step_timing.stage_table(args))
    stages, rank_stages = [], []  # rank_stages: this GPU as rank 0 of GPUS_PROJECTED (step_timing --as_rank_of)
    bus = step_timing.bus_gb_per_s(d.device, None)
    compiles = {"graphs_warmup": 0, "graphs_timed": 0, "graph_breaks": 0}

    def publish(profile=None):
        data = dict(world_size=d.world_size, accumulation=T.check_batch_split(args, d.world_size), warmup=warmup,
                    steps=steps, peak_tflops=peak, stages=stages, stages_total=stages_total, compiles=compiles,
                    peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
        if profile:
            data["profile"] = profile
        if stages:
            data["projection"] = project(stages)
            p = data["projection"]
            data["summary"] = (f"{len(stages)} of {stages_total} stages; "
                               + ", ".join(f"{s['stage']} {s['ms']:.0f} ms/step" for s in stages)
                               + f"; projected {p['this_gpu_s']:.0f} s on this GPU, "
                               f"{p[f'{GPUS_PROJECTED}_gpus_s']:.0f} s on {GPUS_PROJECTED}; "
                               f"{compiles['graphs_timed']} recompiles in timed steps")
        if rank_stages:
            data["rank_projection"] = q = step_timing.rank_projection(rank_stages, bus)
            data.update(rank_of=GPUS_PROJECTED, rank_stages=rank_stages)
            data["summary"] = (data.get("summary", "") + f"; as rank 0 of {GPUS_PROJECTED} ({len(rank_stages)} stages): "
                               f"{q['compute_s']:.0f} s" + (f" + {q['comm_s']:.1f} s communication (estimate) = "
                                                            f"{q['total_s']:.0f} s" if q["total_s"] is not None else ""))
        res.set(**data)

    def on_stage(r):
        r["mfu"] = mfu(r["flops_per_token"], r["tokens_per_s"], peak)
        for key in compiles:
            compiles[key] += r.pop(key, 0)
        stages.append(r)
        publish(r.pop("profile", None) or res.data.get("profile"))

    publish()
    step_timing.run(dataclasses_replace(args, compile=True), d, steps, warmup, peak, on_stage=on_stage,
                    profile_stage="stage 1", profile_steps=2)

    def on_rank_stage(r):
        rank_stages.append(r)
        publish(res.data.get("profile"))

    import gc
    gc.collect()  # the first timing's model and step graphs
    torch.cuda.empty_cache()
    step_timing.run(dataclasses_replace(args, compile=True), d, 2, 2, peak, on_stage=on_rank_stage,
                    as_rank_of=GPUS_PROJECTED, bus=bus)
    require(len(stages) == stages_total == len(rank_stages), f"{len(stages)} and {len(rank_stages)} (as rank 0) of "
            f"{stages_total} stages timed")
    require(compiles["graphs_timed"] == 0 and compiles["graph_breaks"] == 0,
            f"compiles in the timed steps: {compiles}")


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
    loader = T.DocumentLoader(args.train_files, args.bigram_vocab_size, device=device)
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
                opt.step(plan.do_adam, lr_scale=plan.lr_mult, momentum=plan.momentum)  # as Trainer.step does
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
    sys.exit(main(CHECKS, check_function, __doc__))
