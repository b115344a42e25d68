"""Run untrusted Python in a throw-away sandbox: `run_python(code, limits) -> SandboxResult`.

Every run gets a fresh working directory (deleted afterwards), a new session (its own process group), resource limits
set in the child before the code runs, and a wall-clock deadline after which the whole group is SIGKILLed. Which
isolation it gets depends on what the machine permits; `isolation()` says which path is taken, probed once:

| path | what it gives |
|---|---|
| `bwrap` (Debian's bubblewrap; needs unprivileged user namespaces) | new user, pid, net, ipc, uts and cgroup namespaces (`--unshare-all`): no network interface but loopback, no other process visible, the code is pid 2 of its own namespace and every process in it dies when it does (`--die-with-parent`, pid-namespace teardown). The file system is `/usr`, `/lib*`, `/bin` and `/etc/alternatives` read-only, a private `/tmp`, `/proc`, a minimal `/dev`, and the working directory as the only writable host path; the environment is cleared. It runs as uid 65534 (nobody), so the process-count limit is enforced (the kernel exempts uid 0). |
| `unshare` (util-linux; when bwrap is missing or fails) | a new user and network namespace (no network) and the resource limits; the file system is the host's, seen as uid 65534 (nobody): world-writable places such as `/tmp` stay writable. |
| `rlimit` (neither permitted) | only the resource limits, the new session and the throw-away directory: the network is NOT isolated. |

Limits on every path (setrlimit in the child): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS, so a memory hog
gets MemoryError), processes (RLIMIT_NPROC, so a fork bomb gets EAGAIN), output file size (RLIMIT_FSIZE) and no core
dumps; plus the wall-clock deadline (a sleeping or blocked process uses no CPU). stdout/stderr are cut to
`max_output_bytes`. At the end the process group is killed whatever happened, and the directory removed.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534

# runs inside the sandbox: set the limits, then run main.py as __main__
_LAUNCH = """
import resource as r, sys, runpy
cpu, mem, nproc, fsize = (int(a) for a in sys.argv[1:5])
r.setrlimit(r.RLIMIT_CPU, (cpu, cpu + 1))
r.setrlimit(r.RLIMIT_AS, (mem, mem))
r.setrlimit(r.RLIMIT_NPROC, (nproc, nproc))
r.setrlimit(r.RLIMIT_FSIZE, (fsize, fsize))
r.setrlimit(r.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


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


def _command(path: str, workdir: str, python: str, limits: SandboxLimits) -> list[str]:
    launch = [python, "-I", "-c", _LAUNCH, str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.max_procs),
              str(limits.max_file_mb << 20)]
    if path == "bwrap":
        return ["bwrap", *_ro_binds(), "--bind", workdir, "/work", "--chdir", "/work", "--tmpfs", "/tmp",
                "--proc", "/proc", "--dev", "/dev", "--unshare-all", "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", *launch]
    if path == "unshare":
        return ["unshare", "--user", "--net", "--", *launch]
    return launch


def _spawn(path: str, workdir: str, limits: SandboxLimits, python: str) -> subprocess.Popen:
    as_nobody = os.getuid() == 0  # root is exempt from RLIMIT_NPROC; nobody is not
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen(_command(path, workdir, python, limits), cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            user=NOBODY if as_nobody else None, group=NOBODY if as_nobody else None,
                            extra_groups=[] if as_nobody else None)


@functools.lru_cache(maxsize=None)
def isolation() -> str:
    """The strongest path that runs a trivial program here: bwrap, unshare or rlimit (probed once)."""
    forced = os.environ.get("POLYRL_SANDBOX")  # tests pin a path
    if forced:
        return forced
    for path in ("bwrap", "unshare"):
        if shutil.which(path) is None:
            continue
        res = _run(path, "print(6 * 7)", SandboxLimits(wall_s=20))
        if res.stdout.strip() == "42":
            return path
    return "rlimit"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox (see the module docstring) and return what it printed."""
    return _run(isolation(), code, limits or SandboxLimits())


def _run(path: str, code: str, limits: SandboxLimits) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="polyrl-sandbox-")
    os.chmod(workdir, 0o777)  # the sandbox user (nobody) writes here
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    t0 = time.perf_counter()
    proc = _spawn(path, workdir, limits, _python())
    status = None
    try:
        out, err = proc.communicate(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        status = "timeout"
        _kill_group(proc)
        out, err = proc.communicate()
    finally:
        _kill_group(proc)  # children left behind by a finished main process
        shutil.rmtree(workdir, ignore_errors=True)
    code_ = proc.returncode
    signum = -code_ if code_ < 0 else (code_ - 128 if path == "bwrap" and code_ > 128 else 0)  # bwrap: 128 + signal
    if status is None:
        status = "ok" if code_ == 0 else ("killed" if signum else "error")
    if signum:
        err += f"\nKilled by {_SIGNALS.get(signum, f'signal {signum}')}.".encode()
    cut = limits.max_output_bytes
    return SandboxResult(stdout=out[:cut].decode(errors="replace"), stderr=err[-cut:].decode(errors="replace"),
                         exit_code=code_, status=status, isolation=path, seconds=time.perf_counter() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
