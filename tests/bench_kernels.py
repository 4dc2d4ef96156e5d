"""Time every Triton kernel against its torch equivalent at the speedrun shapes (CUDA only), and the
CPU head fused with its loss against the unfused head (a CPU).

    python tests/bench_kernels.py              # all kernels
    python tests/bench_kernels.py --only ce    # one group: sym, mlp, fp8, ce, transpose
    python tests/bench_kernels.py --only ce_limits   # the loss kernel's limits from its sm_90 SASS, on any machine
    python tests/bench_kernels.py --only cpu_head   # runs on a CPU

The symmetric products are timed at the NorMuon banks' shapes on one rank of 8 and on 1 GPU, for
triton_kernels.KERNEL_TIMES (which of the two each measured GPU runs at each shape). The FP8 up-projection
is timed with the record's fast accumulation and with fp32 promotion; the loss kernel with a bf16 and
with the FP8 head's e5m2 gradient, and alone (one launch, no autograd) against the GPU's peak memory
bandwidth: its bytes (the bf16 logits read twice, the gradient written once) per second, and that
as a fraction of the peak (PEAK_BANDWIDTH_GBS, by GPU name; omitted for a GPU not listed there).

Prints milliseconds, achieved TFLOP/s (matmuls) or GB/s (memory-bound kernels) and the speed ratio
torch / triton. For the symmetric kernels TFLOP/s counts the full product (2 m^2 k), so the
triangle trick shows up as a higher "effective" rate. No assertions: this file only measures.
On a machine without a CUDA GPU it says so and exits 0, but for --only cpu_head: the demo model's head
(128 x 50,304, fp32 and bf16) fused with its loss (softcapped_ce_mtp_head_rows) against x @ w and
softcapped_ce_mtp, forward and backward, in alternating rounds (a shared machine's speed drifts):
median milliseconds, and the kernel's CPU time and page faults per call; and for --only ce_limits.

The loss kernel's limits (--only ce prints them first, for the kernel the GPU ran; --only ce_limits on any
machine, for the kernel compiled for sm_90 without a GPU, at an H100's and an H200's figures): from its own
SASS, the instructions and the MUFU operations (exp, reciprocal, tanh) per logit in each of its two passes
over a row (each pass a loop; a thread handles BLOCK_V / (32 x num_warps) logits per iteration) and its
registers, hence programs per SM; then the time each limit allows: issue (one warp instruction per cycle
per SM sub-partition, 4 per SM), MUFU (16 per cycle per SM), memory (its bytes at the peak bandwidth), at
the SM clock and SM count; and which one stops it (loss_kernel_limits). --json PATH writes the loss
kernel's figures as they are measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _row(name: str, ms_triton: float, ms_torch: float, work: float, unit: str) -> None:
    rate = lambda ms: work / (ms * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9)
    print(f"{name:<44} triton {ms_triton:8.3f} ms {rate(ms_triton):8.1f} {unit:<7} | "
          f"torch {ms_torch:8.3f} ms {rate(ms_torch):8.1f} {unit:<7} | speedup x{ms_torch / ms_triton:5.2f}")


# (function, batch, rows, cols of its A) of Polar Express at the speedrun's banks: qk (256 x 768), vo
# (768 x 768) and the tall MLP matrices (3072 x 768, through XTX), per rank of 8 GPUs and on 1 GPU, and
# the shapes of the first H100 measurement (KERNEL_TIMES["H100"]).
SYM_SHAPES = (("XXT", 8, 256, 768), ("ba_plus_cAA", 8, 256, 256), ("XXT", 3, 768, 768), ("ba_plus_cAA", 3, 768, 768),
              ("XTX", 3, 3072, 768), ("XXT", 64, 256, 768), ("ba_plus_cAA", 64, 256, 256), ("XXT", 24, 768, 768),
              ("ba_plus_cAA", 24, 768, 768), ("XTX", 24, 3072, 768), ("XXT", 8, 768, 768), ("XTX", 8, 768, 768),
              ("ba_plus_cAA", 8, 768, 768), ("XXT", 3, 768, 3072))


def time_sym(tk, bench, shapes=SYM_SHAPES) -> list[tuple]:
    """(function, batch, rows, cols, Triton ms, torch ms) at each shape, the kernels called directly."""
    dev, bf16 = "cuda", torch.bfloat16
    rows = []
    for name, b, m, n in shapes:
        A = torch.randn(b, m, n, device=dev, dtype=bf16) / n**0.5
        if name == "ba_plus_cAA":
            A = A @ A.mT  # symmetric
            out = torch.empty_like(A)
            t = bench(lambda: tk.ba_plus_cAA_triton(A, 1.5, -2.0, out))
            r = bench(lambda: torch.baddbmm(A, A, A, beta=-2.0, alpha=1.5, out=out))
        else:
            k = m if name == "XXT" else n
            out = torch.empty(b, k, k, device=dev, dtype=bf16)
            kernel = tk.XXT_triton if name == "XXT" else tk.XTX_triton
            t = bench(lambda: kernel(A, out))
            r = bench(lambda: torch.matmul(A, A.mT, out=out) if name == "XXT" else torch.matmul(A.mT, A, out=out))
        rows.append((name, b, m, n, t, r))
    return rows


def bench_sym(tk, bench) -> None:
    for name, b, m, n, t, r in time_sym(tk, bench):
        k = n if name == "XTX" else m
        flops = 2 * b * k * k * (m if name == "XTX" else n)
        _row(f"{name} {b}x{m}x{n}", t, r, flops, "TFLOP/s")


def bench_fp8(tk, bench, tokens: int) -> None:
    """The FP8 up-projection kernel, fast accumulation (the record's) against fp32 promotion."""
    dev = "cuda"
    T, D, H = tokens, 768, 3072
    x_f8 = torch.randn(T, D, device=dev).clamp(-4, 4).mul(100).to(torch.float8_e4m3fn)
    w_f8 = torch.randn(H, D, device=dev).mul(100).to(torch.float8_e4m3fn)
    dequant = torch.full((1,), 1e-4, device=dev)
    act = torch.full((1,), 1.0, device=dev)
    fast = bench(lambda: tk.relu2_fp8_up_triton(x_f8, w_f8, dequant, act, fast_accum=True))
    precise = bench(lambda: tk.relu2_fp8_up_triton(x_f8, w_f8, dequant, act, fast_accum=False))
    flops = 2 * T * D * H
    print(f"{'relu2_fp8_up ' + f'{T}x{D}x{H}':<44} fast accumulation {fast:8.3f} ms {flops / fast / 1e9:8.1f} TFLOP/s | "
          f"fp32 promotion {precise:8.3f} ms {flops / precise / 1e9:8.1f} TFLOP/s | cost x{precise / fast:5.2f}")


def bench_mlp(tk, bench, tokens: int) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    T, D, H = tokens, 768, 3072
    x = torch.randn(T, D, device=dev, dtype=bf16, requires_grad=True)
    wu = (torch.randn(H, D, device=dev) / D**0.5).to(bf16).requires_grad_(True)
    wd = (torch.randn(H, D, device=dev) / H**0.5).to(bf16).requires_grad_(True)
    ref = torch.compile(tk.relu2_mlp_reference)
    flops_fwd = 2 * 2 * T * D * H
    _row(f"relu2_mlp fwd {T}x{D}x{H}", bench(lambda: tk.relu2_mlp(x, wu, wd)), bench(lambda: ref(x, wu, wd)),
         flops_fwd, "TFLOP/s")
    dy = torch.randn(T, D, device=dev, dtype=bf16)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(x, wu, wd), (x, wu, wd), dy)

    _row(f"relu2_mlp fwd+bwd {T}x{D}x{H}", bench(fwd_bwd(tk.relu2_mlp)), bench(fwd_bwd(ref)), 3 * flops_fwd, "TFLOP/s")


# Peak memory bandwidth in GB/s by a substring of torch.cuda.get_device_name() (the vendors' figures:
# H100 SXM 3.35 TB/s of HBM3, H200 4.8 TB/s of HBM3e). An H100 PCIe or NVL is named otherwise: no figure.
PEAK_BANDWIDTH_GBS = {"H100 80GB HBM3": 3350.0, "H200": 4800.0}


def peak_bandwidth_gbs(gpu_name: str) -> float | None:
    return next((gbs for key, gbs in PEAK_BANDWIDTH_GBS.items() if key in gpu_name), None)


# SM clock (GHz, the boost clock of the data sheets) by a substring of the GPU's name, where torch does not
# report one (an H100 SXM and an H200 SXM: 1.98 GHz, 132 SMs)
SM_CLOCK_GHZ = {"H100": 1.98, "H200": 1.98}
LATENCY_NS = 700.0  # a global load's latency assumed for Little's law (HBM3 on Hopper: roughly 500 to 800 ns)


def sass_loops(sass: str) -> list[dict]:
    """The loops of a kernel's SASS (triton.tools.disasm.get_sass's listing: "LBB1:" labels, one instruction
    a line after its control codes): for each backward branch, the instructions from its target label to
    it, counted by opcode (predicates and modifiers kept: MUFU.EX2, LDG.E.128), in order of appearance."""
    lines = [ln.strip() for ln in sass.splitlines()]
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if re.fullmatch(r"[.\w$]+:", ln)}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\s+(?:`?\(?)([.\w$]+)", ln)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        ops = {}
        for body in lines[labels[m.group(1)] + 1: i + 1]:
            ins = body.split("\t", 1)[1] if "\t" in body else body
            ins = re.sub(r"^@!?U?P\w+\s+", "", ins.strip())
            if not ins or ins.endswith(":") or ins.startswith("."):
                continue
            op = ins.split()[0].rstrip(";")
            ops[op] = ops.get(op, 0) + 1
        loops.append(dict(label=m.group(1), instructions=sum(ops.values()), ops=ops))
    return loops


def count_ops(ops: dict, prefixes) -> int:
    return sum(n for op, n in ops.items() if any(op.startswith(p) for p in prefixes))


def programs_per_sm(regs: int, threads: int, shared: int = 0) -> int:
    """Resident programs per SM on Hopper: 64K registers (allocated per warp in units of 256, i.e. 8 per
    thread), 2048 threads, 32 blocks, 228 KB of shared memory."""
    regs = max(8, -(-regs // 8) * 8)
    by_regs = 65536 // (regs * threads)
    by_shared = (228 * 1024) // shared if shared else 32
    return max(0, min(by_regs, 2048 // threads, 32, by_shared))


def loss_kernel_limits(sass: str, rows: int, vocab: int, block_v: int, num_warps: int, grad_bytes: int, regs: int,
                       sms: int, clock_ghz: float, peak_gbs: float | None, measured_ms: float | None = None,
                       shared: int = 0) -> dict:
    """What bounds the loss kernel (one program per row, two passes over the row: the sum of exp, then the
    gradient), from its SASS: its two largest loops are the passes. Per logit: instructions, MUFU ops
    (MUFU.*), loads; times at the SM clock: issue = instructions x logits / (sms x 128 per cycle), MUFU =
    MUFU ops x logits / (sms x 16 per cycle), memory = bytes / peak (the row read in each pass, bf16, and
    the gradient written once), all counting the masked tail of the last block; the bytes a SM has in
    flight when all its warps have issued one iteration's loads, against Little's law at LATENCY_NS.
    `bound` names the largest limit; with measured_ms, `verdict` says which stops the kernel."""
    loops = sorted(sass_loops(sass), key=lambda lp: -lp["instructions"])[:2]
    passes = sorted(loops, key=lambda lp: sass.find(lp["label"] + ":"))
    per_thread = block_v / (32 * num_warps)  # logits a thread handles per iteration
    processed = rows * math.ceil(vocab / block_v) * block_v  # the masked tail of each row's last block too
    clock = clock_ghz * 1e9
    out = dict(rows=rows, vocab=vocab, block_v=block_v, num_warps=num_warps, regs=regs, sms=sms, clock_ghz=clock_ghz,
               programs_per_sm=programs_per_sm(regs, 32 * num_warps, shared), passes=[])
    for lp in passes:
        out["passes"].append(dict(instructions_per_logit=lp["instructions"] / per_thread,
                                  mufu_per_logit=count_ops(lp["ops"], ("MUFU",)) / per_thread,
                                  loads_per_iteration=count_ops(lp["ops"], ("LDG",)),
                                  load_bytes_per_iteration=sum(n * (int(op.rsplit(".", 1)[1]) // 8 if op.rsplit(".", 1)[1].isdigit() else 4)
                                                               for op, n in lp["ops"].items() if op.startswith("LDG"))))
    instr = sum(p["instructions_per_logit"] for p in out["passes"])
    mufu = sum(p["mufu_per_logit"] for p in out["passes"])
    nbytes = rows * vocab * (2 * 2 + grad_bytes)
    out.update(instructions_per_logit=instr, mufu_per_logit=mufu, bytes_per_logit=2 * 2 + grad_bytes,
               issue_ms=1000 * instr * processed / (sms * 128 * clock), mufu_ms=1000 * mufu * processed / (sms * 16 * clock),
               memory_ms=1000 * nbytes / (peak_gbs * 1e9) if peak_gbs else None)
    warps = out["programs_per_sm"] * num_warps
    in_flight = warps * 32 * (out["passes"][0]["load_bytes_per_iteration"] if out["passes"] else 0)
    out.update(warps_per_sm=warps, bytes_in_flight_per_sm=in_flight,
               bytes_needed_per_sm=peak_gbs * 1e9 / sms * LATENCY_NS * 1e-9 if peak_gbs else None)
    limits = {k: out[f"{k}_ms"] for k in ("issue", "mufu", "memory") if out[f"{k}_ms"] is not None}
    out["bound"] = max(limits, key=limits.get)
    if measured_ms is not None:
        out["measured_ms"] = measured_ms
        out["bandwidth_share"] = nbytes / (measured_ms * 1e-3) / (peak_gbs * 1e9) if peak_gbs else None
        best = limits[out["bound"]]
        if out["bandwidth_share"] is not None and out["bandwidth_share"] >= 0.5:
            out["verdict"] = f"{out['bandwidth_share']:.0%} of the peak bandwidth"
        elif measured_ms > 1.5 * best:
            out["verdict"] = (f"latency: {measured_ms:.2f} ms is {measured_ms / best:.1f}x its largest limit ({out['bound']}, "
                              f"{best:.2f} ms); {warps} warps per SM keep {in_flight / 1024:.0f} KB of loads in flight at "
                              "most, and each iteration's loads wait for the previous iteration's arithmetic")
        else:
            out["verdict"] = f"{out['bound']}-bound ({best:.2f} ms of its {measured_ms:.2f} ms)"
    return out


def limits_lines(f: dict) -> list[str]:
    """loss_kernel_limits' figures in words."""
    p = f["passes"]
    per_pass = " + ".join(f"{x['instructions_per_logit']:.1f}" for x in p)
    lines = [f"  from its SASS: {per_pass} = "
             f"{f['instructions_per_logit']:.1f} instructions and {f['mufu_per_logit']:.1f} MUFU ops per logit (the two "
             f"passes), {f['regs']} registers -> {f['programs_per_sm']} programs ({f['warps_per_sm']} warps) per SM",
             f"  limits at {f['rows']:,} x {f['vocab']:,} on {f['sms']} SMs at {f['clock_ghz']:.2f} GHz: issue "
             f"{f['issue_ms']:.2f} ms, MUFU {f['mufu_ms']:.2f} ms, memory "
             + (f"{f['memory_ms']:.2f} ms ({f['bytes_per_logit']} bytes per logit)" if f["memory_ms"] is not None else "unknown")
             + f"; the largest: {f['bound']}"]
    if "verdict" in f:
        lines.append(f"  measured {f['measured_ms']:.2f} ms: " + f["verdict"])
    return lines


def kernel_sass(compiled) -> str:
    """A compiled Triton kernel's SASS (triton.tools.disasm: cuobjdump, which Triton bundles)."""
    from triton.tools.disasm import get_sass
    return get_sass(compiled.asm["cubin"])


def kernel_registers(compiled) -> int:
    """Registers per thread of a compiled Triton kernel: its n_regs once loaded on a GPU, else cuobjdump's
    resource usage of its cubin."""
    regs = getattr(compiled, "n_regs", None)
    if regs:
        return int(regs)
    from triton.tools.disasm import path_to_cuobjdump
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([path_to_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else 0


def compile_loss_kernel(tk, grad_e5m2: bool, fast_tanh: bool = False, block_v: int = 4096, num_warps: int = 8):
    """The loss kernel compiled for sm_90 without a GPU, specialised as a launch on 16-byte aligned
    tensors with (T, V) divisible by 16 would be (K = 3 MTP weights and the prefix term)."""
    import triton
    from triton.backends.compiler import GPUTarget
    sig = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "weights_ptr": "*fp32", "prefix_ids_ptr": "*i64",
           "prefix_weight_ptr": "*fp32", "loss_ptr": "*fp32", "next_token_ptr": "*fp32",
           "grad_ptr": "*fp8e5" if grad_e5m2 else "*bf16", "T": "i32", "V": "i32", "s_lt": "i32", "s_gt": "i32",
           "grad_scale": "fp32", "grad_mul": "fp32", "K": "constexpr", "HAS_PREFIX": "constexpr", "J_POW2": "constexpr",
           "BLOCK_V": "constexpr", "GRAD_E5M2": "constexpr", "FAST_TANH": "constexpr"}
    constexprs = {"K": 3, "HAS_PREFIX": True, "J_POW2": 4, "BLOCK_V": block_v, "GRAD_E5M2": grad_e5m2, "FAST_TANH": fast_tanh}
    src = triton.compiler.ASTSource(fn=tk._ce_mtp_kernel, signature=sig, constexprs=constexprs,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(12)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def ce_limits_offline(tk, json_path: str | None = None) -> None:
    """--only ce_limits: the loss kernel's limits from its sm_90 SASS, at an H100's and an H200's figures
    (json_path: the figures and each kernel's SASS and registers). Needs Triton's compiler, not a GPU, and
    not TRITON_INTERPRET (under the interpreter there is no kernel to compile)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench_kernels: unset TRITON_INTERPRET to compile the loss kernel")
    gpus = {"H100 SXM": (132, 1.98, 3350.0), "H200": (132, 1.98, 4800.0)}
    out = dict(kernels=[], sass={}, regs={})
    for tag, e5m2, fast in (("bf16", False, False), ("e5m2", True, False), ("e5m2 FAST_TANH", True, True)):
        k = compile_loss_kernel(tk, e5m2, fast_tanh=fast)  # FAST_TANH: the tuning sweep's candidate, not the default
        sass, regs = kernel_sass(k), kernel_registers(k)
        out["sass"][tag], out["regs"][tag] = sass, regs
        for gpu, (sms, clock, peak) in gpus.items():
            for rows in (16384, 49152):
                if fast and (gpu != "H100 SXM" or rows != 16384):
                    continue
                f = loss_kernel_limits(sass, rows, 50304, 4096, 8, 1 if e5m2 else 2, regs, sms, clock, peak)
                out["kernels"].append(dict(gradient=tag, gpu=gpu, limits=f))
                print(f"loss kernel, {tag} gradient, {gpu}:")
                print("\n".join(limits_lines(f)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)


def sm_clock_ghz(gpu_name: str) -> float | None:
    """The SM clock: torch's clock_rate where it has one, else nvidia-smi's maximum, else SM_CLOCK_GHZ."""
    import torch
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", None)
    if rate:
        return rate / 1e6  # kHz
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
        return float(out) / 1000
    except (OSError, ValueError, subprocess.SubprocessError):
        return next((ghz for key, ghz in SM_CLOCK_GHZ.items() if key in gpu_name), None)


def loss_kernel_report(tk, bench, token_counts, json_path: str | None = None) -> list[dict]:
    """The loss kernel alone (one launch, no autograd) at each of token_counts x 50,304 bf16 logits, with a
    bf16 and with an e5m2 gradient: its time, bytes per second against the peak, and its limits
    (loss_kernel_limits, from the SASS of the kernel the GPU ran). Printed, and written to json_path as
    each is measured."""
    import torch
    gpu = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    peak, clock = peak_bandwidth_gbs(gpu), sm_clock_ghz(gpu)
    figures = []
    for T in token_counts:
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, 50304, device="cuda", generator=g, dtype=torch.bfloat16).mul_(5)
        targets = torch.randint(0, 50304, (T,), device="cuda", generator=g)
        w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
        prefix_ids = torch.randint(-1, 50304, (T,), device="cuda", generator=g)
        pi = torch.tensor(0.25, device="cuda")
        for tag, grad_mul, grad_bytes in (("bf16", 0.0, 2), ("e5m2", 448 / 0.75, 1)):
            grid, args, meta, _ = tk.ce_kernel_args(x, targets, w, prefix_ids, pi, 1.0, grad_mul)
            compiled = tk._ce_mtp_kernel[grid](*args, **meta)
            ms = bench(lambda: tk._ce_mtp_kernel[grid](*args, **meta))
            print(bandwidth_line(f"loss kernel alone, {tag} gradient {T}x50304", ms, T * 50304 * (4 + grad_bytes), gpu))
            f = dict(tokens=T, gradient=tag, ms=ms, gb_per_s=T * 50304 * (4 + grad_bytes) / (ms * 1e-3) / 1e9, peak_gbs=peak)
            try:
                lim = loss_kernel_limits(kernel_sass(compiled), T, 50304, meta["BLOCK_V"], meta["num_warps"], grad_bytes,
                                         kernel_registers(compiled), props.multi_processor_count, clock or 0.0, peak, ms,
                                         shared=int(getattr(getattr(compiled, "metadata", None), "shared", 0) or 0))
                f["limits"] = lim
                print("\n".join(limits_lines(lim)))
            except Exception as e:  # noqa: BLE001 -- no SASS (cuobjdump missing): the timing stands
                f["limits_error"] = f"{type(e).__name__}: {e}"
                print(f"  no SASS analysis: {f['limits_error']}")
            figures.append(f)
            if json_path:
                with open(json_path, "w") as out:
                    json.dump(dict(gpu=gpu, clock_ghz=clock, sms=props.multi_processor_count, kernels=figures), out, indent=1)
        del x
    return figures


def bandwidth_line(name: str, ms: float, nbytes: float, gpu_name: str) -> str:
    """'name: ms, GB/s (fraction of the GPU's peak)', the fraction left out for a GPU not in the table."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    peak = peak_bandwidth_gbs(gpu_name)
    share = "" if peak is None else f" = {gbs / peak:.0%} of the {peak / 1000:.2f} TB/s peak"
    return f"{name:<44} triton {ms:8.3f} ms {gbs:8.1f} GB/s{share}"


def bench_ce(tk, bench, tokens: int, json_path: str | None = None) -> None:
    """The loss kernel alone first (loss_kernel_report: read the bf16 row twice, write the gradient once, at
    stage 1's micro-batch and at `tokens`), then through autograd against torch's compiled reference, and
    its e5m2 gradient against the bf16 one and torch's scale-and-cast."""
    loss_kernel_report(tk, bench, sorted({16384, tokens}), json_path)
    dev = "cuda"
    T, V = tokens, 50304
    logits = (torch.randn(T, V, device=dev) * 5).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, V, (T,), device=dev)
    w = torch.tensor([1.0, 0.5, 0.25], device=dev)
    prefix_ids = torch.randint(-1, V, (T,), device=dev)
    pi = torch.tensor(0.25, device=dev)
    ref = torch.compile(tk.softcapped_ce_mtp_reference)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(logits, targets, w, prefix_ids, pi).sum(), logits)

    # bytes: read the row twice and write the gradient (backward returns the stored gradient)
    nbytes = T * V * 2 * 3
    _row(f"softcapped_ce_mtp fwd+bwd {T}x{V} K=3 + prefix", bench(fwd_bwd(tk.softcapped_ce_mtp)), bench(fwd_bwd(ref)),
         nbytes, "GB/s")
    # the FP8 head's form: the e5m2 gradient (1 byte) against the bf16 one plus torch's scale-and-cast
    # passes that it replaces
    x = logits.detach()
    fused = bench(lambda: tk.softcapped_ce_mtp_e5m2(x, targets, w, prefix_ids, pi, 1.0, 0.75 / 448))

    def separate():
        g = torch.autograd.grad(tk.softcapped_ce_mtp(logits, targets, w, prefix_ids, pi).sum(), logits)[0]
        return (g / (0.75 / 448)).to(torch.float8_e5m2)

    _row(f"softcapped_ce_mtp e5m2 gradient {T}x{V}", fused, bench(separate), T * V * 5, "GB/s")


def bench_transpose(tk, bench) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    head = torch.randn(768, 50304, device=dev, dtype=bf16)
    embed = torch.empty(50304, 768, device=dev, dtype=bf16)
    nbytes = head.numel() * 2
    _row("transpose_copy 768x50304 bf16", bench(lambda: tk.transpose_copy(head, embed)),
         bench(lambda: embed.copy_(head.mT)), 2 * nbytes, "GB/s")
    grad = torch.empty(768, 50304, device=dev, dtype=torch.float32)
    egrad = torch.randn(50304, 768, device=dev, dtype=bf16)
    _row("transpose_add 50304x768 bf16 -> fp32", bench(lambda: tk.transpose_add(egrad, grad)),
         bench(lambda: grad.add_(egrad.mT)), nbytes + 2 * grad.numel() * 4, "GB/s")


def bench_cpu_head(tk, tokens: int, rounds: int = 5) -> None:
    import resource
    import statistics
    import time
    T, D, V = tokens, 128, 50304
    g = torch.Generator().manual_seed(0)
    x32 = torch.nn.functional.rms_norm(torch.randn(T, D, generator=g), (D,))
    w32 = torch.randn(D, V, generator=g) * 0.005
    targets = torch.randint(0, V, (T,), generator=g)
    mtp = torch.tensor([1.0, 0.5, 0.25])
    prefix_ids, pi = torch.randint(-1, V, (T,), generator=g), torch.tensor(0.25)

    def fused(x, w):
        return tk.softcapped_ce_mtp_head_rows(x, w, targets, mtp, prefix_ids, pi, 1 / T)

    def unfused(x, w):
        return tk.softcapped_ce_mtp(x @ w, targets, mtp, prefix_ids, pi, 1 / T)

    print(f"CPU head + loss, forward and backward, {T} x {D} x {V}, {torch.get_num_threads()} threads, "
          f"{rounds} alternating rounds (median)")
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype).requires_grad_(True)
        w = w32.to(dtype).requires_grad_(True)
        times = {"fused": [], "unfused": []}
        for _ in range(rounds):
            for name, f in (("fused", fused), ("unfused", unfused)):
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                torch.autograd.grad(f(x, w).sum(), (x, w))
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                times[name].append((time.perf_counter() - t0, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))
        for name, ts in times.items():
            ms, sys_ms, faults = (statistics.median(t[i] for t in ts) for i in range(3))
            print(f"  {str(dtype).removeprefix('torch.'):<9} {name:<8} {ms * 1e3:8.1f} ms   kernel {sys_ms * 1e3:7.1f} ms   "
                  f"{faults:9,.0f} page faults")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("sym", "mlp", "fp8", "ce", "transpose", "cpu_head", "ce_limits"),
                        help="run one group of kernels")
    parser.add_argument("--json", default=None, help="write the loss kernel's figures (ce) to this file as measured")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per rank for the MLP and CE shapes (49152), or the CPU head's (1536, the "
                             "demo's micro-batch on one process)")
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 1536 if args.only == "cpu_head" else 49152
    if args.tokens <= 0:
        raise SystemExit("--tokens must be a positive number of tokens, e.g. --tokens 49152")
    if args.only == "cpu_head":
        import triton_kernels as tk
        bench_cpu_head(tk, args.tokens)
        return 0
    if args.only == "ce_limits":
        import triton_kernels as tk
        ce_limits_offline(tk, args.json)
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (none found); nothing to measure.")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench_kernels: unset TRITON_INTERPRET to time the compiled kernels")

    import triton.testing

    import triton_kernels as tk

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    groups = {"sym": lambda: bench_sym(tk, bench), "mlp": lambda: bench_mlp(tk, bench, args.tokens),
              "fp8": lambda: bench_fp8(tk, bench, args.tokens),
              "ce": lambda: bench_ce(tk, bench, args.tokens, args.json), "transpose": lambda: bench_transpose(tk, bench)}
    for name, run in groups.items():
        if args.only in (None, name):
            run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
