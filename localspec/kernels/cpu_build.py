"""Building localspec's C++ CPU kernels on first use, with the system's C++ compiler.

The sources need no torch headers (their threads come from OpenMP, which resolves to the libgomp
torch has already loaded, so both share one thread pool), so a build takes a few seconds. The
library is cached per source, compiler and flags, and loaded with ctypes. A machine without a
compiler, or a CPU the kernels do not support, gets a one-line reason (`KernelUnavailable`) and
the caller keeps another path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
"""-ffp-contract=off: the kernels' scalar parts (a tail of features past the last vector) must not
become fused multiply-adds in one compiled copy of a loop and a multiply then an add in another
(GCC versions loops, e.g. on whether a slot lies in a row's prefix): a row's bits must not depend
on how its visible slots were listed. The vector parts are intrinsics and say which they mean."""


class KernelUnavailable(RuntimeError):
    """A kernel cannot run here; the message says why in one line."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.cache
def sources_digest() -> str:
    """A short digest of every C++ source shipped here: measurements of passes that may run these
    kernels are keyed by it, so a changed kernel is measured again."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.cpp")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:8]


def build(source: Path, cache_dir: Path, what: str) -> ctypes.CDLL:
    """Compile `source` into cache_dir once (per source, compiler and flags) and load it."""
    machine = platform.machine()  # os.uname does not exist on Windows, which names x86-64 AMD64
    if machine not in ("x86_64", "AMD64"):
        raise KernelUnavailable(f"the {what} is for x86 CPUs, this is {machine}")
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler found (install g++, or set CXX) to build the {what}")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C++ compiler {cxx} does not run ({exc})") from None
    key = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    library = Path(cache_dir) / f"{source.stem}-{key}.so"
    if library.is_file():
        try:
            return ctypes.CDLL(str(library))
        except OSError:  # a damaged file in the cache (disk full while copying, edited): build it again
            library.unlink(missing_ok=True)
    _compile(cxx, source, library, what)
    try:
        return ctypes.CDLL(str(library))
    except OSError as exc:
        raise KernelUnavailable(f"the {what} built with {cxx} does not load ({exc})") from None


def _compile(cxx: str, source: Path, library: Path, what: str) -> None:
    """Compile `source` into `library` through a private temporary file and an atomic rename."""
    library.parent.mkdir(parents=True, exist_ok=True)
    # a private file, then an atomic rename: two processes building at once never share a file
    fd, partial = tempfile.mkstemp(dir=library.parent, prefix=library.name, suffix=".partial")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(source), "-o", partial], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise KernelUnavailable(f"building the {what} with {cxx} failed: {last}")
        os.replace(partial, library)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"building the {what} with {cxx} failed: {exc}") from None
    finally:
        Path(partial).unlink(missing_ok=True)
