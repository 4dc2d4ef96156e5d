"""Time every Triton kernel against its torch equivalent at the speedrun shapes (CUDA only).

    python tests/bench_kernels.py              # all kernels
    python tests/bench_kernels.py --only ce    # one group: sym, mlp, ce, transpose

Prints milliseconds, achieved TFLOP/s (matmuls) or GB/s (memory-bound kernels) and the speed ratio
torch / triton. For the symmetric kernels TFLOP/s counts the full product (2 m^2 k), so the
triangle trick shows up as a higher "effective" rate. No assertions: this file only measures.
On a machine without a CUDA GPU it says so and exits 0.
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


def bench_sym(tk, bench) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    for b, m, n in ((8, 768, 768), (3, 768, 3072)):  # attention banks; MLP bank as its wide transpose
        A = torch.randn(b, m, n, device=dev, dtype=bf16) / n**0.5
        out = torch.empty(b, m, m, device=dev, dtype=bf16)
        flops = 2 * b * m * m * n
        _row(f"XXT {b}x{m}x{n}", bench(lambda: tk.XXT(A, out)), bench(lambda: torch.bmm(A, A.mT, out=out)),
             flops, "TFLOP/s")
        At = A.mT.contiguous()  # (b, n, m): the tall MLP matrices go through XTX
        _row(f"XTX {b}x{n}x{m}", bench(lambda: tk.XTX(At, out)), bench(lambda: torch.bmm(At.mT, At, out=out)),
             flops, "TFLOP/s")
        S = torch.empty(b, m, m, device=dev, dtype=bf16)
        tk.XXT(A, S)
        _row(f"ba_plus_cAA {b}x{m}x{m}", bench(lambda: tk.ba_plus_cAA(S, 1.5, -2.0, out)),
             bench(lambda: torch.baddbmm(S, S, S, beta=-2.0, alpha=1.5, out=out)), 2 * b * m * m * m, "TFLOP/s")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("sym", "mlp", "ce", "transpose"), help="run one group of kernels")
    parser.add_argument("--tokens", type=int, default=49152, help="tokens per rank for the MLP and CE shapes")
    args = parser.parse_args()
    if args.tokens <= 0:
        raise SystemExit("--tokens must be a positive number of tokens, e.g. --tokens 49152")
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
              "ce": lambda: bench_ce(tk, bench, args.tokens), "transpose": lambda: bench_transpose(tk, bench)}
    for name, run in groups.items():
        if args.only in (None, name):
            run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
