"""`python train_gpt.py --dry_run`: the plan of a run without training, against record #89's published
schedule and parameter shapes and against byte counts summed here from a model built on the CPU."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train_gpt as T  # noqa: E402
import warm_python  # noqa: E402


@pytest.fixture(scope="module")
def speedrun():
    return T.dry_run_report(T.parse_args([]))


def test_the_speedrun_plan_is_record_89s(speedrun):
    """#89: stage ends 0, 423, 847, 1270, 1285; the full softmax throughout; its banks and tables."""
    out = speedrun
    assert out.splitlines()[0] == "steps: 1285; stage ends: 0, 423, 847, 1270, 1285"
    assert "training softmax classes: all 50304 from step 0" in out
    shapes = {"lm_head": (768, 50304), "embed": (50304, 768), "value_embeds": (5, 50304, 768),
              "qk_bank": (60, 256, 768), "vo_bank": (20, 768, 768), "mlp_bank": (22, 3072, 768),
              "bigram_embed": (377280, 768)}
    for label, shape in shapes.items():
        assert re.search(rf"^  {label} +\({', '.join(map(str, shape))}\) +{torch.Size(shape).numel():,} bfloat16$",
                         out, re.M), label


def test_memory_per_gpu_is_the_tensors_bytes():
    """The test preset at 2 GPUs: weights and buffers, gradients and rank 0's optimizer state, each summed
    here over a real model and optimizer (CPU tensors) of that world size."""
    args = T.parse_args(["--preset", "test", "--sampled_softmax", "((0, 1024), (0.5, 0))", "--fp8", "false"])
    out = T.dry_run_report(args)
    assert "training softmax classes: 1024 from step 0, all 50304 from step 3" in out
    model = T.GPT(args, 2)
    opt = T.build_optimizer(args, model, torch.device("cpu"), comm=T.SimulatedComm(2))
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    row = re.search(r"^ +2 +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$", out, re.M)
    want = [weights, grads, state, weights + grads + state]
    assert [float(x) for x in row.groups()] == [round(b / 2**30, 2) for b in want]
    assert state > 0 and grads > 0


def test_the_command_line_prints_and_exits_without_shards(tmp_path):
    r = warm_python.run([os.path.join(ROOT, "train_gpt.py"), "--preset", "test", "--dry_run",
                         "--train_files", str(tmp_path / "none_*.bin")], timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("steps: 7; stage ends: ") and "GiB per GPU" in r.stdout
    assert not os.listdir(tmp_path)  # no log, no checkpoint
    with pytest.raises(SystemExit, match=r"^error: --num_iterations -3 must be >= 1$"):  # a bad flag: one line
        T.main(["--dry_run", "--num_iterations", "-3"])


def test_the_speedrun_optimizer_state_shrinks_with_the_gpus(speedrun):
    rows = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^ +(\d) +[\d.]+ +[\d.]+ +([\d.]+) ", speedrun, re.M)}
    assert sorted(rows) == [1, 2, 4, 8]
    assert rows[1] == pytest.approx(8 * rows[8], rel=0.05)  # sharded state: 1/N of it a GPU (banks padded for 8)
