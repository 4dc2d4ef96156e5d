"""The GPU check's coverage scan: every CUDA path of train_gpt.py and triton_kernels.py, found in the
source with `ast`, and which of them no check of tests/gpu_check.py covers (tests/README.md, "GPU
check", Coverage).

Standard library only: `./run.sh gpu-check --dry-run` and tests/test_gpu_check.py run it anywhere.
"""
from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("train_gpt.py", "triton_kernels.py")
KERNEL = "kernel:"


def _qualnames(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, outer ones first."""
    spans = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno, child.end_lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)
    walk(tree, "")
    return spans


def is_cuda_marker(node: ast.AST) -> bool:
    """x.is_cuda, torch.cuda.*, a "cuda..." string (device.type == "cuda", "cuda:nccl"), a comparison
    with "cpu", and calls of _native_fp8 or flex_attention: the ways the two modules branch to GPU-only code."""
    if isinstance(node, ast.Attribute):
        if node.attr == "is_cuda":
            return True
        if node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch":
            return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"cuda(:.*)?", node.value):
        return True
    if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "cpu"
                                             for c in (node.left, *node.comparators)):
        return True  # device.type == "cpu" / != "cpu": the other side of the branch is the GPU's
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in ("_native_fp8", "flex_attention")
    return False


def cuda_paths(sources: dict[str, str]) -> set[str]:
    """Every CUDA path of the given {file name: source}: "kernel:<name>" per @triton.jit function,
    "op:<namespace::name>" per torch.library.custom_op, "cuda:<file>:<function>" per function (the
    innermost one) holding a CUDA marker (is_cuda_marker); "<module>" for top-level code."""
    found = set()
    for fname, text in sources.items():
        tree = ast.parse(text)
        spans = _qualnames(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    dotted = ast.unparse(target)
                    if dotted in ("triton.jit", "jit"):
                        found.add(KERNEL + node.name)
                    if dotted.endswith("custom_op") and isinstance(dec, ast.Call) and dec.args:
                        found.add("op:" + ast.literal_eval(dec.args[0]))
            if is_cuda_marker(node):
                inner = [s for s in spans if s[0] <= node.lineno <= s[1]]
                name = max(inner, key=lambda s: s[0])[2] if inner else "<module>"
                found.add(f"cuda:{fname}:{name}")
    return found


def repo_sources() -> dict[str, str]:
    return {name: open(os.path.join(REPO, name), encoding="utf-8").read() for name in SOURCES}


def coverage(checks, sources=None) -> tuple[set[str], set[str]]:
    """(CUDA paths no check covers, covered names that are no CUDA path: renamed or removed)."""
    paths = cuda_paths(sources if sources is not None else repo_sources())
    covered = {c for check in checks for c in check.covers}
    return paths - covered, covered - paths

