"""Build of zkernels' native modules through the root CMakeLists.txt (triton's setup.py idea).

Metadata lives in pyproject.toml; this file only adds the CMake-driven build_ext.

Environment:
    ZKERNELS_SKIP_EXT=1   install the pure-Python package only (the reference backend runs).
    ZKERNELS_CUDA=1|0     build (or not) zkernels._C_nccl; unset: built when nvcc and NCCL
                          (nccl.h + libnccl.so.2, e.g. from the nvidia-nccl-cu13 wheel) are
                          found.
    ZKERNELS_NCCL_ROOT    folder with include/nccl.h and lib/libnccl.so.2 (else searched).
    ZKERNELS_BUILD_JOBS   parallel compile jobs (default: CPU count).

A requested extension that fails to build fails the install, loudly: a silently missing
extension would make every CPU optimizer step run the slow reference without anyone noticing.
``ZKERNELS_SKIP_EXT=1`` is the explicit way to install without it.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _flag(name):
    """True/False for an explicit 1/0 (on/off, true/false), None when unset."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise SystemExit(f"{name} must be 1 or 0, got {raw!r}")


def _nccl_root():
    """Folder holding include/nccl.h and lib/libnccl.so.2, or None."""
    candidates = [os.environ.get("ZKERNELS_NCCL_ROOT", "")]
    try:
        import nvidia.nccl  # namespace package of the nvidia-nccl-cu* wheels: no __file__
        candidates += list(nvidia.nccl.__path__)
    except ImportError:
        pass
    candidates += [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", "/usr"]
    for root in filter(None, candidates):
        root = Path(root)
        lib_dirs = [root / "lib", root / "lib64", root / "lib" / "x86_64-linux-gnu"]
        if (root / "include" / "nccl.h").is_file() and \
                any((d / "libnccl.so.2").exists() for d in lib_dirs):
            return str(root)
    return None


def _want_cuda():
    forced = _flag("ZKERNELS_CUDA")
    if forced is False:
        return False, None
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    nccl = _nccl_root()
    if forced and not (nvcc and nccl):
        raise SystemExit("ZKERNELS_CUDA=1 but " + ("nvcc" if not nvcc else "NCCL (nccl.h + "
                         "libnccl.so.2; pip install nvidia-nccl-cu13 or set ZKERNELS_NCCL_ROOT)")
                         + " was not found")
    return bool(nvcc and nccl), nccl


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures the root CMakeLists.txt once and builds every requested module with ninja,
    straight into the folder setuptools expects (which `--inplace`/editable installs map to
    zkernels/ in the source tree)."""

    def build_extensions(self):
        import pybind11

        cuda = any(ext.name.endswith("_C_nccl") for ext in self.extensions)
        out_dir = Path(self.get_ext_fullpath(self.extensions[0].name)).parent.resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DZKERNELS_CUDA={'ON' if cuda else 'OFF'}",
            "-DZKERNELS_BUILD_TESTS=OFF",
        ]
        if cuda:
            args.append(f"-DZKERNELS_NCCL_ROOT={self._nccl_root}")
        jobs = os.environ.get("ZKERNELS_BUILD_JOBS") or str(os.cpu_count() or 1)
        targets = [ext.name.rsplit(".", 1)[-1] for ext in self.extensions]
        try:
            subprocess.run(args, check=True)
            subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs, "--target",
                            *targets], check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            hint = ("ZKERNELS_CUDA=0 skips the NCCL engine; " if cuda else "") + \
                "ZKERNELS_SKIP_EXT=1 installs without the native extension (the CPU optimizer " \
                "step then runs the much slower PyTorch reference)"
            raise RuntimeError(f"building zkernels' native extension failed ({exc}); {hint}") \
                from exc


def _extensions():
    if _flag("ZKERNELS_SKIP_EXT"):
        return [], None
    cuda, nccl = _want_cuda()
    exts = [CMakeExtension("zkernels._C")]
    if cuda:
        exts.append(CMakeExtension("zkernels._C_nccl"))
    return exts, nccl


_EXTS, _NCCL = _extensions()
CMakeBuild._nccl_root = _NCCL

setup(ext_modules=_EXTS, cmdclass={"build_ext": CMakeBuild})
