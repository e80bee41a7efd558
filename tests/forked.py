"""``python SCRIPT ARGS`` and ``python -m MODULE ARGS`` processes for the tests, forked from one interpreter
that has already imported torch and densetrain (multiprocessing's ``forkserver``, one per pytest worker).

Why: a fresh interpreter spends ~3 s of CPU importing torch, torch.distributed.tensor and densetrain
before a rank does anything; the suite starts about two hundred such processes (gloo ranks, CLI runs),
which was a third of its CPU time. A forked child is still its own OS process (its own pid, signals,
exit status, file descriptors, torch.distributed state and gloo sockets); only the import work is done
once. The fork server is a clean process (no threads, no process group) started with one OpenMP thread;
each child gets the environment, working directory, argv and stdout/stderr it asked for. What torch reads
from the environment when it starts (OMP_NUM_THREADS, glibc's MALLOC_* tunables) is the server's: a test that
sets those starts its process with :mod:`subprocess`.

:class:`Popen` and :func:`run` take the subset of :mod:`subprocess`'s arguments the tests use; argv
other than ``[sys.executable, SCRIPT | -m MODULE, ...]`` goes to :mod:`subprocess` itself.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile

PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL
PRELOAD = ["forked", "torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "densetrain.cli",
           "densetrain.train", "densetrain.parallel", "densetrain.evals"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        import multiprocessing.forkserver as fs

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # what every child asks for; OpenMP reads it when torch loads
        try:
            fs.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _ctx = ctx
    return _ctx


def stop() -> None:
    """Stop this process's fork server (if started) and reap it: no server outlives the pytest worker, and
    the CPU time of every forked child counts in the worker's own children's time (``time make test``)."""
    import multiprocessing.forkserver as fs

    if _ctx is not None:
        fs._forkserver._stop()


def _child(argv: list[str], env: dict, cwd: str | None, out: str, err: str) -> None:
    """In the forked child: become ``python *argv`` (the environment, cwd, fds 1 and 2, sys.argv, __main__)."""
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # multiprocessing leaves with os._exit: run them as an interpreter would
        sys.stdout.flush()
        sys.stderr.flush()


class Popen:
    """A started child; ``stdout``/``stderr``: ``PIPE`` (returned by :meth:`communicate`), ``DEVNULL``, or
    None (copied to this process's own stream when the child has ended, where pytest captures it)."""

    def __init__(self, args, env=None, cwd=None, stdout=None, stderr=None, text=False, **kw):
        self.args, self._text = [os.fspath(a) for a in args], text
        forkable = (not kw and len(self.args) >= 2 and self.args[0] == sys.executable
                    and (self.args[1] == "-m" or not self.args[1].startswith("-")))
        if not forkable:
            self._sub = subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, **kw)
            self.pid = self._sub.pid
            return
        self._sub = None
        self._modes = (stdout, stderr)
        self._files = []
        for mode in self._modes:
            if mode == DEVNULL:
                self._files.append(os.devnull)
            else:
                fd, path = tempfile.mkstemp(prefix="forked-")
                os.close(fd)
                self._files.append(path)
        self._proc = _context().Process(target=_child, args=(self.args[1:], dict(os.environ if env is None else env),
                                                              None if cwd is None else str(cwd), *self._files))
        self._proc.start()
        self.pid = self._proc.pid
        self._result = None

    @property
    def returncode(self):
        return self._sub.returncode if self._sub else self._proc.exitcode

    def poll(self):
        return self._sub.poll() if self._sub else self._proc.exitcode

    def wait(self, timeout=None):
        if self._sub:
            return self._sub.wait(timeout)
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self._read_outputs()
        return self._proc.exitcode

    def communicate(self, timeout=None):
        if self._sub:
            return self._sub.communicate(timeout=timeout)
        self.wait(timeout)
        return self._result

    def _read_outputs(self) -> None:
        if self._result is not None:
            return
        res = []
        for mode, path, stream in zip(self._modes, self._files, (sys.stdout, sys.stderr), strict=True):
            if mode == DEVNULL:
                res.append(None)
                continue
            with open(path, "rb") as f:
                data = f.read()
            os.unlink(path)
            if mode == PIPE:
                res.append(data.decode() if self._text else data)
            else:
                stream.write(data.decode(errors="replace"))
                res.append(None)
        self._result = tuple(res)

    def send_signal(self, sig):
        if self._sub:
            self._sub.send_signal(sig)
        elif self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def run(args, env=None, cwd=None, capture_output=False, text=False, timeout=None, check=False, stdout=None,
        stderr=None):
    """:func:`subprocess.run` for the argv :class:`Popen` forks (the others go to subprocess)."""
    if capture_output:
        stdout = stderr = PIPE
    p = Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, args, out, err)
    return subprocess.CompletedProcess(args, p.returncode, out, err)
