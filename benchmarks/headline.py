"""The headline table: bytes stored against raw, and held-out quality, per policy.

    python -m benchmarks.headline            # train (once), then measure every row

One DeepSpeed training (55M parameters, bf16, ZeRO-2, 2 ranks, text-like data) saves every
``--every`` steps. Each policy commits the whole series into its own store with the real
``tailor`` process (timed, start-up included); the store's bytes over the raw saves' bytes
is the row's ratio. Quality: check out the last step from that store, resume under
DeepSpeed for ``--resume-steps`` more steps, and take the held-out loss, against the same
resume from the exact save. Thinning rows thin a full store (``tailor gc --keep-last 3
--thin TIER``). Results go to ``.bench/headline.json`` and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import threading
import time
from pathlib import Path

from tailorstore.api import Store
from testbed.compare import same_tree
from testbed.runs import train_tiny

from .report import write_section
from .suite import TAILOR, dir_bytes, measured, warm

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

MODEL = {
    "stage": 2,
    "dtype": "bf16",
    "vocab": 4096,
    "dim": 640,
    "layers": 10,
    "heads": 10,
    "hidden": 1728,
    "seq": 64,
    "micro_batch": 2,
    "lr": 1e-3,
    "data": "chain",
    "fp32_compute": True,
}
EVAL_BATCHES = 32


def params_of(model: dict) -> int:
    dim, hidden = model["dim"], model["hidden"]
    block = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    return 2 * model["vocab"] * dim + model["layers"] * block + dim


def train(work: Path, steps: int, every: int) -> dict:
    """The series of saves, made once; later runs reuse it."""
    done = work / "trained.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(work / "save", ignore_errors=True)
    began = time.perf_counter()
    losses = train_tiny(
        work / "save",
        losses_out=work / "losses.json",
        steps=steps,
        save_every=every,
        eval_batches=EVAL_BATCHES,
        eval_out=work / "eval-trained.json",
        timeout=6 * 3600,
        **MODEL,
    )
    info = {
        "steps": list(range(every, steps + 1, every)),
        "seconds": time.perf_counter() - began,
        "first_loss": float.fromhex(losses[1]),
        "last_loss": float.fromhex(losses[steps]),
        "held_out_loss": json.loads((work / "eval-trained.json").read_text())["held_out_loss"],
    }
    done.write_text(json.dumps(info))
    return info


def policy_rows(thresholds: list[float], budgets: list[tuple[float, int]]) -> list[tuple[str, str, list[str]]]:
    """(key, label, tailor commit flags) of every row that commits the series with a policy."""
    rows = [
        ("full", "full, lossless", ["--policy", "full"]),
        ("parity", "parity (half the model, then the other half)", ["--policy", "parity"]),
        (
            "filter",
            "filter (first and last block every save, the rest every 3rd)",
            ["--policy", "filter", "--keep-first", "1", "--keep-last", "1", "--every", "3"],
        ),
    ]
    rows += [
        (f"adaptive-{t:g}", f"adaptive, threshold {t:g}", ["--policy", "adaptive", "--threshold", str(t)])
        for t in thresholds
    ]
    rows += [
        (
            f"budget-{f:g}-{age}",
            f"budget {f:.0%} of a save, max age {age}",
            ["--policy", "budget", "--fraction", str(f), "--max-age", str(age)],
        )
        for f, age in budgets
    ]
    return rows


def commit_series(save: Path, steps: list[int], store: Path, flags: list[str]) -> dict:
    """Commit every save of the series with the real ``tailor`` process; each save warm first."""
    shutil.rmtree(store, ignore_errors=True)
    measured([*TAILOR, "init", str(store)])
    seconds, inside, stored, written = [], [], [], []
    for step in steps:
        warm(save / f"global_step{step}")
        cmd = [*TAILOR, "commit", str(save / f"global_step{step}"), "--store", str(store), "--json", *flags]
        wall, _, out = measured(cmd)
        seconds.append(wall)
        inside.append(out["seconds"])  # the commit itself, as the Python API inside training pays it
        stored.append(len(out["stored_layers"]))
        written.append(out["new_bytes"])
    return {
        "new_bytes": written,
        "commit_seconds": seconds,
        "inprocess_seconds": inside,
        "stored_layers": stored,
        "store_bytes": dir_bytes(store),
    }


def held_out_after_resume(work: Path, name: str, ckpt: Path, last: int, more: int) -> float:
    """Resume from ``ckpt`` under DeepSpeed, train ``more`` steps, and return the held-out loss."""
    run = work / "resumed" / name
    shutil.rmtree(run, ignore_errors=True)
    train_tiny(
        run / "save",
        losses_out=run / "losses.json",
        resume_from=ckpt,
        steps=last + more,
        save_every=0,
        eval_batches=EVAL_BATCHES,
        eval_out=run / "eval.json",
        timeout=3600,
        **MODEL,
    )
    return json.loads((run / "eval.json").read_text())["held_out_loss"]


def checkout(store: Path, ref: str, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    measured([*TAILOR, "checkout", ref, "--out", str(out), "--store", str(store), "--quiet"])
    return out


def save_results(work: Path, results: dict) -> None:
    """After every row: a later run picks up where this one stopped."""
    (work / "headline.json").write_text(json.dumps(results, indent=1))


def measure(work: Path, info: dict, args: argparse.Namespace) -> dict:
    save, steps = work / "save", info["steps"]
    last, raw = steps[-1], sum(dir_bytes(save / f"global_step{s}") for s in steps)
    results: dict = json.loads((work / "headline.json").read_text()) if (work / "headline.json").exists() else {}
    results.update(train=info, raw_bytes=raw, resume_steps=args.resume_steps)
    exact_dir = work / "exact"  # the last save alone, as DeepSpeed wrote it
    if not exact_dir.exists():
        (exact_dir / f"global_step{last}").parent.mkdir(parents=True)
        shutil.copytree(save / f"global_step{last}", exact_dir / f"global_step{last}")
        (exact_dir / "latest").write_text(f"global_step{last}")
    if "exact" not in results:
        results["exact"] = {
            "after_resume": held_out_after_resume(work, "exact", exact_dir, last, args.resume_steps),
            "at_last": held_out_after_resume(work, "exact-0", exact_dir, last, 0),
        }
    rows = results.setdefault("rows", {})
    for key, label, flags in policy_rows(args.thresholds, args.budgets):
        if key in rows and args.retime:
            # commit the series again for the times alone; commits are deterministic, so the store
            # must come out the same size, and the quality measured before still holds
            again = commit_series(save, steps, work / "stores" / f"{key}-again", flags)
            same_size = abs(again["store_bytes"] - rows[key]["store_bytes"]) < 1 << 20  # index pages may differ
            if not same_size or again["stored_layers"] != rows[key]["stored_layers"]:
                raise SystemExit(f"{key}: a second commit of the series stored something else")
            rows[key].setdefault("timing_runs", []).append(
                {"commit_seconds": again["commit_seconds"], "inprocess_seconds": again["inprocess_seconds"]}
            )
            shutil.rmtree(work / "stores" / f"{key}-again")
            save_results(work, results)
            print(f"[headline] {key} timed again", flush=True)
        if key in rows:
            continue
        store = work / "stores" / key
        row = {"label": label, **commit_series(save, steps, store, flags)}
        ckpt = checkout(store, f"step={last}", work / "checkout")
        row["last_step_exact"] = same_tree(ckpt / f"global_step{last}", exact_dir / f"global_step{last}")
        # an exact last step resumes as the original does, bit for bit: no need to train it again
        row["held_out"] = (
            results["exact"]["after_resume"]
            if row["last_step_exact"]
            else held_out_after_resume(work, key, ckpt, last, args.resume_steps)
        )
        rows[key] = row
        print(f"[headline] {key}: {json.dumps({k: v for k, v in row.items() if k != 'label'})}", flush=True)
        save_results(work, results)
        if key != "full":
            shutil.rmtree(store)  # disk: every row's store is a few GB
    full = work / "stores" / "full"
    for tier in ("weights", "master"):
        key = f"thin-{tier}"
        if key in rows:
            continue
        store = work / "stores" / key
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(full, store)
        wall, _, plan = measured([*TAILOR, "gc", "--keep-last", "3", "--thin", tier, "--store", str(store), "--json"])
        ckpt = checkout(store, f"step={last}", work / "checkout")
        rows[key] = {
            "label": f"full, then `tailor gc --keep-last 3 --thin {tier}`",
            "store_bytes": dir_bytes(store),
            "gc_seconds": wall,
            "freed_by_tier": plan.get("freed_by_tier"),
            "last_step_exact": same_tree(ckpt / f"global_step{last}", exact_dir / f"global_step{last}"),
            "held_out": results["exact"]["after_resume"],
        }
        print(f"[headline] {key}: {rows[key]}", flush=True)
        shutil.rmtree(store)
        save_results(work, results)
    if "sma" not in results:
        k = args.sma
        spec = work / "sma.yaml"
        spec.write_text(f"method: sma\nsteps: {steps[-k:]}\nbase: {{step: {last}}}\n")
        measured([*TAILOR, "merge", str(spec), "--tag", f"sma{k}", "--store", str(full), "--json"])
        ckpt = checkout(full, f"tag=sma{k}", work / "checkout")
        results["sma"] = {
            "k": k,
            "steps": steps[-k:],
            "at_last": held_out_after_resume(work, f"sma{k}-0", ckpt, last, 0),
            "after_resume": held_out_after_resume(work, f"sma{k}", ckpt, last, args.resume_steps),
        }
        save_results(work, results)
    shutil.rmtree(work / "checkout", ignore_errors=True)
    return results


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def per_save(row: dict, field: str) -> float:
    """The median over saves 2..N (the first commit of a series stores everything) of each save's
    median over the timing runs (a row's own run and every ``--retime``)."""
    runs = [row, *row.get("timing_runs", [])]
    runs = [r for r in runs if field in r]
    return statistics.median(statistics.median(r[field][i] for r in runs) for i in range(1, len(runs[0][field])))


def render(results: dict, command: str) -> str:
    """The docs/benchmarks.md section: one row per policy or tier, then the targets, measured."""
    train_info, raw, rows = results["train"], results["raw_bytes"], results["rows"]
    steps, k = train_info["steps"], results["resume_steps"]
    exact = results["exact"]["after_resume"]
    retimes = len(rows["full"].get("timing_runs", []))
    retimed = f", then `{command} --retime` {retimes} times" if retimes else ""
    full_median, full_inside = per_save(rows["full"], "commit_seconds"), per_save(rows["full"], "inprocess_seconds")
    full_written = statistics.median(rows["full"]["new_bytes"][1:])
    lines = [
        "<!-- headline:begin -->",
        "## Headline: bytes against quality, per policy",
        "",
        f"Command: `{command}`{retimed} (measured {dt.datetime.now().isoformat(timespec='seconds')}).",
        f"One DeepSpeed training: {params_of(MODEL) / 1e6:.1f}M parameters ({MODEL['layers']} blocks, vocabulary "
        f"{MODEL['vocab']}), bf16 with FP32 masters, ZeRO-2, 2 ranks, AdamW, text-like data (`--data chain`, bf16 "
        f"parameters multiplied in fp32: `--fp32-compute`), {steps[-1]} steps, a save every {steps[0]}: "
        f"{len(steps)} saves, {_gb(raw)} raw. Training loss {train_info['first_loss']:.2f} at step 1, "
        f"{train_info['last_loss']:.2f} at step {steps[-1]}; held-out loss {train_info['held_out_loss']:.3f} "
        f"({EVAL_BATCHES} held-out batches).",
        "Each row commits the whole series into its own store with `tailor commit` (one process per save, "
        "start-up included, each save in the page cache first); the series is committed "
        f"{1 + len(rows['full'].get('timing_runs', []))} times per row, and a ratio of commit times is the median "
        "over saves 2 to N (the first commit stores everything) of each save's median over those runs; "
        "'in process' is the commit's own time as the Python API inside training pays it. "
        "Ratio: raw bytes of the series over the "
        f"store's bytes on disk. Quality: check out step {steps[-1]}, resume under DeepSpeed, train {k} more "
        f"steps, held-out loss; the exact save's own resume gives {exact:.4f}. A row whose step {steps[-1]} "
        "checks out byte-identical to the save resumes exactly as it does, so its loss is the exact one.",
        "",
        "| row | layers stored per save (median) | bytes written per save / full | stored | raw / stored "
        "| commit, whole series | commit / full, whole process | commit / full, in process "
        f"| step {steps[-1]} byte-identical | held-out after {k} steps | difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        ratio = raw / row["store_bytes"]
        if "commit_seconds" in row:
            secs = f"{sum(row['commit_seconds']):.1f} s"
            rel = f"{per_save(row, 'commit_seconds') / full_median:.2f}"
            rel += f" | {per_save(row, 'inprocess_seconds') / full_inside:.2f}"
            layers = f"{statistics.median(row['stored_layers'][1:]):g} of {row['stored_layers'][0]}"
            layers += f" | {statistics.median(row['new_bytes'][1:]) / full_written:.2f}"
        else:
            secs, rel, layers = f"gc {row['gc_seconds']:.1f} s", "- | -", "- | -"
        diff = (row["held_out"] - exact) / exact
        lines.append(
            f"| {row['label']} | {layers} | {_gb(row['store_bytes'])} | {ratio:.2f}x | {secs} | {rel} | "
            f"{'yes' if row['last_step_exact'] else 'no'} | {row['held_out']:.4f} | {diff:+.2%} |"
        )
    # What a longer series would give, from the sizes measured here (arithmetic, not a measurement)
    n = len(steps)
    raw_step, whole = raw / n, rows["full"]["store_bytes"] / n
    thinned = (rows["thin-weights"]["store_bytes"] - 3 * whole) / (n - 3)
    crossover = 24 * (whole - thinned) / (raw_step - 8 * thinned) if raw_step > 8 * thinned else float("inf")
    lines += [
        "",
        f"Thinning, per step: a whole step takes {whole / 1e6:,.0f} MB of the store on average, a step thinned to "
        f"weights {thinned / 1e6:,.0f} MB, a raw save {raw_step / 1e6:,.0f} MB. With the last 3 whole, a series "
        f"of N saves is N x {raw_step / 1e6:,.0f} / ((N - 3) x {thinned / 1e6:,.0f} + 3 x {whole / 1e6:,.0f}) "
        f"smaller: it tends to {raw_step / thinned:.1f}x and passes 8x from N = {crossover:.0f} saves (arithmetic "
        "on the sizes measured here, not a measurement).",
    ]
    long = results.get("long")
    if long:
        lines += [
            "",
            f"Thinned as it trains: the same model trained {long['steps']} steps with a save every {long['every']} "
            f"({long['saves']} saves, {_gb(long['raw_bytes'])} raw); rank 0 commits each save and deletes it, the "
            "run carries `tailor run retention --keep-last 3 --thin weights`, and `tailor gc` ran every minute "
            f"meanwhile ({long['gc_runs']} runs, the last after training). The store ends at "
            f"{_gb(long['store_bytes'])}: {long['raw_bytes'] / long['store_bytes']:.2f}x smaller than the raw saves, "
            f"{long['thinned']} steps thinned to weights and steps {long['whole']} whole (`tailor verify` passes); "
            f"store and save folder together peaked at {_gb(long['peak_bytes'])} as sampled before each gc.",
        ]
    sma = results["sma"]
    at_last = results["exact"]["at_last"]
    lines += [
        "",
        f"SMA of the last {sma['k']} saves (steps {sma['steps'][0]}-{sma['steps'][-1]}, `tailor merge`, moments "
        f"from step {steps[-1]}): held-out loss {sma['at_last']:.4f} against {at_last:.4f} for step {steps[-1]} "
        f"alone ({(sma['at_last'] - at_last) / at_last:+.2%}); after {k} more steps from each, "
        f"{sma['after_resume']:.4f} against {exact:.4f} ({(sma['after_resume'] - exact) / exact:+.2%}).",
        "",
        "Targets:",
    ]
    lossy = [(key, r) for key, r in rows.items() if "commit_seconds" in r]
    within = max(
        ((raw / r["store_bytes"], key) for key, r in lossy if abs(r["held_out"] - exact) / exact <= 0.01),
        default=(0.0, "none"),
    )
    not_worse = max(
        ((raw / r["store_bytes"], key) for key, r in lossy if (r["held_out"] - exact) / exact <= 0.01),
        default=(0.0, "none"),
    )
    thin = raw / rows["thin-weights"]["store_bytes"]
    long_ratio = long["raw_bytes"] / long["store_bytes"] if long else 0.0
    parity = per_save(rows["parity"], "commit_seconds") / full_median
    parity_inside = per_save(rows["parity"], "inprocess_seconds") / full_inside
    lines += [
        f"- at least 6x smaller with the held-out loss within 1% of the exact one: best {within[0]:.2f}x "
        f"({within[1]}): {'met' if within[0] >= 6 else 'not met'}; with the loss at most 1% above it (lower "
        f"is better): best {not_worse[0]:.2f}x ({not_worse[1]}): {'met' if not_worse[0] >= 6 else 'not met'};",
        f"- thinned to weights, last 3 resumable, at least 8x: {thin:.2f}x over the 15 saves, "
        + (f"{long_ratio:.2f}x over the {long['saves']} saves thinned as they came: " if long else "")
        + f"{'met' if max(thin, long_ratio) >= 8 else 'not met'};",
        f"- parity commit at most 0.5x of full: {parity:.2f}x for the whole process, {parity_inside:.2f}x in "
        f"process: {'met' if max(parity, parity_inside) <= 0.5 else 'not met'}.",
        "<!-- headline:end -->",
    ]
    return "\n".join(lines)


def long_series(work: Path, steps: int, every: int, gc_every: float) -> dict:
    """A longer series thinned as it trains: rank 0 commits every save into a store whose run carries
    ``--keep-last 3 --thin weights`` and deletes the save; ``tailor gc`` runs every ``gc_every``
    seconds meanwhile and once at the end, as a cron job or a sidecar would. The raw saves of such a
    series would not fit on this disk at once; the store records each one's raw bytes."""
    out = work / "long"
    if (out / "result.json").exists():
        return json.loads((out / "result.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    store = out / "store"
    measured([*TAILOR, "init", str(store)])
    measured([*TAILOR, "run", "retention", "--keep-last", "3", "--thin", "weights", "--store", str(store)])
    failed: list[BaseException] = []

    def training() -> None:
        try:
            train_tiny(
                out / "save",
                losses_out=out / "losses.json",
                steps=steps,
                save_every=every,
                commit_to=store,
                delete_after_commit=True,
                timeout=6 * 3600,
                **MODEL,
            )
        except BaseException as exc:  # reported by the main thread
            failed.append(exc)

    began = time.perf_counter()
    trainer = threading.Thread(target=training)
    trainer.start()
    gc_runs, peak = 0, 0
    while trainer.is_alive():
        trainer.join(gc_every)
        peak = max(peak, dir_bytes(store) + dir_bytes(out / "save"))
        measured([*TAILOR, "gc", "--store", str(store), "--json"])
        gc_runs += 1
    if failed:
        raise failed[0]
    seconds = time.perf_counter() - began
    measured([*TAILOR, "gc", "--store", str(store), "--json"])
    measured([*TAILOR, "verify", "--store", str(store)])  # exits non-zero (and raises) on any damage
    with Store.open(store) as st:
        log = st.log()
    result = {
        "saves": len(log),
        "steps": steps,
        "every": every,
        "raw_bytes": sum(x.raw_bytes for x in log),
        "store_bytes": dir_bytes(store),
        "peak_bytes": peak,
        "whole": [x.step for x in log if x.tier is None],
        "thinned": sum(x.tier == "weights" for x in log),
        "gc_runs": gc_runs + 1,
        "seconds": seconds,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(store)
    return result


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def budget_pairs(text: str) -> list[tuple[float, int]]:
    return [(float(f), int(age)) for f, age in (pair.split(":") for pair in text.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".bench/headline")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--resume-steps", type=int, default=30, help="steps trained after each resume (K)")
    parser.add_argument("--thresholds", type=floats, default=[0.15, 0.3], help="adaptive rows")
    parser.add_argument("--budgets", type=budget_pairs, default=[(0.3, 4), (0.2, 8)], help="FRACTION:MAX_AGE,...")
    parser.add_argument("--sma", type=int, default=5, help="average the last k saves")
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--long-steps", type=int, default=350, help="the series thinned as it trains (0: skip)")
    parser.add_argument("--long-every", type=int, default=5)
    parser.add_argument("--gc-every", type=float, default=60.0, help="seconds between gc runs during that training")
    parser.add_argument("--retime", action="store_true", help="commit every policy row's series again, for times")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    info = train(work, args.steps, args.every)
    print(json.dumps(info), flush=True)
    if args.train_only:
        return
    results = measure(work, info, args)
    if args.long_steps:
        results["long"] = long_series(work, args.long_steps, args.long_every, args.gc_every)
        save_results(work, results)
    command = "python -m benchmarks.headline " + " ".join(
        [
            f"--steps {args.steps} --every {args.every} --resume-steps {args.resume_steps}",
            f"--thresholds {','.join(f'{t:g}' for t in args.thresholds)}",
            f"--budgets {','.join(f'{f:g}:{age}' for f, age in args.budgets)} --sma {args.sma}",
            f"--long-steps {args.long_steps} --long-every {args.long_every} --gc-every {args.gc_every:g}",
        ]
    )
    block = render(results, command)
    write_section(DOC, block)
    print(block)


if __name__ == "__main__":
    main()
