"""Calls from the training loop to every Triton kernel launch (issue #78, item 2: "at most 6 calls from
the training loop to any Triton kernel"), found by reading the source: a static call graph of
train_gpt.py and triton_kernels.py built with Python's ast module. Neither file is imported (nor torch).

    python tests/benchmarks/call_depth.py                  # the table, the maximum, the Gram kernel's line
    python tests/benchmarks/call_depth.py --sites          # and every call of each chain, file:line
    python tests/benchmarks/call_depth.py --json out.json  # the same as JSON
    python tests/benchmarks/call_depth.py --max 6          # exit status 1 when a kernel is deeper than 6

What is counted. The training loop is the `for step in ...` loop inside train_gpt.train(); the calls made
in its body are the first calls of every chain. A kernel is a @triton.jit function of triton_kernels.py
launched as `kernel[grid](...)` (or `triton_kernels.kernel[grid](...)` in train_gpt.py); that launch is
the chain's last call. The depth of a kernel is the
number of calls in the shortest chain from the loop to one of its launches (breadth-first; among chains
of equal length, the one whose calls run first). The @triton.jit functions that are never launched
(device helpers called inside kernels) are listed apart.

How a call is resolved (what the tool follows; anything else is a call into torch, Python or the data,
and ends there):
  * `f(...)`: a function nested in the calling function (or one enclosing it), else a module-level
    function of the caller's file, or one imported from the other file; `Class(...)` enters
    Class.__init__. A local variable bound to a function enters it: `op = A if c else B; op(...)` enters A
    and B, following `functools.partial(f, ...)` and `torch.compile(f, ...)` to f.
  * `triton_kernels.f(...)`: that function. `Class.m(...)`: that method.
  * `self.m(...)`: the method of the calling method's class (or of a base class defined in these files).
  * `x.m(...)` on an object whose type is evident: a parameter annotated with a class of these files
    (`opt: NorMuonAdam`), a local `x = Class(...)`, `x = f(...)` with `f` annotated `-> Class`, an
    attribute `self.a` that some method of the class sets from such an expression (`self.fp8_mlp =
    FP8MLPState(...)`, `self.opt = opt` in a method whose `opt` is annotated), or TYPED_NAMES below.
    Calling such an object, `x(...)`, enters Class.forward (an nn.Module), else Class.__call__.
  * custom ops: `torch.ops.speedrun.NAME(...)`, and a direct call of the function decorated
    `@torch.library.custom_op("speedrun::NAME")`, enter that function.
  * hand-off tables: a module-level dict of functions (a literal or `dict(...)`) called through a
    subscript, `HEAD_LOSSES[...](...)`, enters every function its literal lists (functools.partial
    followed to its function), or the entry of the key alone where the call fixes the key (below):
    HEAD_LOSSES, MLPS, ATTEND, ATTENTION_MASKS, ORTHOGONALIZERS, EVALUATION_CE today. A local bound to a
    table's entry (`layer = MLPS[...]`) takes the key as the call that uses it knows it.
  * stored callables that are called under another name: STORED_CALLABLES below, each entry with the
    line of code that stores it (the tool stops with an error when the class or function no longer
    has that attribute or parameter, so the table cannot go stale silently).
  * the backward: `t.backward(...)` on a tensor is one call that enters every autograd backward the
    files register (`op.register_autograd(fn, ...)`, torch.autograd.Function.backward): autograd calls
    it. Which ops the forward actually ran is not tracked: every registered backward is a candidate.

The CUDA path of record #89. The definitions of train_gpt.py named in NOT_FOLLOWED are not followed:
the CPU twins, the alternatives, checkpoints, and what record #89's path does not have (record #92's
step graphs, the one-buffer staging, the reductions launched from gradient hooks); a table entry holding
one of them is skipped. Where a function branches on the device (`x.is_cuda`,
`device.type == "cuda"`) or on anything else the source does not fix, both sides are followed and the
shorter chain is reported: the chain is printed so that a reader can see which side it took. A branch
that the call fixes is followed on its known side only: a parameter passed a constant or left at its
constant default, and locals computed from those (`[] if fp8 else None`), decide `if x is None:`, `if
flag:`, `a if flag else b`, `a and b` and a table's key, and a return on the known side ends the function
there. So evaluate()'s GPT.forward (no mtp_weights) takes the bf16 MLP (MLPS["bf16"]) and stops at the
evaluation loss, never reaching the training head or the FP8 MLP, which training reaches through
forward_backward. One over-approximation is left: `t.backward()` enters every registered backward, so
the MLP kernel's chain may go through the bf16 MLP's backward (triton_kernels' relu2_mlp op, trained
where FP8 is off) although the FP8 speedrun's goes through fp8_mlp's (today both are as long).

Not resolved statically (listed at the end of the output for the functions the search reached): calls of
callables that arrive as data: the waits ShardExchange returns (`reduced[label]()`, `done()`), closures
passed on (GPT.forward's `coef`), flex attention's compiled function and mask function, torch's
baddbmm or addmm picked in ba_plus_cAA; and, not listed, the post-accumulate-grad hooks of
reductions_on_backward (not followed). In today's code none of them launches a Triton kernel (the
hooks' reductions, with the tied fold's transpose, are the ones NorMuonAdam.step launches directly),
but the list says where to look when the code changes.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections import deque
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_FOLLOWED = frozenset((
    '_fp8_mm_fake', 'fp8_mm', 'fp8_mm_backward', '_fp8_mm_backward_fake', '_fp8_mm_setup_context', '_fp8_mm_autograd',
    'fp8_matmul', '_fp8_mlp_cpu', '_fp8_head_loss_cpu', '_normalized_bank', 'gram_newton_schulz', 'auto_orthogonalizer',
    'orthogonalize_auto', 'tensor_parallel_orthogonalize', '_gather_shards', '_tp_layout', 'tensor_parallel_normuon_state', '_split_variance_reduction',
    'tensor_parallel_normuon_update', '_adam_update_sliced', 'adam_update_group_sliced', 'learning_rates', 'reduce_scatter_uneven', 'all_gather_uneven',
    'scatter_uneven', '_balanced_ownership', '_CompletedWork', 'SimulatedComm', 'qk_clip_', 'after_update',
    'qk_clip_hooks', 'BackwardReductions', 'reductions_on_backward', 'launched_reductions', 'dense_attention_mask', 'banded_attention',
    'attention_band', 'SDPAMask', 'sdpa_mask', 'sdpa_attend_tokens', 'VarlenMask', 'varlen_mask',
    'varlen_attend', 'varlen_attend_tokens', 'compiled_flex_attention', '_runs_compiled_flex', 'bf16_head', 'cpu_head',
    'cpu_evaluation_ce', 'final_hidden', 'bf16_logits', 'stage_batch', 'unstage', 'stage_step',
    'step_slices', 'batch_tensors', 'batch_with_tensors', 'staged_bytes', '_staged_bytes', 'generate',
    'use_cuda_graphs', 'graphs_kept', 'graphs_captured_notes', 'step_graphs', 'step_graph_key', '_StepBuffers',
    'StepGraphs', 'step_buffer', 'replay_mismatch', 'save_checkpoint', 'load_checkpoint', 'StopOnSignal',
    'resume_step', 'RunCheckpoints', 'sample_after_training', 'train_step', 'ablated', 'parse_args',
    'check_args', 'adamw_bank_configs', 'switched_off_configs',
))
GRAM_KERNEL = "_sym_mm_kernel"  # XXT / XTX (the Gram matrix) and b A + c A^2 of Polar Express, one kernel

# Names whose type inference cannot see, each: name -> class. A bare name (parameter or local) or an
# attribute `self.<name>` without a type of its own takes this class.
TYPED_NAMES = {
    # Trainer.__init__: self.compiled_model = compile_model(model) if args.compile else model. torch.compile's
    # wrapper calls GPT.forward and forwards attribute reads (batch_masks) to the GPT; passed on as the
    # unannotated `compiled_model` of forward_backward, evaluate and StepGraphs.__init__ (self.compiled_model there).
    "compiled_model": "GPT",
}

# Callables stored under one name and called under it: (class or function, attribute or parameter)
# -> the functions it can hold ("table:NAME" for every function of a hand-off table).
STORED_CALLABLES = {
    # NorMuonAdam.__init__: self._normuon_fn, self._anvil_fn, self._adam_fn = update_functions(compile)'s;
    # it holds _normuon_update and _anvil_update (torch.compile'd on CUDA, as they are otherwise) ...
    ("NorMuonAdam", "_normuon_fn"): ("_normuon_update",),
    ("NorMuonAdam", "_anvil_fn"): ("_anvil_update",),
    # ... and _adam_update_group compiled (CUDA); uncompiled, UNCOMPILED_UPDATES["adam"]: the sliced one that
    # the CPU runs take (not followed)
    ("NorMuonAdam", "_adam_fn"): ("_adam_update_group",),
    # NorMuonAdam.__init__: self.orthogonalize = orthogonalizer_of(orthogonalizer); build_optimizer
    # passes functools.partial(ORTHOGONALIZERS[args.orthogonalizer], dtype=...)
    ("NorMuonAdam", "orthogonalize"): ("table:ORTHOGONALIZERS",),
    # _normuon_update's parameter `orthogonalize`: NorMuonAdam.step passes self.orthogonalize
    ("_normuon_update", "orthogonalize"): ("table:ORTHOGONALIZERS",),
}

BACKWARD = "Tensor.backward"
LOOP = "<training loop>"


@dataclass
class Func:
    module: str
    qualname: str  # "f", "Class.m", "outer.inner"
    node: ast.AST
    cls: str | None = None  # the class of a method (also for functions nested in one)
    parent: str | None = None  # qualname of the enclosing function of a nested one

    @property
    def key(self):
        return (self.module, self.qualname)


@dataclass
class Module:
    name: str
    tree: ast.Module
    skipped: frozenset  # top-level names not followed
    functions: dict = field(default_factory=dict)  # qualname -> Func
    classes: dict = field(default_factory=dict)  # name -> ast.ClassDef
    kernels: set = field(default_factory=set)  # @triton.jit function names
    ops: dict = field(default_factory=dict)  # "ns.name" -> qualname of the custom op's function
    tables: dict = field(default_factory=dict)  # name -> [(key or None, value expression)]
    backwards: list = field(default_factory=list)  # (qualname, line of the registration)
    imports: dict = field(default_factory=dict)  # local name -> module name, or (module, attribute)

    def followed(self, node) -> bool:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return node.name not in self.skipped
        return True


def _is_jit(dec) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return ast.unparse(target) in ("triton.jit", "jit")


def _custom_op_name(dec) -> str | None:
    if (isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("custom_op") and dec.args
            and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
        return dec.args[0].value.replace("::", ".")
    return None


def _dict_items(value) -> list | None:
    """(key, value expression) of a dict literal or dict(...) call, the key None where it is no constant."""
    if isinstance(value, ast.Dict):
        return [(k.value if isinstance(k, ast.Constant) else None, v) for k, v in zip(value.keys, value.values)]
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict" and not value.args:
        return [(kw.arg, kw.value) for kw in value.keywords]
    return None


def load_module(name: str, source: str, skipped: frozenset = NOT_FOLLOWED) -> Module:
    tree = ast.parse(source)
    m = Module(name, tree, frozenset(skipped))

    def add_function(node, qual, cls, parent):
        m.functions[qual] = Func(name, qual, node, cls, parent)
        for child in ast.walk(node):
            if child is not node and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _directly_in(node, child):
                    add_function(child, f"{qual}.{child.name}", cls, qual)

    for node in tree.body:
        if not m.followed(node):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add_function(node, node.name, None, None)
            if any(_is_jit(d) for d in node.decorator_list):
                m.kernels.add(node.name)
            for d in node.decorator_list:
                op = _custom_op_name(d)
                if op:
                    m.ops[op] = node.name
        elif isinstance(node, ast.ClassDef):
            m.classes[node.name] = node
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add_function(item, f"{node.name}.{item.name}", node.name, None)
            if any(ast.unparse(b).split(".")[-1] == "Function" for b in node.bases) and f"{node.name}.backward" in m.functions:
                m.backwards.append((f"{node.name}.backward", node.lineno))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            items = _dict_items(node.value) if node.value is not None else None
            for t in targets:
                if isinstance(t, ast.Name) and items is not None:
                    m.tables[t.id] = [(k, v) for k, v in items if not (isinstance(v, ast.Name) and v.id in m.skipped)]
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Attribute) and call.func.attr == "register_autograd" and call.args:
                fn = call.args[0]
                if isinstance(fn, ast.Name):
                    m.backwards.append((fn.id, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                m.imports[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                m.imports[a.asname or a.name] = (node.module, a.name)
    return m


def _launched_kernel(func, m: Module, modules: dict) -> tuple | None:
    """(module, kernel) when a call's function is a launch, `kernel[grid]` of a @triton.jit function of m
    or `module.kernel[grid]` of an imported module's."""
    if not isinstance(func, ast.Subscript):
        return None
    target = func.value
    if isinstance(target, ast.Name) and target.id in m.kernels:
        return m.name, target.id
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
        other = m.imports.get(target.value.id)
        if isinstance(other, str) and other in modules and target.attr in modules[other].kernels:
            return other, target.attr
    return None


def _directly_in(outer, inner) -> bool:
    """inner is a def nested in outer's body, not inside another def or class of it."""
    def visit(node):
        for child in ast.iter_child_nodes(node):
            if child is inner:
                return True
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if visit(child):
                return True
        return False
    return visit(outer)


def _calls_in(nodes):
    """The calls of these statements in the order they run: a call's arguments before the call, nested
    defs, classes and lambdas skipped (they run when called)."""
    out = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            visit(node.func)
            for a in node.args:
                visit(a)
            for kw in node.keywords:
                visit(kw.value)
            out.append(node)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    for n in nodes:
        visit(n)
    return out


@dataclass
class Edge:
    callee: tuple  # (module, qualname) of a function, ("launch", module, kernel) or ("autograd", BACKWARD)
    module: str  # where the call is
    line: int
    call: str  # the called expression, as written


class CallGraph:
    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.unresolved: list[tuple[str, int, str, str]] = []  # (module, line, call, in function)
        self._edges: dict = {}
        self._types: dict = {}
        for (owner, name), targets in STORED_CALLABLES.items():
            self._check_stored(owner, name, targets)

    # -- lookups ----------------------------------------------------------------------------------
    def _func(self, module: str, qual: str) -> Func | None:
        m = self.modules.get(module)
        return m.functions.get(qual) if m else None

    def _class_module(self, cls: str) -> str | None:
        for name, m in self.modules.items():
            if cls in m.classes:
                return name
        return None

    def _method(self, cls: str, name: str) -> Func | None:
        seen = set()
        todo = [cls]
        while todo:
            c = todo.pop(0)
            if c in seen:
                continue
            seen.add(c)
            mod = self._class_module(c)
            if mod is None:
                continue
            f = self._func(mod, f"{c}.{name}")
            if f:
                return f
            todo.extend(ast.unparse(b).split(".")[-1] for b in self.modules[mod].classes[c].bases)
        return None

    def _check_stored(self, owner: str, name: str, targets) -> None:
        """The table entry still describes the code: the class sets self.<name>, or the function has the
        parameter, and every target exists (an entry whose owner is not in the sources is ignored)."""
        mod = self._class_module(owner)
        if mod is not None:
            cls = self.modules[mod].classes[owner]
            ok = any(isinstance(t, ast.Attribute) and t.attr == name and ast.unparse(t.value) == "self"
                     for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign))
                     for tgt in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     for t in ast.walk(tgt))
        else:
            fns = [m.functions[owner] for m in self.modules.values() if owner in m.functions]
            if not fns:
                return
            a = fns[0].node.args
            ok = name in [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        where = f"call_depth: STORED_CALLABLES[{owner!r}, {name!r}]"
        if not ok:
            raise SystemExit(f"{where}: {owner} no longer has {name}; update the table")
        for t in targets:
            if t.startswith("table:"):
                if not any(t[6:] in m.tables for m in self.modules.values()):
                    raise SystemExit(f"{where}: no table {t[6:]} followed; update the table")
            elif not any(t in m.functions for m in self.modules.values()):
                raise SystemExit(f"{where}: no function {t} followed; update the table")

    def _stored(self, owner: str | None, name: str, module: str) -> list | None:
        targets = STORED_CALLABLES.get((owner, name)) if owner else None
        if targets is None:
            return None
        out = []
        for t in targets:
            if t.startswith("table:"):
                for mname, m in self.modules.items():
                    if t[6:] in m.tables:
                        out += self._table(mname, t[6:])
            else:
                for mname, m in self.modules.items():
                    if t in m.functions:
                        out.append((mname, t))
        return out

    def _table(self, module: str, name: str, key=None) -> list:
        """The functions of a table's entries: the entry of `key` alone when the key is known."""
        out = []
        for k, v in self.modules[module].tables[name]:
            if not isinstance(key, str) or k == key:
                out += self._refs(v, module, None)
        return out

    # -- types ------------------------------------------------------------------------------------
    def _annotation_class(self, ann) -> str | None:
        if ann is None:
            return None
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(ann, ast.BinOp):
            return self._annotation_class(ann.left) or self._annotation_class(ann.right)
        if isinstance(ann, ast.Subscript):
            return self._annotation_class(ann.slice)
        if isinstance(ann, (ast.Name, ast.Attribute)):
            name = ann.id if isinstance(ann, ast.Name) else ann.attr
            return name if self._class_module(name) else None
        return None

    def _assignments(self, f: Func, name: str) -> list:
        """Expressions assigned to local `name` in f's own body (tuple targets matched element-wise)."""
        out = []
        for node in _own_nodes(f.node):
            if isinstance(node, ast.Assign):
                for tgt in node.targets:
                    out += _matched(tgt, node.value, lambda t: isinstance(t, ast.Name) and t.id == name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                if node.value is not None:
                    out.append(node.value)
                out.append(("annotation", node.annotation))
        return out

    def _scope(self, f: Func, name: str):
        """(function, kind, payload) for a local name: its assignments or its parameter annotation, in f
        or the functions enclosing it (closures); None when it is not local to any."""
        while f is not None:
            a = f.node.args
            params = {p.arg: p.annotation for p in a.posonlyargs + a.args + a.kwonlyargs}
            for extra in (a.vararg, a.kwarg):
                if extra:
                    params[extra.arg] = None
            if name in params:
                return f, "param", params[name]
            assigned = self._assignments(f, name)
            if assigned:
                return f, "local", assigned
            f = self._func(f.module, f.parent) if f.parent else None
        return None

    def _type(self, expr, f: Func | None, depth: int = 0) -> str | None:
        """The class of these files that expr's value is an instance of, or None. Memoised; an expression
        met again while its own type is being worked out (x = x.m(), self.a = self.a) is None there."""
        if expr is None:
            return None
        key = (id(expr), f.key if f is not None else None)
        if key in self._types:
            return self._types[key]
        self._types[key] = None  # in progress
        t = self._types[key] = self._type_of(expr, f, depth)
        return t

    def _type_of(self, expr, f: Func | None, depth: int) -> str | None:
        if isinstance(expr, tuple):  # ("annotation", node)
            return self._annotation_class(expr[1])
        if isinstance(expr, ast.Name):
            if f is not None and expr.id in ("self", "cls") and f.cls:
                return f.cls
            scope = self._scope(f, expr.id) if f is not None else None
            if scope is not None:
                g, kind, payload = scope
                if kind == "param":
                    t = self._annotation_class(payload)
                else:
                    t = next((t for t in (self._type(v, g, depth + 1) for v in payload) if t), None)
                return t or TYPED_NAMES.get(expr.id)
            return TYPED_NAMES.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self._type(expr.value, f, depth + 1)
            if owner:
                t = self._attribute_type(owner, expr.attr, depth)
                if t:
                    return t
            return TYPED_NAMES.get(expr.attr) if owner else None
        if isinstance(expr, ast.IfExp):
            return self._type(expr.body, f, depth + 1) or self._type(expr.orelse, f, depth + 1)
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Name) and self._class_module(func.id) and not (f and self._scope(f, func.id)):
                return func.id
            if isinstance(func, ast.Attribute) and func.attr == "to":  # nn.Module.to returns the module
                return self._type(func.value, f, depth + 1)
            for callee in self._resolve(expr, f, record=False):
                g = self._func(*callee) if len(callee) == 2 else None
                if g is not None and not g.qualname.endswith(".__init__"):
                    t = self._annotation_class(g.node.returns)
                    if t:
                        return t
        return None

    def _attribute_type(self, cls: str, attr: str, depth: int) -> str | None:
        """The type of self.<attr> of class cls: from what its methods assign to it."""
        mod = self._class_module(cls)
        if mod is None:
            return None
        for item in self.modules[mod].classes[cls].body:
            f = self._func(mod, f"{cls}.{getattr(item, 'name', '')}")
            if f is None:
                continue
            for node in _own_nodes(f.node):
                if isinstance(node, ast.Assign):
                    for tgt in node.targets:
                        for v in _matched(tgt, node.value, lambda t: isinstance(t, ast.Attribute) and t.attr == attr
                                          and ast.unparse(t.value) == "self"):
                            t = self._type(v, f, depth + 1)
                            if t:
                                return t
                elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute)
                      and node.target.attr == attr and ast.unparse(node.target.value) == "self"):
                    t = self._annotation_class(node.annotation) or self._type(node.value, f, depth + 1)
                    if t:
                        return t
        return None

    # -- calls ------------------------------------------------------------------------------------
    def _refs(self, expr, module: str, f: Func | None, env: dict | None = None) -> list:
        """The functions an expression that names a callable can denote (not calling it); env: what is
        known of the names where it is called (a table's key)."""
        if isinstance(expr, ast.IfExp):
            return self._refs(expr.body, module, f, env) + self._refs(expr.orelse, module, f, env)
        if isinstance(expr, ast.Call):
            name = ast.unparse(expr.func)
            if name in ("functools.partial", "partial", "torch.compile") and expr.args:
                return self._refs(expr.args[0], module, f)
            return []
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
            m = self.modules[module]
            if expr.value.id in m.tables and not (f and self._scope(f, expr.value.id)):
                return self._table(module, expr.value.id, const_value(expr.slice, env or {}))
            return []
        if isinstance(expr, ast.Name):
            if f is not None:
                scope = self._scope(f, expr.id)
                if scope is not None:
                    return []  # a local that holds a function is followed by _resolve
                g = f
                while g is not None:  # a function nested in f or in a function enclosing it
                    nested = self._func(module, f"{g.qualname}.{expr.id}")
                    if nested:
                        return [nested.key]
                    g = self._func(module, g.parent) if g.parent else None
            m = self.modules[module]
            if expr.id in m.functions:
                return [(module, expr.id)]
            if expr.id in m.classes:
                init = self._method(expr.id, "__init__")
                return [init.key] if init else []
            imp = m.imports.get(expr.id)
            if isinstance(imp, tuple) and imp[0] in self.modules:
                return self._refs(ast.Name(imp[1]), imp[0], None)
            return []
        if isinstance(expr, ast.Attribute):
            text = ast.unparse(expr)
            parts = text.split(".")
            if len(parts) == 4 and parts[:2] == ["torch", "ops"]:
                op = f"{parts[2]}.{parts[3]}"
                return [(name, m.ops[op]) for name, m in self.modules.items() if op in m.ops]
            if isinstance(expr.value, ast.Name) and not (f and self._scope(f, expr.value.id)):
                target = self.modules[module].imports.get(expr.value.id)
                if isinstance(target, str) and target in self.modules:
                    return self._refs(ast.Name(expr.attr), target, None)
                if expr.value.id in self.modules[module].classes or self._class_module(expr.value.id):
                    meth = self._method(expr.value.id, expr.attr)
                    return [meth.key] if meth else []
            return []
        return []

    def _resolve(self, call: ast.Call, f: Func | None, module: str | None = None, record: bool = True,
                 env: dict | None = None) -> list:
        module = f.module if f is not None else module
        func = call.func
        m = self.modules[module]
        launch = _launched_kernel(func, m, self.modules)
        if launch is not None:
            return [("launch", *launch)]
        if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name):
            refs = self._refs(func, module, f, env)
            if not refs and record:
                self._note(module, call, f)
            return Indirect(refs)
        if isinstance(func, ast.Name):
            scope = self._scope(f, func.id) if f is not None else None
            if scope is not None:
                g, kind, payload = scope
                stored = self._stored(g.qualname, func.id, module)
                if stored is not None:
                    return Indirect(stored)
                if kind == "local":
                    refs = [r for v in payload if not isinstance(v, tuple) for r in self._refs(v, module, g, env)]
                    if refs:
                        return Indirect(refs)
                t = self._type(func, f)
                if t:
                    return self._instance_call(t)
                if record:
                    self._note(module, call, f)
                return []
            refs = self._refs(func, module, f)
            if refs:
                return refs
            t = TYPED_NAMES.get(func.id)
            return self._instance_call(t) if t else []
        if isinstance(func, ast.Attribute):
            refs = self._refs(func, module, f)
            if refs:
                return refs
            owner = self._type(func.value, f) if f is not None else None
            if owner:
                meth = self._method(owner, func.attr)
                if meth:
                    return [meth.key]
                stored = self._stored(owner, func.attr, module)
                if stored is not None:
                    return Indirect(stored)
                t = self._attribute_type(owner, func.attr, 0) or TYPED_NAMES.get(func.attr)
                if t:
                    return self._instance_call(t)
                if record and ast.unparse(func.value) == "self":
                    self._note(module, call, f)
                return []
            if func.attr == "backward":
                return [("autograd", BACKWARD)]
            return []
        if record:
            self._note(module, call, f)
        return []

    def _instance_call(self, cls: str) -> list:
        meth = self._method(cls, "forward") or self._method(cls, "__call__")
        return [meth.key] if meth else []

    def _note(self, module, call, f):
        self.unresolved.append((module, call.lineno, ast.unparse(call.func), f.qualname if f else LOOP))

    def edges(self, node) -> list[Edge]:
        """The calls a node makes, in the order they run. A function node is (module, qualname, what is
        known of its parameters at the call: ((name, value), ...)); the body is walked with that."""
        if node in self._edges:
            return self._edges[node]
        out = []
        if node == ("autograd", BACKWARD):
            for name, m in self.modules.items():
                for qual, line in m.backwards:
                    if qual in m.functions:
                        out.append(Edge((name, qual, ()), name, line, f"autograd (register_autograd, line {line})"))
        elif len(node) == 3 and node[0] in self.modules:
            f = self._func(node[0], node[1])
            if f is not None:
                out = self._edges_of(calls_run(f.node.body, dict(node[2])), f)
        self._edges[node] = out
        return out

    def _edges_of(self, calls, f: Func) -> list[Edge]:
        out = []
        for call, env in calls:
            resolved = self._resolve(call, f, env=env)
            for callee in resolved:
                if callee[0] in self.modules:  # a function: what the call tells of its parameters
                    known = () if isinstance(resolved, Indirect) else self._known_args(call, env, callee)
                    callee = (*callee, known)
                out.append(Edge(callee, f.module, call.lineno, ast.unparse(call.func)))
        return out

    def _known_args(self, call: ast.Call, env: dict, callee) -> tuple:
        """The callee's parameters whose value the call fixes: a constant passed (or a name the caller
        knows), or a constant default not passed. None of them when the call unpacks *args or **kwargs."""
        g = self._func(*callee)
        if g is None or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return ()
        a = g.node.args
        params = [p.arg for p in a.posonlyargs + a.args]
        method = g.cls is not None and g.qualname.count(".") == 1
        static = any(ast.unparse(d) == "staticmethod" for d in g.node.decorator_list)
        unbound = isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) \
            and self._class_module(call.func.value.id) is not None
        if method and not static and not unbound:
            params = params[1:]  # self (or cls) is bound
        known = {}
        defaults = list(zip(params[len(params) - len(a.defaults):], a.defaults)) if a.defaults else []
        defaults += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for name, d in defaults:
            known[name] = const_value(d, {})
        for name, arg in zip(params, call.args):
            known[name] = const_value(arg, env)
        for kw in call.keywords:
            known[kw.arg] = const_value(kw.value, env)
        return tuple(sorted((k, v) for k, v in known.items() if v is not UNKNOWN))


class Indirect(list):
    """Callees reached through data (a table, a stored callable, a local bound to a function): the
    call's arguments are not matched to their parameters (a functools.partial may have bound some)."""


UNKNOWN = object()
NOT_NONE = "<not None>"  # a value known only not to be None: a list, a dict, a tuple


def const_value(expr, env: dict):
    """What a small expression is known to be where env (name -> value) holds: a constant, NOT_NONE, or
    UNKNOWN. Enough for the branches that pick a code path: `x is None`, a flag, `[] if fp8 else None`."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name):
        return env.get(expr.id, UNKNOWN)
    if isinstance(expr, (ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.Lambda)):
        return NOT_NONE
    if isinstance(expr, ast.IfExp):
        t = truth(expr.test, env)
        if t is None:
            a, b = const_value(expr.body, env), const_value(expr.orelse, env)
            return a if a is not UNKNOWN and a == b else UNKNOWN
        return const_value(expr.body if t else expr.orelse, env)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        t = truth(expr.operand, env)
        return UNKNOWN if t is None else not t
    if isinstance(expr, ast.BoolOp):
        for i, v in enumerate(expr.values):
            t = truth(v, env)
            if t is None:
                return UNKNOWN
            if t == isinstance(expr.op, ast.Or) or i == len(expr.values) - 1:
                return const_value(v, env)
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right, op = const_value(expr.left, env), const_value(expr.comparators[0], env), expr.ops[0]
        if isinstance(op, (ast.Is, ast.IsNot)) and right is None and left is not UNKNOWN:
            return (left is None) == isinstance(op, ast.Is)
        if isinstance(op, (ast.Eq, ast.NotEq)) and UNKNOWN not in (left, right) and NOT_NONE not in (left, right):
            return (left == right) == isinstance(op, ast.Eq)
    return UNKNOWN


def truth(expr, env: dict):
    """True or False where const_value knows the truth of expr, else None."""
    v = const_value(expr, env)
    return None if v is UNKNOWN or v is NOT_NONE else bool(v)


def _assigned_names(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def calls_run(stmts, env: dict) -> list:
    """(call, what is known of the names there) for the calls these statements can run, in the order they
    run. A branch whose test is known (from env and the constant assignments before it) is followed
    alone, and a block ends at a return or raise that surely runs; every other branch is followed."""
    out = []
    _walk(stmts, env, out)
    return out


def _collect(node, env, out):
    """The calls of an expression (or simple statement): arguments before the call; nested defs, classes
    and lambdas skipped (they run when called); the known side of a conditional expression only."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    if isinstance(node, ast.IfExp):
        t = truth(node.test, env)
        _collect(node.test, env, out)
        if t is not False:
            _collect(node.body, env, out)
        if t is not True:
            _collect(node.orelse, env, out)
        return
    if isinstance(node, ast.Call):
        _collect(node.func, env, out)
        for a in node.args:
            _collect(a, env, out)
        for kw in node.keywords:
            _collect(kw.value, env, out)
        out.append((node, dict(env)))
        return
    for child in ast.iter_child_nodes(node):
        _collect(child, env, out)


def _walk(stmts, env: dict, out) -> bool:
    """Walks a block, updating env; True when the block surely ends early (return, raise, break)."""
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            env.pop(s.name, None)
        elif isinstance(s, ast.If):
            _collect(s.test, env, out)
            t = truth(s.test, env)
            if t is not None:
                if _walk(s.body if t else s.orelse, env, out):
                    return True
            else:
                e1, e2 = dict(env), dict(env)
                end1, end2 = _walk(s.body, e1, out), _walk(s.orelse, e2, out)
                if end1 and end2:
                    return True
                merged = e2 if end1 else e1 if end2 else {k: v for k, v in e1.items() if k in e2 and e2[k] == v}
                env.clear()
                env.update(merged)
        elif isinstance(s, (ast.Return, ast.Raise)):
            _collect(s, env, out)
            return True
        elif isinstance(s, (ast.Break, ast.Continue)):
            return True
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            _collect(s.iter if not isinstance(s, ast.While) else s.test, env, out)
            for name in _assigned_names(s):  # a later iteration sees what an earlier one assigned
                env.pop(name, None)
            _walk(s.body, dict(env), out)
            _walk(s.orelse, env, out)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                _collect(item.context_expr, env, out)
            if _walk(s.body, env, out):
                return True
        elif isinstance(s, ast.Try):
            for name in _assigned_names(s):
                env.pop(name, None)
            for block in (s.body, *[h.body for h in s.handlers], s.orelse, s.finalbody):
                _walk(block, dict(env), out)
        elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if s.value is not None:
                _collect(s.value, env, out)
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            v = const_value(s.value, env) if isinstance(s, ast.Assign) else UNKNOWN
            for t in targets:
                for name in _assigned_names(t):
                    env.pop(name, None)
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and v is not UNKNOWN:
                env[targets[0].id] = v
        else:
            _collect(s, env, out)
            for name in _assigned_names(s):
                env.pop(name, None)
    return False


def _own_nodes(fn):
    """Every node of a function's body, nested defs, classes and lambdas left out."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.append(child)


def _matched(target, value, want) -> list:
    """The parts of `value` assigned to the targets that `want` accepts (tuples unpacked element-wise)."""
    if want(target):
        return [value]
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        return [v for t, e in zip(target.elts, value.elts) for v in _matched(t, e, want)]
    return []


def find_loop(m: Module, function: str = "train", var: str = "step") -> ast.For:
    f = m.functions.get(function)
    if f is None:
        raise SystemExit(f"call_depth: no function {function}() in {m.name}")
    for node in ast.walk(f.node):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == var:
            return node
    raise SystemExit(f"call_depth: no `for {var} in ...` loop in {function}()")


def display(node) -> str:
    if node[0] == "launch":
        return f"{node[2]}[grid]"
    if node[0] == "autograd":
        return node[1]
    return node[1]


@dataclass
class KernelPath:
    kernel: str
    line: int  # the kernel's definition in its file
    depth: int | None
    chain: list  # display names, the launch last
    calls: list  # Edge of every call of the chain


@dataclass
class Result:
    loop_module: str
    loop_line: int
    kernels: dict  # kernel name -> KernelPath
    device_functions: list  # @triton.jit functions never launched
    unresolved: list

    @property
    def maximum(self) -> KernelPath | None:
        reached = [k for k in self.kernels.values() if k.depth is not None]
        return max(reached, key=lambda k: k.depth) if reached else None


def analyze(sources: dict[str, str], loop_module: str = "train_gpt", loop_function: str = "train",
            loop_var: str = "step", kernel_module: str = "triton_kernels", skipped: frozenset = NOT_FOLLOWED) -> Result:
    """The shortest chain from the loop to every kernel launch of kernel_module. sources: module name ->
    source text (skipped: names of loop_module not followed)."""
    modules = {name: load_module(name, src, skipped if name == loop_module else frozenset()) for name, src in sources.items()}
    graph = CallGraph(modules)
    loop_mod = modules[loop_module]
    loop = find_loop(loop_mod, loop_function, loop_var)
    train_fn = loop_mod.functions[loop_function]
    root = ("loop",)
    graph._edges[root] = graph._edges_of(calls_run(loop.body, {}), train_fn)
    prev = {root: None}
    depth = {root: 0}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        if node[0] == "launch":
            continue
        for e in graph.edges(node):
            if e.callee not in depth:
                depth[e.callee] = depth[node] + 1
                prev[e.callee] = (node, e)
                queue.append(e.callee)
    km = modules[kernel_module]
    launched = set()
    for m in modules.values():
        for f in m.functions.values():
            for call in _calls_in(f.node.body):
                launch = _launched_kernel(call.func, m, modules)
                if launch is not None and launch[0] == kernel_module:
                    launched.add(launch[1])
    kernels = {}
    for k in sorted(launched, key=lambda k: km.functions[k].node.lineno):
        node = ("launch", kernel_module, k)
        chain, calls = [], []
        if node in depth:
            n = node
            while prev[n] is not None:
                p, e = prev[n]
                chain.append(display(n))
                calls.append(e)
                n = p
            chain.reverse()
            calls.reverse()
        kernels[k] = KernelPath(k, km.functions[k].node.lineno, depth.get(node), chain, calls)
    helpers = sorted(km.kernels - launched, key=lambda k: km.functions[k].node.lineno)
    reached = {n[:2] for n in depth if len(n) == 3 and n[0] in modules}
    unresolved = sorted({u for u in graph.unresolved if (u[0], u[3]) in reached or u[3] == LOOP},
                        key=lambda u: (u[0], u[1]))
    return Result(loop_module, loop.lineno, kernels, helpers, unresolved)


def load_sources(root: str = REPO) -> dict[str, str]:
    out = {}
    for name in ("train_gpt", "triton_kernels"):
        with open(os.path.join(root, f"{name}.py")) as fh:
            out[name] = fh.read()
    return out


def to_json(r: Result) -> dict:
    mx = r.maximum
    gram = r.kernels.get(GRAM_KERNEL)
    return {
        "loop": {"file": f"{r.loop_module}.py", "line": r.loop_line},
        "kernels": [{"kernel": k.kernel, "line": k.line, "depth": k.depth, "chain": k.chain,
                     "calls": [{"callee": c, "file": f"{e.module}.py", "line": e.line, "call": e.call}
                               for c, e in zip(k.chain, k.calls)]}
                    for k in r.kernels.values()],
        "maximum": {"kernel": mx.kernel, "depth": mx.depth} if mx else None,
        "gram_kernel": {"kernel": GRAM_KERNEL, "depth": gram.depth} if gram else None,
        "device_functions": r.device_functions,
        "unresolved": [{"file": f"{u[0]}.py", "line": u[1], "call": u[2], "in": u[3]} for u in r.unresolved],
    }


def report(r: Result, sites: bool = False) -> str:
    lines = [f"Calls from the training loop ({r.loop_module}.py:{r.loop_line}, `for step in ...` in train()) to each "
             "Triton kernel's launch, shortest chain on the CUDA path (the launch is the last call):", ""]
    width = max([len(k) for k in r.kernels] + [6])
    lines.append(f"{'kernel':<{width}}  calls  chain")
    for k in r.kernels.values():
        depth = "-" if k.depth is None else str(k.depth)
        chain = " -> ".join(k.chain) if k.chain else "not reached from the training loop"
        lines.append(f"{k.kernel:<{width}}  {depth:>5}  {chain}")
        if sites:
            for name, e in zip(k.chain, k.calls):
                call = e.call if e.call.startswith("autograd") else f"{e.call}(...)"
                lines.append(f"{'':<{width}}         {e.module}.py:{e.line}  {call}  -> {name}")
    mx = r.maximum
    lines.append("")
    lines.append(f"maximum: {mx.depth} calls ({mx.kernel})" if mx else "maximum: no kernel reached")
    gram = r.kernels.get(GRAM_KERNEL)
    if gram and gram.depth is not None:
        lines.append(f"From the training loop to the Gram kernel (the symmetric matmul kernel of Polar Express) "
                     f"is {gram.depth} calls")
    if r.device_functions:
        lines.append(f"@triton.jit device functions (called inside kernels, never launched): {', '.join(r.device_functions)}")
    if r.unresolved:
        lines.append(f"not resolved statically in the functions reached ({len(r.unresolved)} calls of callables held as data):")
        for mod, line, call, fn in r.unresolved:
            lines.append(f"  {mod}.py:{line}  {call}(...)  in {fn}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--max", type=int, metavar="N", help="exit status 1 when some kernel's depth exceeds N")
    ap.add_argument("--sites", action="store_true", help="print every call of each chain with its file:line")
    ap.add_argument("--root", default=REPO, help="folder holding train_gpt.py and triton_kernels.py")
    args = ap.parse_args(argv)
    r = analyze(load_sources(args.root))
    print(report(r, sites=args.sites))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(to_json(r), fh, indent=1)
            fh.write("\n")
    if args.max is not None:
        over = [k for k in r.kernels.values() if k.depth is not None and k.depth > args.max]
        if over:
            print(f"over --max {args.max}: " + ", ".join(f"{k.kernel} ({k.depth})" for k in over))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
