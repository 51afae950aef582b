#!/bin/bash
# The device check of the snapshot (one GPU): the same 374M-parameter ZeRO-2 bf16 training through
# attach twice, with the snapshot (the default) and with snapshot=False, a save every 60 steps, so
# that each commit ends before the next save; each save's stall against a copy of the same bytes
# into pinned host memory; then an exact resume from the snapshot run's store at step 240.
# Run from the repository root with the wheels in .whl/ (docs/benchmarks.md); results in $OUT.
set -u
OUT=${OUT:-gpu-stall}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD PYTHONUNBUFFERED=1 TAILOR_STAGING=/dev/shm
W=/tmp/gpustall; rm -rf $W; mkdir -p $W
nvidia-smi --query-gpu=name --format=csv,noheader
M="--cuda --dim 1024 --layers 24 --heads 16 --hidden 2816 --vocab 32000 --seq 512 --micro-batch 8 --stage 2 --dtype bf16"
for way in snap sync; do
  python3 -c "from tailorstore import Store; Store.init('$W/store-$way').close()" || exit 1
  extra=""; [ $way = sync ] && extra="--no-snapshot"
  echo "== attach ($way)"
  timeout 170 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M $extra --save-dir $W/$way --commit-to $W/store-$way --tailor-engine --steps 300 --save-every 60 --losses-out "$OUT/$way-losses.json" --timings-out "$OUT/$way-timings.json" > "$W/$way.log" 2>&1
  echo "rc $?"; grep -E "in flight|committed step|Error" "$W/$way.log" | tail -8
done
echo "== resume at step 240 from the store"
timeout 80 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M --save-dir $W/snap --commit-to $W/store-snap --tailor-engine --resume-from $W/snap --resume-tag global_step240 --steps 300 --save-every 0 --losses-out "$OUT/resumed-losses.json" > "$W/resume.log" 2>&1
echo "rc $?"; tail -2 "$W/resume.log"
python3 - "$OUT" <<'PY'
import json, sys, statistics
from pathlib import Path
out = Path(sys.argv[1])
def j(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:
        return {"missing": str(exc)}
for way in ("snap", "sync"):
    t = j(f"{way}-timings.json")
    print(way, "stalls", [round(s, 3) for s in t.get("stalls", [])], "median", round(statistics.median(t["stalls"]), 3) if t.get("stalls") else None,
          "floor", t.get("copy_floor_seconds"), "bytes", t.get("copy_floor_bytes"), "loop", t.get("loop_seconds"))
a, b, r = j("snap-losses.json"), j("sync-losses.json"), j("resumed-losses.json")
print("snap losses == sync losses:", a == b, len(a))
print("resumed", len(r), "steps, equal to the uninterrupted run:", bool(r) and all(a.get(k) == v for k, v in r.items()))
PY
