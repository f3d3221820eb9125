#!/usr/bin/env bash
# Real Criteo lines, three ways to map categorical values to rows, each model trained with the
# settings of configs/criteo_18k.yaml (best on val) and scored as an exported .pt2 on the test rows
# (lines it never saw): managed collision (--raw-ids, model.managed_collision.size N), modulo
# hashing into N rows (--num-embeddings N), a vocabulary (--frequency-threshold 3).
#   scripts/bench_criteo_mc.sh WORK N INPUT... (benchmarks/managed_collision.md)
# SCORE=run scores each run's best checkpoint (`dlrmctl evaluate RUN`, equal to its fp32 export to
# 1e-6) instead of exporting it (the export also times the program, slow on a loaded machine).
set -euo pipefail
work=$1; n=$2; shift 2
ins=(); for f in "$@"; do ins+=(--input "$f"); done
split=(--val-ratio 0.15 --test-ratio 0.15)
dl() { python -m dlrmctl.cli "$@"; }
dl preprocess criteo "${ins[@]}" --out "$work/raw" --raw-ids "${split[@]}" -q >/dev/null
dl preprocess criteo "${ins[@]}" --out "$work/mod" --num-embeddings "$(( n - 1 ))" "${split[@]}" -q >/dev/null
dl preprocess criteo "${ins[@]}" --out "$work/vocab" --frequency-threshold 3 "${split[@]}" -q >/dev/null
cfg=configs/criteo_18k.yaml
for v in raw mod vocab; do
  sets=(--set "data.path=$work/$v" --set "name=$v" --set "train.run_dir=$work/runs" --set train.progress=false)
  [ "$v" = raw ] && sets+=(--set "model.managed_collision.size=$n")
  [ -f "$work/runs/$v/summary.json" ] || dl train "$cfg" "${sets[@]}" >/dev/null
  if [ "${SCORE:-export}" = run ]; then
    auc=$(dl evaluate "$work/runs/$v" --data "$work/$v" --split test | awk '$1 == "auc" {print $2}')
  else
    [ -f "$work/exp_$v/model.pt2" ] || dl export "$work/runs/$v" --fp32 --out "$work/exp_$v" >/dev/null
    auc=$(dl evaluate "$work/exp_$v" --data "$work/$v" --split test | awk '$1 == "auc" {print $2}')
  fi
  echo "$v $auc"
done
