"""StepGraphs, the training step through static buffers that CUDA runs replay as graphs, checked on a
CPU: without capture it runs the same code on the same buffers, so every step equals train_step's to
the bit; the shape keys of a schedule are its stage rows; --cuda_graphs false (or a CPU) keeps
train_step. The capture itself and its check against the uncaptured step run in the GPU check
(`cuda-graphs`)."""
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt as tg  # noqa: E402

CPU = torch.device("cpu")


def make_corpus(tmp_path, name="train", num_shards=2, tokens=60_000, seed=0):
    """Shards of random documents (BOS, then 1-400 tokens below 50,000)."""
    rng = np.random.default_rng(seed)
    for s in range(num_shards):
        out = []
        while len(out) < tokens:
            out += [tg.BOS_ID] + rng.integers(0, 50_000, int(rng.integers(1, 400))).tolist()
        tg.write_shard(str(tmp_path / f"c_{name}_{s:06d}.bin"), out)
    return str(tmp_path / f"c_{name}_*.bin")


def replica(args, pattern):
    """Model, optimizer, loader (staging each step into one buffer, as on CUDA) and the loss-weight
    tensors, from seed 0: two replicas start equal."""
    torch.manual_seed(0)
    model = tg.GPT(args, 1, dtype=torch.float32)
    model.prefix_table.copy_(tg.build_prefix_table(tg.gpt2_encoding(), args.padded_vocab_size))
    opt = tg.build_optimizer(args, model, CPU)
    loader = tg.DocumentLoader(pattern, args.ngram_rows)
    loader.stage = True  # the CUDA loader's joint staging buffer (unpinned without a GPU)
    mtp, prefix = torch.zeros(len(args.stages[0].mtp_start)), torch.zeros(())
    return model, opt, loader, mtp, prefix


def assert_same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and torch.equal(a, b), what


@pytest.mark.slow
def test_static_buffer_step_equals_train_step_bit_for_bit(tmp_path):
    """The test preset's whole schedule (7 steps: every stage, both Adam parities, the untie after step
    5) through train_step and through StepGraphs (no capture) from the same state: every step's loss,
    every parameter, every gradient left pending and every optimizer state tensor are the same bits.
    Steps of one stage share a key, so the second step of each reads data its own staging copy put in
    the static buffer."""
    args = tg.parse_args(["--preset", "test", "--compile", "false", "--micro_batches", "2",
                          "--stage_batch_tokens", "(256, 512, 512, 512)"])
    pattern = make_corpus(tmp_path)
    model_a, opt_a, loader_a, mtp_a, prefix_a = replica(args, pattern)
    model_b, opt_b, loader_b, mtp_b, prefix_b = replica(args, pattern)
    accum = tg.grad_accum_steps(args, 1)
    scale = tg.grad_scale_for(args, 1)
    graphs = tg.StepGraphs(model_b, model_b, opt_b, mtp_b, prefix_b, scale, CPU)
    assert not graphs.capture
    for step in range(tg.total_steps(args)):
        plan = tg.plan_step(args, step)
        request = tg.batch_request(args, plan, accum, CPU)
        model_a.set_windows(*plan.windows)
        model_b.set_windows(*plan.windows)
        batches_a, batches_b = loader_a.next_step(*request), loader_b.next_step(*request)
        loss_a = torch.stack(tg.train_step(model_a, opt_a, batches_a, plan, mtp_a, prefix_a, scale, CPU))
        loss_b = torch.stack(graphs.step(batches_b, plan, tg.step_graph_key(plan, request, accum)))
        opt_b.step(**tg.optimizer_schedule(plan))  # Trainer.step's, after the graphs'
        if step == tg.untie_step(args):
            opt_a.untie()
            opt_b.untie()
        assert torch.equal(loss_a, loss_b), (step, loss_a.tolist(), loss_b.tolist())
        for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
            assert_same(pa.detach(), pb.detach(), f"step {step}: {name}")
            assert_same(pa.grad, pb.grad, f"step {step}: gradient of {name}")
        sa, sb = opt_a.state_dict(), opt_b.state_dict()
        assert sa["adam_steps"] == sb["adam_steps"] and sa["tied"] == sb["tied"]
        for label, st in sa["state"].items():
            for k, t in st.items():
                assert_same(t, sb["state"][label][k], f"step {step}: optimizer state {label}.{k}")
    assert len(graphs.buffers) == len(args.stages) and graphs.captured() == 0


def test_the_step_graphs_run_forward_backward_itself(tmp_path, monkeypatch):
    """One definition of a micro-batch's forward and backward: train_step and the step graphs (what
    Trainer.step runs on CUDA; here uncaptured) both run forward_backward, once a step, over every
    micro-batch, the graphs into their static buffers; no other training forward exists."""
    args = tg.parse_args(["--preset", "test", "--compile", "false", "--micro_batches", "2",
                          "--stage_batch_tokens", "(256, 512, 512, 512)"])
    pattern = make_corpus(tmp_path)
    model, opt, loader, mtp, prefix = replica(args, pattern)
    calls, step = [], tg.forward_backward
    monkeypatch.setattr(tg, "forward_backward", lambda *a, **k: (calls.append((len(a[2]), "into" in k)), step(*a, **k))[1])
    plan, accum, scale = tg.plan_step(args, 0), tg.grad_accum_steps(args, 1), tg.grad_scale_for(args, 1)
    request = tg.batch_request(args, plan, accum, CPU)
    model.set_windows(*plan.windows)
    tg.train_step(model, opt, loader.next_step(*request), plan, mtp, prefix, scale, CPU)
    graphs = tg.StepGraphs(model, model, opt, mtp, prefix, scale, CPU)
    graphs.step(loader.next_step(*request), plan, tg.step_graph_key(plan, request, accum))
    assert calls == [(accum, False), (accum, True)]
    source = open(tg.__file__).read()
    assert source.count("micro_next_token = compiled_model(") == 1  # evaluate() calls it for the validation loss only


def test_step_buffer_is_the_loaders_one_buffer(tmp_path):
    """A staging loader packs a step's micro-batches into consecutive slices of one buffer; step_buffer
    gives that buffer itself (the step's one copy), and a packed copy of batches staged apart."""
    args = tg.parse_args(["--preset", "test"])
    loader = tg.DocumentLoader(make_corpus(tmp_path), args.ngram_rows)
    loader.stage = True
    batches = loader.next_step(128, 64, 4)
    joint = tg.step_buffer(batches)
    assert joint.numel() == sum(b.staged.numel() for b in batches)
    assert joint.data_ptr() == batches[0].staged.data_ptr()  # no copy: the loader's buffer
    apart = [tg.stage_batch(b) for b in batches]
    packed = tg.step_buffer(apart)
    assert packed.numel() == joint.numel() and packed.data_ptr() != apart[0].staged.data_ptr()
    for buf in (joint, packed):  # every batch's tensors, from its slice of the one buffer
        at = 0
        for b in batches:
            assert all(torch.equal(x, y) for x, y in zip(tg.batch_tensors(b), tg.batch_tensors(tg.unstage(b, buf[at:at + b.staged.numel()]))))
            at += b.staged.numel()


def schedule_keys(args, steps, world_size, device):
    accum = tg.grad_accum_steps(args, world_size)
    keys = set()
    for step in steps:
        plan = tg.plan_step(args, step)
        keys.add(tg.step_graph_key(plan, tg.batch_request(args, plan, world_size * accum, device), accum))
    return keys


@pytest.mark.parametrize("preset,world_size", [("speedrun", 1), ("speedrun", 8), ("test", 1), ("demo", 2)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_schedule_shape_keys_are_the_stage_rows(preset, world_size, device):
    """The whole schedule's shape keys are one per stage row, (windows, tokens per micro-batch, max
    document length, micro-batches per rank) as the stages table gives them (Adam parity and the untie
    need no key of their own); every one of them occurs in the warm-up steps, which capture them."""
    args = tg.parse_args(["--preset", preset, "--attention_kernel", "flex"])
    accum = tg.grad_accum_steps(args, world_size)
    expected = {(tuple(row.windows), row.batch_tokens // (world_size * accum), row.max_doc_len, accum)
                for row in args.stages}
    keys = schedule_keys(args, range(tg.total_steps(args)), world_size, torch.device(device))
    assert len(keys) == len(expected) == 4
    assert {k[:4] for k in keys} == expected
    assert all((k[4] is None) == (device == "cpu") for k in keys)  # the loader's flex mask spec on CUDA
    assert schedule_keys(args, tg.warmup_steps(args), world_size, torch.device(device)) == keys


def test_cuda_graphs_flag():
    """--cuda_graphs (default true) captures only on CUDA with --compile true; false, a CPU or no
    compile keep train_step; a bad value is a one-line error, like any bool flag."""
    parse = tg.parse_args
    assert parse([]).cuda_graphs is True and parse(["--cuda_graphs", "false"]).cuda_graphs is False
    cuda = torch.device("cuda")
    assert tg.use_cuda_graphs(parse([]), cuda)
    assert not tg.use_cuda_graphs(parse(["--cuda_graphs", "false"]), cuda)
    assert not tg.use_cuda_graphs(parse(["--compile", "false"]), cuda)
    assert not tg.use_cuda_graphs(parse([]), CPU)
    with pytest.raises(SystemExit, match=r"^error: --cuda_graphs 'maybe' is not a valid true/false"):
        parse(["--cuda_graphs", "maybe"])
    assert "cuda_graphs" in tg.RESUMABLE_CHANGES  # a speed switch: a run may resume with it changed


def run_train(tmp_path, monkeypatch, graphs: bool, *flags):
    """train() of 3 small steps with the compile warm-up (torch.compile as the identity), recording
    every step's loss; graphs: StepGraphs forced on (without capture: a CPU)."""
    losses, made = [], []
    forward_backward, step = tg.forward_backward, tg.StepGraphs.step

    def recording_forward_backward(*a, **k):
        out = forward_backward(*a, **k)
        if "into" not in k:  # the step graphs' run: recorded by recording_step
            losses.append(torch.stack(out))  # (objective, next-token loss)
        return out

    def recording_step(self, *a, **k):
        made.append(self)
        out = step(self, *a, **k)
        losses.append(torch.stack(out))
        return out

    monkeypatch.setattr(tg, "forward_backward", recording_forward_backward)
    monkeypatch.setattr(tg.StepGraphs, "step", recording_step)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    if graphs:
        monkeypatch.setattr(tg, "use_cuda_graphs", lambda args, device: True)
    args = tg.parse_args(["--preset", "test", "--compile", "true", "--val_loss_every", "0", "--val_tokens", "512",
                          "--num_iterations", "3", "--extension_iterations", "0", "--micro_batches", "2",
                          "--stage_batch_tokens", "(256, 256, 256, 256)", "--cpu_dtype", "fp32",
                          "--train_files", make_corpus(tmp_path), "--val_files", make_corpus(tmp_path, "val", 1),
                          "--log_dir", str(tmp_path / "logs"), "--run_id", f"graphs{graphs}", *flags])
    val = tg.train(args, tg.setup_distributed(force_cpu=True))
    log = open(tmp_path / "logs" / f"graphs{graphs}.txt").read()
    return losses, val, made, log.split("==== training ====\n", 1)[1]


def test_train_through_step_graphs_equals_train_step(tmp_path, monkeypatch):
    """train() on a CPU with --cuda_graphs true (the default) runs forward_backward, as with false; forced
    through StepGraphs it runs the same warm-up, restores the same state (gradients the warm-up left
    are zeroed in place in the static tensors) and logs the same losses to the bit."""
    with monkeypatch.context() as m:
        plain, val_plain, made, log = run_train(tmp_path, m, False)
    assert not made and "cuda graphs" not in log
    warm = len(tg.warmup_steps(tg.parse_args(["--preset", "test", "--num_iterations", "3",
                                              "--extension_iterations", "0"])))
    assert len(plain) == warm + 3
    with monkeypatch.context() as m:
        static, val_static, made, log = run_train(tmp_path, m, True)
    assert made and all(g is made[0] for g in made) and len(static) == len(plain)
    assert "cuda graphs: 0 step shapes captured in the warm-up" in log
    assert all(torch.equal(a, b) for a, b in zip(plain, static)), (plain, static)
    assert val_static == val_plain


@pytest.mark.slow
def test_compiled_step_through_static_buffers_equals_train_step(tmp_path):
    """The same through torch.compile (aot_eager: dynamo and AOTAutograd as on a GPU, no inductor) over
    two stages: the static buffers' views (micro-batches at offsets into one buffer) compile to no
    graph of their own, and each step is train_step's to the bit."""
    args = tg.parse_args(["--preset", "test", "--micro_batches", "2", "--stage_batch_tokens", "(256, 512, 512, 512)"])
    pattern = make_corpus(tmp_path)
    (model_a, opt_a, loader_a, mtp_a, prefix_a), (model_b, opt_b, loader_b, mtp_b, prefix_b) = (
        replica(args, pattern), replica(args, pattern))
    torch._dynamo.reset()
    fn_a, fn_b = (torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=False) for m in (model_a, model_b))
    scale = tg.grad_scale_for(args, 1)
    graphs = tg.StepGraphs(model_b, fn_b, opt_b, mtp_b, prefix_b, scale, CPU)
    for step in range(4):  # stage 1 (steps 0, 1), stage 2 (2, 3)
        plan = tg.plan_step(args, step)
        request = tg.batch_request(args, plan, 2, CPU)
        model_a.set_windows(*plan.windows)
        model_b.set_windows(*plan.windows)
        loss_a = torch.stack(tg.train_step(fn_a, opt_a, loader_a.next_step(*request), plan, mtp_a, prefix_a, scale, CPU))
        loss_b = torch.stack(graphs.step(loader_b.next_step(*request), plan, tg.step_graph_key(plan, request, 2)))
        opt_b.step(**tg.optimizer_schedule(plan))
        assert torch.equal(loss_a, loss_b), step
        assert all(torch.equal(pa, pb) for pa, pb in zip(model_a.parameters(), model_b.parameters())), step
    assert tg.compile_counts()["graph_breaks"] == 0


def test_replay_check_is_bitwise_where_uncaptured_runs_agree():
    """The warm-up's check of a replay: equal bits pass; a tensor two uncaptured runs reproduce must
    match bit for bit; one they do not (atomic adds) may differ by up to 4x their spread; float8
    buffers compare as bytes."""
    x = torch.arange(6, dtype=torch.float32)
    f8 = torch.full((4,), 2.0).to(torch.float8_e4m3fn)
    ref = {"loss": torch.tensor(3.0), "grad": x, "scale": f8}
    assert tg.replay_mismatch({k: v.clone() for k, v in ref.items()}, ref, ref) == ""
    off = {**ref, "grad": x + 1e-3}
    assert "grad differs" in tg.replay_mismatch(off, ref, ref)
    noisy = {**ref, "grad": x + 1e-3}
    assert tg.replay_mismatch(off, ref, noisy) == ""  # within the uncaptured runs' own spread
    assert "grad differs" in tg.replay_mismatch({**ref, "grad": x + 5e-3}, ref, noisy)
    assert "scale differs" in tg.replay_mismatch({**ref, "scale": torch.full((4,), 4.0).to(torch.float8_e4m3fn)}, ref, ref)
