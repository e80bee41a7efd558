"""Fetching the Debian packages of the demo corpus without installing them: ``apt-get download``
into a cache, ``dpkg-deb -x`` into a scratch directory (:class:`DebPackages`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def log(msg: str) -> None:
    """One ``[corpus]`` progress line (the demo corpus modules' log)."""
    print(f"[corpus] {msg}", flush=True)


def sweep_scratch(parent: Path) -> None:
    """Remove the ``unpack-*`` scratch directories a killed build left in ``parent`` (a SIGKILL/SIGTERM skips
    the TemporaryDirectory cleanup; the ladder corpus's can hold 500 MB). Two builds into one corpus
    directory at once would overwrite each other's files anyway, so none can be in use."""
    for d in sorted(parent.glob("unpack-*")) if parent.is_dir() else []:
        log(f"removing {d}: the unpacked packages of a killed build")
        shutil.rmtree(d, ignore_errors=True)


class DebPackages:
    """Download (apt-get download) and unpack (dpkg-deb -x) Debian packages, without installing."""

    def __init__(self, cache_dir: Path, extract_root: Path):
        self.cache_dir = cache_dir
        self.extract_root = extract_root
        self.available = bool(shutil.which("apt-get") and shutil.which("dpkg-deb"))
        self.updated = False
        self.errors: dict[str, str] = {}

    def _cached(self, pkg: str) -> Path | None:
        debs = sorted(self.cache_dir.glob(f"{pkg}_*.deb"))
        return debs[-1] if debs else None

    def deb(self, pkg: str) -> Path | None:
        """The cached ``.deb`` of ``pkg`` (the newest file name when several), or None."""
        return self._cached(pkg)

    def _apt_download(self, pkgs: list[str]) -> tuple[bool, str]:
        try:
            r = subprocess.run(["apt-get", "download", "-q", *pkgs], cwd=self.cache_dir, capture_output=True, text=True,
                               timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
        if r.returncode == 0:
            return True, ""
        lines = (r.stderr or "").strip().splitlines()
        errs = [line for line in lines if line.startswith("E:")]
        return False, errs[-1] if errs else lines[-1] if lines else f"exit status {r.returncode}"

    def _update(self) -> None:
        # A fresh container often has empty package lists; refreshing them needs root.
        if self.updated or not hasattr(os, "geteuid") or os.geteuid() != 0:
            return
        self.updated = True
        log("package download failed; running apt-get update -qq (root, package lists may be empty)")
        try:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def prefetch(self, pkgs: list[str]) -> None:
        """Download every package not cached yet, in one apt-get call when possible."""
        if not self.available:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        todo = [p for p in pkgs if self._cached(p) is None]
        if not todo:
            return
        log(f"apt-get download {' '.join(todo)}")
        ok, _ = self._apt_download(todo)
        if not ok:
            self._update()
            ok, _ = self._apt_download(todo)
        if not ok:  # one bad name fails the whole call: fetch what can be fetched one by one
            for p in todo:
                if self._cached(p) is None:
                    ok1, err = self._apt_download([p])
                    if not ok1:
                        self.errors[p] = err or "apt-get download failed"

    def get(self, pkg: str) -> Path | None:
        """Unpacked root of ``pkg`` (downloading it if needed), or None when unavailable."""
        if not self.available:
            return None
        dest = self.extract_root / pkg
        if dest.is_dir():
            return dest
        deb = self._cached(pkg)
        if deb is None:
            self.prefetch([pkg])
            deb = self._cached(pkg)
        if deb is None:
            self.errors.setdefault(pkg, "download failed")
            return None
        tmp = self.extract_root / f".{pkg}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        r = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            self.errors[pkg] = f"dpkg-deb -x failed: {r.stderr.strip()[-200:]}"
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        tmp.rename(dest)
        return dest
