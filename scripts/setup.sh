#!/usr/bin/env bash
# Create .venv and install everything the tests and the demo need.
# Idempotent: a stamp keyed on this script, the requirements files and pyproject.toml
# makes a second run take well under a second when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  STACK=cuda
else
  STACK=cpu
fi
REQ=requirements/$STACK.txt

key=$(cat scripts/setup.sh "$REQ" pyproject.toml | sha256sum | cut -c1-16)
STAMP="$VENV/.tightfit-setup-$STACK-$key"
if [ -f "$STAMP" ]; then
  exit 0
fi

echo "[setup] installing the $STACK stack into $VENV (a few minutes on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_() {
  # This machine's pip config names local wheel folders that may be absent; hide those warnings only.
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}
PIP=pip_
$PIP install -q --upgrade pip

# Pin torch across every later install so no package can swap it for another build.
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
if [ "$STACK" = cpu ]; then
  # 2.13.0 CPU: a plain `torch` pulls a multi-GB CUDA build; fbgemm-gpu-cpu 1.8.0 needs exactly 2.13.0.
  $PIP install -q torch==2.13.0
  echo "torch==2.13.0" >"$CONSTRAINT"
  DS_BUILD_OPS=0 $PIP install -q -c "$CONSTRAINT" -r "$REQ"
  # torchrec requires fbgemm-gpu (the CUDA build), which fails to load on a CPU torch
  # and shadows fbgemm-gpu-cpu: install it without its dependencies.
  $PIP install -q --no-deps torchrec==1.8.0
else
  $PIP install -q torch
  echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" >"$CONSTRAINT"
  DS_BUILD_OPS=0 $PIP install -q -c "$CONSTRAINT" -r "$REQ"
fi
$PIP install -q --no-deps -e . >/dev/null

# torchao: weight-only int8/int4 quantization in energon (quantization="int8"|"int4"). Optional: without it
# energon loads unquantized models as before and refuses quantization in one line naming this install.
# 0.18.0 is the release built for torch 2.13 (its CUDA extension libraries fail to load on a CPU torch, harmlessly).
$PIP install -q -c "$CONSTRAINT" torchao==0.18.0 || true
if ! "$VENV/bin/python" -c "import torchao" >/dev/null 2>&1; then
  echo "[setup] torchao did not install: energon's quantization (quantization='int8'/'int4') will be refused;" \
       "install it by hand (pip install torchao==0.18.0) to use it"
fi

# DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload: the peer of benchmarks/elixir_disk.py and of
# ElixirDeepSpeedStrategy(disk_dir=...)) JIT-builds on first use against libaio's headers. Optional: without
# them that peer is skipped and says why; nothing else needs them.
if [ ! -e /usr/include/libaio.h ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing libaio-dev (DeepSpeed's NVMe op)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev; } >/dev/null 2>&1; then
      echo "[setup] apt-get could not install libaio-dev: DeepSpeed's NVMe (ZeRO-Infinity) peer will be skipped;" \
           "install it by hand (apt-get install -y libaio-dev) to run it"
    fi
  else
    echo "[setup] libaio-dev is not installed and apt-get is unavailable here (or not root): DeepSpeed's NVMe" \
         "(ZeRO-Infinity) peer will be skipped; install libaio-dev (Debian/Ubuntu) or libaio-devel (Fedora) to run it"
  fi
fi

rm -f "$VENV"/.tightfit-setup-*
touch "$STAMP"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
