"""Build of pyrl: the Python package, the Triton kernels (as pyrl.kernels), the Hydra configs (as
pyrl.configs package data) and the C++ core pyrl._C (C++17 + pybind11, no libtorch)."""

import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

# the C++ files compile in parallel, one per core (PYRL_BUILD_JOBS=N sets how many): `pip install --no-deps -e .`
# 39 s -> 34 s on 2 cores
ParallelCompile("PYRL_BUILD_JOBS", default=0).install()

CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]

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
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
