"""Runs the C++ tests (CTest) from pytest: configures the root CMakeLists.txt into
build/native-ctest-<generator> (gitignored, kept between runs so a rerun only rebuilds what changed) with
only the CPU libraries and their tests, builds, and runs ctest. Each C++ test (cpu_adam, cpu_ops,
cpu_quant, optim, cpu_adam_lowbit) forces every SIMD path the CPU supports in turn,
bit-exact against the scalar path or an independent reference written in the test."""
import os
import shutil
import subprocess

import pytest

from .conftest import ROOT, skip_ext_requested


def _run(cmd, cwd, timeout):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow  # a CMake build of the C++ tests; the bindings are tested in the quick suite
def test_ctest_cpu_libraries():
    if skip_ext_requested():
        pytest.skip("ZKERNELS_SKIP_EXT=1: installed without the native extension")
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed to build the C++ tests (pip install cmake)"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # one folder per generator: CMake refuses to switch generators in a configured folder
    build = ROOT / "build" / ("native-ctest-ninja" if generator else "native-ctest-make")
    _run([cmake, "-S", str(ROOT), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
          "-DZKERNELS_BUILD_PYTHON=OFF", "-DZKERNELS_CUDA=OFF", "-DZKERNELS_BUILD_TESTS=ON"],
         ROOT, 300)
    _run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 1)], ROOT, 600)
    ctest = os.path.join(os.path.dirname(cmake), "ctest")
    tests = ("cpu_adam", "cpu_ops", "cpu_quant", "optim", "cpu_adam_lowbit")
    for name in tests:  # one ctest run per library: each output read on its own
        out = _run([ctest if os.path.exists(ctest) else "ctest", "--test-dir", str(build),
                    "--output-on-failure", "-V", "-R", f"^{name}$"], ROOT, 300)
        assert "1 tests passed" in out or "100% tests passed" in out, out
        if name == "cpu_adam":
            assert "conversions ok" in out and "errors ok" in out, out
        for isa in ("scalar", "avx2", "avx512"):
            assert f"PATH {isa} ok" in out or f"PATH {isa} unsupported" in out, out
        best = out.split("best path: ")[1].split()[0]
        assert f"PATH {best} ok" in out, out  # the path production runs was among those tested
