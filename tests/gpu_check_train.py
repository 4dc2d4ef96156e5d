"""train_gpt.py's own run (train_gpt.main, what `torchrun train_gpt.py` runs), recorded for the GPU check's
speedrun-default check (tests/gpu_check.py): every step's losses and a sample of every parameter after it,
the device's milliseconds per step, the host dispatches of one step under torch.profiler, the CUDA graphs'
state after the compile warm-up, the losses of the warm-up's own steps, and the parameters before the
first step and after the last.

    torchrun --standalone --nproc_per_node=1 tests/gpu_check_train.py --record R.json --tensors P.pt \\
        [--profile_step N] -- [train_gpt.py's flags]

Nothing of train_gpt.py is changed: Trainer.step (the step train() runs, the warm-up's too) is wrapped
here, and records around the call. The samples are read on the device after each step (an index_select
per parameter, no host wait); the profiled step is left out of the milliseconds. R.json is written when
the run ends, also when it fails (then with "error" and the whole "traceback"); P.pt holds the tensors
(rank 0 only). train_gpt.py names used: main, Trainer.step (its `warm_up` keyword, its (plan, losses)
return), Trainer's model / args / dist_info / graphs, StepGraphs.captured / failure, use_cuda_graphs, plan_step
(batch_tokens, windows), warmup_steps, total_steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SAMPLE = 4096  # entries of each parameter read after every step (all of a smaller one)


def dispatch_counts(events) -> dict:
    """Host dispatches in a torch.profiler run's events: aten ops (every aten:: call, nested ones too, as
    tests/benchmarks/host_dispatch.py counts them), kernel launches, CUDA graph launches, and the
    asynchronous copies and fills the host queued (CUDA runtime and driver calls by name)."""
    launches = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
    copies = ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaMemset")
    out = dict(aten_ops=0, kernel_launches=0, graph_launches=0, copies=0)
    for e in events:
        name = e.name
        if name.startswith("aten::"):
            out["aten_ops"] += 1
        elif name in launches:
            out["kernel_launches"] += 1
        elif name in ("cudaGraphLaunch", "cuGraphLaunch"):
            out["graph_launches"] += 1
        elif name in copies:
            out["copies"] += 1
    out["host_dispatches"] = out["kernel_launches"] + out["graph_launches"] + out["copies"]
    return out


class Recorder:
    """What the wrapped Trainer.step records (see the module docstring)."""

    def __init__(self, profile_step: int):
        self.profile_step = profile_step
        self.trainer = None
        self.steps, self.warmup, self.samples, self.events = [], [], [], []
        self.index, self.names, self.first, self.graphs, self.dispatch = None, [], None, None, None

    def sample(self, model):
        """Every parameter's sampled entries, flattened into one fp32 device tensor (no host wait)."""
        import torch
        params = [p for _, p in model.named_parameters()]
        if self.index is None:  # fixed entries per parameter, drawn on the device
            self.names = [(n, min(p.numel(), SAMPLE)) for n, p in model.named_parameters()]
            self.index = []
            for i, p in enumerate(params):
                g = torch.Generator(device=p.device).manual_seed(i)
                n = p.numel()
                self.index.append(torch.arange(n, device=p.device) if n <= SAMPLE
                                  else torch.randint(0, n, (SAMPLE,), device=p.device, generator=g))
        return torch.cat([p.detach().reshape(-1).index_select(0, i).float() for p, i in zip(params, self.index)])

    def step(self, original, trainer, args, kwargs):
        import torch
        self.trainer = trainer
        step = args[0] if args else kwargs["step"]
        if kwargs.get("warm_up", False):
            plan, losses = original(trainer, *args, **kwargs)
            self.warmup.append((step, losses.detach().clone()))
            return plan, losses
        import train_gpt as T
        cuda = trainer.dist_info.device.type == "cuda"
        if self.first is None:  # the timed run's first step: the graphs as the warm-up left them, the weights
            g = trainer.graphs
            self.graphs = dict(enabled=T.use_cuda_graphs(trainer.args, trainer.dist_info.device), kept=g is not None,
                               captured=g.captured() if g is not None else 0,
                               failure=g.failure if g is not None else "")
            self.first = {n: p.detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters()}
            self.sample0 = self.sample(trainer.model)
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        t = time.perf_counter()
        if step == self.profile_step:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                plan, losses = original(trainer, *args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
            self.dispatch = dict(dispatch_counts(prof.events()), step=step,
                                 wall_ms=1000 * (time.perf_counter() - t))
        else:
            plan, losses = original(trainer, *args, **kwargs)
        host_ms = 1000 * (time.perf_counter() - t)
        end = None
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.events.append((start, end))
        self.samples.append(self.sample(trainer.model))
        self.steps.append(dict(step=step, batch_tokens=plan.batch_tokens, windows=list(plan.windows), host_ms=host_ms,
                               profiled=step == self.profile_step, losses=losses.detach().clone()))
        return plan, losses

    def finish(self, record: dict, tensors_path: str | None, rank: int) -> dict:
        """The record's JSON part (device figures read now), and the tensors saved to tensors_path."""
        import torch
        if self.events and self.events[0][0] is not None:
            torch.cuda.synchronize()
            # from a step's start to the next step's start; the last step: to the end of its launches
            ends = [start for start, _ in self.events[1:]] + [self.events[-1][1]]
            for s, (start, _), end in zip(self.steps, self.events, ends):
                s["device_ms"] = start.elapsed_time(end)
        for s in self.steps:
            next_token, objective = s.pop("losses").tolist()
            s.update(next_token=next_token, objective=objective)
        record.update(steps=self.steps, warmup=[dict(step=st, next_token=l[0], objective=l[1])
                                                for st, l in ((st, l.tolist()) for st, l in self.warmup)],
                      graphs=self.graphs, dispatch=self.dispatch, sample_names=self.names)
        if tensors_path and rank == 0 and self.first is not None:
            final = {n: p.detach().to("cpu", copy=True) for n, p in self.trainer.model.named_parameters()}
            torch.save(dict(first=self.first, final=final, sample0=self.sample0.cpu(),
                            samples=torch.stack(self.samples).cpu()), tensors_path)
        if self.trainer is not None:
            import train_gpt as T
            a = self.trainer.args
            record.update(warmup_steps=T.warmup_steps(a) if a.compile else [], total_steps=T.total_steps(a))
        return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", required=True, help="the record's JSON file (written by rank 0)")
    ap.add_argument("--tensors", default=None, help="the parameters and samples (torch.save, rank 0)")
    ap.add_argument("--profile_step", type=int, default=-1, help="the timed step run under torch.profiler")
    a, rest = ap.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    import train_gpt as T
    rec = Recorder(a.profile_step)
    original = T.Trainer.step

    def step(self, *args, **kwargs):
        return rec.step(original, self, args, kwargs)

    T.Trainer.step = step
    record, t0, code = dict(flags=rest), time.perf_counter(), 0
    rank = int(os.environ.get("RANK", 0))
    try:
        T.main(rest)
    except BaseException as e:  # noqa: BLE001 -- recorded, then raised again
        record.update(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                      traceback=traceback.format_exc())
        code = 1
        if not isinstance(e, Exception):
            raise
    finally:
        record["seconds"] = time.perf_counter() - t0
        try:
            rec.finish(record, a.tensors, rank)
        except Exception:  # noqa: BLE001 -- the run's own error comes first
            record.setdefault("traceback", traceback.format_exc())
            record.setdefault("error", "recording failed")
            code = 1
        if rank == 0:
            with open(a.record, "w") as f:
                json.dump(record, f, indent=1, default=float)
    if code:
        print(record.get("traceback", ""), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
