"""Build ep_plugin: the Python package, plus the `ep_plugin._C` extension when a CUDA toolkit is found.

The extension's core is framework-free CUDA (csrc/kernels, csrc/runtime.cu) compiled by nvcc; the
pybind11 binding (csrc/python_api.cpp) is compiled by the host compiler; everything links against
the static CUDA runtime, so the module does not depend on a particular PyTorch build. Beside it,
`ep_plugin._C_torch` (csrc/torch_outputs.cpp: the outputs, allocated by torch from C++) is built by
the installed torch's own BuildExtension, so it matches that torch: rebuild after upgrading torch.

Environment:
    CUDA_HOME / CUDA_PATH      CUDA toolkit (else the directory of `nvcc` on PATH, else /usr/local/cuda)
    EP_PLUGIN_CUDA_ARCHS       architectures, e.g. "90" or "80;90a" (default: from TORCH_CUDA_ARCH_LIST, else "90")
    CUDAHOSTCXX                host compiler for nvcc
    EP_PLUGIN_SKIP_CUDA=1      install the pure-Python package only
    MAX_JOBS                   parallel nvcc processes
    EP_PLUGIN_NVCC_FLAGS       extra nvcc flags, e.g. "-Xptxas -v"
    NVSHMEM_DIR                NVSHMEM (include/, lib/) for `ep_plugin._C_nvshmem`, the low-latency kernels
                               (default: the nvidia-nvshmem-cu13 or -cu12 wheel; without NVSHMEM that module
                               is skipped and everything else builds as before)
    EP_PLUGIN_SKIP_NVSHMEM=1   do not build `ep_plugin._C_nvshmem`
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"

# What this build did, for the summary at its end: extension name -> "built" or why it was skipped.
# NOTE: pip shows a build's output only with -v (or when it fails); `ep-plugin info` tells an
# installed package's state at any time.
BUILD_OUTCOMES: dict[str, str] = {}


def note(message: str) -> None:
    """One progress line on stderr (unbuffered, so it shows while nvcc runs)."""
    print(f"ep_plugin: {message}", file=sys.stderr, flush=True)


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


def _nvshmem_roots() -> list[Path]:
    """Candidate NVSHMEM installations: $NVSHMEM_DIR, then the nvidia-nvshmem-cu13/-cu12 wheels."""
    roots = [Path(os.environ["NVSHMEM_DIR"])] if os.environ.get("NVSHMEM_DIR") else []
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")  # both wheels install nvidia/nvshmem
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    return roots


def _host_library(lib_dir: Path) -> Path | None:
    """libnvshmem_host.so.N (the wheels ship only the versioned name), else libnvshmem_host.so."""
    versioned = [p for p in lib_dir.glob("libnvshmem_host.so.*") if re.fullmatch(r"libnvshmem_host\.so\.\d+", p.name)]
    if versioned:
        return max(versioned, key=lambda p: int(p.name.rsplit(".", 1)[1]))
    plain = lib_dir / "libnvshmem_host.so"
    return plain if plain.exists() else None


def find_nvshmem() -> tuple[Path, Path, Path] | None:
    """(include dir, lib dir, host library) of the first complete NVSHMEM, or None."""
    for root in _nvshmem_roots():
        include = root / "include"
        for lib_dir in (root / "lib", root / "lib64"):
            host = _host_library(lib_dir) if lib_dir.is_dir() else None
            if (include / "nvshmem.h").exists() and (lib_dir / "libnvshmem_device.a").exists() and host:
                return include, lib_dir, host
    return None


# Kernel files that use NVSHMEM's device API (ep_plugin._C_nvshmem only).
NVSHMEM_KERNEL_PREFIXES = ("low_latency_", "internode_")


class CudaExtension(Extension):
    """An extension whose .cu sources go through nvcc."""


class NvshmemExtension(CudaExtension):
    """A CUDA extension with NVSHMEM device code: relocatable device code, a device-link step against
    libnvshmem_device.a, and the host library linked by its full (versioned) path with an rpath."""

    def __init__(self, name: str, sources: list[str], nvshmem: tuple[Path, Path, Path]) -> None:
        super().__init__(name, sources=sources)
        self.nvshmem_include, self.nvshmem_lib, self.nvshmem_host = nvshmem


class TorchExtension(Extension):
    """A C++ extension against the installed torch (its headers, libraries, ABI and pybind11 flags)."""


class NvccBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if isinstance(ext, TorchExtension):
            return self.build_with_torch(ext)
        if not isinstance(ext, CudaExtension):
            return super().build_extension(ext)
        cuda_home = find_cuda_home()
        nvcc = str(cuda_home / "bin" / "nvcc")
        build_temp = Path(self.build_temp) / ext.name.replace("ep_plugin.", "ep_plugin")
        build_temp.mkdir(parents=True, exist_ok=True)
        include_dirs = [str(CSRC), str(cuda_home / "include"), str(cuda_home / "include" / "cccl")]
        with_nvshmem = isinstance(ext, NvshmemExtension)
        if with_nvshmem:
            include_dirs.append(str(ext.nvshmem_include))
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        cpp_sources = [s for s in ext.sources if not s.endswith(".cu")]

        nvcc_flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr",
                      *gencode_flags(cuda_archs()), *[f"-I{d}" for d in include_dirs]]
        if with_nvshmem:
            nvcc_flags.append("-rdc=true")  # NVSHMEM's device API lives in libnvshmem_device.a
        if os.environ.get("CUDAHOSTCXX"):
            nvcc_flags += ["-ccbin", os.environ["CUDAHOSTCXX"]]
        nvcc_flags += os.environ.get("EP_PLUGIN_NVCC_FLAGS", "").split()

        jobs = max(1, int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))
        note(f"building {ext.name}: {len(cu_sources)} CUDA files with nvcc ({jobs} at once, MAX_JOBS), "
             f"architectures {', '.join(cuda_archs())}")
        compiled = []
        started = time.monotonic()

        def compile_cu(source: str) -> str:
            obj = build_temp / (Path(source).stem + ".o")
            cmd = [nvcc, *nvcc_flags, "-c", source, "-o", str(obj)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            compiled.append(source)
            note(f"  [{len(compiled)}/{len(cu_sources)}] {Path(source).name} "
                 f"({time.monotonic() - started:.0f} s)")
            return str(obj)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            objects = list(pool.map(compile_cu, cu_sources))

        extra_link = []
        if with_nvshmem:
            # Device link: resolve the kernels' NVSHMEM device calls against libnvshmem_device.a.
            dlink = str(build_temp / "device_link.o")
            cmd = [nvcc, "-dlink", "-Xcompiler", "-fPIC", *gencode_flags(cuda_archs()), *objects,
                   f"-L{ext.nvshmem_lib}", "-lnvshmem_device", "-o", dlink]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            objects.append(dlink)
            # Host link: the device library's host part, then the host library by its versioned path
            # (the wheels ship no unversioned .so), found again at run time through the rpath.
            extra_link = [str(ext.nvshmem_lib / "libnvshmem_device.a"), str(ext.nvshmem_host),
                          f"-Wl,-rpath,{ext.nvshmem_lib}"]

        import pybind11

        objects += self.compiler.compile(
            cpp_sources, output_dir=str(build_temp),
            include_dirs=[pybind11.get_include(), *include_dirs],
            extra_postargs=["-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden"])
        self.compiler.link_shared_object(
            objects, self.get_ext_fullpath(ext.name),
            library_dirs=[str(cuda_home / "lib64"), str(cuda_home / "lib64" / "stubs")],
            libraries=["cudart_static", "rt", "pthread", "dl"],
            extra_postargs=extra_link,
            target_lang="c++")
        BUILD_OUTCOMES[ext.name] = "built"
        note(f"built {ext.name} in {time.monotonic() - started:.0f} s")

    def build_with_torch(self, ext: Extension) -> None:
        """Builds `ext` with torch's BuildExtension, into the same place as the others: it adds the flags
        that must match the installed torch (C++ standard, C++ ABI, pybind11's ABI ids)."""
        from torch.utils.cpp_extension import BuildExtension

        started = time.monotonic()
        torch_build = BuildExtension(self.distribution, use_ninja=False)
        for option in ("build_lib", "build_temp", "plat_name", "debug", "force"):
            setattr(torch_build, option, getattr(self, option))
        torch_build.inplace = 0  # this command copies every extension into the source tree where asked
        torch_build.finalize_options()
        torch_build.extensions = [ext]
        torch_build.run()
        BUILD_OUTCOMES[ext.name] = "built"
        note(f"built {ext.name} in {time.monotonic() - started:.0f} s")


def torch_extension() -> list[Extension]:
    """`ep_plugin._C_torch`, which the native backend allocates its outputs with."""
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError as error:  # the kernels alone would be no use: the native backend allocates through it
        raise SystemExit(f"ep_plugin: torch is not importable in this build ({error}), and the native backend "
                         "needs ep_plugin._C_torch, built against the installed torch. Install torch first, then "
                         "`pip install --no-build-isolation .` (or EP_PLUGIN_SKIP_CUDA=1 for the pure-Python "
                         "package)") from error
    # torch's include and library lists, on an extension of our class (build_extension tells it by that).
    made = CppExtension("ep_plugin._C_torch", sources=["csrc/torch_outputs.cpp"], extra_compile_args=["-O3"])
    return [TorchExtension(made.name, made.sources, include_dirs=[str(CSRC), *made.include_dirs],
                           library_dirs=made.library_dirs,
                           libraries=made.libraries, language=made.language,
                           extra_compile_args=made.extra_compile_args)]


def integration_packages() -> list[str]:
    """Sub-packages of integrations/ (megatron, vllm, ...), shipped as ep_plugin.integrations.<name>."""
    return sorted(p.parent.relative_to(ROOT / "integrations").as_posix().replace("/", ".")
                  for p in (ROOT / "integrations").glob("*/**/__init__.py"))


def extensions() -> list[Extension]:
    native = ["ep_plugin._C", "ep_plugin._C_nvshmem", "ep_plugin._C_torch"]
    if os.environ.get("EP_PLUGIN_SKIP_CUDA") == "1":
        return skipped(native, "EP_PLUGIN_SKIP_CUDA=1: the pure-Python package only")
    if find_cuda_home() is None:
        return skipped(native,
                       "no CUDA toolkit found (nvcc; set CUDA_HOME): the reference backend works, the native "
                       "kernels are not built")
    # Low-latency and internode kernels need NVSHMEM: they go into ep_plugin._C_nvshmem, never into ep_plugin._C.
    kernels = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "kernels").glob("*.cu"))
    sources = [s for s in kernels if not Path(s).name.startswith(NVSHMEM_KERNEL_PREFIXES)]
    sources += ["csrc/runtime.cu", "csrc/staged_combine.cu", "csrc/output_region.cpp", "csrc/python_api.cpp"]
    return [CudaExtension("ep_plugin._C", sources=sources), *nvshmem_extensions(kernels), *torch_extension()]


def skipped(names: list[str], why: str) -> list[Extension]:
    """Record and say that `names` are not built, and why; returns no extension."""
    for name in names:
        BUILD_OUTCOMES[name] = f"skipped: {why}"
    note(f"not building {', '.join(names)}: {why}")
    return []


def summary() -> str:
    """One line: what this build built and skipped (shown at its end)."""
    return "; ".join(f"{name} {outcome}" for name, outcome in BUILD_OUTCOMES.items())


def nvshmem_extensions(kernels: list[str]) -> list[Extension]:
    """`ep_plugin._C_nvshmem` (low-latency mode, internode normal mode) where NVSHMEM is found, else nothing."""
    if os.environ.get("EP_PLUGIN_SKIP_NVSHMEM") == "1":
        return skipped(["ep_plugin._C_nvshmem"], "EP_PLUGIN_SKIP_NVSHMEM=1 (native low-latency mode)")
    nvshmem = find_nvshmem()
    if nvshmem is None:
        return skipped(["ep_plugin._C_nvshmem"], "NVSHMEM not found (set NVSHMEM_DIR or pip install "
                       "nvidia-nvshmem-cu13): low-latency mode uses the reference backend")
    note(f"ep_plugin._C_nvshmem will be built against NVSHMEM at {nvshmem[1].parent} ({nvshmem[2].name})")
    sources = [s for s in kernels if Path(s).name.startswith(NVSHMEM_KERNEL_PREFIXES)]
    sources += ["csrc/nvshmem_runtime.cu", "csrc/python_api_nvshmem.cpp"]
    return [NvshmemExtension("ep_plugin._C_nvshmem", sources=sources, nvshmem=nvshmem)]


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
if BUILD_OUTCOMES:  # nothing to say where no build ran (metadata steps) and nothing was skipped
    note(f"summary: {summary()} (after installing, `ep-plugin info` says the same)")
