#!/usr/bin/env bash
# Set up clipbias on a fresh Debian machine: Fashion-MNIST from Debian, a virtualenv with torch 2.13.0, and
# clipbias itself with every extra the test suite uses: all optional features (pyproject.toml), the docs build
# and the test tools. The torch line pins a version, not a build: it installs the CPU build where pip's
# configuration offers it (a local wheel folder with torch-2.13.0+cpu, as on the CI machines) and PyPI's CUDA
# build with default pip settings on Linux x86-64; README ("Install") gives the CPU index route.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "installing Debian package dataset-fashion-mnist ..."
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq dataset-fashion-mnist
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[all,docs,test]'
echo "clipbias installed: $(.venv/bin/clipbias --help | head -1)"
