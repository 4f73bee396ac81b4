#!/usr/bin/env bash
# Install megatron-core for the Megatron integration's CPU tests (tests/test_megatron_integration.py).
#
# megatron-core 0.19.2, the newest supported release. From 0.17 on its wheels declare
# Requires-Python >= 3.12, but the cp311 wheel is built for 3.11 and imports there:
# --ignore-requires-python. --no-deps keeps pip away from torch (torch==2.13.0+cpu stays as it
# is); what the imports need is installed by name: numpy and packaging (declared), triton
# (imported unconditionally by megatron.core's MoE and SSM kernels; importing it needs no GPU).
# Idempotent and quiet; safe to run again.
set -euo pipefail

PYTHON=${PYTHON:-python3}
MCORE_VERSION=${MCORE_VERSION:-0.19.2}
pip_install() { "$PYTHON" -m pip install -qq --disable-pip-version-check "$@"; }  # -qq: errors only

installed=$("$PYTHON" - <<'PY' 2>/dev/null || true
from importlib.metadata import version
print(version("megatron-core"))
PY
)
if [ "$installed" != "$MCORE_VERSION" ]; then
  pip_install --no-deps --ignore-requires-python "megatron-core==$MCORE_VERSION"
fi
# Only what is missing or too old, without dependencies: never an upgrade that could pull another torch.
missing=$("$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

def major_minor(text):
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())

needed = {"numpy": None, "packaging": "24.2", "triton": None, "typing_extensions": None}
print(" ".join(f"{name}>={minimum}" if minimum else name for name, minimum in needed.items()
               if installed(name) is None or (minimum and major_minor(installed(name)) < major_minor(minimum))))
PY
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086 - one word per requirement
  pip_install --no-deps $missing
fi

# The import chain the tests use must work (a CPU-only process, as tests/megatron_env.py prepares it).
"$PYTHON" -W ignore - <<'PY'
import sys, typing
import torch
if not torch.cuda.is_available():
    sys.modules.setdefault("flashinfer", None)   # CUDA-only; see tests/megatron_env.py
if not hasattr(typing, "override"):
    import typing_extensions
    typing.override = typing_extensions.override
import megatron.core
from megatron.core.transformer.moe import moe_layer, token_dispatcher  # noqa: F401
from megatron.training import arguments  # noqa: F401
from importlib.metadata import version
print(f"megatron-core {version('megatron-core')} imports (torch {torch.__version__})")
PY
