"""The GPU check's runner and report writer: the command line of tests/gpu_check.py (which holds the
checks and hands them to `main`), one process per check under its time cap, the groups' time limits
and --budget, the shared compile caches, and the report, records/gpu_check/<date>_<gpu>.md and .json,
merged into the same day's report of the same GPU (tests/README.md, "GPU check").

A check's process is `python tests/gpu_check.py --run-one NAME --result PATH` (`default_command`):
the entry point again, which finds the check in its table and runs its function (`run_one`).

Imports here are the standard library's only: the list, the coverage scan (gpu_check_coverage) and
the report writer run on any Python; torch is imported by the checks themselves.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from gpu_check_coverage import SOURCES, coverage, cuda_paths, repo_sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
ENTRY = os.path.join(TESTS, "gpu_check.py")  # the checks; a check's process runs it with --run-one
# run as a script (run.sh gpu-check) sys.path starts with tests/: train_gpt and the test helpers import from here
sys.path[:0] = [p for p in (REPO, TESTS) if p not in sys.path]
RECORDS = os.path.join(REPO, "records", "gpu_check")
SHARD_DIR = os.path.join(REPO, ".cache", "gpu_check_shards")  # ignored (.gitignore: .cache/)
CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(REPO, ".cache", "inductor"),
              "TRITON_CACHE_DIR": os.path.join(REPO, ".cache", "triton")}
GROUPS = ("kernels", "model", "run", "speedrun", "tune")
GROUP_LIMIT_S = 500.0   # no check of a group starts later than this; caps are cut to fit (9 minutes a group)
GPUS_PROJECTED = 8      # the record's machine


@dataclass(frozen=True)
class Check:
    """One row of the table in tests/gpu_check.py: its name, time cap, what it compares, the CUDA paths
    it covers (gpu_check_coverage), its group, and its function there (default check_<name with _>)."""
    name: str
    cap_s: float
    what: str
    covers: tuple[str, ...] = ()
    group: str = "kernels"
    fn: str = ""  # function name in tests/gpu_check.py; default check_<name with _>


# ----------------------------------------------------------------------------------------------
# Projections and the report
# ----------------------------------------------------------------------------------------------

def project(stages: list[dict], gpus: int = GPUS_PROJECTED) -> dict:
    """Training time of the whole schedule from measured stages (steps x ms/step, validation excluded):
    on this GPU, and on `gpus` GPUs with the same per-GPU speed, where each GPU does 1/gpus of a step's
    micro-batches (accumulation 8 -> 8/gpus) and communication costs nothing, so a lower bound. Where
    every stage has its optimizer split (step_timing.optimizer_split), also the time with the
    micro-batches split `gpus` ways and the optimizer step not split at all (its launches, and the
    per-bank work of a launch-bound step, do not shrink with the shard): `gpus_optimizer_whole_s`.
    The projection from one rank's own work (step_timing --as_rank_of, its per-rank fixed costs included,
    communication estimated from bytes) is step_timing.rank_projection, which the check computes itself
    (it needs torch); the report shows it beside these."""
    this = sum(s["steps"] * s["ms"] for s in stages) / 1000
    out = {"this_gpu_s": this, f"{gpus}_gpus_s": this / gpus, "steps": sum(s["steps"] for s in stages)}
    if stages and all("optimizer_ms" in s for s in stages):
        out[f"{gpus}_gpus_optimizer_whole_s"] = sum(
            s["steps"] * (s["ms"] - s["optimizer_ms"]) / gpus + s["steps"] * s["optimizer_ms"] for s in stages) / 1000
    return out


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else flops_per_token * tokens_per_s / (peak_tflops * 1e12)


def atomic_write(path: str, text: str) -> None:
    """Write through a temporary file in the same folder and rename it into place: a reader (or a run
    killed half-way) never sees a half-written file."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "gpu"


def report_paths(info: dict, folder: str = RECORDS) -> tuple[str, str]:
    base = os.path.join(folder, f"{info['date']}_{slug(info['gpu'])}")
    return base + ".md", base + ".json"


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def rank_lines(t: dict) -> list[str]:
    """The speedrun timing as rank 0 of N (step_timing --as_rank_of N), if the check got to it: per stage
    rank 0's ms/step, its optimizer's, the bytes it sends and their time at the assumed bandwidth, then
    the N-GPU projection from them (step_timing.rank_projection)."""
    stages, q = t.get("rank_stages"), t.get("rank_projection")
    if not stages or not q:
        return []
    n, bus = t["rank_of"], q["bus_gb_per_s"]
    lines = ["", f"### This GPU as rank 0 of {n}", "",
             f"Rank 0's work of each step on {n} GPUs, timed alone (step_timing --as_rank_of {n}): the model built for {n} ranks, "
             f"its micro-batches of each step, its shards of the optimizer as ownership over {n} ranks gives them; the "
             "collectives complete at once, their bytes counted as the real ones send them. Communication is an "
             + (f"estimate: bytes / {bus:.0f} GB/s per direction per GPU (nominal bus bandwidth), not overlapped with compute."
                if bus else "unknown: no bus bandwidth for this GPU, bytes only."),
             "", "| stage | steps | ms/step | optimizer ms | MB sent/step | by collective (MB) | communication ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in stages:
        sent = sum(s.get("comm_bytes", {}).values())
        ops = ", ".join(f"{op} {b / 1e6:.1f}" for op, b in s.get("comm_bytes", {}).items())
        lines.append(f"| {s['stage']} | {s['steps']} | {s['ms']:.1f} | {_fmt(s.get('optimizer_ms'), '.1f')} | "
                     f"{sent / 1e6:.1f} | {ops or '-'} | {_fmt(bus and sent / (bus * 1e9) * 1000, '.2f')} |")
    lines += ["", f"- stages measured: {len(stages)} of {t['stages_total']}"
              + ("" if len(stages) == t["stages_total"] else " (projection covers those only)"),
              f"- projected training time on {n} GPUs from rank 0's work, {q['steps']} steps: "
              + (f"{q['total_s']:.1f} s = {q['compute_s']:.1f} s of rank 0's steps + {q['comm_s']:.1f} s of "
                 "communication (estimate)" if q["total_s"] is not None
                 else f"{q['compute_s']:.1f} s of rank 0's steps, communication not estimated")]
    return lines


def render_markdown(report: dict) -> str:
    info, results = report["info"], report["checks"]
    passed = sum(r["status"] == "pass" for r in results)
    lines = [
        f"# GPU check, {info['date']}: {info['gpu']}",
        "",
        f"- GPU: {info['gpu']} (compute capability {info['capability']}, {info['sms']} SMs, "
        f"{info['memory_gib']:.1f} GiB), {info['gpu_count']} GPU(s) visible",
        f"- driver {info['driver']}, CUDA {info['cuda']}",
        f"- torch {info['torch']}, triton {info['triton']}, Python {info['python']}",
        *([f"- host: {info['host']}"] if info.get("host") else []),
        f"- code: commit {info['commit']}" + ("" if len({r.get('commit', info['commit']) for r in results}) == 1
                                             else " (the commit of each check in its row)"),
        f"- result: {passed} of {len(results)} checks passed in {report['total_s']:.0f} s",
        "",
        "| check | group | result | seconds | figures |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        figures = r.get("summary") or ""
        if r["status"] != "pass" and r.get("error"):
            figures = (figures + "; " if figures else "") + r["error"]
        if r.get("commit", info["commit"]) != info["commit"]:
            figures += f" (commit {r['commit']})"
        lines.append(f"| {r['name']} | {r.get('group', '-')} | {r['status']} | {r['seconds']:.1f} | "
                     f"{figures.replace('|', '/')} |")
    timing = next((r for r in results if r["name"] == "speedrun-timing" and r.get("data", {}).get("stages")), None)
    if timing:
        t = timing["data"]
        lines += ["", "## Speedrun preset on this GPU", "",
                  f"{t['world_size']} GPU, accumulation {t['accumulation']}, {t['warmup']} warm-up + {t['steps']} "
                  f"timed steps per stage; MFU against {_fmt(t['peak_tflops'], '.1f', 'unknown')} TFLOP/s dense bf16.",
                  "", "| stage | steps | batch tokens | warm-up s (compile) | ms/step | host ms | optimizer ms | "
                  "tokens/s | GFLOP/token | MFU |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in t["stages"]:
            lines.append(f"| {s['stage']} | {s['steps']} | {s['batch']:,} | {s['warmup_s']:.1f} | {s['ms']:.1f} | "
                         f"{_fmt(s.get('host_ms'), '.1f')} | {_fmt(s.get('optimizer_ms'), '.1f')} | {s['tokens_per_s']:,.0f} | {s['flops_per_token'] / 1e9:.3f} | "
                         f"{_fmt(s.get('mfu') and 100 * s['mfu'], '.1f')}{'%' if s.get('mfu') else ''} |")
        p = t.get("projection")
        if p:
            lines += ["", f"- stages measured: {len(t['stages'])} of {t['stages_total']}"
                      + ("" if len(t["stages"]) == t["stages_total"] else " (projection covers those only)"),
                      f"- compile and warm-up: {sum(s['warmup_s'] for s in t['stages']):.0f} s",
                      f"- projected training time, {p['steps']} steps: {p['this_gpu_s']:.0f} s on this GPU, "
                      f"{p[f'{GPUS_PROJECTED}_gpus_s']:.1f} s on {GPUS_PROJECTED} such GPUs (no communication counted)"
                      + (f"; {p[f'{GPUS_PROJECTED}_gpus_optimizer_whole_s']:.1f} s if the optimizer step does not "
                         "shrink at all (its time measured with the device synchronised around it)"
                         if f"{GPUS_PROJECTED}_gpus_optimizer_whole_s" in p else "")]
        if t.get("peak_allocated_gib") is not None:
            lines.append(f"- peak memory: {t['peak_allocated_gib']:.2f} GiB allocated, "
                         f"{t['peak_reserved_gib']:.2f} GiB reserved")
        if t.get("compiles"):
            c = t["compiles"]
            lines.append(f"- torch.compile: {c['graphs_warmup']} graphs compiled in the warm-up steps, "
                         f"{c['graphs_timed']} in the timed steps (recompiles), {c['graph_breaks']} graph breaks")
        lines += rank_lines(t)
    prof = next((r["data"]["profile"] for r in results if r.get("data", {}).get("profile")), None)
    if prof:
        lines += ["", f"## Profile: {prof['what']}", "",
                  f"{prof['steps']} steps, {prof['step_ms']:.1f} ms/step wall, GPU busy {100 * prof['busy']:.1f}% "
                  f"(union of kernel intervals / wall time); {prof['kernels_per_step']:.0f} kernels and "
                  f"{prof['ops_per_step']:.0f} aten ops per step.", "",
                  "| kernel | ms/step | calls/step |", "| --- | --- | --- |"]
        lines += [f"| {name[:90].replace('|', '/')} | {ms:.3f} | {calls:.1f} |" for name, ms, calls in prof["top_kernels"]]
        lines += ["", "| host op | calls/step | host ms/step |", "| --- | --- | --- |"]
        lines += [f"| {name} | {calls:.1f} | {ms:.3f} |" for name, calls, ms in prof["top_ops"]]
        if prof.get("top_self"):
            lines += ["", "| host time spent in (self) | calls/step | self ms/step |", "| --- | --- | --- |"]
            lines += [f"| {name[:90].replace('|', '/')} | {calls:.1f} | {ms:.3f} |" for name, calls, ms in prof["top_self"]]
    failures = [r for r in results if r["status"] in ("fail", "timeout") and r.get("traceback")]
    if failures:
        fence = "`" * 3
        lines += ["", "## Failures"]
        for r in failures:
            lines += ["", f"### {r['name']} ({r['status']})", "", fence, r["traceback"].replace(fence, "'" * 3), fence]
    return "\n".join(lines) + "\n"


def merge_reports(old: dict | None, new: dict, order=()) -> dict:
    """The day's report after `new`: its checks replace the same checks of `old` (same GPU), the other
    checks of `old` stay (each row keeps the commit it ran on); rows in the order of the check names
    `order` (the table's), any others after them."""
    if not old or old.get("info", {}).get("gpu") != new["info"]["gpu"]:
        return new
    rows = {r["name"]: r for r in old.get("checks", [])}
    rows.update({r["name"]: r for r in new["checks"]})
    order = {name: i for i, name in enumerate(order)}
    merged = sorted(rows.values(), key=lambda r: order.get(r["name"], len(order)))
    return dict(info=new["info"], checks=merged, total_s=sum(r["seconds"] for r in merged))


def write_report(report: dict, folder: str = RECORDS, merge: bool = False, order=()) -> tuple[str, str]:
    """Write report (merged into the same day's report of this GPU when merge, rows in the order of the
    check names `order`) as .json and .md."""
    md, js = report_paths(report["info"], folder)
    if merge and os.path.exists(js):
        with open(js) as f:
            report = merge_reports(json.load(f), report, order)
    atomic_write(js, json.dumps(report, indent=1, sort_keys=True) + "\n")
    atomic_write(md, render_markdown(report))
    return md, js


def machine_info() -> dict:
    import torch
    import triton
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (no nvidia-smi)"
    # GPU_CHECK_COMMIT names the commit of a tree copied to the GPU machine, whose .git (if any) may
    # be stale; otherwise git says it.
    commit = os.environ.get("GPU_CHECK_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                                          capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    commit = commit or "unknown"
    return dict(date=datetime.date.today().isoformat(), gpu=props.name, capability=f"{props.major}.{props.minor}",
                sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                gpu_count=torch.cuda.device_count(), driver=driver, cuda=torch.version.cuda, torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(), commit=commit, host=host_cpu())


def host_cpu() -> str:
    """The host's processor and CPU count: the host launches every kernel, so its speed is part of a
    step's time where the GPU waits on it (small micro-batches), and differs between machines of one kind."""
    import train_gpt as T
    return f"{T.cpu_model()}, {os.cpu_count()} CPUs"



# ----------------------------------------------------------------------------------------------
# Running: one process per check, with a time cap
# ----------------------------------------------------------------------------------------------

def default_command(check: Check, result_path: str) -> list[str]:
    """A check's process: the entry point, which holds the check's function, with --run-one."""
    return [sys.executable, ENTRY, "--run-one", check.name, "--result", result_path]


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b|^\w+\.\w+Error", ln)]
    return (errors or lines or ["no output"])[-1][:400]


TRACEBACK_CHARS = 12_000  # of a failing check's output kept in the report: its last traceback, whole


def last_traceback(text: str) -> str:
    """The last Python traceback in a check's output, from its "Traceback" line to the end (the error
    and anything printed after it), paths shortened to the repository and site-packages; at most
    TRACEBACK_CHARS, cut in the middle (the first frames and the error are what a fix needs)."""
    start = text.rfind("Traceback (most recent call last):")
    tb = text[start:] if start >= 0 else text[-TRACEBACK_CHARS:]
    tb = re.sub(r'File "[^"]*?/(site-packages|dist-packages)/', r'File "\1/', tb.replace(REPO + os.sep, ""))
    if len(tb) > TRACEBACK_CHARS:
        half = TRACEBACK_CHARS // 2
        tb = tb[:half] + f"\n... ({len(tb) - TRACEBACK_CHARS} characters left out) ...\n" + tb[-half:]
    return tb.strip()


def check_env() -> dict:
    """The environment of a check's process: the shared compile caches (unless the caller set its own)."""
    env = dict(os.environ)
    for name, path in CACHE_DIRS.items():
        env.setdefault(name, path)
    return env


def run_checks(checks, command=default_command, total_limit_s: float = GROUP_LIMIT_S, log=print,
               log_dir: str | None = None) -> list[dict]:
    """Run each check in its own process, capped at min(its cap, time left of total_limit_s); a check
    with under 5 s left is skipped. Returns one dict per check: name, status (pass / fail / timeout /
    skipped), seconds, summary, error, traceback (a failure's whole last traceback, or the output's
    end for a timeout), data (what the check wrote, even when it did not finish)."""
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in checks:
            left = total_limit_s - (time.monotonic() - start)
            r = dict(name=check.name, status="skipped", seconds=0.0, summary="", error="", traceback="", data={})
            if left < 5:
                r["error"] = f"not started: the {total_limit_s:.0f} s limit of its group was reached"
                results.append(r)
                log(f"{check.name:22s} skipped")
                continue
            cap = min(check.cap_s, left)
            result_path = os.path.join(tmp, check.name + ".json")
            out_path = os.path.join(log_dir or tmp, check.name + ".log")
            t0 = time.monotonic()
            with open(out_path, "w") as out:
                proc = subprocess.Popen(command(check, result_path), stdout=out, stderr=subprocess.STDOUT,
                                        cwd=REPO, start_new_session=True, env=check_env())
                try:
                    code = proc.wait(timeout=cap)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)  # the check and whatever it started (torchrun workers)
                    proc.wait()
                    code = None
            r["seconds"] = time.monotonic() - t0
            if os.path.exists(result_path):
                with open(result_path) as f:
                    r["data"] = json.load(f)
                r["summary"] = r["data"].pop("summary", "")
            output = open(out_path, errors="replace").read()
            if code is None:
                r["status"], r["error"] = "timeout", f"stopped at its {cap:.0f} s cap"
                r["traceback"] = output[-TRACEBACK_CHARS // 4:].strip()
            elif code == 0:
                r["status"] = "pass"
            else:
                r["status"], r["error"] = "fail", last_error_line(output)
                r["traceback"] = last_traceback(output)
            results.append(r)
            log(f"{check.name:22s} {r['status']:8s} {r['seconds']:6.1f} s  {r['summary']}"
                + (f"  [{r['error']}]" if r["error"] else ""))
    return results


class Result:
    """What a check hands back: figures (JSON) saved after every set(), so a check stopped at its
    cap still reports what it measured; `summary` is the report's one-line figures."""

    def __init__(self, path: str | None):
        self.path, self.data = path, {}

    def set(self, **kw) -> None:
        self.data.update(kw)
        if self.path:
            atomic_write(self.path, json.dumps(self.data, default=float))


def run_one(checks, check_function, name: str, result_path: str | None) -> int:
    """Run the check `name` of `checks` (its function: check_function(check)) in this process."""
    check = next((c for c in checks if c.name == name), None)
    if check is None:
        print(f"gpu_check: no check named {name!r}; --dry-run lists them", file=sys.stderr)
        return 2
    res = Result(result_path)
    try:
        check_function(check)(res)
    except Exception:
        traceback.print_exc()
        return 1
    return 0



# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def dry_run(checks, all_checks) -> int:
    print(f"{len(checks)} checks in groups {', '.join(GROUPS)} (each check in its own process; a group stops "
          f"starting checks after {GROUP_LIMIT_S:.0f} s):")
    for group in GROUPS:
        mine = [c for c in checks if c.group == group]
        if mine:
            print(f"group {group}: caps add up to {sum(c.cap_s for c in mine):.0f} s")
        for c in mine:
            print(f"  {c.name:22s} cap {c.cap_s:4.0f} s  {c.what}")
            if c.covers:
                print(f"  {'':22s}   covers: {', '.join(c.covers)}")
    uncovered, stale = coverage(all_checks)
    print(f"CUDA paths found in {' and '.join(SOURCES)}: {len(cuda_paths(repo_sources()))}; "
          f"not covered by any check: {', '.join(sorted(uncovered)) or 'none'}")
    if stale:
        print(f"covered names that are no longer CUDA paths: {', '.join(sorted(stale))}")
    return 0 if not uncovered and not stale else 1


def no_gpu_reason() -> str | None:
    """One line saying why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return f"{sys.executable} has no torch; run it with PYTHON=/path/to/python that has torch >= 2.11"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__} (torch.cuda.is_available() is False); run it on a machine with one"
    return None


def main(all_checks, check_function, description: str = "", argv=None) -> int:
    """The command line of tests/gpu_check.py, over its table `all_checks` (their functions:
    check_function(check)); `description` is its --help text."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and their coverage; needs no GPU")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--group", default="", help=f"comma-separated groups ({', '.join(GROUPS)}); default: all")
    ap.add_argument("--out", default=RECORDS, help="folder of the report (default records/gpu_check)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: no check starts later, caps are cut to fit, and the report "
                         "is written after each group (for a GPU lease shorter than the groups together)")
    ap.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run_one:
        return run_one(all_checks, check_function, a.run_one, a.result)
    checks = list(all_checks)
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {c.name for c in all_checks}]
        if unknown:
            print(f"gpu-check: unknown check(s) {', '.join(unknown)}; known: {', '.join(c.name for c in all_checks)}",
                  file=sys.stderr)
            return 2
        checks = [c for c in all_checks if c.name in names]
    if a.group:
        groups = [g.strip() for g in a.group.split(",") if g.strip()]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            print(f"gpu-check: unknown group(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}", file=sys.stderr)
            return 2
        checks = [c for c in checks if c.group in groups]
    if a.dry_run:
        return dry_run(checks, all_checks)
    reason = no_gpu_reason()
    if reason:
        print(f"gpu-check: {reason}", file=sys.stderr)
        return 2
    info = machine_info()
    print(f"gpu-check: {info['gpu']}, driver {info['driver']}, torch {info['torch']}, triton {info['triton']}", flush=True)
    start = time.monotonic()
    logs = os.path.join(REPO, ".cache", "gpu_check_logs")
    os.makedirs(logs, exist_ok=True)
    results = []
    for group in GROUPS:  # each group under its own time limit (one GPU lease of 10 minutes)
        mine = [c for c in checks if c.group == group]
        if not mine:
            continue
        limit = GROUP_LIMIT_S
        if a.budget is not None:
            limit = min(limit, a.budget - (time.monotonic() - start))
        for r in run_checks(mine, total_limit_s=limit, log=lambda line: print(line, flush=True), log_dir=logs):
            results.append(dict(r, group=group, commit=info["commit"]))
        # Written after every group, so that a lease ending mid-run keeps the groups already done.
        report = dict(info=info, checks=results, total_s=time.monotonic() - start)
        md, js = write_report(report, a.out, merge=True, order=[c.name for c in all_checks])
    print(f"report: {os.path.relpath(md, REPO)} and {os.path.relpath(js, REPO)}; check logs in {os.path.relpath(logs, REPO)}/")
    return 0 if all(r["status"] == "pass" for r in results) else 1
