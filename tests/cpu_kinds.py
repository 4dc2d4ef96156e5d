"""What a test may claim about bf16 matrix products across ownerships, on each kind of CPU.

NorMuon orthogonalizes a rank's block of a bank as one batch of bf16 products (Polar Express: torch.bmm,
baddbmm and matmul of 3-D tensors), so a matrix is multiplied in a batch of another size on a rank than
in one process whenever ownership gives the rank only part of the bank. Whether that changes its bits
depends on the CPU:

* AVX2 only: torch multiplies a bf16 batch one matrix at a time in its own gemm, so a matrix's bits do
  not depend on the batch. (Emulated with ONEDNN_MAX_CPU_ISA=AVX2 on a bigger CPU, torch still hands big
  batches to oneDNN, capped at AVX2; the 7, 13 and 14 ranks' blocks below were bitwise there.)
* AVX512-BF16 without AMX: torch hands a bf16 batch to oneDNN when the whole batch is big enough
  (batch x m x n x k above 16^3), else to its own gemm. oneDNN's AVX512-BF16 kernels give a matrix the
  same bits in any batch, and so does torch's gemm, but the two may round a product differently: a
  small matrix (m x n x k of every product at most 16^3) batched alone or in pairs on a rank and with
  the whole bank in one process can differ in the last bits. The balanced-ownership test's banks on 1,
  2, 3, 5, 6 and 8 ranks do not (bitwise on this kind); on 7, 13 or 14 ranks its 8 x 24 Q/K bank would
  (each rank's block orthogonalized in one process for 2 to 21 ranks, on a 2-core AMD EPYC with
  AVX512-BF16, 2026-12-07).
* AMX (oneDNN's bf16 kernels on the AMX tiles): a batched product rounds differently with the number
  of matrices in the batch, large matrices too (a rank owning 1 of the 11 MLP matrices of that test
  differs from one process).

So tests compare across ownerships bit for bit except where oneDNN runs bf16 products on AMX, and there
within AMX_REL (below).
"""
from __future__ import annotations

import os

import torch


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """The CPU has AMX-BF16 and processes may use it: the `amx_bf16` flag of /proc/cpuinfo (Linux lists
    it only where its kernel supports AMX); where that file has no flags, torch's own CPU probe."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.partition(":")[2].split()
    except OSError:
        pass
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # not in every torch this code supports
    return bool(capabilities is not None and capabilities().get("amx_bf16", False))


def onednn_isa_allows_amx(env=None) -> bool:
    """oneDNN's ISA cap leaves AMX on: ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA) unset,
    ALL, or an AMX level (AVX512_CORE_AMX, AVX10_1_512_AMX, ...); AVX512_CORE_BF16, AVX2 and the other
    levels below turn it off."""
    env = os.environ if env is None else env
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap in ("", "ALL") or "AMX" in cap


def onednn_amx(env=None, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether oneDNN runs this process's bf16 matmuls on AMX: torch's oneDNN is on, the CPU has
    AMX-BF16 and the ISA cap allows it. Worker processes inherit the environment, so the answer holds
    for the gloo ranks the tests start too."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and onednn_isa_allows_amx(env) and cpu_has_amx_bf16(cpuinfo))


AMX = onednn_amx()

# The bound on AMX: relative Frobenius distance per matrix, of a parameter's change from its start (its
# fp32 master) and of the second moment. Both sides run the same bf16 Polar Express on the same inputs at
# every step (its input, the momentum of the gradients, involves no product); AMX changes only how each
# product's fp32 sum is formed before it is rounded to bf16. So each side lies within the whole bf16
# rounding of the iteration from the same steps with every product kept in fp32, and the two sides within
# twice that of each other. That whole rounding, measured on a 2-core AMD EPYC with AVX512-BF16
# (2026-12-07) for the steps of these tests: 2.0-4.0% on the balanced-ownership banks, 0.6-2.1% on the
# test preset's, 1.5-5.7% on the stacked test's (most on its matrices scaled to 30 and 1e3, whose change
# is mostly the cautious decay, with a sign mask that follows the update). Twice the largest, rounded up:
# 2 x 6% = 12%. For scale: every product summed in float64 before its rounding (another order of the same
# sums, as on AMX) moved the same quantities by at most 0.6%; a matrix skipped, stepped twice or given
# another's update moves them by ~100%.
AMX_REL = 0.12


def assert_equal_or_within_amx_rounding(got: torch.Tensor, ref: torch.Tensor, start: torch.Tensor | None = None,
                                        what="") -> None:
    """got equals ref bit for bit; where oneDNN runs bf16 products on AMX, matrix by matrix (the last two
    dims) got - start is within AMX_REL of ref - start. start: the value before the steps (None for a
    quantity that starts at zero, like the second moment)."""
    if not AMX:
        assert torch.equal(got, ref), what
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    a, b = got.double(), ref.double()
    if start is not None:
        a, b = a - start.double(), b - start.double()
    a, b = a.reshape(-1, a.shape[-2] * a.shape[-1]), b.reshape(-1, b.shape[-2] * b.shape[-1])
    err, scale = (a - b).norm(dim=1), b.norm(dim=1)
    assert (err <= AMX_REL * scale).all(), (what, (err / scale.clamp_min(1e-300)).tolist())
