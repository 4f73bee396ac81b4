#!/usr/bin/env bash
# vLLM for the CPU tests of the vLLM integration (tests/test_vllm_integration.py): 0.33.0 installed,
# and 0.32.0, the previous supported release, in its own directory ($VLLM_PREVIOUS_DIR) that the tests
# put ahead of the installed one in a child process.
#
# vLLM's wheel pins a CUDA torch and ~80 GPU/serving packages; the tests need only its Python
# modules. So: vLLM and xgrammar (whose metadata asks for torch) without their dependencies, then
# the few packages vLLM's imports of the config, CLI, distributed and fused-MoE modules need, with
# vLLM's own version bounds and torch pinned to the installed one (pip never replaces torch), plus
# what `vllm serve --help` imports (uvicorn, watchfiles). vLLM 0.32.0 goes into its directory without
# dependencies: it shares 0.33.0's. Idempotent: what already imports is left as it is.
set -euo pipefail

PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.33.0
VLLM_PREVIOUS_VERSION=0.32.0
# tests/test_vllm_integration.py reads the same variable, with the same default.
VLLM_PREVIOUS_DIR=${EP_PLUGIN_VLLM_PREVIOUS_DIR:-$(cd ~ && pwd)/.cache/ep_plugin/vllm-0.32}

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
import vllm.entrypoints.cli.main, vllm.entrypoints.cli.serve, vllm.entrypoints.cli.launch
EOF
}

install_previous() {
  if [ -f "$VLLM_PREVIOUS_DIR/vllm-$VLLM_PREVIOUS_VERSION.dist-info/METADATA" ]; then
    echo "install_vllm.sh: vLLM $VLLM_PREVIOUS_VERSION already in $VLLM_PREVIOUS_DIR"
    return
  fi
  rm -rf "$VLLM_PREVIOUS_DIR"
  pip_install --no-deps --target "$VLLM_PREVIOUS_DIR" "vllm==$VLLM_PREVIOUS_VERSION"
  echo "install_vllm.sh: vLLM $VLLM_PREVIOUS_VERSION installed in $VLLM_PREVIOUS_DIR"
}

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

if check_imports; then
  echo "install_vllm.sh: vLLM $VLLM_VERSION already importable"
  install_previous
  exit 0
fi

pip_install --no-deps "vllm==$VLLM_VERSION" "xgrammar==0.2.8"
pip_install \
  "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" "openai>=2.25.0" "oss-harmony>=0.0.11" \
  "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" "pydantic>=2.12.0" "pillow>=13.0.0" \
  "apache-tvm-ffi==0.1.11" "llguidance>=1.7.0,<1.8.0" "prometheus_client>=0.18.0" \
  "requests>=2.33.0" cloudpickle py-cpuinfo psutil pyzmq cbor2 blake3 pybase64 cachetools msgspec uvloop partial-json-parser einops \
  uvicorn watchfiles

if ! check_imports; then
  echo "install_vllm.sh: vLLM $VLLM_VERSION installed but its modules do not import:" >&2
  VLLM_TARGET_DEVICE=cpu "$PYTHON" -c 'import vllm.model_executor.layers.fused_moe.oracle.unquantized, vllm.engine.arg_utils, vllm.entrypoints.cli.launch' >&2
  exit 1
fi
installed_torch=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$installed_torch" != "$torch_version" ]; then
  echo "install_vllm.sh: torch changed from $torch_version to $installed_torch" >&2
  exit 1
fi
echo "install_vllm.sh: vLLM $VLLM_VERSION installed (torch $installed_torch kept)"
install_previous
