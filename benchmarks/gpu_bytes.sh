#!/bin/bash
# The device check of the bytes and of the cores (one GPU node, 16 CPU cores):
# 1. the same deterministic CUDA training (58M parameters, ZeRO-2 bf16, 4 steps, one save) three
#    ways: plain save_checkpoint, attach with the snapshot (the default) and attach with
#    snapshot=False; both stores' steps checked out and compared, file by file, with the plain
#    save (benchmarks/compare_saves.py names any record and pickle opcode that differs);
# 2. commit and checkout throughput at 1, 2, 4, 8 and 16 threads (benchmarks/threads.py);
# 3. whole-process commit and checkout against their floors (benchmarks/cost.py);
# 4. the warm resume's parts in one process (benchmarks/resume_floor.py);
# 5. the snapshot's stall at this size: 100 steps, a save every 20, against a copy of the same
#    bytes into pinned memory already mapped (testbed.train_tiny --timings-out).
# 6. which part of the commit stops growing with threads (benchmarks/scaling_parts.py), and the
#    commit's own thread under cProfile (benchmarks/commit_profile.py).
# PARTS picks some of them (default: bytes threads floor cost stall parts profile).
# Run from the repository root with the wheels in .whl/ (docs/benchmarks.md); results in $OUT.
set -u
OUT=${OUT:-gpu-bytes}; mkdir -p "$OUT"
if [ "${CPU_ONLY:-0}" = 1 ]; then  # a rehearsal on a machine with the packages installed
  export PYTHONPATH=$PWD
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
  [ -e tailorstore/cli ] || ln -s ../cli tailorstore/cli  # installed as tailorstore.cli (pyproject.toml)
fi
export PYTHONUNBUFFERED=1 TAILOR_STAGING=/dev/shm
W=/tmp/gpubytes; rm -rf $W; mkdir -p $W /tmp/bin
# the tailor command, as a wheel install would have it (cost.py runs it as whole processes)
cat > /tmp/bin/tailor <<'SH'
#!/bin/sh
exec python3 -c 'import sys; sys.argv[0] = "tailor"; from tailorstore.cli.app import run; sys.exit(run())' "$@"
SH
chmod +x /tmp/bin/tailor; export PATH=/tmp/bin:$PATH
python3 -m compileall -q tailorstore cli /tmp/site/zstandard > /dev/null 2>&1
(nvidia-smi --query-gpu=name --format=csv,noheader; nproc; python3 -c "import torch; print(torch.__version__)") | tee "$OUT/machine.txt"
GPU=""; [ "${CPU_ONLY:-0}" = 1 ] || GPU="--cuda"
M="$GPU ${MODEL_ARGS:---dim 512 --layers 8 --heads 8 --hidden 1408 --vocab 32000 --seq 256 --micro-batch 8} --stage 2 --dtype bf16 --steps 4 --save-every 4"
PARTS=${PARTS:-bytes threads floor cost stall parts profile}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
ways="plain snap sync"; has bytes || ways=plain  # the plain save is what every other part reads
for way in $ways; do
  extra=""
  if [ $way != plain ]; then
    python3 -c "from tailorstore import Store; Store.init('$W/store-$way').close()" || exit 1
    extra="--commit-to $W/store-$way --tailor-engine"
  fi
  [ $way = sync ] && extra="$extra --no-snapshot"
  echo "== $way"
  timeout 150 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $M $extra --save-dir $W/$way --losses-out "$W/$way-losses.json" > "$W/$way.log" 2>&1
  echo "rc $?"; grep -E "Error|error:" "$W/$way.log" | tail -3
  if [ $way != plain ]; then
    python3 -c "from tailorstore import Store; Store.open('$W/store-$way').checkout('latest', '$W/out-$way')" || echo "checkout failed"
    python3 -m benchmarks.compare_saves $W/plain/global_step4 $W/out-$way/global_step4 > "$OUT/compare-$way.json"
    echo "$way: files equal to the plain save: rc $?"
  fi
done
python3 - "$OUT" "$W" <<'PY'
import json, sys
from pathlib import Path
out, work = Path(sys.argv[1]), Path(sys.argv[2])
losses = {w: json.loads((work / f"{w}-losses.json").read_text()) for w in ("plain", "snap", "sync") if (work / f"{w}-losses.json").exists()}
print("losses equal every way:", len({json.dumps(v, sort_keys=True) for v in losses.values()}) == 1, {w: len(v) for w, v in losses.items()})
for w in ("snap", "sync"):
    f = out / f"compare-{w}.json"
    if f.exists():
        r = json.loads(f.read_text())
        print(w, {k: (v.get("identical"), v.get("bytes")) for k, v in r["files"].items()})
PY
du -sh $W/plain/global_step4
has threads && { echo "== threads"; timeout 150 python3 -m benchmarks.threads $W/plain/global_step4 --repeats 2 --counts 1,2,4,8,16 > "$OUT/threads.json"; echo "rc $?"; }
has floor && { echo "== resume floor"; timeout 60 python3 -m benchmarks.resume_floor $W/plain global_step4 --repeats 3 > "$OUT/floor.json"; echo "rc $?"; }
if ! has cost; then :
elif [ -x /usr/bin/time ]; then
  echo "== cost"; timeout 120 python3 -m benchmarks.cost $W/plain/global_step4 --repeats 3 --work $W/cost > "$OUT/cost.json"; echo "rc $?"
else
  echo "no /usr/bin/time: cost skipped"
fi
has parts && { echo "== parts"; timeout 120 python3 -m benchmarks.scaling_parts $W/plain/global_step4 > "$OUT/parts.json"; echo "rc $?"; cat "$OUT/parts.json"; }
has profile && for t in 4 16; do echo "== commit profile, threads=$t"; timeout 60 python3 -m benchmarks.commit_profile $W/plain/global_step4 --threads $t --top 14 | tee "$OUT/profile-$t.txt" | cut -c1-150; done
if has stall; then
  echo "== stall"; python3 -c "from tailorstore import Store; Store.init('$W/store-stall').close()" || exit 1
  S="${M/--steps 4 --save-every 4/--steps 100 --save-every 20}"
  timeout 150 torchrun --standalone --nproc_per_node 1 -m testbed.train_tiny $S --save-dir $W/stall --commit-to $W/store-stall --tailor-engine --timings-out "$OUT/stall-timings.json" > "$W/stall.log" 2>&1
  echo "rc $?"; grep -E "Error|error:" "$W/stall.log" | tail -3; cat "$OUT/stall-timings.json"; echo
fi
for f in threads floor cost; do [ -f "$OUT/$f.json" ] && tail -c 1500 "$OUT/$f.json"; done
