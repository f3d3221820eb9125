#!/usr/bin/env bash
# gpu_check.sh: the device checks of dlrmctl in one script, run from source.
#
#   bash scripts/gpu_check.sh            # from anywhere; needs torch (CUDA build on a GPU box)
#
# Runs from the repository checkout with PYTHONPATH=<repo> (no pip install).  fbgemm_gpu is
# optional: without it the package trains with the `dense` compute kernel (this is the
# expected set-up of the GPU box: CUDA torch, no fbgemm_gpu).  Steps, in order (each one
# bounded by `timeout`; the script goes on after a failure so that every figure is
# collected, and exits non-zero if any step failed):
#
#   env            python / torch / CUDA version, GPU name, fbgemm present, package versions
#   import         `python -c "import dlrmctl, dlrmctl.cli"` (records HAS_FBGEMM)
#   import_nofbgemm  import dlrmctl with fbgemm_gpu hidden (the way tests/commands/test_no_fbgemm.py
#                  hides it) and run an EBC asked for the `fused` kernel on the device: it
#                  must fall back to `dense`
#   pytest         `python -m pytest -m cuda -q` (tests/modules/test_cuda.py: dense-kernel EBC, DLRM
#                  steps device == CPU, sharded EBC on a one-rank nccl/gloo group for all six
#                  sharding types, fp16 export scoring); the cuda variants skip without CUDA
#   data           a synthetic Criteo-schema data set (dlrmctl.data.synthetic.generate_synthetic):
#                  300,000 rows on CUDA, 20,000 on CPU
#   train          `python -m dlrmctl.cli train configs/demo.yaml` through the sharded path on
#                  a one-rank process group (sharding.force=true; t_C1..t_C4 forced to row_wise,
#                  column_wise and table_column_wise (two column shards each, both on rank 0),
#                  table_row_wise; the planner places the rest: table_wise / data_parallel)
#                  with the sparse_dist pipeline on the device, max_steps 200 (CUDA) / 15 (CPU);
#                  samples/s and the data / input_dist wait shares come from
#                  runs/<name>/metrics.jsonl and the "epoch N: ..." line
#   train_amp      the same run for at most 100 steps with train.precision fp16 (CUDA; bf16 on
#                  CPU), model.embedding_precision fp16 and sharding.comm_precision bf16 (its
#                  status and seconds in the JSON, its summary.json in the logs)
#
# On a CPU-only machine the same steps run on CPU / gloo (the CUDA test variants skip) and the
# script exits 0 when they pass.  On a CUDA machine it also fails if no CUDA test variant passed.
#
# Time: about 3-4 minutes on one GPU (well under 8; hard bounds: pytest 360 s, train 300 s, train_amp 180 s),
# about 1-2 minutes on a 2-core CPU machine.
#
# Output: a JSON file of figures -- $GPU_CHECK_JSON, else $OUT/gpu_check.json when OUT is set
# (the GPU harness collects $OUT), else ./gpu_check.json in the directory the script was
# started from -- with: versions, cuda availability and device name, fbgemm present, per-step
# status and seconds, pytest passed/failed/skipped/errors counts (and the cuda variants'
# counts, skip reasons, failures), the training figures (samples/s, data_wait_share,
# comm_wait_share, steps, loss, val AUC) and the log directory.  Logs of every step go to a
# temporary work directory (printed) and, when OUT is set, to $OUT/gpu_check_logs/.  The last
# lines printed are a short summary and "gpu_check: figures written to <path>".
#
# Environment: PYTHON (interpreter; default python, or .venv/bin/python when python lacks
# torch), GPU_CHECK_ROWS, GPU_CHECK_MAX_STEPS, GPU_CHECK_BATCH (data.batch_size),
# GPU_CHECK_JSON, GPU_CHECK_KEEP=1 (keep the synthetic data in the work directory).
set -uo pipefail

CALLER_PWD="$(pwd)"
cd "$(dirname "$0")/.." || exit 2
REPO="$(pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

PY="${PYTHON:-$(command -v python || command -v python3)}"
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -z "${PYTHON:-}" ] && [ -x "$REPO/.venv/bin/python" ]; then
    PY="$REPO/.venv/bin/python"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "gpu_check: '$PY' cannot import torch; set PYTHON to an interpreter with torch" >&2
    exit 2
fi

if [ -n "${GPU_CHECK_JSON:-}" ]; then
    JSON="$GPU_CHECK_JSON"
elif [ -n "${OUT:-}" ]; then
    JSON="$OUT/gpu_check.json"
else
    JSON="$CALLER_PWD/gpu_check.json"
fi
case "$JSON" in /*) ;; *) JSON="$CALLER_PWD/$JSON" ;; esac
mkdir -p "$(dirname "$JSON")"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
: >"$WORK/steps.tsv"
T_START=$(date +%s.%N)

DEV="$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null)"
if [ "$DEV" = cuda ]; then
    ROWS="${GPU_CHECK_ROWS:-300000}"; MAX_STEPS="${GPU_CHECK_MAX_STEPS:-200}"; LOG_EVERY=25
else
    ROWS="${GPU_CHECK_ROWS:-20000}"; MAX_STEPS="${GPU_CHECK_MAX_STEPS:-15}"; LOG_EVERY=5
fi
echo "gpu_check: repo $REPO, python $PY, device $DEV, work dir $WORK"

# run_step NAME TIMEOUT_S CMD...: run with a time bound, log to $LOGS/NAME.log, record rc and seconds
run_step() {
    local name="$1" limit="$2"
    shift 2
    local t0 t1 rc
    t0=$(date +%s.%N)
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=20 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN{print $t1 - $t0}")" >>"$WORK/steps.tsv"
    if [ "$rc" -ne 0 ]; then
        echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out')); last lines of $LOGS/$name.log:"
        tail -n 30 "$LOGS/$name.log" | cut -c1-300 | sed 's/^/   | /'
    else
        echo "   ok"
    fi
    return 0
}

# ------------------------------------------------------------------ env
run_step env 120 "$PY" - "$WORK/env.json" <<'PY'
import importlib.metadata as md, importlib.util, json, platform, subprocess, sys
import torch
def ver(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
    return None
cuda = torch.cuda.is_available()
env = {
    "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cuda_available": cuda, "cuda_device_count": torch.cuda.device_count() if cuda else 0,
    "device_name": torch.cuda.get_device_name(0) if cuda else None,
    "device_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None,
    "fbgemm_gpu_installed": importlib.util.find_spec("fbgemm_gpu") is not None,
    "fbgemm_gpu_version": ver("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm_gpu", "fbgemm_gpu_cpu"),
    "packages": {n: ver(n) for n in ("numpy", "pyarrow", "typer", "pyyaml", "torchx", "pytest", "pytest-timeout")},
    "cpu_count": __import__("os").cpu_count(),
}
try:
    env["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30).stdout.strip() or None
except Exception:
    env["nvidia_smi"] = None
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
PY

# ------------------------------------------------------------------ imports
GPU_CHECK_REPO="$REPO" run_step import 120 "$PY" -c "
import os, dlrmctl, dlrmctl.cli
print('HAS_FBGEMM', dlrmctl.HAS_FBGEMM)
print('dlrmctl from', dlrmctl.__file__)
repo = os.path.realpath(os.environ['GPU_CHECK_REPO'])  # any clone path (quotes, symlinks) compares right
assert os.path.realpath(dlrmctl.__file__).startswith(repo + os.sep), 'dlrmctl is not imported from this checkout'
"

run_step import_nofbgemm 120 "$PY" - "$DEV" <<'PY'
# hide fbgemm_gpu exactly as tests/helpers/run_without_fbgemm.py does, then import the package
import importlib.abc, importlib.util, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fbgemm_gpu" or name.startswith("fbgemm_gpu."):
            raise ModuleNotFoundError(f"No module named '{name}' (blocked)")
        return None
sys.meta_path.insert(0, Block())
_orig = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a, **k: None if n.split(".")[0] == "fbgemm_gpu" else _orig(n, *a, **k)
import torch
import dlrmctl
print("HAS_FBGEMM", dlrmctl.HAS_FBGEMM)
assert dlrmctl.HAS_FBGEMM is False
import dlrmctl.cli  # noqa: F401
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor
dev = sys.argv[1]
ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=10, embedding_dim=8, name="t", feature_names=["f"], pooling="mean")], compute_kernel="fused", device=dev)
assert ebc.compute_kernel == "dense", ebc.compute_kernel
kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1])).to(dev)
out = ebc(kjt).values()
assert out.shape == (3, 8) and out.device.type == dev and bool((out[1] == 0).all())
print("fused requested -> kernel", ebc.compute_kernel, "on", out.device)
PY

# ------------------------------------------------------------------ pytest -m cuda
run_step pytest "$([ "$DEV" = cuda ] && echo 360 || echo 240)" \
    "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$WORK/pytest.xml"

# ------------------------------------------------------------------ data + train
run_step data 180 "$PY" -c "
from dlrmctl.data.synthetic import generate_synthetic
r = generate_synthetic('$WORK/data', rows=$ROWS, seed=0)
print(r)
"

TRAIN_SETS=(
    --set "data.path=$WORK/data" --set "train.run_dir=$WORK/runs" --set name=gpu_check
    --set sharding.force=true --set train.pipeline=sparse_dist --set "train.device=$DEV"
    --set "train.max_steps=$MAX_STEPS" --set "train.log_every=$LOG_EVERY" --set train.progress=false
    --set sharding.tables.t_C1.sharding_type=row_wise
    --set "sharding.tables.t_C2={sharding_type: column_wise, ranks: [0, 0], column_sizes: [8, 8]}"
    --set sharding.tables.t_C3.sharding_type=table_row_wise
    --set "sharding.tables.t_C4={sharding_type: table_column_wise, ranks: [0, 0], column_sizes: [4, 12]}"
)
if [ -n "${GPU_CHECK_BATCH:-}" ]; then TRAIN_SETS+=(--set "data.batch_size=$GPU_CHECK_BATCH"); fi
run_step train 300 "$PY" -m dlrmctl.cli train configs/demo.yaml "${TRAIN_SETS[@]}" --overwrite

# mixed precision on the same sharded path: fp16 autocast + GradScaler on CUDA (bf16 on CPU),
# fp16 embedding weights, bf16 pooled-embedding all-to-all (qcomm); at most 100 steps
AMP=bf16; [ "$DEV" = cuda ] && AMP=fp16
AMP_STEPS=$(( MAX_STEPS < 100 ? MAX_STEPS : 100 ))
run_step train_amp 180 "$PY" -m dlrmctl.cli train configs/demo.yaml "${TRAIN_SETS[@]}" --overwrite \
    --set name=gpu_check_amp --set "train.max_steps=$AMP_STEPS" --set "train.precision=$AMP" \
    --set model.embedding_precision=fp16 --set sharding.comm_precision=bf16
[ -f "$WORK/runs/gpu_check_amp/summary.json" ] && cp "$WORK/runs/gpu_check_amp/summary.json" "$LOGS/train_amp_summary.json"

RUN="$WORK/runs/gpu_check"
for f in metrics.jsonl summary.json plan.txt; do
    [ -f "$RUN/$f" ] && cp "$RUN/$f" "$LOGS/train_$f"
done
[ -f "$WORK/pytest.xml" ] && cp "$WORK/pytest.xml" "$LOGS/pytest.xml"
[ "${GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$WORK/data" "$RUN/checkpoints"

# ------------------------------------------------------------------ figures
T_END=$(date +%s.%N)
TOTAL_S="$(awk "BEGIN{print $T_END - $T_START}")"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/gpu_check_logs" && cp -r "$LOGS/." "$OUT/gpu_check_logs/"
    LOG_DIR_REPORTED="$OUT/gpu_check_logs"
else
    LOG_DIR_REPORTED="$LOGS"
fi
"$PY" - "$WORK" "$JSON" "$DEV" "$ROWS" "$MAX_STEPS" "$TOTAL_S" "$LOG_DIR_REPORTED" <<'PY'
import json, os, re, sys
import xml.etree.ElementTree as ET
work, out, dev, rows, max_steps, total_s, log_dir = sys.argv[1:8]
logs = os.path.join(work, "logs")

def read(path, default=None):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default

steps = {}
for line in (read(os.path.join(work, "steps.tsv"), "") or "").splitlines():
    name, rc, secs = line.split("\t")
    steps[name] = {"ok": rc == "0", "exit_code": int(rc), "seconds": round(float(secs or 0), 1)}

env = json.loads(read(os.path.join(work, "env.json"), "{}") or "{}")
imp = read(os.path.join(logs, "import.log"), "") or ""
m = re.search(r"HAS_FBGEMM (True|False)", imp)
env["dlrmctl_has_fbgemm"] = None if m is None else m.group(1) == "True"
env["compute_kernel"] = None if m is None else ("fused" if env["dlrmctl_has_fbgemm"] else "dense")

# pytest: junit xml
py = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0,
      "cuda_variants": {"passed": 0, "failed": 0, "skipped": 0}, "skip_reasons": {}, "failures": []}
try:
    root = ET.parse(os.path.join(work, "pytest.xml")).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kind = "passed"
        for child in case:
            if child.tag == "skipped":
                kind = "skipped"
                reason = (child.get("message") or "").strip()
                py["skip_reasons"][reason] = py["skip_reasons"].get(reason, 0) + 1
            elif child.tag in ("failure", "error"):
                kind = "failed" if child.tag == "failure" else "errors"
                py["failures"].append({"test": name, "kind": child.tag, "message": (child.get("message") or "")[:600]})
        py[kind] += 1
        py["total"] += 1
        if re.search(r"\[cuda[-\]]", case.get("name") or ""):
            py["cuda_variants"]["failed" if kind in ("failed", "errors") else kind] += 1
    # collection errors appear as testcases without a [param] or as testsuite errors
    py["errors"] = max(py["errors"], sum(int(s.get("errors", 0)) for s in root.iter("testsuite")))
except (OSError, ET.ParseError) as e:
    py["junit_error"] = str(e)
tail = (read(os.path.join(logs, "pytest.log"), "") or "").strip().splitlines()
py["summary_line"] = tail[-1] if tail else None

# training: metrics.jsonl (train records), summary.json, the epoch line
train = {"device": dev, "rows": int(rows), "max_steps": int(max_steps), "pipeline": "sparse_dist",
         "sharded_one_rank_group": True, "backend": "nccl" if dev == "cuda" else "gloo"}
recs = []
for line in (read(os.path.join(logs, "train_metrics.jsonl"), "") or "").splitlines():
    try:
        recs.append(json.loads(line))
    except json.JSONDecodeError:
        pass
tr = [r for r in recs if r.get("kind") == "train"]
ev = [r for r in recs if r.get("kind") == "eval"]
if tr:
    last = tr[-1]
    train.update({"steps_logged": last["step"], "samples_per_s": last.get("samples_per_s"),
                  "data_wait_share": last.get("data_wait_share"), "comm_wait_share": last.get("comm_wait_share"),
                  "loss_last": last.get("loss"), "loss_first": tr[0].get("loss"),
                  "records": [{k: r.get(k) for k in ("step", "samples_per_s", "data_wait_share", "comm_wait_share", "loss")} for r in tr]})
if ev:
    train["val_auc"] = ev[-1].get("auc")
    train["val_logloss"] = ev[-1].get("logloss")
summ = read(os.path.join(logs, "train_summary.json"))
if summ:
    s = json.loads(summ)
    train["steps"] = s.get("steps")
    train["train_seconds"] = s.get("train_seconds")
epoch_lines = re.findall(
    r"epoch (\d+)(?:/\d+)?: (\d+) steps, ([\d,.]+) samples/s \((\w+) pipeline\), waiting on data ([\d.]+)% and on input_dist ([\d.]+)% of step time",
    read(os.path.join(logs, "train.log"), "") or "")
train["epoch_lines"] = [{"epoch": int(e), "steps": int(n), "samples_per_s": float(sps.replace(",", "")), "pipeline": p,
                         "data_wait_pct": float(d), "comm_wait_pct": float(c)} for e, n, sps, p, d, c in epoch_lines]
plan = read(os.path.join(logs, "train_plan.txt"), "") or ""
train["sharding_types"] = sorted({l.split()[1] for l in plan.splitlines()[2:] if l.startswith("t_") and len(l.split()) > 2})

checks = {}
if env.get("cuda_available"):
    checks["cuda_test_variants_ran"] = py["cuda_variants"]["passed"] > 0
checks["train_metrics_recorded"] = bool(tr) and train.get("samples_per_s") is not None
ok = all(s["ok"] for s in steps.values()) and all(checks.values())
report = {"ok": ok, "device": dev, "total_seconds": round(float(total_s or 0), 1), "env": env, "steps": steps,
          "checks": checks, "pytest": py, "train": train, "log_dir": log_dir, "work_dir": work}
with open(out, "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")

def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"
print("\n===== gpu_check summary =====")
print(f"torch {env.get('torch')} (cuda {env.get('torch_cuda')}), device {dev}"
      + (f" [{env.get('device_name')}]" if env.get("device_name") else "")
      + f", fbgemm_gpu {'present' if env.get('fbgemm_gpu_installed') else 'absent'} -> {env.get('compute_kernel')} kernel")
print("steps: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED(' + str(v['exit_code']) + ')'} {v['seconds']}s" for k, v in steps.items()))
cv = py["cuda_variants"]
print(f"pytest -m cuda: {py['passed']} passed, {py['failed']} failed, {py['errors']} errors, {py['skipped']} skipped "
      f"(cuda variants: {cv['passed']} passed, {cv['failed']} failed, {cv['skipped']} skipped)")
for reason, n in py["skip_reasons"].items():
    print(f"  skipped x{n}: {reason[:200]}")
for fl in py["failures"][:10]:
    print(f"  {fl['kind']}: {fl['test']}: {fl['message'][:200]}")
sps = train.get("samples_per_s")
print(f"train ({train['backend']}, one-rank group, sparse_dist, {train.get('steps')} steps, {rows} rows): "
      f"{'n/a' if sps is None else f'{sps:,.0f}'} samples/s, waiting on data {pct(train.get('data_wait_share'))}, "
      f"on input_dist {pct(train.get('comm_wait_share'))}, val AUC {train.get('val_auc')}")
for k, v in checks.items():
    if not v:
        print(f"  check failed: {k}")
print(f"total {report['total_seconds']}s; logs in {log_dir}; result: {'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
RC=$?
echo "gpu_check: figures written to $JSON"
exit $RC
