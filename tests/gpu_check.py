"""The GPU check: every CUDA path of train_gpt.py and triton_kernels.py on one CUDA GPU, then the
speedrun preset's step times, written to records/gpu_check/<date>_<gpu>.md and .json (README "GPU check").

    ./run.sh gpu-check                 # all checks, report under records/gpu_check/
    ./run.sh gpu-check --dry-run       # list the checks and the CUDA paths each covers (any machine)
    ./run.sh gpu-check --only a,b      # some checks (a check run alone gets its whole time cap)

Each check runs in a process of its own (a CUDA error or a hang in one cannot take the others down),
killed at its time cap; the whole run stops starting checks at TOTAL_LIMIT_S so that it ends within
8 minutes. A failing check is reported with its error and the rest still run. Exit status: 0 when
every check passed, 1 otherwise, 2 for bad usage or no CUDA GPU.

Every check declares what it covers: the @triton.jit kernels, the `torch.library.custom_op`s and
the functions holding a CUDA-only branch (`cuda_paths` finds them in the source);
tests/test_gpu_check.py fails when a path is covered by no check.

Imports here are the standard library's only: the list, the coverage scan and the report writer
run on any Python; torch is imported by the checks themselves.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
SOURCES = ("train_gpt.py", "triton_kernels.py")
RECORDS = os.path.join(REPO, "records", "gpu_check")
SHARD_DIR = os.path.join(REPO, ".cache", "gpu_check_shards")  # ignored (.gitignore: .cache/)
TOTAL_LIMIT_S = 450.0   # no check starts later than this; caps are cut to fit (8 minutes in all)
GPUS_PROJECTED = 8      # the record's machine


# ----------------------------------------------------------------------------------------------
# The checks: name, time cap, what each proves, what it covers
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str
    cap_s: float
    what: str
    covers: tuple[str, ...] = ()
    fn: str = ""  # function name in this module; default check_<name with _>


K, OP = "kernel:", "op:speedrun::"
TK, TG = "cuda:triton_kernels.py:", "cuda:train_gpt.py:"

CHECKS: tuple[Check, ...] = (
    Check("triton-symmetric", 40, "XXT, XTX, ba_plus_cAA on the NorMuon banks (60x256x768, 20x768x768, 22x3072x768) "
          "in bf16 and fp32 against float64; outputs bitwise symmetric; Polar Express on CUDA against the CPU path",
          (K + "_sym_mm_kernel", OP + "xxt", OP + "xtx", OP + "ba_plus_caa", TK + "_cuda_sm_count",
           TK + "_num_programs", TK + "_check_runnable", TK + "_sym_config", TK + "XXT", TK + "XTX",
           TK + "ba_plus_cAA", TG + "_gram_of", TG + "_poly_of_gram")),
    Check("triton-mlp", 40, "relu2_mlp forward and backward (49152 x 768 -> 3072) in bf16 and fp32 against float64",
          (K + "_mm_epilogue_kernel", K + "_grouped_tile", OP + "relu2_mlp_fwd", OP + "relu2_mlp_bwd",
           TK + "_mm_config", TK + "relu2_mlp", TK + "relu2_mlp_backward")),
    Check("triton-cross-entropy", 40, "softcapped_ce_mtp (8192 x 50304, 3 MTP weights, the prefix term) loss and the "
          "record's gradient in bf16 and fp32 against the float64 reference, and against its CPU twin run on the GPU",
          (K + "_ce_mtp_kernel", K + "_tanh", K + "_round_to_bf16", K + "_softcap_sigma", OP + "softcapped_ce_mtp_fwd",
           OP + "softcapped_ce_mtp_rows", TK + "_ce_config", TK + "softcapped_ce_mtp")),
    Check("triton-transpose", 30, "transpose_copy and transpose_add of the LM head (768 x 50304) in bf16 and fp32, exact",
          (K + "_transpose_kernel", OP + "transpose_copy", OP + "transpose_add", TK + "_launch_transpose",
           TK + "transpose_copy", TK + "transpose_add")),
    Check("fp8-up", 30, "relu2_fp8_up kernel (49152 x 768 -> 3072, e4m3) against its torch reference",
          (K + "_fp8_relu2_kernel", TK + "_fp8_up_config", TK + "relu2_fp8_up")),
    Check("fp8-matmul", 30, "fp8_mm / fp8_matmul (LM head, 16384 x 768 x 50304) forward and backward through "
          "torch._scaled_mm against the op's emulation",
          (OP + "fp8_mm", OP + "fp8_mm_backward", TG + "_native_fp8", TG + "_scaled_matmul")),
    Check("fp8-mlp", 30, "FP8MLPState / speedrun::fp8_mlp (16384 x 768 -> 3072) forward and backward against "
          "its emulation and float64",
          (OP + "fp8_mlp",)),
    Check("flex-attention", 60, "flex_attention forward and backward (compiled) against SDPA with "
          "dense_attention_mask: causal, window, documents, paired slots",
          (TG + "GPT._attend",)),
    Check("compiled-model", 180, "the speedrun model (FP8 on) compiled against eager: loss and every gradient",
          (TG + "GPT._attend", TG + "GPT.forward", TG + "Batch.to")),
    Check("sync-free-step", 90, "training steps under torch.cuda.set_sync_debug_mode('error'): "
          "test_training_step_never_waits_for_the_gpu (eager), then compiled model and optimizer with FP8 "
          "re-quantisation",
          (TG + "train_step", TG + "hyperparam_tensors", TG + "_adam_update_sliced",
           TG + "build_optimizer")),
    Check("normuon-nccl", 60, "NorMuonAdam on a single-rank NCCL group (and 2 ranks where 2 GPUs exist) "
          "against the single-process result",
          (TG + "setup_distributed", TG + "ShardExchange._plan_sparse")),
    Check("train-script", 60, "train_gpt.py --preset test through torchrun on this GPU (FP8, NCCL, run log)",
          (TG + "train", TG + "RunLog.__init__", TG + "cuda_synchronize", TG + "compute_dtype")),
    Check("speedrun-timing", 440, "the speedrun preset on one GPU (accumulation 8), generated shards: 2 warm-up + "
          "4 timed steps per stage; compile time, ms/step, tokens/s, MFU, peak memory, projections",
          ()),
)


def check_function(check: Check):
    return globals()[check.fn or "check_" + check.name.replace("-", "_")]


# ----------------------------------------------------------------------------------------------
# Coverage: every CUDA path in the two modules
# ----------------------------------------------------------------------------------------------

def _qualnames(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, outer ones first."""
    spans = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno, child.end_lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)
    walk(tree, "")
    return spans


def _is_cuda_marker(node: ast.AST) -> bool:
    """x.is_cuda, torch.cuda.*, a "cuda..." string (device.type == "cuda", "cuda:nccl"), a comparison
    with "cpu", and calls of _native_fp8 or flex_attention: the ways the two modules branch to GPU-only code."""
    if isinstance(node, ast.Attribute):
        if node.attr == "is_cuda":
            return True
        if node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch":
            return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"cuda(:.*)?", node.value):
        return True
    if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "cpu"
                                             for c in (node.left, *node.comparators)):
        return True  # device.type == "cpu" / != "cpu": the other side of the branch is the GPU's
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in ("_native_fp8", "flex_attention")
    return False


def cuda_paths(sources: dict[str, str]) -> set[str]:
    """Every CUDA path of the given {file name: source}: "kernel:<name>" per @triton.jit function,
    "op:<namespace::name>" per torch.library.custom_op, "cuda:<file>:<function>" per function (the
    innermost one) holding a CUDA marker (_is_cuda_marker); "<module>" for top-level code."""
    found = set()
    for fname, text in sources.items():
        tree = ast.parse(text)
        spans = _qualnames(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    dotted = ast.unparse(target)
                    if dotted in ("triton.jit", "jit"):
                        found.add(K + node.name)
                    if dotted.endswith("custom_op") and isinstance(dec, ast.Call) and dec.args:
                        found.add("op:" + ast.literal_eval(dec.args[0]))
            if _is_cuda_marker(node):
                inner = [s for s in spans if s[0] <= node.lineno <= s[1]]
                name = max(inner, key=lambda s: s[0])[2] if inner else "<module>"
                found.add(f"cuda:{fname}:{name}")
    return found


def repo_sources() -> dict[str, str]:
    return {name: open(os.path.join(REPO, name), encoding="utf-8").read() for name in SOURCES}


def coverage(checks=CHECKS, sources=None) -> tuple[set[str], set[str]]:
    """(CUDA paths no check covers, covered names that are no CUDA path: renamed or removed)."""
    paths = cuda_paths(sources if sources is not None else repo_sources())
    covered = {c for check in checks for c in check.covers}
    return paths - covered, covered - paths


# ----------------------------------------------------------------------------------------------
# Generated shards, projections, the report
# ----------------------------------------------------------------------------------------------

def make_shards(directory: str, num_shards: int = 2, tokens_per_shard: int = 4_000_000, seed: int = 0,
                mean_doc_len: int = 1000, vocab: int = 50257) -> list[str]:
    """Random-token training shards in the repo's format (train_gpt.write_shard): documents of
    geometric lengths (mean mean_doc_len, at least 2 tokens), each starting with BOS. Returns the paths
    (fineweb_train_<i>.bin); shards already there with the right size are kept."""
    import numpy as np
    sys.path.insert(0, REPO)
    import train_gpt as T
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(num_shards):
        path = os.path.join(directory, f"fineweb_train_{i:06d}.bin")
        paths.append(path)
        if os.path.exists(path) and os.path.getsize(path) == T.SHARD_HEADER_BYTES + 2 * tokens_per_shard:
            continue
        tokens = rng.integers(0, T.BOS_ID, tokens_per_shard, dtype=np.int64)  # never BOS inside a document
        lengths = np.maximum(rng.geometric(1.0 / mean_doc_len, tokens_per_shard // 2 + 1), 2)
        starts = np.cumsum(lengths) - lengths
        tokens[starts[starts < tokens_per_shard]] = T.BOS_ID
        T.write_shard(path, tokens)
    return paths


def project(stages: list[dict], gpus: int = GPUS_PROJECTED) -> dict:
    """Training time of the whole schedule from measured stages (steps x ms/step, validation excluded):
    on this GPU, and on `gpus` GPUs with the same per-GPU speed, where each GPU does 1/gpus of a step's
    micro-batches (accumulation 8 -> 8/gpus) and communication costs nothing, so a lower bound."""
    this = sum(s["steps"] * s["ms"] for s in stages) / 1000
    return {"this_gpu_s": this, f"{gpus}_gpus_s": this / gpus, "steps": sum(s["steps"] for s in stages)}


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
        f"- code: commit {info['commit']}",
        f"- result: {passed} of {len(results)} checks passed in {report['total_s']:.0f} s",
        "",
        "| check | result | seconds | figures |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        figures = r.get("summary") or ""
        if r["status"] != "pass" and r.get("error"):
            figures = (figures + "; " if figures else "") + r["error"]
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {figures.replace('|', '/')} |")
    timing = next((r for r in results if r["name"] == "speedrun-timing" and r.get("data", {}).get("stages")), None)
    if timing:
        t = timing["data"]
        lines += ["", "## Speedrun preset on this GPU", "",
                  f"{t['world_size']} GPU, accumulation {t['accumulation']}, {t['warmup']} warm-up + {t['steps']} "
                  f"timed steps per stage; MFU against {_fmt(t['peak_tflops'], '.1f', 'unknown')} TFLOP/s dense bf16.",
                  "", "| stage | steps | batch tokens | warm-up s (compile) | ms/step | tokens/s | GFLOP/token | MFU |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in t["stages"]:
            lines.append(f"| {s['stage']} | {s['steps']} | {s['batch']:,} | {s['warmup_s']:.1f} | {s['ms']:.1f} | "
                         f"{s['tokens_per_s']:,.0f} | {s['flops_per_token'] / 1e9:.3f} | "
                         f"{_fmt(s.get('mfu') and 100 * s['mfu'], '.1f')}{'%' if s.get('mfu') else ''} |")
        p = t.get("projection")
        if p:
            lines += ["", f"- stages measured: {len(t['stages'])} of {t['stages_total']}"
                      + ("" if len(t["stages"]) == t["stages_total"] else " (projection covers those only)"),
                      f"- compile and warm-up: {sum(s['warmup_s'] for s in t['stages']):.0f} s",
                      f"- projected training time, {p['steps']} steps: {p['this_gpu_s']:.0f} s on this GPU, "
                      f"{p[f'{GPUS_PROJECTED}_gpus_s']:.1f} s on {GPUS_PROJECTED} such GPUs (no communication counted)"]
        if t.get("peak_allocated_gib") is not None:
            lines.append(f"- peak memory: {t['peak_allocated_gib']:.2f} GiB allocated, "
                         f"{t['peak_reserved_gib']:.2f} GiB reserved")
    return "\n".join(lines) + "\n"


def write_report(report: dict, folder: str = RECORDS) -> tuple[str, str]:
    md, js = report_paths(report["info"], folder)
    atomic_write(js, json.dumps(report, indent=1, sort_keys=True) + "\n")
    atomic_write(md, render_markdown(report))
    return md, js


def machine_info() -> dict:
    import platform
    import torch
    import triton
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (no nvidia-smi)"
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                                text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return dict(date=datetime.date.today().isoformat(), gpu=props.name, capability=f"{props.major}.{props.minor}",
                sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                gpu_count=torch.cuda.device_count(), driver=driver, cuda=torch.version.cuda, torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(), commit=commit)


# ----------------------------------------------------------------------------------------------
# Running: one process per check, with a time cap
# ----------------------------------------------------------------------------------------------

def default_command(check: Check, result_path: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--run-one", check.name, "--result", result_path]


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b|^\w+\.\w+Error", ln)]
    return (errors or lines or ["no output"])[-1][:400]


def run_checks(checks, command=default_command, total_limit_s: float = TOTAL_LIMIT_S, log=print,
               log_dir: str | None = None) -> list[dict]:
    """Run each check in its own process, capped at min(its cap, time left of total_limit_s); a check
    with under 5 s left is skipped. Returns one dict per check: name, status (pass / fail / timeout /
    skipped), seconds, summary, error, data (what the check wrote, even when it did not finish)."""
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in checks:
            left = total_limit_s - (time.monotonic() - start)
            r = dict(name=check.name, status="skipped", seconds=0.0, summary="", error="", data={})
            if left < 5:
                r["error"] = f"not started: the {total_limit_s:.0f} s limit of the whole check was reached"
                results.append(r)
                log(f"{check.name:22s} skipped")
                continue
            cap = min(check.cap_s, left)
            result_path = os.path.join(tmp, check.name + ".json")
            out_path = os.path.join(log_dir or tmp, check.name + ".log")
            t0 = time.monotonic()
            with open(out_path, "w") as out:
                proc = subprocess.Popen(command(check, result_path), stdout=out, stderr=subprocess.STDOUT,
                                        cwd=REPO, start_new_session=True)
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
            elif code == 0:
                r["status"] = "pass"
            else:
                r["status"], r["error"] = "fail", _last_error_line(output)
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


def run_one(name: str, result_path: str | None) -> int:
    check = next((c for c in CHECKS if c.name == name), None)
    if check is None:
        print(f"gpu_check: no check named {name!r}; --dry-run lists them", file=sys.stderr)
        return 2
    sys.path[:0] = [REPO, TESTS]
    res = Result(result_path)
    try:
        check_function(check)(res)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# Helpers shared by the checks
# ----------------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in float64; inf when got has a NaN or inf."""
    import torch
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _gen(seed: int):
    import torch
    return torch.Generator(device="cuda").manual_seed(seed)


# Tolerances, relative Frobenius error against float64 (METHOD: bf16 operands land between 1e-3 and
# 1e-2, fp32 far under 1e-3).
TOL = {"bf16": 1e-2, "fp32": 1e-4}


def _dtypes():
    import torch
    return (("bf16", torch.bfloat16), ("fp32", torch.float32))


# ----------------------------------------------------------------------------------------------
# The checks (each runs in its own process, on cuda:0)
# ----------------------------------------------------------------------------------------------

def check_triton_symmetric(res: Result) -> None:
    import torch
    import train_gpt as T
    import triton_kernels as tk
    worst = {}
    banks = {"qk": (60, 256, 768), "vo": (20, 768, 768), "mlp": (22, 3072, 768)}
    for dname, dtype in _dtypes():
        g = _gen(0)
        for bank, shape in banks.items():
            A = (torch.randn(shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(dtype)
            left = shape[1] <= shape[2]
            n = shape[1] if left else shape[2]
            out = torch.full((shape[0], n, n), float("nan"), device="cuda", dtype=dtype)
            (tk.XXT if left else tk.XTX)(A, out)
            A64 = A.double()
            ref = A64 @ A64.mT if left else A64.mT @ A64
            e = rel_err(out, ref)
            require(e < TOL[dname], f"{'XXT' if left else 'XTX'} {bank} {dname}: relative error {e:.2e}")
            require(torch.equal(out, out.mT), f"{'XXT' if left else 'XTX'} {bank} {dname}: not bitwise symmetric")
            worst[f"{'xxt' if left else 'xtx'}_{bank}_{dname}"] = e
            S = (out.double() / out.double().norm(dim=(-2, -1), keepdim=True) * 4).to(dtype)  # symmetric input
            out2 = torch.full_like(S, float("nan"))
            tk.ba_plus_cAA(S, -2.7, 3.9, out2)
            S64 = S.double()
            e = rel_err(out2, -2.7 * S64 @ S64 + 3.9 * S64)
            require(e < TOL[dname], f"ba_plus_cAA {bank} {dname}: relative error {e:.2e}")
            require(torch.equal(out2, out2.mT), f"ba_plus_cAA {bank} {dname}: not bitwise symmetric")
            worst[f"aa_{bank}_{dname}"] = e
    # Polar Express end to end: the kernels' path on the GPU against the CPU's bmm path, both bf16
    g = _gen(1)
    for bank, shape in banks.items():
        G = torch.randn((4, *shape[1:]), device="cuda", generator=g)
        e = rel_err(T.polar_express(G), T.polar_express(G.cpu()).cuda())
        require(e < 5e-2, f"polar_express {bank}: CUDA vs CPU relative difference {e:.2e}")  # 5 bf16 iterations
        worst[f"polar_express_{bank}"] = e
    res.set(errors=worst, summary=f"worst relative error bf16 {max(v for k, v in worst.items() if 'bf16' in k):.1e}, "
            f"fp32 {max(v for k, v in worst.items() if 'fp32' in k):.1e}; Polar Express CUDA vs CPU "
            f"{max(v for k, v in worst.items() if 'polar' in k):.1e}")


def check_triton_mlp(res: Result) -> None:
    import torch
    import triton_kernels as tk
    T_, D, H = 49152, 768, 3072  # stage 3's tokens per micro-batch on one GPU
    errs = {}
    for dname, dtype in _dtypes():
        g = _gen(2)
        x = torch.nn.functional.rms_norm(torch.randn(T_, D, device="cuda", generator=g), (D,)).to(dtype)
        w_up = ((torch.rand(H, D, device="cuda", generator=g) * 2 - 1) * (3 / D) ** 0.5 * 0.5).to(dtype)
        w_down = (0.05 * torch.randn(H, D, device="cuda", generator=g)).to(dtype)
        dy = torch.randn(T_, D, device="cuda", generator=g).to(dtype)
        ins = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
        y = tk.relu2_mlp(*ins)
        y.backward(dy)
        ref_ins = [t.double().requires_grad_() for t in (x, w_up, w_down)]
        y64 = tk.relu2_mlp_reference(*ref_ins)
        y64.backward(dy.double())
        for what, got, want in (("y", y, y64), ("dx", ins[0].grad, ref_ins[0].grad),
                                ("dw_up", ins[1].grad, ref_ins[1].grad), ("dw_down", ins[2].grad, ref_ins[2].grad)):
            e = rel_err(got, want)
            errs[f"{what}_{dname}"] = e
            require(e < TOL[dname], f"relu2_mlp {what} {dname}: relative error {e:.2e}")
        del ins, ref_ins, y, y64
    res.set(errors=errs, summary=f"worst relative error bf16 {max(v for k, v in errs.items() if 'bf16' in k):.1e}, "
            f"fp32 {max(v for k, v in errs.items() if 'fp32' in k):.1e}")


def check_triton_cross_entropy(res: Result) -> None:
    import torch
    import triton_kernels as tk
    T_, V = 8192, 50304
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    pi = torch.tensor(0.25, device="cuda")
    errs = {}
    for dname, dtype in _dtypes():
        g = _gen(3)
        logits = (3 * torch.randn(T_, V, device="cuda", generator=g)).to(dtype)
        targets = torch.randint(0, min(V, 50257), (T_,), device="cuda", generator=g)
        prefix = torch.randint(-1, min(V, 50257), (T_,), device="cuda", generator=g)  # -1: no prefix token
        x = logits.clone().requires_grad_()
        loss = tk.softcapped_ce_mtp(x, targets, w, prefix, pi, grad_scale=0.5)
        loss.sum().backward()  # the kernel's gradient ignores the upstream one (the record's)
        x64 = logits.double().requires_grad_()
        loss64 = tk.softcapped_ce_mtp_reference(x64, targets, w.double(), prefix, pi.double(), grad_scale=0.5)
        loss64.sum().backward()
        errs[f"loss_{dname}"] = e = rel_err(loss, loss64)
        require(e < TOL["fp32"], f"cross-entropy loss {dname}: relative error {e:.2e}")  # the loss is fp32 either way
        errs[f"grad_{dname}"] = e = rel_err(x.grad, x64.grad)
        require(e < TOL[dname], f"cross-entropy gradient {dname}: relative error {e:.2e}")
        twin = logits.clone().requires_grad_()  # the CPU path's torch twin, on the GPU's tensors
        tk.softcapped_ce_mtp_rows(twin, targets, w, prefix, pi, grad_scale=0.5).sum().backward()
        errs[f"twin_grad_{dname}"] = e = rel_err(x.grad, twin.grad)
        require(e < TOL[dname], f"cross-entropy kernel vs its CPU twin {dname}: gradient difference {e:.2e}")
        del x, x64, twin, loss64
    res.set(errors=errs, summary=f"loss {max(errs['loss_bf16'], errs['loss_fp32']):.1e}, gradient bf16 "
            f"{errs['grad_bf16']:.1e}, fp32 {errs['grad_fp32']:.1e}, kernel vs twin {errs['twin_grad_bf16']:.1e}")


def check_triton_transpose(res: Result) -> None:
    import torch
    import triton_kernels as tk
    for dname, dtype in _dtypes():
        g = _gen(4)
        src = torch.randn(768, 50304, device="cuda", generator=g).to(dtype)
        dst = torch.full((50304, 768), float("nan"), device="cuda", dtype=dtype)
        tk.transpose_copy(src, dst)
        require(torch.equal(dst, src.mT), f"transpose_copy {dname}: not exact")
        base = torch.randn(50304, 768, device="cuda", generator=g).to(dtype)
        acc = base.clone()
        tk.transpose_add(src, acc)
        want = (base.float() + src.mT.float()).to(dtype)  # one rounding of the fp32 sum
        require(torch.equal(acc, want), f"transpose_add {dname}: differs from the fp32 sum rounded once "
                f"in {int((acc != want).sum())} elements")
    res.set(summary="bitwise equal in bf16 and fp32")


def check_fp8_up(res: Result) -> None:
    import torch
    import triton_kernels as tk
    T_, D, H = 49152, 768, 3072
    g = _gen(5)
    x = torch.nn.functional.rms_norm(torch.randn(T_, D, device="cuda", generator=g), (D,))
    ax = x.abs().amax()
    x_f8 = (x * (448 / ax)).to(torch.float8_e4m3fn)
    w = (torch.rand(H, D, device="cuda", generator=g) * 2 - 1) / 32
    s1 = w.abs().amax() / 448
    w_f8 = (w / s1).to(torch.float8_e4m3fn)
    dequant = (s1 * ax / 448).float().reshape(1)
    act = torch.full((1,), 0.05, device="cuda")
    post, post_f8, amax = tk.relu2_fp8_up(x_f8, w_f8, dequant, act)
    rp, rq, ra = tk.relu2_fp8_up_reference(x_f8, w_f8, dequant, act)
    e_post, e_q = rel_err(post, rp), rel_err(post_f8.float(), rq.float())
    differ = float((post != rp).double().mean())
    e_amax = abs(float(amax) - float(ra)) / float(ra)
    res.set(post=e_post, post_f8=e_q, post_differs=differ, amax=e_amax,
            summary=f"post {e_post:.1e} ({100 * differ:.3f}% of elements differ), e4m3 copy {e_q:.1e}, amax {e_amax:.1e}")
    # the fp32 sums run in another order, so a few pre values round to the neighbouring bf16
    require(e_post < 1e-3 and differ < 1e-2, f"post: relative error {e_post:.2e}, {100 * differ:.2f}% differ")
    require(e_q < 1e-2, f"post_f8: relative error {e_q:.2e}")
    require(e_amax < 1e-2, f"amax: relative error {e_amax:.2e}")


class _Emulated:
    """Within the block, the FP8 ops take their non-native path: train_gpt's _scaled_matmul emulation
    (dequantise, fp32 matmul) and the up-projection's torch reference instead of the kernel."""

    def __enter__(self):
        import train_gpt as T
        import triton_kernels as tk
        self.saved = (T._native_fp8, tk.relu2_fp8_up)
        T._native_fp8 = lambda device: False

        def up_reference(x_f8, w_up_f8, dequant, act_scale):
            return tk.relu2_fp8_up_reference(x_f8, w_up_f8, dequant, act_scale)
        tk.relu2_fp8_up = up_reference

    def __exit__(self, *exc):
        import train_gpt as T
        import triton_kernels as tk
        T._native_fp8, tk.relu2_fp8_up = self.saved


def check_fp8_matmul(res: Result) -> None:
    import torch
    import train_gpt as T
    require(T._native_fp8(torch.device("cuda")), "this GPU has no FP8 tensor cores (compute capability < 8.9)")
    M, K_, N = 16384, 768, 50304
    g = _gen(6)
    x = T.norm(torch.randn(M, K_, device="cuda", generator=g)).bfloat16()
    w = (0.3 * torch.randn(K_, N, device="cuda", generator=g)).bfloat16() / 20
    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16()
    scales = (T.FP8_HEAD_X_SCALE, T.FP8_HEAD_W_SCALE, T.FP8_HEAD_GRAD_SCALE)

    def run():
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = T.fp8_matmul(a, b, *scales)
        y.backward(dy)
        return y, a.grad, b.grad

    native = run()
    with _Emulated():
        emulated = run()
    errs = {what: rel_err(n, e) for what, n, e in zip(("y", "dx", "dw"), native, emulated)}
    exact = rel_err(native[0], x.double() @ w.double())
    res.set(errors=errs, vs_exact=exact, summary=f"_scaled_mm vs emulation: y {errs['y']:.1e}, dx {errs['dx']:.1e}, "
            f"dw {errs['dw']:.1e}; y vs float64 matmul {exact:.1e}")
    for what, e in errs.items():  # summation order and fast accumulation, then a bf16 rounding
        require(e < 1e-2, f"fp8_matmul {what}: native vs emulation relative difference {e:.2e}")
    require(exact < 0.06, f"fp8_matmul y vs the float64 product: {exact:.2e}")  # e4m3 quantisation


def check_fp8_mlp(res: Result) -> None:
    import torch
    import train_gpt as T
    require(T._native_fp8(torch.device("cuda")), "this GPU has no FP8 tensor cores (compute capability < 8.9)")
    T_, D, H = 16384, 768, 3072
    g = _gen(7)
    x = T.norm(torch.randn(T_, D, device="cuda", generator=g)).bfloat16()
    w_up = ((torch.rand(H, D, device="cuda", generator=g) * 2 - 1) * D ** -0.5).bfloat16()
    w_down = (0.05 * torch.randn(H, D, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(T_, D, device="cuda", generator=g).bfloat16()
    state = T.FP8MLPState(1, H, D).cuda()
    state.quantize(torch.stack([w_up, w_down]), bootstrap=True)
    with torch.no_grad():
        state.mlp(0, x, w_up, w_down)  # sets the delayed activation scale from this input's amax
    act = state.act_scale.clone()

    def run():
        state.act_scale.copy_(act)
        ins = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
        y = state.mlp(0, *ins)
        y.backward(dy)
        return [y] + [t.grad for t in ins]

    native = run()
    with _Emulated():
        emulated = run()
    names = ("y", "dx", "dw_up", "dw_down")
    errs = {n: rel_err(a, b) for n, a, b in zip(names, native, emulated)}
    exact = rel_err(native[0], torch.relu(x.double() @ w_up.double().T) ** 2 @ w_down.double())
    res.set(errors=errs, vs_exact=exact, summary="native vs emulation " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
            + f"; y vs float64 MLP {exact:.1e}")
    for n, e in errs.items():
        require(e < 2e-2, f"fp8_mlp {n}: native vs emulation relative difference {e:.2e}")
    require(exact < 0.08, f"fp8_mlp y vs the float64 MLP: {exact:.2e}")  # the CPU test's bound (tests/test_fp8.py)


def _layout(T_: int, seed: int, mean_doc: int = 700):
    """Document ids (T,) on the GPU for documents of random (geometric) lengths."""
    import numpy as np
    import torch
    lengths = np.random.default_rng(seed).geometric(1.0 / mean_doc, T_)
    starts = np.cumsum(lengths) - lengths
    first = np.zeros(T_, dtype=np.int64)
    first[starts[(starts > 0) & (starts < T_)]] = 1
    return torch.from_numpy(np.cumsum(first)).cuda()


def check_flex_attention(res: Result) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention
    import train_gpt as T
    torch.manual_seed(8)
    flex = torch.compile(flex_attention, dynamic=False)  # the kernel the compiled model runs
    T_, H, hd = 8192, 6, 128
    cases = {  # name: (document ids, window in slots, slots per token)
        "causal": (torch.zeros(T_, dtype=torch.long, device="cuda"), 2 * T_, 1),
        "window 384": (torch.zeros(T_, dtype=torch.long, device="cuda"), 384, 1),
        "documents, window 1408": (_layout(T_, 1), 1408, 1),
        "paired slots, documents, window 640": (_layout(T_, 2), 640, 2),
    }
    errs = {}
    for name, (doc, window, r) in cases.items():
        n, heads = T_ * r, H // r
        w = torch.tensor(window, dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(1, heads, n, hd, device="cuda").bfloat16() for _ in range(3))
        dy = torch.randn(1, heads, n, hd, device="cuda").bfloat16()
        scale = 0.12
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        y = flex(*ins, block_mask=T.block_attention_mask(doc, w, r), scale=scale)
        y.backward(dy)
        mask = T.dense_attention_mask(doc, w, r)
        ref = [t.float().requires_grad_() for t in (q, k, v)]
        y32 = F.scaled_dot_product_attention(*ref, attn_mask=mask, scale=scale)
        y32.backward(dy.float())
        low = [t.clone().requires_grad_() for t in (q, k, v)]  # SDPA in bf16: what bf16 alone costs
        y16 = F.scaled_dot_product_attention(*low, attn_mask=mask, scale=scale)
        y16.backward(dy)
        for what, a, b, c in (("y", y, y32, y16), ("dq", ins[0].grad, ref[0].grad, low[0].grad),
                              ("dk", ins[1].grad, ref[1].grad, low[1].grad), ("dv", ins[2].grad, ref[2].grad, low[2].grad)):
            e, e16 = rel_err(a, b), rel_err(c, b)
            errs[f"{name}: {what}"] = (e, e16)
            require(e < max(2 * e16, 2e-3) and e < TOL["bf16"],
                    f"flex attention {name} {what}: relative error {e:.2e} (SDPA in bf16: {e16:.2e})")
        del ins, ref, low, y, y32, y16, mask
    worst = max(errs.items(), key=lambda kv: kv[1][0])
    res.set(errors={k: v[0] for k, v in errs.items()}, sdpa_bf16={k: v[1] for k, v in errs.items()},
            summary=f"{len(cases)} masks, worst relative error {worst[1][0]:.1e} ({worst[0]}; SDPA in bf16 {worst[1][1]:.1e})")


def check_compiled_model(res: Result) -> None:
    import torch
    import train_gpt as T
    args = T.parse_args(["--preset", "speedrun"])
    torch.manual_seed(0)
    model = T.GPT(args).cuda()
    from test_model import randomize  # generic non-zero weights (zero inits would hide paths)
    randomize(model, seed=1)
    model.set_windows(*args.stage_windows[1])
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    model.fp8_mlp.quantize(model.mlp_bank, bootstrap=True)
    fp8_state = {k: v.clone() for k, v in model.fp8_mlp.state_dict().items()}
    T_ = 4096
    doc = _layout(T_ + 1, 3)
    tokens = torch.randint(0, 50256, (T_ + 1,), device="cuda")
    tokens[torch.nonzero(doc[1:] != doc[:-1]).view(-1) + 1] = T.BOS_ID
    batch = T.make_batch(tokens.cpu().numpy().astype("uint16"), args.bigram_vocab_size).to(torch.device("cuda"))
    mtp = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    prefix = torch.tensor(0.25, device="cuda")
    compiled = torch.compile(model, dynamic=False)

    def run(fn):
        model.zero_grad(set_to_none=True)
        model.fp8_mlp.load_state_dict(fp8_state)  # the forward moves the delayed activation scales
        loss = fn(batch.inputs, batch.targets, batch.cu_seqlens, batch.bigram_ids, mtp_weights=mtp, loss_scale=1 / 8,
                  prefix_weight=prefix)
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_e, grads_e = run(model)
    t = time.perf_counter()
    loss_c, grads_c = run(compiled)
    compile_s = time.perf_counter() - t
    require(set(grads_e) == set(grads_c), f"gradients differ in which parameters get one: {set(grads_e) ^ set(grads_c)}")
    errs = {n: rel_err(grads_c[n], grads_e[n]) for n in grads_e if grads_e[n].abs().max() > 0}
    # a gradient of a few numbers (gates, lambdas) is a sum over every token with cancellation, so its
    # relative error says little: those only have to agree in sign and rough size
    big = {n: e for n, e in errs.items() if grads_e[n].numel() >= 4096}
    small = {n: e for n, e in errs.items() if n not in big}
    worst = max(big.items(), key=lambda kv: kv[1])
    dl = abs(loss_c - loss_e) / abs(loss_e)
    res.set(loss_eager=loss_e, loss_compiled=loss_c, loss_rel=dl, grads=errs, compile_s=compile_s,
            summary=f"loss {loss_e:.4f} eager vs {loss_c:.4f} compiled ({dl:.1e}); worst gradient {worst[1]:.1e} "
            f"({worst[0]}); {len(errs)} gradients; first compiled call {compile_s:.0f} s")
    require(dl < 5e-3, f"compiled loss {loss_c} vs eager {loss_e}: relative difference {dl:.2e}")
    require(worst[1] < 5e-2, f"gradient of {worst[0]}: compiled vs eager relative difference {worst[1]:.2e}")
    for n, e in small.items():
        require(e < 0.5, f"gradient of {n} ({grads_e[n].numel()} numbers): compiled vs eager relative difference {e:.2e}")


def check_sync_free_step(res: Result) -> None:
    import torch
    import train_gpt as T
    import test_training
    test_training.test_training_step_never_waits_for_the_gpu()  # eager, the test as it stands
    res.set(eager="pass")
    # the way train() runs it: compiled model and optimizer, FP8 weights re-quantised after every step
    args = T.parse_args(["--preset", "test", "--compile", "true"])
    device = torch.device("cuda")
    model = T.GPT(args).to(device)
    opt = T.build_optimizer(args, model, device)
    model_fn = torch.compile(model, dynamic=False)
    loader = T.DocumentLoader(args.train_files, args.bigram_vocab_size)
    mtp = torch.zeros(len(args.stage_mtp_start[0]), device=device)
    prefix = torch.zeros((), device=device)
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    slots = T.check_batch_split(args, 1)
    model.fp8_mlp.quantize(model.mlp_bank, bootstrap=True)

    def step(i):
        plan = T.plan_step(args, i)
        batches = loader.next_step(plan.batch_tokens // slots, plan.max_doc_len, slots)
        loss = T.train_step(model_fn, opt, batches, plan, mtp, prefix, T.grad_scale_for(args, 1), device)
        model.fp8_mlp.quantize(model.mlp_bank, bootstrap=i < T.FP8_BOOTSTRAP_STEPS)
        return loss

    step(2), step(3)  # compile stage 2's shapes, both parities: no recompilation below
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(2), step(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    finite = all(bool(torch.isfinite(x)) for x in losses)
    res.set(compiled="pass", summary="eager and compiled steps (NorMuon, then NorMuon + Adam) ran with no host sync")
    require(finite, f"non-finite training loss: {[float(x) for x in losses]}")


def _nccl_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    sys.path[:0] = [REPO, TESTS]
    import torch.distributed as dist
    import train_gpt as T
    d = T.setup_distributed()
    try:
        out = _optimizer_steps(d.device, world_size, rank)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


NCCL_ARGS = ["--preset", "test", "--bank_ownership", "balanced", "--compile", "false"]


def _optimizer_steps(device, world_size: int, rank: int) -> dict:
    """Two optimizer steps (NorMuon, then NorMuon + Adam) of the test preset's model on gradients whose
    mean over ranks is exact in bf16 (multiples of 1/16), so any world size has the same mean gradient."""
    import torch
    import train_gpt as T
    args = T.parse_args(NCCL_ARGS)
    torch.manual_seed(0)
    model = T.GPT(args, world_size).to(device)
    opt = T.build_optimizer(args, model, device)
    params = model.params_by_label()
    for step in range(2):
        for i, (label, p) in enumerate(params.items()):
            gen = torch.Generator().manual_seed(10 * step + i)
            target = torch.randint(-2, 3, p.shape, generator=gen).float() / 16
            rest = [torch.randint(-2, 3, p.shape, generator=gen).float() / 16 for _ in range(world_size - 1)]
            mine = rest[rank] if rank < world_size - 1 else world_size * target - sum(rest, torch.zeros(p.shape))
            p.grad = mine.to(p.dtype).to(device)
        opt.step(do_adam=step == 1)
    T.cuda_synchronize(device)
    return {label: p.detach().cpu() for label, p in params.items()}


def check_normuon_nccl(res: Result) -> None:
    import socket
    import torch
    import torch.multiprocessing as mp
    ref = _optimizer_steps(torch.device("cuda"), 1, 0)  # no process group at all
    summary = []
    sizes = [1] + ([2] if torch.cuda.device_count() >= 2 else [])
    for world in sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_nccl_worker, args=(world, port, tmp), nprocs=world, start_method="spawn")
            got = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
        for r, params in enumerate(got):
            bitwise = all(torch.equal(params[k], ref[k]) for k in ref)
            worst = max((rel_err(params[k].float(), ref[k].float()), k) for k in ref)
            res.set(**{f"ranks_{world}_rank{r}": dict(bitwise=bitwise, worst=worst[0], worst_label=worst[1])})
            if world == 1:  # the same code on the same shapes: nothing may differ
                require(bitwise, f"1-rank NCCL group differs from one process: {worst[1]} by {worst[0]:.2e}")
            else:  # other banks per rank: the kernels' tiles may differ, so rounding may too
                require(worst[0] < 1e-3, f"{world} ranks, rank {r}: {worst[1]} differs by {worst[0]:.2e}")
        summary.append(f"{world} rank(s): " + ("bitwise equal" if all(
            torch.equal(p[k], ref[k]) for p in got for k in ref) else f"within {worst[0]:.1e}"))
    if len(sizes) == 1:
        summary.append("2 ranks: not run (1 GPU)")
    res.set(summary="; ".join(summary))


def check_train_script(res: Result) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               os.path.join(REPO, "train_gpt.py"), "--preset", "test", "--compile", "false", "--run_id", "gpu_check",
               "--log_dir", tmp, "--checkpoint_dir", os.path.join(tmp, "ckpt")]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        log_path = os.path.join(tmp, "gpu_check.txt")
        log = open(log_path).read() if os.path.exists(log_path) else ""
    print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
    require(r.returncode == 0, f"train_gpt.py exited with {r.returncode}: {_last_error_line(r.stderr)}")
    vals = [float(m) for m in re.findall(r"val_loss:([0-9.]+|nan)", log)]
    hardware = re.search(r"^hardware: .*$", log, re.M)
    res.set(val_losses=vals, summary=f"val loss {vals[0]:.3f} -> {vals[-1]:.3f}; "
            f"{hardware.group(0) if hardware else 'no hardware line'}")
    require(hardware and "CPU" not in hardware.group(0), "the run log names no GPU")
    require(len(vals) >= 2 and all(v == v for v in vals) and vals[-1] < vals[0], f"validation losses {vals}")
    require("peak memory allocated" in log, "no peak memory line in the run log")


def check_speedrun_timing(res: Result) -> None:
    import torch
    import train_gpt as T
    sys.path.insert(0, os.path.join(TESTS, "benchmarks"))
    import step_timing
    make_shards(SHARD_DIR)
    args = T.parse_args(["--preset", "speedrun", "--train_files", os.path.join(SHARD_DIR, "fineweb_train_*.bin")])
    d = T.setup_distributed()
    peak = step_timing.peak_tflops(d.device, None)
    warmup, steps = 2, 4
    stages_total = len(step_timing.stage_table(args))
    stages = []

    def publish():
        data = dict(world_size=d.world_size, accumulation=T.check_batch_split(args, d.world_size), warmup=warmup,
                    steps=steps, peak_tflops=peak, stages=stages, stages_total=stages_total,
                    peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
        if stages:
            data["projection"] = project(stages)
            p = data["projection"]
            data["summary"] = (f"{len(stages)} of {stages_total} stages; "
                               + ", ".join(f"{s['stage']} {s['ms']:.0f} ms/step" for s in stages)
                               + f"; projected {p['this_gpu_s']:.0f} s on this GPU, "
                               f"{p[f'{GPUS_PROJECTED}_gpus_s']:.0f} s on {GPUS_PROJECTED}")
        res.set(**data)

    def on_stage(r):
        r["mfu"] = mfu(r["flops_per_token"], r["tokens_per_s"], peak)
        stages.append(r)
        publish()

    publish()
    step_timing.run(dataclasses_replace(args, compile=True), d, steps, warmup, peak, on_stage=on_stage)
    require(len(stages) == stages_total, f"{len(stages)} of {stages_total} stages timed")


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def dry_run(checks) -> int:
    print(f"{len(checks)} checks (each in its own process; the run stops starting checks after {TOTAL_LIMIT_S:.0f} s):")
    for c in checks:
        print(f"  {c.name:22s} cap {c.cap_s:4.0f} s  {c.what}")
        if c.covers:
            print(f"  {'':22s}   covers: {', '.join(c.covers)}")
    uncovered, stale = coverage()
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and their coverage; needs no GPU")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--out", default=RECORDS, help="folder of the report (default records/gpu_check)")
    ap.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run_one:
        return run_one(a.run_one, a.result)
    checks = list(CHECKS)
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {c.name for c in CHECKS}]
        if unknown:
            print(f"gpu-check: unknown check(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CHECKS)}",
                  file=sys.stderr)
            return 2
        checks = [c for c in CHECKS if c.name in names]
    if a.dry_run:
        return dry_run(checks)
    reason = no_gpu_reason()
    if reason:
        print(f"gpu-check: {reason}", file=sys.stderr)
        return 2
    info = machine_info()
    print(f"gpu-check: {info['gpu']}, driver {info['driver']}, torch {info['torch']}, triton {info['triton']}", flush=True)
    start = time.monotonic()
    logs = os.path.join(REPO, ".cache", "gpu_check_logs")
    os.makedirs(logs, exist_ok=True)
    results = run_checks(checks, log=lambda line: print(line, flush=True), log_dir=logs)
    report = dict(info=info, checks=results, total_s=time.monotonic() - start)
    md, js = write_report(report, a.out)
    print(f"report: {os.path.relpath(md, REPO)} and {os.path.relpath(js, REPO)}; check logs in {os.path.relpath(logs, REPO)}/")
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
