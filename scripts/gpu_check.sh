#!/usr/bin/env bash
# gpu_check.sh v2: the device checks of dlrmctl, built for a 15-minute GPU slot that may end in a kill.
#
#   bash scripts/gpu_check.sh [--out DIR]      # default DIR: $OUT, else ./gpu_check_out
#
# Runs the checkout from source (PYTHONPATH=<repo>; needs torch, pytest, pyarrow; NOT torchx or
# fbgemm_gpu: without fbgemm the tables run on the `dense` kernel and every figure says so).
# Every step writes, as soon as it finishes, DIR/logs/<step>.log and DIR/steps/<step>.json
# ({"step", "status": passed|failed|timeout|skipped, "seconds", "limit_s", + its figures});
# a step's record is written as "started" before it runs, so a kill leaves the finished steps'
# records and marks the one that was running.  DIR/gpu_check.json merges the records so far.
# PYTHONFAULTHANDLER=1 and `timeout -s ABRT`: a hung step dumps every Python thread's stack into
# its log; collectives time out after 120 s (DLRMCTL_COLLECTIVE_TIMEOUT_S).  A failed step skips
# the later steps (they would only repeat the failure).  Per-step limits add up to 8 minutes.
#
#   env        versions, CUDA device, fbgemm present (the later steps read the device from
#              its figures: no second torch import to ask)                         (30 s)
#   pytest     tests/modules/test_cuda.py -v, the CUDA variants only (ids with cuda); skipped without CUDA (150 s)
#   data       a small synthetic Criteo-schema data set                            (30 s)
#   demo       the plain user command `dlrmctl train configs/demo.yaml` (one device,
#              unsharded, 50 steps) in-process: samples/s labelled with its kernel
#              ("dense fallback" without fbgemm), torch.cuda.max_memory_allocated,
#              a step time measured with device synchronisation                    (90 s)
#   parity     `pipeline: none` vs `sparse_dist` on the sharded path (one-rank group,
#              nccl on CUDA / gloo on CPU), 30 steps, log_every 1, both runs in one
#              process: the per-step losses must be identical (a stream race shows here) (180 s)
#
# Its cost is mostly Python start-up (importing torch and torch._dynamo: about 2/3 of the CPU
# time on a 2-core CPU machine), so the steps share processes where the records allow: 3 torch
# imports in all (env, demo, parity; data imports no torch; before: 5).
#
# On a CPU-only machine the same steps run on CPU / gloo, the CUDA ones are skipped, exit 0.
set -uo pipefail

DIR="${OUT:-$(pwd)/gpu_check_out}"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) DIR="$2"; shift 2 ;;
        --out=*) DIR="${1#--out=}"; shift ;;
        *) echo "gpu_check: unknown argument $1 (usage: gpu_check.sh [--out DIR])" >&2; exit 2 ;;
    esac
done
case "$DIR" in /*) ;; *) DIR="$(pwd)/$DIR" ;; esac
cd "$(dirname "$0")/.." || exit 2
REPO="$(pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export DLRMCTL_COLLECTIVE_TIMEOUT_S=120 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
PY="${PYTHON:-$(command -v python || command -v python3)}"
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; fi
mkdir -p "$DIR/logs" "$DIR/steps" || exit 2
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
FAILED=""

record() {  # record STEP STATUS SECONDS LIMIT [FIGURES_JSON_FILE]: DIR/steps/STEP.json, then the merge
    "$PY" - "$DIR" "$@" <<'PYEOF'
import json, os, sys
d, step, status, secs, limit = sys.argv[1:6]
rec = {"step": step, "status": status, "seconds": float(secs), "limit_s": int(limit)}
if len(sys.argv) > 6 and os.path.exists(sys.argv[6]):
    try:
        rec.update(json.load(open(sys.argv[6])))
    except ValueError as e:
        rec["figures_error"] = str(e)
def atomic(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)
atomic(os.path.join(d, "steps", step + ".json"), rec)
steps = {}
for n in sorted(os.listdir(os.path.join(d, "steps"))):
    if n.endswith(".json"):
        steps[n[:-5]] = json.load(open(os.path.join(d, "steps", n)))
atomic(os.path.join(d, "gpu_check.json"), {"steps": steps})
PYEOF
}

run_step() {  # run_step NAME LIMIT_S CMD...: the command's figures go to $WORK/NAME.fig.json
    local name="$1" limit="$2"; shift 2
    if [ -n "$FAILED" ]; then
        echo "gpu_check: $name skipped (after $FAILED failed)" | tee "$DIR/logs/$name.log"
        record "$name" skipped 0 "$limit"; return
    fi
    record "$name" started 0 "$limit"
    echo "gpu_check: $name (limit ${limit}s) ..."
    local t0=$SECONDS rc
    FIG="$WORK/$name.fig.json" timeout -s ABRT -k 10 "$limit" "$@" >"$DIR/logs/$name.log" 2>&1; rc=$?
    local status=passed
    if [ $rc = 124 ] || [ $rc = 134 ] || [ $rc = 137 ]; then status=timeout; elif [ $rc = 77 ]; then status=skipped;
    elif [ $rc != 0 ]; then status=failed; fi
    record "$name" "$status" $((SECONDS - t0)) "$limit" "$WORK/$name.fig.json"
    echo "gpu_check: $name $status in $((SECONDS - t0))s (log: $DIR/logs/$name.log)"
    case "$status" in failed|timeout) FAILED="$name" ;; esac
}

run_step env 30 "$PY" -c "
import json, os, platform, torch
from dlrmctl import _fbgemm
cuda = torch.cuda.is_available()
fig = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
       'cuda_available': cuda, 'device_name': torch.cuda.get_device_name(0) if cuda else None,
       'fbgemm': _fbgemm.HAS_FBGEMM}
print(fig); json.dump(fig, open(os.environ['FIG'], 'w'))"
# the device, from the env step's figures (one torch import less than asking torch again)
CUDA=0
grep -q '"cuda_available": true' "$WORK/env.fig.json" 2>/dev/null && CUDA=1
DEV=cpu; [ "$CUDA" = 1 ] && DEV=cuda

if [ "$CUDA" = 1 ]; then
    run_step pytest 150 "$PY" -m pytest tests/modules/test_cuda.py -v -p no:cacheprovider -k "[cuda or -cuda- or -cuda]"
else
    echo "gpu_check: pytest skipped (no CUDA: the CPU variants run in CI)" | tee "$DIR/logs/pytest.log"
    record pytest skipped 0 150
fi

ROWS=20000; [ "$CUDA" = 1 ] && ROWS=200000
run_step data 30 "$PY" -c "
from dlrmctl.data.synthetic import generate_synthetic
generate_synthetic('$WORK/data', rows=$ROWS, seed=0)"

COMMON=(--set "data.path=$WORK/data" --set "train.run_dir=$WORK/runs" --set train.progress=false
        --set train.eval_every=0 --set train.checkpoint_every=0)
"$PY" - "$WORK/demo.py" <<'PYEOF'
import sys
open(sys.argv[1], "w").write('''"""`dlrmctl train configs/demo.yaml` in-process (unsharded, one device), then its figures."""
import json, os, sys, time
import torch
from dlrmctl import _fbgemm
from dlrmctl.cli import app
run_dir, args = sys.argv[1], sys.argv[2:]
cuda = torch.cuda.is_available()
t0 = time.perf_counter()
try:
    rc = app(args, standalone_mode=False)  # a one-line error returns its exit code here
finally:
    if cuda:
        torch.cuda.synchronize()
if rc:
    sys.exit(rc)
wall = time.perf_counter() - t0
recs = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
train = [r for r in recs if r["kind"] == "train"]
steps = json.load(open(os.path.join(run_dir, "summary.json")))["steps"]  # all steps, not the last logged one
kernel = "fused (FBGEMM TBE)" if _fbgemm.HAS_FBGEMM else "dense fallback (no fbgemm_gpu)"
fig = {"device": "cuda" if cuda else "cpu", "steps": steps, "last_loss": train[-1]["loss"] if train else None,
       "kernel": kernel, "samples_per_s": train[-1]["samples_per_s"] if train else None,
       "samples_per_s_label": "samples/s of the " + kernel,
       "step_s_synchronized": wall / max(steps, 1),
       "step_s_note": "whole run (build, data, steps) / steps, after torch.cuda.synchronize",
       "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None}
print(fig)
json.dump(fig, open(os.environ["FIG"], "w"))
''')
PYEOF
run_step demo 90 "$PY" "$WORK/demo.py" "$WORK/runs/gpu_demo" train configs/demo.yaml "${COMMON[@]}" \
    --set name=gpu_demo --set train.max_steps=50 --set train.log_every=10 --set "train.device=$DEV" --overwrite

cat > "$WORK/parity.py" <<'PYEOF'
"""Per-step losses of `pipeline: none` and `sparse_dist` (sharded path, one-rank group): identical.
Both runs in this one process (`dlrmctl train` in-process, its process group torn down after each):
one torch import, not two."""
import json, os, sys
from dlrmctl.cli import app
runs, args = sys.argv[1], sys.argv[2:]
losses = {}
for p in ("none", "sparse_dist"):
    rc = app(["train", "configs/demo.yaml", *args, "--set", f"name=parity_{p}", "--set", f"train.pipeline={p}",
              "--overwrite"], standalone_mode=False)
    if rc:  # a one-line error (already printed) returns its exit code here
        sys.exit(rc)
    with open(os.path.join(runs, f"parity_{p}", "metrics.jsonl")) as f:
        losses[p] = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
same = losses["none"] == losses["sparse_dist"] and len(losses["none"]) == 30
first = next((i + 1 for i, (a, b) in enumerate(zip(*losses.values())) if a != b), None)
from dlrmctl import _fbgemm
kernel = "fused (FBGEMM TBE)" if _fbgemm.HAS_FBGEMM else "dense fallback (no fbgemm_gpu)"
fig = {"steps": len(losses["none"]), "identical": same, "first_differing_step": first, "kernel": kernel,
       "losses": losses}
json.dump(fig, open(os.environ["FIG"], "w"))
print({k: v for k, v in fig.items() if k != "losses"})
sys.exit(0 if same else 1)
PYEOF
run_step parity 180 "$PY" "$WORK/parity.py" "$WORK/runs" "${COMMON[@]}" --set sharding.force=true \
    --set train.max_steps=30 --set train.log_every=1 --set "train.device=$DEV" --set data.batch_size=512

echo "gpu_check: records in $DIR/steps, logs in $DIR/logs, summary $DIR/gpu_check.json"
if [ -n "$FAILED" ]; then echo "gpu_check: FAILED at step $FAILED"; exit 1; fi
echo "gpu_check: all steps passed or skipped"
