"""warm_python: a script run as a child of the warm server behaves as the same script run by a fresh
interpreter (the reference: subprocess.run([sys.executable, ...]) with the same environment)."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warm_python  # noqa: E402
from dist_utils import _launch_env  # noqa: E402

ENV = _launch_env({"RANK": "3"})  # run_workers' environment (one thread): the suite's server for it is reused


@pytest.fixture(autouse=True)
def server_on(monkeypatch):
    """These tests are of the server: on even when the run has it off (WARM_PYTHON=0)."""
    monkeypatch.delenv("WARM_PYTHON", raising=False)

PROBE = """import atexit, os, signal, sys, threading, time
print(__name__, sys.argv, sys.path[0], os.getcwd(), os.environ.get("RANK"))
atexit.register(lambda: print("atexit ran"))
mode = sys.argv[1]
if mode == "plain":  # the one mode that imports what the server preloads (seconds in a fresh interpreter)
    for name in sys.argv[2:]:  # anything these print or warn at import time is printed here too
        __import__(name)
    print("threads", sys.modules["torch"].get_num_threads())
elif mode == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
elif mode == "exit3":
    sys.exit(3)
elif mode == "message":
    sys.exit("a message")
elif mode == "raise":
    raise ValueError("boom")
elif mode == "term":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("end", file=sys.stderr)
"""


def fresh(argv, env, cwd):
    r = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def warm(argv, env, cwd):
    r = warm_python.run(argv, env=env, cwd=cwd, timeout=120)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("mode", ["plain", "thread", "exit3", "message", "raise", "term"])
def test_a_child_of_the_server_runs_a_script_as_a_fresh_interpreter_does(tmp_path, mode):
    """Output, error output and exit status equal, byte for byte: __main__, argv, sys.path[0], the working
    directory, the environment, what the preloaded modules print at import, torch's thread count
    (OMP_NUM_THREADS, read at import), an exception's traceback, sys.exit's status and message, a
    non-daemon thread joined and atexit run at the end, a signal's default action."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    argv = [str(script), mode, *warm_python.PRELOAD]
    expected = fresh(argv, ENV, tmp_path)
    assert warm(argv, ENV, tmp_path) == expected
    assert expected[0] == {"plain": 0, "thread": 0, "exit3": 3, "message": 1, "raise": 1, "term": -15}[mode]


def test_code_given_with_c_runs_as_python_c_does(tmp_path):
    for argv in (["-c", "import sys; print(sys.argv, sys.path[0], __name__)", "a"], ["-c", "1/0"]):
        assert warm(argv, ENV, tmp_path) == fresh(argv, ENV, tmp_path)


def test_only_a_matching_environment_is_served(tmp_path, monkeypatch):
    """The server's children are not this process's and share a parent across the worker variables; a
    launch in an environment no server has, once every server slot is taken, or any launch under
    WARM_PYTHON=0 is a fresh interpreter, this process's child."""
    def parent(env):
        return int(warm(["-c", "import os; print(os.getppid())"], env, tmp_path)[1])
    served = parent(ENV)
    assert served != os.getpid(), "no server for run_workers' environment: every server slot was taken"
    assert parent(dict(ENV, RANK="5", MASTER_PORT="1", _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR="1")) == served
    monkeypatch.setattr(warm_python, "MAX_SERVERS", len(warm_python._servers))
    with pytest.warns(UserWarning, match="differs from the nearest one's in OTHER: a fresh interpreter"):
        assert parent(dict(ENV, OTHER="1")) == os.getpid()
    monkeypatch.setenv("WARM_PYTHON", "0")
    assert parent(ENV) == os.getpid()



def test_requests_that_reach_the_server_in_one_read_each_get_a_child(tmp_path):
    """Three requests written at once (the server's read of its pipe holds them all) start three children,
    and none waits for a later request to be noticed."""
    server = warm_python._server_for(ENV)
    outs = [tmp_path / f"out{i}" for i in range(3)]
    requests = []
    for i, out in enumerate(outs):
        out.write_text("")
        requests.append(json.dumps(dict(id=-1 - i, argv=["-c", f"print({i})"], env=ENV, cwd=str(tmp_path),
                                        stdout=str(out), stderr=str(out))) + "\n")
    with server.lock:
        server.proc.stdin.write("".join(requests))
        server.proc.stdin.flush()
    with server.changed:
        assert server.changed.wait_for(lambda: all(server.status.get(server.pids.get(-1 - i)) == 0 for i in range(3)),
                                       30), "a request written with others was not served"
    assert [out.read_text() for out in outs] == ["0\n", "1\n", "2\n"]
