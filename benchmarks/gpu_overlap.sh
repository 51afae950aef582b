#!/bin/bash
# The device check of the overlapped snapshot (one GPU): the snapshot's copies run on side streams
# beside the next step (tailorstore/integrations/deepspeed/side_copy.py).
# 1. tests/unit/integrations/deepspeed/test_side_copy.py on the GPU: a change queued right after a save is not in its file;
# 2. the same 374M-parameter ZeRO-2 bf16 training through attach three ways: no saves, the
#    snapshot through GPU buffers (the default where the GPU has room), and straight into pinned
#    memory (gpu_buffers=False), and with PARTS containing "gpubuf4" the first again with the
#    background commit on 4 threads (TAILOR_THREADS=4); STEPS steps, a save every EVERY. Each save's stall, and the
#    tokens/s of the WINDOW steps from each save against the same steps of the run without saves;
#    the two ways' stores compared file by file at the second save; a resume from the first store
#    at that step, its losses against the uninterrupted run's;
# 3. with PARTS containing "threads": commit and checkout GB/s at 1-16 threads (gpu_bytes.sh).
# Run from the repository root with the wheels in .whl/ (docs/benchmarks.md); results in $OUT.
set -u
OUT=${OUT:-gpu-overlap}; mkdir -p "$OUT"
STEPS=${STEPS:-130}; EVERY=${EVERY:-40}; WINDOW=${WINDOW:-10}; PARTS=${PARTS:-test nosave gpubuf direct resume}
if [ "${CPU_ONLY:-0}" = 1 ]; then  # a rehearsal of the script on a machine with the packages installed
  export PYTHONPATH=$PWD
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
fi
export PYTHONUNBUFFERED=1 TAILOR_STAGING=/dev/shm
W=/tmp/gpuoverlap; rm -rf $W; mkdir -p $W
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; python3 -c "import torch; print(torch.__version__)") | tee "$OUT/machine.txt"
if has test; then
  echo "== tests/unit/integrations/deepspeed/test_side_copy.py"
  timeout 120 python3 -m pytest -q --noconftest -p no:cacheprovider tests/unit/integrations/deepspeed/test_side_copy.py 2>&1 | tail -4
fi
M=${MODEL:-"--cuda --dim 1024 --layers 24 --heads 16 --hidden 2816 --vocab 32000 --seq 512 --micro-batch 8 --stage 2 --dtype bf16"}
for way in nosave gpubuf direct gpubuf4; do
  has $way || continue
  threads=""
  case $way in
    nosave) extra="--save-every 0" ;;
    gpubuf) extra="--save-every $EVERY --tailor-engine --commit-to $W/store-$way --gpu-buffers auto" ;;
    direct) extra="--save-every $EVERY --tailor-engine --commit-to $W/store-$way --gpu-buffers off" ;;
    gpubuf4) extra="--save-every $EVERY --tailor-engine --commit-to $W/store-$way"; threads=4 ;;  # commit on 4 threads
  esac
  [ $way = nosave ] || python3 -c "from tailorstore import Store; Store.init('$W/store-$way').close()" || exit 1
  echo "== $way"
  TAILOR_THREADS=$threads timeout 200 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M $extra --save-dir $W/$way --steps $STEPS --losses-out "$OUT/$way-losses.json" --timings-out "$OUT/$way-timings.json" > "$W/$way.log" 2>&1
  echo "rc $?"; grep -E "Error|error:|committed step" "$W/$way.log" | tail -4
  rm -rf /dev/shm/tailor-* 2>/dev/null
done
if has gpubuf && has direct; then  # deterministic runs: the two ways' stores hold the same bytes of a step
  echo "== step $((2 * EVERY)) from both stores, file by file"
  timeout 120 python3 - "$W" $((2 * EVERY)) <<'PY'
import filecmp, sys
from pathlib import Path
from tailorstore import Store
work, step = Path(sys.argv[1]), int(sys.argv[2])
for way in ("gpubuf", "direct"):
    with Store.open(work / f"store-{way}") as store:
        store.checkout(step, work / f"out-{way}")
a, b = work / "out-gpubuf", work / "out-direct"
names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
same = [n for n in names if filecmp.cmp(a / n, b / n, shallow=False)]
print(f"{len(same)} of {len(names)} files identical: {names}")
PY
  rm -rf $W/out-gpubuf $W/out-direct
fi
if has resume; then
  echo "== resume at step $((2 * EVERY)) from the gpubuf store"
  timeout 120 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M --save-dir $W/gpubuf --commit-to $W/store-gpubuf --tailor-engine --resume-from $W/gpubuf --resume-tag global_step$((2 * EVERY)) --steps $STEPS --save-every 0 --losses-out "$OUT/resumed-losses.json" > "$W/resume.log" 2>&1
  echo "rc $?"; tail -2 "$W/resume.log"
  python3 -c "
import json; a = json.load(open('$OUT/nosave-losses.json')); r = json.load(open('$OUT/resumed-losses.json'))
print(len(r), 'steps resumed, equal to the run without saves:', bool(r) and all(a.get(k) == v for k, v in r.items()))"
fi
python3 - "$OUT" "$EVERY" "$WINDOW" "${TOKENS:-4096}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, every, window = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tokens_a_step = int(sys.argv[4])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:
        return {"missing": str(exc)}
base = load("nosave-timings.json")
ends0 = {int(k): v for k, v in base.get("step_ends", {}).items()}
if ends0:
    steady = sorted(ends0[s + 1] - ends0[s] for s in ends0 if s + 1 in ends0 and s > 10)
    print("no saves: median step", round(statistics.median(steady), 4), "s; loop", round(base["loop_seconds"], 2), "s")
for way in ("gpubuf", "direct", "gpubuf4"):
    t = load(f"{way}-timings.json")
    if "stalls" not in t:
        print(way, t)
        continue
    ends = {int(k): v for k, v in t["step_ends"].items()}
    print(way, "stalls", [round(s, 4) for s in t["stalls"]], "copy floor", t.get("copy_floor_seconds"), "s for", t.get("copy_floor_bytes"), "bytes")
    for s in sorted(ends):
        if s % every or s + window not in ends or s not in ends0 or s + window not in ends0:
            continue
        mine, theirs = ends[s + window] - ends[s], ends0[s + window] - ends0[s]
        print(f"  save at {s}: steps {s + 1}-{s + window} (the save included) {mine:.3f} s against {theirs:.3f} s without saves;"
              f" tokens/s {window * tokens_a_step / mine:,.0f} against {window * tokens_a_step / theirs:,.0f}: {theirs / mine:.4f}x")
    same = load(f"{way}-losses.json") == load("nosave-losses.json")
    print("  losses equal to the run without saves:", same)
PY
if has threads; then
  echo "== threads (benchmarks/gpu_bytes.sh)"
  OUT="$OUT" PARTS="threads" timeout 240 bash benchmarks/gpu_bytes.sh > "$W/threads.log" 2>&1; echo "rc $?"
  tail -c 1200 "$OUT/threads.json" 2>/dev/null
fi
