#!/usr/bin/env bash
# Install NVSHMEM (the nvidia-nvshmem-cu13 wheel: headers, libnvshmem_device.a, libnvshmem_host.so.3)
# so that `pip install -e .` compiles and links ep_plugin._C_nvshmem, the native low-latency kernels.
# CI has nvcc but no GPU: the module is built and imported there, its GPU tests run on GPU machines.
# --no-deps: only the NVSHMEM files, never another torch. Idempotent and quiet; safe to run again.
set -euo pipefail

PYTHON=${PYTHON:-python3}
NVSHMEM_WHEEL=${NVSHMEM_WHEEL:-nvidia-nvshmem-cu13}

if ! "$PYTHON" - <<'PY' 2>/dev/null
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("nvidia.nvshmem")
roots = [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
sys.exit(0 if any((r / "include" / "nvshmem.h").exists() and (r / "lib" / "libnvshmem_device.a").exists()
                  for r in roots) else 1)
PY
then
  "$PYTHON" -m pip install -qq --disable-pip-version-check --no-deps "$NVSHMEM_WHEEL"
fi
"$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
for name in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
    try:
        print(f"NVSHMEM: {name} {version(name)} installed (for ep_plugin._C_nvshmem)")
    except PackageNotFoundError:
        pass
PY
