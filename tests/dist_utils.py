"""Run code on several gloo ranks of this machine, for CPU-only tests of distributed code.

Three ways in:

* `run_on_ranks(fn, world_size, *args, **kwargs)` starts `world_size` processes (fork when that
  is safe, else spawn), joins them into one gloo process group on 127.0.0.1 and calls
  `fn(rank, world_size, *args, **kwargs)` in each; it returns the return values in rank order.
  `fn` must be a module-level function (importable by name, for spawn) and should return CPU
  tensors or plain Python objects. An exception on any rank fails the call with its traceback.
  For several world sizes in one go, create subgroups with `dist.new_group` inside `fn`.

* `run_torchrun(script, nproc_per_node, nnodes=1, script_args=())` launches the real launcher:
  `nnodes` concurrent `torchrun` processes that rendezvous on 127.0.0.1 like separate machines,
  each running `nproc_per_node` workers of `script`. It returns the launchers' CompletedProcess
  objects and fails with their output if any exits non-zero or times out.

* `run_workers(script, nproc, script_args=())` starts the workers torchrun would start, with its
  environment but without the launcher, and returns their output. The workers are children of the
  warm server (warm_python.py), which has imported torch once: no interpreter start-up either.

All pick a free port, limit each worker to one intra-op thread (many ranks share few cores) and
enforce a timeout so a hung collective fails the test instead of hanging it.

`on_call(fn, n, action)` makes something happen to a run (a signal, a kill) in a chosen step, on one
rank or in one process.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import warm_python

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, timeout, fn, args, kwargs, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # Peers then fail in their next collective; keep this root cause for the report.
            with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
                f.write(traceback.format_exc())
            raise
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _root_causes(out_dir: str, world_size: int) -> str:
    parts = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"--- rank {r} ---\n{f.read()}")
    return "\n".join(parts)


_autograd_forks_broken = False  # once broken in this process, they stay broken


def _forked_child_can_backward() -> bool:
    """Whether a child forked from this process can run autograd. It cannot once this process's
    autograd engine has started its worker threads, which a backward through torch.compile's graphs
    does even on a CPU: every backward in such a child raises "Unable to handle autograd's threading
    in combination with fork-based multiprocessing". Asked of a forked child, which runs one backward."""
    global _autograd_forks_broken
    if not _autograd_forks_broken:
        pid = os.fork()
        if pid == 0:  # the child: exit at once, skipping the parent's atexit handlers and buffers
            try:
                torch.ones(1, requires_grad=True).sum().backward()
                code = 0
            except RuntimeError:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        _autograd_forks_broken = os.waitstatus_to_exitcode(status) != 0
    return not _autograd_forks_broken


def _default_start_method() -> str:
    # fork skips re-importing torch in every child (seconds each); it is safe while this process
    # has no CUDA context, no process group and an autograd engine without worker threads.
    # Otherwise start fresh interpreters.
    if (sys.platform == "linux" and not torch.cuda.is_initialized() and not dist.is_initialized()
            and _forked_child_can_backward()):
        return "fork"
    return "spawn"


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0, start_method: str | None = None,
                 **kwargs) -> list:
    """fn(rank, world_size, *args, **kwargs) on `world_size` gloo ranks; return values by rank.

    start_method: 'fork' (default on Linux when safe: fast, fn may be any module-level function
    already imported) or 'spawn' (fresh interpreters; fn must be importable by name).
    """
    port = free_port()
    start_method = start_method or _default_start_method()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, port, timeout, fn, args, kwargs, out_dir),
                                 nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_on_ranks({fn.__name__}, world_size={world_size}) exceeded {timeout:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            causes = _root_causes(out_dir, world_size)
            if causes:
                raise RuntimeError(f"run_on_ranks({fn.__name__}, world_size={world_size}) failed:\n{causes}") from e
            raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _launch_env(env: dict | None) -> dict:
    """This process's environment for a launched script: one intra-op thread, the repository importable,
    then env's entries."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, full_env.get("PYTHONPATH")) if p)
    return full_env


def run_torchrun(script: str, nproc_per_node: int, nnodes: int = 1, script_args=(),
                 timeout: float = 120.0, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Launch `nnodes` torchrun launchers on this machine (static rendezvous on 127.0.0.1)."""
    port = free_port()
    full_env = _launch_env(env)
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node}",
               f"--nproc_per_node={nproc_per_node}", "--master_addr=127.0.0.1", f"--master_port={port}",
               script, *map(str, script_args)]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, None))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"torchrun {script} ({nnodes} nodes x {nproc_per_node}) exceeded {timeout:.0f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for node, r in enumerate(results):
        if r.returncode != 0:
            raise AssertionError(f"torchrun node {node} exited with {r.returncode}:\n{r.stdout[-4000:]}")
    return results


def run_workers(script: str, nproc: int, script_args=(), timeout: float = 120.0, env: dict | None = None,
                grace: float = 5.0) -> str:
    """`nproc` processes of `script` on this machine with the environment torchrun gives its workers (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without the launcher: torchrun
    imports torch before it starts a worker, about 2 s of every launch. Each worker runs as a child of
    warm_python's server, as `python script args...` would, without importing torch again (4 to 6 s a
    worker on a 2-core machine). As torchrun does, once a worker fails the others get SIGTERM once
    `grace` seconds have not stopped them, SIGKILL `grace` seconds later (a worker blocked in a
    collective keeps SIGTERM for its next step), and the call fails with every worker's output. Returns
    the workers' outputs in rank order."""
    port = free_port()
    base = _launch_env(env)
    with tempfile.TemporaryDirectory() as out_dir:
        files = [open(os.path.join(out_dir, f"rank{r}.txt"), "w+") for r in range(nproc)]
        procs = [warm_python.popen([script, *map(str, script_args)], cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                   env=dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                                            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r, f in enumerate(files)]
        deadline, failed_at, signalled = time.monotonic() + timeout, None, 0
        try:
            while None in [p.poll() for p in procs]:  # every worker polled: a failed one's returncode is set
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"{script} on {nproc} workers exceeded {timeout:.0f} s")
                if failed_at is None and any(p.returncode for p in procs):
                    failed_at = now
                if failed_at is not None and now > failed_at + (signalled + 1) * grace and signalled < 2:
                    for p in procs:
                        if p.poll() is None:
                            p.kill() if signalled else p.terminate()
                    signalled += 1
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            outs = []
            for f in files:
                f.seek(0)
                outs.append(f.read())
                f.close()
    if any(p.returncode for p in procs):
        codes = ", ".join(f"rank {r}: {p.returncode}" for r, p in enumerate(procs))
        raise AssertionError(f"{script} on {nproc} workers failed ({codes}):\n"
                             + "\n".join(f"--- rank {r} ---\n{out[-4000:]}" for r, out in enumerate(outs)))
    return "".join(outs)


def in_subgroups(rank: int, world_size: int, phases, worker) -> dict:
    """Run worker(sub_rank, size, group) in every subgroup this rank belongs to, one phase at a time: a
    phase splits the world into consecutive groups of the given sizes (one spawn hosts several world
    sizes). Every rank creates every group, in the same order, as torch.distributed requires. Returns
    {group size: worker's result}."""
    import torch.distributed as dist
    out = {}
    for phase in phases:
        start, mine = 0, None
        for size in phase:
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks) if size < world_size else dist.group.WORLD
            if rank in ranks:
                mine = (size, ranks.index(rank), group)
            start += size
        if mine is not None:
            size, sub_rank, group = mine
            out[size] = worker(sub_rank, size, group)
        dist.barrier()
    return out


def by_group_size(per_rank: list[dict], phases) -> dict:
    """in_subgroups' per-rank results regrouped: {group size: [result of sub-rank 0, 1, ...]}."""
    results = {}
    for phase in phases:
        start = 0
        for size in phase:
            results[size] = [per_rank[r][size] for r in range(start, start + size)]
            start += size
    return results


def on_call(fn, n: int, action):
    """fn, except that its n-th call runs action() first (something that happens to the run in that step)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            action()
        return fn(*args, **kwargs)
    return wrapped
