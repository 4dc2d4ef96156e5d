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
