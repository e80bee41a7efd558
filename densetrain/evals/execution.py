"""HumanEval programs and their sandboxed execution: one limited process per program, no network.

Each program (:func:`run_program`) runs in its own ``python -I`` process (isolated mode: no
``PYTHON*`` variables, no user site, script directory not on ``sys.path``) with an empty
environment, in a fresh temporary directory that is its working directory and is deleted afterwards,
stdin closed, output to a file there. Before the program starts, its interpreter sets
``RLIMIT_AS`` (address space, default 1 GiB: a memory bomb gets ``MemoryError``), ``RLIMIT_CPU``,
``RLIMIT_FSIZE`` (16 MiB: output and files) and ``RLIMIT_CORE`` = 0, and replaces the ``socket``
constructors with one that raises. It runs in its own session (process group); at the wall-time
limit (default 5 s; human-eval uses 3 s, we add margin for interpreter start-up on busy machines) the
whole group is killed with SIGKILL, and the group is killed after a normal exit too, so background
children do not survive. Where unprivileged user namespaces are allowed (``unshare -rn`` works), the
process also gets its own user and network namespaces (no network interfaces; "root" inside
maps to the calling user outside): no network at all. Not isolated:
the file system (the program can read and write whatever the user can), the process count (a fork
bomb lives until the wall-time limit; a child that calls ``setsid`` escapes the group kill), and,
without ``unshare``, the network through other modules than ``socket``. Run untrusted model output
only on machines where that is acceptable (human-eval's own warning). Limits are set in the child
rather than in a ``preexec_fn``: Python documents ``preexec_fn`` as unsafe in threaded programs
(PyTorch's thread pools, our execution threads).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from densetrain.data.tokenizer import usable_cpus
from densetrain.registry.gen_tasks import Problem

__all__ = ["ExecResult", "humaneval_program", "run_program", "run_programs"]


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

# Runs in the child before the program: resource limits, no socket constructors, then the program.
# sys.exit() inside the program counts as failure (human-eval catches BaseException the same way).
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
with open(sys.argv[1], encoding="utf-8") as f:
    code = compile(f.read(), sys.argv[1], "exec")
try:
    exec(code, {"__name__": "__main__"})
except SystemExit as e:
    sys.stderr.write(f"program called exit({e.code!r})\n")
    sys.exit(1)
"""


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``('unshare', '-rn')`` when a user + network namespace can be created here, else ()."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 1024, netns: bool = True) -> ExecResult:
    """Run Python ``source`` in a separate, limited process (module docstring: what is isolated).

    Args:
        source: the program text.
        timeout_s: wall-time limit in seconds (> 0); the process group is killed after it.
        memory_mb: address-space limit in MiB (RLIMIT_AS).
        netns: run in a new network namespace where ``unshare -rn`` works (else only the ``socket``
            constructors are disabled).

    Returns:
        an :class:`ExecResult`.

    Raises:
        ValueError: timeout_s <= 0 or memory_mb < 1.
    """
    if timeout_s <= 0 or memory_mb < 1:
        raise ValueError(f"need timeout_s > 0 and memory_mb >= 1, got {timeout_s}, {memory_mb}")
    cpu_s = int(math.ceil(timeout_s)) + 1  # a CPU-time backstop; the wall-time kill comes first
    with tempfile.TemporaryDirectory(prefix="densetrain-exec-") as tmp:
        prog, log = Path(tmp) / "program.py", Path(tmp) / "output.txt"
        prog.write_text(source, encoding="utf-8")
        cmd = [*(_netns_prefix() if netns else ()), sys.executable, "-I", "-c", _RUNNER, str(prog),
               str(memory_mb << 20), str(cpu_s), str(_FSIZE_BYTES)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=tmp, env={}, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
                status = "passed" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                _kill_group(proc.pid)  # also any children left behind
                proc.wait()
        text = log.read_bytes()[-8000:].decode("utf-8", errors="replace")[-2000:]
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
