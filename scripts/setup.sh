#!/usr/bin/env bash
# Set up clipbias on a fresh Debian machine: Fashion-MNIST from Debian, a virtualenv .venv with torch 2.13.0, and
# clipbias itself with every extra the test suite uses: all optional features (pyproject.toml), the docs build
# and the test tools.
#
# Which torch build (README, "Install"):
# * an installed torch 2.13.0 in .venv is kept;
# * no NVIDIA GPU (nvidia-smi lists none): the CPU build, torch==2.13.0 from PyTorch's CPU index
#   (--index-url https://download.pytorch.org/whl/cpu, which also serves torch's own dependencies; pip's other
#   configured sources, find-links and extra-index-url, stay in use). Where that index cannot be reached (a
#   machine that reaches PyPI only through a mirror, as the CI machines do) or the install from it fails:
#   torch==2.13.0 with pip's own settings, which install the CPU build where they offer it (the CI machines' local
#   wheel folder holds torch-2.13.0+cpu) and, with PyPI's defaults on Linux x86-64, the CUDA build (gigabytes);
# * an NVIDIA GPU: torch==2.13.0 with pip's own settings (PyPI's CUDA build on Linux x86-64);
# * TORCH_INDEX_URL=URL installs from that index instead (e.g. one of PyTorch's CUDA indexes,
#   https://download.pytorch.org/whl/cuXYZ), and TORCH_INDEX_URL= (empty) with pip's own settings, GPU or not.
# The line it prints at the end names the torch it installed and whether it is the CPU or a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "installing Debian package dataset-fashion-mnist ..."
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq dataset-fashion-mnist
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/pip install -q --disable-pip-version-check)

installed=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$installed" = "$TORCH_VERSION" ]; then
  echo "torch $TORCH_VERSION is installed in .venv: kept"
elif [ -n "${TORCH_INDEX_URL+set}" ]; then
  if [ -n "$TORCH_INDEX_URL" ]; then
    echo "installing torch==$TORCH_VERSION from $TORCH_INDEX_URL (TORCH_INDEX_URL) ..."
    "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
  else
    echo "installing torch==$TORCH_VERSION with pip's own settings (TORCH_INDEX_URL is empty) ..."
    "${PIP[@]}" "torch==$TORCH_VERSION"
  fi
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "an NVIDIA GPU is present: installing torch==$TORCH_VERSION with pip's own settings (PyPI's CUDA build on" \
       "Linux x86-64) ..."
  "${PIP[@]}" "torch==$TORCH_VERSION"
elif .venv/bin/python -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=20)" \
     >/dev/null 2>&1; then
  echo "no NVIDIA GPU: installing the CPU build, torch==$TORCH_VERSION from $CPU_INDEX ..."
  "${PIP[@]}" --index-url "$CPU_INDEX" "torch==$TORCH_VERSION" || {
    echo "could not install from $CPU_INDEX: installing torch==$TORCH_VERSION with pip's own settings" >&2
    "${PIP[@]}" "torch==$TORCH_VERSION"; }
else
  echo "no NVIDIA GPU, and $CPU_INDEX cannot be reached from here: installing torch==$TORCH_VERSION with pip's" \
       "own settings (the CPU build where they offer it; with PyPI's defaults on Linux x86-64, the CUDA build)" ...
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi

"${PIP[@]}" -e '.[all,docs,test]'
echo "torch installed: $(.venv/bin/python -c 'import torch
print(torch.__version__, "(CPU build)" if torch.version.cuda is None else f"(CUDA {torch.version.cuda} build)")')"
echo "clipbias installed: $(.venv/bin/clipbias --help | head -1)"
