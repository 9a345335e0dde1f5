"""Build ringtrain's container image on this machine and run commands inside it, without an OCI runtime.

This sandbox refuses ``podman run`` (crun's setrlimit is not permitted), so the image is
built with ``podman build --isolation chroot`` and its commands run through the same
chroot isolation with ``buildah run --isolation chroot`` (docs/container.md). Everything lives in one work directory: the container storage
(``podman --root``), a Debian base made offline from Debian's packages by debootstrap,
the build context with a wheelhouse, and it is all removed by :meth:`Images.close`.

``prepare(work)`` checks the tools (installing podman, buildah and debootstrap with
apt-get when root and missing) and skips, naming the reason, where they cannot be
installed or run; a failing build of a working toolchain is a test failure.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
#: The base is Debian 12, as debian:bookworm-slim (the Containerfile's default base):
#: its python3 is 3.11 and its glibc 2.36, so the wheelhouse is resolved for CPython 3.11
#: on manylinux_2_17 ... 2_36 (pip takes the platforms it is given, not older ones).
SUITE, PYTHON_VERSION, GLIBC_MINOR = "bookworm", "3.11", 36
MIRROR = "http://deb.debian.org/debian"
BASE_IMAGE = "localhost/ringtrain-test-base:bookworm"
PACKAGES = {"podman": "podman", "buildah": "buildah", "debootstrap": "debootstrap"}

__all__ = ["Images", "ROOT", "prepare"]


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip()


@dataclass
class Images:
    """podman/buildah on a private storage under ``work``; built images and working containers."""

    work: Path
    env: dict[str, str] = field(default_factory=dict)
    containers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.work / "tmp").mkdir(parents=True, exist_ok=True)
        # TMPDIR: podman's and buildah's temporary files stay in the work directory too.
        self.env = dict(os.environ, TMPDIR=str(self.work / "tmp"), BUILDAH_ISOLATION="chroot")

    def _storage(self) -> list[str]:
        return ["--root", str(self.work / "storage"), "--runroot", str(self.work / "run")]

    def podman(self, *args: str, timeout: float = 120, check: bool = True,
               **kw: object) -> subprocess.CompletedProcess[str]:
        return self._run(["podman", *self._storage(), *args], timeout, check, **kw)

    def buildah(self, *args: str, timeout: float = 120, check: bool = True,
                **kw: object) -> subprocess.CompletedProcess[str]:
        return self._run(["buildah", *self._storage(), *args], timeout, check, **kw)

    def _run(self, argv: list[str], timeout: float, check: bool,
             **kw: object) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env,
                             **kw)  # type: ignore[call-overload]
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv[:6])} ... failed ({res.returncode}):\n"
                                 f"{_tail(res.stdout)}\n{_tail(res.stderr)}")
        return res

    # -- building ---------------------------------------------------------------------------
    def debian_base(self) -> str:
        """A minimal Debian image made from Debian's packages (45-80 s here, network-bound)."""
        rootfs = self.work / "rootfs"
        res = subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), MIRROR],
                             capture_output=True, text=True, timeout=300, env=self.env)
        if res.returncode != 0:
            pytest.skip(f"debootstrap could not make a Debian {SUITE} base from {MIRROR} here: "
                        f"{_tail(res.stdout + res.stderr, 300)}")
        # What debootstrap downloaded stays out of the base (the build runs apt-get update).
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / leftover).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            self.podman("import", "-", BASE_IMAGE, stdin=tar.stdout, timeout=300)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(timeout=60)
        shutil.rmtree(rootfs)
        return BASE_IMAGE

    def context(self, extras: tuple[str, ...]) -> tuple[Path, str]:
        """The repository copied as a build context, plus wheels/ with everything pip needs.

        Returns the context and the torch requirement. torch is the CPU build of the
        version under test (``+cpu``), so this never downloads the multi-GB CUDA build:
        on our machines pip finds it on local disk through its configuration.
        """
        ctx = self.work / "context"
        shutil.copytree(ROOT, ctx, ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "checkpoints", "out", "build", "dist", "__pycache__",
            "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache", "wheels"))
        base_version = importlib.metadata.version("torch").split("+")[0]
        torch_req = f"torch=={base_version}+cpu"
        reqs = [torch_req, "setuptools>=77", "wheel"]  # the last two: building ringtrain
        for text in importlib.metadata.requires("ringtrain") or []:
            req = Requirement(text)
            if req.name == "torch":
                continue
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                reqs.append(f"{req.name}{req.specifier}")
        arch = platform.machine()
        platforms = [a for minor in range(GLIBC_MINOR, 16, -1)
                     for a in ("--platform", f"manylinux_2_{minor}_{arch}")]
        platforms += ["--platform", f"manylinux2014_{arch}"]
        res = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q",
             "-d", str(ctx / "wheels"), "--only-binary=:all:", "--python-version", PYTHON_VERSION,
             "--implementation", "cp", *platforms, *reqs],
            capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            errors = "\n".join(line for line in res.stderr.splitlines() if not line.startswith("WARNING"))
            pytest.skip(f"pip could not collect the image's wheels ({torch_req} must be a CPU "
                        f"wheel pip can find, e.g. on local disk): {_tail(errors, 400)}")
        return ctx, torch_req

    def build(self, ctx: Path, tag: str, build_args: dict[str, str],
              containerfile: str = "Containerfile") -> float:
        """``podman build --isolation chroot``; returns its wall time in seconds."""
        args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
        t0 = time.monotonic()
        res = self.podman("build", "--isolation", "chroot", "-f", str(ctx / containerfile),
                          "-t", tag, *args, str(ctx), timeout=720, check=False)
        elapsed = time.monotonic() - t0
        (self.work / f"build-{tag.rsplit(':', 1)[-1]}.log").write_text(res.stdout + res.stderr)
        assert res.returncode == 0, f"podman build failed:\n{_tail(res.stdout, 3000)}\n{_tail(res.stderr)}"
        return elapsed

    def probe_build(self, base: str) -> None:
        """Skip where chroot-isolated RUN steps cannot run at all (not the Containerfile's fault)."""
        probe = self.work / "probe"
        probe.mkdir(exist_ok=True)
        (probe / "Containerfile").write_text(f"FROM {base}\nRUN true\n")
        res = self.podman("build", "--isolation", "chroot", "-t", "localhost/ringtrain-probe",
                          str(probe), timeout=300, check=False)
        if res.returncode != 0:
            pytest.skip(f"podman build --isolation chroot cannot run RUN steps here: {_tail(res.stderr, 400)}")
        self.podman("rmi", "localhost/ringtrain-probe", check=False)

    # -- running ----------------------------------------------------------------------------
    def container(self, image: str, name: str) -> str:
        """A working container: its own copy-on-write file system, like one host's container."""
        self.buildah("from", "--pull-never", "--name", name, image)
        self.containers.append(name)
        return name

    def run_argv(self, name: str, *command: str, volumes: tuple[str, ...] = ()) -> list[str]:
        """``buildah run`` of ``command`` in container ``name``, in the caller's network namespace.

        One command at a time per container: a second ``buildah run`` on the same
        container unmounts its file system under the first when it ends.
        """
        vols = [a for v in volumes for a in ("-v", v)]
        return ["buildah", *self._storage(), "run", "--isolation", "chroot", *vols, name, "--", *command]

    def run(self, name: str, *command: str, volumes: tuple[str, ...] = (),
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.run_argv(name, *command, volumes=volumes), capture_output=True,
                              text=True, timeout=timeout, env=self.env)

    def mount(self, image: str) -> Path:
        return Path(self.podman("image", "mount", image).stdout.strip())

    def size(self, image: str) -> int:
        return int(self.podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())

    def close(self) -> None:
        """Remove every container, image and file of the work directory (also after a kill)."""
        for tool, args in ((self.buildah, ("rm", "--all")), (self.podman, ("image", "unmount", "--all")),
                           (self.podman, ("rmi", "--all", "--force"))):
            try:
                tool(*args, check=False, timeout=300)
            except subprocess.TimeoutExpired:
                pass  # the unmounts and the removal below still free the disk
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(self.work))]
        for mnt in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


def prepare(work: Path) -> Images:
    """Tools present and working, or skip with the reason."""
    if not Path("/proc/self/mounts").exists():
        pytest.skip("container image tests need Linux")
    if os.geteuid() != 0:
        pytest.skip("container image tests need root: debootstrap and podman's chroot isolation (CI runs as root)")
    missing = sorted({pkg for cmd, pkg in PACKAGES.items() if shutil.which(cmd) is None})
    if missing:
        if shutil.which("apt-get") is None:
            pytest.skip(f"needs {', '.join(missing)} and there is no apt-get to install them")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        res = subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True, env=env,
                             timeout=300)
        if res.returncode == 0:
            res = subprocess.run(["apt-get", "install", "-y", "-qq", *missing], capture_output=True,
                                 text=True, env=env, timeout=600)
        if res.returncode != 0:
            pytest.skip(f"cannot install {' '.join(missing)} with apt-get: {_tail(res.stderr, 300)}")
    images = Images(work)
    res = images.podman("info", check=False)
    if res.returncode != 0:
        images.close()
        pytest.skip(f"podman cannot run here: {_tail(res.stderr, 300)}")
    return images
