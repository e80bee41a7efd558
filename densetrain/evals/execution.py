"""HumanEval programs and their sandboxed execution: one limited, isolated process per program.

Each program (:func:`run_program`) runs in its own ``python -I`` process (isolated mode: no
``PYTHON*`` variables, no user site, script directory not on ``sys.path``) with an empty
environment, in a fresh temporary directory that is its working directory and is deleted afterwards,
stdin closed, output to a file there. Before the program starts, its interpreter sets
``RLIMIT_AS`` (address space, default 1 GiB: a memory bomb gets ``MemoryError``), ``RLIMIT_CPU``,
``RLIMIT_FSIZE`` (16 MiB: output and files) and ``RLIMIT_CORE`` = 0, and replaces the ``socket``
constructors with one that raises.

**Isolation** (required; :func:`require_sandbox`): the process runs under ``unshare --user
--map-root-user --net --pid --fork --mount-proc --kill-child`` in new user, network, pid and mount
namespaces: no network interface but its own loopback (nothing outside is reachable), and it is pid 1 of
a namespace of its own, whose ``/proc`` lists only its own processes, so it can neither see nor signal
the evaluating process (its parent there is pid 0), nor the training run that hosts in-loop tasks. When
it ends or is killed, the kernel kills everything else in its namespace, so background children (even
ones that called ``setsid``) do not survive. Where this machine refuses such namespaces (no ``unshare``,
``kernel.unprivileged_userns_clone = 0``, a container without them), code execution is refused with
one line rather than run unisolated.

**Passing** needs a positive signal: a per-run random token that the harness hands to the child on a pipe
and that the runner reads, and copies to a second pipe, only after the program and its tests returned
normally. An early ``os._exit(0)``, a signal, an ``exec`` of another program or a printed imitation of
success therefore fail ("ended before its tests finished"); so does ``sys.exit()`` (human-eval treats it
the same way). A program written against this module that reads its own file descriptors could still
copy the token; nothing here defends against that, nor isolates the file system (the program can read
and write what the user can). Run untrusted model output only on machines where that is acceptable
(human-eval's own warning). At the wall-time limit (default 5 s; human-eval uses 3 s, we add margin for
interpreter start-up on busy machines) the process group is killed with SIGKILL. Limits are set in the
child rather than in a ``preexec_fn``: Python documents ``preexec_fn`` as unsafe in threaded programs
(PyTorch's thread pools, our execution threads).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from densetrain.data.tokenizer import usable_cpus
from densetrain.errors import TrainError
from densetrain.registry.gen_tasks import Problem

__all__ = ["ExecResult", "humaneval_program", "require_sandbox", "run_program", "run_programs"]


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    Attributes:
        passed: it ran to the end without an exception (exit status 0).
        status: ``'passed'``, ``'failed'`` (exception or non-zero exit) or ``'timeout'`` (killed).
        output: the last 2000 characters of its stdout + stderr.
    """

    passed: bool
    status: str
    output: str


def humaneval_program(problem: Problem, completion: str) -> str:
    """The program that tests ``completion``: ``prompt + completion``, the problem's ``test`` code and
    ``check(entry_point)`` (human-eval's ``check_program``, Chen et al. 2021)."""
    return f"{problem.prompt}{completion}\n{problem.test}\ncheck({problem.entry_point})\n"


_FSIZE_BYTES = 16 << 20

# Runs in the child before the program: resource limits, no socket constructors, then the program, then
# the completion token (module docstring). sys.exit() inside the program counts as failure (human-eval
# catches BaseException the same way).
_RUNNER = r"""
import resource, sys
mem, cpu, fsize = (int(a) for a in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import _socket, socket
class _NoSocket(_socket.socket):  # a class, so that modules subclassing socket.socket still import
    def __init__(self, *args, **kwargs):
        raise OSError("network access is disabled for evaluated programs")
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled for evaluated programs")
_socket.socket = socket.socket = socket.SocketType = _NoSocket
socket.socketpair = socket.fromfd = _socket.socketpair = _no_network
token_fd, done_fd = int(sys.argv[5]), int(sys.argv[6])
with open(sys.argv[1], encoding="utf-8") as f:
    code = compile(f.read(), sys.argv[1], "exec")
try:
    exec(code, {"__name__": "__main__"})
except SystemExit as e:
    sys.stderr.write(f"program called exit({e.code!r})\n")
    sys.exit(1)
import os
# Reached only when the program and its tests returned: the token is read now, not before, so no object
# of the program's run held it.
os.write(done_fd, os.read(token_fd, 64))
"""


_UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", "--kill-child")


@functools.lru_cache(maxsize=1)
def _sandbox() -> tuple[tuple[str, ...], str]:
    """``(unshare command prefix, '')`` when the namespaces of the module docstring can be created here
    (probed once per process by running ``true`` in them), else ``((), why not)``."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return (), "no unshare command (util-linux) on this Linux machine" if exe is None else "not Linux"
    try:
        r = subprocess.run([exe, *_UNSHARE_FLAGS, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=10)
        why = "" if r.returncode == 0 else (r.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    return ((exe, *_UNSHARE_FLAGS), "") if not why else ((), why)


def require_sandbox() -> None:
    """Raise unless generated code can run isolated here (module docstring).

    Raises: TrainError, one line: what failed and what to do."""
    prefix, why = _sandbox()
    if not prefix:
        raise TrainError(f"generated code is not run here: the humaneval sandbox needs user, network and pid "
                         f"namespaces (unshare {' '.join(_UNSHARE_FLAGS)} true: {why}); allow unprivileged user "
                         "namespaces (sysctl kernel.unprivileged_userns_clone=1) or leave humaneval out of the tasks")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> ExecResult:
    """Run Python ``source`` in a separate, limited, isolated process (module docstring).

    Args:
        source: the program text.
        timeout_s: wall-time limit in seconds (> 0); the process group is killed after it.
        memory_mb: address-space limit in MiB (RLIMIT_AS).

    Returns:
        an :class:`ExecResult`; ``passed`` only with exit status 0 and the completion token.

    Raises:
        ValueError: timeout_s <= 0 or memory_mb < 1.
        TrainError: no sandbox on this machine (:func:`require_sandbox`).
    """
    if timeout_s <= 0 or memory_mb < 1:
        raise ValueError(f"need timeout_s > 0 and memory_mb >= 1, got {timeout_s}, {memory_mb}")
    require_sandbox()
    cpu_s = int(math.ceil(timeout_s)) + 1  # a CPU-time backstop; the wall-time kill comes first
    token, got = secrets.token_hex(16).encode(), b""
    token_r, token_w = os.pipe()
    done_r, done_w = os.pipe()
    os.write(token_w, token)
    os.close(token_w)
    with tempfile.TemporaryDirectory(prefix="densetrain-exec-") as tmp:
        prog, log = Path(tmp) / "program.py", Path(tmp) / "output.txt"
        prog.write_text(source, encoding="utf-8")
        cmd = [*_sandbox()[0], sys.executable, "-I", "-c", _RUNNER, str(prog),
               str(memory_mb << 20), str(cpu_s), str(_FSIZE_BYTES), str(token_r), str(done_w)]
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, cwd=tmp, env={}, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(token_r, done_w))
                os.close(token_r)
                os.close(done_w)
                token_r = done_w = -1
                try:
                    rc = proc.wait(timeout=timeout_s)
                    status = "passed" if rc == 0 else "failed"
                except subprocess.TimeoutExpired:
                    status = "timeout"
                finally:
                    _kill_group(proc.pid)  # also any children left behind
                    proc.wait()
            os.set_blocking(done_r, False)  # the token, if the runner wrote it, is in the pipe by now
            with contextlib.suppress(BlockingIOError):
                got = os.read(done_r, 64)
        finally:
            for fd in (token_r, done_w, done_r):
                if fd >= 0:
                    os.close(fd)
        text = log.read_bytes()[-8000:].decode("utf-8", errors="replace")[-2000:]
    if status == "passed" and got != token:
        status = "failed"
        text += "\n(exit status 0, but the program ended before its tests finished)"
    return ExecResult(status == "passed", status, text)


def run_programs(sources: list[str], timeout_s: float = 5.0, memory_mb: int = 1024,
                 workers: int | None = None) -> list[ExecResult]:
    """:func:`run_program` for many programs, ``workers`` at a time (default: the usable CPUs, at
    most 8), results in input order."""
    if not sources:
        return []
    if workers is None:
        workers = min(8, usable_cpus())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda s: run_program(s, timeout_s, memory_mb), sources))
