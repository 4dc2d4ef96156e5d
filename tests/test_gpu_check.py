"""The GPU check's machinery on a CPU: the coverage scan (every CUDA path has a check), the runner
(pass, fail, time cap, skip), the report files, the generated shards, the projections, and the
one-line refusals of `./run.sh gpu-check` without a GPU. The checks themselves need a CUDA GPU."""
import ast
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import bench_kernels  # noqa: E402,F401  (the loss kernel's limits)
import gpu_check as G  # noqa: E402  (the checks)
import gpu_check_coverage as C  # noqa: E402  (the coverage scan)
import gpu_check_runner as R  # noqa: E402  (the runner and the report writer)
import train_gpt as T  # noqa: E402


# ---- coverage ------------------------------------------------------------------------------------

def test_every_cuda_path_has_a_check():
    paths = C.cuda_paths(C.repo_sources())
    kernels = {p for p in paths if p.startswith("kernel:")}
    ops = {p for p in paths if p.startswith("op:")}
    # counted independently: the decorators as text
    tk = open(os.path.join(ROOT, "triton_kernels.py")).read()
    tg = open(os.path.join(ROOT, "train_gpt.py")).read()
    assert len(kernels) == tk.count("\n@triton.jit\n") == 10
    assert len(ops) == tk.count("@torch.library.custom_op(") + tg.count("@torch.library.custom_op(") == 12
    assert {"cuda:train_gpt.py:flex_attend", "cuda:train_gpt.py:fp8_matmul_grads", "cuda:train_gpt.py:setup_distributed",
            "cuda:triton_kernels.py:relu2_fp8_up_partial_count", "cuda:train_gpt.py:Batch.to", "op:speedrun::fp8_head_loss",
            "cuda:train_gpt.py:attention_kernels", "cuda:triton_kernels.py:softcapped_ce_mtp_e5m2"} <= paths
    uncovered, stale = C.coverage(G.CHECKS)
    assert uncovered == set() and stale == set()
    # every private helper's CUDA branch counts for a public function, op or kernel reaching it, so the
    # checks name no private helper (a rename of one changes no tag)
    assert C.private_paths(paths) == set()
    assert not [t for c in G.CHECKS for t in c.covers if t.startswith("cuda:") and C.is_private(t.rsplit(":", 1)[1])]


def _with(sources, name, extra):
    return {**sources, name: sources[name] + extra}


def test_a_new_cuda_path_without_a_check_fails_coverage():
    src = C.repo_sources()
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
        uncovered, stale = C.coverage(G.CHECKS, sources=_with(src, "train_gpt.py", extra))
        assert uncovered == {want} and stale == set(), (extra, uncovered)


def test_a_removed_cuda_path_shows_as_stale():
    src = C.repo_sources()
    renamed = src["triton_kernels.py"].replace("def relu2_fp8_up_partial_count(", "def relu2_fp8_up_partials_count(")
    uncovered, stale = C.coverage(G.CHECKS, sources={**src, "triton_kernels.py": renamed})
    assert uncovered == {"cuda:triton_kernels.py:relu2_fp8_up_partials_count"}
    assert stale == {"cuda:triton_kernels.py:relu2_fp8_up_partial_count"}


def covering(sources) -> dict[str, list[str]]:
    """Each CUDA path of `sources` and the checks that cover it."""
    return {p: [c.name for c in G.CHECKS if p in c.covers] for p in C.cuda_paths(sources)}


def test_renaming_private_helpers_changes_no_tag():
    """Every private helper of the two files that holds a CUDA branch (_transpose_args, _ce_config,
    ShardExchange._plan_sparse, ...) renamed at once, definitions and uses: the same CUDA paths, each
    covered by the same checks, and every path still covered."""
    import re
    src = C.repo_sources()
    renamed, helpers = {}, []
    for name, text in src.items():
        tree = ast.parse(text)
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef) and C.is_private(f.name) and any(
                    C.is_cuda_marker(n) for stmt in f.body for n in ast.walk(stmt)):
                helpers.append(f.name)
                text = re.sub(rf"\b{f.name}\b", f.name + "_renamed", text)
        renamed[name] = text
    assert len(helpers) >= 15 and {"_transpose_args", "_ce_config", "_plan_sparse", "_native_fp8"} <= set(helpers)
    assert all(h + "_renamed" in renamed["train_gpt.py"] + renamed["triton_kernels.py"] for h in helpers)
    assert covering(renamed) == covering(src)
    assert C.coverage(G.CHECKS, sources=renamed) == (set(), set())


def test_a_private_helpers_cuda_branch_counts_for_what_reaches_it():
    text = ("def _device_ok(x):\n    return x.is_cuda\n\n"          # reached through a private chain
            "def _twice(x):\n    return _device_ok(x)\n\n"
            "def public(x):\n    return _twice(x)\n\n"
            "handed_on = [_twice]\n\n"                              # a reference at the top level reaches nothing
            "class Store:\n    def put(self, x):\n        return self._copy(x)\n\n"
            "    def _copy(self, x):\n        return x.to('cuda')\n\n"
            "@torch.library.custom_op('speedrun::op', mutates_args=())\n"
            "def _op_impl(x: Tensor) -> Tensor:\n    return _device_ok(x)\n\n"
            "@_op_impl.register_kernel('cpu')\ndef _op_on_cpu(x):\n    return _twice(x)\n\n"  # the op's
            "def _nobody(x):\n    return torch.cuda.current_stream()\n")
    paths = C.cuda_paths({"m.py": text})
    assert paths == {"cuda:m.py:public", "cuda:m.py:Store.put", "op:speedrun::op", "cuda:m.py:_nobody"}
    assert C.private_paths(paths) == {"cuda:m.py:_nobody"}  # reached by no function: named after itself


def test_comments_docstrings_and_cpu_only_code_are_no_cuda_paths():
    text = ('def f(x):\n    """Mentions torch.cuda.synchronize and x.is_cuda in prose."""\n'
            '    # if x.is_cuda: a comment\n    return torch.device("cpu")\n')
    assert C.cuda_paths({"m.py": text}) == set()
    assert C.cuda_paths({"m.py": text + "y = torch.cuda.is_available()\n"}) == {"cuda:m.py:<module>"}


def test_every_check_has_its_function_and_each_group_fits_in_nine_minutes():
    names = [c.name for c in G.CHECKS]
    assert len(names) == len(set(names)) == 22
    for c in G.CHECKS:
        assert callable(G.check_function(c)) and c.cap_s > 0 and c.what and c.group in R.GROUPS
    for group in R.GROUPS:
        caps = [c.cap_s for c in G.CHECKS if c.group == group]
        assert caps, group
        # no check of a group starts after GROUP_LIMIT_S and none runs past it: a group ends within
        # 9 minutes, 40 s of which are left for start-up and the report (a GPU lease is 10 minutes a call)
        assert min(sum(caps), R.GROUP_LIMIT_S) + 40 <= 9 * 60, group
    # the checks' order follows the groups' (a run of every group reports them in this order)
    assert [c.group for c in G.CHECKS] == sorted((c.group for c in G.CHECKS), key=R.GROUPS.index)


def test_val_losses_are_read_from_record_lines_only():
    """The run log starts with the source code, whose format strings look like record lines."""
    log = ('==== train_gpt.py ====\n    log.write(f"step:{step}/{total} val_loss:{val_loss:.4f} train_time:{t}ms")\n'
           "step:0/7 val_loss:10.8240 train_time:0ms step_avg:0.00ms\nstep:1/7 train_time:5ms step_avg:5.00ms\n"
           "step:3/7 val_loss:10.7164 train_time:9ms step_avg:3.00ms\nstep:7/7 val_loss:nan train_time:20ms\n")
    vals = G.parse_val_losses(log)
    assert vals[:2] == [10.824, 10.7164] and len(vals) == 3 and vals[2] != vals[2]


def test_check_processes_share_the_repositorys_compile_caches(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    env = R.check_env()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(ROOT, ".cache", "inductor")
    assert env["TRITON_CACHE_DIR"] == "/elsewhere"  # the caller's own choice is kept


def test_last_traceback_is_whole_and_shortened():
    out = ("warming up\nTraceback (most recent call last):\n  File \"old.py\", line 1\nValueError: first\n"
           f"Traceback (most recent call last):\n  File \"{ROOT}/train_gpt.py\", line 10, in f\n"
           '  File "/usr/lib/python3.12/site-packages/torch/_ops.py", line 3, in g\n'
           "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED\nexit note\n")
    tb = R.last_traceback(out)
    assert tb.startswith("Traceback (most recent call last):\n  File \"train_gpt.py\", line 10")
    assert 'File "site-packages/torch/_ops.py"' in tb and tb.endswith("CUBLAS_STATUS_NOT_SUPPORTED\nexit note")
    assert "first" not in tb
    long = "Traceback (most recent call last):\n" + "x" * 50_000 + "\nValueError: end"
    cut = R.last_traceback(long)
    assert len(cut) < R.TRACEBACK_CHARS + 100 and cut.endswith("ValueError: end") and "characters left out" in cut


# ---- the runner ------------------------------------------------------------------------------------

FAKE = {  # check name -> what its process does
    "good": "R.set(x=1.5, summary='all fine')",
    "bad": "import atexit; atexit.register(print, 'a note printed at exit'); R.set(x=2); "
           "raise ValueError('relu2_mlp dx bf16: relative error 3.1e-02')",
    # a process of its own (as torchrun's workers): the cap must end it too
    "slow": "import subprocess; p = subprocess.Popen(['sleep', '30']); R.set(stages=[1], child=p.pid); p.wait()",
    "later": "R.set(summary='never')",
}


def fake_command(check, result_path, fake=FAKE):
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); import gpu_check_runner as runner; "
            f"R = runner.Result({result_path!r}); " + fake[check.name])
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
    checks = [R.Check("good", 20, "-"), R.Check("bad", 20, "-"), R.Check("slow", 2.0, "-"), R.Check("later", 20, "-")]
    lines = []
    # the limit leaves time for three processes but not the fourth: "later" is never started
    import time
    t = time.monotonic()
    results = R.run_checks(checks, command=fake_command, total_limit_s=7.0, log=lines.append, log_dir=str(tmp_path))
    took = time.monotonic() - t
    by = {r["name"]: r for r in results}
    assert [r["name"] for r in results] == ["good", "bad", "slow", "later"]
    assert by["good"]["status"] == "pass" and by["good"]["summary"] == "all fine" and by["good"]["data"] == {"x": 1.5}
    assert by["bad"]["status"] == "fail" and by["bad"]["data"] == {"x": 2}
    assert by["bad"]["error"] == "ValueError: relu2_mlp dx bf16: relative error 3.1e-02"
    assert by["bad"]["traceback"].startswith("Traceback (most recent call last):")  # the whole of it, for the report
    assert by["bad"]["traceback"].rstrip().endswith("a note printed at exit")
    assert by["slow"]["status"] == "timeout" and by["slow"]["error"] == "stopped at its 2 s cap"
    child = by["slow"]["data"].pop("child")
    assert by["slow"]["data"] == {"stages": [1]}  # what it measured before the cap
    assert not alive(child)
    assert 2.0 <= by["slow"]["seconds"] < 6
    assert by["later"]["status"] == "skipped" and "limit of its group" in by["later"]["error"]
    assert took < 7.0 + 5 and len(lines) == 4
    assert "relative error 3.1e-02" in (tmp_path / "bad.log").read_text()


def test_a_checks_process_runs_its_function_from_the_entry_point(tmp_path, monkeypatch):
    """The runner starts each check as `python tests/gpu_check.py --run-one NAME`: the entry point finds
    the check in its table and runs its function (here on no GPU, so the function fails inside)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    check = next(c for c in G.CHECKS if c.name == "triton-transpose")
    assert R.default_command(check, "r.json")[1:] == [G.__file__, "--run-one", "triton-transpose", "--result", "r.json"]
    (r,) = R.run_checks([check], total_limit_s=120, log=lambda line: None, log_dir=str(tmp_path))
    assert r["status"] == "fail" and 'File "tests/gpu_check.py"' in r["traceback"], r
    assert "in check_triton_transpose" in r["traceback"]


def test_result_is_on_disk_after_every_set(tmp_path):
    path = tmp_path / "r.json"
    r = R.Result(str(path))
    r.set(a=1)
    assert json.loads(path.read_text()) == {"a": 1}
    r.set(b=[2.5])
    assert json.loads(path.read_text()) == {"a": 1, "b": [2.5]}
    assert os.listdir(tmp_path) == ["r.json"]


def test_lanes_run_side_by_side_under_one_budget(tmp_path):
    """run_lanes: each lane's checks one after another, the lanes at the same time, one time limit for all."""
    import time
    fake = dict(FAKE, nap1="import time; time.sleep(2); R.set(summary='1')", nap2="import time; time.sleep(2)",
                nap3="import time; time.sleep(2)")
    t = time.monotonic()
    results = R.run_lanes([[R.Check("nap1", 20, "-")], [R.Check("nap2", 20, "-"), R.Check("nap3", 20, "-")]],
                          command=lambda c, p: fake_command(c, p, fake), total_limit_s=30, log=lambda line: None,
                          log_dir=str(tmp_path))
    took = time.monotonic() - t
    assert sorted(r["name"] for r in results) == ["nap1", "nap2", "nap3"]
    assert all(r["status"] == "pass" for r in results)
    assert 4 <= took < 5.9  # the longer lane's 2 x 2 s, not the 6 s of all three one after another


def test_a_budget_cut_run_still_writes_its_report(tmp_path):
    """A lease command whose budget ends while a check runs: that check is stopped at what is left (its
    figures so far kept), a check after it in its lane is not started, the other lane's results stand, and
    the report holds all of them (written after every check)."""
    lanes = [[R.Check("slow", 60, "-"), R.Check("later", 20, "-")], [R.Check("good", 20, "-"), R.Check("bad", 20, "-")]]
    info = dict(INFO, date="2026-12-24")
    results = R.run_and_report([(8.0, lanes)], info, str(tmp_path), order=["good", "bad", "slow", "later"],
                               command=fake_command, log=lambda line: None, log_dir=str(tmp_path))
    by = {r["name"]: r for r in results}
    assert by["slow"]["status"] == "timeout" and by["slow"]["error"].startswith("stopped at its ")
    assert by["later"]["status"] == "skipped" and by["good"]["status"] == "pass" and by["bad"]["status"] == "fail"
    md, js = R.report_paths(info, str(tmp_path))
    report = json.loads(open(js).read())
    assert [r["name"] for r in report["checks"]] == ["good", "bad", "slow", "later"]
    assert {r["name"]: r["status"] for r in report["checks"]} == {"good": "pass", "bad": "fail", "slow": "timeout",
                                                                  "later": "skipped"}
    slow = next(r for r in report["checks"] if r["name"] == "slow")
    assert slow["data"]["stages"] == [1] and 7 < slow["seconds"] < 12  # what it measured before the cut
    assert "| slow | kernels | timeout |" in open(md).read()


def test_a_stopped_run_writes_its_report(tmp_path):
    """SIGTERM (the lease ending, `timeout`) while a check runs: the check's process group is killed, the
    check is reported as stopped with what it measured, nothing starts after it, and the report is written."""
    import signal
    import time
    tests = os.path.join(ROOT, "tests")
    child = f"""
import json, signal, sys
sys.path.insert(0, {tests!r})
import gpu_check_runner as R

def command(check, result_path):
    body = "import time; R.set(stages=[1]); print('started', flush=True); time.sleep(60)" if check.name == "slow" else "R.set(x=1)"
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); import gpu_check_runner as runner; "
            f"R = runner.Result({{result_path!r}}); " + body]

stopper = R.Stopper()
signal.signal(signal.SIGTERM, stopper.handle)
info = json.loads({json.dumps(json.dumps(dict(INFO, date="2026-12-25")))})
R.run_and_report([(120, [[R.Check("quick", 60, "-"), R.Check("slow", 60, "-"), R.Check("never", 60, "-")]])], info,
                 {str(tmp_path)!r}, order=["quick", "slow", "never"], command=command, log=print, log_dir={str(tmp_path)!r},
                 stopper=stopper)
print("reported", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "slow.log"
    for _ in range(300):  # until the slow check is running
        if log.exists() and "started" in log.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "reported" in out, out
    md, js = R.report_paths(dict(INFO, date="2026-12-25"), str(tmp_path))
    by = {r["name"]: r for r in json.loads(open(js).read())["checks"]}
    assert by["quick"]["status"] == "pass"
    assert by["slow"]["status"] == "timeout" and by["slow"]["error"].startswith("stopped by SIGTERM after ")
    assert by["slow"]["data"] == {"stages": [1]} and by["slow"]["seconds"] < 30
    assert by["never"]["status"] == "skipped" and "stopped by SIGTERM" in by["never"]["error"]


def test_a_check_hands_over_the_traceback_of_what_it_ran(tmp_path):
    """A check that ran a program of its own (train_gpt.py under torchrun) puts that program's traceback in
    its data: the report shows it first, then the check's own."""
    fake = dict(FAKE, handing="R.set(traceback='Traceback (most recent call last):\\n  File \"train_gpt.py\", line 9\\n"
                              "RuntimeError: CUDA error: an illegal memory access'); raise AssertionError('the run failed')")
    (r,) = R.run_checks([R.Check("handing", 20, "-")], command=lambda c, p: fake_command(c, p, fake), total_limit_s=20,
                        log=lambda line: None, log_dir=str(tmp_path))
    assert r["status"] == "fail" and r["error"] == "AssertionError: the run failed"
    assert r["traceback"].startswith("Traceback (most recent call last):\n  File \"train_gpt.py\", line 9\n"
                                     "RuntimeError: CUDA error: an illegal memory access\n\nTraceback")
    assert r["traceback"].rstrip().endswith("AssertionError: the run failed") and "traceback" not in r["data"]


def plan_output():
    r = run_sh("--plan", env={"PYTHON": "python3"})  # the plan needs no torch
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_the_plan_is_two_commands_of_8_and_3_minutes_that_start_with_the_default_speedrun():
    """`./run.sh gpu-check --plan` (no GPU, no torch): two commands, the first at most 480 s, the second at
    most 180 s, 660 s in all; every lane's caps add up to its command's budget at most, and its printed
    sums are the table's caps; the first check of the first command is speedrun-default; every planned
    check exists; the commands run with --lease N."""
    import re
    text = plan_output()
    commands = re.findall(r"^command (\d) of (\d): --budget (\d+) s", text, re.M)
    assert [(int(i), int(n)) for i, n, _ in commands] == [(1, 2), (2, 2)]
    budgets = [int(b) for _, _, b in commands]
    assert budgets[0] <= 480 and budgets[1] <= 180 and sum(budgets) <= 660
    assert f"total: {budgets[0]} + {budgets[1]} = {sum(budgets)} s" in text
    caps = {c.name: c.cap_s for c in G.CHECKS}
    blocks = re.split(r"^command \d of \d", text, flags=re.M)[1:]
    planned = []
    for budget, block in zip(budgets, blocks):
        assert "./run.sh gpu-check --lease" in block
        lanes = re.split(r"^  (?:main lane|beside lane \d+).*:$", block, flags=re.M)[1:]
        assert lanes
        for lane in lanes:
            rows = re.findall(r"^    (\S+)\s+cap\s+(\d+) s$", lane, re.M)
            total = int(re.search(r"^    sum\s+(\d+) s$", lane, re.M).group(1))
            assert rows and all(name in caps and int(cap) == caps[name] for name, cap in rows), rows
            assert total == sum(int(cap) for _, cap in rows) <= budget
            planned += [name for name, _ in rows]
    first_lane = re.split(r"^  (?:main lane|beside lane \d+).*:$", blocks[0], flags=re.M)[1]
    assert re.findall(r"^    (\S+)\s+cap", first_lane, re.M)[0] == "speedrun-default"
    assert len(planned) == len(set(planned))
    # the plan the module holds is the one printed
    assert [c.budget_s for c in G.LEASE] == budgets and G.LEASE[0].lanes[0][0] == "speedrun-default"
    assert R.check_plan(G.LEASE, G.CHECKS, G.LEASE_LIMITS_S) == [] and G.LEASE_LIMITS_S == (480.0, 180.0)


def test_a_plan_over_its_limits_is_refused():
    checks = [R.Check("a", 100, "-"), R.Check("b", 90, "-"), R.Check("c", 30, "-")]
    ok = (R.LeaseCommand(190, (("a", "b"),)), R.LeaseCommand(30, (("c",),)))
    assert R.check_plan(ok, checks, (200, 30)) == []
    over = (R.LeaseCommand(150, (("a",), ("b", "c"))), R.LeaseCommand(30, (("c", "d"),)))
    problems = R.check_plan(over, checks, (140, 60))
    assert any("over its limit of 140 s" in p for p in problems)
    assert not any("the lane b, c" in p for p in problems)  # 120 s of caps within its 150 s budget
    assert any("no check named 'd'" in p for p in problems) and any("c is planned twice" in p for p in problems)
    lines = R.plan_lines(ok, checks, (200, 30))
    assert "total: 190 + 30 = 220 s (3.7 min) of 230 s allowed" in lines


def test_lease_runs_a_command_of_the_plan_and_nothing_else():
    r = run_sh("--lease", "1", "--only", "fp8-head", env={"PYTHON": sys.executable})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--lease runs its command's checks" in r.stderr
    r = run_sh("--lease", "3", env={"PYTHON": sys.executable})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "the plan has commands 1 to 2" in r.stderr
    r = run_sh("--lease", "1", env={"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and r.stderr.startswith("gpu-check: no CUDA GPU visible")


# ---- report ------------------------------------------------------------------------------------------

INFO = dict(date="2026-11-24", gpu="NVIDIA H100 80GB HBM3", capability="9.0", sms=132, memory_gib=79.1, gpu_count=1,
            driver="580.159.04", cuda="13.0", torch="2.11.0+cu130", triton="3.6.0", python="3.12.3", commit="abc1234",
            host="Intel(R) Xeon(R) Platinum 8480C, 224 CPUs")

STAGES = [dict(stage="stage 1", steps=423, batch=131072, warmup_s=80.0, ms=400.0, host_ms=390.5, tokens_per_s=327680.0,
               flops_per_token=1.0e9, mfu=0.33, optimizer_ms=40.0, rest_ms=360.0),
          dict(stage="stage 2", steps=424, batch=262144, warmup_s=40.0, ms=800.0, host_ms=420.0, tokens_per_s=327680.0,
               flops_per_token=1.1e9, mfu=None, optimizer_ms=48.0, rest_ms=752.0)]


def test_projection_arithmetic():
    p = R.project(STAGES)
    assert p["steps"] == 847
    assert p["this_gpu_s"] == pytest.approx((423 * 400 + 424 * 800) / 1000)  # 508.4 s
    assert p["8_gpus_s"] == pytest.approx(508.4 / 8)
    assert R.project(STAGES, gpus=4)["4_gpus_s"] == pytest.approx(127.1)
    # the optimizer step kept whole on each GPU, the micro-batches split 8 ways
    assert p["8_gpus_optimizer_whole_s"] == pytest.approx((423 * (360 / 8 + 40) + 424 * (752 / 8 + 48)) / 1000)
    older = [{k: v for k, v in st.items() if k not in ("optimizer_ms", "rest_ms")} for st in STAGES]
    assert "8_gpus_optimizer_whole_s" not in R.project(older)  # a report from before the split
    # MFU: FLOPs per token x tokens/s over the peak
    assert R.mfu(1.0e9, 327680.0, 989.4) == pytest.approx(327680e9 / 989.4e12)
    assert R.mfu(1.0e9, 327680.0, None) is None


# this GPU as rank 0 of 8 (step_timing --as_rank_of 8); the projection worked by hand at 450 GB/s:
# (423 x 60 + 424 x 90) ms = 63.54 s, (423 x 3e8 + 424 x 3.02e8) B / 450 GB/s = 0.567 s
RANK_STAGES = [dict(stage="stage 1", steps=423, ms=60.0, optimizer_ms=12.5,
                    comm_bytes={"all_gather": 1.5e8, "reduce_scatter": 1.5e8}),
               dict(stage="stage 2", steps=424, ms=90.0, optimizer_ms=14.0,
                    comm_bytes={"all_gather": 1.5e8, "all_to_all": 2e6, "reduce_scatter": 1.5e8})]
RANK_PROJECTION = dict(compute_s=63.54, comm_s=0.5665, total_s=64.1065, bus_gb_per_s=450.0, steps=847)


def report(tmp_path):
    timing = dict(world_size=1, accumulation=8, warmup=2, steps=4, peak_tflops=989.4, stages=STAGES, stages_total=4,
                  projection=R.project(STAGES), peak_allocated_gib=41.5, peak_reserved_gib=52.25,
                  rank_of=8, rank_stages=RANK_STAGES, rank_projection=RANK_PROJECTION)
    timing["compiles"] = dict(graphs_warmup=9, graphs_timed=0, graph_breaks=0)
    timing["profile"] = dict(what="stage 1, rank 0", steps=2, step_ms=1030.0, busy=0.452, kernels_per_step=4200.0,
                             ops_per_step=9100.0, top_kernels=[["ce_kernel", 25.6, 8.0]], top_ops=[["aten::mm", 1000.0, 12.5]],
                             top_self=[["cudaLaunchKernel", 4200.0, 30.25]])
    checks = [dict(name="triton-mlp", group="kernels", status="pass", seconds=12.34,
                   summary="worst relative error bf16 3.0e-03", error="", traceback="", data={}),
              dict(name="fp8-up", group="kernels", status="fail", seconds=3.0, summary="", error="AssertionError: post | 2% differ",
                   traceback="Traceback (most recent call last):\n  File \"tests/gpu_check.py\", line 5\nAssertionError: post | 2% differ",
                   data={}),
              dict(name="speedrun-timing", group="speedrun", status="timeout", seconds=300.0, summary="2 of 4 stages",
                   error="stopped at its 300 s cap", traceback="", data=timing)]
    return dict(info=INFO, checks=checks, total_s=315.3)


def test_report_files_name_the_machine_and_hold_the_figures(tmp_path):
    md, js = R.write_report(report(tmp_path), str(tmp_path))
    assert os.path.basename(md) == "2026-11-24_nvidia-h100-80gb-hbm3.md"
    assert os.path.basename(js) == "2026-11-24_nvidia-h100-80gb-hbm3.json"
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(js), os.path.basename(md)]  # no temporary left
    assert json.loads(open(js).read()) == report(tmp_path)
    text = open(md).read()
    for line in ("# GPU check, 2026-11-24: NVIDIA H100 80GB HBM3",
                 "- GPU: NVIDIA H100 80GB HBM3 (compute capability 9.0, 132 SMs, 79.1 GiB), 1 GPU(s) visible",
                 "- driver 580.159.04, CUDA 13.0",
                 "- torch 2.11.0+cu130, triton 3.6.0, Python 3.12.3",
                 "- host: Intel(R) Xeon(R) Platinum 8480C, 224 CPUs",
                 "- result: 1 of 3 checks passed in 315 s",
                 "| triton-mlp | kernels | pass | 12.3 | worst relative error bf16 3.0e-03 |",
                 "| fp8-up | kernels | fail | 3.0 | AssertionError: post / 2% differ |",
                 "| stage 1 | 423 | 131,072 | 80.0 | 400.0 | 390.5 | 40.0 | 327,680 | 1.000 | 33.0% |",
                 "| stage 2 | 424 | 262,144 | 40.0 | 800.0 | 420.0 | 48.0 | 327,680 | 1.100 | - |",
                 "- stages measured: 2 of 4 (projection covers those only)",
                 "- compile and warm-up: 120 s",
                 "- projected training time, 847 steps: 508 s on this GPU, 63.5 s on 8 such GPUs (no communication counted); "
                 "96.2 s if the optimizer step does not shrink at all (its time measured with the device synchronised "
                 "around it)",
                 "- peak memory: 41.50 GiB allocated, 52.25 GiB reserved",
                 "- torch.compile: 9 graphs compiled in the warm-up steps, 0 in the timed steps (recompiles), 0 graph breaks",
                 "### This GPU as rank 0 of 8",
                 "| stage 1 | 423 | 60.0 | 12.5 | 300.0 | all_gather 150.0, reduce_scatter 150.0 | 0.67 |",
                 "| stage 2 | 424 | 90.0 | 14.0 | 302.0 | all_gather 150.0, all_to_all 2.0, reduce_scatter 150.0 | 0.67 |",
                 "- projected training time on 8 GPUs from rank 0's work, 847 steps: 64.1 s = 63.5 s of rank 0's steps + "
                 "0.6 s of communication (estimate)",
                 "## Profile: stage 1, rank 0",
                 "2 steps, 1030.0 ms/step wall, GPU busy 45.2% (union of kernel intervals / wall time); 4200 kernels and "
                 "9100 aten ops per step.",
                 "| ce_kernel | 25.600 | 8.0 |", "| aten::mm | 1000.0 | 12.500 |", "| cudaLaunchKernel | 4200.0 | 30.250 |",
                 "### fp8-up (fail)",
                 "AssertionError: post | 2% differ"):  # the traceback as it is, in a code block
        assert line + "\n" in text, line


def test_a_group_run_keeps_the_days_other_results(tmp_path):
    """The report of a run of some groups replaces those checks of the same day's report and keeps the
    rest, each with the commit it ran on."""
    first = report(tmp_path)
    for r in first["checks"]:
        r["commit"] = "abc1234"
    order = [c.name for c in G.CHECKS]  # the table's, as the command line passes it
    R.write_report(first, str(tmp_path), merge=True, order=order)
    again = dict(info=dict(INFO, commit="def5678"), total_s=20.0,
                 checks=[dict(name="fp8-up", group="kernels", status="pass", seconds=20.0, summary="fixed", error="",
                              traceback="", data={}, commit="def5678")])
    md, js = R.write_report(again, str(tmp_path), merge=True, order=order)
    merged = json.loads(open(js).read())
    assert [r["name"] for r in merged["checks"]] == ["triton-mlp", "fp8-up", "speedrun-timing"]
    assert {r["name"]: r["commit"] for r in merged["checks"]} == {"triton-mlp": "abc1234", "fp8-up": "def5678",
                                                                  "speedrun-timing": "abc1234"}
    text = open(md).read()
    assert "| fp8-up | kernels | pass | 20.0 | fixed |" in text and "(commit abc1234)" in text
    assert "## Failures" not in text  # the earlier failure was replaced


def test_report_writing_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.md"
    R.atomic_write(str(path), "old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(R.os, "replace", broken_replace)
    with pytest.raises(OSError):
        R.atomic_write(str(path), "new, half-written\n")
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
    assert [line.split()[1].rstrip(":") for line in r.stdout.splitlines() if line.startswith("group ")] == list(R.GROUPS)
    assert "not covered by any check: none" in r.stdout


def test_without_a_gpu_it_is_one_line(tmp_path):
    r = run_sh("--out", str(tmp_path), env={"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu-check: no CUDA GPU visible to torch "), r.stderr
    assert os.listdir(tmp_path) == []  # no report from a run that never started
    r = run_sh("--only", "triton-mlp,nope", env={"PYTHON": sys.executable})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown check(s) nope" in r.stderr
    r = run_sh("--group", "kernel", env={"PYTHON": sys.executable})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown group(s) kernel" in r.stderr


def test_an_interpreter_without_torch_is_refused_in_one_line(tmp_path):
    bare = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    r = run_sh(env={"PYTHON": str(bare / "bin" / "python")})
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("run.sh: gpu-check: ") and "lacks torch>=2.11, triton>=3.6, numpy" in r.stderr


def test_calls_into_the_two_modules_bind_to_their_signatures():
    """The first H200 run lost its flex-attention check to a call that no longer matched flex_attend's
    signature (the softmax scale had become an argument). Every call in gpu_check.py of a train_gpt (T.),
    triton_kernels (tk.) or step_timing function must name a function that exists and bind to its parameters."""
    import inspect
    import triton_kernels as tk
    sys.path.insert(0, os.path.join(ROOT, "tests", "benchmarks"))
    import step_timing
    modules = {"T": T, "tk": tk, "step_timing": step_timing}
    tree = ast.parse(open(G.__file__).read())
    bad, bound = [], 0
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules):
            continue
        where = f"gpu_check.py line {node.lineno}: {f.value.id}.{f.attr}"
        fn = getattr(modules[f.value.id], f.attr, None)
        if fn is None:
            bad.append(f"{where} does not exist")
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or custom op without a Python signature
            continue
        try:
            sig.bind(*node.args, **{k.arg: None for k in node.keywords})
            bound += 1
        except TypeError as e:
            bad.append(f"{where}: {e}")
    assert bound > 20  # the scan sees the checks' calls
    assert not bad, "\n".join(bad)


def test_tile_sweep_takes_the_fastest_correct_config():
    """sweep_configs on a CPU with a fake kernel and a fake clock: a config whose output is off is not a
    candidate however fast, one that raises is listed with its error, the committed config comes first,
    and the speedup is its time over the best's."""
    import torch
    a, b, c, d = ({"BLOCK_V": v, "num_warps": 4} for v in (1, 2, 3, 4))
    times = {1: 2.0, 2: 1.0, 4: 0.1}   # 4 is the fastest but wrong; 3 fails to launch
    last = []

    def run(cfg):
        last.append(cfg["BLOCK_V"])
        if cfg["BLOCK_V"] == 3:
            raise RuntimeError("out of resource: shared memory\ndetails")
        return (torch.ones(4) * (2.0 if cfg["BLOCK_V"] == 4 else 1.0),)

    f = G.sweep_configs(run, (b, c, d, a), a, lambda fn: (fn(), times[last[-1]])[1])
    by = {r["config"]: r for r in f["configs"]}
    assert [r["config"] for r in f["configs"]] == ["V1 w4", "V2 w4", "V3 w4", "V4 w4"]
    assert f["current"] == "V1 w4" and f["best"] == "V2 w4" and f["best_ms"] == 1.0 and f["speedup"] == 2.0
    assert by["V3 w4"]["failed"].startswith("RuntimeError: out of resource") and not by["V3 w4"]["ok"]
    assert not by["V4 w4"]["ok"] and by["V4 w4"]["error"] == pytest.approx(1.0)


def test_optimizer_split_times_the_step_and_restores_it(monkeypatch):
    """step_timing.optimizer_split on a CPU with a fake optimizer and a fake clock: the optimizer's time
    is what passes inside opt.step, the rest is the remainder, and opt.step is the class's own again."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
    import step_timing
    import torch
    clock = [0.0]
    monkeypatch.setattr(step_timing.time, "perf_counter", lambda: clock[0])

    class Opt:
        def step(self):
            clock[0] += 0.010  # 10 ms inside the optimizer

    opt = Opt()

    def step():
        clock[0] += 0.030  # 30 ms of micro-batches
        opt.step()

    split = step_timing.optimizer_split(opt, step, torch.device("cpu"), 3)
    assert split["optimizer_ms"] == pytest.approx(10.0) and split["rest_ms"] == pytest.approx(30.0)
    assert split["wall"] == pytest.approx([40.0] * 3) and "step" not in vars(opt)


def test_host_cpu_names_the_processor_when_run_as_a_script(tmp_path):
    """run.sh runs `python tests/gpu_check.py`, so sys.path starts with tests/, not the repository: the
    report's host line (train_gpt.cpu_model) must import from there, from any working directory."""
    code = (f"import sys; sys.path[0] = {os.path.join(ROOT, 'tests')!r}; import gpu_check, gpu_check_runner; "
            "print(gpu_check_runner.host_cpu())")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"{T.cpu_model()}, {os.cpu_count()} CPUs"


# ---- the references: plain torch, run here against the CPU paths ------------------------------------

def ce_case(T_=37, V=300, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(T_, V, generator=g)).bfloat16()
    targets, prefix = G.ce_targets(T_, V, g)
    return logits, targets, prefix, torch.tensor([1.0, 0.5, 0.25]), torch.tensor(0.25)


def test_the_loss_reference_is_the_kernels_specification_in_float64():
    """ce_reference_rows (what triton-cross-entropy holds the kernel's target columns to) against
    triton_kernels' own float64 autograd reference and the CPU twin, whatever the rows per block."""
    import torch
    import triton_kernels as tk
    logits, targets, prefix, w, pi = ce_case()
    assert (targets[1:] == targets[:-1]).any() and (prefix == targets).any() and (prefix < 0).any()
    x64 = logits.double().requires_grad_()
    tk.softcapped_ce_mtp_reference(x64, targets, w.double(), prefix, pi.double(), grad_scale=0.5).sum().backward()
    loss_want = tk.softcapped_ce_mtp_reference(logits.double(), targets, w.double(), prefix, pi.double(), grad_scale=0.5)
    for rows in (5, 64):
        parts = list(G.ce_reference_rows(logits, targets, w, prefix, pi, 0.5, rows=rows))
        loss, grad = torch.cat([p[1] for p in parts]), torch.cat([p[3] for p in parts])
        assert G.rel_err(loss, loss_want) < 1e-6 and G.rel_err(grad, x64.grad) < 1e-6
    twin = logits.clone().requires_grad_()
    tk.softcapped_ce_mtp(twin, targets, w, prefix, pi, grad_scale=0.5).sum().backward()
    assert G.rel_err(twin.grad, grad) < 1e-2  # bf16
    rows, cols = G.target_entries(targets, prefix, 3)
    assert rows.numel() == 37 + 36 + 35 + int((prefix >= 0).sum())
    assert (grad[rows, cols] < 0).all()  # a target column's gradient carries its one-hot term


def test_the_target_column_runs_catch_a_lost_one_hot_term():
    """ce_target_runs on the CPU twin: within every bound; a run whose target columns lost their one-hot
    term (what the loss kernel writes without its barrier's order) is off in that run and unequal to the
    first, in both gradient forms."""
    import torch
    for form in ("bf16", "e5m2"):
        f = G.ce_target_runs(192, 1024, form, 3, torch.Generator().manual_seed(1), kernel=False)
        assert f["target_off"] == [0, 0, 0] and f["unequal_runs"] == 0 and G.ce_target_problems(form, f) == [], f

        def corrupt(run, grad):
            if run == 2:
                grad[7] = grad[7].abs()
        f = G.ce_target_runs(192, 1024, form, 3, torch.Generator().manual_seed(1), kernel=False, corrupt=corrupt)
        assert f["target_off"][:2] == [0, 0] and f["target_off"][2] > 0 and f["unequal_runs"] == 1
        assert len(G.ce_target_problems(form, f)) == 2


def test_the_fp8_references_match_the_ops_cpu_paths():
    """fp8-head's and fp8-mlp's figures on CPU tensors: the ops' CPU bodies (float8 products emulated in
    fp32, the loss kernel's twin) against the float64 references are within the checks' bounds, and exact
    where the CPU path is (the e5m2 gradient, post)."""
    import torch
    g = torch.Generator().manual_seed(0)
    M, K_, N = 128, 64, 1024
    x = T.norm(torch.randn(M, K_, generator=g)).bfloat16()
    w = (0.05 * torch.randn(K_, N, generator=g)).bfloat16()
    targets, prefix = G.ce_targets(M, N, g)
    e = G.fp8_head_figures(x, w, targets, torch.tensor([1.0, 0.5, 0.25]), prefix, torch.tensor(0.25), 1 / 8, rows=48)
    e.update(G.fp8_mm_figures(x, w, (torch.randn(M, N, generator=g) * 1e-3).bfloat16()))
    assert e["loss"] < 1e-6 and e["e5m2_differ"] == 0 and e["dlogits_e5m2"] > 0.01  # e5m2's own rounding
    assert not [k for k, tol in G.FP8_HEAD_TOL.items() if not e[k] < tol], e
    Tn, D, H, L = 128, 64, 256, 3
    x = T.norm(torch.randn(Tn, D, generator=g)).bfloat16()
    bank = torch.stack([((torch.rand(H, D, generator=g) * 2 - 1) * D ** -0.5) if i % 2 == 0 else
                        0.05 * torch.randn(H, D, generator=g) for i in range(2 * L)]).bfloat16()
    state = T.FP8MLPState(L, H, D)
    state.quantize(bank, bootstrap=True)
    with torch.no_grad():
        state.update_act_scales([state.mlp(i, x, bank[2 * i], bank[2 * i + 1])[1] for i in range(L)])
    e = G.fp8_mlp_figures(state, 2, x, bank[4], bank[5], torch.randn(Tn, D, generator=g).bfloat16())
    assert e["post"] == 0 and e["post_differ"] == 0 and e["y_vs_bf16_mlp"] > 0.01  # FP8's own error
    assert not [k for k, tol in G.FP8_MLP_TOL.items() if not e[k] < tol], e


@pytest.mark.slow
def test_the_reference_ops_replace_only_the_fp8_bodies_in_the_model(monkeypatch):
    """compiled-model's reference: the test preset's model with its FP8 path forced on a CPU, the two FP8
    ops replaced by their plain-torch references (reference_fp8_ops): the same loss and gradients as with
    the ops' CPU bodies, and the ops are the real ones again afterwards."""
    import numpy as np
    import torch
    monkeypatch.setattr(T, "_native_fp8", lambda device: True)
    args = T.parse_args(["--preset", "test"])
    torch.manual_seed(0)
    model = T.GPT(args)
    G.near_init(model, seed=1)
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    model.quantize_fp8(bootstrap=True)
    state = {k: v.clone() for k, v in model.fp8_mlp.state_dict().items()}
    tokens = np.random.default_rng(0).integers(0, 50256, 513).astype("uint16")
    tokens[[0, 200]] = T.BOS_ID
    b = T.make_batch(tokens, args.ngram_rows)

    def run():
        model.zero_grad(set_to_none=True)
        model.fp8_mlp.load_state_dict(state)
        loss, _ = model(b.inputs, b.targets, b.cu_seqlens, b.ngram_ids, mtp_weights=torch.tensor([1.0, 0.5, 0.25]),
                        loss_scale=1 / 8, prefix_weight=torch.tensor(0.25))
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ops = (T.fp8_mlp, T.fp8_head_loss)
    loss, grads = run()
    with G.reference_fp8_ops():
        assert (T.fp8_mlp, T.fp8_head_loss) == (G.reference_fp8_mlp, G.reference_fp8_head_loss)
        loss_r, grads_r = run()
    assert (T.fp8_mlp, T.fp8_head_loss) == ops
    assert abs(loss - loss_r) / abs(loss_r) < 1e-5 and set(grads) == set(grads_r)
    for n in grads_r:
        if grads_r[n].abs().max() > 0:
            assert G.rel_err(grads[n], grads_r[n]) < (0.1 if grads_r[n].numel() >= 4096 else 0.5), n


def test_polar_express_reference_is_the_iteration_in_float64():
    import torch
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 64, 96), (2, 96, 64)):
        A = torch.randn(shape, generator=g)
        ref = G.polar_express_reference(A, T.POLAR_EXPRESS_COEFFS)
        assert ref.dtype == torch.float32 and ref.shape == A.shape
        assert G.rel_err(T.polar_express(A, dtype=torch.float32), ref) < 1e-4  # the same iteration in fp32
        assert 1e-3 < G.rel_err(T.polar_express(A), ref) < 5e-2  # bf16's


# ---- speedrun-default: the comparison of the two runs, the driver -------------------------------------

def fake_runs(steps=3, seed=0):
    """Records and tensors as tests/gpu_check_train.py writes them, for two runs that agree exactly."""
    import torch
    g = torch.Generator().manual_seed(seed)
    names = [("bank", 8), ("gate", 3)]
    first = {"bank": torch.randn(64, 64, generator=g), "gate": torch.randn(3, generator=g)}
    moves = [{n: 0.01 * torch.randn(t.shape, generator=g) for n, t in first.items()} for _ in range(steps)]
    idx = {"bank": torch.arange(8) * 7}

    def sample(p):
        return torch.cat([p["bank"].reshape(-1)[idx["bank"]], p["gate"]])

    params, samples = dict(first), []
    for m in moves:
        params = {n: params[n] + m[n] for n in params}
        samples.append(sample(params))
    record = dict(sample_names=names, steps=[dict(step=i, batch_tokens=131072, windows=[1, 3], next_token=10.0 - i,
                                                  objective=20.0 - i, device_ms=400.0, profiled=i == 1) for i in range(steps)],
                  warmup=[dict(step=i, next_token=10.0 - i, objective=20.0 - i) for i in range(steps)])
    tensors = dict(first=first, final=params, sample0=sample(first), samples=torch.stack(samples))
    return record, tensors


def test_the_default_runs_comparison_states_each_bound():
    import copy
    import torch
    record, tensors = fake_runs()
    c = G.compare_default_runs(record, copy.deepcopy(record), tensors, copy.deepcopy(tensors))
    assert c["problems"] == [] and c["first_equal"] and c["replay"] == [0, 0, 0]
    assert c["steps"][0]["update"][1] == 0 and set(c["final"]) == {"bank", "gate"}
    # a loss off at step 0 (same weights, same batch): over first_loss; a later step within loss
    other = copy.deepcopy(record)
    other["steps"][0]["next_token"] *= 1 + 5e-3
    other["steps"][2]["objective"] *= 1 + 5e-3
    problems = G.compare_default_runs(record, other, tensors, tensors)["problems"]
    assert len(problems) == 1 and problems[0].startswith("step 0: losses")
    # an update that went the other way (a stale gradient buffer, a missing update)
    wrong = copy.deepcopy(tensors)
    wrong["samples"][1, :8] = 2 * tensors["sample0"][:8] - tensors["samples"][1, :8]
    wrong["final"]["bank"] = torch.zeros_like(wrong["final"]["bank"]) + tensors["first"]["bank"]
    problems = G.compare_default_runs(record, record, wrong, tensors)["problems"]
    assert any(p.startswith("step 1: the update of bank (sampled)") for p in problems)
    assert any(p.startswith("after the last step: bank") for p in problems)
    # different starting weights; the timed run against its warm-up
    moved = copy.deepcopy(tensors)
    moved["first"]["gate"] += 1
    warm = copy.deepcopy(record)
    warm["warmup"][0]["objective"] += 1e-3
    problems = G.compare_default_runs(warm, record, moved, tensors)["problems"]
    assert any("start from different weights" in p for p in problems)
    assert any(p.startswith("step 0: the timed run's losses differ from the warm-up's") for p in problems)


def test_the_graphs_runs_own_verdicts():
    record, _ = fake_runs()
    s = dict(code=0, error="", steps=record["steps"], graphs=dict(enabled=True, kept=True, captured=1, failure=""),
             val_losses=[7.5], graphs_notes=[], graphs_after_warmup=0, graph_breaks=0,
             compile_line="torch.compile: 0 graphs compiled during the timed run (recompiles after the warm-up), 0 graph breaks",
             hardware="hardware: 1 x NVIDIA H100 80GB HBM3 (79 GiB), CUDA 13.0", peak_memory="peak memory allocated: 1 MiB")
    assert G.default_run_problems(s) == []
    bad = dict(s, graphs=dict(enabled=True, kept=False, captured=0, failure=""), graphs_notes=["cuda graphs off for this "
               "run: capture failed: RuntimeError: operation not permitted when stream is capturing"], val_losses=[11.0],
               graphs_after_warmup=2)
    problems = G.default_run_problems(bad)
    assert len(problems) == 3 and "operation not permitted" in problems[0] and "validation losses [11.0]" in problems[1]
    assert problems[2].startswith("compiled after the warm-up")


def test_the_run_logs_facts_are_read_after_its_sources():
    log = ('==== train_gpt.py ====\n        return (f"peak memory allocated: {x} MiB "\n    log.write(f"hardware: {h}")\n'
           '        self.write(f"==== environment ====\\npython {v}")\n'
           "==== environment ====\npython 3.12\nhardware: 1 x NVIDIA H200 (140 GiB), CUDA 13.0\n"
           "cuda graphs: 4 step shapes captured in the warm-up, each replay equal to the uncaptured step\n"
           "compile warm-up: 11 steps in 301s\nstep:11/11 val_loss:6.1234 train_time:5000ms step_avg:454.55ms\n"
           "torch.compile: 0 graphs compiled during the timed run (recompiles after the warm-up), 0 graph breaks\n"
           "peak memory allocated: 22000 MiB reserved: 24000 MiB\n")
    f = G.log_facts(log, "\rcompile warm-up: 11 steps in 301s\n")
    assert f["val_losses"] == [6.1234] and f["warmup_line"] == "compile warm-up: 11 steps in 301s"
    assert f["hardware"].startswith("hardware: 1 x NVIDIA H200") and f["peak_memory"].startswith("peak memory allocated: 22000")
    assert f["graphs_after_warmup"] == 0 and f["graph_breaks"] == 0 and len(f["graphs_notes"]) == 1
    steps = [dict(batch_tokens=b, windows=w) for b, w in ((131072, [1, 3]), (131072, [1, 3]), (262144, [3, 7]),
                                                         (393216, [5, 11]), (393216, [6, 13]))]
    assert G.stage_of_steps(steps) == ["stage 1", "stage 1", "stage 2", "stage 3", "extension"]


def test_the_text_val_shard_holds_whole_documents(tmp_path):
    pattern = G.text_val_shard(str(tmp_path), tokens=100_000)
    (path,) = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    assert pattern == os.path.join(str(tmp_path), "tinyshakespeare_val_*.bin")
    tokens = T.read_shard(path).numpy()
    assert len(tokens) >= 100_000 and tokens[0] == T.BOS_ID and len(tokens) % 36032 == 0


def test_dispatch_counts_read_a_profile():
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import gpu_check_train
    from torch.profiler import ProfilerActivity, profile
    a = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (a @ a + 1).relu()
    d = gpu_check_train.dispatch_counts(prof.events())
    assert d["aten_ops"] >= 3 and d["kernel_launches"] == d["graph_launches"] == d["host_dispatches"] == 0

    class E:
        def __init__(self, name):
            self.name = name
    d = gpu_check_train.dispatch_counts([E("cudaLaunchKernel")] * 5 + [E("cudaGraphLaunch"), E("cudaMemcpyAsync"),
                                                                         E("aten::mm")])
    assert d == dict(aten_ops=1, kernel_launches=5, graph_launches=1, copies=1, host_dispatches=7)


@pytest.mark.slow
def test_the_training_driver_records_train_gpt_s_own_run(tmp_path):
    """tests/gpu_check_train.py around train_gpt.main under torchrun (the test preset on this CPU, fp32):
    every step's losses, samples and the weights before and after, the profiled step's dispatches, the log's
    facts; a run compared with itself meets every bound; a failing run hands over its traceback."""
    import torch
    flags = ["--preset", "test", "--compile", "false", "--cpu_dtype", "fp32", "--num_iterations", "3",
             "--extension_iterations", "0", "--val_loss_every", "0"]
    run = G.run_training(flags, str(tmp_path), "graphs", profile_step=1)
    assert run["code"] == 0, run["output"]
    rec = run["record"]
    assert [s["step"] for s in rec["steps"]] == [0, 1, 2] and rec["steps"][1]["profiled"]
    assert rec["dispatch"]["step"] == 1 and rec["dispatch"]["aten_ops"] > 1000 and rec["graphs"]["enabled"] is False
    t = torch.load(run["tensors"])
    assert t["samples"].shape == (3, sum(n for _, n in rec["sample_names"])) and set(t["first"]) == set(t["final"])
    s = G.default_run_summary("graphs", run)
    assert s["val_losses"] and G.default_run_problems(s, cuda=False) == []
    c = G.compare_default_runs(rec, rec, t, t)
    assert c["problems"] == [] and c["first_equal"]
    assert "graphs: next-token loss" in G.default_run_line(dict(runs={"graphs": s}, comparison=c))
    bad = G.run_training([*flags, "--train_files", str(tmp_path / "none_*.bin")], str(tmp_path), "eager")
    assert bad["code"] != 0 and "no train shards match" in bad["record"]["error"]
    assert bad["record"]["traceback"].startswith("Traceback (most recent call last):")


# ---- the loss kernel's limits, from its own SASS --------------------------------------------------------

def test_the_loss_kernels_limits_come_from_its_sass(tmp_path):
    """bench_kernels' analysis of the loss kernel compiled for sm_90 (`--only ce_limits`: no GPU, Triton's
    compiler without the interpreter): its two passes are its two loops, each a few dozen instructions and 3
    MUFU operations (two exp, one reciprocal) per logit with the accurate tanh; an H100's figures make it
    issue-bound; a measured time far above every limit reads as latency, one at over half the bandwidth as
    such."""
    import bench_kernels as B
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "limits.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bench_kernels.py"), "--only", "ce_limits", "--json",
                        str(path)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the largest: issue" in r.stdout
    out = json.loads(path.read_text())
    sass, regs = out["sass"]["e5m2"], out["regs"]["e5m2"]
    assert 16 <= regs <= 255
    assert len([lp for lp in B.sass_loops(sass) if lp["instructions"] > 50]) == 2
    f = B.loss_kernel_limits(sass, 16384, 50304, 4096, 8, 1, regs, 132, 1.98, 3350.0)
    assert [round(p["mufu_per_logit"]) for p in f["passes"]] == [3, 3]
    assert all(10 < p["instructions_per_logit"] < 100 for p in f["passes"]) and f["bytes_per_logit"] == 5
    assert f["bound"] == "issue" and f["programs_per_sm"] >= 1
    assert f["memory_ms"] == pytest.approx(16384 * 50304 * 5 / 3.35e12 * 1e3)
    fast = B.loss_kernel_limits(out["sass"]["e5m2 FAST_TANH"], 16384, 50304, 4096, 8, 1, out["regs"]["e5m2 FAST_TANH"],
                                132, 1.98, 3350.0)
    assert fast["instructions_per_logit"] < f["instructions_per_logit"]  # the hardware tanh: fewer instructions
    slow = B.loss_kernel_limits(sass, 16384, 50304, 4096, 8, 1, regs, 132, 1.98, 3350.0, measured_ms=3 * f["issue_ms"])
    assert slow["verdict"].startswith("latency: ") and slow["bandwidth_share"] < 0.5
    quick = B.loss_kernel_limits(sass, 16384, 50304, 4096, 8, 1, regs, 132, 1.98, 3350.0, measured_ms=1.5 * f["memory_ms"])
    assert quick["verdict"].endswith("of the peak bandwidth")
    assert any(line.startswith("  from its SASS: ") for line in B.limits_lines(slow))
    assert B.programs_per_sm(45, 256) == 5 and B.programs_per_sm(32, 128) == 16


def test_the_report_shows_the_default_speedrun_and_the_loss_kernel(tmp_path):
    record, tensors = fake_runs()
    import copy
    c = G.compare_default_runs(record, copy.deepcopy(record), tensors, copy.deepcopy(tensors))
    c.pop("problems")
    run = dict(code=0, seconds=351.2, error="", graphs=dict(enabled=True, kept=True, captured=4, failure=""),
               dispatch=dict(host_dispatches=812, aten_ops=2301, step=2), steps=[dict(s, stage="stage 1") for s in record["steps"]],
               ms_per_stage={"stage 1": 400.0}, val_losses=[6.5], warmup_line="compile warm-up: 11 steps in 301s")
    data = dict(flags=["--num_iterations", "9"], eager_flags=["--compile", "false"], runs={"graphs": run, "eager": dict(
        run, graphs=dict(enabled=False), dispatch=dict(host_dispatches=20345, aten_ops=30111, step=2))}, comparison=c,
        bounds=dict(loss=1e-2), problems=["step 4: over"])
    limits = dict(instructions_per_logit=72.0, mufu_per_logit=6.0, regs=45, programs_per_sm=5, issue_ms=1.88,
                  mufu_ms=1.25, memory_ms=1.23, verdict="latency: 3.45 ms is 1.8x its largest limit")
    loss = dict(sms=132, clock_ghz=1.98, kernels=[dict(tokens=16384, gradient="e5m2", ms=3.45, gb_per_s=1195.0,
                                                       peak_gbs=3350.0, limits=limits)])
    rep = dict(info=INFO, total_s=400.0, checks=[
        dict(name="speedrun-default", group="run", status="fail", seconds=400.0, summary="s", error="e", traceback="", data=data),
        dict(name="loss-kernel", group="kernels", status="pass", seconds=20.0, summary="l", error="", traceback="", data=loss)])
    text = R.render_markdown(rep)
    for line in ("## The default speedrun: train_gpt.py through torchrun",
                 "| graphs | 0 | 351 | 4 captured | compile warm-up: 11 steps in 301s | 6.5000 | stage 1 400 | 812 (2,301) in step 2 |",
                 "| eager | 0 | 351 | off | compile warm-up: 11 steps in 301s | 6.5000 | stage 1 400 | 20,345 (30,111) in step 2 |",
                 "| 1 | stage 1 | 9.0000 / 9.0000 | 19.0000 / 19.0000 | 0.0e+00 | 0.0e+00 (bank) | 400 / 400 (profiled) |",
                 "- weights before step 0 the same in both runs: yes", "- not met: step 4: over",
                 "## The loss kernel alone",
                 "| 16,384 | e5m2 | 3.450 | 1195 | 36% | 72.0 | 6.0 | 45 | 5 | 1.88 | 1.25 | 1.23 | latency: 3.45 ms is 1.8x its "
                 "largest limit |"):
        assert line + "\n" in text, line


def test_the_docs_name_every_check_and_the_next_lease_holds_the_plans_commands():
    """tests/README.md's GPU check table has one row per check of the table, in its group; records/gpu_check/
    README.md's "Next lease" gives the plan's commands (`--lease N`, one per command of LEASE) and their caps."""
    import re
    text = open(os.path.join(ROOT, "tests", "README.md")).read()
    rows = re.findall(r"^\| (\w+) \| `([\w-]+)` \|", text, re.M)
    assert sorted(rows) == sorted((c.group, c.name) for c in G.CHECKS)
    records = open(os.path.join(ROOT, "records", "gpu_check", "README.md")).read()
    next_lease = records[records.index("## Next lease"):records.index("\n## ", records.index("## Next lease") + 1)]
    for i, cmd in enumerate(G.LEASE, 1):
        assert f"./run.sh gpu-check --lease {i}   # {cmd.budget_s:.0f} s" in next_lease
    assert "--lease 3" not in next_lease


def test_rank_0_of_8_is_reported_without_the_one_gpu_stages():
    """speedrun-timing times rank 0 of 8 first: cut before the one-GPU stages, its projection is in the report."""
    timing = dict(rank_of=8, rank_stages=RANK_STAGES, rank_projection=RANK_PROJECTION, stages=[], stages_total=4)
    rep = dict(info=INFO, total_s=180.0, checks=[dict(name="speedrun-timing", group="speedrun", status="timeout",
                                                      seconds=180.0, summary="", error="", traceback="", data=timing)])
    text = R.render_markdown(rep)
    assert "### This GPU as rank 0 of 8" in text and "| stage 1 | 423 | 60.0 | 12.5 | 300.0 |" in text
    assert "| stage | steps | batch tokens |" not in text and "- stages measured: 2 of 4 (projection covers those only)" in text
