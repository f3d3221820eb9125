#!/usr/bin/env bash
# One command from a fresh clone to a trained, evaluated model on data the
# project generates itself (synthetic Criteo schema with a planted signal).
#   scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh cpu,test
. "${DLRMCTL_VENV:-.venv}/bin/activate"
ROWS="${ROWS:-600000}"
dlrmctl preprocess synthetic --out data/demo --rows "$ROWS" --seed 0
dlrmctl train configs/demo.yaml --overwrite
dlrmctl evaluate runs/demo --split val
python - <<'PY'
import json
meta = json.load(open("data/demo/meta.json"))
best = json.load(open("runs/demo/summary.json"))["best"]
print(f"validation AUC {best['auc']:.4f}  (Bayes-optimal AUC of this data: {meta['bayes_auc']:.4f}, "
      f"gap {meta['bayes_auc'] - best['auc']:.4f})")
PY
