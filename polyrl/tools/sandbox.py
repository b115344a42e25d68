"""Run untrusted Python in a throw-away sandbox: `run_python(code, limits) -> SandboxResult`.

A sandbox is a server process (`_SERVER`, the system Python) started inside the isolation below; for each call it
forks a child that runs the code. Every call gets a fresh working directory (deleted afterwards), a new session (its
own process group), resource limits set in the child before the code runs, and a wall-clock deadline after which the
whole group is SIGKILLed. Which isolation it gets depends on what the machine permits; `isolation()` says which path
is taken, probed once:

| path | what it gives |
|---|---|
| `bwrap` (Debian's bubblewrap; needs unprivileged user namespaces) | new user, pid, net, ipc, uts and cgroup namespaces (`--unshare-all`): no network interface but loopback, no other process visible, the code is pid 2 of its own namespace and every process in it dies when it does (`--die-with-parent`, pid-namespace teardown). The file system is `/usr`, `/lib*`, `/bin` and `/etc/alternatives` read-only, a private `/tmp`, `/proc`, a minimal `/dev`, and the working directory as the only writable host path; the environment is cleared. It runs as uid 65534 (nobody), so the process-count limit is enforced (the kernel exempts uid 0). |
| `unshare` (util-linux; when bwrap is missing or fails) | new user, network, pid and mount namespaces: no network, its own /proc, and every process in it dies with it (`--fork --kill-child`: its first process is pid 1). The file system is the host's, seen as uid 65534 (nobody): world-writable places such as `/tmp` stay writable. |
| `unshare-net` (where the pid namespace is refused) | a new user and network namespace only: no network; a process that leaves its process group (setsid) outlives the run. |
| `rlimit` (neither permitted) | only the resource limits, the new session and the throw-away directory: the network is NOT isolated. |

Limits on every path (setrlimit in the child): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS, so a memory hog
gets MemoryError), processes (RLIMIT_NPROC, so a fork bomb gets EAGAIN), output file size (RLIMIT_FSIZE) and no core
dumps; plus the wall-clock deadline (a sleeping or blocked process uses no CPU). stdout/stderr are cut to
`max_output_bytes`. At the end the process group is killed whatever happened, and the directory removed.

A cold call (`warm=False`) starts a sandbox for itself and stops it after. Starting one costs a Python start and new
namespaces: 37 ms on a 2-core CPU, 54-67 ms on the H100 machine (more with several at once), where a multi-turn step's
tool calls then set its pace (10.3 s steps, 1.25 s with warm sandboxes: docs/tools.md). **Warm** calls (the Python
tool's default) take a running sandbox from a pool (one per concurrent caller) and give it back: the child still gets
its own session, directory, limits and deadline, and nothing an earlier call imported or wrote (it is forked from a
server that never runs user code). What calls of one warm sandbox share is its namespaces: on bwrap and unshare a pid
namespace, where the server kills every other process after each call (on unshare the server is its pid 1 and reaps
them too), so nothing outlives its call; on unshare-net a process that leaves its process group outlives its call,
warm or cold. A sandbox is replaced after `WARM_CALLS` calls or a call that timed out, and when it dies or stops
answering (that call then runs cold). The rlimit path runs cold only (its process-count limit would count the other
sandboxes of the pool).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

NOBODY = 65534

# the sandbox's server (module doc): one JSON request per line on stdin, one JSON answer per line on stdout
_SERVER = """
import json, os, resource as r, runpy, select, shutil, signal, sys, time, traceback
base, sweep, n = sys.argv[1], sys.argv[2] == "1", 0
requests, answers = sys.stdin, sys.stdout
def child(q, d):
    os.setsid()
    os.chdir(d)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    os.environ.update(HOME=d, TMPDIR=d)
    r.setrlimit(r.RLIMIT_CPU, (q["cpu"], q["cpu"] + 1))
    r.setrlimit(r.RLIMIT_AS, (q["mem"], q["mem"]))
    r.setrlimit(r.RLIMIT_NPROC, (q["nproc"], q["nproc"]))
    r.setrlimit(r.RLIMIT_FSIZE, (q["fsize"], q["fsize"]))
    r.setrlimit(r.RLIMIT_CORE, (0, 0))
    sys.argv = ["main.py"]
    code = 0
    try:
        runpy.run_path("main.py", run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass
    os._exit(code)
def sweep_others():
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid not in (1, os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:  # as pid 1 (unshare) the server inherits orphans: reap them, as zombies count toward RLIMIT_NPROC
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
for line in requests:
    q, n = json.loads(line), n + 1
    d = os.path.join(base, "call%d" % n)
    os.mkdir(d)
    with open(os.path.join(d, "main.py"), "w") as f:
        f.write(q["code"])
    t0 = time.monotonic()
    answers.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child(q, d)
        finally:  # a failure before the code ran ends the child here, with no teardown of the server's state
            os._exit(1)
    status, st = "ok", None
    if hasattr(os, "pidfd_open"):  # Linux: sleep until the child exits or the deadline
        fd = os.pidfd_open(pid)
        if not select.select([fd], [], [], q["wall"])[0]:
            status = "timeout"
        os.close(fd)
    else:  # elsewhere (macOS): poll
        while st is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                st = code
            elif time.monotonic() - t0 > q["wall"]:
                status = "timeout"
                break
            else:
                time.sleep(0.002)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if st is None:
        st = os.waitpid(pid, 0)[1]
    if sweep:
        sweep_others()
    seconds = time.monotonic() - t0
    out = []
    for name, tail in (("stdout", False), ("stderr", True)):
        with open(os.path.join(d, name), "rb") as f:
            b = f.read()
        out.append((b[-q["cut"]:] if tail else b[:q["cut"]]).decode(errors="replace"))
    shutil.rmtree(d, ignore_errors=True)
    answers.write(json.dumps({"stdout": out[0], "stderr": out[1], "code": os.waitstatus_to_exitcode(st),
                              "status": status, "seconds": seconds}) + "\\n")
    answers.flush()
"""
WARM_CALLS = 512  # calls before a pooled sandbox is replaced by a fresh one


_SIGNALS = {signal.SIGXCPU: "SIGXCPU (the CPU-time limit)", signal.SIGKILL: "SIGKILL",
            signal.SIGXFSZ: "SIGXFSZ (the file-size limit)", signal.SIGSEGV: "SIGSEGV"}


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock deadline; the process group is killed at it."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS)."""
    max_procs: int = 16
    """Processes of the sandbox user (RLIMIT_NPROC)."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE)."""
    max_output_bytes: int = 16384
    """stdout and stderr are each cut to this."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    status: str  # ok | error (non-zero exit) | timeout (wall clock) | killed (a signal: CPU limit, memory, ...)
    isolation: str
    seconds: float

    def as_text(self) -> str:
        """What the model sees."""
        if self.status == "timeout":
            return (self.stdout + f"\nError: the code ran past its {self.seconds:.0f} s time limit and was "
                    "stopped.").strip()
        out = self.stdout
        if self.status != "ok":
            out += ("\n" if out else "") + (self.stderr.strip().splitlines() or [f"exit {self.exit_code}"])[-1]
        return out.strip()


def _python() -> str:
    """A Python the sandbox user can run: the system one (the project's may sit under an unreadable /root)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if os.access(p, os.X_OK):
            return p
    return sys.executable


def _ro_binds() -> list[str]:
    args = []
    for path in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives", "/etc/ld.so.cache"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def _command(path: str, workdir: str, launch: list[str]) -> list[str]:
    if path == "bwrap":
        return ["bwrap", *_ro_binds(), "--bind", workdir, "/work", "--chdir", "/work", "--tmpfs", "/tmp",
                "--proc", "/proc", "--dev", "/dev", "--unshare-all", "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", *launch]
    if path == "unshare":
        return ["unshare", "--user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--", *launch]
    if path == "unshare-net":
        return ["unshare", "--user", "--net", "--", *launch]
    return launch


def _spawn(path: str, workdir: str, launch: list[str], stdin=subprocess.DEVNULL) -> subprocess.Popen:
    as_nobody = os.getuid() == 0  # root is exempt from RLIMIT_NPROC; nobody is not
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen(_command(path, workdir, launch), cwd=workdir, env=env, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            user=NOBODY if as_nobody else None, group=NOBODY if as_nobody else None,
                            extra_groups=[] if as_nobody else None)


@functools.lru_cache(maxsize=None)
def isolation() -> str:
    """The strongest path that runs a trivial program here: bwrap, unshare, unshare-net or rlimit (probed once)."""
    forced = os.environ.get("POLYRL_SANDBOX")  # tests pin a path
    if forced:
        return forced
    for path in ("bwrap", "unshare", "unshare-net"):
        if shutil.which(path.split("-")[0]) is None:
            continue
        res = _run(path, "print(6 * 7)", SandboxLimits(wall_s=20))
        if res.stdout.strip() == "42":
            return path
    return "rlimit"


def run_python(code: str, limits: SandboxLimits | None = None, warm: bool = False) -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox (see the module docstring) and return what it printed. `warm`: in a
    child forked by a warm sandbox of the pool (bwrap and unshare paths; the module docstring says what differs)."""
    path, limits = isolation(), limits or SandboxLimits()
    if warm and path != "rlimit":
        return _WARM.run(path, code, limits)
    return _run(path, code, limits)


def _run(path: str, code: str, limits: SandboxLimits) -> SandboxResult:
    """A cold call: a sandbox started for it and stopped after."""
    box = None
    try:
        box = _Sandbox(path)
        return box.run(code, limits)
    except (OSError, ValueError, KeyError) as e:  # the sandbox did not start or died: say why as the result
        why = box.stderr() if box is not None else ""
        return SandboxResult(stdout="", stderr=f"The sandbox failed ({path}): {e}. {why}".strip(), exit_code=None,
                             status="error", isolation=path, seconds=0.0)
    finally:
        if box is not None:
            box.close()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Sandbox:
    """One sandbox (module doc): a server process on `path` and the directory its calls' directories live in."""

    def __init__(self, path: str):
        self.path, self.calls = path, 0
        self.workdir = tempfile.mkdtemp(prefix="polyrl-sandbox-")
        os.chmod(self.workdir, 0o777)
        base = "/work" if path == "bwrap" else self.workdir  # bwrap mounts the directory at /work
        sweep = "1" if path in ("bwrap", "unshare") else "0"  # a pid namespace of its own: kill all but the server
        self.proc = _spawn(path, self.workdir, [_python(), "-I", "-c", _SERVER, base, sweep], stdin=subprocess.PIPE)

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        """One call; raises OSError/ValueError where the server is dead, stuck or answers garbage."""
        self.calls += 1
        request = {"code": code, "wall": limits.wall_s, "cpu": limits.cpu_s, "mem": limits.memory_mb << 20,
                   "nproc": limits.max_procs, "fsize": limits.max_file_mb << 20, "cut": limits.max_output_bytes}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], limits.wall_s + 10)[0]:
            raise OSError("it did not answer")
        answer = json.loads(self.proc.stdout.readline() or b"null")
        if not isinstance(answer, dict):
            raise OSError("it exited")
        code_ = answer["code"]
        status = answer["status"]
        if status == "ok" and code_ != 0:
            status = "killed" if code_ < 0 else "error"
        err = answer["stderr"]
        if code_ < 0:
            err += f"\nKilled by {_SIGNALS.get(-code_, f'signal {-code_}')}."
        return SandboxResult(stdout=answer["stdout"], stderr=err, exit_code=code_, status=status,
                             isolation=self.path, seconds=answer["seconds"])

    def stderr(self) -> str:
        """What the isolation tool said on the way out (read once the server is dead)."""
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read(2000).decode(errors="replace").strip()

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # the server's loop ends; then make sure of it
        except OSError:
            pass
        _kill_group(self.proc)
        self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


class _WarmPool:
    """Idle sandboxes per path; a caller takes one (or starts one), runs its call, and gives it back."""

    def __init__(self):
        self.lock = threading.Lock()
        self.idle: list[_Sandbox] = []
        self.pid = os.getpid()
        atexit.register(self.close)

    def _forked(self) -> bool:
        """In a child forked from the process that started the idle sandboxes: their pipes are the parent's, so the
        child forgets them (it starts its own) and never stops them."""
        if os.getpid() == self.pid:
            return False
        self.lock, self.idle, self.pid = threading.Lock(), [], os.getpid()
        return True

    def run(self, path: str, code: str, limits: SandboxLimits) -> SandboxResult:
        self._forked()
        with self.lock:
            box = next((b for b in self.idle if b.path == path), None)
            if box is not None:
                self.idle.remove(box)
        try:
            box = box or _Sandbox(path)
            res = box.run(code, limits)
        except (OSError, ValueError, KeyError):  # a dead or stuck server: this call runs cold, the server goes
            if box is not None:
                box.close()
            return _run(path, code, limits)
        if res.status == "timeout" or box.calls >= WARM_CALLS:
            box.close()  # a fresh server for the next caller
        else:
            with self.lock:
                self.idle.append(box)
        return res

    def close(self) -> None:
        """Stop every idle sandbox (at exit, and in tests that count the sandbox's processes)."""
        if self._forked():
            return
        with self.lock:
            boxes, self.idle = self.idle, []
        for box in boxes:
            box.close()


_WARM = _WarmPool()
close_warm = _WARM.close
