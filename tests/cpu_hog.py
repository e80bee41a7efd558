"""Run a command while every core is busy: ``python tests/cpu_hog.py [--per-core N] -- COMMAND...`` starts N
(default 1) Python spinners per core this process may use, at normal priority, runs COMMAND, stops the spinners
and exits with COMMAND's status. ``make test-under-load`` runs the test suite this way (issue 44: no test may
depend on the machine's load; tests inject measurements, speed belongs to benchmarks/)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys


def _spin() -> None:
    x = 0
    while True:  # pure CPU: no memory traffic, no syscalls
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-core", type=int, default=1, help="spinners per core (default 1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.per_core < 1:
        p.error("expected --per-core >= 1 and -- COMMAND")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(cores * args.per_core)]
    for s in spinners:
        s.start()
    print(f"cpu_hog: {len(spinners)} spinner(s) on {cores} core(s) while: {' '.join(command)}", flush=True)
    try:
        return subprocess.call(command)
    finally:
        for s in spinners:  # only the spinners this process started
            s.terminate()
            s.join()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
