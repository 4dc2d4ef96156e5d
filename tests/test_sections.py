"""train_gpt.py's sections stand on their own: names flow down, tables are whole where they are defined,
and a copy of the file through a section runs the examples of that section (README.md).

A section opens with a banner of three lines: '# ------...', '# Title', '# ------...'; it runs to the
line before the next banner (the last to the end of the file). The lines before the first banner (the
docstring and imports) come first. A section uses only names defined in it, in a section above it, or
imported; only the last section, "main", may use anything.
"""
import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_GPT = os.path.join(ROOT, "train_gpt.py")
LAST_SECTION = "main"


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------- sections

@dataclass(frozen=True)
class Section:
    title: str
    start: int  # 1-based line of the banner's first line (1 for the lines before the first banner)
    end: int    # 1-based, inclusive: the line before the next banner


def sections(lines: list[str]) -> list[Section]:
    """The file's sections in order; the first, titled '', holds the lines before the first banner."""
    starts = [i for i in range(len(lines) - 2)
              if lines[i].startswith("# ------") and lines[i + 2].startswith("# ------")
              and lines[i + 1].startswith("# ") and not lines[i + 1].startswith("# --")]
    bounds = [(0, "")] + [(i, lines[i + 1][2:].strip()) for i in starts]
    ends = [i for i, _ in bounds[1:]] + [len(lines)]
    return [Section(title, i + 1, end) for (i, title), end in zip(bounds, ends) if end > i]


def section_of(secs: list[Section], line: int) -> int:
    return next(k for k, s in enumerate(secs) if s.start <= line <= s.end)


# ---------------------------------------------------------------------------------------------- scopes
# Names are resolved as Python does: parameters, a function's assignments and imports, comprehension
# variables and a class body's own names are not module names; a function's free names (not bound in it
# or in an enclosing function, or declared global) are. Annotations are skipped: the file has
# `from __future__ import annotations`, so none is evaluated. Decorators, defaults, base classes and
# keywords are evaluated where the def or class statement stands.

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _scope_children(node):
    """The child nodes evaluated in node's own scope (node a statement or expression of that scope):
    for a nested def, lambda, class or comprehension only what is evaluated where it stands."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = node.args
        out = list(getattr(node, "decorator_list", [])) + list(args.defaults)
        return out + [d for d in args.kw_defaults if d is not None]
    if isinstance(node, ast.ClassDef):
        return list(node.decorator_list) + list(node.bases) + [k.value for k in node.keywords]
    if isinstance(node, _COMPREHENSIONS):
        return [node.generators[0].iter]
    if isinstance(node, ast.AnnAssign):
        return [node.target] + ([node.value] if node.value is not None else [])
    if isinstance(node, ast.arg):
        return []
    return list(ast.iter_child_nodes(node))


def _walk_scope(nodes):
    """Every node of one scope, starting from nodes, not entering nested scopes' bodies."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(_scope_children(node))


def _bindings(nodes) -> tuple[set, set]:
    """(names bound, names declared global) by the statements or expressions of one scope."""
    bound, declared = set(), set()
    for node in _walk_scope(nodes):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name != "*")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, ast.Global):
            declared.update(node.names)
    return bound - declared, declared


def _parameters(args: ast.arguments) -> set:
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return {a.arg for a in every}


def _nested_scopes(nodes):
    """The nested scopes that start in this scope: (kind, their nodes, names they bind by themselves)."""
    for node in _walk_scope(nodes):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "function", node.body, _parameters(node.args)
        elif isinstance(node, ast.Lambda):
            yield "function", [node.body], _parameters(node.args)
        elif isinstance(node, ast.ClassDef):
            yield "class", node.body, set()
        elif isinstance(node, _COMPREHENSIONS):
            gens = node.generators
            parts = [gens[0].target, *gens[0].ifs] + [p for g in gens[1:] for p in (g.target, g.iter, *g.ifs)]
            parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            yield "function", parts, set()


def _module_uses(nodes, kind="module", local=frozenset(), declared=frozenset(), enclosing=()):
    """(name, line) of every load in nodes, one scope of the given kind ("module", "class" or "function")
    whose own names are local and whose global declarations are declared, that refers to a module-level
    name; enclosing: the local names of the enclosing function scopes."""
    for node in _walk_scope(nodes):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            name = node.id
            if kind == "module" or name in declared or (
                    name not in local and not any(name in names for names in enclosing)):
                yield name, node.lineno
    inner = enclosing + ((local,) if kind == "function" else ())  # a class's names are not its methods'
    for sub_kind, sub_nodes, params in _nested_scopes(nodes):
        sub_bound, sub_declared = _bindings(sub_nodes)
        yield from _module_uses(sub_nodes, sub_kind, (sub_bound | params) - sub_declared, sub_declared, inner)


def _globals_assigned(stmt) -> set:
    """Names a function declares global and binds: module names the statement defines."""
    out = set()
    for node in ast.walk(stmt):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            declared = _bindings(node.body)[1]
            assigned = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            out |= declared & assigned
    return out


@dataclass
class Module:
    lines: list[str]
    tree: ast.Module
    secs: list[Section]
    defined: dict  # module-level name -> line of the top-level statement that binds it first

    def section(self, line: int) -> int:
        return section_of(self.secs, line)


@functools.lru_cache(maxsize=None)
def train_gpt() -> Module:
    return parse(read(TRAIN_GPT))


def parse(source: str) -> Module:
    tree = ast.parse(source)
    defined = {}
    for stmt in tree.body:
        bound, _ = _bindings([stmt])
        for name in sorted(bound | _globals_assigned(stmt)):
            defined.setdefault(name, stmt.lineno)
    return Module(source.split("\n"), tree, sections(source.split("\n")), defined)


def forward_references(mod: Module) -> list[tuple[str, str, int, str, int]]:
    """(name, using section, line of the first such use, defining section, line of the definition) of
    every module-level name a top-level statement outside the last section uses but a later section
    defines first."""
    found = {}
    for stmt in mod.tree.body:
        user = mod.section(stmt.lineno)
        if mod.secs[user].title == LAST_SECTION:
            continue
        for name, line in _module_uses([stmt]):
            if name in mod.defined and mod.section(mod.defined[name]) > user:
                key = (name, user)
                if key not in found or line < found[key]:
                    found[key] = line
    rows = [(name, mod.secs[user].title, line, mod.secs[mod.section(mod.defined[name])].title, mod.defined[name])
            for (name, user), line in found.items()]
    return sorted(rows, key=lambda r: (r[2], r[0]))


# ---------------------------------------------------------------------------------------------- tables

_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "add", "remove", "discard",
             "clear", "__setitem__", "__delitem__", "sort", "reverse"}


def table_changes(mod: Module) -> list[tuple[int, str, str, int]]:
    """(line, what, table, line of its definition) of every top-level statement that changes a module-level
    table (a name an assignment binds) that another top-level statement defined: an item set or deleted,
    a mutating method called, an augmented assignment, or the name bound again."""
    tables = {}  # name -> the assignment statement that binds it first
    for stmt in mod.tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for name in sorted(_bindings([stmt])[0]):
                tables.setdefault(name, stmt)
    out = []
    for stmt in mod.tree.body:
        def changed(name, what, line):
            if name in tables and tables[name] is not stmt:
                out.append((line, what, name, tables[name].lineno))

        augmented = set()
        for node in _walk_scope([stmt]):  # the statement's own module-level code, not function bodies
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                base = node.value
                while isinstance(base, (ast.Subscript, ast.Attribute)):
                    base = base.value
                if isinstance(base, ast.Name):
                    changed(base.id, "item " + ("deleted" if isinstance(node.ctx, ast.Del) else "set"), node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                    and isinstance(node.func.value, ast.Name):
                changed(node.func.value.id, f".{node.func.attr}()", node.lineno)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                changed(node.target.id, "augmented assignment", node.lineno)
                augmented.add(node.target)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node not in augmented:
                changed(node.id, "bound again", node.lineno)
    return sorted(out)


# ---------------------------------------------------------------------------------------------- the tests

def test_sections_are_found():
    mod = train_gpt()
    titles = [s.title for s in mod.secs]
    assert titles[0] == "" and titles[1].startswith("The recipe") and LAST_SECTION in titles, titles
    assert all(a.end + 1 == b.start for a, b in zip(mod.secs, mod.secs[1:])) and mod.secs[-1].end == len(mod.lines)
    assert not [s.title for s in mod.secs[1:] if s.title.startswith("--")]  # sub-banners are not sections


def test_main_is_the_last_section_and_the_last_definition():
    mod = train_gpt()
    assert mod.secs[-1].title == LAST_SECTION, f"the last section is {mod.secs[-1].title!r}, not {LAST_SECTION!r}"
    defining = [stmt for stmt in mod.tree.body if _bindings([stmt])[0]]
    assert isinstance(defining[-1], ast.FunctionDef) and defining[-1].name == "main", (
        f"the file's last definition is line {defining[-1].lineno}, not main()")
    assert mod.section(defining[-1].lineno) == len(mod.secs) - 1, "main() is not in the last section"


def test_no_section_uses_a_name_a_later_section_defines():
    rows = forward_references(train_gpt())
    names = {}  # name -> (its uses, where it is defined), in the order of first use
    for name, user, line, definer, at in rows:
        names.setdefault(name, ([], f"{definer!r} (line {at})"))[0].append(f"{user!r} (line {line})")
    assert not names, f"{len(names)} names used above the section that defines them:\n" + "\n".join(
        f"  {name}: used in {', '.join(uses)}; defined in {definer}" for name, (uses, definer) in names.items())


def test_every_table_is_whole_where_it_is_defined():
    rows = table_changes(train_gpt())
    assert not rows, f"{len(rows)} top-level statements change a table another statement defines:\n" + "\n".join(
        f"  line {line}: {name} {what} (defined at line {at})" for line, what, name, at in rows)


# ---- the checkers on small sources -------------------------------------------------------------------

CHECKED = '''\
from __future__ import annotations
import os
# ----------
# First
# ----------
def f(a, b=B_DEFAULT) -> Later:           # B_DEFAULT: a default, evaluated here
    x: Later = g(a)                       # g: a function's free name; annotations skipped
    return [y for y in x if y] + [os.sep] + [lambda z: z + w for w in x]
@decorate
class K(Base):
    n = 1
    m = n + 1                             # the class body's own n
    def h(self, n=n):
        return n, K, TABLE
def late_user():
    global STATE
    STATE = 1
# ---- a sub-banner, not a section ----
# ----------
# Second
# ----------
g = len
B_DEFAULT = 0
decorate = Base = TABLE = None
TABLE2 = {}
TABLE2["x"] = 1
TABLE2.update(y=2)
TABLE3 = []
TABLE3 += [1]
TABLE3 = TABLE3 + [2]
print(STATE)
# ----------
# main
# ----------
def main():
    return f, Third
'''


def test_forward_references_follow_pythons_scopes():
    mod = parse(CHECKED)
    assert [s.title for s in mod.secs] == ["", "First", "Second", "main"]
    rows = {(name, user, definer) for name, user, _, definer, _ in forward_references(mod)}
    assert rows == {(n, "First", "Second") for n in ("B_DEFAULT", "g", "decorate", "Base", "TABLE")}
    assert mod.defined["STATE"] == CHECKED.split("\n").index("def late_user():") + 1


def test_table_changes_are_found():
    mod = parse(CHECKED)
    assert [(what, name) for _, what, name, _ in table_changes(mod)] == [
        ("item set", "TABLE2"), (".update()", "TABLE2"), ("augmented assignment", "TABLE3"), ("bound again", "TABLE3")]


# ---------------------------------------------------------------------------------------------- copies

# The examples of copies: (document, the heading they follow, index among that section's python blocks,
# what the example prints, what the document states of it: by default a last line "# <what it prints>").
EXAMPLES = {
    "optimizer": ("README.md", "### Using the optimizer on its own", 0, "loss after 30 steps: 0.79", "# 0.79"),
    "polar_express": ("README.md", "### Copying a section", 0,
                      "(4, 96, 64) torch.bfloat16, singular values 0.86..1.14", None),
    "fp8_mlp": ("README.md", "### Copying a section", 1,
                "relative error 0.059, |dx| 95.0", None),
    "model_loss": ("README.md", "### Copying a section", 2, "loss 10.82, ln(vocab) 10.83", None),
}


def example(name: str) -> str:
    doc, heading, index, _, _ = EXAMPLES[name]
    section = read(os.path.join(ROOT, doc)).split(heading + "\n", 1)[1]
    section = re.split(r"^###? ", section, flags=re.M)[0]  # up to the next heading
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def imported_names(code: str) -> list[str]:
    return [a.name for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.ImportFrom) and node.module == "train_gpt" for a in node.names]


def copy_through(mod: Module, names, folder) -> Section:
    """Write train_gpt.py from its first line through the section that defines the last-defined of names,
    and triton_kernels.py beside it, into folder; return that section."""
    missing = [n for n in names if n not in mod.defined]
    assert not missing, f"train_gpt.py defines no {missing}"
    sec = mod.secs[max(mod.section(mod.defined[n]) for n in names)]
    os.makedirs(folder)
    with open(os.path.join(folder, "train_gpt.py"), "w", encoding="utf-8") as f:
        f.write("\n".join(mod.lines[: sec.end]) + "\n")
    shutil.copy(os.path.join(ROOT, "triton_kernels.py"), folder)
    return sec


def python(args, cwd) -> subprocess.Popen:
    """A fresh interpreter in cwd that finds train_gpt only there (the script's folder is cwd for -c); its
    output goes to files, so a process that is never read cannot block on a full pipe."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=out, stderr=err)
    proc.out, proc.err = out, err
    return proc


def finish(procs: list, timeout=120) -> list[str]:
    """What each process printed, once all have exited 0; when one fails (or time runs out) the rest are
    stopped, not left waiting for it in a collective."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    outs, errs = [], []
    for p in procs:
        for f in (p.out, p.err):
            f.seek(0)
        outs.append(p.out.read())
        errs.append(p.err.read())
        p.out.close()
        p.err.close()
    failed = [f"process {k} of {len(procs)}: exit {p.returncode}" + (" (stopped)" if p.returncode < 0 else "")
              + f":\n{errs[k][-2000:]}" for k, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(failed)
    return outs


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_runs_from_a_copy_through_its_section(name, tmp_path):
    """The example's imports come from a copy of train_gpt.py that ends with the section defining the last
    of them (nothing below it), beside triton_kernels.py in an otherwise empty folder; it prints what its
    document states."""
    doc, _, _, printed, stated = EXAMPLES[name]
    code = example(name)
    assert (stated or f"# {printed}") in code, f"{doc}'s {name} example does not state {printed!r}"
    folder = tmp_path / "copy"
    sec = copy_through(train_gpt(), imported_names(code), folder)
    out, = finish([python(["-c", code], cwd=folder)])
    assert out == printed + "\n", f"from a copy through {sec.title!r}: {out!r}"


RANK = """\
import sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
try:
    exec(compile(sys.argv[3], "README.md", "exec"), {"__name__": "__main__"})
finally:
    dist.destroy_process_group()
"""


def test_optimizer_example_runs_on_two_ranks_from_a_copy(tmp_path):
    """The optimizer example on two gloo ranks, each a fresh interpreter importing the copy: both print
    the one-process figure (identical data on both ranks)."""
    code = example("optimizer")
    folder = tmp_path / "copy"
    copy_through(train_gpt(), imported_names(code), folder)
    init = str(tmp_path / "init")
    outs = finish([python(["-c", RANK, init, str(rank), code], cwd=folder) for rank in range(2)])
    assert outs == [EXAMPLES["optimizer"][3] + "\n"] * 2
