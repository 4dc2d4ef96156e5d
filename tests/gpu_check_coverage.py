"""The GPU check's coverage scan: every CUDA path of train_gpt.py and triton_kernels.py, found in the
source with `ast`, and which of them no check covers (tests/README.md, "GPU check", Coverage).

A CUDA path is named by something a rename of a private helper leaves alone:

- "kernel:<name>" for each @triton.jit function;
- "op:<namespace::name>" for each `torch.library.custom_op` (the name it is registered under);
- "cuda:<file>:<qualified name>" for each public function or method holding a CUDA marker
  (`is_cuda_marker`), or "cuda:<file>:<module>" for top-level code.

A marker inside a private helper (a name with a leading underscore, dunders excepted, or a method of a
private class) is the CUDA path of whatever reaches the helper in the same file: each function that
names it (a call, or a reference handed on), followed through other private helpers until a public
function, a custom op or a kernel. So `Check.covers` lists public names, op names and kernels only,
and renaming a private helper changes no tag. A private helper that nothing in its file reaches keeps
its own name (`private_paths` lists them; the coverage test wants none).

Standard library only: `./run.sh gpu-check --dry-run` and tests/test_gpu_check.py run it anywhere.
"""
from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("train_gpt.py", "triton_kernels.py")
KERNEL, OP, CUDA = "kernel:", "op:", "cuda:"


def is_private(qualname: str) -> bool:
    """A qualified name with a part that starts with an underscore and is no dunder (`__init__`)."""
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
               for part in qualname.split("."))


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


class _Module:
    """One file in one pass: each function's own tag (kernel, op or public name; None when private),
    the functions (None: top-level code) holding a CUDA marker, and those naming each identifier."""

    def __init__(self, fname: str, text: str):
        self.fname = fname
        self.tags: dict[str, str | None] = {}
        self.holders: set[str | None] = set()
        self.named_in: dict[str, set[str | None]] = {}
        for stmt in ast.parse(text).body:
            self._visit(stmt, "", None)

    def _visit(self, node: ast.AST, prefix: str, function: str | None) -> None:
        """Record `node` and what it holds; `function` is the innermost function around it."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            for part in node.decorator_list + getattr(node, "bases", []):  # evaluated where the def stands
                self._visit(part, prefix, function)
            inside = node.body
            if not isinstance(node, ast.ClassDef):
                self.tags[name] = self._own_tag(node, name)
                function, inside = name, [node.args, *inside]  # a "cuda" default counts for the function
            for part in inside:
                self._visit(part, name + ".", function)
            return
        if is_cuda_marker(node):
            self.holders.add(function)
        ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if ident is not None:
            self.named_in.setdefault(ident, set()).add(function)
        for child in ast.iter_child_nodes(node):
            self._visit(child, prefix, function)

    def _own_tag(self, node, qualname: str) -> str | None:
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            dotted = ast.unparse(target)
            if dotted in ("triton.jit", "jit"):
                return KERNEL + node.name
            if dotted.endswith("custom_op") and isinstance(dec, ast.Call) and dec.args:
                return OP + ast.literal_eval(dec.args[0])
            if (isinstance(target, ast.Attribute) and target.attr.startswith("register_")
                    and isinstance(target.value, ast.Name) and (self.tags.get(target.value.id) or "").startswith(OP)):
                return self.tags[target.value.id]  # an op's registered kernel, fake or autograd is the op's
        return None if is_private(qualname) else f"{CUDA}{self.fname}:{qualname}"

    def users(self, qualname: str) -> set[str | None]:
        """The functions (None: top-level code) naming the helper by its first private part, as a name
        (`_helper(...)`, `_Class(...)`) or an attribute (`self._method(...)`), outside its own body."""
        handle = next(p for p in qualname.split(".") if is_private(p))
        return {user for user in self.named_in.get(handle, ())
                if user is None or not (user == qualname or user.startswith(qualname + "."))}

    def owners(self, qualname: str | None, seen: frozenset = frozenset()) -> set[str]:
        """The tags a marker in `qualname` counts for: its own, or those of the functions reaching it."""
        if qualname is None:
            return {f"{CUDA}{self.fname}:<module>"}
        if self.tags[qualname] is not None:
            return {self.tags[qualname]}
        found = set()
        for user in self.users(qualname) - {None}:  # a helper handed on at the top level is reached by no function
            if user not in seen:
                found |= self.owners(user, seen | {qualname})
        return found or {f"{CUDA}{self.fname}:{qualname}"}

    def paths(self) -> set[str]:
        found = {t for t in self.tags.values() if t and not t.startswith(CUDA)}
        for holder in self.holders:
            found |= self.owners(holder)
        return found


def cuda_paths(sources: dict[str, str]) -> set[str]:
    """Every CUDA path of the given {file name: source} (the module docstring says how each is named)."""
    return set().union(*(_Module(fname, text).paths() for fname, text in sources.items()))


def private_paths(paths: set[str]) -> set[str]:
    """The paths named after a private helper: those reached by no function of their file."""
    return {p for p in paths if p.startswith(CUDA) and is_private(p.rsplit(":", 1)[1])}


def repo_sources() -> dict[str, str]:
    return {name: open(os.path.join(REPO, name), encoding="utf-8").read() for name in SOURCES}


def coverage(checks, sources=None) -> tuple[set[str], set[str]]:
    """(CUDA paths no check covers, covered names that are no CUDA path: renamed or removed)."""
    paths = cuda_paths(sources if sources is not None else repo_sources())
    covered = {c for check in checks for c in check.covers}
    return paths - covered, covered - paths
