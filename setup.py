"""The CMake half of `pip install .` (pyproject.toml holds the rest): builds libvramswap.so,
libvramswap_preload.so and cudasim's libcudart.so.13, libcuda.so.1 and libcufile.so.0, and
puts them in the package as vramswap/lib/ and vramswap/sim/, where vramswap._lib looks
first.

  VRAMSWAP_CMAKE_BUILD_DIR   a CMake build tree that already holds the libraries (lib/ and
                             sim/, as scripts/test leaves build/): they are copied, nothing
                             is built. Default: configure and build in setuptools' build_temp
                             (Release, no tests), with CMake from PATH and the CUDA toolkit
                             where the project's CMakeLists.txt finds it.

setuptools' own build tree is build/pip/, apart from the CMake tree build/ (whose lib/ holds
the libraries: a wheel made from it would carry them at the top of site-packages).
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# package subdirectory -> the files the CMake tree holds there (symlinks are followed: a
# wheel carries files only, under the names the loader and ctypes look for)
SHIPPED = {"lib": ["libvramswap.so", "libvramswap_preload.so"], "sim": ["libcudart.so.13", "libcuda.so.1", "libcufile.so.0"]}
TARGETS = ["vramswap", "vramswap_preload", "cudasim_cudart", "cudasim_driver", "cudasim_cufile"]


class BuildWithCMake(build_py):
    def run(self):
        super().run()
        given = os.environ.get("VRAMSWAP_CMAKE_BUILD_DIR")
        tree = Path(given).resolve() if given else self._cmake_build()
        for sub, names in SHIPPED.items():
            dest = Path(self.build_lib) / "vramswap" / sub
            dest.mkdir(parents=True, exist_ok=True)
            for name in names:
                src = tree / sub / name
                if not src.exists():
                    raise RuntimeError(f"{src} is missing: VRAMSWAP_CMAKE_BUILD_DIR={given!r} must be a built CMake tree "
                                       "of this project (scripts/test builds build/)" if given else
                                       f"{src} is missing after the CMake build")
                shutil.copyfile(src, dest / name)  # follows the symlinks
                os.chmod(dest / name, 0o755)

    def _cmake_build(self):
        tree = Path(self.get_finalized_command("build").build_temp).resolve() / "cmake"
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(tree), "-DCMAKE_BUILD_TYPE=Release",
                               "-DBUILD_TESTING=OFF"])
        subprocess.check_call(["cmake", "--build", str(tree), "-j", jobs, "--target", *TARGETS])
        return tree


class BinaryDistribution(Distribution):
    """The wheel carries native libraries: it is tagged for this platform, not `any`."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithCMake}, distclass=BinaryDistribution,
      options={"build": {"build_base": "build/pip"}})
