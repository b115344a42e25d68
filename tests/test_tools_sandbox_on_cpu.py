"""The Python tool's sandbox (polyrl/tools/sandbox.py): each attack is stopped and reported, the caller goes on, and
no process is left running. Runs on the strongest isolation this machine permits; the file-system and network checks
need bwrap (they skip on the weaker paths, whose limits the docstring states)."""

import asyncio
import os
import subprocess
import time

import pytest

from polyrl.tools.python_tool import PythonTool
from polyrl.tools.sandbox import NOBODY, SandboxLimits, close_warm, isolation, run_python

FAST = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=256, max_procs=16)
needs_bwrap = pytest.mark.skipif(isolation() != "bwrap", reason="bubblewrap is not usable here")


def _sandbox_processes() -> list[str]:
    """Live processes of the sandbox user (uid 65534 when the tests run as root), or of bwrap. Zombies (state Z) are
    dead, waiting for pid 1 to reap them, and not counted."""
    out = subprocess.run(["ps", "-eo", "pid,uid,stat,comm"], capture_output=True, text=True).stdout.splitlines()[1:]
    return [ln for ln in out if (ln.split()[1] == str(NOBODY) or ln.split()[3] == "bwrap")
            and not ln.split()[2].startswith("Z")]


@pytest.fixture(autouse=True)
def nothing_left_running():
    yield
    close_warm()  # the pool's idle warm sandboxes are meant to outlive their calls; anything else is not
    time.sleep(0.2)
    assert _sandbox_processes() == [], "a sandboxed process outlived its run"


@pytest.fixture(params=[False, True], ids=["cold", "warm"])
def run(request):
    """run_python in a fresh sandbox, or in a child of a warm one (the Python tool's default)."""
    return lambda code, limits: run_python(code, limits, warm=request.param)


def test_plain_code_runs_and_prints(run):
    res = run("print(sum(i * i for i in range(10)))", FAST)
    assert (res.status, res.stdout.strip()) == ("ok", "285")


@needs_bwrap
def test_write_outside_workdir_is_refused_and_workdir_is_thrown_away(run, tmp_path):
    target = tmp_path / "escaped.txt"
    res = run(f"open('local.txt', 'w').write('ok')\nprint('local ok')\nopen({str(target)!r}, 'w').write('x')",
                     FAST)
    assert "local ok" in res.stdout and res.status == "error"
    assert "Read-only file system" in res.stderr or "No such file" in res.stderr
    assert not target.exists()
    assert run("import os; print(os.path.exists('local.txt'))", FAST).stdout.strip() == "False"


@needs_bwrap
def test_network_is_unreachable(run):
    res = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')", FAST)
    assert res.status == "error" and "connected" not in res.stdout
    assert "unreachable" in res.stderr.lower() or "errno" in res.stderr.lower()


def test_fork_bomb_is_contained(run):
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    t0 = time.perf_counter()
    res = run(bomb, SandboxLimits(wall_s=3, cpu_s=2, memory_mb=256, max_procs=16))
    assert res.status in ("timeout", "killed") and time.perf_counter() - t0 < 10


def test_infinite_loop_hits_the_cpu_limit(run):
    res = run("while True:\n    pass", SandboxLimits(wall_s=10, cpu_s=1))  # wall: slack for a busy CPU
    assert res.status == "killed" and "CPU" in res.as_text() and res.seconds < 10


def test_sleeping_code_hits_the_wall_clock(run):
    res = run("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.5, cpu_s=2))
    assert res.status == "timeout" and res.seconds < 5 and "time limit" in res.as_text()


def test_memory_hog_gets_memory_error(run):
    res = run("x = bytearray(1 << 30)\nprint('allocated')", FAST)
    assert res.status == "error" and "MemoryError" in res.as_text() and "allocated" not in res.stdout


def test_tool_reports_errors_and_runs_concurrently():
    tool = PythonTool({"timeout": 4, "cpu_s": 2})

    async def call(code):
        iid, _ = await tool.create()
        resp, reward, metrics = await tool.execute(iid, {"code": code})
        await tool.release(iid)
        return resp.text, metrics

    async def main():
        return await asyncio.gather(call("import time; time.sleep(1); print('a')"),
                                    call("import time; time.sleep(1); print('b')"), call("1/0"),
                                    call("print(7 * 6)"))

    t0 = time.perf_counter()
    out = asyncio.run(main())
    assert [o[0] for o in out[:2]] == ["a", "b"] and "ZeroDivisionError" in out[2][0] and out[3][0] == "42"
    assert out[2][1]["error"] == 1 and out[3][1]["error"] == 0
    assert time.perf_counter() - t0 < 1.9  # the two one-second sleeps overlapped


@pytest.mark.skipif(isolation() == "rlimit", reason="no warm form on the rlimit path")
def test_warm_calls_share_nothing_and_a_daemon_is_swept_or_recycled():
    """Calls of one warm sandbox: a module one call imported or changed, or a file it left, is not seen by the next;
    a process that setsid()s away from its call is killed after it (bwrap's and unshare's pid namespace); a timed-out
    call's server is replaced."""
    lim = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=256, max_procs=16)
    first = run_python("import fractions, os\nos.marked = 1\nopen('left.txt', 'w').write('x')\nprint(os.getpid())",
                       lim, warm=True)
    servers = len(_sandbox_processes())
    second = run_python("import sys, os\nprint('fractions' in sys.modules, hasattr(os, 'marked'), "
                        "os.path.exists('left.txt'), os.getpid())", lim, warm=True)
    assert first.status == second.status == "ok"
    *seen, pid = second.stdout.split()
    assert seen == ["False"] * 3 and pid != first.stdout.strip()  # a new child each call
    if isolation() in ("bwrap", "unshare"):  # a pid namespace: the server sweeps it (unshare-net cannot)
        daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('parent done')"
        assert run_python(daemon, lim, warm=True).stdout.strip() == "parent done"
        time.sleep(0.2)
        assert len(_sandbox_processes()) == servers, _sandbox_processes()
    slow = run_python("import time\ntime.sleep(30)", SandboxLimits(wall_s=1), warm=True)
    assert slow.status == "timeout" and run_python("print(6 * 7)", lim, warm=True).stdout.strip() == "42"


@pytest.mark.skipif(isolation() == "rlimit", reason="no warm form on the rlimit path")
def test_a_forked_process_neither_shares_nor_stops_its_parents_warm_sandboxes():
    """A child forked after warm calls (a data-loader worker, say) gets sandboxes of its own; its exit handlers leave
    the parent's running, and the parent's next call still works."""
    lim = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=256, max_procs=16)
    from polyrl.tools import sandbox

    assert run_python("print(1)", lim, warm=True).stdout.strip() == "1"
    server = sandbox._WARM.idle[0].proc
    pid = os.fork()
    if pid == 0:  # the child: exit handlers (the pool's close among them), its own warm call, exit handlers again
        close_warm()
        ok = run_python("print(2)", lim, warm=True).stdout.strip() == "2"
        close_warm()
        os._exit(0 if ok else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    time.sleep(0.2)
    assert server.poll() is None and sandbox._WARM.idle[0].proc is server  # the parent's sandbox lives on
    assert run_python("print(3)", lim, warm=True).stdout.strip() == "3"


def _serve(tmp_path, requests, prelude=""):
    """The sandbox's server run here unsandboxed (`prelude` first): one answer per (code, wall, limit overrides)."""
    import json
    import sys

    from polyrl.tools import sandbox

    server = subprocess.Popen([sys.executable, "-I", "-c", prelude + sandbox._SERVER, str(tmp_path), "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    answers = []
    for code, wall, extra in requests:
        request = {"code": code, "wall": wall, "cpu": 5, "mem": 512 << 20, "nproc": 256, "fsize": 1 << 24, "cut": 99,
                   **extra}
        server.stdin.write((json.dumps(request) + "\n").encode())
        server.stdin.flush()
        answers.append(json.loads(server.stdout.readline()))
    server.stdin.close()
    server.wait()
    return answers


def test_the_server_without_pidfd_polls_and_keeps_the_deadline(tmp_path):
    """Where os.pidfd_open is missing (macOS) the sandbox's server polls its child: output, exit codes and the
    wall-clock deadline are the same."""
    answers = _serve(tmp_path, [("print(6 * 7)", 5, {}), ("import time\ntime.sleep(30)", 0.5, {}),
                                ("import sys\nsys.exit(4)", 5, {})], prelude="import os\ndel os.pidfd_open\n")
    assert (answers[0]["stdout"], answers[0]["code"]) == ("42\n", 0)
    assert answers[1]["status"] == "timeout" and answers[1]["seconds"] < 3
    assert (answers[2]["status"], answers[2]["code"]) == ("ok", 4)


def test_a_child_that_fails_before_the_code_runs_exits_and_the_server_goes_on(tmp_path):
    """A forked child whose set-up raises (here a limit of the wrong type) is answered as exit 1 and the server
    answers the next call."""
    answers = _serve(tmp_path, [("print(1)", 5, {"nproc": "x"}), ("print(2)", 5, {})])
    assert (answers[0]["code"], answers[0]["stdout"]) == (1, "")
    assert (answers[1]["code"], answers[1]["stdout"]) == (0, "2\n")
