"""Python processes started without the import: forked from one interpreter that imported torch once.

Every test that runs a script (train_gpt.py on gloo ranks, a benchmark, a bad flag) starts an interpreter
that imports torch, torch._dynamo, triton and NumPy before the script's first line: 4 to 6 CPU-seconds
on a 2-core machine, most of such a test's time. This module keeps a server interpreter that has done
those imports, started with the environment the launched scripts get (one server an environment, at
most MAX_SERVERS), and forks a child of it for each script. The child takes the requested argv,
working directory, environment and output files and runs the script as `python script.py ...` or
`python -c code ...` would: `__main__`, sys.argv, sys.path[0], an uncaught exception's traceback and
exit status 1, `sys.exit`'s status, non-daemon threads joined and atexit handlers run at the end,
signals at their defaults.

The variables that may change from launch to launch (torchrun's RANK, WORLD_SIZE, MASTER_PORT, ...:
PER_LAUNCH_VARIABLES) are set in the child; every other variable is the server's: torch and its
libraries read some (OMP_NUM_THREADS, TORCH_LOGS, ATEN_CPU_CAPABILITY) when they are imported, so a
child could not honour a change. A launch in an environment no server has starts a server for it, or,
once MAX_SERVERS run, a fresh interpreter (with a warning); so does every launch under WARM_PYTHON=0.
Tests that need a fresh interpreter (a copied section of train_gpt.py, whose missing import a preloaded
module could hide; pinned CPU kinds) call subprocess.

    popen(argv, env=None, cwd=None, stdout=file, stderr=file) -> a Popen-like handle (pid, poll, wait,
                                                                 terminate, kill, returncode)
    run(argv, env=None, cwd=None, timeout=None) -> subprocess.CompletedProcess (text, both streams)

argv starts after the interpreter: [script, *args] or ["-c", code, *args].
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import warnings

# Variables that differ from launch to launch of one server, since nothing it imports reads them at
# import time: torchrun's per-worker ones, pytest's current test, and the one inductor sets in the
# test process at its first compilation (a pointer of that process).
PER_LAUNCH_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "PYTEST_CURRENT_TEST",
                                  "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})
PRELOAD = ("numpy", "torch", "torch.distributed", "torch._dynamo", "torch.nn.attention.flex_attention",
           "triton", "triton.language")


# ---- the server: runs in its own interpreter (python warm_python.py) ----------------------------------

def _exit_status(e: SystemExit) -> int:
    """The status the interpreter exits with for an uncaught SystemExit (printing a non-integer code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(request: dict, clean_path: list[str]) -> None:
    """In the forked child: become `python argv...` with the request's files, directory and environment."""
    import atexit
    import runpy
    import types
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd, (path, flags) in enumerate([(os.devnull, os.O_RDONLY), (request["stdout"], os.O_WRONLY | os.O_APPEND),
                                            (request["stderr"], os.O_WRONLY | os.O_APPEND)]):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        if argv[0] == "-c":
            sys.argv, sys.path[:] = ["-c", *argv[2:]], ["", *clean_path]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(argv[0])
            sys.argv, sys.path[:] = list(argv), [os.path.dirname(script), *clean_path]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException:
        kind, error, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.run_path.__code__.co_filename):
            tb = tb.tb_next  # the traceback a fresh interpreter prints: from the script's first frame
        sys.excepthook(kind, error.with_traceback(tb), tb)
    finally:
        try:
            threading._shutdown()  # what the interpreter does at exit: join non-daemon threads
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """Read one JSON request a line from stdin, fork a child for each, answer {"pid"} at once and
    {"pid", "status"} when the child ends. Ends when stdin closes."""
    clean_path = sys.path[1:]  # without this file's folder: a child puts its own script's there
    for name in PRELOAD:
        __import__(name)
    out = sys.stdout
    children: set[int] = set()

    def answer(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    stdin_open, pending = True, b""
    while stdin_open or children:
        ready, _, _ = select.select([0] if stdin_open else [], [], [], 0.02)
        if ready:  # read what the pipe holds: select cannot see lines already in a reader's buffer
            data = os.read(0, 1 << 16)
            stdin_open = bool(data)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, clean_path)
                children.add(pid)
                answer(id=request["id"], pid=pid)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            answer(pid=pid, status=os.waitstatus_to_exitcode(status))


# ---- the client: the test process --------------------------------------------------------------------

class _Server:
    """The running server and a thread that reads its answers."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lock, self.changed = threading.Lock(), threading.Condition()
        self.pids: dict[int, int] = {}      # request id -> pid
        self.status: dict[int, int] = {}    # pid -> exit status
        self.gone = False  # the server has closed its answers (exited)
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "status" in msg:
                    self.status[msg["pid"]] = msg["status"]
                else:
                    self.pids[msg["id"]] = msg["pid"]
                    self.status.pop(msg["pid"], None)  # an earlier child's, whose pid the system reused
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def fork(self, argv, env, cwd, stdout, stderr, timeout=120.0) -> int:
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            self.proc.stdin.write(json.dumps(dict(id=rid, argv=list(argv), env=env, cwd=cwd, stdout=stdout,
                                                  stderr=stderr)) + "\n")
            self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: rid in self.pids or self.gone, timeout):
                raise TimeoutError("the warm Python server did not answer")
            if rid not in self.pids:
                raise RuntimeError("the warm Python server exited")
            return self.pids[rid]

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.gone


_servers: dict[frozenset, _Server] = {}
_servers_lock = threading.Lock()
MAX_SERVERS = 2  # the suite launches with two environments: the tests' own and run_workers' (one thread)


def _server_for(env: dict) -> _Server | None:
    """The server started with env, PER_LAUNCH_VARIABLES aside (started now if need be), or None when the
    launch must start a fresh interpreter."""
    if os.environ.get("WARM_PYTHON", "1") == "0" or not hasattr(os, "fork"):
        return None
    base = {k: v for k, v in env.items() if k not in PER_LAUNCH_VARIABLES}
    key = frozenset(base.items())
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and not server.alive():
            del _servers[key]
            server = None
        if server is None and len(_servers) < MAX_SERVERS:
            server = _servers[key] = _Server(base)
        elif server is None:
            differ = min((sorted(k for k in set(other.env) | set(base) if other.env.get(k) != base.get(k))
                          for other in _servers.values()), key=len)
            warnings.warn(f"warm_python: {MAX_SERVERS} servers run and this launch's environment differs from the "
                          f"nearest one's in {', '.join(differ)}: a fresh interpreter")
        return server


class WarmProcess:
    """A child of the server, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, server: _Server, pid: int, args):
        self.server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.status.get(self.pid)
        return self.returncode

    def wait(self, timeout=None):
        server = self.server
        with server.changed:
            if not server.changed.wait_for(lambda: self.pid in server.status or server.gone, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        if self.poll() is None:
            raise RuntimeError("the warm Python server exited while its child ran")
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def popen(argv, env: dict | None = None, cwd: str | None = None, stdout=None, stderr=None):
    """`python argv...` with stdout and stderr written to the given files (files opened by path; stderr may
    be subprocess.STDOUT): a WarmProcess when the server can run it, else a subprocess.Popen."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    out = os.path.abspath(stdout.name)
    err = out if stderr is subprocess.STDOUT else os.path.abspath(stderr.name)
    server = _server_for(env)
    if server is None:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    return WarmProcess(server, server.fork(argv, env, cwd, out, err), [sys.executable, *argv])


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def run(argv, env: dict | None = None, cwd: str | None = None, timeout: float | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...), through the server
    when it can run it."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")]
        with open(paths[0], "w") as out, open(paths[1], "w") as err:
            proc = popen(argv, env, cwd, out, err)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
        stdout, stderr = (_read(p) for p in paths)
    result = subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    serve()
