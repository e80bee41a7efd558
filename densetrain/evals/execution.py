"""HumanEval programs and their sandboxed execution: one limited, isolated process per program.

**Isolation** (required; :func:`require_sandbox`): each program (:func:`run_program`) runs under ``unshare
--user --map-root-user --net --pid --fork --mount-proc --kill-child`` in new user, network, pid and mount
namespaces, with an empty environment, stdin closed. Inside, a small trusted runner (``python -I``:
no ``PYTHON*`` variables, no user site) is pid 1 and:

1. marks itself not dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so the program cannot open its
   ``/proc/1/fd/*``, read ``/proc/1/mem`` or ptrace it;
2. makes every inherited mount read-only in one call (``mount_setattr(/, AT_RECURSIVE,
   MOUNT_ATTR_RDONLY)``, Linux >= 5.12; allowed in a user namespace, as it only adds restrictions) and
   mounts a fresh tmpfs (32 MiB, 4096 inodes) on ``/tmp``, which is the program's working directory and
   holds ``program.py`` and ``output.txt``: the program can write there and nowhere else (not the run's
   checkpoints, not ``/dev/shm``), and the host's ``/tmp`` is hidden;
3. forks the program's process, which enters a user namespace of its own (no capability over the runner's
   namespaces: it can neither undo the read-only mounts nor trace the runner), closes every descriptor but
   stdio (``/dev/null``, ``output.txt``) and a completion pipe, sets ``RLIMIT_AS`` (address space, default
   1 GiB: a memory bomb gets ``MemoryError``), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (16 MiB) and
   ``RLIMIT_CORE`` = 0, replaces the ``socket`` constructors with one that raises, and runs the program;
4. kills it at the wall-time limit (default 5 s; human-eval uses 3 s, we add margin for busy machines).

The network namespace has no interface but its own loopback, so nothing outside is reachable even when the
socket guard is undone. The program sees only the runner and itself in ``/proc`` and cannot signal the
evaluating process or the training run that hosts in-loop tasks; SIGKILL to the runner (pid 1 of the
namespace) is ignored by the kernel. When the runner ends, the kernel kills everything left in the
namespace, so background children (even ones that called ``setsid``) do not survive. Where this machine
refuses any of this (no ``unshare``, ``kernel.unprivileged_userns_clone = 0``, a kernel before 5.12, a
container without namespaces; probed once per process by running an empty program), code execution is
refused with one line rather than run unisolated or with a writable host file system.

**Passing** needs two signals. (a) The program's process writes a per-run random nonce to the completion
pipe after the program and its tests returned, then exits with status 0: an early ``os._exit(0)``, a
signal, an ``exec`` of another program, ``sys.exit()`` (human-eval treats it the same way) or a printed
imitation of success therefore fail ("ended before its tests finished"). (b) Only then does the runner
read the per-run token from a descriptor the program's process never held (closed before the program
starts; its number alone is useless) and write it on its stdout, a pipe only the runner holds; the
evaluating process counts a pass only with that token. The token is read after the fork, so no copy of it
is in the program's memory, and the runner's descriptors and memory are closed to the program (1, 3), so
reading or scanning descriptors (``/proc/self/fd``, ``/proc/1/fd``, argv) yields nothing that passes.

What this does **not** stop: the nonce is in the program's own process (it has to be, to be written after
the tests), so a program written against this module, which digs it out of the harness's Python frames
and writes it to descriptor 3 before leaving, is scored as a pass; so is any program that defeats the
tests in-process (an object whose ``__eq__`` is always true, replacing ``check``), as in human-eval. Such
a program still cannot obtain the token, write outside its tmpfs, reach the network, or signal or read
anything outside its namespaces. Kernel bugs are out of scope: run untrusted model output only on machines
where that is acceptable (human-eval's own warning). Limits are set in the program's process rather than
in a ``preexec_fn``: Python documents ``preexec_fn`` as unsafe in threaded programs (PyTorch's thread
pools, our execution threads).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from densetrain.data.tokenizer import usable_cpus
from densetrain.errors import TrainError
from densetrain.registry.gen_tasks import Problem

__all__ = ["ExecResult", "humaneval_program", "require_sandbox", "run_program", "run_programs"]


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    Attributes:
        passed: it ran to the end without an exception, exit status 0, completion reported after its tests
            returned, and this run's token handed over by the runner (module docstring).
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

# The runner: pid 1 of the sandbox's namespaces, trusted code (module docstring). argv: memory bytes, CPU
# seconds, file-size bytes, wall seconds, the token's fd; stdin: the program source; stdout: one line
# "<token, or dashes> <status>" and then the tail of the program's output. The token is read from its fd
# only after the program's process ended, so no copy of it is in any memory the program shares.
_RUNNER = r"""
import ctypes, os, secrets, select, signal, sys
mem, cpu, fsize = (int(a) for a in sys.argv[1:4])
timeout_s, token_fd = float(sys.argv[4]), int(sys.argv[5])
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1: the kernel drops signals it has no handler for
def report(status, text=b"", token=b"-" * 32):
    os.write(1, token + b" " + status + b"\n" + text[-8000:])
    os._exit(0)
def need(rc, what):
    if rc != 0:
        report(b"refused", f"{what}: {os.strerror(ctypes.get_errno())}".encode())
need(libc.prctl(4, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")  # no /proc/1/fd, /proc/1/mem, ptrace of pid 1
# mount_setattr is syscall 442 on every architecture (numbers from 424 on are shared; Alpha aside)
attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr {.attr_set = MOUNT_ATTR_RDONLY}
need(libc.syscall(442, -100, b"/", 0x8000, attr, 32), "mount_setattr(/, AT_RECURSIVE, MOUNT_ATTR_RDONLY)")
need(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 2 | 4, b"size=32m,nr_inodes=4096,mode=0700"), "mount tmpfs on /tmp")
os.chdir("/tmp")
with open("program.py", "wb") as f:
    f.write(sys.stdin.buffer.read())
nonce = secrets.token_hex(16).encode()
done_r, done_w = os.pipe()
pid = os.fork()
if pid == 0:  # the program's process
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python program
        # a user namespace of its own: no capability over ours (it cannot undo the read-only mounts, nor
        # trace us); only stdio (to output.txt) and the completion pipe (fd 3) stay open
        if libc.unshare(0x10000000) != 0:
            os._exit(125)
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(done_w, 3)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        import resource
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
        sys.argv = ["program.py"]
        with open("program.py", encoding="utf-8") as f:
            code = compile(f.read(), "program.py", "exec")
        exec(code, {"__name__": "__main__"})
        os.write(3, nonce)  # reached only when the program and its tests returned
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except SystemExit as e:  # human-eval counts sys.exit() as a failure too
        sys.stderr.write(f"program called exit({e.code!r})\n")
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(1)
os.close(done_w)
pidfd = os.pidfd_open(pid)
status = b"passed"
if not select.select([pidfd], [], [], timeout_s)[0]:
    os.kill(pid, signal.SIGKILL)
    status = b"timeout"
rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
if rc == 125:
    report(b"refused", b"unshare(CLONE_NEWUSER) failed in the program's process")
os.set_blocking(done_r, False)
try:
    got = os.read(done_r, 64)
except BlockingIOError:
    got = b""
with open("output.txt", "rb") as f:
    f.seek(max(0, os.fstat(f.fileno()).st_size - 8000))
    text = f.read()
if status == b"passed" and rc != 0:
    status = b"failed"
elif status == b"passed" and got != nonce:
    status, text = b"failed", text + b"\n(exit status 0, but the program ended before its tests finished)"
report(status, text, os.read(token_fd, 64) if status == b"passed" else b"-" * 32)
"""


_UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", "--kill-child")
_GRACE_S = 10.0  # beyond the runner's own wall-time kill: interpreter start-up on a busy machine


def _run(prefix: tuple[str, ...], source: str, timeout_s: float, memory_mb: int) -> tuple[str, str]:
    """Run ``source`` under the runner in the namespaces ``prefix`` creates; ``(status, output)``, status
    ``'passed'`` only with this run's token."""
    cpu_s = int(math.ceil(timeout_s)) + 1  # a CPU-time backstop; the wall-time kill comes first
    token = secrets.token_hex(16).encode()
    token_r, token_w = os.pipe()
    os.write(token_w, token)
    os.close(token_w)
    cmd = [*prefix, sys.executable, "-I", "-c", _RUNNER, str(memory_mb << 20), str(cpu_s), str(_FSIZE_BYTES),
           str(timeout_s), str(token_r)]
    try:
        with subprocess.Popen(cmd, env={}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True, pass_fds=(token_r,)) as proc:
            os.close(token_r)
            token_r = -1
            try:
                out = proc.communicate(source.encode(), timeout=timeout_s + _GRACE_S)[0]
            except subprocess.TimeoutExpired:
                out = b"-" * 32 + b" timeout\n"
            finally:
                _kill_group(proc.pid)  # also any children left behind
                proc.wait()
    finally:
        if token_r >= 0:
            os.close(token_r)
    head, _, text = out.partition(b"\n")
    got, _, status = head.partition(b" ")
    if status == b"passed" and got != token:  # the runner's line is the only one on this pipe; belt and braces
        status = b"failed"
    if status not in (b"passed", b"failed", b"timeout", b"refused"):
        status, text = b"failed", out
    return status.decode(), text[-8000:].decode("utf-8", errors="replace")[-2000:]


@functools.lru_cache(maxsize=1)
def _sandbox() -> tuple[tuple[str, ...], str]:
    """``(unshare command prefix, '')`` when the sandbox of the module docstring works here (probed once
    per process by running an empty program in it), else ``((), why not)``."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return (), "no unshare command (util-linux) on this Linux machine" if exe is None else "not Linux"
    try:
        status, text = _run((exe, *_UNSHARE_FLAGS), "pass\n", 10.0, 256)
        why = "" if status == "passed" else (text.strip().splitlines() or [f"{status}, no output"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    return ((exe, *_UNSHARE_FLAGS), "") if not why else ((), why)


def require_sandbox() -> None:
    """Raise unless generated code can run isolated here (module docstring).

    Raises: TrainError, one line: what failed and what to do."""
    prefix, why = _sandbox()
    if not prefix:
        raise TrainError(f"generated code is not run here: the humaneval sandbox needs user, network, pid and "
                         f"mount namespaces with read-only remounts (unshare {' '.join(_UNSHARE_FLAGS)}: {why}); "
                         "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, Linux >= "
                         "5.12) or leave humaneval out of the tasks")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> ExecResult:
    """Run Python ``source`` in a separate, limited, isolated process (module docstring).

    Args:
        source: the program text.
        timeout_s: wall-time limit in seconds (> 0); the program's process is killed after it.
        memory_mb: address-space limit in MiB (RLIMIT_AS).

    Returns:
        an :class:`ExecResult`; ``passed`` only with exit status 0, completion reported after the tests
        returned, and this run's token.

    Raises:
        ValueError: timeout_s <= 0 or memory_mb < 1.
        TrainError: no sandbox on this machine (:func:`require_sandbox`).
    """
    if timeout_s <= 0 or memory_mb < 1:
        raise ValueError(f"need timeout_s > 0 and memory_mb >= 1, got {timeout_s}, {memory_mb}")
    require_sandbox()
    status, text = _run(_sandbox()[0], source, timeout_s, memory_mb)
    if status == "refused":  # worked for the probe, not now: never run unisolated
        raise TrainError(f"generated code is not run here: the humaneval sandbox failed: {text.strip()}")
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
