"""Build ep_plugin: the Python package, plus the `ep_plugin._C` extension when a CUDA toolkit is found.

The extension's core is framework-free CUDA (csrc/kernels, csrc/runtime.cu) compiled by nvcc; the
pybind11 binding (csrc/python_api.cpp) is compiled by the host compiler; everything links against
the static CUDA runtime, so the module does not depend on a particular PyTorch build.

Environment:
    CUDA_HOME / CUDA_PATH      CUDA toolkit (else the directory of `nvcc` on PATH, else /usr/local/cuda)
    EP_PLUGIN_CUDA_ARCHS       architectures, e.g. "90" or "80;90a" (default: from TORCH_CUDA_ARCH_LIST, else "90")
    CUDAHOSTCXX                host compiler for nvcc
    EP_PLUGIN_SKIP_CUDA=1      install the pure-Python package only
    MAX_JOBS                   parallel nvcc processes
"""
from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def find_cuda_home() -> Path | None:
    """The first toolkit with both nvcc and cuda_runtime.h: CUDA_HOME, CUDA_PATH, nvcc's, /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").exists() \
                and (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return Path(candidate)
    return None


def cuda_archs() -> list[str]:
    """Architectures as nvcc numbers ('90', '90a'), from EP_PLUGIN_CUDA_ARCHS or TORCH_CUDA_ARCH_LIST."""
    explicit = os.environ.get("EP_PLUGIN_CUDA_ARCHS")
    if explicit:
        return [a.strip() for a in explicit.replace(",", ";").split(";") if a.strip()]
    torch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if torch_list:
        archs = []
        for item in torch_list.replace(",", ";").replace(" ", ";").split(";"):
            item = item.strip().replace("+PTX", "")
            if item:
                archs.append(item.replace(".", ""))
        if archs:
            return archs
    return ["90"]


def gencode_flags(archs: list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


class CudaExtension(Extension):
    """An extension whose .cu sources go through nvcc."""


class NvccBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CudaExtension):
            return super().build_extension(ext)
        cuda_home = find_cuda_home()
        nvcc = str(cuda_home / "bin" / "nvcc")
        build_temp = Path(self.build_temp) / "ep_plugin_C"
        build_temp.mkdir(parents=True, exist_ok=True)
        include_dirs = [str(CSRC), str(cuda_home / "include"), str(cuda_home / "include" / "cccl")]
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        cpp_sources = [s for s in ext.sources if not s.endswith(".cu")]

        nvcc_flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr",
                      *gencode_flags(cuda_archs()), *[f"-I{d}" for d in include_dirs]]
        if os.environ.get("CUDAHOSTCXX"):
            nvcc_flags += ["-ccbin", os.environ["CUDAHOSTCXX"]]

        def compile_cu(source: str) -> str:
            obj = build_temp / (Path(source).stem + ".o")
            cmd = [nvcc, *nvcc_flags, "-c", source, "-o", str(obj)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return str(obj)

        jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_cu, cu_sources))

        import pybind11

        objects += self.compiler.compile(
            cpp_sources, output_dir=str(build_temp),
            include_dirs=[pybind11.get_include(), *include_dirs],
            extra_postargs=["-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden"])
        self.compiler.link_shared_object(
            objects, self.get_ext_fullpath(ext.name),
            library_dirs=[str(cuda_home / "lib64"), str(cuda_home / "lib64" / "stubs")],
            libraries=["cudart_static", "rt", "pthread", "dl"],
            target_lang="c++")


def integration_packages() -> list[str]:
    """Sub-packages of integrations/ (megatron, vllm, ...), shipped as ep_plugin.integrations.<name>."""
    return sorted(p.parent.relative_to(ROOT / "integrations").as_posix().replace("/", ".")
                  for p in (ROOT / "integrations").glob("*/**/__init__.py"))


def extensions() -> list[Extension]:
    if os.environ.get("EP_PLUGIN_SKIP_CUDA") == "1":
        print("ep_plugin: EP_PLUGIN_SKIP_CUDA=1, installing the pure-Python package only")
        return []
    if find_cuda_home() is None:
        print("ep_plugin: no CUDA toolkit found (nvcc), installing the pure-Python package only: "
              "the reference backend works, the native kernels are not built")
        return []
    sources = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "kernels").glob("*.cu"))
    sources += ["csrc/runtime.cu", "csrc/python_api.cpp"]
    return [CudaExtension("ep_plugin._C", sources=sources)]


setup(
    name="ep_plugin",
    version="0.1.0",
    description="Expert-parallel dispatch/combine for Mixture-of-Experts: DeepEP-compatible Buffer, native "
                "NVLink kernels, Megatron-Core and vLLM integrations",
    python_requires=">=3.10",
    # integrations/ and configs/ ship inside the package: ep_plugin.integrations.*, ep_plugin.configs.
    packages=["ep_plugin", "ep_plugin.backends", "ep_plugin.configs", "ep_plugin.integrations",
              *[f"ep_plugin.integrations.{name}" for name in integration_packages()]],
    package_dir={"ep_plugin": "ep_plugin", "ep_plugin.integrations": "integrations", "ep_plugin.configs": "configs"},
    package_data={"ep_plugin.configs": ["*.yaml"]},
    install_requires=["torch>=2.4", "pyyaml>=6", "numpy"],
    extras_require={"test": ["pytest>=7"], "plot": ["matplotlib"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": NvccBuildExt},
    entry_points={"console_scripts": ["ep-plugin = ep_plugin.cli:main"],
                  # vLLM loads general plugins in every process before it parses its CLI.
                  "vllm.general_plugins": ["ep_plugin = ep_plugin.integrations.vllm:register"]},
    zip_safe=False,
)
