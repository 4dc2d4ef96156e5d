"""tests/benchmarks/host_dispatch.py's counter against references whose counts are known by construction:
eager aten ops around a compiled function (the ops inside it not counted, whichever backend, with and
without autograd), custom-op crossings and the aten ops of their bodies (counted inside compiled graphs
too), phases, and, on the real training step, the attention masks' share (zero when the loader builds them)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
import host_dispatch as H  # noqa: E402
from torch.profiler import record_function  # noqa: E402

EAGER_OPS = 4  # eager_part's aten ops: four calls, none of which dispatches another op


def eager_part(x, y):
    a = torch.add(x, y)
    b = torch.mul(a, y)
    c = torch.neg(b)
    return torch.sub(c, x)


def graph_body(x):  # pointwise ops (one fused kernel with inductor) and a matmul (aten::mm in either backend)
    return (x.sin() * x.cos() + x.exp()).tanh() @ x


@torch.library.custom_op("hdtest::scaled_sum", mutates_args=())
def scaled_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.add(torch.mul(x, y), x)  # CUSTOM_BODY_OPS aten ops, none nested


CUSTOM_BODY_OPS = 2


@scaled_sum.register_fake
def _(x, y):
    return torch.empty_like(x)


def test_the_eager_reference_has_exactly_its_calls():
    """The references below rely on eager_part dispatching exactly EAGER_OPS ops and the custom op's
    body CUSTOM_BODY_OPS (the profiler, unfiltered)."""
    x, y = torch.randn(8), torch.randn(8)
    for fn, n in ((eager_part, EAGER_OPS), (lambda: scaled_sum(x, y), CUSTOM_BODY_OPS)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn(x, y) if fn is eager_part else fn()
        assert sum(e.name.startswith("aten::") for e in prof.events()) == n


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("grad", [False, True])
def test_ops_inside_a_compiled_graph_are_not_counted(backend, grad):
    """Twice the eager part around one compiled call: exactly 2 x EAGER_OPS aten ops, while the graph's
    own ops are seen (in_graphs) and left out, with autograd (CompiledFunction) and without (inductor's
    graph call; aot_eager's bare region)."""
    torch._dynamo.reset()
    compiled = torch.compile(graph_body, fullgraph=True, backend=backend)
    x, y = torch.randn(64, 64, requires_grad=grad), torch.randn(64, 64)

    def step():
        return eager_part(compiled(eager_part(x, y)), y)

    with torch.set_grad_enabled(grad):
        step()  # compiles: the counted call below only runs the graph
        count, _ = H.count_host_dispatches(step)
    assert count.aten == 2 * EAGER_OPS, count.aten_ops
    assert count.aten_outermost == 2 * EAGER_OPS
    assert count.aten_ops == {"aten::add": 2, "aten::mul": 2, "aten::neg": 2, "aten::sub": 2}
    assert count.in_graphs >= 1 and count.crossings == 0


def test_custom_op_crossings_and_their_bodies_are_counted_inside_graphs_too():
    """k eager calls and one compiled function calling the op twice: k + 2 crossings, and every body's
    aten ops counted (the compiled graph calls the op as an opaque kernel whose body runs eagerly)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: scaled_sum(scaled_sum(x.sin(), y), y).cos(), fullgraph=True,
                             backend="aot_eager")
    x, y = torch.randn(32), torch.randn(32)
    k = 3

    def step():
        z = x
        for _ in range(k):
            z = scaled_sum(z, y)
        return compiled(z, y)

    step()
    count, _ = H.count_host_dispatches(step, namespaces=("hdtest",))
    assert count.crossings == k + 2
    assert count.custom_ops == {"hdtest::scaled_sum": k + 2}
    assert count.aten == (k + 2) * CUSTOM_BODY_OPS, count.aten_ops
    assert count.in_graphs >= 2  # sin and cos


def test_phases_attribute_each_dispatch_to_the_nearest_phase():
    x, y = torch.randn(8), torch.randn(8)

    def step():
        with record_function(H.PHASE_PREFIX + "outer"):
            eager_part(x, y)
            with record_function(H.PHASE_PREFIX + "inner"):
                scaled_sum(x, y)
        eager_part(x, y)

    count, _ = H.count_host_dispatches(step, namespaces=("hdtest",))
    assert count.phases == {"outer": {"aten": EAGER_OPS, "crossings": 0},
                            "inner": {"aten": CUSTOM_BODY_OPS, "crossings": 1},
                            H.OTHER_PHASE: {"aten": EAGER_OPS, "crossings": 0}}
    assert count.total == 2 * EAGER_OPS + CUSTOM_BODY_OPS + 1


def test_report_summary_line_and_per_step_figures():
    count = H.DispatchCount(aten=300, aten_outermost=100, crossings=60, in_graphs=5, in_stand_ins=7,
                            phases={"masks": {"aten": 160, "crossings": 0}},
                            aten_ops=H.collections.Counter({"aten::add": 300}),
                            custom_ops=H.collections.Counter({"speedrun::fp8_mlp": 60}))
    lines = H.report(count, steps=2, micro=8, layers=11)
    assert lines[0] == ("host dispatches per step: 180 (150 aten ops outside compiled graphs + 30 custom-op "
                        "crossings), 8 micro-batches, 11 layers")
    assert any("attention masks" in line and "(10 + 0)" in line for line in lines)
    assert count.scaled(0.5)["phases"]["masks"]["aten"] == 80


def test_compare_prints_the_change_per_phase():
    before = dict(total=100.0, aten=90.0, crossings=10.0, phases={"masks": {"aten": 40, "crossings": 0},
                                                                   H.FORWARD_BACKWARD: {"aten": 50, "crossings": 10}})
    after = dict(total=60.0, aten=50.0, crossings=10.0, phases={H.FORWARD_BACKWARD: {"aten": 50, "crossings": 10}})
    lines = H.compare(before, after)
    assert lines[0] == "host dispatches per step, before -> after: 100.0 -> 60.0 (-40.0)"
    masks = next(line for line in lines if "attention masks" in line)
    assert masks.split()[-4:] == ["40.0", "->", "0.0", "(-40.0)"]


@pytest.mark.slow
def test_training_step_counts_and_loader_masks_remove_exactly_the_mask_share():
    """The real step (4-layer test table, 2 micro-batches, aot_eager): positive counts in every phase
    that dispatches on the host, the FP8 ops crossing once per layer and micro-batch; with the loader's
    block masks (the CUDA path) the masks phase dispatches only the windows' views, the compiled calls, optimizer and
    re-quantization exactly as many as with masks the model builds, and the transfer one view more per
    mask tensor the batch carries (8 per attention kind and the document ids)."""
    import train_gpt as T
    args = H.tiny_args(micro_tokens=256, micro_batches=2,
                       layers=T.parse_args(["--preset", "test"]).layers)
    runner = H.StepRunner(args, "aot_eager")
    with H.cuda_path_on_cpu("aot_eager"):
        # compile both variants (the model's masks carry int64 document ids, the loader's int32) on step 0,
        # whose Adam parity step 2 shares
        runner.step(0, runner.batches(0))
        runner.step(0, runner.batches(0, model_masks=True))
        built, _ = H.count_host_dispatches(runner.step, 2, runner.batches(2, model_masks=True))
        loader, _ = H.count_host_dispatches(runner.step, 2, runner.batches(2))
    masks = built.phases["masks"]
    assert masks["aten"] > 0 and masks["crossings"] == 0
    for phase in (H.FORWARD_BACKWARD, "optimizer", "fp8 quantize"):
        assert built.phases[phase]["aten"] > 0, phase
        assert loader.phases[phase] == built.phases[phase], phase
    layers, micro = len(args.layers), args.micro_batches
    assert built.custom_ops["speedrun::fp8_mlp"] == layers * micro
    assert built.custom_ops["speedrun::fp8_head_loss"] == micro
    kinds = len(T.attention_kinds(args.layers))
    # left in the masks phase: each kind's view of its window in the model's buffer (select, as_strided)
    assert loader.phases["masks"]["aten"] <= 2 * kinds * micro < masks["aten"] / 10
    extra_views = micro * (8 * kinds + 1)
    assert loader.phases[H.OTHER_PHASE]["aten"] == built.phases[H.OTHER_PHASE]["aten"] + extra_views
    assert loader.crossings == built.crossings


@pytest.mark.slow
def test_smoke_run_prints_the_summary_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "figures.json"
    count = H.main(["--smoke", "--json", str(out)])
    printed = capsys.readouterr().out.splitlines()
    summary = next(line for line in printed if line.startswith("host dispatches per step:"))
    assert summary == (f"host dispatches per step: {count.total:,} ({count.aten:,} aten ops outside compiled graphs"
                       f" + {count.crossings:,} custom-op crossings), 2 micro-batches, 4 layers")
    figures = H.json.loads(out.read_text())
    assert figures["total"] == count.total > 0 and figures["layers"] == 4 and figures["micro_batches"] == 2
    assert sum(p["aten"] for p in figures["phases"].values()) == figures["aten"]
    assert figures["per_step"] == [dict(step=2, adam=False, total=count.total, aten=count.aten, crossings=count.crossings)]
