# Sourced by benchmarks/run_h200*.sh on the GPU machine, with W (a work folder) set: $OUT, unbuffered Python,
# NVLink multicast off (KINDS.md), FlashInfer and FA4 from .device-wheels/b when carried, this tree's
# packages, and two helpers: `quiet` (a log without progress noise) and `conf NAME FILTER` (a slice of the
# conformance suite in its own process, so FlashInfer's JIT modules compile side by side).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -f .device-wheels/b/install.sh ]; then source .device-wheels/b/install.sh > "$W/install.log" 2>&1; fi
bash scripts/device-setup.sh 2>&1 | tail -1
quiet() { grep -v -E "^INFO|Loading|Writing|Warning|warn|it/s\]" "$@"; }
conf() { timeout "${CONF_S:-300}" ${CONF_PREFIX:-} python3 -m pytest -q -p no:cacheprovider tests/test_attention_conformance.py \
  -k "$2" --junitxml="$W/conf_$1.xml" > "$W/conf_$1.log" 2>&1; echo "conf $1: $(tail -1 "$W/conf_$1.log")"; }
