"""tests/benchmarks/call_depth.py, the static count of calls from the training loop to each Triton kernel
launch (issue #78, item 2): on small sources whose chains are known by construction (a chain of
functions, methods through self and through typed objects, a custom op, a hand-off table with a
functools.partial, a stored callable, the backward, names not followed, branches a call fixes), then on the real
train_gpt.py and triton_kernels.py: every kernel the speedrun launches is reached."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
import call_depth as C  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNELS = textwrap.dedent('''
    import torch
    import triton

    @triton.jit
    def _k(x):
        pass

    @triton.jit
    def _k2(x):
        _helper(x)

    @triton.jit
    def _helper(x):
        pass

    def launch(x):
        _k[(1,)](x)

    def launch2(x):
        _k2[(1,)](x)

    def mid(x):
        launch(x)

    @torch.library.custom_op("speedrun::go", mutates_args=())
    def _go_op(x: torch.Tensor) -> None:
        _k2[(4,)](x)

    def go(x):
        torch.ops.speedrun.go(x)

    @torch.library.custom_op("speedrun::fwd", mutates_args=())
    def _fwd_op(x: torch.Tensor) -> torch.Tensor:
        return x

    def _bwd(ctx, g):
        launch2(g)

    _fwd_op.register_autograd(_bwd)
''')


def run(train_src: str, kernels_src: str = KERNELS) -> C.Result:
    return C.analyze({"train_gpt": textwrap.dedent(train_src), "triton_kernels": kernels_src},
                     skipped=frozenset({"shortcut"}))


def test_chain_of_functions():
    r = run('''
        import triton_kernels

        def a(x):
            b(x)

        def b(x):
            triton_kernels.mid(x)

        def train():
            for step in range(3):
                a(step)
    ''')
    k = r.kernels["_k"]
    assert k.chain == ["a", "b", "mid", "launch", "_k[grid]"]
    assert k.depth == 5
    assert [e.line for e in k.calls] == [12, 5, 8, 24, 18]  # each call where it is written
    assert r.kernels["_k2"].depth is None  # launched in the file, never from the loop
    assert r.device_functions == ["_helper"]  # @triton.jit, never launched
    assert r.maximum.kernel == "_k"


def test_methods_through_self_and_typed_objects():
    r = run('''
        import triton_kernels

        class Opt:
            def step(self):
                self._work()

            def _work(self):
                triton_kernels.launch(1)

        class Trainer:
            def __init__(self, opt: Opt):
                self.opt = opt

            def step(self):
                self.opt.step()

        def train():
            trainer = Trainer(Opt())
            for step in range(3):
                trainer.step()
    ''')
    assert r.kernels["_k"].chain == ["Trainer.step", "Opt.step", "Opt._work", "launch", "_k[grid]"]


def test_custom_op_and_nested_function():
    r = run('''
        import triton_kernels

        def train():
            def report(x):
                triton_kernels.go(x)
            for step in range(3):
                report(step)
    ''')
    assert r.kernels["_k2"].chain == ["train.report", "go", "_go_op", "_k2[grid]"]
    assert r.kernels["_k2"].calls[2].call == "torch.ops.speedrun.go"


def test_hand_off_table_with_partial_and_names_not_followed():
    src = '''
        import functools
        import triton_kernels

        def long_way(x, scale=1.0):
            step_one(x)

        def step_one(x):
            triton_kernels.launch(x)

        def other(x):
            triton_kernels.launch2(x)

        LOSSES = {"a": functools.partial(long_way, scale=2.0), "b": other}

        def train(kind):
            for step in range(3):
                LOSSES["a"](step)
                shortcut(step)
                CALL

        def shortcut(x):
            triton_kernels.launch(x)

        OTHERS = {"c": shortcut}
    '''
    r = run(src.replace("CALL", "pass"))
    # shortcut is not followed (a name in NOT_FOLLOWED), so the table's partial gives the chain
    assert r.kernels["_k"].chain == ["long_way", "step_one", "launch", "_k[grid]"]
    assert r.kernels["_k2"].depth is None  # a key the call fixes enters its entry alone
    r = run(src.replace("CALL", "LOSSES[kind](step)"))
    assert r.kernels["_k2"].chain == ["other", "launch2", "_k2[grid]"]  # any other key: every entry of the table
    r = run(src.replace("CALL", "pick = LOSSES['b' if kind is None else 'a']\n                pick(step)")
            .replace("def train(kind):", "def train(kind=None):"))
    assert r.kernels["_k2"].chain == ["other", "launch2", "_k2[grid]"]  # a local bound to a table's entry


def test_backward_enters_registered_backwards():
    r = run('''
        import triton_kernels

        def train():
            for step in range(3):
                loss = triton_kernels._fwd_op(step)
                loss.backward()
    ''')
    assert r.kernels["_k2"].chain == ["Tensor.backward", "_bwd", "launch2", "_k2[grid]"]


def test_a_branch_the_call_fixes():
    train = '''
        import triton_kernels

        class Model:
            def forward(self, x, w=None):
                if w is None:
                    return self.cheap(x)
                hidden = self.hidden(x, big=True)
                return triton_kernels.launch2(hidden)

            def hidden(self, x, big=False):
                extra = [] if big else None
                return self.layer(x, extra)

            def layer(self, x, extra):
                if extra is not None:
                    triton_kernels.launch(x)
                return x

            def cheap(self, x):
                return self.hidden(x)

        def train():
            model = Model()
            for step in range(3):
                model(step)
                CALL
    '''
    r = run(train.replace("CALL", "pass"))  # evaluation only: w None returns before the kernels
    assert r.kernels["_k"].depth is None and r.kernels["_k2"].depth is None
    r = run(train.replace("CALL", "model(step, w=step)"))
    assert r.kernels["_k"].chain == ["Model.forward", "Model.hidden", "Model.layer", "launch", "_k[grid]"]
    assert r.kernels["_k2"].chain == ["Model.forward", "launch2", "_k2[grid]"]


def test_unknown_branches_follow_both_sides():
    r = run('''
        import triton_kernels

        def pick(x):
            if x.is_cuda:
                return triton_kernels.mid(x)
            return triton_kernels.launch(x)

        def train():
            for step in range(3):
                pick(step)
    ''')
    assert r.kernels["_k"].chain == ["pick", "launch", "_k[grid]"]  # the shorter side


def test_stored_callable_table(monkeypatch):
    src = '''
        import triton_kernels

        class Opt:
            def __init__(self):
                self._fn = make()

            def step(self):
                self._fn(1)

        def train():
            opt = Opt()
            for step in range(3):
                opt.step()
    '''
    assert run(src).kernels["_k"].depth is None  # what self._fn holds is not in the source's types
    monkeypatch.setitem(C.STORED_CALLABLES, ("Opt", "_fn"), ("mid",))
    assert run(src).kernels["_k"].chain == ["Opt.step", "mid", "launch", "_k[grid]"]
    monkeypatch.setitem(C.STORED_CALLABLES, ("Opt", "_gone"), ("mid",))
    with pytest.raises(SystemExit, match="no longer has _gone"):  # a stale entry stops the tool
        run(src)


def test_a_launch_of_the_kernel_modules_kernel_from_the_other_module():
    r = run('''
        import torch
        import triton_kernels

        @torch.library.custom_op("speedrun::body", mutates_args=())
        def body(x: torch.Tensor) -> torch.Tensor:
            triton_kernels._k2[(1,)](x)
            return x

        def train():
            for step in range(3):
                body(step)
    ''')
    assert r.kernels["_k2"].chain == ["body", "_k2[grid]"]
    assert r.kernels["_k2"].calls[1].module == "train_gpt"


SPEEDRUN_KERNELS = {
    "_sym_mm_kernel": "the symmetric matmul (Polar Express's Gram products)",
    "_fp8_relu2_kernel": "the FP8 up-projection",
    "_ce_mtp_kernel": "the loss",
    "_transpose_kernel": "the transposes of the tied embedding",
    "_mm_epilogue_kernel": "the MLP epilogue",
}


def test_real_files_reach_every_kernel_the_speedrun_launches(tmp_path):
    r = C.analyze(C.load_sources(REPO))
    assert set(SPEEDRUN_KERNELS) <= set(r.kernels)
    for name, what in SPEEDRUN_KERNELS.items():
        k = r.kernels[name]
        assert k.depth is not None and k.depth == len(k.chain) == len(k.calls), (name, what)
        assert k.chain[-1] == f"{name}[grid]"
        assert k.calls[0].module == "train_gpt" and r.loop_line < k.calls[0].line  # a call in the loop's body
    gram = r.kernels["_sym_mm_kernel"].chain
    assert "polar_express" in gram and "NorMuonAdam.step" in gram
    assert "GPT.forward" in r.kernels["_fp8_relu2_kernel"].chain
    # issue #78, item 2: at most 6 calls (the Gram kernel launched by XXT itself, traced into the compiled update)
    assert {k: r.kernels[k].depth for k in SPEEDRUN_KERNELS} == {
        "_sym_mm_kernel": 6, "_fp8_relu2_kernel": 6, "_ce_mtp_kernel": 6, "_transpose_kernel": 5, "_mm_epilogue_kernel": 6}
    assert gram[-3:] == ["polar_express", "XXT", "_sym_mm_kernel[grid]"]
    assert r.kernels["_fp8_relu2_kernel"].chain[-3:] == ["FP8MLPState.mlp", "fp8_mlp", "_fp8_relu2_kernel[grid]"]
    assert r.kernels["_ce_mtp_kernel"].chain[-3:] == ["fp8_head", "fp8_head_loss", "_ce_mtp_kernel[grid]"]
    assert r.maximum.depth == max(k.depth for k in r.kernels.values())
    out = tmp_path / "depth.json"
    assert C.main(["--json", str(out), "--max", str(r.maximum.depth)]) == 0
    data = json.loads(out.read_text())
    assert {k["kernel"]: k["depth"] for k in data["kernels"]} == {k: v.depth for k, v in r.kernels.items()}
    assert C.main(["--max", str(r.maximum.depth - 1)]) == 1


def test_reads_the_source_without_importing_it():
    code = ("import sys; sys.path.insert(0, 'tests/benchmarks'); import call_depth; call_depth.main([]); "
            "assert not {'torch', 'triton', 'train_gpt', 'triton_kernels'} & set(sys.modules), sorted(sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "From the training loop to the Gram kernel (the symmetric matmul kernel of Polar Express) is" in p.stdout
