#!/bin/bash
# Every check that needs a GPU, in one device session, in order of value, under a deadline:
#
#   bash benchmarks/gpu_session.sh [DEADLINE_S]     # default 380; output in $OUT (or /tmp/gpu_out)
#
# Steps: benchmarks/gpu_check.py (pinned slots + side-stream copies, a 1-rank NCCL job,
# ring/ps on device buffers), the real-CUDA loader test, the README demo at 1 rank (NCCL)
# and at 2 ranks on one GPU (Gloo), examples/gpt_parallel.py with FSDP2 sharding on the
# GPU, the JPEG decoders with nvJPEG, DecodeCrop on the GPU (benchmarks/gpu_decode.py:
# nvJPEG batch decode + crop + resize on the loader's side stream vs CPU workers), and, when HOROVOD_TESTS names a checkout of
# horovod/horovod (its test/parallel/test_torch.py and test/utils/common.py), that suite
# at 1 rank with `horovod.torch` resolving to ringtrain.horovod. Wheels for packages the machine
# lacks (simplejpeg) go in $WHEELS (default .gpu/whl). On a borrowed machine, put the
# wheels and the Horovod files in an ignored folder that travels with the tree, e.g.
#   HOROVOD_TESTS=.gpu/horovod bash benchmarks/gpu_session.sh 380
# Nothing here runs in CI.
START=$(date +%s); DEADLINE=${1:-380}
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
SITE=$(mktemp -d)
WHEELS=${WHEELS:-.gpu/whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    || echo "wheels in $WHEELS not installed"
fi
export PYTHONPATH=$PWD/src:$SITE
# Launchers and `python` as small scripts in a fresh folder (never write through a
# link an earlier run left: it may point at the interpreter itself).
BIN=$(mktemp -d)
printf '#!/bin/sh\nexec python3 -m ringtrain.launch.cli "$@"\n' > "$BIN/ringrun"
printf '#!/bin/sh\nexec python3 -m ringtrain.launch.horovodrun "$@"\n' > "$BIN/horovodrun"
printf '#!/bin/sh\nexec python3 "$@"\n' > "$BIN/python"
chmod +x "$BIN"/*
export PATH=$BIN:$PATH

step() {  # step NAME LIMIT_S CMD...: its output in $OUT/NAME.txt; skipped near the deadline
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - ($(date +%s) - START)))
  if (( left < 20 )); then echo "=== $name: SKIPPED (deadline)"; return; fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s)"
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.txt"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
}

horovod_suite() {
  local shim; shim=$(mktemp -d)
  mkdir -p "$shim/horovod/torch" "$shim/horovod/runner/util"
  touch "$shim/horovod/__init__.py" "$shim/horovod/runner/__init__.py" "$shim/horovod/runner/util/__init__.py"
  cp "$HOROVOD_TESTS"/horovod/runner/util/threads.py "$shim/horovod/runner/util/"  # the suite's helper
  printf 'from unittest.mock import *\n' > "$shim/mock.py"  # the suite imports the old `mock`
  printf 'import sys\nimport ringtrain.horovod as _rt\nsys.modules[__name__] = _rt\n' \
    > "$shim/horovod/torch/__init__.py"
  cp "$HOROVOD_TESTS"/test/parallel/test_torch.py "$HOROVOD_TESTS"/test/utils/common.py "$shim/"
  cd "$shim" && PYTHONPATH=$shim:$PYTHONPATH horovodrun -np 1 python -m pytest -q \
    -p no:cacheprovider -o addopts= test_torch.py
}
export -f horovod_suite

{
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
step gpu_check 150 python3 benchmarks/gpu_check.py
step loader_device 90 python3 -m pytest -q -p no:cacheprovider tests/integration/test_loader_device.py
step demo_np1 90 ringrun -np 1 python examples/mnist_cnn.py --epochs 2 --checkpoint-dir /tmp/gpu_runs1
step gpt_shard_np1 90 ringrun -np 1 python examples/gpt_parallel.py --steps 30 --shard --log-every 10
step demo_np2_one_gpu 120 ringrun -np 2 --oversubscribe python examples/mnist_cnn.py --epochs 2 \
  --checkpoint-dir /tmp/gpu_runs2
step decoders 100 python3 benchmarks/loader_field.py --decoders
step gpu_decode 120 python3 benchmarks/gpu_decode.py --files 1024 --batches 15 --json "$OUT/gpu_decode.json"
if [[ -n ${HOROVOD_TESTS:-} ]]; then export HOROVOD_TESTS; step hvd_test_torch_np1 200 bash -c horovod_suite; fi
} 2>&1 | tee "$OUT/log"
