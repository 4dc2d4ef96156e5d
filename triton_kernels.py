"""Fused kernels for train_gpt.py, each beside a plain-PyTorch reference of the same function.

Every public function `name(...)` dispatches on the device of its main input: CUDA tensors run the
Triton kernel (the symmetric products: at the shapes kernel_choice gives it), anything else runs torch
ops (for the MLP and the cross-entropy, a torch twin of the kernel that saves what the kernel saves), so
the same model code trains anywhere and the CPU demo stays fast. The `name_triton` functions always
take the Triton path; on a CPU tensor that only works under the Triton interpreter (TRITON_INTERPRET=1
set before this module is imported), which is how the tests prove the kernels on machines without a GPU.

The symmetric products of Polar Express launch their kernel from the public function itself: the
optimizer's compiled update traces the launch into its graph as a user-defined Triton kernel (no
gradient flows there), as record #89 does. The other kernels are launched from
`torch.library.custom_op`s in the `speedrun` namespace, each with a fake (meta) implementation and,
where gradients flow, a registered autograd formula, so `torch.compile`d model code treats them as
opaque ops instead of trying to trace into Triton launches. An op's body launches its kernel itself,
`kernel[grid](*args, **meta)`, with what a `*_args` helper computes from the op's inputs (checks,
tiles, outputs): public function, op, kernel.

Design notes (Hopper, sm_90):
  * The matmul kernels are persistent: one program per SM walks a list of output tiles, so tile
    set-up and launch costs are paid once per SM and the K loop stays software-pipelined.
  * Symmetric products (A A^T, A^T A, alpha A A + beta A) enumerate only the lower-triangle tiles
    and store each tile twice (itself and its transpose), halving the FLOPs of Polar Express. A
    diagonal tile keeps its own lower triangle and mirrors it, so the output is bitwise symmetric
    by construction, whatever order tl.dot sums in.
  * The MLP matmul walks tiles in GROUP_M-row groups so neighbouring programs share operand tiles
    in L2.
  * The softcapped logits are bounded, z in (0, 23), so sum(exp(z)) cannot overflow fp32 (at most
    50304 * e^23 ~ 5e14): the cross-entropy kernel needs no running max and makes exactly two
    passes over each vocab row (sum, then gradient), never storing the row in fp32.
  * Configurations are chosen per shape class instead of autotuned: autotuning needs a GPU to
    benchmark on, and the speedrun runs a handful of fixed shapes.
  * Kernels use plain pointer arithmetic (no block pointers, deprecated in triton 3.8) and upcast
    to fp32 before any elementwise math.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

# ----------------------------------------------------------------------------------------------
# Shared launch helpers
# ----------------------------------------------------------------------------------------------

# Persistent grids on the interpreter use a few programs, so that every program walks several
# tiles and the tile-walking logic is exercised by the CPU tests.
_INTERPRETER_PROGRAMS = 3


def _is_interpreted(kernel) -> bool:
    """True when `kernel` was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _constant_at_trace_time(fn):
    """torch.compiler.assume_constant_result: a compiled caller calls fn once while tracing and keeps its
    result as a constant. The same mark, set without importing torch._dynamo as that function does (about
    0.7 s): a process that imports this file and stops before its first op (a flag error, --dry-run, a
    lease plan) does not pay it. tests/test_triton_kernels.py checks the mark against torch's own."""
    fn._dynamo_marked_constant = True
    return fn


@functools.lru_cache(maxsize=None)
def _cuda_sm_count_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Read at trace time, so that a launch traced into a compiled graph (XXT's) stays in it. Not on the cached
# function itself: dynamo ignores assume_constant_result on an lru_cache wrapper and traces into it.
@_constant_at_trace_time
def _cuda_sm_count(index: int) -> int:
    return _cuda_sm_count_cached(index)


def _num_programs(device: torch.device, tiles: int) -> int:
    """Size of a persistent grid: one program per SM on CUDA, a few on the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(tiles, _cuda_sm_count(index)))
    return max(1, min(tiles, _INTERPRETER_PROGRAMS))


def _check_runnable(kernel, *tensors: Tensor) -> None:
    """Refuse, with one clear line, to launch a compiled Triton kernel on non-CUDA tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"triton_kernels: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not _is_interpreted(kernel):
        raise RuntimeError(
            f"triton_kernels: the Triton path needs CUDA tensors (got {device}); on CPU call the "
            "public function (it uses the torch reference) or set TRITON_INTERPRET=1 before import"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32: callers passing fp32 asked for fp32 accuracy.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _overlaps(a: Tensor, b: Tensor) -> bool:
    """Conservative check whether two tensors share any bytes of storage."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + sum((s - 1) * st for s, st in zip(a.shape, a.stride())) * a.element_size() + a.element_size()
    b1 = b0 + sum((s - 1) * st for s, st in zip(b.shape, b.stride())) * b.element_size() + b.element_size()
    return a0 < b1 and b0 < a1


# ----------------------------------------------------------------------------------------------
# Symmetric products for Polar Express: A A^T, A^T A, alpha A A + beta A
# ----------------------------------------------------------------------------------------------


def XXT_reference(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = A @ A^T for A of shape (..., m, n); out (..., m, m)."""
    return out.copy_(A @ A.mT)


def XTX_reference(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = A^T @ A for A of shape (..., m, n); out (..., n, n)."""
    return out.copy_(A.mT @ A)


def ba_plus_cAA_reference(A: torch.Tensor, alpha: float, beta: float, out: torch.Tensor) -> torch.Tensor:
    """out = alpha * A @ A + beta * A for symmetric A of shape (..., m, m)."""
    return out.copy_(alpha * (A @ A) + beta * A)


@triton.jit
def _sym_mm_kernel(
    x_ptr, y_ptr, z_ptr, out_ptr,
    N, K, n_batches,
    sxb, sxm, sxk,
    syb, syk, syn,
    szb, szm, szn,
    sob, som, son,
    alpha, beta,
    HAS_Z: tl.constexpr, FP64: tl.constexpr, PREC: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[b] = alpha * X[b] @ Y[b] + beta * Z[b] (Z optional), for a product known to be symmetric.

    X is (N, K) and Y is (K, N) through their strides, so A A^T, A^T A and A A are all this kernel.
    Only lower-triangle tiles (row block i >= column block j) are computed; each is stored at
    (i, j) and, transposed, at (j, i). A diagonal tile's upper triangle is its lower triangle
    transposed. Every output element below the diagonal is thus written from one computed value and
    its mirror image from the same value: out == out^T bitwise, which Polar Express relies on.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nt = tl.cdiv(N, BLOCK)
    n_tri = nt * (nt + 1) // 2
    total = n_tri * n_batches
    for tile in tl.range(pid, total, nprog):
        bat = tile // n_tri
        t = tile - bat * n_tri
        # Row of the t-th lower-triangle tile: i(i+1)/2 <= t < (i+1)(i+2)/2. The float estimate is
        # off by at most one, which the two integer corrections fix.
        i = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
        i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
        i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
        j = t - i * (i + 1) // 2

        offs_m = i * BLOCK + tl.arange(0, BLOCK)
        offs_n = j * BLOCK + tl.arange(0, BLOCK)
        offs_k = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + bat * sxb + offs_m[:, None] * sxm + offs_k[None, :] * sxk
        y_tile = y_ptr + bat * syb + offs_k[:, None] * syk + offs_n[None, :] * syn
        if FP64:
            acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float64)
        else:
            acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            a = tl.load(x_tile, mask=(offs_m[:, None] < N) & k_ok[None, :], other=0.0)
            b = tl.load(y_tile, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC, out_dtype=acc.dtype)  # triton 3.6: fp32 unless told
            x_tile += BLOCK_K * sxk
            y_tile += BLOCK_K * syk

        in_bounds = (offs_m[:, None] < N) & (offs_n[None, :] < N)
        if HAS_Z:
            z = tl.load(z_ptr + bat * szb + offs_m[:, None] * szm + offs_n[None, :] * szn, mask=in_bounds, other=0.0)
            acc = alpha * acc + beta * z.to(acc.dtype)
        res = acc.to(out_ptr.dtype.element_ty)
        out_base = out_ptr + bat * sob
        if i == j:
            # Diagonal tile: res[r, c] and res[c, r] are separate dot products whose summation order
            # the hardware (or the interpreter's BLAS) need not keep alike, so keep the tile's lower
            # triangle and mirror it into the upper one. Exactly symmetric, whatever the dot did.
            # Cheap: one register transpose, which off-diagonal tiles pay for their mirror store
            # anyway, and one full (vectorized) store instead of two; the mask stays bounds-only.
            lower = offs_m[:, None] >= offs_n[None, :]
            res = tl.where(lower, res, tl.trans(res))
            tl.store(out_base + offs_m[:, None] * som + offs_n[None, :] * son, res, mask=in_bounds)
        else:
            tl.store(out_base + offs_m[:, None] * som + offs_n[None, :] * son, res, mask=in_bounds)
            # Mirror tile, written row-major from the transposed registers so the store stays coalesced.
            mirror_ok = (offs_n[:, None] < N) & (offs_m[None, :] < N)
            tl.store(out_base + offs_n[:, None] * som + offs_m[None, :] * son, tl.trans(res), mask=mirror_ok)


def _sym_config(N: int, n_batches: int, device: torch.device) -> dict:
    """Tile sizes for the symmetric kernel.

    On H100 a 128x128 tile saturates the tensor cores; when that leaves most SMs idle (the three
    768x768 Gram matrices of the MLP bank give only 63 tiles for 132 SMs) drop to 64x64 tiles.
    The interpreter uses small tiles so CPU test shapes cover several tiles and ragged edges.
    """
    if device.type != "cuda":
        return dict(BLOCK=32, BLOCK_K=32, num_warps=4, num_stages=1)
    nt = triton.cdiv(N, 128)
    if n_batches * nt * (nt + 1) // 2 >= _num_programs(device, 1 << 30):
        return dict(BLOCK=128, BLOCK_K=64, num_warps=8, num_stages=4)
    return dict(BLOCK=64, BLOCK_K=64, num_warps=4, num_stages=4)


def _as_batched(t: Tensor) -> tuple[int, int, int, int]:
    """(batch count, batch stride, row stride, column stride) of a 2-D or 3-D tensor."""
    if t.dim() == 2:
        return 1, 0, t.stride(0), t.stride(1)
    return t.shape[0], t.stride(0), t.stride(1), t.stride(2)


def _check_sym_shapes(name: str, A: Tensor, out: Tensor, n_out: int) -> None:
    if A.dim() not in (2, 3):
        raise ValueError(f"{name}: A must be 2-D (m, n) or batched 3-D (b, m, n), got shape {tuple(A.shape)}")
    want = (*A.shape[:-2], n_out, n_out)
    if tuple(out.shape) != want:
        raise ValueError(f"{name}: out must have shape {want} for A of shape {tuple(A.shape)}, got {tuple(out.shape)}")


def _sym_args(A: Tensor, out: Tensor, mode: str, alpha: float = 1.0, beta: float = 0.0,
              config: dict | None = None) -> tuple[tuple, tuple, dict]:
    """The symmetric kernel's (grid, arguments, meta-parameters) for out = A A^T ("xxt"), A^T A ("xtx") or
    alpha A A + beta A ("aa"), once A and out pass the checks; config: tiles other than _sym_config's."""
    if mode == "aa" and (A.dim() not in (2, 3) or A.shape[-1] != A.shape[-2]):
        raise ValueError(f"ba_plus_cAA: A must be square (m, m) or batched (b, m, m), got shape {tuple(A.shape)}")
    name = dict(xxt="XXT", xtx="XTX", aa="ba_plus_cAA")[mode]
    _check_sym_shapes(name, A, out, A.shape[-2] if mode == "xxt" else A.shape[-1])
    if not torch.compiler.is_compiling():  # data pointers do not trace: a compiled caller's `out` is its own
        _check_runnable(_sym_mm_kernel, A, out)
        if _overlaps(A, out):
            raise ValueError("triton_kernels: `out` must not overlap `A` (the kernel reads A while writing out)")
    nb, sab, sam, san = _as_batched(A)
    _, sob, som, son = _as_batched(out)
    m, n = A.shape[-2], A.shape[-1]
    if mode == "xxt":  # X = A (m x n), Y = A^T
        N, K = m, n
        x_strides, y_strides = (sab, sam, san), (sab, san, sam)
    elif mode == "xtx":  # X = A^T (n x m), Y = A
        N, K = n, m
        x_strides, y_strides = (sab, san, sam), (sab, sam, san)
    else:  # "aa": X = Y = A, plus beta * A
        N, K = m, m
        x_strides, y_strides = (sab, sam, san), (sab, sam, san)
    cfg = dict(config) if config is not None else _sym_config(N, nb, A.device)
    nt = triton.cdiv(N, cfg["BLOCK"])
    grid = (_num_programs(A.device, nb * nt * (nt + 1) // 2),)
    args = (A, A, A, out, N, K, nb, *x_strides, *y_strides, sab, sam, san, sob, som, son,
            float(alpha), float(beta))
    meta = dict(HAS_Z=(mode == "aa"), FP64=(A.dtype == torch.float64), PREC=_dot_precision(A.dtype), **cfg)
    return grid, args, meta


def XXT_triton(A: Tensor, out: Tensor) -> Tensor:
    """`XXT` on the Triton kernel at every shape; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    return XXT(A, out, kernel=True)


def XTX_triton(A: Tensor, out: Tensor) -> Tensor:
    """`XTX` on the Triton kernel at every shape; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    return XTX(A, out, kernel=True)


def ba_plus_cAA_triton(A: Tensor, alpha: float, beta: float, out: Tensor) -> Tensor:
    """`ba_plus_cAA` on the Triton kernel at every shape; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    return ba_plus_cAA(A, alpha, beta, out, kernel=True)


# Per GPU and shape, the Triton kernel or torch (cuBLAS). The triangle trick halves the FLOPs, but at the
# NorMuon banks' small shapes cuBLAS's batched GEMM can still be faster: a Triton launch costs about
# 0.025 ms of host time, more than these products take. (function, batch, rows, cols of A) ->
# (Triton ms, torch ms), per GPU named in torch.cuda.get_device_name(). A GPU takes the faster of the two
# at a shape its table lists, the kernel everywhere else; tests/gpu_check.py's kernel-choice check
# measures every bank shape again on the GPU at hand and fails where its table picks the slower.
KERNEL_TIMES = {
    # one H100 80GB HBM3, torch 2.11, triton 3.6, 2026-11-24 (tests/bench_kernels.py)
    "H100": {
        ("XXT", 8, 768, 768): (0.034, 0.017),
        ("XTX", 8, 768, 768): (0.044, 0.017),
        ("ba_plus_cAA", 8, 768, 768): (0.023, 0.028),
        ("XXT", 3, 768, 3072): (0.047, 0.022),
        ("XTX", 3, 3072, 768): (0.053, 0.022),
        ("ba_plus_cAA", 3, 768, 768): (0.068, 0.017),
    },
    # one H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-26 (the GPU check's kernel-choice, records/gpu_check)
    "H200": {
        ("XXT", 8, 256, 768): (0.027, 0.008),
        ("ba_plus_cAA", 8, 256, 256): (0.030, 0.010),
        ("XXT", 3, 768, 768): (0.027, 0.011),
        ("ba_plus_cAA", 3, 768, 768): (0.031, 0.016),
        ("XTX", 3, 3072, 768): (0.033, 0.022),
        ("XXT", 64, 256, 768): (0.027, 0.017),
        ("ba_plus_cAA", 64, 256, 256): (0.029, 0.018),
        ("XXT", 24, 768, 768): (0.042, 0.038),
        ("ba_plus_cAA", 24, 768, 768): (0.042, 0.064),
        ("XTX", 24, 3072, 768): (0.098, 0.123),
        ("XXT", 8, 768, 768): (0.028, 0.017),
        ("XTX", 8, 768, 768): (0.025, 0.016),
        ("ba_plus_cAA", 8, 768, 768): (0.031, 0.026),
        ("XXT", 3, 768, 3072): (0.034, 0.020),
    },
}
USE_KERNEL_TABLE = True  # False: the Triton kernel at every shape (the kernel-choice check times both)


def measured_table(tables: dict, gpu_name: str) -> dict:
    """The table of the first GPU of `tables` whose name is in gpu_name ({} for one never measured)."""
    return next((table for gpu, table in tables.items() if gpu in gpu_name), {})


def kernel_choice(name: str, shape: tuple, gpu_name: str) -> str:
    """"torch" where this GPU's KERNEL_TIMES table says torch is faster at this shape, else "triton"."""
    key = (name, *((1, *shape) if len(shape) == 2 else shape))
    times = measured_table(KERNEL_TIMES, gpu_name).get(key)
    if not USE_KERNEL_TABLE or times is None:
        return "triton"
    return "torch" if times[1] < times[0] else "triton"


@_constant_at_trace_time  # read at trace time: a compiled caller does not break its graph here
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index) if torch.cuda.is_available() else ""


def gpu_name_of(t: Tensor) -> str:
    """The name of the GPU holding t ("" for any other device), for the per-GPU measured tables."""
    if not t.is_cuda:
        return ""
    return _gpu_name(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _runs_kernel(name: str, A: Tensor, kernel: bool | None) -> bool:
    """kernel if given, else: a CUDA tensor whose shape the table does not give to torch."""
    if kernel is not None:
        return kernel
    return A.is_cuda and kernel_choice(name, tuple(A.shape), gpu_name_of(A)) == "triton"


# The three products launch the kernel themselves, no custom op between: under torch.compile (Polar Express
# in the optimizer's compiled update) dynamo traces the launch into the graph as a user-defined Triton
# kernel, as record #89 does (modded-nanogpt PR #342's XXT), so the update crosses no op boundary.

def XXT(A: Tensor, out: Tensor, kernel: bool | None = None) -> Tensor:
    """out = A @ A^T; A (m, n) or (b, m, n), out (m, m) or (b, m, m), any float dtype; returns out.

    On CUDA only the lower-triangle tiles are multiplied (fp32 accumulation) and mirrored, except at
    shapes where kernel_choice gives torch's matmul, which other devices run (kernel=True: the Triton
    kernel at every shape, False: torch). `out` must not overlap `A`.
    """
    if _runs_kernel("XXT", A, kernel):
        grid, args, meta = _sym_args(A, out, "xxt")
        _sym_mm_kernel[grid](*args, **meta)
        return out
    return torch.matmul(A, A.mT, out=out)


def XTX(A: Tensor, out: Tensor, kernel: bool | None = None) -> Tensor:
    """out = A^T @ A; A (m, n) or (b, m, n), out (n, n) or (b, n, n); returns out.

    The symmetric form for tall matrices (rows > cols), same triangle trick (and table) as `XXT`.
    """
    if _runs_kernel("XTX", A, kernel):
        grid, args, meta = _sym_args(A, out, "xtx")
        _sym_mm_kernel[grid](*args, **meta)
        return out
    return torch.matmul(A.mT, A, out=out)


def ba_plus_cAA(A: Tensor, alpha: float, beta: float, out: Tensor, kernel: bool | None = None) -> Tensor:
    """out = alpha * A @ A + beta * A for symmetric A (m, m) or (b, m, m); returns out.

    This is the `b*A + c*A^2` step of Polar Express (alpha = c, beta = b). A must be symmetric: on
    CUDA only half of the product is computed, except where kernel_choice gives torch's baddbmm, which
    other devices run. `out` must not overlap `A`.
    """
    if _runs_kernel("ba_plus_cAA", A, kernel):
        grid, args, meta = _sym_args(A, out, "aa", alpha, beta)
        _sym_mm_kernel[grid](*args, **meta)
        return out
    return (torch.baddbmm if A.dim() == 3 else torch.addmm)(A, A, A, beta=beta, alpha=alpha, out=out)


# ----------------------------------------------------------------------------------------------
# Squared-ReLU MLP
# ----------------------------------------------------------------------------------------------


def relu2_mlp_reference(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """y = relu(x @ w_up^T)^2 @ w_down, with x (T, D), w_up (H, D), w_down (H, D)."""
    return torch.relu(x @ w_up.mT).square() @ w_down


_EPI_NONE, _EPI_RELU2, _EPI_RELU2_GRAD = 0, 1, 2


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row, column) tile indices of linear tile `tile`, walking GROUP_M-row groups column by column."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _mm_epilogue_kernel(
    a_ptr, b_ptr, c_ptr, aux_ptr,
    M, N, K,
    sam, sak, sbk, sbn, scm, scn, sxm, sxn,
    EPILOGUE: tl.constexpr, FP64: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = epilogue(A @ B), A (M, K), B (K, N), persistent over GROUP_M-swizzled tiles.

    EPILOGUE 0: C = A @ B.  1: C = relu(A @ B)^2 (MLP forward: only the post-activation is kept).
    2: C = 2 * (A @ B) * sqrt(AUX) with AUX = relu(pre)^2 (MLP backward: sqrt(post) = relu(pre),
    so the pre-activation never has to be stored).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(pid, num_pid_m * num_pid_n, nprog):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = offs_m.to(tl.int64)  # T x H activations exceed 2^31 elements at long sequence lengths
        a_tile = a_ptr + rows[:, None] * sam + offs_k[None, :] * sak
        b_tile = b_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn
        if FP64:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            a = tl.load(a_tile, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_tile, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC, out_dtype=acc.dtype)  # triton 3.6: fp32 unless told
            a_tile += BLOCK_K * sak
            b_tile += BLOCK_K * sbk

        in_bounds = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if EPILOGUE == 1:
            r = tl.maximum(acc, 0.0)
            acc = r * r
        elif EPILOGUE == 2:
            post = tl.load(aux_ptr + rows[:, None] * sxm + offs_n[None, :] * sxn, mask=in_bounds, other=0.0)
            acc = 2.0 * acc * tl.sqrt(post.to(acc.dtype))
        tl.store(c_ptr + rows[:, None] * scm + offs_n[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=in_bounds)


def _mm_config(M: int, N: int, K: int, device: torch.device) -> dict:
    """Tile sizes for the MLP matmuls (speedrun: M = 49152 tokens, N = 3072, K = 768 in bf16).

    128x256x64 with 8 warps is the usual H100 sweet spot for large bf16 GEMMs (one warpgroup pair
    per tile, 3 stages of 48 KB in shared memory); small problems use 64x64 tiles so that more SMs
    get work. The interpreter uses small tiles so CPU tests cover several tiles and ragged edges.
    """
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    if M * N >= 128 * 256 * 2 * _num_programs(device, 1 << 30):
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)


def _mm_args(a: Tensor, b: Tensor, c: Tensor, epilogue: int, aux: Tensor | None = None,
             config: dict | None = None) -> tuple[tuple, tuple, dict]:
    """The MLP kernel's (grid, arguments, meta-parameters) for c = epilogue(a @ b), 2-D a (M, K), b (K, N)
    (any strides), c (M, N); config: tiles other than _mm_config's."""
    _check_runnable(_mm_epilogue_kernel, a, b, c)
    M, K = a.shape
    N = b.shape[1]
    cfg = dict(config) if config is not None else _mm_config(M, N, K, a.device)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    aux_t = aux if aux is not None else c
    args = (a, b, c, aux_t, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            aux_t.stride(0), aux_t.stride(1))
    return ((_num_programs(a.device, tiles),), args,
            dict(EPILOGUE=epilogue, FP64=(a.dtype == torch.float64), PREC=_dot_precision(a.dtype), **cfg))


def _relu2_post(x: Tensor, w_up: Tensor) -> Tensor:
    """The kernel's post = relu(x @ w_up^T)^2 in torch ops (the CPU's twin)."""
    return torch.relu(x @ w_up.mT).square()


def _relu2_dpre(dy: Tensor, w_down: Tensor, post: Tensor) -> Tensor:
    """The kernel's dpre = 2 (dy @ w_down^T) sqrt(post) in torch ops (the CPU's twin): relu(pre) = sqrt(post),
    so the backward needs no pre."""
    acc = torch.promote_types(post.dtype, torch.float32)  # one rounding at the end, as in the kernel
    return (2.0 * (dy @ w_down.mT).to(acc) * post.to(acc).sqrt()).to(post.dtype)


# `kernel` picks the Triton kernels (CUDA, or the interpreter in tests) or their torch twins (CPU):
# both keep only the post-activation for the backward, so a CPU run saves what a GPU run saves.
@torch.library.custom_op("speedrun::relu2_mlp_fwd", mutates_args=())
def _relu2_mlp_fwd_op(x: Tensor, w_up: Tensor, w_down: Tensor, kernel: bool) -> tuple[Tensor, Tensor]:
    """Returns (y, post): post = relu(x @ w_up^T)^2 in x's dtype, y = post @ w_down."""
    if kernel:
        post = torch.empty(x.shape[0], w_up.shape[0], dtype=x.dtype, device=x.device)
        grid, args, meta = _mm_args(x, w_up.mT, post, _EPI_RELU2)
        _mm_epilogue_kernel[grid](*args, **meta)
    else:
        post = _relu2_post(x, w_up)
    return post @ w_down, post


@_relu2_mlp_fwd_op.register_fake
def _(x, w_up, w_down, kernel):
    post = x.new_empty(x.shape[0], w_up.shape[0])
    return x.new_empty(x.shape[0], w_down.shape[1]), post


@torch.library.custom_op("speedrun::relu2_mlp_bwd", mutates_args=())
def relu2_mlp_backward(dy: Tensor, x: Tensor, w_up: Tensor, w_down: Tensor, post: Tensor,
                       use_kernel: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw_up, dw_down) of relu2_mlp for 2-D x from its post-activation alone; also the FP8 MLP's
    backward. use_kernel: dpre by the Triton kernel (default on CUDA) or its torch twin. (Not `kernel`:
    inductor passes a default it fills in by name, and its fallback takes `kernel` itself.)"""
    dy = dy.to(x.dtype)
    if x.is_cuda if use_kernel is None else use_kernel:
        dpre = torch.empty_like(post)
        grid, args, meta = _mm_args(dy, w_down.mT, dpre, _EPI_RELU2_GRAD, aux=post)
        _mm_epilogue_kernel[grid](*args, **meta)
    else:
        dpre = _relu2_dpre(dy, w_down, post)
    return dpre @ w_up, dpre.mT @ x, post.mT @ dy


@relu2_mlp_backward.register_fake
def _(dy, x, w_up, w_down, post, use_kernel=None):
    return torch.empty_like(x), torch.empty_like(w_up), torch.empty_like(w_down)


def _relu2_mlp_setup(ctx, inputs, output):
    x, w_up, w_down, kernel = inputs
    _, post = output
    ctx.save_for_backward(x, w_up, w_down, post)
    ctx.mark_non_differentiable(post)
    ctx.kernel = kernel


def _relu2_mlp_backward(ctx, dy, _dpost):
    x, w_up, w_down, post = ctx.saved_tensors
    return *relu2_mlp_backward(dy, x, w_up, w_down, post, ctx.kernel), None


_relu2_mlp_fwd_op.register_autograd(_relu2_mlp_backward, setup_context=_relu2_mlp_setup)


def _mlp_rows(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """x (..., D) as (rows, D), once x, w_up and w_down pass relu2_mlp's checks."""
    if w_up.dim() != 2 or w_down.dim() != 2 or w_up.shape != w_down.shape:
        raise ValueError(f"relu2_mlp: w_up and w_down must both be (H, D), got {tuple(w_up.shape)} and {tuple(w_down.shape)}")
    if x.shape[-1] != w_up.shape[1]:
        raise ValueError(f"relu2_mlp: x has {x.shape[-1]} features but the weights expect D={w_up.shape[1]}")
    if not (x.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"relu2_mlp: x, w_up, w_down must share one dtype, got {x.dtype}, {w_up.dtype}, {w_down.dtype}")
    return x.reshape(-1, x.shape[-1])


def relu2_mlp_triton(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """Triton path of `relu2_mlp`; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    y, _ = torch.ops.speedrun.relu2_mlp_fwd(_mlp_rows(x, w_up, w_down), w_up, w_down, True)
    return y.reshape(*x.shape[:-1], w_down.shape[1])


def relu2_mlp(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """y = relu(x @ w_up^T)^2 @ w_down; x (..., D), w_up (H, D), w_down (H, D), one dtype (bf16).

    Differentiable in x, w_up and w_down. Only the post-activation is kept for the backward, which
    recovers relu(pre) as sqrt(post) (the record's "post-only" MLP; pre is never stored). On CUDA the
    first matmul and the squared ReLU are one kernel, and dpre is fused into the backward's matmul;
    elsewhere the same math runs in torch ops.
    """
    y, _ = torch.ops.speedrun.relu2_mlp_fwd(_mlp_rows(x, w_up, w_down), w_up, w_down, x.is_cuda)
    return y.reshape(*x.shape[:-1], w_down.shape[1])


# ----------------------------------------------------------------------------------------------
# FP8 MLP up-projection (record #89, modded-nanogpt PR #342): e4m3 x e4m3 into an fp32 accumulator,
# the squared ReLU, and the e4m3 copy of the post-activation for the down-projection, in one kernel
# ----------------------------------------------------------------------------------------------
#
# Accumulation. On Hopper (sm_90) Triton runs an e4m3 tl.dot with "fast accumulation" unless told
# otherwise (its CUDA backend sets max_num_imprecise_acc_default = 2**30 on sm_90): the tensor cores
# keep the running sum with a reduced mantissa (about 13-14 bits; DeepSeek-V3, arXiv 2412.19437, sec.
# 3.3.2), so a few percent of the bf16 outputs land one bf16 ulp from the exactly rounded value (5.4%
# on an H100 at 49152 x 768 -> 3072). Record #89's kernel calls tl.dot with Triton's defaults, i.e. with
# fast accumulation; fast_accum=True (the default here) does the same. fast_accum=False passes
# max_num_imprecise_acc=32: the running sum is promoted to fp32 after every 32-deep wgmma instruction,
# as cuBLAS does without fast accumulation (0 would leave wgmma for Ampere's mma.sync);
# tests/bench_kernels.py measures what it costs. Other GPUs and the interpreter accumulate in fp32.

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def relu2_fp8_up_reference(x_f8: Tensor, w_up_f8: Tensor, dequant: Tensor, act_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(post, post_f8, amax) of the FP8 up-projection, in plain torch ops.

    pre = bf16(dequant * (x_f8 @ w_up_f8^T)) with fp32 accumulation (float8 products are exact in fp32);
    post = relu(pre)^2 rounded to bf16; post_f8 = e4m3(min(post * (1 / act_scale), 448)); amax = max(post)
    (post >= 0), fp32. dequant and act_scale are one-element fp32 tensors.
    """
    acc = (x_f8.float() @ w_up_f8.float().mT) * dequant
    r = torch.relu(acc.to(torch.bfloat16)).float()
    post = (r * r).to(torch.bfloat16)  # a bf16 square: r*r is exact in fp32, rounded once
    post_f8 = (post.float() * (1.0 / act_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return post, post_f8, post.amax().float()


@triton.jit
def _fp8_relu2_kernel(
    a_ptr, b_ptr, post_ptr, q_ptr, amax_ptr, dequant_ptr, act_scale_ptr,
    M, N, K,
    sam, sak, sbk, sbn, spm, spn, sqm, sqn,
    FAST_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """post = relu(bf16(dequant * (A @ B)))^2 (bf16) and Q = e4m3(min(post * (1 / act_scale), 448)) for e4m3
    A (M, K), B (K, N); persistent over GROUP_M-swizzled tiles. Program p writes the max of post over
    its tiles to amax[p] (post >= 0 and masked elements are 0, so padding never raises it)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    dequant = tl.load(dequant_ptr)
    inv_act = 1.0 / tl.load(act_scale_ptr)
    row_max = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for tile in tl.range(pid, num_pid_m * num_pid_n, nprog):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = offs_m.to(tl.int64)
        a_tile = a_ptr + rows[:, None] * sam + offs_k[None, :] * sak
        b_tile = b_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            a = tl.load(a_tile, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_tile, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            if FAST_ACC:  # Triton's default for e4m3 on sm_90: the record's
                acc = tl.dot(a, b, acc, out_dtype=tl.float32)
            else:  # promoted to fp32 after every 32-deep wgmma (0 would fall back to pre-Hopper mma.sync)
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=32, out_dtype=tl.float32)
            a_tile += BLOCK_K * sak
            b_tile += BLOCK_K * sbk

        r = tl.maximum((acc * dequant).to(tl.bfloat16).to(tl.float32), 0.0)
        post = (r * r).to(tl.bfloat16)
        in_bounds = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(post_ptr + rows[:, None] * spm + offs_n[None, :] * spn, post, mask=in_bounds)
        post32 = post.to(tl.float32)
        q = tl.minimum(post32 * inv_act, 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + rows[:, None] * sqm + offs_n[None, :] * sqn, q, mask=in_bounds)
        row_max = tl.maximum(row_max, tl.max(post32, axis=1))
    tl.store(amax_ptr + pid, tl.max(row_max, axis=0))


def _fp8_up_config(M: int, N: int, device: torch.device) -> dict:
    """The MLP tiles with K tiles twice as deep: an e4m3 tile of 128 columns is as many bytes as a bf16
    tile of 64, so the pipeline keeps the bf16 kernel's shared-memory footprint per stage."""
    cfg = _mm_config(M, N, 0, device)
    if device.type == "cuda":
        cfg["BLOCK_K"] *= 2
    return cfg


def _check_fp8_up_args(x_f8: Tensor, w_up_f8: Tensor, dequant: Tensor, act_scale: Tensor) -> None:
    for name, t in (("x_f8", x_f8), ("w_up_f8", w_up_f8)):
        if t.dim() != 2 or t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"relu2_fp8_up: {name} must be a 2-D float8_e4m3fn tensor, got {t.dtype} {tuple(t.shape)}")
    if x_f8.shape[1] != w_up_f8.shape[1]:
        raise ValueError(f"relu2_fp8_up: x_f8 has {x_f8.shape[1]} features but w_up_f8 expects {w_up_f8.shape[1]}")
    for name, t in (("dequant", dequant), ("act_scale", act_scale)):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(f"relu2_fp8_up: {name} must be one float32 value, got {t.dtype} with {t.numel()} elements")


def fp8_up_kernel_args(x_f8: Tensor, w_up_f8: Tensor, dequant: Tensor, act_scale: Tensor, fast_accum: bool = True,
                       config: dict | None = None) -> tuple[tuple, tuple, dict, tuple[Tensor, Tensor, Tensor]]:
    """The up-projection kernel's (grid, arguments, meta-parameters) and its outputs, allocated: post (T, H)
    bf16, post_f8 (T, H) e4m3 and the per-program maxima of post (programs,) fp32; config: tiles other
    than _fp8_up_config's. The operands are checked here (CUDA, or CPU under the interpreter)."""
    _check_fp8_up_args(x_f8, w_up_f8, dequant, act_scale)
    _check_runnable(_fp8_relu2_kernel, x_f8, w_up_f8, dequant, act_scale)
    M, K = x_f8.shape
    N = w_up_f8.shape[0]
    cfg = dict(config) if config is not None else _fp8_up_config(M, N, x_f8.device)
    programs = _num_programs(x_f8.device, triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]))
    post = torch.empty(M, N, dtype=torch.bfloat16, device=x_f8.device)
    post_f8 = torch.empty(M, N, dtype=torch.float8_e4m3fn, device=x_f8.device)
    partial = torch.empty(programs, dtype=torch.float32, device=x_f8.device)
    b = w_up_f8.mT  # (K, N), K contiguous per column: the operand order fp8 tensor cores read
    args = (x_f8, b, post, post_f8, partial, dequant, act_scale, M, N, K, x_f8.stride(0), x_f8.stride(1),
            b.stride(0), b.stride(1), post.stride(0), post.stride(1), post_f8.stride(0), post_f8.stride(1))
    return (programs,), args, dict(FAST_ACC=bool(fast_accum), **cfg), (post, post_f8, partial)


def relu2_fp8_up_triton(x_f8: Tensor, w_up_f8: Tensor, dequant: Tensor, act_scale: Tensor,
                        config: dict | None = None, fast_accum: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Triton path of `relu2_fp8_up`: (post, post_f8, per-program maxima of post (programs,) fp32)."""
    grid, args, meta, outputs = fp8_up_kernel_args(x_f8, w_up_f8, dequant, act_scale, fast_accum, config)
    _fp8_relu2_kernel[grid](*args, **meta)
    return outputs


def relu2_fp8_up_partial_count(M: int, N: int, device: torch.device) -> int:
    """Length of relu2_fp8_up_partials' maxima for x_f8 (M, D), w_up_f8 (N, D) on `device`: the kernel's
    persistent grid on CUDA (one program per SM at training sizes), 1 elsewhere (the reference)."""
    if device.type != "cuda":
        return 1
    cfg = _fp8_up_config(M, N, device)
    return _num_programs(device, triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]))


def relu2_fp8_up_partials(x_f8: Tensor, w_up_f8: Tensor, dequant: Tensor, act_scale: Tensor,
                          fast_accum: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """`relu2_fp8_up` with the amax left unreduced: (post, post_f8, maxima of post over disjoint parts
    (relu2_fp8_up_partial_count(T, H, device),) fp32), whose max is the amax of post. The FP8 MLP
    reduces every layer's maxima in one go after the last layer, as record #89's kernel does with its
    per-SM partial maxima (modded-nanogpt PR #342): no reduction launch per layer."""
    if x_f8.is_cuda:
        return relu2_fp8_up_triton(x_f8, w_up_f8, dequant, act_scale, fast_accum=fast_accum)
    _check_fp8_up_args(x_f8, w_up_f8, dequant, act_scale)
    post, post_f8, amax = relu2_fp8_up_reference(x_f8, w_up_f8, dequant, act_scale)
    return post, post_f8, amax.reshape(1)


def relu2_fp8_up(x_f8: Tensor, w_up_f8: Tensor, dequant: Tensor, act_scale: Tensor,
                 fast_accum: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(post bf16 (T, H), post_f8 e4m3 (T, H), amax of post (0-D fp32)) of the FP8 up-projection.

    x_f8 (T, D) and w_up_f8 (H, D) are e4m3, dequant = the product of both operands' scales, act_scale
    the delayed scale of post_f8 (record #89). fast_accum: the tensor cores' reduced-precision running
    sum on sm_90 (the record's; see the section comment), else fp32 promotion throughout. Not
    differentiable: the FP8 MLP op around it owns the (bf16) backward. CUDA runs the kernel (the maximum
    is reduced from per-program partials on the device, no host sync), other devices the reference.
    """
    post, post_f8, partial = relu2_fp8_up_partials(x_f8, w_up_f8, dequant, act_scale, fast_accum=fast_accum)
    return post, post_f8, partial.amax()


# ----------------------------------------------------------------------------------------------
# Softcapped cross-entropy with multi-token prediction and the prefix-token term
# ----------------------------------------------------------------------------------------------
#
# The training loss of record #89 (modded-nanogpt PR #342). Per position t, with the softcapped logits
# z = 23 sigma((l + 5) / 7.5), MTP weights w_0..w_{K-1} and the prefix weight pi:
#   loss[t] = sum_{k < K, t + k < T} w_k (lse(z_t) - z_t[targets[t + k]])
#             + [prefix_ids[t] >= 0] pi (lse(z_t) - z_t[prefix_ids[t]])
# and its gradient is the record's, which is not exactly d(grad_scale * sum(loss))/dlogits:
#   dlogits[t] = grad_scale (S_t softmax(z_t) - sum of the weights whose target is the column)
#                * 23/7.5 sigma (1 - sigma),
#   S_t = sum of ALL K MTP weights + pi [prefix valid]: the weights of targets past the end of the
#   sequence still count in S_t, so at the last K-1 positions the gradient is not the loss's.
# Whatever gradient flows back into the loss is ignored: the gradient is the one above, computed in
# the forward pass for the grad_scale the caller gives (the record assumes the upstream gradient is
# grad_scale; train_gpt's loss is sum(loss) * grad_scale, which sends exactly that).
#
# For the FP8 LM head the gradient is written directly as float8_e5m2, the operand of the head's FP8
# backward matmuls (record #89): dlogits * grad_mul (grad_mul = 1 / the head's gradient scale),
# clamped to +-57344 (e5m2's largest finite value: saturating, never inf) and rounded to nearest even,
# in the same pass, so no logits-sized bf16 gradient is written, read back, scaled and cast again.
#
# sigma is computed as 0.5 + 0.5 tanh(x / 2), x = (l + 5) / 7.5, with fast math, and stored in bf16
# (record #89): the rounded value (ties to even) is the only sigma used here, in z = 23 bf16(sigma) and
# in the derivative factor sigma (1 - sigma). Exact: the bf16 rounding of a given fp32 sigma (the
# kernel rounds with integer ops, bit-identical to torch's). Not exact: the fp32 sigma before rounding.
# The kernel evaluates the record's formula with an accurate tanh (one exp); the CPU twin and the
# reference use torch.sigmoid, the same function in exact arithmetic (torch's fp32 tanh is ~8x slower
# on a CPU and rounds ~5e-4 of sigmas to the other bf16 neighbour of the float64 value). Both match
# float64 math rounded to bf16 at all but a few logits in a million; the record's fast-math tanh is an
# approximation whose values are not reproduced, so its bf16 sigma can be one bf16 ulp (2^-8 for
# sigma >= 0.5) away from ours wherever its fp32 value falls across a rounding midpoint. The kernel's
# FAST_TANH=True takes the GPU's one-instruction tanh.approx.f32 instead (fast math, and cheaper than
# the exp and division of the accurate form); it is not the default: the GPU check's kernel-tuning
# sweep times it first.


def softcap(logits: torch.Tensor) -> torch.Tensor:
    """Evaluation's z = 23 * sigmoid((logits + 5) / 7.5), computed in fp32 and rounded once to the
    logits' dtype, returned in fp32: record #89 evaluates the softcap on its bf16 logits in bf16 (one
    fused, compiled expression: fp32 inside, a bf16 result), then casts to fp32. On the trained CPU demo
    this rounding raises the validation loss by 0.0002-0.0005 over an fp32 z (records/README.md)."""
    return (23.0 * torch.sigmoid((logits.float() + 5.0) / 7.5)).to(logits.dtype).float()


def softcap_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Evaluation's fp32 log-probabilities log_softmax(softcap(logits)) of (R, V) logits, bit for bit.

    On a CPU the reference's out-of-place ops each write a fresh (R, V) fp32 tensor (7 of them, ~200 MB
    each for 1,024 rows of a 50,304 vocabulary), and page faults and memory traffic make evaluation
    several times slower than a training step per token. Here the same ops run in place on one block of
    CE_CPU_ROWS rows at a time, which stays in cache, and each block's log-softmax goes into one output:
    every op is elementwise or row-wise, so the values are the reference's, bit for bit (a test checks
    it on both CPU kinds and thread counts). Meant for CPUs: on a GPU the compiled reference fuses."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for _, _, (block, dst) in _row_blocks(logits.shape[0], logits, out):
        z = block.to(torch.float32, copy=True)  # the ops below work in place
        z.add_(5.0).div_(7.5).sigmoid_().mul_(23.0)
        if logits.dtype != torch.float32:
            z.copy_(z.to(logits.dtype))  # softcap's single rounding to the logits' dtype
        torch.log_softmax(z, dim=-1, out=dst)
    return out


def softcap_sigma_bf16(logits: torch.Tensor) -> torch.Tensor:
    """The training loss's sigma((logits + 5) / 7.5) (= 0.5 + 0.5 tanh((logits + 5) / 15)), rounded to
    bf16 and returned in fp32; z = 23 * this (see the section comment)."""
    # in place on one fp32 copy: the CPU twin calls this per block of rows
    sigma = logits.to(torch.float32, copy=True).add_(5.0).mul_(1.0 / 7.5).sigmoid_()
    return sigma.bfloat16().float()


def _check_ce_args(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                   prefix_weight: Tensor | None, grad_scale: float) -> None:
    if logits.dim() != 2:
        raise ValueError(f"softcapped_ce_mtp: logits must be (T, V), got shape {tuple(logits.shape)}")
    T = logits.shape[0]
    if targets.shape != (T,):
        raise ValueError(f"softcapped_ce_mtp: targets must be ({T},), got {tuple(targets.shape)}")
    if mtp_weights.dim() != 1 or not 1 <= mtp_weights.shape[0] <= 3:
        raise ValueError(f"softcapped_ce_mtp: mtp_weights must be a 1-D tensor of 1 to 3 weights, got shape {tuple(mtp_weights.shape)}")
    if (prefix_ids is None) != (prefix_weight is None):
        raise ValueError("softcapped_ce_mtp: prefix_ids and prefix_weight must be given together")
    if prefix_ids is not None and (prefix_ids.shape != (T,) or prefix_ids.is_floating_point()):
        raise ValueError(f"softcapped_ce_mtp: prefix_ids must be ({T},) integers, "
                         f"got {tuple(prefix_ids.shape)} {prefix_ids.dtype}")
    if prefix_weight is not None and (prefix_weight.dim() != 0 or not prefix_weight.is_floating_point()):
        raise ValueError(f"softcapped_ce_mtp: prefix_weight must be a 0-D float tensor, "
                         f"got shape {tuple(prefix_weight.shape)} {prefix_weight.dtype}")
    if not math.isfinite(grad_scale):
        raise ValueError(f"softcapped_ce_mtp: grad_scale must be a finite number, got {grad_scale}")


class _RecordCEReference(torch.autograd.Function):
    """The loss of the section comment on full (T, V) fp32 tensors; backward returns the record's
    gradient, computed here in the forward pass from its formula, and ignores the incoming gradient."""

    @staticmethod
    def forward(ctx, logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale):
        sigma = softcap_sigma_bf16(logits)
        z = 23.0 * sigma
        lse = torch.logsumexp(z, dim=1)
        T = z.shape[0]
        rows = torch.arange(T, device=z.device)
        loss = torch.zeros(T, dtype=torch.float32, device=z.device)
        onehots = torch.zeros_like(z)  # sum of the weights whose target is the column
        w = mtp_weights.float()
        for k in range(w.shape[0]):
            n = max(T - k, 0)
            tgt = targets[k:].long()
            loss[:n] += w[k] * (lse[:n] - z[rows[:n], tgt])
            onehots[rows[:n], tgt] += w[k]
        normaliser = w.sum().expand(T)  # every MTP weight, also where t + k >= T (the record's)
        if prefix_ids is not None:
            valid = prefix_ids >= 0
            pi = torch.where(valid, prefix_weight.float(), 0.0)
            col = prefix_ids.long().clamp(min=0)
            loss += pi * (lse - z[rows, col])
            onehots[rows, col] += pi
            normaliser = normaliser + pi
        p = torch.softmax(z, dim=1)
        grad = grad_scale * (normaliser[:, None] * p - onehots) * (23.0 / 7.5) * sigma * (1.0 - sigma)
        ctx.save_for_backward(grad.to(logits.dtype))
        next_token = lse - z[rows, targets.long()]
        ctx.mark_non_differentiable(next_token)
        return loss, next_token

    @staticmethod
    def backward(ctx, _dloss, _dnext_token):
        (grad,) = ctx.saved_tensors
        return grad, None, None, None, None, None


def softcapped_ce_mtp_reference(logits: torch.Tensor, targets: torch.Tensor, mtp_weights: torch.Tensor,
                                prefix_ids: torch.Tensor | None = None, prefix_weight: torch.Tensor | None = None,
                                grad_scale: float = 1.0, next_token: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Plain-torch reference of `softcapped_ce_mtp`: the same loss, next-token loss and gradient, on
    full (T, V) tensors."""
    _check_ce_args(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale)
    loss, nt = _RecordCEReference.apply(logits, targets, mtp_weights, prefix_ids, prefix_weight, float(grad_scale))
    return (loss, nt) if next_token else loss


@triton.jit
def _tanh(y):
    """tanh from one exp of a non-positive number (never overflows), a few fp32 ulps from exact."""
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _round_to_bf16(v):
    """v (fp32, finite) rounded to the nearest bf16, ties to even, returned in fp32. Integer ops
    rather than a cast: the interpreter's fp32 -> bf16 cast truncates, this gives the same bits on
    a GPU and in the interpreter, and the same as torch's .bfloat16()."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tanh_approx(y):
    """The GPU's one-instruction tanh (PTX tanh.approx.f32, sm_75+; about 2^-11 relative error): fast
    math, which record #89 names for its sigma (whether its compiler picks this same instruction is not
    established). CUDA only (the interpreter runs no PTX)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _softcap_sigma(x, FAST_TANH: tl.constexpr = False):
    """The record's stored sigma of logits x (fp32): bf16(0.5 + 0.5 tanh(u / 2)), u = (x + 5) / 7.5.
    FAST_TANH: the hardware's approximate tanh instead of the accurate one (a tuning candidate)."""
    u = (x + 5.0) * (1.0 / 15.0)
    if FAST_TANH:
        t = _tanh_approx(u)
    else:
        t = _tanh(u)
    return _round_to_bf16(0.5 + 0.5 * t)


E5M2_MAX = 57344.0  # largest finite float8_e5m2


@triton.jit
def _ce_mtp_kernel(
    logits_ptr, targets_ptr, weights_ptr, prefix_ids_ptr, prefix_weight_ptr, loss_ptr, next_token_ptr, grad_ptr,
    T, V, s_lt, s_gt, grad_scale, grad_mul,
    K: tl.constexpr, HAS_PREFIX: tl.constexpr, J_POW2: tl.constexpr, BLOCK_V: tl.constexpr,
    GRAD_E5M2: tl.constexpr, FAST_TANH: tl.constexpr = False,
):
    """One program per token row: loss[t], the next-token loss next_token[t] = lse - z[targets[t]]
    and the record's dlogits[t, :] in two passes over the row.
    GRAD_E5M2: dlogits * grad_mul saturated to +-57344 and stored as e5m2 (grad_ptr is e5m2).

    The row's targets sit in one vector of J_POW2 slots: slots 0..K-1 are the MTP targets, slot K the
    prefix token (HAS_PREFIX). A slot without a target (past the end, invalid prefix) holds -1.
    """
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    x_row = logits_ptr + row64 * s_lt
    g_row = grad_ptr + row64 * s_gt
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: sum of exp(z). z < 23 so no running max is needed.
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        x = tl.load(x_row + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        acc += tl.where(ok, tl.exp(23.0 * _softcap_sigma(x, FAST_TANH)), 0.0)
    lse = tl.log(tl.sum(acc, axis=0))

    slots = tl.arange(0, J_POW2)
    is_mtp = slots < K
    tgt = tl.load(targets_ptr + row + slots, mask=is_mtp & (row + slots < T), other=-1).to(tl.int32)
    w = tl.load(weights_ptr + slots, mask=is_mtp, other=0.0).to(tl.float32)
    if HAS_PREFIX:
        prefix = tl.load(prefix_ids_ptr + row).to(tl.int32)
        is_prefix = (slots == K) & (prefix >= 0)
        tgt = tl.where(is_prefix, prefix, tgt)
        w = tl.where(is_prefix, tl.load(prefix_weight_ptr).to(tl.float32), w)
    normaliser = tl.sum(w, axis=0)     # every MTP weight, even past the end (the record's S_t)
    w_hit = tl.where(tgt >= 0, w, 0.0)  # loss and one-hot terms: only targets that exist
    x_t = tl.load(x_row + tgt, mask=tgt >= 0, other=0.0).to(tl.float32)
    s_t = _softcap_sigma(x_t, FAST_TANH)
    z_t = 23.0 * s_t
    ce_t = lse - z_t                    # each target's cross-entropy; slot 0 is the next token's
    tl.store(loss_ptr + row, tl.sum(w_hit * ce_t, axis=0))
    tl.store(next_token_ptr + row, tl.sum(tl.where(slots == 0, ce_t, 0.0), axis=0))

    # Pass 2: the gradient, scaled by grad_scale and written once in the logits' dtype, without the
    # one-hot terms (a column that is no target has none: (S p - 0) f = (S p) f, bit for bit) ...
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        x = tl.load(x_row + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        s = _softcap_sigma(x, FAST_TANH)
        p = tl.exp(23.0 * s - lse)
        g = (normaliser * p) * ((23.0 / 7.5) * grad_scale * s * (1.0 - s))
        if GRAD_E5M2:
            g = tl.minimum(tl.maximum(g * grad_mul, -57344.0), 57344.0)
        tl.store(g_row + v0 + cols, g.to(grad_ptr.dtype.element_ty), mask=ok)
    # ... then the row's target columns (at most J_POW2) written again with them. A column's one-hot
    # weight sums the weights of every slot naming it, in slot order, as a compare-and-sum per element
    # did: duplicate columns get the same value, whichever slot stores last. The barrier orders these
    # stores after the loop's stores to the same columns (other threads of the program wrote those).
    tl.debug_barrier()
    p_t = tl.exp(23.0 * s_t - lse)
    hit_t = tl.sum(tl.where(tgt[:, None] == tgt[None, :], w_hit[None, :], 0.0), axis=1)
    g_t = (normaliser * p_t - hit_t) * ((23.0 / 7.5) * grad_scale * s_t * (1.0 - s_t))
    if GRAD_E5M2:
        g_t = tl.minimum(tl.maximum(g_t * grad_mul, -57344.0), 57344.0)
    tl.store(g_row + tgt, g_t.to(grad_ptr.dtype.element_ty), mask=tgt >= 0)


def _ce_config(V: int, device: torch.device) -> dict:
    """4096-wide vocab chunks (8 KB of bf16 per load, 16 values per thread with 8 warps) on GPU."""
    if device.type != "cuda":
        return dict(BLOCK_V=min(256, triton.next_power_of_2(V)), num_warps=4)
    return dict(BLOCK_V=4096, num_warps=8)


def _grad_dtype(logits: Tensor, grad_mul: float) -> torch.dtype:
    """dlogits in the logits' dtype, or e5m2 (scaled by grad_mul) when grad_mul > 0."""
    return torch.float8_e5m2 if grad_mul > 0 else logits.dtype


def ce_kernel_args(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                   prefix_weight: Tensor | None, grad_scale: float, grad_mul: float = 0.0,
                   config: dict | None = None) -> tuple[tuple, tuple, dict, tuple[Tensor, Tensor, Tensor]]:
    """The loss kernel's (grid, arguments, meta-parameters) and its outputs, allocated: the per-token loss
    (T,) fp32, the next-token loss (T,) fp32 and dlogits (T, V) (_grad_dtype), once the inputs pass
    softcapped_ce_mtp's checks; config: tiles other than _ce_config's (the GPU check's tuning sweep)."""
    _check_ce_args(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale)
    if not (math.isfinite(grad_mul) and grad_mul >= 0):
        raise ValueError(f"softcapped_ce_mtp: grad_mul must be a finite number >= 0, got {grad_mul}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    targets, mtp_weights, prefix_ids, prefix_weight = _ce_inputs(targets, mtp_weights, prefix_ids, prefix_weight)
    has_prefix = prefix_ids is not None
    extra = (prefix_ids, prefix_weight) if has_prefix else ()
    _check_runnable(_ce_mtp_kernel, logits, targets, mtp_weights, *extra)
    T, V = logits.shape
    K = mtp_weights.shape[0]
    loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    next_token = torch.empty(T, dtype=torch.float32, device=logits.device)
    grad = torch.empty((T, V), dtype=_grad_dtype(logits, grad_mul), device=logits.device)
    args = (logits, targets, mtp_weights, prefix_ids if has_prefix else targets,
            prefix_weight if has_prefix else mtp_weights, loss, next_token, grad, T, V, logits.stride(0),
            grad.stride(0), float(grad_scale), float(grad_mul))
    meta = dict(K=K, HAS_PREFIX=has_prefix, J_POW2=max(2, triton.next_power_of_2(K + has_prefix)),
                GRAD_E5M2=grad_mul > 0, **(config or _ce_config(V, logits.device)))
    return (T,), args, meta, (loss, next_token, grad)


@torch.library.custom_op("speedrun::softcapped_ce_mtp_fwd", mutates_args=())
def _ce_mtp_fwd_op(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                   prefix_weight: Tensor | None, grad_scale: float, grad_mul: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (per-token loss (T,) fp32, per-token next-token loss (T,) fp32, the record's dlogits
    (T, V) in the logits' dtype, or in e5m2 times grad_mul, saturated, when grad_mul > 0)."""
    grid, args, meta, outputs = ce_kernel_args(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale,
                                               grad_mul)
    if grid[0]:  # no rows: nothing to launch (an empty tensor has no address for the kernel)
        _ce_mtp_kernel[grid](*args, **meta)
    return outputs


@_ce_mtp_fwd_op.register_fake
def _(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale, grad_mul=0.0):
    return (logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(logits.shape[0], dtype=torch.float32),
            torch.empty_like(logits, dtype=_grad_dtype(logits, grad_mul)))


def _ce_setup(ctx, inputs, output):
    """The loss ops' outputs: the loss, the next-token loss (a reading, no gradient), then the gradients
    of their leading inputs, computed in the forward pass: saved as they are for backward."""
    grads = output[2:]
    ctx.save_for_backward(*grads)
    ctx.mark_non_differentiable(output[1], *grads)
    ctx.set_materialize_grads(False)  # no zero (T, V) tensor for the gradient outputs nobody uses
    ctx.num_inputs = len(inputs)


def _ce_backward(ctx, _dloss, _dnext_token, *_dgrads):
    """The stored gradients as they are: the incoming one is ignored (the record's; see the section comment)."""
    grads = ctx.saved_tensors
    return *grads, *(None,) * (ctx.num_inputs - len(grads))


_ce_mtp_fwd_op.register_autograd(_ce_backward, setup_context=_ce_setup)


def _ce_inputs(targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None, prefix_weight: Tensor | None):
    """Kernel-ready inputs: contiguous int64 ids, fp32 weights."""
    prefix = None if prefix_ids is None else (prefix_ids.long().contiguous(), prefix_weight.float().contiguous())
    return targets.long().contiguous(), mtp_weights.float().contiguous(), *(prefix or (None, None))


def softcapped_ce_mtp_triton(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None = None,
                             prefix_weight: Tensor | None = None, grad_scale: float = 1.0,
                             next_token: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Triton path of `softcapped_ce_mtp`; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    return softcapped_ce_mtp(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale, next_token, kernel=True)


# The CPU twin of the kernel: the same one-pass algorithm (loss and dlogits together, per block of rows,
# never a full fp32 (T, V) tensor) in plain torch ops. The autograd graph of a plain-torch loss holds
# several fp32 (T, V) intermediates; this is ~5x faster on a CPU, which is what makes the CPU demo practical.
CE_CPU_ROWS = 8  # rows per block: 8 x 50304 fp32 values stay in a 2 MiB L2 cache


def _ce_rows_block(logits: Tensor, cols: Tensor, w_hit: Tensor, normaliser: Tensor, grad_out: Tensor,
                   grad_scale: float, grad_mul: float = 0.0) -> tuple[Tensor, Tensor]:
    """(loss (R,), next-token loss (R,)) of one block of rows, writing the record's dlogits (R, V) into
    grad_out; cols and w_hit (R, J) are the rows' target columns and their weights (0 where there is no
    target; column 0 is the next token, always there), normaliser (R,) the rows' S_t. In-place ops keep
    it to a few cache-resident passes over the block.
    grad_mul > 0: grad_out is e5m2 and receives dlogits * grad_mul saturated to +-E5M2_MAX."""
    sigma = softcap_sigma_bf16(logits)
    e = sigma.mul(23.0).exp_()                                 # exp(z), z < 23: no overflow in fp32
    total = e.sum(dim=1)
    ce = total.log()[:, None] - 23.0 * sigma.gather(1, cols)  # each target's cross-entropy (R, J)
    loss = (w_hit * ce).sum(dim=1)
    # dlogits = (S softmax(z) - sum_j w_j onehot(col_j)) * 23/7.5 sigma (1 - sigma) * grad_scale, the
    # constant folded into the row scale and the one-hot weights; the last product is rounded once
    scale = grad_scale * 23.0 / 7.5
    g = e.mul_((normaliser * scale / total)[:, None])
    g.scatter_add_(1, cols, w_hit * -scale)
    if grad_mul > 0:  # fp32 as above, then scaled, saturated and rounded to e5m2 once, as in the kernel
        g.mul_(torch.addcmul(sigma, sigma, sigma, value=-1.0)).mul_(grad_mul).clamp_(-E5M2_MAX, E5M2_MAX)
        grad_out.copy_(g)
    else:
        torch.mul(g, torch.addcmul(sigma, sigma, sigma, value=-1.0), out=grad_out)
    return loss, ce[:, 0]


def _row_blocks(T: int, *tensors: Tensor):
    """(start, stop, [row block of each tensor]) over the rows, CE_CPU_ROWS at a time."""
    for a in range(0, T, CE_CPU_ROWS):
        b = min(a + CE_CPU_ROWS, T)
        yield a, b, [t[a:b] for t in tensors]


def _ce_row_targets(targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None, prefix_weight: Tensor | None):
    """Per row: target columns (T, J) (0 where there is none), their weights (T, J) (0 where there is
    none) and the record's normaliser S_t (T,), J = K MTP offsets plus the prefix token if given;
    column 0 is the next token."""
    T, K = targets.shape[0], mtp_weights.shape[0]
    idx = torch.arange(T, device=targets.device)[:, None] + torch.arange(K, device=targets.device)[None, :]
    cols = targets.long()[idx.clamp(max=max(T - 1, 0))]
    w_hit = mtp_weights.float()[None, :] * (idx < T).float()
    normaliser = mtp_weights.float().sum().expand(T)  # every weight, also past the end
    if prefix_ids is not None:
        valid = prefix_ids >= 0
        pi = torch.where(valid, prefix_weight.float(), 0.0)
        cols = torch.cat([cols, prefix_ids.long().clamp(min=0)[:, None]], dim=1)
        w_hit = torch.cat([w_hit, pi[:, None]], dim=1)
        normaliser = normaliser + pi
    return cols, w_hit, normaliser


@torch.library.custom_op("speedrun::softcapped_ce_mtp_rows", mutates_args=())
def _ce_mtp_rows_op(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                    prefix_weight: Tensor | None, grad_scale: float, grad_mul: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (per-token loss (T,) fp32, per-token next-token loss (T,) fp32, the record's dlogits
    (T, V) in the logits' dtype, or e5m2 as the kernel's when grad_mul > 0)."""
    T, V = logits.shape
    loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    next_token = torch.empty(T, dtype=torch.float32, device=logits.device)
    grad = torch.empty((T, V), dtype=_grad_dtype(logits, grad_mul), device=logits.device)
    cols, w_hit, normaliser = _ce_row_targets(targets, mtp_weights, prefix_ids, prefix_weight)
    for a, b, (lg, c, w, n, go) in _row_blocks(T, logits, cols, w_hit, normaliser, grad):
        loss[a:b], next_token[a:b] = _ce_rows_block(lg, c, w, n, go, grad_scale, grad_mul)
    return loss, next_token, grad


@_ce_mtp_rows_op.register_fake
def _(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale, grad_mul=0.0):
    return (logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(logits.shape[0], dtype=torch.float32),
            torch.empty_like(logits, dtype=_grad_dtype(logits, grad_mul)))


_ce_mtp_rows_op.register_autograd(_ce_backward, setup_context=_ce_setup)


# The CPU head with its loss: logits = x @ w, the loss and dlogits above, and the two matmuls of the
# backward (dx = dlogits @ w^T, dw = x^T @ dlogits), a block of CE_CPU_HEAD_ROWS rows at a time in one
# reused (rows, V) buffer. Unfused, a micro-batch holds the full (T, V) logits and their gradient
# (300 MB each in fp32 at 1,536 tokens and V = 50,304): too large for the allocator's heap, so both are
# mapped and their pages faulted in afresh every time, about a fifth of a CPU run's time spent in the
# kernel. Each row's loss and dx come from that row alone, as unfused; dw sums the blocks' products in
# fp32: both agree with the unfused ones to rounding.
CE_CPU_HEAD_ROWS = 256  # 51 MB of fp32 logits; faster than 64 or 1,024 rows on the demo model (5-12%)


@torch.library.custom_op("speedrun::softcapped_ce_mtp_head_rows", mutates_args=())
def _ce_mtp_head_rows_op(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                         prefix_weight: Tensor | None, grad_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (per-token loss (T,) fp32, per-token next-token loss (T,) fp32, dx (T, D) in x's dtype,
    dw (D, V) in w's dtype) for the record's gradient of logits = x @ w."""
    T, V = x.shape[0], w.shape[1]
    loss = torch.empty(T, dtype=torch.float32, device=x.device)
    next_token = torch.empty(T, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    cols, w_hit, normaliser = _ce_row_targets(targets, mtp_weights, prefix_ids, prefix_weight)
    buffer = x.new_empty((min(CE_CPU_HEAD_ROWS, T), V))
    for a in range(0, T, CE_CPU_HEAD_ROWS):
        b = min(a + CE_CPU_HEAD_ROWS, T)
        block = torch.mm(x[a:b], w, out=buffer[: b - a])
        for c, d, (lg, cc, wh, n) in _row_blocks(b - a, block, cols[a:b], w_hit[a:b], normaliser[a:b]):
            loss[a + c: a + d], next_token[a + c: a + d] = _ce_rows_block(lg, cc, wh, n, lg, grad_scale)  # dlogits over the logits
        torch.mm(block, w.T, out=dx[a:b])
        if block.dtype == torch.float32:
            dw.addmm_(x[a:b].T, block)
        else:  # bf16: each block's product is rounded once, the blocks are summed in fp32
            dw.add_(torch.mm(x[a:b].T, block))
    return loss, next_token, dx, dw.to(w.dtype)


@_ce_mtp_head_rows_op.register_fake
def _(x, w, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale):
    return (x.new_empty(x.shape[0], dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32),
            torch.empty_like(x), torch.empty_like(w))


_ce_mtp_head_rows_op.register_autograd(_ce_backward, setup_context=_ce_setup)


def softcapped_ce_mtp_head_rows(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor,
                                prefix_ids: Tensor | None = None, prefix_weight: Tensor | None = None,
                                grad_scale: float = 1.0, next_token: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """softcapped_ce_mtp(x @ w, ...) on a CPU, the head's matmuls fused with the loss (no (T, V) tensor
    lives past a block of rows): the same per-token loss (T,), differentiable in x (T, D) and w (D, V)
    (and with next_token, the next-token loss (T,) too)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0] or x.dtype != w.dtype:
        raise ValueError(f"softcapped_ce_mtp_head_rows: x (T, D) and w (D, V) of one dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(w.shape)} {w.dtype}")
    _check_ce_args(x.new_empty(x.shape[0], 0), targets, mtp_weights, prefix_ids, prefix_weight, grad_scale)
    loss, nt, _, _ = torch.ops.speedrun.softcapped_ce_mtp_head_rows(
        x, w, *_ce_inputs(targets, mtp_weights, prefix_ids, prefix_weight), float(grad_scale))
    return (loss, nt) if next_token else loss


def softcapped_ce_mtp_rows(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None = None,
                           prefix_weight: Tensor | None = None, grad_scale: float = 1.0,
                           next_token: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """CPU path of `softcapped_ce_mtp`: the kernel's fused algorithm in torch ops, block of rows at a time."""
    return softcapped_ce_mtp(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale, next_token, kernel=False)


def softcapped_ce_mtp_e5m2(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                           prefix_weight: Tensor | None, grad_scale: float, grad_s: float,
                           kernel: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss (T,) fp32, per-token next-token loss (T,) fp32, dlogits (T, V) float8_e5m2) for
    the FP8 LM head's backward: the
    record's gradient (see softcapped_ce_mtp) divided by the head's gradient scale grad_s, saturated
    at +-57344 and rounded to nearest, written by the same pass that computes the loss. Not
    differentiable: the FP8 head op owns the backward. kernel: the Triton kernel (default on CUDA) or
    the CPU twin."""
    _check_ce_args(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale)
    if not (math.isfinite(grad_s) and grad_s > 0):
        raise ValueError(f"softcapped_ce_mtp_e5m2: grad_s must be a positive finite number, got {grad_s}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    op = (torch.ops.speedrun.softcapped_ce_mtp_fwd if (logits.is_cuda if kernel is None else kernel)
          else torch.ops.speedrun.softcapped_ce_mtp_rows)
    return op(logits, *_ce_inputs(targets, mtp_weights, prefix_ids, prefix_weight), float(grad_scale), 1.0 / grad_s)


def softcapped_ce_mtp_e5m2_reference(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None,
                                     prefix_weight: Tensor | None, grad_scale: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-torch reference of softcapped_ce_mtp_e5m2: the reference losses and gradient (in the
    logits' dtype, float64 for float64 logits) / grad_s, saturated and rounded to e5m2."""
    x = logits.detach().clone().requires_grad_()
    loss, nt = softcapped_ce_mtp_reference(x, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale,
                                           next_token=True)
    loss.sum().backward()
    return loss.detach(), nt, (x.grad / grad_s).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def softcapped_ce_mtp(logits: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_ids: Tensor | None = None,
                      prefix_weight: Tensor | None = None, grad_scale: float = 1.0, next_token: bool = False,
                      kernel: bool | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token softcapped cross-entropy with multi-token prediction and the prefix-token term; (T,) fp32.

    logits (T, V) (bf16 in training), targets (T,) int with targets[t] the token after position t,
    mtp_weights (K,) fp32 for offsets k = 0..K-1 (a tensor, so changing it never recompiles),
    prefix_ids (T,) int64 (the prefix token of targets[t], -1 for none) with prefix_weight, a 0-D fp32
    tensor (read on the device, no host sync); both None: no prefix term. The loss and the record's
    gradient are defined in the section comment above: backward returns grad_scale times that
    gradient whatever gradient reaches the loss, so use it as sum(loss) * grad_scale. The loss and the
    gradient are computed in one pass over the logits (Triton on CUDA, the CPU twin elsewhere).
    next_token=True: returns (loss, next_token_loss), the second (T,) fp32 the plain next-token
    cross-entropy lse(z_t) - z_t[targets[t]] of the same z (the k = 0 term without its weight, what
    evaluation measures per token), computed by the same pass, without a gradient. kernel: the Triton
    kernel (default on CUDA; softcapped_ce_mtp_triton) or the CPU twin (softcapped_ce_mtp_rows).
    """
    _check_ce_args(logits, targets, mtp_weights, prefix_ids, prefix_weight, grad_scale)
    op = (torch.ops.speedrun.softcapped_ce_mtp_fwd if (logits.is_cuda if kernel is None else kernel)
          else torch.ops.speedrun.softcapped_ce_mtp_rows)
    loss, nt, _ = op(logits, *_ce_inputs(targets, mtp_weights, prefix_ids, prefix_weight), float(grad_scale))
    return (loss, nt) if next_token else loss


# ----------------------------------------------------------------------------------------------
# Transposes for the tied embedding / LM head
# ----------------------------------------------------------------------------------------------


def transpose_copy_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst = src^T for 2-D src (m, n), dst (n, m)."""
    return dst.copy_(src.mT)


def transpose_add_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst += src^T for 2-D src (m, n), dst (n, m)."""
    return dst.add_(src.mT)


@triton.jit
def _transpose_kernel(
    src_ptr, dst_ptr, M, N,
    ssm, ssn, sdn, sdm,
    ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dst[n, m] (+)= src[m, n] one tile at a time.

    The tile is read row-major from src and transposed in registers (Triton stages the layout
    change through shared memory), so both the global read and the global write are coalesced.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile = tl.load(src_ptr + rows_m[:, None] * ssm + offs_n[None, :] * ssn, mask=ok)
    tile_t = tl.trans(tile)
    dst = dst_ptr + rows_n[:, None] * sdn + offs_m[None, :] * sdm
    ok_t = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if ADD:
        cur = tl.load(dst, mask=ok_t, other=0.0)
        tl.store(dst, (cur.to(tl.float32) + tile_t.to(tl.float32)).to(dst_ptr.dtype.element_ty), mask=ok_t)
    else:
        tl.store(dst, tile_t.to(dst_ptr.dtype.element_ty), mask=ok_t)


def _transpose_args(src: Tensor, dst: Tensor, add: bool) -> tuple[tuple, tuple, dict]:
    """The transpose kernel's (grid, arguments, meta-parameters) for dst (+)= src^T, once src and dst pass
    the checks."""
    if src.dim() != 2 or dst.dim() != 2 or tuple(dst.shape) != (src.shape[1], src.shape[0]):
        raise ValueError(f"{'transpose_add' if add else 'transpose_copy'}: need 2-D src (m, n) and dst (n, m), "
                         f"got {tuple(src.shape)} and {tuple(dst.shape)}")
    _check_runnable(_transpose_kernel, src, dst)
    if _overlaps(src, dst):
        raise ValueError("triton_kernels: transpose `dst` must not overlap `src`")
    M, N = src.shape
    block = 64 if src.is_cuda else 32
    grid = (triton.cdiv(M, block), triton.cdiv(N, block))
    args = (src, dst, M, N, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1))
    return grid, args, dict(ADD=add, BLOCK_M=block, BLOCK_N=block, num_warps=4)


@torch.library.custom_op("speedrun::transpose_copy", mutates_args=("dst",))
def _transpose_copy_op(src: Tensor, dst: Tensor) -> None:
    grid, args, meta = _transpose_args(src, dst, add=False)
    _transpose_kernel[grid](*args, **meta)


@torch.library.custom_op("speedrun::transpose_add", mutates_args=("dst",))
def _transpose_add_op(src: Tensor, dst: Tensor) -> None:
    grid, args, meta = _transpose_args(src, dst, add=True)
    _transpose_kernel[grid](*args, **meta)


@_transpose_copy_op.register_fake
def _(src, dst):
    return None


@_transpose_add_op.register_fake
def _(src, dst):
    return None


def transpose_copy_triton(src: Tensor, dst: Tensor) -> Tensor:
    """Triton path of `transpose_copy`; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    torch.ops.speedrun.transpose_copy(src, dst)
    return dst


def transpose_add_triton(src: Tensor, dst: Tensor) -> Tensor:
    """Triton path of `transpose_add`; runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    torch.ops.speedrun.transpose_add(src, dst)
    return dst


def transpose_copy(src: Tensor, dst: Tensor) -> Tensor:
    """dst = src^T for src (m, n), dst (n, m) (dtypes may differ); returns dst.

    Used to copy the LM head (768, 50304) into the tied embedding (50304, 768) with tiled,
    coalesced reads and writes on CUDA.
    """
    if not src.is_cuda:
        return transpose_copy_reference(src, dst)
    torch.ops.speedrun.transpose_copy(src, dst)
    return dst


def transpose_add(src: Tensor, dst: Tensor) -> Tensor:
    """dst += src^T for src (m, n), dst (n, m) (the sum is formed in fp32); returns dst.

    Folds the tied embedding's gradient into the LM head's gradient on CUDA.
    """
    if not src.is_cuda:
        return transpose_add_reference(src, dst)
    torch.ops.speedrun.transpose_add(src, dst)
    return dst
