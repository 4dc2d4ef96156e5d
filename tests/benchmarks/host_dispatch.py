"""Host dispatches of one training step: the aten ops the host dispatches outside compiled graphs and the
custom-op crossings, per phase, on the CUDA code path forced onto CPU tensors (issue #77, item 6).

    python tests/benchmarks/host_dispatch.py                    # 11-layer table, 8 micro-batches, 2 steps
    python tests/benchmarks/host_dispatch.py --json out.json    # the figures as JSON as well
    python tests/benchmarks/host_dispatch.py --compare out.json # and the change since out.json's run
    python tests/benchmarks/host_dispatch.py --backend aot_eager --steps 4   # compiles in a fraction of the time
    python tests/benchmarks/host_dispatch.py --model_masks      # the masks built by the model in the step, as before the loader built them
    python tests/benchmarks/host_dispatch.py --smoke            # tooling check (tests): 4 layers, 1 step

What is counted. One training step is what train_gpt.Trainer.step does without CUDA graphs: forward_backward (every
micro-batch's transfer (Batch.to: one copy of its staged buffer and a view per tensor), attention masks
(GPT.batch_masks: BlockMasks around the block indices the loader built on its thread, as on CUDA),
forward and backward, the loss sum), NorMuonAdam.step, then the FP8 re-quantization of the weights
(GPT.quantize_fp8) and the loss's scaling. Counted, for that step:
  * aten ops dispatched outside compiled graphs: every aten:: call the profiler records that is not inside
    a compiled graph (CompiledFunction / CompiledFunctionBackward, inductor's "## Call CompiledFxGraph"),
    nested calls included (a composite op's inner dispatches cost host time too; the outermost ones, the
    calls made from Python, are printed beside). The compiled-graph wrappers' own ops (AOTAutograd's
    prologue and epilogue, e.g. copying a mutated buffer back) are outside the graph and are counted.
  * custom-op crossings: every run of a speedrun::* op's Python body (train_gpt's FP8 ops,
    triton_kernels' ops), wherever it is called from: a compiled graph calls a custom op as an opaque
    kernel, whose body then dispatches aten ops eagerly, so the aten ops inside a custom op's body are
    counted even when the op sits in a compiled graph.
Method: torch.profiler on the CPU (record_shapes off); each custom op's kernel is wrapped in a
record_function named after the op (the profiler records no event for a Python custom op otherwise), and
each phase in one named "phase: ..."; an event is classified by its nearest marking ancestor. The counter
(count_host_dispatches) is reusable: run it on any callable, e.g. before and after a change that moves the
masks into the loader or the FP8 ops into the graphs. tests/test_host_dispatch.py checks it against toy
functions with known counts.

The CUDA path on CPU tensors, and what is substituted:
  * compiled: the model with train_gpt.compile_model's settings (fullgraph, dynamic=False), the optimizer's
    updates compiled as on CUDA (train_gpt.update_functions(True)); the backend is --backend (default
    inductor). The graph boundaries, and so what is dispatched outside them, are dynamo's and
    AOTAutograd's whatever the backend; aot_eager (--smoke's) compiles in a fraction of inductor's time.
    The phase split of forward and backward is not: AOTAutograd's partitioner may move backward work into
    the forward graph (aot_eager does here: the loss's gradient ignores the incoming one), so the two
    are one phase.
  * batches: built as the CUDA loader builds them (make_batch with the step's flex_mask_spec, then
    stage_batch), outside the count (the loader's thread); inside it, Batch.to makes the staged buffer's copy
    (a clone here, the host-to-device copy on CUDA) and its views, as on CUDA. --model_masks: batches
    without block masks, the model building them per micro-batch (attention_masks(kernel="flex")).
  * attention: flex. Inductor cannot compile flex_attention's backward for CPU tensors (it fails in lowering), so
    with --backend inductor the flex call inside the graph is replaced by SDPA on the dense mask that the
    block mask's mask_mod defines (built inside the graph: nothing outside changes). With aot_eager the
    flex_attention call itself is traced (its CPU-device check switched off, as tests/test_compile_graph.py does).
  * FP8: train_gpt._native_fp8 is forced True, so the FP8 MLP and FP8 head ops run (their float8 matmuls
    emulated in fp32, same op calls) and the FP8 weights are re-quantized after each optimizer step.
  * Triton kernels: triton_kernels dispatches on the tensor's device, and on a CPU runs torch twins. Their
    bodies stand in for one Triton launch each and their aten ops are NOT counted (printed separately as
    "in CPU stand-ins"): the cross-entropy row loop (speedrun::softcapped_ce_mtp_rows, one Triton kernel on
    CUDA, ~2,000 aten ops per micro-batch on a CPU), the MLP's relu2 post / dpre, the FP8 up-projection's
    reference, and the transposes of the tied embedding (a speedrun::transpose_* op on CUDA: counted as a
    crossing here). Not seen on a CPU, so not counted: the few torch.empty allocations a Triton launch
    makes on CUDA, copy_from_host_'s pin_memory (CPU tensors are not moved), and the orthogonalizer's symmetric products that the measured kernel table sends to Triton ops
    inside the optimizer's compiled graphs (on a CPU they are traced into the graph).
Sizes: the record's layer table (train_gpt.LAYERS) and 8 micro-batches on one rank, at tiny widths (model
dim 128, 2 heads x 64, MLP 512, vocabulary 1,024, 1,024 tokens per micro-batch): the counts depend on the
layers and micro-batches, not on the widths (the stand-ins aside, which are excluded for that reason).
Steps 2, 3, ... are counted after compiling on steps 0 and 1: even steps run NorMuon only, odd steps Adam
as well (the record's), so the default 2 steps give one of each and the figure is their mean.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import train_gpt as T  # noqa: E402
import triton_kernels as TK  # noqa: E402

# Profiler event names that open a compiled graph's body: AOTAutograd's forward and backward functions
# and inductor's call of its compiled code. "Torch-Compiled Region" (dynamo's frame) is not one: it also
# holds the runtime wrappers' eager ops, which the host does dispatch.
COMPILED_GRAPH_EVENTS = ("CompiledFunction", "## Call CompiledFxGraph")
COMPILED_REGION_EVENT = "Torch-Compiled Region"
CUSTOM_OP_PREFIX = "custom op: "
STAND_IN_PREFIX = "cpu stand-in: "
PHASE_PREFIX = "phase: "
OTHER_PHASE = "other"
FORWARD_BACKWARD = "forward + backward"

# The speedrun ops whose CPU body replaces one Triton launch on CUDA (see the module docstring).
STAND_IN_OPS = ("speedrun::softcapped_ce_mtp_rows",)
# triton_kernels' CPU twins called by name inside op bodies and the optimizer, with the custom op the
# CUDA path calls in their place (None: a direct Triton launch, no op).
STAND_IN_FUNCTIONS = {
    "_relu2_post": None, "_relu2_dpre": None, "relu2_fp8_up_reference": None,
    "transpose_copy_reference": "speedrun::transpose_copy", "transpose_add_reference": "speedrun::transpose_add",
}


@dataclasses.dataclass
class DispatchCount:
    """What count_host_dispatches saw: totals, per phase, and per op name."""
    aten: int = 0                 # aten ops dispatched outside compiled graphs (nested calls included)
    aten_outermost: int = 0       # of these, the ones no other counted aten op encloses (calls from Python)
    crossings: int = 0            # custom-op crossings
    in_graphs: int = 0            # aten ops inside compiled graphs (not host dispatches; for reference)
    in_stand_ins: int = 0         # aten ops inside CPU stand-ins of Triton kernels (not counted)
    phases: dict = dataclasses.field(default_factory=dict)    # phase -> {"aten": n, "crossings": n}
    aten_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    custom_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return self.aten + self.crossings

    def scaled(self, factor: float) -> dict:
        """The figures as a JSON-ready dict, every count multiplied by factor (1 / steps: per step)."""
        def s(n):
            return round(n * factor, 1)
        return dict(total=s(self.total), aten=s(self.aten), aten_outermost=s(self.aten_outermost),
                    crossings=s(self.crossings), in_graphs=s(self.in_graphs), in_stand_ins=s(self.in_stand_ins),
                    phases={p: {k: s(v) for k, v in c.items()} for p, c in self.phases.items()},
                    aten_ops={k: s(v) for k, v in self.aten_ops.most_common()},
                    custom_ops={k: s(v) for k, v in self.custom_ops.most_common()})


def _custom_op_defs(namespaces) -> dict:
    """name -> CustomOpDef of every torch.library.custom_op in the namespaces."""
    from torch._library.custom_ops import OPDEFS
    return {name: op for name, op in OPDEFS.items() if name.split("::")[0] in namespaces}


@contextlib.contextmanager
def marked_custom_ops(namespaces=("speedrun",)):
    """Every run of a custom op's kernel (its Python body, whichever device) inside a record_function
    named after the op: a crossing event, and the parent of the aten ops its body dispatches."""
    saved = []
    for name, op in _custom_op_defs(namespaces).items():
        for key, fn in list(op._backend_fns.items()):
            def marked(*args, _fn=fn, _event=CUSTOM_OP_PREFIX + name, **kwargs):
                with record_function(_event):
                    return _fn(*args, **kwargs)
            saved.append((op, key, fn))
            op._backend_fns[key] = marked
    try:
        yield
    finally:
        for op, key, fn in saved:
            op._backend_fns[key] = fn


def marked(fn, event: str):
    """fn run inside record_function(event)."""
    def run(*args, **kwargs):
        with record_function(event):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def marked_stand_ins():
    """triton_kernels' CPU twins (STAND_IN_FUNCTIONS) inside stand-in events (module globals, so calls by
    name from the op bodies see the marked version)."""
    saved = {name: getattr(TK, name) for name in STAND_IN_FUNCTIONS}
    for name, op in STAND_IN_FUNCTIONS.items():
        setattr(TK, name, marked(saved[name], STAND_IN_PREFIX + (op or name)))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(TK, name, fn)


def classify(events, stand_in_ops=STAND_IN_OPS) -> DispatchCount:
    """DispatchCount of profiler events (torch.profiler's events(), with their parent links)."""
    count = DispatchCount()

    def phase_of(e):
        while e is not None:
            if e.name.startswith(PHASE_PREFIX):
                return e.name[len(PHASE_PREFIX):]
            e = e.cpu_parent
        return OTHER_PHASE

    def add(phase, kind):
        count.phases.setdefault(phase, {"aten": 0, "crossings": 0})[kind] += 1

    regions_with_body = set()
    for e in events:
        if e.name.startswith(COMPILED_GRAPH_EVENTS):
            p = e.cpu_parent
            while p is not None and not p.name.startswith(COMPILED_REGION_EVENT):
                p = p.cpu_parent
            if p is not None:
                regions_with_body.add(id(p))
    for e in events:
        name = e.name
        if name.startswith(CUSTOM_OP_PREFIX) or (name.startswith(STAND_IN_PREFIX) and "::" in name):
            op = name.split(": ", 1)[1]
            count.crossings += 1
            count.custom_ops[op] += 1
            add(phase_of(e), "crossings")
            continue
        if not name.startswith("aten::"):
            continue
        # The nearest marking ancestor decides: a custom op's body and anything outside compiled graphs
        # is dispatched by the host; a compiled graph's body is not; a CPU stand-in is left out.
        where, outermost, p = "eager", True, e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                outermost = False
            elif p.name.startswith(STAND_IN_PREFIX) or p.name[len(CUSTOM_OP_PREFIX):] in stand_in_ops:
                where = "stand-in"
                break
            elif p.name.startswith(CUSTOM_OP_PREFIX):
                break
            elif p.name.startswith(COMPILED_GRAPH_EVENTS):
                where = "graph"
                break
            elif p.name.startswith(COMPILED_REGION_EVENT):
                # directly in dynamo's frame: a runtime wrapper's op where the graph body has an event of
                # its own, else (aot_eager without autograd) the graph body itself
                where = "eager" if id(p) in regions_with_body else "graph"
                break
            p = p.cpu_parent
        if where == "graph":
            count.in_graphs += 1
        elif where == "stand-in":
            count.in_stand_ins += 1
        else:
            count.aten += 1
            count.aten_outermost += outermost
            count.aten_ops[name] += 1
            add(phase_of(e), "aten")
    return count


def count_host_dispatches(fn, *args, namespaces=("speedrun",), **kwargs) -> tuple[DispatchCount, object]:
    """Run fn(*args, **kwargs) once under the profiler and count its host dispatches (classify). Mark
    phases inside fn with record_function(PHASE_PREFIX + name) (or marked()); the custom ops of the
    namespaces are marked here. Warm fn up first: compilation inside the profiled call is counted too.
    Returns (count, fn's result)."""
    with marked_custom_ops(namespaces), marked_stand_ins():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            result = fn(*args, **kwargs)
    return classify(prof.events()), result


# ---- the training step at tiny widths -------------------------------------------------------------

def tiny_args(micro_tokens: int = 1024, micro_batches: int = 8, layers=T.LAYERS) -> T.Hyperparameters:
    """The record's layer table and micro-batches at tiny widths (every stage at micro_tokens per micro-batch)."""
    return dataclasses.replace(
        T.Hyperparameters(), layers=layers, micro_batches=micro_batches,
        model_dim=128, num_heads=2, head_dim=64, mlp_hidden=512, vocab_size=1000, padded_vocab_size=1024,
        ngram_rows=4001, mudd_hidden=32, dc_window=56, window_block_size=64,
        stages=T.restaged(T.STAGES, batch_tokens=(micro_tokens * micro_batches,) * 4,
                          max_doc_len=(micro_tokens // 2,) * 4),
        compile=True)


def synthetic_token_buffers(args: T.Hyperparameters, tokens: int, count: int, seed: int) -> list:
    """count buffers of tokens + 1 random token ids, documents of random lengths (16 to tokens / 2) each
    starting with BOS, as the loader's (make_batch finds the documents from the BOS tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, args.vocab_size, (tokens + 1,), generator=gen)
        starts = torch.randint(16, tokens // 2, (tokens // 16,), generator=gen).cumsum(0)
        ids[0] = T.BOS_ID
        ids[starts[starts < tokens]] = T.BOS_ID
        out.append(ids.numpy().astype("uint16"))
    return out


def sdpa_for_block_mask(q, k, v, block_mask, scale):
    """Stand-in for train_gpt.flex_attend inside an inductor graph on a CPU: SDPA over the dense mask the
    block mask's mask_mod defines, with the same fp32 softmax scale."""
    n = q.shape[-2]
    idx = torch.arange(n, device=q.device)
    mask = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
    return F.scaled_dot_product_attention(q.float() * scale, k.float(), v.float(), attn_mask=mask,
                                          scale=1.0).to(q.dtype)


class _PhaseMarked:
    """A compiled_model / optimizer stand-in for train_step: calls run inside the phase event `call`, the
    attributes given replace the inner object's, everything else passes through."""

    def __init__(self, inner, call: str | None = None, **attrs):
        self._inner, self._call = inner, call
        self.__dict__.update(attrs)

    def __call__(self, *args, **kwargs):
        return marked(self._inner, PHASE_PREFIX + self._call)(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextlib.contextmanager
def cuda_path_on_cpu(backend: str):
    """The CUDA branches that matter for the count, taken on CPU tensors (see the module docstring)."""
    import torch.nn.attention.flex_attention as flex_module
    saved = (T._native_fp8, T.flex_attend, flex_module._validate_device)
    T._native_fp8 = lambda device: True
    if backend == "inductor":
        T.flex_attend = sdpa_for_block_mask
    else:
        flex_module._validate_device = lambda *a: None
    try:
        yield
    finally:
        T._native_fp8, T.flex_attend, flex_module._validate_device = saved


class StepRunner:
    """Trainer.step (uncaptured) on one rank at tiny widths, compiled as on CUDA; step(i) runs training step i
    with its phases marked."""

    def __init__(self, args: T.Hyperparameters, backend: str = "inductor", seed: int = 0):
        self.args, self.device = args, torch.device("cpu")
        torch.manual_seed(seed)
        self.model = T.GPT(args, 1, dtype=torch.bfloat16)
        self.opt = T.build_optimizer(args, self.model, self.device)
        # the CUDA path's compiled updates (build_optimizer compiles them only on CUDA)
        updates = T.update_functions(True if backend == "inductor" else backend)
        self.opt._normuon_fn, self.opt._anvil_fn, self.opt._adam_fn = updates["normuon"], updates["anvil"], updates["adam"]
        self.model.quantize_fp8(bootstrap=True)  # as train() does before step 0
        if backend == "inductor":
            self.compiled_model = T.compile_model(self.model)
        else:  # compile_model's settings, another backend
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.compiled_model = torch.compile(self.model, dynamic=False, fullgraph=True, backend=backend)
        self.mtp = torch.zeros(len(args.stages[0].mtp_start), dtype=torch.float32)
        self.prefix = torch.zeros((), dtype=torch.float32)
        self.grad_scale = T.grad_scale_for(args, 1)

    def batches(self, step: int, model_masks: bool = False) -> list[T.Batch]:
        """The step's micro-batches as the CUDA loader hands them over: block masks built and every
        tensor staged (model_masks: no block masks, the model builds them in the step)."""
        plan = T.plan_step(self.args, step)
        tokens = plan.batch_tokens // self.args.micro_batches
        spec = None if model_masks else T.flex_mask_spec(self.args, plan.windows)
        out = []
        for buf in synthetic_token_buffers(self.args, tokens, self.args.micro_batches, seed=step):
            b = T.make_batch(buf, self.args.ngram_rows, spec, plan.max_doc_len)
            inputs = b.inputs % self.args.vocab_size  # BOS (50256) found the documents; now the tiny vocabulary's ids
            out.append(dataclasses.replace(b, inputs=inputs, targets=b.targets % self.args.vocab_size,
                                           ngram_ids=T.bigram_hash(inputs, self.args.ngram_rows)))
        return [T.stage_batch(b) for b in out]

    def step(self, step: int, batches: list[T.Batch]):
        """One Trainer.step: train_step (forward_backward, NorMuonAdam.step), then the FP8 re-quantization, then the loss's scaling."""
        args, model = self.args, self.model
        plan = T.plan_step(args, step)
        model.set_windows(*plan.windows)

        def batch_masks(batch):  # the CUDA path: the loader's block masks, or flex masks built here
            if batch.block_masks is not None:
                return model.batch_masks(batch)
            return model.attention_masks(batch.cu_seqlens, batch.inputs.numel(), kernel="flex")

        # forward and backward are one phase: AOTAutograd's partitioner may move backward work into the
        # forward graph (aot_eager does: the loss's gradient does not depend on the incoming one)
        compiled_model = _PhaseMarked(self.compiled_model, call=FORWARD_BACKWARD, batch_masks=marked(batch_masks, PHASE_PREFIX + "masks"))
        opt = _PhaseMarked(self.opt, step=marked(self.opt.step, PHASE_PREFIX + "optimizer"))
        backward, to = torch.Tensor.backward, T.Batch.to
        torch.Tensor.backward = marked(backward, PHASE_PREFIX + FORWARD_BACKWARD)
        T.Batch.to = lambda batch, device: T.unstage(batch, batch.staged.clone())  # the device copy, and its views
        try:
            with record_function(PHASE_PREFIX + OTHER_PHASE):
                objective, next_token = T.train_step(compiled_model, opt, batches, plan, self.mtp, self.prefix,
                                                     self.grad_scale, self.device)
            with record_function(PHASE_PREFIX + "fp8 quantize"):
                model.quantize_fp8(bootstrap=step < T.FP8_BOOTSTRAP_STEPS)
            with record_function(PHASE_PREFIX + OTHER_PHASE):
                return torch.stack([next_token / plan.batch_tokens, objective / (self.grad_scale * plan.batch_tokens)])
        finally:
            torch.Tensor.backward, T.Batch.to = backward, to


PHASE_ORDER = ("masks", FORWARD_BACKWARD, "optimizer", "fp8 quantize", OTHER_PHASE)
PHASE_TEXT = {"masks": "attention masks (eager)", FORWARD_BACKWARD: "forward + backward (compiled calls)",
              "optimizer": "optimizer step (NorMuonAdam.step)",
              "fp8 quantize": "FP8 re-quantization", OTHER_PHASE: "train_step's glue (copies, loss sum)"}


def measure(args: T.Hyperparameters, backend: str, steps: int, warmup: int = 2, model_masks: bool = False,
            log=print) -> tuple[DispatchCount, list[dict]]:
    """(summed DispatchCount of `steps` training steps after `warmup` compiling ones, each step's totals).
    model_masks: batches without block masks (the model builds them in the step)."""
    runner = StepRunner(args, backend)
    with cuda_path_on_cpu(backend):
        t = time.perf_counter()
        for s in range(warmup):
            runner.step(s, runner.batches(s, model_masks))
        log(f"compiled and warmed up in {warmup} steps: {time.perf_counter() - t:.0f}s")
        total, each = DispatchCount(), []
        for s in range(warmup, warmup + steps):
            count, loss = count_host_dispatches(runner.step, s, runner.batches(s, model_masks))
            if not torch.isfinite(loss).all():  # (next-token loss, objective)
                raise SystemExit(f"error: step {s} gave loss {loss}")
            log(f"step {s} ({'NorMuon + Adam' if s % 2 else 'NorMuon'}): {count.total} host dispatches")
            total = merged(total, count)
            each.append(dict(step=s, adam=s % 2 == 1, total=count.total, aten=count.aten, crossings=count.crossings))
        return total, each


def merged(a: DispatchCount, b: DispatchCount) -> DispatchCount:
    phases = {p: {k: a.phases.get(p, {}).get(k, 0) + b.phases.get(p, {}).get(k, 0) for k in ("aten", "crossings")}
              for p in {*a.phases, *b.phases}}
    return DispatchCount(a.aten + b.aten, a.aten_outermost + b.aten_outermost, a.crossings + b.crossings,
                         a.in_graphs + b.in_graphs, a.in_stand_ins + b.in_stand_ins, phases,
                         a.aten_ops + b.aten_ops, a.custom_ops + b.custom_ops)


def report(count: DispatchCount, steps: int, micro: int, layers: int, top: int = 15) -> list[str]:
    per = count.scaled(1 / steps)
    n = lambda v: f"{v:,.0f}" if float(v).is_integer() else f"{v:,.1f}"  # noqa: E731
    lines = [f"host dispatches per step: {n(per['total'])} ({n(per['aten'])} aten ops outside compiled graphs"
             f" + {n(per['crossings'])} custom-op crossings), {micro} micro-batches, {layers} layers",
             f"  aten ops called from Python (outermost): {n(per['aten_outermost'])}; inside compiled graphs (not"
             f" counted): {n(per['in_graphs'])}; in CPU stand-ins of Triton kernels (not counted): {n(per['in_stand_ins'])}",
             f"  by phase, per step (per micro-batch){'; mean of ' + str(steps) + ' steps' if steps > 1 else ''}:"]
    for p in sorted(per["phases"], key=lambda p: PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER)):
        c = per["phases"][p]
        each = f" ({n(round(c['aten'] / micro, 1))} + {n(round(c['crossings'] / micro, 1))})" \
            if p in ("masks", FORWARD_BACKWARD) else ""
        lines.append(f"    {PHASE_TEXT.get(p, p):44s} {n(c['aten']):>8s} aten + {n(c['crossings']):>6s} crossings{each}")
    lines.append(f"  top {top} aten ops outside compiled graphs, per step:")
    lines += [f"    {name:44s} {n(v):>8s}" for name, v in list(per["aten_ops"].items())[:top]]
    lines.append("  custom-op crossings, per step:")
    lines += [f"    {name:44s} {n(v):>8s}" for name, v in per["custom_ops"].items()]
    return lines


def compare(before: dict, after: dict) -> list[str]:
    """Lines of per-step figures (the --json files' contents) before -> after: the total, its two parts,
    every phase."""
    def line(what, b, a):
        return f"  {what:44s} {b:>10,.1f} -> {a:>10,.1f}  ({a - b:+,.1f})"
    lines = [f"host dispatches per step, before -> after: {before['total']:,.1f} -> {after['total']:,.1f}"
             f" ({after['total'] - before['total']:+,.1f})",
             line("aten ops outside compiled graphs", before["aten"], after["aten"]),
             line("custom-op crossings", before["crossings"], after["crossings"])]
    for p in sorted({*before["phases"], *after["phases"]},
                    key=lambda p: PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER)):
        b, a = (sum(f["phases"].get(p, {}).values()) for f in (before, after))
        lines.append(line(PHASE_TEXT.get(p, p), b, a))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="counted steps after the 2 compiling ones (mean reported)")
    ap.add_argument("--micro_tokens", type=int, default=1024, help="tokens per micro-batch (a multiple of 128)")
    ap.add_argument("--micro_batches", type=int, default=8)
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"),
                    help="compile backend of the model and the optimizer (the count does not depend on it)")
    ap.add_argument("--model_masks", action="store_true",
                    help="the model builds each micro-batch's flex masks in the step (instead of the loader)")
    ap.add_argument("--json", default=None, help="also write the figures (per step: the mean, and each step's totals)"
                    " to this file")
    ap.add_argument("--compare", default=None, metavar="BEFORE_JSON",
                    help="also print the change from an earlier --json file (e.g. at the base commit)")
    ap.add_argument("--smoke", action="store_true",
                    help="tooling check (tests): 1 step, aot_eager, the test preset's 4 layers, 2 micro-batches of 256 tokens")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.micro_tokens % T.FLEX_BLOCK_SIZE:
        raise SystemExit(f"error: --steps must be >= 1 and --micro_tokens a multiple of {T.FLEX_BLOCK_SIZE}")
    layers = T.LAYERS
    if a.smoke:  # the test preset's 4-layer table: compiles in a fraction of the 11 layers' time
        a.steps, a.backend, a.micro_tokens, a.micro_batches = 1, "aot_eager", 256, 2
        layers = T.parse_args(["--preset", "test"]).layers
    args = tiny_args(a.micro_tokens, a.micro_batches, layers)
    print(f"host dispatches of one training step: {len(args.layers)} layers, {a.micro_batches} micro-batches x "
          f"{a.micro_tokens} tokens, CUDA path on CPU tensors, {a.backend} backend"
          + (", masks built by the model" if a.model_masks else ""))
    t = time.perf_counter()
    count, each = measure(args, a.backend, a.steps, model_masks=a.model_masks)
    print("\n".join(report(count, a.steps, a.micro_batches, len(args.layers))))
    print(f"substituted on this CPU: {'flex_attention -> SDPA on the dense mask inside the graph (inductor has no CPU flex backward); ' if a.backend == 'inductor' else ''}"
          "_native_fp8 forced True (float8 matmuls emulated); CPU twins of Triton kernels not counted")
    print(f"wall time {time.perf_counter() - t:.0f}s")
    if a.json:
        figures = dict(count.scaled(1 / a.steps), steps=a.steps, micro_batches=a.micro_batches,
                       layers=len(args.layers), micro_tokens=a.micro_tokens, backend=a.backend,
                       model_masks=a.model_masks, per_step=each)
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    if a.compare:
        with open(a.compare) as f:
            print("\n".join(compare(json.load(f), count.scaled(1 / a.steps))))
    return count


if __name__ == "__main__":
    main()
