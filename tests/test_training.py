"""The training script end to end: the `test` preset over gloo, launched by torchrun (the two-rank run the
other tests resume from) or as the workers torchrun starts (dist_utils.run_workers: the same processes and
environment, without the launcher's seconds)."""
import os
import re
import shutil
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warm_python  # noqa: E402
from dist_utils import on_call, run_on_ranks, run_torchrun, run_workers  # noqa: E402

SCRIPT = os.path.join(ROOT, "train_gpt.py")
STEP_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:([0-9.]+)ms "
                       r"train_loss:([0-9.]+) objective:([0-9.]+)$")
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:([0-9.]+) train_time:(\d+)ms")

pytestmark = pytest.mark.slow


def train(tmp_path, run_id, nproc, *extra, expect_fail=False, torchrun=False):
    args = ["--preset", "test", "--compile", "false", "--run_id", run_id,
            "--log_dir", str(tmp_path / "logs"), "--checkpoint_dir", str(tmp_path / "ckpt"), *extra]
    launch = run_torchrun if torchrun else run_workers
    if expect_fail:
        with pytest.raises(AssertionError) as e:
            launch(SCRIPT, nproc, script_args=args, timeout=400)
        return str(e.value)
    launch(SCRIPT, nproc, script_args=args, timeout=400)
    return open(tmp_path / "logs" / f"{run_id}.txt").read()


WORKER_PROBE = """import os, signal, sys, time
print(*(os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")), flush=True)
if sys.argv[1] == "fail":
    signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM kept", flush=True))  # as a rank in a collective
    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(60)
"""


def test_workers_get_torchruns_environment_and_a_failed_one_stops_the_others(tmp_path):
    """run_workers, which most tests below launch with: torchrun's environment for every worker, output in
    rank order; one worker's failure stops the others (SIGTERM once, then SIGKILL) within the grace times."""
    script = tmp_path / "probe.py"
    script.write_text(WORKER_PROBE)
    assert run_workers(str(script), 3, ["ok"]).splitlines() == [f"{r} {r} 3 3 127.0.0.1" for r in range(3)]
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_workers(str(script), 2, ["fail"], timeout=60, grace=0.5)
    assert time.monotonic() - start < 20
    assert "failed (rank 0: -9, rank 1: 3)" in str(e.value)
    assert str(e.value).count("SIGTERM kept") == 1


def val_losses(log):
    return {int(m.group(1)): float(m.group(3)) for m in map(VAL_LINE.match, log.splitlines()) if m}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run2")
    return tmp, train(tmp, "two", 2, "--save_every", "3", torchrun=True)


def test_two_rank_run_log_and_learning(two_rank_run):
    tmp, log = two_rank_run
    for name in ("train_gpt.py", "triton_kernels.py"):
        source = open(os.path.join(ROOT, name)).read().rstrip("\n")
        assert f"==== {name} ====\n{source}\n" in log
    import platform
    import triton  # the versions the launched processes import: this interpreter's (any pinned stack)
    assert f"python {platform.python_version()} torch {torch.__version__} triton {triton.__version__}" in log
    assert "hardware: 2 CPU process(es)" in log and "orthogonalizer = 'polar_express'" in log
    assert re.search(r"^cpu dtype (bf16|fp32) \(auto: 256x64x256 matmul GFLOP/s per process: bf16 [0-9.]+, "
                     r"fp32 [0-9.]+; capability \w+\) on .+$", log, re.M)
    training = log.split("==== training ====\n", 1)[1].splitlines()
    steps = [STEP_LINE.match(line) for line in training]
    assert [int(m.group(1)) for m in steps if m] == list(range(1, 8))
    assert all(m.group(2) == "7" for m in steps if m)
    times = [int(m.group(3)) for m in steps if m]
    assert times == sorted(times) and times[0] > 0
    vals = val_losses(log)
    assert sorted(vals) == [0, 3, 6, 7]
    assert 10.6 < vals[0] < 11.0  # ln(50257) = 10.83 at init
    assert vals[7] < vals[0] - 0.5, vals  # it learns
    assert re.match(r"peak memory .*: \d+ MiB", training[-1])


def test_checkpoints_between_evaluations_keep_the_training_time(tmp_path):
    """A checkpoint is not training time, but the steps before it are: with checkpoints at steps 2 and 4
    and evaluations at 0, 3 and 6, the logged training time never goes back (it lost the steps since
    the last evaluation at each checkpoint)."""
    log = train(tmp_path, "ckpt_time", 1, "--save_every", "2")
    training = log.split("==== training ====\n", 1)[1].splitlines()
    times = [int(m.group(3)) for m in map(STEP_LINE.match, training) if m]
    assert len(times) == 7 and times == sorted(times), times
    assert sorted(val_losses(log)) == [0, 3, 6, 7]
    assert sorted(os.listdir(tmp_path / "ckpt" / "ckpt_time")) == [f"step_{s:06d}" for s in (2, 4, 6, 7)]


def test_world_sizes_agree(two_rank_run, tmp_path):
    """Same global batch, same data, same schedule: 1, 2 and 4 ranks follow the same loss trajectory
    (gradient averaging, sharded optimizer and loader split are exact up to bf16 rounding)."""
    _, log2 = two_rank_run
    # the same compute dtype: --cpu_dtype auto times bf16 against fp32 at start-up, and on a CPU where
    # they are close (AVX512-BF16 without AMX) a busy machine can tip each run its own way
    dtype = re.search(r"^cpu dtype (bf16|fp32)", log2, re.M).group(1)
    log1 = train(tmp_path, "one", 1, "--cpu_dtype", dtype)
    log4 = train(tmp_path, "four", 4, "--cpu_dtype", dtype)
    v1, v2, v4 = val_losses(log1), val_losses(log2), val_losses(log4)
    assert v1[0] == v2[0] == v4[0]  # same initial model, same validation tokens
    for step in (3, 6, 7):
        assert abs(v1[step] - v2[step]) < 0.02 and abs(v1[step] - v4[step]) < 0.02, (v1, v2, v4)
    assert v1[7] < v1[0] - 0.5


def test_record_92s_switches_train_alike_on_one_two_and_three_ranks(tmp_path):
    """--sampled_softmax (each micro-batch's candidate set a function of the micro-batch alone), ANVIL, the
    weight blends (on every rank's whole weights), the two-channel n-gram table with row Adam (its rows
    exchanged sparsely), the tables' cadence (step 5's update held from the hook-launched reductions and
    the row exchange), #92's post-loop mix, the virtual sequence cap, rows without x0, n-gram, attention or
    MLP, with a parallel MLP and narrow heads, #92's YaRN chains and table lr: 1, 2 and 3 ranks (6
    micro-batches a step: 6, 3 and 2 accumulation steps; 6 validation sequences) follow the same loss
    trajectory, and the loss falls; validation is over every class."""
    flags = ("--cpu_dtype", "fp32", "--fp8", "false", "--sampled_softmax", "((0, 1024), (0.8, 0))",
             "--matrix_optimizer", "anvil", "--weight_blends", "true", "--table_cadence", "(0.3, 4, 3)",
             "--ngram_channels", "2", "--ngram_optimizer", "row_adam", "--mudd_post_mix", "10", "--virtual_seq_cap", "96",
             "--yarn_chains", "own", "--attn_scale_short", "0.13", "--table_lr_mul", "70",
             "--layers", '("paired short save_skip no_ngram narrow_qk narrow_v",'
                         ' "attn long offset ve xsa gate post_gates parallel_mlp", "no_attn no_mlp no_x0", "skip save_h",'
                         ' "attn long offset ve gate dc from_h mudd")',
             "--micro_batches", "6", "--stage_batch_tokens", "(576, 1152, 1728, 1728)", "--val_tokens", "3072",
             "--bank_ownership", "balanced")  # ownership by FLOPs over 3 ranks
    logs = [train(tmp_path / str(n), f"sampled{n}", n, *flags) for n in (1, 2, 3)]
    v1, *others = (val_losses(log) for log in logs)
    # 7 steps: TailEMA's window is 2 steps, the averages' 1 (step 6: no value-embedding update)
    assert all("weight blends shipped (ticks): tail_ema 2, tail_average 1, value_embed_average 0, bank_blend 2"
               in log for log in logs)
    for v in others:
        assert v1[0] == v[0], (v1, v)
        for step in (3, 6, 7):
            assert abs(v1[step] - v[step]) < 0.02, (v1, v)
    assert v1[7] < v1[0] - 0.5


def test_resume_continues_exactly(two_rank_run, tmp_path):
    tmp, log = two_rank_run
    ckpt = tmp / "ckpt" / "two" / "step_000003"
    assert (ckpt / "model.pt").exists() and (ckpt / "rank001.pt").exists()
    resumed = train(tmp_path, "resumed", 2, "--resume", str(ckpt))
    # the compute dtype is the checkpoint's, not a fresh start-up timing's (which a busy CPU can tip)
    dtype = re.search(r"^cpu dtype (bf16|fp32)", log, re.M).group(1)
    assert re.search(rf"^cpu dtype {dtype} \(the checkpoint's: --resume {re.escape(str(ckpt))}\)", resumed, re.M)
    full, cont = val_losses(log), val_losses(resumed)
    assert sorted(cont) == [3, 6, 7]
    assert [cont[s] for s in (3, 6, 7)] == [full[s] for s in (3, 6, 7)]


def train_signalled(rank, world_size, argv, signalled_rank, call):
    """train_gpt.train() on this gloo rank; rank `signalled_rank` gets SIGTERM in its `call`-th training
    step. Returns the exit status and whether SIGTERM's handler is the one before the run."""
    import signal
    import train_gpt as tg
    handler = signal.getsignal(signal.SIGTERM)
    if rank == signalled_rank:
        tg.forward_backward = on_call(tg.forward_backward, call, lambda: signal.raise_signal(signal.SIGTERM))
    try:
        tg.train(tg.parse_args(argv), tg.DistInfo(rank, world_size, rank, torch.device("cpu")))
        status = 0
    except SystemExit as e:
        status = e.code
    return status, signal.getsignal(signal.SIGTERM) == handler


def test_a_signal_to_one_rank_checkpoints_every_rank_at_one_step(two_rank_run, tmp_path):
    """SIGTERM reaches rank 1 alone, in step 2: its request is combined over ranks after that step and
    read a step later, so both ranks save step 4 (no --save_every 5 checkpoint is due) and exit with
    the shell's status for SIGTERM (143). Resumed from there, the run logs the uninterrupted run's losses
    to the bit."""
    tmp, log = two_rank_run
    dtype = re.search(r"^cpu dtype (bf16|fp32)", log, re.M).group(1)
    argv = ["--preset", "test", "--compile", "false", "--run_id", "signalled", "--log_dir", str(tmp_path / "logs"),
            "--checkpoint_dir", str(tmp_path / "ckpt"), "--save_every", "5", "--cpu_dtype", dtype]
    assert run_on_ranks(train_signalled, 2, argv, 1, 3, timeout=300) == [(143, True), (143, True)]
    ckpt = tmp_path / "ckpt" / "signalled" / "step_000004"
    assert os.listdir(tmp_path / "ckpt" / "signalled") == ["step_000004"]
    assert sorted(os.listdir(ckpt)) == ["model.pt", "rank000.pt", "rank001.pt"]
    stopped = open(tmp_path / "logs" / "signalled.txt").read()
    assert f"\nstopped by SIGTERM at step 4: --resume {ckpt} continues the run\n" in stopped
    assert "step:4/7 train_time" in stopped and "step:5/7" not in stopped
    resumed = train(tmp_path, "after_signal", 2, "--resume", str(ckpt), "--cpu_dtype", dtype)
    full, cont = val_losses(log), val_losses(resumed)
    assert val_losses(stopped) == {s: full[s] for s in (0, 3)}
    assert sorted(cont) == [6, 7] and [cont[s] for s in (6, 7)] == [full[s] for s in (6, 7)]


def test_bad_checkpoints_are_refused(two_rank_run, tmp_path):
    tmp, _ = two_rank_run
    ckpt = tmp / "ckpt" / "two" / "step_000003"
    out = train(tmp_path, "w1", 1, "--resume", str(ckpt), expect_fail=True)
    assert "cannot resume from" in out and "written by 2 ranks, this run has 1" in out
    out = train(tmp_path, "dim", 2, "--resume", str(ckpt), "--model_dim", "96", "--head_dim", "48", expect_fail=True)
    assert "--model_dim was 64, now 96" in out
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model.pt").write_bytes(b"garbage")
    out = train(tmp_path, "broken", 2, "--resume", str(broken), expect_fail=True)
    assert "unreadable checkpoint file" in out


def test_nan_stops_the_run(two_rank_run, tmp_path):
    tmp, _ = two_rank_run
    src = tmp / "ckpt" / "two" / "step_000003"
    bad = tmp_path / "nan_ckpt"
    shutil.copytree(src, bad)
    meta = torch.load(bad / "model.pt", weights_only=False)
    meta["model"]["mlp_bank"][0, 0, 0] = float("nan")
    torch.save(meta, bad / "model.pt")
    out = train(tmp_path, "nan", 2, "--resume", str(bad), "--val_loss_every", "0", expect_fail=True)
    assert "error: training loss is nan at step 3; stopping" in out
    log = open(tmp_path / "logs" / "nan.txt").read()
    assert "==== training ====" in log  # the log is kept


@pytest.mark.parametrize("flag,value,message", [
    ("--matrix_optimizer", "foo", "--matrix_optimizer 'foo' is not one of normuon, muon, adamw, anvil"),
    ("--model_dim", "65", "--model_dim (65) must equal --num_heads * --head_dim"),
    ("--stage_batch_tokens", "(502, 1000, 1500, 1500)", "does not split into 1 ranks x 4 accumulation steps"),
    ("--mudd_hidden", "four", "--mudd_hidden 'four' is not a valid int"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flag, value, message):
    r = warm_python.run([SCRIPT, "--preset", "test", "--compile", "false", "--log_dir", str(tmp_path), flag, value],
                        timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.txt"))  # nothing written for a run that never started


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU check runs it)")
def test_training_step_never_waits_for_the_gpu():
    """A whole training step (loader batches to the device, forward, backward, NorMuon and Adam) under
    torch.cuda.set_sync_debug_mode("error"): any .item(), blocking copy or host branch on a device
    value inside the step raises."""
    import train_gpt as tg
    args = tg.parse_args(["--preset", "test", "--compile", "false"])
    device = torch.device("cuda")
    model = tg.GPT(args).to(device)
    opt = tg.build_optimizer(args, model, device)
    loader = tg.DocumentLoader(args.train_files, args.ngram_rows)
    mtp, prefix = torch.zeros(len(args.stages[0].mtp_start), device=device), torch.zeros((), device=device)
    model.prefix_table.copy_(tg.build_prefix_table(tg.gpt2_encoding(), args.padded_vocab_size))
    slots = tg.check_batch_split(args, 1)

    def step(i):
        plan = tg.plan_step(args, i)
        batches = loader.next_step(plan.batch_tokens // slots, plan.max_doc_len, slots)
        return torch.stack(tg.train_step(model, opt, batches, plan, mtp, prefix, tg.grad_scale_for(args, 1), device))

    step(0), step(1)  # first calls: lazy initialisation, allocator growth
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(2), step(3)]  # an even (NorMuon only) and an odd (Adam too) step
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(x).all().item() for x in losses)


def test_prefix_table_is_built_after_the_clock_starts(tmp_path, monkeypatch):
    """Record #89's order: the compile warm-up trains with the prefix table filled (the graphs of
    the timed run), then the table is built again right after the clock starts, before the first timed
    step; every step's forward sees it and the schedule's prefix weight."""
    import train_gpt as tg
    events = []
    build = tg.build_prefix_table
    forward = tg.GPT.forward

    def recording_forward(self, *args, prefix_weight=None, **kwargs):
        if prefix_weight is not None:  # training
            events.append(("step", bool((self.prefix_table >= 0).any()), float(prefix_weight)))
        return forward(self, *args, prefix_weight=prefix_weight, **kwargs)

    monkeypatch.setattr(tg, "build_prefix_table", lambda *a: events.append("build") or build(*a))
    monkeypatch.setattr(tg, "cuda_synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(tg.GPT, "forward", recording_forward)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # the warm-up path without inductor
    # three steps of small batches (the CPU cross-entropy over 50,304 logits per token is most of a step)
    args = tg.parse_args(["--preset", "test", "--compile", "true", "--val_loss_every", "0", "--val_tokens", "512",
                          "--num_iterations", "3", "--extension_iterations", "0", "--micro_batches", "2",
                          "--stage_batch_tokens", "(256, 256, 256, 256)", "--log_dir", str(tmp_path / "logs")])
    tg.train(args, tg.setup_distributed(force_cpu=True))
    first, second = [i for i, e in enumerate(events) if e == "build"]
    micro = tg.grad_accum_steps(args, 1)
    warm, timed = events[first + 1:second - 1], [e for e in events[second + 1:] if e != "sync"]
    assert first == 0 and events[second - 1] == "sync"  # the clock starts, then the timed build
    assert warm == [("step", True, pytest.approx(tg.plan_step(args, s).prefix_weight))
                    for s in tg.warmup_steps(args) for _ in range(micro)]
    assert timed == [("step", True, pytest.approx(tg.plan_step(args, s).prefix_weight))
                     for s in range(tg.total_steps(args)) for _ in range(micro)]
    assert [e[2] for e in timed[::micro]] == [0.25, 0.25, 0.0]  # stages 1, 2 (its first step) and 3


def test_train_loss_is_on_the_validation_scale(tmp_path, capsys):
    """At initialisation the next-token loss of step 1 (progress line and log) is the validation loss
    at step 0, both about ln(50,304) = 10.83; the objective trained on (three weighted targets and the
    prefix term) is nearly twice that, and is shown apart."""
    import train_gpt as tg
    args = tg.parse_args(["--preset", "test", "--compile", "false", "--val_loss_every", "100", "--val_tokens", "512",
                          "--num_iterations", "3", "--extension_iterations", "0", "--micro_batches", "2",
                          "--stage_batch_tokens", "(256, 256, 256, 256)", "--log_dir", str(tmp_path / "logs"),
                          "--run_id", "scale"])
    tg.train(args, tg.setup_distributed(force_cpu=True))
    log = open(tmp_path / "logs" / "scale.txt").read()
    val0 = val_losses(log)[0]
    training = log.split("==== training ====\n", 1)[1].splitlines()
    steps = {int(m.group(1)): m for m in map(STEP_LINE.match, training) if m}
    assert sorted(steps) == [1, 2, 3]
    train1, objective1 = float(steps[1].group(5)), float(steps[1].group(6))
    assert 10.6 < val0 < 11.0 and abs(train1 - val0) < 0.2, (train1, val0)
    assert objective1 > 1.6 * train1, objective1
    shown = re.search(r"^step 1/3  train_loss ([0-9.]+)  objective ([0-9.]+)  [0-9,]+ tok/s  eta \d+s$",
                      capsys.readouterr().out, re.M)
    assert shown and (float(shown.group(1)), float(shown.group(2))) == (train1, objective1)


def test_prune_checkpoints_keeps_the_newest_by_step_number(tmp_path):
    """--keep_checkpoints: the newest N step_N directories by step number (step_1000000 is newer than
    step_999999, though it sorts first as text); an unfinished .tmp directory and other files stay."""
    sys.path.insert(0, ROOT)
    import train_gpt as tg
    for name in ("step_000002", "step_000010", "step_999999", "step_1000000", "step_1000001", "step_1000002.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.pt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("kept")
    tg.prune_checkpoints(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step_1000000", "step_1000001", "step_1000002.tmp"]


KEPT_PROBE = """
import os, sys
sys.path.insert(0, {root!r})
import torch
import train_gpt as T
def resident():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
kept = T.keep_freed_memory() if {call} else None
before = resident()
block = torch.ones(64 << 20)  # 256 MiB, above glibc's default mmap threshold
del block
print(kept, (resident() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm; mallopt is glibc's")
def test_keep_freed_memory_keeps_a_freed_block_in_the_heap():
    """Resident memory after freeing a 256 MiB tensor, read from /proc: glibc's default hands the block
    back (near 0 MiB stays resident); after keep_freed_memory it stays in the heap (256 MiB); with the
    user's MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_ set, the call leaves them be (False) and they keep it."""
    import subprocess
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def probe(call, env):
        out = subprocess.run([sys.executable, "-c", KEPT_PROBE.format(root=ROOT, call=call)], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()
        return out[0], int(out[1])

    kept, mib = probe(False, clean)
    assert kept == "None" and mib < 64
    kept, mib = probe(True, clean)
    assert kept == "True" and mib >= 250
    kept, mib = probe(True, {**clean, "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)})
    assert kept == "False" and mib >= 250
