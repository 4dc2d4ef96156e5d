"""The GPU check's machinery on a CPU: the coverage scan (every CUDA path has a check), the runner
(pass, fail, time cap, skip), the report files, the generated shards, the projections, and the
one-line refusals of `./run.sh gpu-check` without a GPU. The checks themselves need a CUDA GPU."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import gpu_check as G  # noqa: E402
import train_gpt as T  # noqa: E402


# ---- coverage ------------------------------------------------------------------------------------

def test_every_cuda_path_has_a_check():
    paths = G.cuda_paths(G.repo_sources())
    kernels = {p for p in paths if p.startswith("kernel:")}
    ops = {p for p in paths if p.startswith("op:")}
    # counted independently: the decorators as text
    tk = open(os.path.join(ROOT, "triton_kernels.py")).read()
    tg = open(os.path.join(ROOT, "train_gpt.py")).read()
    assert len(kernels) == tk.count("\n@triton.jit\n") == 9
    assert len(ops) == tk.count("@torch.library.custom_op(") + tg.count("@torch.library.custom_op(") == 12
    assert {"cuda:train_gpt.py:GPT._attend", "cuda:train_gpt.py:_native_fp8", "cuda:train_gpt.py:setup_distributed",
            "cuda:triton_kernels.py:_num_programs", "cuda:train_gpt.py:Batch.to"} <= paths
    uncovered, stale = G.coverage()
    assert uncovered == set() and stale == set()


def _with(sources, name, extra):
    return {**sources, name: sources[name] + extra}


def test_a_new_cuda_path_without_a_check_fails_coverage():
    src = G.repo_sources()
    cases = {
        "\n\ndef new_path(x):\n    if x.is_cuda:\n        return x\n": "cuda:train_gpt.py:new_path",
        "\n\nclass A:\n    def f(self, d):\n        return d.type != 'cpu'\n": "cuda:train_gpt.py:A.f",
        "\n\ndef g():\n    return torch.cuda.device_count()\n": "cuda:train_gpt.py:g",
        "\n\ndef h(q):\n    return flex_attention(q, q, q)\n": "cuda:train_gpt.py:h",
        "\n\n@triton.jit\ndef _new_kernel(x_ptr):\n    pass\n": "kernel:_new_kernel",
        "\n\n@torch.library.custom_op('speedrun::new_op', mutates_args=())\ndef new_op(x: Tensor) -> Tensor:\n"
        "    return x\n": "op:speedrun::new_op",
    }
    for extra, want in cases.items():
        uncovered, stale = G.coverage(sources=_with(src, "train_gpt.py", extra))
        assert uncovered == {want} and stale == set(), (extra, uncovered)


def test_a_removed_cuda_path_shows_as_stale():
    src = G.repo_sources()
    renamed = src["triton_kernels.py"].replace("def _ce_config(", "def _ce_configuration(")
    uncovered, stale = G.coverage(sources={**src, "triton_kernels.py": renamed})
    assert uncovered == {"cuda:triton_kernels.py:_ce_configuration"}
    assert stale == {"cuda:triton_kernels.py:_ce_config"}


def test_comments_docstrings_and_cpu_only_code_are_no_cuda_paths():
    text = ('def f(x):\n    """Mentions torch.cuda.synchronize and x.is_cuda in prose."""\n'
            '    # if x.is_cuda: a comment\n    return torch.device("cpu")\n')
    assert G.cuda_paths({"m.py": text}) == set()
    assert G.cuda_paths({"m.py": text + "y = torch.cuda.is_available()\n"}) == {"cuda:m.py:<module>"}


def test_every_check_has_its_function_and_the_run_fits_in_eight_minutes():
    names = [c.name for c in G.CHECKS]
    assert len(names) == len(set(names)) == 13
    for c in G.CHECKS:
        assert callable(G.check_function(c)) and c.cap_s > 0 and c.what
    # no check starts after TOTAL_LIMIT_S and none runs past it: 30 s are left for start-up and the report
    assert G.TOTAL_LIMIT_S + 30 <= 8 * 60


# ---- the runner ------------------------------------------------------------------------------------

FAKE = {  # check name -> what its process does
    "good": "R.set(x=1.5, summary='all fine')",
    "bad": "import atexit; atexit.register(print, 'a note printed at exit'); R.set(x=2); "
           "raise ValueError('relu2_mlp dx bf16: relative error 3.1e-02')",
    # a process of its own (as torchrun's workers): the cap must end it too
    "slow": "import subprocess; p = subprocess.Popen(['sleep', '30']); R.set(stages=[1], child=p.pid); p.wait()",
    "later": "R.set(summary='never')",
}


def fake_command(check, result_path):
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); import gpu_check as G; "
            f"R = G.Result({result_path!r}); " + FAKE[check.name])
    return [sys.executable, "-c", code]


def alive(pid: int) -> bool:
    """True while pid runs (a zombie waiting for its parent counts as ended)."""
    import time
    for _ in range(20):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True


def test_runner_reports_pass_fail_cap_and_skip(tmp_path):
    checks = [G.Check("good", 20, "-"), G.Check("bad", 20, "-"), G.Check("slow", 2.0, "-"), G.Check("later", 20, "-")]
    lines = []
    # the limit leaves time for three processes but not the fourth: "later" is never started
    import time
    t = time.monotonic()
    results = G.run_checks(checks, command=fake_command, total_limit_s=7.0, log=lines.append, log_dir=str(tmp_path))
    took = time.monotonic() - t
    by = {r["name"]: r for r in results}
    assert [r["name"] for r in results] == ["good", "bad", "slow", "later"]
    assert by["good"]["status"] == "pass" and by["good"]["summary"] == "all fine" and by["good"]["data"] == {"x": 1.5}
    assert by["bad"]["status"] == "fail" and by["bad"]["data"] == {"x": 2}
    assert by["bad"]["error"] == "ValueError: relu2_mlp dx bf16: relative error 3.1e-02"
    assert by["slow"]["status"] == "timeout" and by["slow"]["error"] == "stopped at its 2 s cap"
    child = by["slow"]["data"].pop("child")
    assert by["slow"]["data"] == {"stages": [1]}  # what it measured before the cap
    assert not alive(child)
    assert 2.0 <= by["slow"]["seconds"] < 6
    assert by["later"]["status"] == "skipped" and "limit of the whole check" in by["later"]["error"]
    assert took < 7.0 + 5 and len(lines) == 4
    assert "relative error 3.1e-02" in (tmp_path / "bad.log").read_text()


def test_result_is_on_disk_after_every_set(tmp_path):
    path = tmp_path / "r.json"
    r = G.Result(str(path))
    r.set(a=1)
    assert json.loads(path.read_text()) == {"a": 1}
    r.set(b=[2.5])
    assert json.loads(path.read_text()) == {"a": 1, "b": [2.5]}
    assert os.listdir(tmp_path) == ["r.json"]


# ---- report ------------------------------------------------------------------------------------------

INFO = dict(date="2026-11-24", gpu="NVIDIA H100 80GB HBM3", capability="9.0", sms=132, memory_gib=79.1, gpu_count=1,
            driver="580.159.04", cuda="13.0", torch="2.11.0+cu130", triton="3.6.0", python="3.12.3", commit="abc1234")

STAGES = [dict(stage="stage 1", steps=423, batch=131072, warmup_s=80.0, ms=400.0, tokens_per_s=327680.0,
               flops_per_token=1.0e9, mfu=0.33),
          dict(stage="stage 2", steps=424, batch=262144, warmup_s=40.0, ms=800.0, tokens_per_s=327680.0,
               flops_per_token=1.1e9, mfu=None)]


def test_projection_arithmetic():
    p = G.project(STAGES)
    assert p["steps"] == 847
    assert p["this_gpu_s"] == pytest.approx((423 * 400 + 424 * 800) / 1000)  # 508.4 s
    assert p["8_gpus_s"] == pytest.approx(508.4 / 8)
    assert G.project(STAGES, gpus=4)["4_gpus_s"] == pytest.approx(127.1)
    # MFU: FLOPs per token x tokens/s over the peak
    assert G.mfu(1.0e9, 327680.0, 989.4) == pytest.approx(327680e9 / 989.4e12)
    assert G.mfu(1.0e9, 327680.0, None) is None


def report(tmp_path):
    timing = dict(world_size=1, accumulation=8, warmup=2, steps=4, peak_tflops=989.4, stages=STAGES, stages_total=4,
                  projection=G.project(STAGES), peak_allocated_gib=41.5, peak_reserved_gib=52.25)
    checks = [dict(name="triton-mlp", status="pass", seconds=12.34, summary="worst relative error bf16 3.0e-03", error="", data={}),
              dict(name="fp8-up", status="fail", seconds=3.0, summary="", error="AssertionError: post | 2% differ", data={}),
              dict(name="speedrun-timing", status="timeout", seconds=300.0, summary="2 of 4 stages", error="stopped at its 300 s cap",
                   data=timing)]
    return dict(info=INFO, checks=checks, total_s=315.3)


def test_report_files_name_the_machine_and_hold_the_figures(tmp_path):
    md, js = G.write_report(report(tmp_path), str(tmp_path))
    assert os.path.basename(md) == "2026-11-24_nvidia-h100-80gb-hbm3.md"
    assert os.path.basename(js) == "2026-11-24_nvidia-h100-80gb-hbm3.json"
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(js), os.path.basename(md)]  # no temporary left
    assert json.loads(open(js).read()) == report(tmp_path)
    text = open(md).read()
    for line in ("# GPU check, 2026-11-24: NVIDIA H100 80GB HBM3",
                 "- GPU: NVIDIA H100 80GB HBM3 (compute capability 9.0, 132 SMs, 79.1 GiB), 1 GPU(s) visible",
                 "- driver 580.159.04, CUDA 13.0",
                 "- torch 2.11.0+cu130, triton 3.6.0, Python 3.12.3",
                 "- result: 1 of 3 checks passed in 315 s",
                 "| triton-mlp | pass | 12.3 | worst relative error bf16 3.0e-03 |",
                 "| fp8-up | fail | 3.0 | AssertionError: post / 2% differ |",
                 "| stage 1 | 423 | 131,072 | 80.0 | 400.0 | 327,680 | 1.000 | 33.0% |",
                 "| stage 2 | 424 | 262,144 | 40.0 | 800.0 | 327,680 | 1.100 | - |",
                 "- stages measured: 2 of 4 (projection covers those only)",
                 "- compile and warm-up: 120 s",
                 "- projected training time, 847 steps: 508 s on this GPU, 63.5 s on 8 such GPUs (no communication counted)",
                 "- peak memory: 41.50 GiB allocated, 52.25 GiB reserved"):
        assert line + "\n" in text, line


def test_report_writing_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.md"
    G.atomic_write(str(path), "old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(G.os, "replace", broken_replace)
    with pytest.raises(OSError):
        G.atomic_write(str(path), "new, half-written\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["r.md"]


# ---- generated shards ----------------------------------------------------------------------------

def test_generated_shards_are_bos_delimited_random_documents(tmp_path):
    paths = G.make_shards(str(tmp_path), num_shards=2, tokens_per_shard=50_000, mean_doc_len=100, seed=3)
    assert [os.path.basename(p) for p in paths] == ["fineweb_train_000000.bin", "fineweb_train_000001.bin"]
    a, b = (T.read_shard(p).numpy().astype(np.int64) for p in paths)
    assert len(a) == len(b) == 50_000 and not np.array_equal(a, b)
    for tokens in (a, b):
        starts = np.flatnonzero(tokens == T.BOS_ID)
        assert starts[0] == 0 and tokens.max() == T.BOS_ID and tokens.min() >= 0
        lengths = np.diff(np.append(starts, len(tokens)))[:-1]
        assert lengths.min() >= 2 and 80 < lengths.mean() < 120  # geometric, mean 100
        body = tokens[tokens != T.BOS_ID]
        assert len(np.unique(body)) > 20_000  # random ids over the whole vocabulary
    again = G.make_shards(str(tmp_path / "again"), num_shards=2, tokens_per_shard=50_000, mean_doc_len=100, seed=3)
    assert np.array_equal(T.read_shard(again[0]).numpy(), a)  # a seed makes the same shards
    mtime = os.path.getmtime(paths[0])
    G.make_shards(str(tmp_path), num_shards=2, tokens_per_shard=50_000, mean_doc_len=100, seed=3)
    assert os.path.getmtime(paths[0]) == mtime  # kept, not rewritten
    loader = T.DocumentLoader(os.path.join(str(tmp_path), "fineweb_train_*.bin"), 4_001)
    (batch,) = loader.next_step(2048, 896, 1)
    assert batch.inputs[0] == T.BOS_ID and batch.inputs.numel() == 2048
    assert (batch.inputs[batch.cu_seqlens[1:][batch.cu_seqlens[1:] < 2048].long()] == T.BOS_ID).all()


def test_rel_err_catches_nan():
    import torch
    want = torch.tensor([3.0, 4.0])
    assert G.rel_err(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1)
    assert G.rel_err(torch.tensor([3.0, float("nan")]), want) == float("inf")


# ---- the command line ------------------------------------------------------------------------------

def run_sh(*args, env=None):
    return subprocess.run([os.path.join(ROOT, "run.sh"), "gpu-check", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})


def test_dry_run_lists_every_check_on_any_python():
    r = run_sh("--dry-run", env={"PYTHON": "python3"})  # the list needs no torch
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines() if " cap " in line]
    assert listed == [c.name for c in G.CHECKS]
    assert "not covered by any check: none" in r.stdout


def test_without_a_gpu_it_is_one_line(tmp_path):
    r = run_sh("--out", str(tmp_path), env={"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu-check: no CUDA GPU visible to torch "), r.stderr
    assert os.listdir(tmp_path) == []  # no report from a run that never started
    r = run_sh("--only", "triton-mlp,nope", env={"PYTHON": sys.executable})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown check(s) nope" in r.stderr


def test_an_interpreter_without_torch_is_refused_in_one_line(tmp_path):
    bare = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    r = run_sh(env={"PYTHON": str(bare / "bin" / "python")})
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("run.sh: gpu-check: ") and "lacks torch>=2.11, triton>=3.6, numpy" in r.stderr
