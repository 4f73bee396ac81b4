#!/usr/bin/env bash
# vLLM 0.33.0 for the CPU tests of the vLLM integration (tests/test_vllm_integration.py).
#
# vLLM's wheel pins a CUDA torch and ~80 GPU/serving packages; the tests need only its Python
# modules. So: vLLM and xgrammar (whose metadata asks for torch) without their dependencies, then
# the few packages vLLM's imports of the config, CLI, distributed and fused-MoE modules need, with
# vLLM's own version bounds and torch pinned to the installed one (pip never replaces torch).
# Idempotent: a machine where vLLM 0.33.0 already imports is left as it is.
set -euo pipefail

PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.33.0

# The modules tests/test_vllm_integration.py imports, on vLLM's CPU platform.
check_imports() {
  VLLM_TARGET_DEVICE=cpu "$PYTHON" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
import vllm
assert vllm.__version__ == sys.argv[1], vllm.__version__
import vllm.config, vllm.engine.arg_utils, vllm.plugins, vllm.utils.argparse_utils
import vllm.distributed.device_communicators.cpu_communicator
import vllm.distributed.device_communicators.cuda_communicator
import vllm.model_executor.layers.fused_moe.all2all_utils
import vllm.model_executor.layers.fused_moe.modular_kernel
import vllm.model_executor.layers.fused_moe.oracle.unquantized
EOF
}

if check_imports; then
  echo "install_vllm.sh: vLLM $VLLM_VERSION already importable"
  exit 0
fi

torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
log=$(mktemp)
trap 'rm -f "$constraints" "$log"' EXIT
echo "torch==$torch_version" >"$constraints"

# pip's resolver lists every vLLM requirement left out on purpose; show its output only on failure.
pip_install() {
  if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --constraint "$constraints" "$@" >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
  fi
}

pip_install --no-deps "vllm==$VLLM_VERSION" "xgrammar==0.2.8"
pip_install \
  "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" "openai>=2.25.0" "oss-harmony>=0.0.11" \
  "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" "pydantic>=2.12.0" "pillow>=13.0.0" \
  "apache-tvm-ffi==0.1.11" "llguidance>=1.7.0,<1.8.0" "prometheus_client>=0.18.0" \
  "requests>=2.33.0" cloudpickle py-cpuinfo psutil pyzmq cbor2 blake3 pybase64 cachetools msgspec uvloop partial-json-parser einops

if ! check_imports; then
  echo "install_vllm.sh: vLLM $VLLM_VERSION installed but its modules do not import:" >&2
  VLLM_TARGET_DEVICE=cpu "$PYTHON" -c 'import vllm.model_executor.layers.fused_moe.oracle.unquantized, vllm.engine.arg_utils' >&2
  exit 1
fi
installed_torch=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$installed_torch" != "$torch_version" ]; then
  echo "install_vllm.sh: torch changed from $torch_version to $installed_torch" >&2
  exit 1
fi
echo "install_vllm.sh: vLLM $VLLM_VERSION installed (torch $installed_torch kept)"
