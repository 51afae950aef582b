#!/bin/bash
# The device check (one GPU): a DeepSpeed ZeRO-2 bf16 run of 374M parameters through attach,
# each save's stall against plain save_checkpoint and against a copy of the same bytes into
# pinned host memory, then an exact resume from the store at step 8; and DCP's own save stall
# on the same card as a baseline. Run from the repository root with the wheels in .whl/
# (docs/benchmarks.md says how); results land in $OUT (or ./gpu-check).
set -u
OUT=${OUT:-gpu-check}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/gpucheck; rm -rf $W; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 
df -h /dev/shm /tmp | tee "$OUT/df.txt"
free=$(df --output=avail -B1G /dev/shm | tail -1)
if [ "$free" -ge 24 ]; then export TAILOR_STAGING=/dev/shm; else export TAILOR_STAGING=$W/staging; mkdir -p $W/staging; fi
echo "staging: $TAILOR_STAGING" | tee -a "$OUT/df.txt"
M="--cuda --dim 1024 --layers 24 --heads 16 --hidden 2816 --vocab 32000 --seq 512 --micro-batch 8 --stage 2 --dtype bf16"
python3 -c "from tailorstore import Store; Store.init('$W/store').close()" || exit 1
echo "== attach"; timeout 180 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M --save-dir $W/a --commit-to $W/store --tailor-engine --steps 12 --save-every 4 --losses-out "$OUT/attach-losses.json" --timings-out "$OUT/attach-timings.json" > "$OUT/attach.log" 2>&1; echo "rc $?"; tail -5 "$OUT/attach.log"
echo "== plain"; timeout 100 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M --save-dir $W/plain --steps 12 --save-every 4 --losses-out "$OUT/plain-losses.json" --timings-out "$OUT/plain-timings.json" > "$W/plain.log" 2>&1; echo "rc $?"; tail -3 "$W/plain.log"
echo "== resume at step 8 from the store"; timeout 100 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M --save-dir $W/a --commit-to $W/store --tailor-engine --resume-from $W/a --resume-tag global_step8 --steps 12 --save-every 0 --losses-out "$OUT/resumed-losses.json" > "$W/resume.log" 2>&1; echo "rc $?"; tail -3 "$W/resume.log"
echo "== dcp"; timeout 80 torchrun --standalone --nproc_per_node 1 -m benchmarks.dcp_stall --out $W/dcp > "$W/dcp.log" 2>&1; echo "rc $?"; tail -2 "$W/dcp.log"
python3 - "$OUT" <<'PY'
import json, sys, statistics
from pathlib import Path
out = Path(sys.argv[1])
def j(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:
        return {"missing": str(exc)}
a, p, r = j("attach-timings.json"), j("plain-timings.json"), j("resumed-losses.json")
full = j("attach-losses.json")
print("attach stalls", a.get("stalls"), "plain stalls", p.get("stalls"))
print("copy floor", a.get("copy_floor_seconds"), "s for", a.get("copy_floor_bytes"), "bytes")
same = {k: v for k, v in r.items() if k in full}
print("resumed steps", sorted(r), "equal to the uninterrupted run:", all(full[k] == v for k, v in same.items()) and len(same) == 4)
PY
du -sh $W/store $W/plain 2>/dev/null
