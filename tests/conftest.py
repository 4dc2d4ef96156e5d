"""Shared pytest set-up.

Triton kernels are tested on CPU tensors through the Triton interpreter, which has to be switched
on before triton_kernels (and its @triton.jit functions) is imported. The public functions still
use the torch reference on CPU, so setting this for the whole test run does not slow other tests.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

# torch.compile's on-disk cache defaults to /tmp/torchinductor_$USER, shared by every checkout (and
# every version of this code) on the machine: an entry written there by another checkout's run made
# test_compiled_forward_backward_matches_eager_on_cpu abort (Fatal Python error inside the cached
# wrapper), and the same test passed with an empty cache. Each checkout keeps its own (gitignored).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_REPO, ".cache", "torchinductor"))


def inductor_cache_dir(env) -> str | None:
    """The torch.compile cache directory a test run under `env` should use, or None for torch's own.

    Inductor's CPU code is generated for one vector ISA (AVX-512: 16 floats a vector; AVX2: 8), picked
    from ATEN_CPU_CAPABILITY when it is set, but its FX-graph cache key leaves the ISA out (torch
    2.14). A run emulating an AVX2 machine (ATEN_CPU_CAPABILITY=avx2) and an ordinary run sharing
    /tmp/torchinductor_$USER load each other's kernels, rebuilt for the other vector width: heap
    corruption ("corrupted size vs. prev_size") or "index out of bounds" aborts in compiled tests. So
    a run that sets the capability gets a cache of its own, which subprocesses inherit.
    """
    cap = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not cap:
        return None
    base = env.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        base = default_cache_dir()
    suffix = f"_isa_{cap}"
    return base if base.endswith(suffix) else base + suffix


_cache_dir = inductor_cache_dir(os.environ)
if _cache_dir is not None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache_dir


def _patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's tl.dot correct for bf16 inputs.

    The interpreter keeps bf16 values as raw uint16 bits and its dot hands those bits straight to
    numpy, so a bf16 dot returns garbage. Kernels feed bf16 tiles to tl.dot directly (the fast path
    on the GPU), so the interpreter is taught to widen them to fp32 first, which is what the tensor
    cores do (exact products, fp32 accumulation).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_bf16_widened", False):
        return
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._bf16_widened = True
    builder.create_dot = create_dot


_patch_interpreter_bf16_dot()


def _patch_interpreter_rounding() -> None:
    """Make the interpreter's narrowing float casts round like Hopper: fp32 -> bf16 to nearest even,
    fp32 -> float8_e4m3fn / float8_e5m2 to nearest even with saturation at +-448 / +-57344.

    The interpreter truncates fp32 -> bf16, and converts to float8 bit by bit (subnormals truncated,
    halves rounded away from zero, values past the top binade on a wrong exponent). The compiled
    kernels' conversions (cvt.rn.bf16.f32, cvt.rn.satfinite.e4m3x2.f32 / e5m2x2) are what torch's CPU casts
    of a clamped value compute, so the interpreter is given those, and kernels whose outputs are
    defined bit for bit (the FP8 MLP up-projection) can be checked exactly.
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_rounds_like_hopper", False):
        return
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def fp32_values(src):
        return torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = fp32_values(src).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            bits = fp32_values(src).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(bits, tl.float8e4nv)
        if dst_type.scalar == tl.float8e5 and src.dtype.scalar in (tl.float32, tl.float16):
            bits = fp32_values(src).clamp(-57344.0, 57344.0).to(torch.float8_e5m2).view(torch.uint8).numpy()
            return interpreter.TensorHandle(bits, tl.float8e5)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    cast_impl._rounds_like_hopper = True
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp


_patch_interpreter_rounding()
