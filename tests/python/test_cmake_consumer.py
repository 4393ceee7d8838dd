"""A native C++ program builds, links and runs against the installed pagedllm CMake package
(tests/cpp/consumer): find_package(pagedllm), pagedllm::core; it allocates, forks, triggers
copy-on-write, frees and asserts the pool is whole again.

Where the package comes from, in order:
  1. `python -m pagedllm --cmake-dir` (an installed package: scripts/test.sh pip-installs it);
  2. else the dev build folder named by PAGEDLLM_DEV_BUILD_DIR (e.g. build/dev), installed with
     `cmake --install` into a temporary prefix.
With neither, the test FAILS: the package must be usable, not assumed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = ROOT / "tests" / "cpp" / "consumer"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def _cmake_dir(tmp_path: Path, cmake: str) -> Path:
    proc = _run([sys.executable, "-m", "pagedllm", "--cmake-dir"])
    if proc.returncode == 0 and proc.stdout.strip():
        return Path(proc.stdout.strip())
    dev = os.environ.get("PAGEDLLM_DEV_BUILD_DIR")
    assert dev, (
        "no installed pagedllm CMake package (`python -m pagedllm --cmake-dir` said: "
        f"{proc.stderr.strip()!r}) and PAGEDLLM_DEV_BUILD_DIR is not set to a build folder to install"
    )
    prefix = tmp_path / "prefix"
    inst = _run([cmake, "--install", dev, "--prefix", str(prefix)])
    assert inst.returncode == 0, f"cmake --install {dev} failed:\n{inst.stdout}\n{inst.stderr}"
    return prefix / "lib" / "cmake" / "pagedllm"


def test_native_consumer_links_and_keeps_the_pool_whole(tmp_path):
    cmake = shutil.which("cmake")
    assert cmake, "cmake not found on PATH"
    config_dir = _cmake_dir(tmp_path, cmake)
    assert (config_dir / "pagedllmConfig.cmake").is_file(), f"no pagedllmConfig.cmake in {config_dir}"
    build = tmp_path / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    conf = _run([cmake, "-S", str(CONSUMER), "-B", str(build), *gen, f"-Dpagedllm_DIR={config_dir}",
                 "-DCMAKE_BUILD_TYPE=Release"])
    assert conf.returncode == 0, f"configure failed:\n{conf.stdout}\n{conf.stderr}"
    bld = _run([cmake, "--build", str(build), "-j2"])
    assert bld.returncode == 0, f"build failed:\n{bld.stdout}\n{bld.stderr}"
    run = _run([str(build / "kv_consumer")])
    assert run.returncode == 0, f"kv_consumer failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    assert "pool whole again (16/16 blocks free" in run.stdout
