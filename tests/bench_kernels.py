"""Time every Triton kernel against its torch equivalent at the speedrun shapes (CUDA only), and the
CPU head fused with its loss against the unfused head (a CPU).

    python tests/bench_kernels.py              # all kernels
    python tests/bench_kernels.py --only ce    # one group: sym, mlp, fp8, ce, transpose
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
median milliseconds, and the kernel's CPU time and page faults per call.
"""
from __future__ import annotations

import argparse
import os
import sys

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


def bandwidth_line(name: str, ms: float, nbytes: float, gpu_name: str) -> str:
    """'name: ms, GB/s (fraction of the GPU's peak)', the fraction left out for a GPU not in the table."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    peak = peak_bandwidth_gbs(gpu_name)
    share = "" if peak is None else f" = {gbs / peak:.0%} of the {peak / 1000:.2f} TB/s peak"
    return f"{name:<44} triton {ms:8.3f} ms {gbs:8.1f} GB/s{share}"


def bench_ce(tk, bench, tokens: int) -> None:
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
    # the kernel alone: read the bf16 row twice, write the gradient once (bf16, or e5m2 for the FP8 head)
    gpu = torch.cuda.get_device_name()

    def loss_kernel(grad_mul):
        grid, args, meta, _ = tk.ce_kernel_args(x, targets, w, prefix_ids, pi, 1.0, grad_mul)
        tk._ce_mtp_kernel[grid](*args, **meta)

    for tag, grad_mul, grad_bytes in (("bf16", 0.0, 2), ("e5m2", 448 / 0.75, 1)):
        ms = bench(lambda: loss_kernel(grad_mul))
        print(bandwidth_line(f"loss kernel alone, {tag} gradient {T}x{V}", ms, T * V * (4 + grad_bytes), gpu))


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
    parser.add_argument("--only", choices=("sym", "mlp", "fp8", "ce", "transpose", "cpu_head"),
                        help="run one group of kernels")
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
              "ce": lambda: bench_ce(tk, bench, args.tokens), "transpose": lambda: bench_transpose(tk, bench)}
    for name, run in groups.items():
        if args.only in (None, name):
            run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
