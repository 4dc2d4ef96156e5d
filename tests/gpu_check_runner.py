"""The GPU check's runner and report writer: the command line of tests/gpu_check.py (which holds the
checks and hands them to `main`), one process per check under its time cap, the groups' time limits
and --budget, the lease plan (--plan prints it, --lease N runs its command N: lanes of checks side by
side under one budget), the shared compile caches, and the report, records/gpu_check/<date>_<gpu>.md and
.json, merged into the same day's report of the same GPU and written after every check, also when the
run is stopped by SIGTERM (tests/README.md, "GPU check").

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
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

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
STARTED = time.monotonic()  # the budget of a run counts from here: the interpreter's and torch's start included
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


@dataclass(frozen=True)
class LeaseCommand:
    """One command of a GPU lease's plan (gpu_check.LEASE): its time budget and its lanes of check names.
    The lanes run side by side, each one check after another (lanes[0] the main lane); no check starts
    after budget_s and every cap is cut to what is left of it, so the command ends within budget_s
    (plus the report's writing). A lane's caps must add up to budget_s at most (check_plan)."""
    budget_s: float
    lanes: tuple[tuple[str, ...], ...]
    note: str = ""  # what the command is for, printed by --plan


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


def default_run_lines(data: dict) -> list[str]:
    """speedrun-default's section: both runs (exit, seconds, CUDA graphs, compile warm-up, validation loss,
    ms/step by stage, one step's host dispatches), each step's losses both ways with the worst parameter
    update's difference, the parameters farthest apart after the last step, the timed run against its
    warm-up's, the bounds and what missed them."""
    runs, c = data.get("runs", {}), data.get("comparison") or {}
    lines = ["", "## The default speedrun: train_gpt.py through torchrun", "",
             f"Flags on top of the speedrun preset's defaults: `{' '.join(str(f) for f in data.get('flags', []))}`; the "
             f"eager run adds `{' '.join(data.get('eager_flags', []))}`.", "",
             "| run | exit | seconds | CUDA graphs | compile warm-up | val loss | ms/step by stage (device) | "
             "host dispatches in one step (aten ops) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, r in runs.items():
        g, d = r.get("graphs") or {}, r.get("dispatch") or {}
        graphs = ("off" if not g.get("enabled") else f"{g.get('captured', 0)} captured" if g.get("kept")
                  else f"off after the warm-up: {g.get('failure') or '; '.join(r.get('graphs_notes', []))}")
        ms = " / ".join(f"{k} {v:.0f}" for k, v in (r.get("ms_per_stage") or {}).items()) or "-"
        disp = f"{d['host_dispatches']:,} ({d['aten_ops']:,}) in step {d['step']}" if d else "-"
        vals = r.get("val_losses") or []
        lines.append(f"| {label} | {r['code']} | {r['seconds']:.0f} | {graphs} | {r.get('warmup_line') or '-'} | "
                     f"{_fmt(vals[-1] if vals else None, '.4f')} | {ms} | {disp} |".replace("\n", " "))
    steps = {s["step"]: s for s in (runs.get("graphs") or {}).get("steps", [])}
    eager = {s["step"]: s for s in (runs.get("eager") or {}).get("steps", [])}
    if c.get("steps"):
        lines += ["", "| step | stage | next-token loss (graphs / eager) | objective (graphs / eager) | difference | "
                      "worst update difference (sampled) | ms (graphs / eager) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in c["steps"]:
            g, e = steps.get(row["step"], {}), eager.get(row["step"], {})
            up = f"{row['update'][1]:.1e} ({row['update'][0]})" if "update" in row else "-"
            lines.append(f"| {row['step']} | {g.get('stage', '-')} | {row['next_token'][0]:.4f} / {row['next_token'][1]:.4f} | "
                         f"{row['objective'][0]:.4f} / {row['objective'][1]:.4f} | "
                         f"{max(row['next_token_diff'], row['objective_diff']):.1e} | {up} | "
                         f"{_fmt(g.get('device_ms'), '.0f')} / {_fmt(e.get('device_ms'), '.0f')}"
                         f"{' (profiled)' if g.get('profiled') else ''} |")
    if c.get("final"):
        lines += ["", "- after the last step, the parameters' updates farthest from eager's: "
                  + ", ".join(f"{n} {e:.1e}" for n, e in list(c["final"].items())[:6])]
    if "first_equal" in c:
        lines.append(f"- weights before step 0 the same in both runs: {'yes' if c['first_equal'] else 'no'}")
    if c.get("replay"):
        lines.append(f"- the timed run against the warm-up's own run of the same steps: step 0 {c['replay'][0]:.1e}, "
                     f"worst {max(c['replay']):.1e}")
    if data.get("bounds"):
        lines.append("- bounds: " + ", ".join(f"{k} {v:g}" for k, v in data["bounds"].items()))
    for p in data.get("problems", []):
        lines.append(f"- not met: {p}")
    return lines


def loss_kernel_lines(data: dict) -> list[str]:
    """loss-kernel's section: per case its time, bandwidth and limits (bench_kernels.loss_kernel_limits)."""
    lines = ["", "## The loss kernel alone", "",
             f"{data.get('sms', '-')} SMs at {_fmt(data.get('clock_ghz'), '.2f')} GHz; limits from the kernel's own SASS "
             "(issue: 4 warp instructions per cycle per SM; MUFU: 16 per cycle per SM; memory: the bf16 row read twice "
             "and the gradient written once, at the peak).", "",
             "| rows | gradient | ms | GB/s | of peak | instructions / logit | MUFU / logit | registers | programs / SM | "
             "issue ms | MUFU ms | memory ms | what stops it |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in data.get("kernels", []):
        lim = f.get("limits") or {}
        share = f["gb_per_s"] / f["peak_gbs"] if f.get("peak_gbs") else None
        lines.append(f"| {f['tokens']:,} | {f['gradient']} | {f['ms']:.3f} | {f['gb_per_s']:.0f} | "
                     f"{_fmt(share and 100 * share, '.0f')}{'%' if share else ''} | {_fmt(lim.get('instructions_per_logit'), '.1f')} | "
                     f"{_fmt(lim.get('mufu_per_logit'), '.1f')} | {lim.get('regs', '-')} | {lim.get('programs_per_sm', '-')} | "
                     f"{_fmt(lim.get('issue_ms'), '.2f')} | {_fmt(lim.get('mufu_ms'), '.2f')} | {_fmt(lim.get('memory_ms'), '.2f')} | "
                     f"{lim.get('verdict') or f.get('limits_error', '-')} |")
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
    timing = next((r for r in results if r["name"] == "speedrun-timing"
                   and (r.get("data", {}).get("stages") or r.get("data", {}).get("rank_stages"))), None)
    if timing:  # rank 0 of 8 is timed first: its section stands without the one-GPU stages
        t = timing["data"]
        lines += ["", "## Speedrun preset on this GPU", ""]
    if timing and t.get("stages"):
        lines += [f"{t['world_size']} GPU, accumulation {t['accumulation']}, {t['warmup']} warm-up + {t['steps']} "
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
    if timing:
        lines += rank_lines(t)
    default = next((r for r in results if r["name"] == "speedrun-default" and r.get("data", {}).get("runs")), None)
    if default:
        lines += default_run_lines(default["data"])
    loss = next((r for r in results if r["name"] == "loss-kernel" and r.get("data", {}).get("kernels")), None)
    if loss:
        lines += loss_kernel_lines(loss["data"])
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


class Stopper:
    """What a SIGTERM (the lease ending, `timeout`) does to a run: no check starts after it, and every
    check process running is killed with its process group; the run then writes its report as usual.
    Each lane registers the process it runs here."""

    def __init__(self):
        self.event = threading.Event()
        self.lock = threading.Lock()
        self.active: dict[str, subprocess.Popen] = {}
        self.reason = ""

    def stop(self, reason: str) -> None:
        with self.lock:
            self.reason = self.reason or reason
            self.event.set()
            for proc in self.active.values():
                try:
                    os.killpg(proc.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass

    def handle(self, signum, frame) -> None:  # a signal handler
        self.stop(f"stopped by {signal.Signals(signum).name}")

    def register(self, name: str, proc: subprocess.Popen | None) -> None:
        with self.lock:
            if proc is None:
                self.active.pop(name, None)
            else:
                self.active[name] = proc
                if self.event.is_set():  # stopped while this one was starting
                    os.killpg(proc.pid, 9)


def run_checks(checks, command=default_command, total_limit_s: float = GROUP_LIMIT_S, log=print,
               log_dir: str | None = None, start: float | None = None, stopper: Stopper | None = None,
               on_result=None) -> list[dict]:
    """Run each check in its own process, capped at min(its cap, time left of total_limit_s counted from
    `start` (default: now)); a check with under 5 s left is skipped, and so is every check after a stop
    (stopper). Returns one dict per check: name, status (pass / fail / timeout / skipped), seconds,
    summary, error, traceback (a failure's whole last traceback, after the one the check handed over in
    its data's "traceback", if any; for a timeout the output's end), data (what the check wrote, even when
    it did not finish). on_result(result) is called as each check ends (the report is written there)."""
    start = time.monotonic() if start is None else start
    stopper = stopper or Stopper()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in checks:
            left = total_limit_s - (time.monotonic() - start)
            r = dict(name=check.name, status="skipped", seconds=0.0, summary="", error="", traceback="", data={})
            if stopper.event.is_set() or left < 5:
                r["error"] = (f"not started: the run was {stopper.reason}" if stopper.event.is_set()
                              else f"not started: the {total_limit_s:.0f} s limit of its group was reached")
                results.append(r)
                log(f"{check.name:22s} skipped")
                if on_result:
                    on_result(r)
                continue
            cap = min(check.cap_s, left)
            result_path = os.path.join(tmp, check.name + ".json")
            out_path = os.path.join(log_dir or tmp, check.name + ".log")
            t0 = time.monotonic()
            with open(out_path, "w") as out:
                proc = subprocess.Popen(command(check, result_path), stdout=out, stderr=subprocess.STDOUT,
                                        cwd=REPO, start_new_session=True, env=check_env())
                stopper.register(check.name, proc)
                try:
                    code = proc.wait(timeout=cap)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)  # the check and whatever it started (torchrun workers)
                    proc.wait()
                    code = None
                finally:
                    stopper.register(check.name, None)
            r["seconds"] = time.monotonic() - t0
            if os.path.exists(result_path):
                with open(result_path) as f:
                    r["data"] = json.load(f)
                r["summary"] = r["data"].pop("summary", "")
            handed = r["data"].pop("traceback", "") if isinstance(r["data"], dict) else ""
            output = open(out_path, errors="replace").read()
            if stopper.event.is_set() and code != 0:
                r["status"], r["error"] = "timeout", f"{stopper.reason} after {r['seconds']:.0f} s"
                r["traceback"] = output[-TRACEBACK_CHARS // 4:].strip()
            elif code is None:
                r["status"], r["error"] = "timeout", f"stopped at its {cap:.0f} s cap"
                r["traceback"] = output[-TRACEBACK_CHARS // 4:].strip()
            elif code == 0:
                r["status"] = "pass"
            else:
                r["status"], r["error"] = "fail", last_error_line(output)
                r["traceback"] = last_traceback(output)
            if handed and r["status"] != "pass":
                r["traceback"] = handed.strip() + "\n\n" + r["traceback"]
            results.append(r)
            log(f"{check.name:22s} {r['status']:8s} {r['seconds']:6.1f} s  {r['summary']}"
                + (f"  [{r['error']}]" if r["error"] else ""))
            if on_result:
                on_result(r)
    return results


def run_lanes(lanes, command=default_command, total_limit_s: float = GROUP_LIMIT_S, log=print,
              log_dir: str | None = None, stopper: Stopper | None = None, on_result=None) -> list[dict]:
    """Each lane (a list of checks) in a thread of its own, side by side, its checks one after another
    (run_checks), all under one time limit counted from now. Returns the results, lane by lane."""
    start, stopper = time.monotonic(), stopper or Stopper()
    out = [[] for _ in lanes]

    def lane(i, checks):
        out[i] = run_checks(checks, command, total_limit_s, log, log_dir, start, stopper, on_result)

    threads = [threading.Thread(target=lane, args=(i, checks), daemon=True) for i, checks in enumerate(lanes)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # joined in steps, so the main thread's signal handler can run
        for t in threads:
            t.join(0.2)
    return [r for rs in out for r in rs]


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


def lane_caps(command: LeaseCommand, checks) -> list[float]:
    """The sum of the caps of each lane of `command`."""
    cap = {c.name: c.cap_s for c in checks}
    return [sum(cap.get(name, 0.0) for name in lane) for lane in command.lanes]


def check_plan(lease, checks, limits_s) -> list[str]:
    """What is wrong with the lease plan `lease` (LeaseCommands) against the checks' table and the
    commands' limits (seconds, one per command; the plan's total is their sum): an unknown or repeated
    check, a command over its limit, a lane whose caps exceed its command's budget."""
    names, problems, seen = {c.name for c in checks}, [], set()
    if len(lease) != len(limits_s):
        problems.append(f"{len(lease)} commands, the limits name {len(limits_s)}")
    for i, (cmd, limit) in enumerate(zip(lease, limits_s), 1):
        if cmd.budget_s > limit:
            problems.append(f"command {i}: budget {cmd.budget_s:.0f} s over its limit of {limit:.0f} s")
        if not cmd.lanes or not cmd.lanes[0]:
            problems.append(f"command {i}: no main lane")
        for lane, total in zip(cmd.lanes, lane_caps(cmd, checks)):
            for name in lane:
                if name not in names:
                    problems.append(f"command {i}: no check named {name!r}")
                elif name in seen:
                    problems.append(f"command {i}: {name} is planned twice")
                seen.add(name)
            if total > cmd.budget_s:
                problems.append(f"command {i}: the lane {', '.join(lane)} has {total:.0f} s of caps, over the "
                                f"command's {cmd.budget_s:.0f} s")
    if sum(c.budget_s for c in lease) > sum(limits_s):
        problems.append(f"the commands add up to {sum(c.budget_s for c in lease):.0f} s, over {sum(limits_s):.0f} s")
    return problems


def plan_lines(lease, checks, limits_s) -> list[str]:
    """--plan's text: each command of the lease with the command line that runs it, its lanes, each
    check's cap, the lanes' sums and the command's, and the total against the limits."""
    cap = {c.name: c.cap_s for c in checks}
    total = sum(c.budget_s for c in lease)
    lines = [f"The next GPU lease: {len(lease)} commands on one machine, one after the other; "
             f"{total:.0f} s ({total / 60:.1f} min) of caps in all, the machine's start-up not counted.",
             "Each check runs in a process of its own, stopped at its cap; the lanes of a command run side by "
             "side, the checks of a lane one after another; the report is written after every check."]
    for i, (cmd, limit) in enumerate(zip(lease, limits_s), 1):
        sums = lane_caps(cmd, checks)
        lines += ["", f"command {i} of {len(lease)}: --budget {cmd.budget_s:.0f} s ({cmd.budget_s / 60:.1f} min; "
                      f"limit {limit:.0f} s)" + (f": {cmd.note}" if cmd.note else ""),
                  f"  GPU_CHECK_COMMIT=<hash> ./run.sh gpu-check --lease {i}"]
        for j, (lane, lane_sum) in enumerate(zip(cmd.lanes, sums)):
            lines.append("  main lane:" if j == 0 else f"  beside lane {j} (at the same time as the main lane):")
            lines += [f"    {name:24s} cap {cap.get(name, 0):5.0f} s" for name in lane]
            lines.append(f"    {'sum':24s}     {lane_sum:5.0f} s")
        lines.append(f"  command {i}: {max(sums, default=0):.0f} s of caps (its longest lane), within its "
                     f"{cmd.budget_s:.0f} s budget")
    lines += ["", f"total: {' + '.join(f'{c.budget_s:.0f}' for c in lease)} = {total:.0f} s "
                  f"({total / 60:.1f} min) of {sum(limits_s):.0f} s allowed"]
    planned = {n for cmd in lease for lane in cmd.lanes for n in lane}
    rest = [c.name for c in checks if c.name not in planned]
    if rest:
        lines.append(f"not in the plan (run them with --only): {', '.join(rest)}")
    return lines


def run_and_report(phases, info: dict, out: str, order=(), command=default_command, log=print,
                   log_dir: str | None = None, stopper: Stopper | None = None) -> list[dict]:
    """Run `phases` one after another, each (time limit in s, [lane, ...]) with its lanes side by side
    (run_lanes), and write the report (merged into the same day's report of this GPU) after every check,
    so that a run stopped by its budget or a signal keeps what it measured. A time limit may be a
    function of the seconds already spent (a budget shared by the phases). Returns the results."""
    stopper = stopper or Stopper()
    start, results, lock = time.monotonic(), [], threading.Lock()
    groups = {c.name: c.group for _, lanes in phases for lane in lanes for c in lane}

    def on_result(r):
        with lock:
            results.append(dict(r, group=groups[r["name"]], commit=info["commit"]))
            rank = {name: i for i, name in enumerate(order)}
            report = dict(info=info, checks=sorted(results, key=lambda x: rank.get(x["name"], len(rank))),
                          total_s=time.monotonic() - start)
            write_report(report, out, merge=True, order=order)

    for limit, lanes in phases:
        limit = limit(time.monotonic() - start) if callable(limit) else limit
        run_lanes(lanes, command, limit, log, log_dir, stopper, on_result)
    return results


def no_gpu_reason() -> str | None:
    """One line saying why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return f"{sys.executable} has no torch; run it with PYTHON=/path/to/python that has torch >= 2.11"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__} (torch.cuda.is_available() is False); run it on a machine with one"
    return None


def main(all_checks, check_function, description: str = "", argv=None, lease=(), lease_limits_s=()) -> int:
    """The command line of tests/gpu_check.py, over its table `all_checks` (their functions:
    check_function(check)) and its lease plan `lease` (LeaseCommands, each within its limit of
    lease_limits_s); `description` is its --help text."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and their coverage; needs no GPU")
    ap.add_argument("--plan", action="store_true", help="print the next lease's commands, each check's cap and "
                    "their sums; needs no GPU")
    ap.add_argument("--lease", type=int, default=0, metavar="N", help="run command N of the lease plan (--plan)")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--group", default="", help=f"comma-separated groups ({', '.join(GROUPS)}); default: all")
    ap.add_argument("--out", default=RECORDS, help="folder of the report (default records/gpu_check)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: no check starts later, caps are cut to fit, and the report "
                         "is written after each check (for a GPU lease shorter than the groups together); "
                         "with --lease, instead of the command's own budget")
    ap.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run_one:
        return run_one(all_checks, check_function, a.run_one, a.result)
    if a.plan:
        problems = check_plan(lease, all_checks, lease_limits_s)
        print("\n".join(plan_lines(lease, all_checks, lease_limits_s)))
        for p in problems:
            print(f"plan error: {p}")
        return 1 if problems else 0
    by_name = {c.name: c for c in all_checks}
    checks = list(all_checks)
    if a.lease:
        if a.only or a.group:
            print("gpu-check: --lease runs its command's checks; leave out --only and --group", file=sys.stderr)
            return 2
        if not 1 <= a.lease <= len(lease):
            print(f"gpu-check: --lease {a.lease}: the plan has commands 1 to {len(lease)} (--plan)", file=sys.stderr)
            return 2
        problems = check_plan(lease, all_checks, lease_limits_s)
        if problems:
            print(f"gpu-check: the lease plan is wrong: {'; '.join(problems)}", file=sys.stderr)
            return 2
        cmd = lease[a.lease - 1]
        lanes = [[by_name[n] for n in lane] for lane in cmd.lanes]
        checks = [c for lane in lanes for c in lane]
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
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
    spent = time.monotonic() - STARTED  # the interpreter's start, torch's import, the machine's facts
    if a.lease:
        budget = (cmd.budget_s if a.budget is None else a.budget) - spent
        phases = [(budget, lanes)]
        print(f"gpu-check: lease command {a.lease} of {len(lease)}, {len(lanes)} lane(s), budget {budget:.0f} s",
              flush=True)
    else:  # each group under its own time limit (one GPU lease of 10 minutes), within --budget
        def limit_of(elapsed, budget=None if a.budget is None else a.budget - spent):
            return GROUP_LIMIT_S if budget is None else min(GROUP_LIMIT_S, budget - elapsed)
        phases = [(limit_of, [[c for c in checks if c.group == g]]) for g in GROUPS if any(c.group == g for c in checks)]
    logs = os.path.join(REPO, ".cache", "gpu_check_logs")
    os.makedirs(logs, exist_ok=True)
    stopper = Stopper()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stopper.handle)
    results = run_and_report(phases, info, a.out, [c.name for c in all_checks], log=lambda line: print(line, flush=True),
                             log_dir=logs, stopper=stopper)
    md, js = report_paths(info, a.out)
    print(f"report: {os.path.relpath(md, REPO)} and {os.path.relpath(js, REPO)}; check logs in {os.path.relpath(logs, REPO)}/"
          + (f"; the run was {stopper.reason}" if stopper.event.is_set() else ""))
    return 0 if results and all(r["status"] == "pass" for r in results) else 1
