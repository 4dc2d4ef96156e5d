"""The compiled model as inductor receives it, checked on a CPU: one graph for the training step, the
attention masks built outside it (their tensors graph inputs, which is what inductor's flex_attention
lowering needs), and every stage's block masks equal to the dense masks they stand for.

On the first H100 run the block masks were computed inside the model's graph and inductor failed to
lower flex_attention ("convert FlexibleLayout to FixedLayout first"): the lowering reads the block
counts and indices, and the tensors the mask_mod captures, only from buffers with a fixed layout.
flex_attention refuses a CPU backward, so these tests trace the CUDA attention path on CPU tensors with
that refusal switched off; tracing never runs a CUDA kernel.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import train_gpt as tg
from test_model import make_batch, randomize

TEST = tg.parse_args(["--preset", "test"])


def _flex_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "flex_attention" in str(n.target)]


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx nodes among the block mask tuple and the mask/score functions' captured tensors of a
    flex_attention (or its backward) call: every argument that is a tuple, flattened."""
    return [a for arg in node.args if isinstance(arg, (tuple, list)) for a in arg
            if isinstance(a, torch.fx.Node) and a.op != "get_attr"]


def _trace(model, masks, backend, vocab=50257):
    T = 256
    inputs, targets, cu = make_batch(T=T, starts=(0, 30, 70, 200), vocab=vocab)
    big = tg.bigram_hash(inputs, model.args.ngram_rows)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    loss, _ = compiled(inputs, targets, cu, big, mtp_weights=torch.tensor([1.0, 0.5, 0.25]), loss_scale=1 / T,
                       prefix_weight=torch.tensor(0.25), masks=masks(cu, T) if masks else None)
    loss.backward()
    return loss


def _collector(graphs: list):
    """keep(kind): a compile backend that appends (kind, graph) to graphs and runs the graph as it is;
    boxed: as AOTAutograd's compilers are called (one list of arguments)."""
    def keep(kind, boxed=False):
        def backend(gm, example_inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward) if boxed else gm.forward
        return backend
    return keep


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """flex_attention's CUDA path on CPU tensors: its CPU-backward refusal off (nothing here runs a kernel
    that needs it but the eager reference)."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *a: None)


def test_training_graph_reads_every_mask_tensor_as_an_input(flex_on_cpu):
    """The whole training forward traces into one graph (fullgraph), and in it, in the forward graph
    AOTAutograd hands to inductor and in the backward graph, every tensor of every flex_attention
    call's block mask and every tensor its mask_mod reads (document ids, window) is a graph input."""
    model = tg.GPT(TEST)
    randomize(model)
    graphs = []
    keep = _collector(graphs)

    def masks(cu, T):
        return model.attention_masks(cu, T, kernel="flex")

    _trace(model, masks, keep("dynamo"))
    _trace(model, masks, aot_autograd(fw_compiler=keep("forward", True), bw_compiler=keep("backward", True)))
    assert [kind for kind, _ in graphs] == ["dynamo", "forward", "backward"]  # one graph each: no break
    attention_layers = sum(row.attention != "none" for row in model.layers)
    for kind, gm in graphs:
        nodes = _flex_nodes(gm)
        assert len(nodes) == attention_layers, kind
        for node in nodes:
            tensors = _tensor_args(node)
            assert len(tensors) >= 10, (kind, node)  # 8 block-mask tensors, document ids, window
            computed = [a.name for a in tensors if a.op != "placeholder"]
            assert not computed, f"{kind} graph computes mask tensors {computed} for {node.name}"


def test_masks_built_inside_the_graph_are_what_inductor_cannot_lower(flex_on_cpu):
    """The same check, on the forward that builds its own masks (masks=None, the first H100 run's
    design): the block mask tensors are computed in the graph. Guards the test above against passing
    for a reason of its own."""
    model = tg.GPT(TEST)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = tg.GPT.attention_masks
    # inside the graph: attention_masks refuses flex while compiling, so call its body's builder directly
    def in_graph(self, cu_seqlens, num_tokens, kernel=None):
        doc = tg.document_ids(cu_seqlens, num_tokens)
        return {key: tg.attention_mask(doc, self.windows[int(key[0])], self.window_tokens[int(key[0])], key[1], "flex")
                for key in real(self, cu_seqlens, num_tokens, "sdpa")}
    tg.GPT.attention_masks = in_graph
    try:
        _trace(model, None, keep)
    finally:
        tg.GPT.attention_masks = real
    computed = [a for n in _flex_nodes(graphs[0]) for a in _tensor_args(n) if a.op != "placeholder"]
    assert computed


def test_flex_masks_are_refused_inside_a_compiled_graph():
    model = tg.GPT(TEST)
    _, _, cu = make_batch(T=128, starts=(0, 30))

    def build(cu):
        return model.attention_masks(cu, 128, kernel="flex")

    with pytest.raises(Exception, match="outside the compiled model"):
        torch.compile(build, backend="eager", fullgraph=True)(cu)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the recorder's eager stand-in
def test_eager_cuda_calls_share_one_compiled_flex_attention(monkeypatch, flex_on_cpu):
    """Outside a compiled graph every CUDA flex call goes through the one compiled flex_attention (the
    uncompiled one materialises the scores and synchronises). Pretend CPU tensors are CUDA ones."""
    assert tg.compiled_flex_attention() is tg.compiled_flex_attention()
    calls = []

    def recorder(q, k, v, score_mod, block_mask, scale):
        calls.append(block_mask)
        return flex_module.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

    monkeypatch.setattr(tg, "compiled_flex_attention", lambda: recorder)
    monkeypatch.setattr(tg, "_runs_compiled_flex", lambda q: True)
    model = tg.GPT(TEST)
    inputs, _, cu = make_batch(T=128)
    with torch.no_grad():
        tg.bf16_logits(model, inputs, cu, tg.bigram_hash(inputs, TEST.ngram_rows),
                     masks=model.attention_masks(cu, 128, kernel="flex"))
    assert len(calls) == sum(row.attention != "none" for row in model.layers)
    assert all(isinstance(m, flex_module.BlockMask) for m in calls)


def test_attention_masks_cover_the_tables_kinds():
    model = tg.GPT(TEST)
    _, _, cu = make_batch(T=128, starts=(0, 30))
    for kernel, kind in (("flex", flex_module.BlockMask), ("sdpa", tg.SDPAMask), ("sdpa_fp32", tg.SDPAMask)):
        masks = model.attention_masks(cu, 128, kernel)
        want = {(row.window == "long", 2 if row.attention == "paired" else 1) for row in model.layers
                if row.attention != "none"}
        assert set(masks) == want and all(isinstance(m, kind) for m in masks.values())
    with pytest.raises(ValueError, match="kernel='bad'"):
        model.attention_masks(cu, 128, "bad")


def _expand(bm, n: int) -> torch.Tensor:
    """The element mask the flex kernel applies: full blocks pass, partial blocks run the mask_mod."""
    bs = bm.BLOCK_SIZE[0]
    nb = n // bs
    idx = torch.arange(n)
    mod = bm.mask_mod(0, 0, idx[:, None], idx[None, :])
    blocks = torch.zeros(nb, nb, dtype=torch.int8)  # 0 empty, 1 partial, 2 full
    for i in range(nb):
        blocks[i, bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]]] = 1
        blocks[i, bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]]] = 2
    per_elem = blocks.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    return (per_elem == 2) | ((per_elem == 1) & mod)


@pytest.mark.slow
def test_every_stage_block_mask_equals_the_dense_mask():
    """The speedrun's windows of every stage, the extension and the final validation, short and long,
    plain and paired, as block masks over 128-token blocks, applied element by element: exactly the
    dense mask (which test_model checks against a brute-force loop)."""
    args = tg.parse_args(["--preset", "speedrun"])
    T = 3072
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 900, (40,), generator=rng)
    starts = torch.cumsum(lengths, 0)[:-1]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), starts[starts < T], torch.full((8,), T)]).to(torch.int32)
    doc = tg.document_ids(cu, T)
    windows = {tg.plan_step(args, s).windows for s in tg.stage_bounds(args)[:-1]}
    windows.add(args.final_val_windows)
    assert len(windows) == 5
    bs = args.window_block_size
    for short, long in sorted(windows):
        for blocks in (short, long):
            w = torch.tensor(blocks * bs, dtype=torch.int32)
            for r in (1, 2):
                bm = tg.attention_mask(doc, w, blocks * bs, r, "flex")
                assert torch.equal(_expand(bm, T * r), tg.dense_attention_mask(doc, w, r)), (blocks, r)


def test_fp8_training_step_traces_into_one_graph(flex_on_cpu, monkeypatch):
    """The FP8 path (GPUs with FP8 tensor cores) as the compiled model takes it: the FP8 MLP ops with their
    delayed-scale update and the FP8 head fused with the loss trace with the masks into one graph
    (fullgraph), forward and backward, with one custom op per layer and one for the head (their
    backward ops likewise); the activations' e4m3 casts and amaxes and the one act-scale write are
    graph ops, the head's weight the buffer quantize_fp8 fills. Pretend the CPU has FP8 tensor cores:
    the model takes its FP8 paths, whose float8 matmuls run their emulation on CPU tensors."""
    monkeypatch.setattr(tg, "_native_fp8", lambda device: True)
    args = tg.parse_args(["--preset", "test", "--vocab_size", "1000", "--padded_vocab_size", "1024"])
    model = tg.GPT(args)
    randomize(model)
    model.quantize_fp8(bootstrap=True)
    graphs = []
    keep = _collector(graphs)

    _trace(model, lambda cu, T: model.attention_masks(cu, T, kernel="flex"),
           aot_autograd(fw_compiler=keep("forward", True), bw_compiler=keep("backward", True)), vocab=1000)
    assert [kind for kind, _ in graphs] == ["forward", "backward"]
    L = args.num_layers
    for (kind, gm), want in zip(graphs, ({"fp8_mlp": L, "fp8_head_loss": 1},
                                         {"fp8_head_loss_backward": 1, "relu2_mlp_bwd": L})):
        names = [str(n.target).split(".")[1] for n in gm.graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("speedrun.")]
        custom = {name: names.count(name) for name in names if name.startswith("fp8") or name == "relu2_mlp_bwd"}
        # the FP8 custom ops once per layer and once for the head; the activations' quantisation (x's
        # amax and e4m3 cast per MLP, the head input's cast) and the act-scale update are graph ops
        assert custom == want, (kind, custom)
    forward = graphs[0][1].graph
    for n in forward.nodes:
        if n.op == "call_function" and str(n.target).startswith(("speedrun.fp8_mlp", "speedrun.fp8_head_loss")):
            x_f8 = n.args[3] if "fp8_mlp" in str(n.target) else n.args[2]
            assert str(x_f8.target) == "aten._to_copy.default", (n, x_f8)  # the e4m3 cast, in the graph
            if "fp8_head_loss" in str(n.target):  # the buffer quantize_fp8 fills, transposed
                assert str(n.args[3].target) in ("aten.t.default", "aten.permute.default"), n.args[3]
                assert n.args[3].args[0].op == "placeholder"
    count = {t: sum(str(n.target) == t for n in forward.nodes) for t in ("aten.amax.default", "aten.select_scatter.default")}
    # x's amax per MLP, one reduction of every layer's maxima of post, one write of all act scales
    assert count == {"aten.amax.default": L + 1, "aten.select_scatter.default": 1}, count
    assert (model.fp8_mlp.act_scale[:, 0] != 1.0).all()  # the delayed scales were written back


def test_loader_built_masks_train_exactly_like_the_models_own(flex_on_cpu):
    """The block masks the loader builds on the host (make_batch with the step's flex_mask_spec, the
    CUDA path) give the compiled training step the same loss and gradients, bit for bit, as masks the
    model builds from cu_seqlens; in the traced graphs every tensor of them is a graph input."""
    model = tg.GPT(TEST)
    randomize(model)
    T = 256
    buf = torch.randint(0, 50_000, (T + 1,), generator=torch.Generator().manual_seed(3)).numpy().astype("uint16")
    buf[[0, 30, 70, 200]] = tg.BOS_ID
    b = tg.make_batch(buf, TEST.ngram_rows, tg.flex_mask_spec(TEST, TEST.windows_init))
    assert b.cu_seqlens[:5].tolist() == [0, 30, 70, 200, T]
    results = []
    for masks in (model.attention_masks(b.cu_seqlens, T, kernel="flex"), model.batch_masks(b)):
        graphs = []
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=_collector(graphs)("forward", True)),
                                 fullgraph=True, dynamic=False)
        model.zero_grad(set_to_none=True)
        loss, _ = compiled(b.inputs, b.targets, b.cu_seqlens, b.ngram_ids, mtp_weights=torch.tensor([1.0, 0.5, 0.25]),
                           loss_scale=1 / T, prefix_weight=torch.tensor(0.25), masks=masks)
        loss.backward()
        flex = [n for _, gm in graphs for n in _flex_nodes(gm)]
        assert len(flex) == 2 * sum(row.attention != "none" for row in model.layers)  # forward, backward
        assert all(a.op == "placeholder" for n in flex for a in _tensor_args(n))
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_model, grads_model), (loss_loader, grads_loader) = results
    assert torch.equal(loss_model, loss_loader)
    assert grads_model.keys() == grads_loader.keys() and len(grads_model) > 10
    for name in grads_model:
        assert torch.equal(grads_model[name], grads_loader[name]), name


# The optimizer's compiled NorMuon update as dynamo and AOT autograd see it on a GPU machine: dynamo treats
# a `kernel[grid](...)` launch as a user-defined Triton kernel only where a Triton GPU backend exists (and
# not under the interpreter), so the trace runs in a fresh process with has_triton() answering True and
# every symmetric product sent to the kernel; the compiler keeps the graphs and runs nothing.
_POLAR_EXPRESS_TRACE = r"""
import json, sys
import torch.utils._triton as triton_utils
triton_utils.has_triton = lambda: True
import torch
from torch._dynamo.backends.common import aot_autograd
sys.path.insert(0, sys.argv[1])
import triton_kernels as tk
import train_gpt as tg

dynamo_graphs, forward_graphs = [], []

def forward_compiler(gm, example_inputs):
    forward_graphs.append(gm)
    outputs = [n.meta["val"] for n in gm.graph.output_node().args[0]]
    return lambda *args: [torch.zeros(o.shape, dtype=o.dtype) for o in outputs]

def backend(gm, example_inputs):
    dynamo_graphs.append(gm)
    return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)

for name in ("XXT", "XTX", "ba_plus_cAA"):  # the public function with the kernel at every shape
    fn = getattr(tk, name)
    setattr(tk, name, lambda *args, _fn=fn: _fn(*args, kernel=True))
normuon = tg.update_functions(compile=backend)["normuon"]
k, results = 2, {}
for rows, cols in ((64, 96), (96, 64)):  # wide: XXT; tall: XTX
    torch._dynamo.reset()
    dynamo_graphs.clear(); forward_graphs.clear()
    side = (k, 1, cols) if rows < cols else (k, rows, 1)
    normuon(torch.randn(k, rows, cols), torch.zeros(k, rows, cols), torch.zeros(side),
            torch.randn(k, rows, cols, dtype=torch.bfloat16), None, torch.ones(k, 1, 1),
            torch.tensor([0.01, 0.0, 0.95, 0.95, 0.0]), tg.polar_express)
    targets = lambda gs: [str(n.target) for g in gs for n in g.graph.nodes if n.op == "call_function"]
    results[f"{rows}x{cols}"] = dict(dynamo_graphs=len(dynamo_graphs), forward_graphs=len(forward_graphs),
                                     dynamo=targets(dynamo_graphs), aot=targets(forward_graphs))
print(json.dumps(results))
"""


def test_polar_express_kernel_launches_trace_into_the_compiled_update():
    """On CUDA the symmetric products launch _sym_mm_kernel inside the compiled NorMuon update (record #89's
    way: no custom-op crossing, dynamo sees the launch): the update must stay one graph (fullgraph: a
    graph break is an error), with the 5 Polar Express iterations' 10 launches (Gram + b A + c A^2) as
    Triton kernel nodes dynamo traced and AOT autograd functionalised, and no custom op of ours."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _POLAR_EXPRESS_TRACE, repo], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for shape, r in results.items():
        assert (r["dynamo_graphs"], r["forward_graphs"]) == (1, 1), shape
        assert r["dynamo"].count("triton_kernel_wrapper_mutation") == 10, (shape, r["dynamo"])
        assert r["aot"].count("triton_kernel_wrapper_functional") == 10, (shape, r["aot"])
        assert not [t for t in r["dynamo"] + r["aot"] if "speedrun" in t], shape
