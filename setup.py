"""Build of pyrl: the Python package, the Triton kernels (as pyrl.kernels), the Hydra configs (as
pyrl.configs package data) and the C++ core pyrl._C (C++17 + pybind11, no libtorch).

PYRL_BUILD_CUDA=1 also compiles csrc/cuda/*.cu with nvcc into pyrl._C (skipped, with a message,
when nvcc is missing)."""

import glob
import os
import shutil
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


class BuildExt(build_ext):
    """Adds nvcc-compiled objects to pyrl._C when PYRL_BUILD_CUDA=1."""

    def build_extensions(self):
        if os.environ.get("PYRL_BUILD_CUDA") == "1":
            nvcc = shutil.which("nvcc")
            if nvcc is None:
                print("pyrl: PYRL_BUILD_CUDA=1 but nvcc was not found; building the CPU core only", file=sys.stderr)
            else:
                self._add_cuda_objects(nvcc)
        super().build_extensions()

    def _add_cuda_objects(self, nvcc):
        ext = self.extensions[0]
        os.makedirs(self.build_temp, exist_ok=True)
        for src in sorted(glob.glob("csrc/cuda/*.cu")):
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-O3", "-std=c++17", "-Icsrc/include", "-Xcompiler", "-fPIC", "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            ext.extra_objects.append(obj)
        cuda_home = os.path.dirname(os.path.dirname(nvcc))
        ext.library_dirs += [os.path.join(cuda_home, "lib64")]
        ext.libraries += ["cudart"]
        ext.define_macros += [("PYRL_WITH_CUDA", "1")]


ext_modules = [
    Pybind11Extension(
        "pyrl._C",
        sorted(glob.glob("csrc/*.cpp")),
        include_dirs=["csrc/include"],
        cxx_std=17,
        extra_compile_args=CXX_FLAGS,
        extra_link_args=["-fopenmp"],
    )
]

setup(
    packages=find_packages(include=["pyrl", "pyrl.*"]) + ["pyrl.kernels", "pyrl.configs"],
    package_dir={"pyrl": "pyrl", "pyrl.kernels": "kernels", "pyrl.configs": "configs"},
    package_data={"pyrl.configs": ["*.yaml", "**/*.yaml"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
