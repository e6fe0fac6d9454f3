"""Finding NVRTC for the native extension.

The extension loads ``libnvrtc.so`` at run time under the names CUDA 12 uses (``libnvrtc.so``,
``libnvrtc.so.12``, ...). A PyTorch built for CUDA 13 brings ``libnvrtc.so.13`` in a pip
package, which those names miss. The extension also searches ``sparse_mla/_nvrtc/`` (its
RUNPATH), so when no NVRTC is found under the usual names this module links the first one
it finds there: ``$SPARSE_MLA_NVRTC`` (a path to a libnvrtc.so*), the ``nvidia`` pip packages,
``$CUDA_HOME`` / ``/usr/local/cuda*``.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
LINK_DIR = os.path.join(_HERE, "_nvrtc")


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def _candidates() -> List[str]:
    found: List[str] = []
    env = os.environ.get("SPARSE_MLA_NVRTC")
    if env:
        found.append(env)
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels

        for base in list(getattr(nvidia, "__path__", [])):
            found += sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
    roots += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for r in roots:
        if r:
            found += sorted(glob.glob(os.path.join(r, "lib64", "libnvrtc.so*")), reverse=True)
            found += sorted(glob.glob(os.path.join(r, "targets", "*", "lib", "libnvrtc.so*")), reverse=True)
    return [f for f in found if "builtins" not in os.path.basename(f) and "alt" not in os.path.basename(f)]


def ensure() -> Optional[str]:
    """Make NVRTC findable by the extension; returns the library linked, if one had to be."""
    if os.path.exists(os.path.join(LINK_DIR, "libnvrtc.so")):
        return os.path.realpath(os.path.join(LINK_DIR, "libnvrtc.so"))
    if _loadable("libnvrtc.so") or _loadable("libnvrtc.so.12"):
        return None
    for lib in _candidates():
        if not os.path.exists(lib):
            continue
        try:
            os.makedirs(LINK_DIR, exist_ok=True)
            tmp = os.path.join(LINK_DIR, f".libnvrtc.so.{os.getpid()}")
            os.symlink(os.path.realpath(lib), tmp)
            os.replace(tmp, os.path.join(LINK_DIR, "libnvrtc.so"))
            # NVRTC opens its builtins library by name from its own folder
            for b in glob.glob(os.path.join(os.path.dirname(os.path.realpath(lib)), "libnvrtc-builtins.so*")):
                dst = os.path.join(LINK_DIR, os.path.basename(b))
                if not os.path.exists(dst):
                    os.symlink(b, dst)
        except OSError:
            return None  # read-only install: the extension reports NVRTC missing, with the fix
        return lib
    return None
