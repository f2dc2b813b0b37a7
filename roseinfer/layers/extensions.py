"""Kernels in C++ or CUDA built on the machine that runs them, at first use, by torch's
``cpp_extension``, and kept under the cache: a library a source, its flags, torch and the
``target`` (the CPU or GPU it was built for), loaded later in a fraction of a second."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def build_library(source: Path, namespace: str, flags: tuple[str, ...], target: str,
                  what: str, cuda_flags: tuple[str, ...] = (), headers: tuple[Path, ...] = ()):
    """Builds ``source`` (once per key; ``what`` names it in the log and errors) and
    returns its ops, ``torch.ops.<namespace>``; ``headers``: the files it includes, whose
    text joins the key. Raises RuntimeError where no compiler (nvcc for a .cu source) or
    ninja can build it."""
    from torch.utils.cpp_extension import load

    from roseinfer.models.loader import CACHE_DIR

    if shutil.which("ninja") is None:  # the ninja wheel's, where none is on PATH
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    key = hashlib.sha256("\0".join([source.read_text(), *(h.read_text() for h in headers),
                                    *flags, *cuda_flags,
                                    torch.__version__, target]).encode()).hexdigest()[:16]
    name = f"{namespace}_{key}"
    folder = Path(CACHE_DIR) / "kernels"
    library = folder / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:  # load() loads what it builds
        log.info("building %s for this machine (once)", what)
        folder.mkdir(parents=True, exist_ok=True)
        # Built in a scratch folder and renamed into place: a build killed half-way leaves
        # torch's lock file only there (in a shared folder it would stall every later
        # build), and processes building at once each rename a whole library
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            try:
                load(name=name, sources=[str(source)], extra_cflags=list(flags),
                     extra_cuda_cflags=list(cuda_flags), build_directory=scratch,
                     is_python_module=False)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                raise RuntimeError(f"could not build {what} ({e})") from e
            os.replace(os.path.join(scratch, f"{name}.so"), library)
    return getattr(torch.ops, namespace)
