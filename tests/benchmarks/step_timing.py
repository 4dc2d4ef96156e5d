"""Timed training steps of every stage of a preset: ms/step, tokens/s, model FLOPs utilisation, peak
memory and the projected time of the whole schedule.

    torchrun --standalone --nproc_per_node=8 tests/benchmarks/step_timing.py     # speedrun preset on 8 GPUs
    python tests/benchmarks/step_timing.py --preset demo --steps 4 --warmup 1    # a CPU: ms/step only
    python tests/benchmarks/step_timing.py --smoke                               # tooling check (tests)
    python tests/benchmarks/step_timing.py --as_rank_of 8                        # one GPU as rank 0 of 8

Each stage (and the extension) runs --warmup untimed steps (compilation happens there) and then
--steps timed ones with that stage's batch size, document length and windows, exactly as in
train_gpt.train(): the same model, optimizer, loader and train_step. The embedding is untied before the
third stage, as in the real run. Validation is not timed (the record clock stops for it too).

Model FLOPs per training token (forward + backward = 3 x forward):
    6 * (P_matrices + P_head) + sum over attention layers of 12 * num_heads * head_dim * keys(layer)
P_matrices counts the real Q, K, V, O, MLP-up and MLP-down matrices (not the zero padding of the
banks), P_head = model_dim * padded_vocab; keys(layer) is the mean number of keys a query attends to
in that layer (sliding window cut at document starts, measured on the stage's batches; x2 on
paired-head layers). Embedding look-ups, norms and the softcap are not counted. MFU divides by the
dense bf16 peak of the GPUs (H100 SXM and H200 SXM: 989 TFLOP/s each; --peak_tflops for others).

--as_rank_of N runs, in one process on one device, exactly rank 0's work of an N-rank run: the model
built for N ranks (banks padded for N), rank 0's micro-batches of each step (micro_batches / N of
them: one on 8 GPUs) and NorMuonAdam on rank 0's shards as ownership over N ranks gives them, its
collectives launched through train_gpt.SimulatedComm, which completes them at once without
communicating and counts the bytes the real N-rank collectives send. Per stage it reports rank 0's
ms/step, the optimizer's share and the bytes sent per step by collective, and projects the N-GPU time
as sum over stages of steps x (rank 0's ms/step + communication ms/step), communication estimated as
the bytes rank 0 sends per step over the bus bandwidth of one GPU (H100 SXM and H200: 450 GB/s per
direction over NVLink, nominal; --bus_gbps for others), not overlapped with compute. On an unknown GPU
or a CPU it reports the bytes only.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import train_gpt as T  # noqa: E402

# Dense bf16 peak per device, by torch.cuda.get_device_name() exactly (NVIDIA's data sheets: the H100
# SXM and the H200 SXM share the same tensor cores and clocks); other GPUs need --peak_tflops.
BF16_PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H200": 989.4}
# NVLink bandwidth per GPU and direction, nominal (NVIDIA's data sheets: 900 GB/s bidirectional on both,
# NVLink 4), for the communication estimate of --as_rank_of.
BUS_GB_PER_S = {"NVIDIA H100 80GB HBM3": 450.0, "NVIDIA H200": 450.0}


def matrix_params(model: T.GPT) -> int:
    """Weights of the real attention and MLP matrices (bank padding excluded)."""
    total = 0
    for label, roles in model.bank_roles.items():
        bank = getattr(model, label)
        total += sum(1 for r in roles if r != "pad") * bank.shape[-2] * bank.shape[-1]
    return total


def mean_keys(cu_seqlens: torch.Tensor, num_tokens: int, window: int, pos_div: int = 1) -> float:
    """Mean over the query slots of the number of key slots they see under tg.attention_mask_mod:
    min(window + 1, slot position in its document + 1); pos_div = 2 is the paired-head layout."""
    doc = T.document_ids(cu_seqlens.long(), num_tokens)
    pos = torch.arange(num_tokens) - cu_seqlens.long()[doc]
    slots = (pos_div * pos[:, None] + torch.arange(pos_div)[None, :]).flatten()
    return float((slots + 1).clamp(max=window + 1).double().mean())


def attention_flops_per_token(model: T.GPT, batches: list[T.Batch]) -> float:
    """Attention score and value FLOPs (forward + backward) per token, averaged over `batches`: per
    query slot and key slot 4 * head_dim per head, x3 with the backward; paired rows have twice the
    slots and half the heads per slot. DC adds the same over its own window."""
    a = model.args
    short, long = (int(w) for w in model.windows.tolist())
    total = 0.0
    for b in batches:
        T_ = b.inputs.numel()
        for i in model.attn_layers:
            row = model.layers[i]
            keys = mean_keys(b.cu_seqlens, T_, long if row.window == "long" else short,
                             2 if row.attention == "paired" else 1)
            if row.dc:
                keys += mean_keys(b.cu_seqlens, T_, a.dc_window - 1)
            total += 12 * a.num_heads * a.head_dim * keys
    return total / len(batches)


def mudd_params(model: T.GPT) -> int:
    """Weights of the MUDD gate and layer MLPs that run per token (both first layers of each, the rows of
    the second layers that are read)."""
    a = model.args
    outputs = (*model.gate_outputs, *T.MUDD_LAYER_OUTPUTS)
    return sum(a.mudd_hidden * (a.model_dim + n) for n in outputs)


def flops_per_token(model: T.GPT, batches: list[T.Batch]) -> float:
    a = model.args
    dense = matrix_params(model) + mudd_params(model) + a.model_dim * a.padded_vocab_size
    return 6 * dense + attention_flops_per_token(model, batches)


def stage_table(args: T.Hyperparameters) -> list[tuple[str, int, int]]:
    """(name, first step, number of steps) of every stage row, the extension last (if it has steps)."""
    bounds = T.stage_bounds(args)
    names = [f"stage {s + 1}" for s in range(len(args.stages) - 1)] + ["extension"]
    return [(name, lo, hi - lo) for name, lo, hi in zip(names, bounds, bounds[1:]) if name != "extension" or hi > lo]


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    return BF16_PEAK_TFLOPS.get(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def bus_gb_per_s(device: torch.device, override: float | None) -> float | None:
    """The bus bandwidth (GB/s per direction per GPU) the communication estimate assumes, or None."""
    if override:
        return override
    return BUS_GB_PER_S.get(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def comm_per_step(before: dict, after: dict, steps: int) -> dict[str, float]:
    """Bytes sent per step by collective, from two snapshots of a CommLayer's bytes_by_op."""
    out = {}
    for (label, op), nbytes in after.items():
        out[op] = out.get(op, 0) + (nbytes - before.get((label, op), 0)) / steps
    return {op: b for op, b in sorted(out.items()) if b}


def rank_projection(stages: list[dict], bus: float | None) -> dict:
    """The whole schedule on N GPUs from rank 0's stages (--as_rank_of N): compute_s = sum of steps x
    rank 0's ms/step; with a bus bandwidth (GB/s), comm_s = sum of steps x bytes per step / bandwidth
    (no overlap with compute) and total_s = compute_s + comm_s; without one, comm_s and total_s are None."""
    compute = sum(s["steps"] * s["ms"] for s in stages) / 1000
    comm = sum(s["steps"] * sum(s["comm_bytes"].values()) for s in stages) / (bus * 1e9) if bus else None
    return dict(compute_s=compute, comm_s=comm, total_s=None if comm is None else compute + comm, bus_gb_per_s=bus,
                steps=sum(s["steps"] for s in stages))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="speedrun", choices=sorted(T.PRESETS))
    ap.add_argument("--steps", type=int, default=30, help="timed steps per stage (rounded up to even: Adam steps on odd ones)")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps per stage before timing (compilation)")
    ap.add_argument("--compile", default="auto", choices=("auto", "true", "false"), help="auto: on CUDA only")
    ap.add_argument("--peak_tflops", type=float, default=None, help="per-device dense bf16 peak for MFU (known: H100 SXM, H200 SXM)")
    ap.add_argument("--smoke", action="store_true", help="test preset, one timed step per stage and no warm-up, on the CPU")
    ap.add_argument("--as_rank_of", type=int, default=None, metavar="N",
                    help="one process times rank 0's work of an N-rank run (collectives simulated, bytes counted)")
    ap.add_argument("--bus_gbps", type=float, default=None,
                    help="per-GPU bus bandwidth, GB/s per direction, for --as_rank_of's estimate (known: H100 SXM, H200)")
    a, rest = ap.parse_known_args(argv)
    if a.steps < 1 or a.warmup < 0:
        raise SystemExit("error: --steps must be >= 1 and --warmup >= 0")
    if a.as_rank_of is not None and a.as_rank_of < 1:
        raise SystemExit("error: --as_rank_of must be >= 1")
    steps = a.steps + a.steps % 2  # whole (no Adam, Adam) pairs
    if a.smoke:
        a.preset, steps, a.warmup, a.compile = "test", 1, 0, "false"
    args = T.parse_args(["--preset", a.preset, *rest])  # any train_gpt flag passes through
    d = T.setup_distributed(force_cpu=a.smoke)
    use_compile = d.device.type == "cuda" if a.compile == "auto" else a.compile == "true"
    args = dataclasses.replace(args, compile=use_compile)
    try:
        run(args, d, steps, a.warmup, peak_tflops(d.device, a.peak_tflops), as_rank_of=a.as_rank_of,
            bus=bus_gb_per_s(d.device, a.bus_gbps))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def profile_summary(prof, steps: int, wall_ms: float, what: str, top: int = 25) -> dict:
    """From a torch.profiler run of `steps` steps that took wall_ms: the GPU busy fraction (union of the
    kernels' intervals over the wall time), kernels and aten ops per step, the top kernels by time,
    the host ops called most often, and where the host's time went (self time per step of aten ops and
    of CUDA runtime calls such as cudaLaunchKernel, cudaHostAlloc or a synchronisation: nested ops are
    not counted twice, so a host-bound step shows what holds it up)."""
    from torch.autograd import DeviceType
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy_us += b - max(a, end)
            end = b
    by_kernel, host = {}, {}
    for e in kernels:
        t, n = by_kernel.get(e.name, (0.0, 0))
        by_kernel[e.name] = (t + (e.time_range.end - e.time_range.start) / 1000, n + 1)
    by_self = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            continue
        if e.name.startswith("aten::"):
            n, t = host.get(e.name, (0, 0.0))
            host[e.name] = (n + 1, t + e.cpu_time_total / 1000)
        n, t = by_self.get(e.name, (0, 0.0))
        by_self[e.name] = (n + 1, t + e.self_cpu_time_total / 1000)
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    top_ops = sorted(host.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(what=what, steps=steps, step_ms=wall_ms / steps, busy=busy_us / 1000 / wall_ms,
                kernels_per_step=len(kernels) / steps, ops_per_step=sum(n for n, _ in host.values()) / steps,
                top_kernels=[(name, ms / steps, n / steps) for name, (ms, n) in top_kernels],
                top_ops=[(name, n / steps, ms / steps) for name, (n, ms) in top_ops],
                top_self=[(name, n / steps, ms / steps)
                          for name, (n, ms) in sorted(by_self.items(), key=lambda kv: -kv[1][1])[:top]])


def optimizer_split(opt, step, device: torch.device, n: int) -> dict:
    """Run step() n times with the device synchronised before and after opt.step; returns the mean wall
    ms of the whole step ("wall" per step too), of the optimizer step, and of the rest."""
    wall, inside = [], []
    plain = opt.step

    def synchronised(*a, **k):
        T.cuda_synchronize(device)
        t = time.perf_counter()
        out = plain(*a, **k)
        T.cuda_synchronize(device)
        inside.append(1000 * (time.perf_counter() - t))
        return out

    opt.step = synchronised
    try:
        for _ in range(n):
            T.cuda_synchronize(device)
            t = time.perf_counter()
            step()
            T.cuda_synchronize(device)
            wall.append(1000 * (time.perf_counter() - t))
    finally:
        del opt.step  # the class's own step again
    total, optimizer = sum(wall) / n, sum(inside) / n
    return dict(wall=wall, step_ms=total, optimizer_ms=optimizer, rest_ms=total - optimizer)


def run(args: T.Hyperparameters, d: T.DistInfo, steps: int, warmup: int, peak: float | None,
        on_stage=None, profile_stage: str | None = None, profile_steps: int = 2, split_steps: int = 2,
        as_rank_of: int | None = None, bus: float | None = None, only: tuple[str, ...] | None = None) -> list[dict]:
    """Times every stage; on_stage(result) is called as each stage finishes (so a caller keeps the
    stages measured before an interruption). warmup_s is the wall time of a stage's warm-up steps,
    its compilation included; graphs_warmup / graphs_timed count the graphs torch.compile made in the
    warm-up and in the timed steps (recompiles: 0 when every shape was compiled in the warm-up).
    profile_stage: after that stage's timed steps, profile_steps more under torch.profiler (CUDA only),
    summarised as result["profile"] (profile_summary). split_steps: after the timed steps, that many
    more with the device synchronised around the optimizer step, for optimizer_ms (its wall time per
    step) and rest_ms (the micro-batches' forward and backward and the rest): on N GPUs the micro-batches
    split N ways but the optimizer's launches and collectives do not (the projections' upper bound).
    as_rank_of: N to time rank 0's work of an N-rank run in this one process (the module's docstring;
    needs no process group); every stage of a run on more than one rank then has comm_bytes (bytes
    rank 0 sends per step by collective), and bus (GB/s) gives the projection's communication estimate.
    only: the names of the stages to time (stage_table's), the others skipped; default all."""
    comm = None
    if as_rank_of is not None:
        if dist.is_initialized():
            raise SystemExit("error: --as_rank_of runs one process standing in for rank 0; start it without torchrun")
        comm = T.SimulatedComm(as_rank_of, 0)
        d = T.DistInfo(0, as_rank_of, d.local_rank, d.device)  # rank 0 of as_rank_of, this device
    accum = T.check_batch_split(args, d.world_size)
    torch.manual_seed(args.seed)
    model = T.GPT(args, d.world_size, dtype=T.compute_dtype(args, d)[0]).to(d.device)
    if dist.is_initialized():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = T.build_optimizer(args, model, d.device, comm=comm)
    loader = T.DocumentLoader(args.train_files, args.ngram_rows, d.rank, d.world_size, d.device)
    trainer = T.Trainer(args, d, model, opt, loader)  # the step train() runs (CUDA graphs where it uses them)
    model.prefix_table.copy_(T.build_prefix_table(T.gpt2_encoding(), args.padded_vocab_size))
    if trainer.fp8:  # as train(): quantised before step 0 and after every step
        model.quantize_fp8(bootstrap=True)
    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)

    say = print if d.is_master else (lambda *_, **__: None)
    ranks = (f"rank 0 of {d.world_size} in one process (collectives simulated)" if comm is not None
             else f"{d.world_size} rank(s)")
    say(f"step timing: {args.num_layers} layers x {args.model_dim}, {ranks} on {d.device.type}, {accum} accumulation step(s), "
        f"compile {args.compile}, {warmup} warm-up + {steps} timed steps per stage")
    results = []
    for name, first, length in stage_table(args):
        if name == "stage 3" and opt.tied:
            opt.untie()
        if only is not None and name not in only:
            continue
        timed_batches, t0 = [], None
        T.cuda_synchronize(d.device)
        t_warm = time.perf_counter()
        counts = [T.compile_counts()]

        def one_step(i):  # train()'s step; the warm-up steps capture the step graphs (CUDA)
            step = first + min(i, length - 1)
            plan = dataclasses.replace(T.plan_step(args, step), do_adam=i % 2 == 1)  # alternate as in the real run
            # as train(): the next step is built on the loader's thread (a stage's steps share a plan's shapes)
            plan, _ = trainer.step(step, plan=plan, next_step=first + min(i + 1, length - 1), warm_up=i < warmup)
            return plan, trainer.batches

        host_s = 0.0  # the timed steps' host time: launching a step, no waiting (nothing in it synchronises)
        for i in range(warmup + steps):
            if i == warmup:
                T.cuda_synchronize(d.device)
                counts.append(T.compile_counts())
                sent = dict(opt.comm.bytes_by_op)
                t0 = time.perf_counter()
            t_launch = time.perf_counter()
            plan, batches = one_step(i)
            if i >= warmup:
                host_s += time.perf_counter() - t_launch
                if len(timed_batches) < 4:
                    timed_batches.extend(batches)
        T.cuda_synchronize(d.device)
        ms = 1000 * (time.perf_counter() - t0) / steps
        counts.append(T.compile_counts())
        comm_bytes = comm_per_step(sent, opt.comm.bytes_by_op, steps)
        split, done = {}, warmup + steps
        if split_steps > 0:
            indices = iter(range(done, done + split_steps))
            split = optimizer_split(opt, lambda: one_step(next(indices)), d.device, split_steps)
            done += split_steps
        profile = None
        if name == profile_stage and d.device.type == "cuda" and profile_steps > 0:
            from torch.profiler import ProfilerActivity, profile as torch_profile
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t_prof = time.perf_counter()
                for i in range(done, done + profile_steps):
                    one_step(i)
                T.cuda_synchronize(d.device)
                wall = 1000 * (time.perf_counter() - t_prof)
            profile = profile_summary(prof, profile_steps, wall, f"{name}, rank {d.rank}")
        if dist.is_initialized():  # the slowest rank sets the pace
            t = torch.tensor([ms], dtype=torch.float64, device=d.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms = float(t)
        fpt = flops_per_token(model, timed_batches)
        results.append(dict(stage=name, steps=length, ms=ms, host_ms=1000 * host_s / steps, batch=plan.batch_tokens,
                            warmup_s=t0 - t_warm,
                            tokens_per_s=plan.batch_tokens / (ms / 1000), flops_per_token=fpt,
                            graphs_warmup=counts[1]["graphs"] - counts[0]["graphs"],
                            graphs_timed=counts[2]["graphs"] - counts[1]["graphs"],
                            graph_breaks=counts[2]["graph_breaks"] - counts[0]["graph_breaks"],
                            cuda_graphs=trainer.graphs.captured() if trainer.graphs is not None else 0,
                            cuda_graphs_off=trainer.graphs.failure if trainer.graphs is not None else ""))
        if split:
            results[-1].update(optimizer_ms=split["optimizer_ms"], rest_ms=split["rest_ms"])
        if d.world_size > 1:
            results[-1]["comm_bytes"] = comm_bytes
        if profile is not None:
            results[-1]["profile"] = profile
        if on_stage is not None:
            on_stage(dict(results[-1]))

    say(f"\n{'stage':10s} {'steps':>6s} {'batch':>9s} {'ms/step':>9s} {'tokens/s':>12s} {'GFLOP/token':>12s} {'MFU':>7s}"
        f" {'graphs (warm-up/timed)':>23s}")
    for r in results:
        mfu = ""
        if peak:
            mfu = f"{r['flops_per_token'] * r['tokens_per_s'] / (d.world_size * peak * 1e12):7.1%}"
            r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / (d.world_size * peak * 1e12)
        say(f"{r['stage']:10s} {r['steps']:6d} {r['batch']:9,d} {r['ms']:9.2f} {r['tokens_per_s']:12,.0f} "
            f"{r['flops_per_token'] / 1e9:12.3f} {mfu:>7s} {r['graphs_warmup']:>11d}/{r['graphs_timed']:<11d}")
    if trainer.graphs is not None:
        say(f"CUDA graphs: {results[-1]['cuda_graphs'] if results else 0} step shapes captured"
            + (f"; off after a failed check: {trainer.graphs.failure}" if trainer.graphs.failure else ""))
    for r in results:
        say(f"{r['stage']}: the host launches a step in {r['host_ms']:.2f} ms of its {r['ms']:.2f} "
            "(near equal: the GPU waits on the host)")
        if "optimizer_ms" in r:
            say(f"{r['stage']}: optimizer step {r['optimizer_ms']:.2f} ms, the rest {r['rest_ms']:.2f} ms per step "
                f"(device synchronised around the optimizer step)")
    for r in results:
        if "comm_bytes" in r:
            say(f"{r['stage']}: rank 0 sends {sum(r['comm_bytes'].values()) / 1e6:.2f} MB per step ("
                + ", ".join(f"{op} {b / 1e6:.2f} MB" for op, b in r["comm_bytes"].items()) + ")")
    total_s = sum(r["steps"] * r["ms"] for r in results) / 1000
    say(f"projected training time of the whole schedule ({T.total_steps(args)} steps, validation excluded): {total_s:.1f} s")
    if comm is not None and results:
        say(rank_projection_line(rank_projection(results, bus), d.world_size))
    say("FLOPs/token = 6*(P_matrices + P_head) + sum_attention_layers 12*num_heads*head_dim*keys(layer)"
        f"  [P_matrices {matrix_params(model):,}, P_head {args.model_dim * args.padded_vocab_size:,}]")
    if d.device.type == "cuda":
        say(f"peak memory (rank 0): allocated {torch.cuda.max_memory_allocated(d.device) / 2**30:.2f} GiB, "
            f"reserved {torch.cuda.max_memory_reserved(d.device) / 2**30:.2f} GiB")
        if not peak:
            say("MFU: unknown GPU peak; pass --peak_tflops (dense bf16 TFLOP/s per device)")
    else:
        import resource
        say(f"peak memory (max RSS of rank 0): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
        say("GPU figures (MFU, the speedrun's ms/step and projected time) need a CUDA GPU: this ran on a CPU.")
    return results


def rank_projection_line(p: dict, world_size: int) -> str:
    """rank_projection's figures in words, with the assumption the estimate makes."""
    head = (f"projected {world_size}-GPU time from rank 0's work ({p['steps']} steps, validation excluded): ")
    if p["total_s"] is None:
        return (head + f"{p['compute_s']:.1f} s of rank 0's steps, communication not estimated (no bus bandwidth "
                "known for this device: bytes only; --bus_gbps gives one)")
    return (head + f"{p['total_s']:.1f} s = {p['compute_s']:.1f} s of rank 0's steps + {p['comm_s']:.1f} s of "
            f"communication, an estimate: the bytes rank 0 sends per step at {p['bus_gb_per_s']:.0f} GB/s per "
            "direction per GPU (nominal), not overlapped with compute")


if __name__ == "__main__":
    main()
