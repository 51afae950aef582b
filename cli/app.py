"""``tailor``: a thin typer shell over tailorstore's public API (``tailorstore.Store``).

Each command parses its options, calls one method of the API and prints the result. The
API is loaded when a command runs, not for ``--help``: ``import tailorstore`` stays light.
Errors
of our own become a one-line message on stderr and the exit code the error class names
(2 bad input, 3 damaged store, 4 lock timeout); nothing else is decided here.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import typer
from tailorstore.cli.naming import EXIT_CODES, as_command

import tailorstore
from tailorstore import LOCK_TIMEOUT, STORE_ENV, TailorError, __version__, for_terminal
from tailorstore.core.sizes import human

try:  # the click that typer runs: its own copy from typer 0.20 on, the click package before
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - an older typer
    from click import exceptions as click_errors

if TYPE_CHECKING:
    from tailorstore import GcPlan

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: rich's renderer is slow to load (docs/PERFORMANCE.md)
    help="A content-addressed, layer-wise store for LLM training checkpoints (DeepSpeed, FSDP/DCP, Hugging Face).",
)

ArchiveLevelsOpt = typer.Option(
    None,
    "--archive-levels",
    help="With --thin archive: grid steps from 0 to each group's largest weight (default 31: within 1/62 of it).",
)
KeyframeEveryOpt = typer.Option(
    None, "--keyframe-every", help="With --thin archive: a full keyframe at least every N archived steps (default 16)."
)
KeepBestOpt = typer.Option(
    None,
    "--keep-best",
    help="METRIC:min|max:K keeps each run's K best steps by a metric recorded at commit (eval_loss:min:3); "
    "a step without it is never among the best, and of equal values the later step ranks first.",
)
StoreOpt = typer.Option(
    None, "--store", envvar=STORE_ENV, help=f"The store: a directory or s3://bucket/prefix (or ${STORE_ENV})."
)
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary line.")
JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON.")
TrustOpt = typer.Option(False, "--trust-pickles", help="Load pickles with globals outside the allowlist (unsafe).")
LockOpt = typer.Option(LOCK_TIMEOUT, "--lock-timeout", help="Seconds to wait for the store lock.")
RunOpt = typer.Option(None, "--run", help="The run whose steps step=N and latest name (default: main).")
SELECTOR_HELP = "step=N, RUN:step=N, tag=NAME, id=HEX or digest=HEX (as `tailor log` prints them) or latest."


def _open(store: str | None, run: str | None = None) -> tailorstore.Store:
    """The store named by --store (or $TAILOR_STORE), reading step=N and latest in ``run``."""
    tailorstore.reuse_freed_memory()  # a command that opens a store may move gigabytes
    return tailorstore.Store.open(store, run=run or tailorstore.MAIN_RUN)


def _asdict(record: Any) -> dict:
    from dataclasses import asdict  # only for --json output

    return asdict(record)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tailorstore {__version__} (store format {tailorstore.FORMAT_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Commit training checkpoints (DeepSpeed, DCP, HF) into a store, check them out bit-exact, tailor them by layer."""
    _quiet_but_ours()


@app.command()
def init(path: str = typer.Argument(..., help="Directory for the new store, or s3://bucket/prefix.")) -> None:
    """Create an empty store: an SQLite index plus a blob area."""
    tailorstore.Store.init(path).close()
    typer.echo(f"initialized an empty tailorstore in {path}")


@app.command()
def commit(
    ckpt_dir: Path | None = typer.Argument(
        None,
        help="A DeepSpeed save dir or global_stepN/, a DCP folder, an HF checkpoint-N/, or torch/safetensors files.",
    ),
    step: int | None = typer.Option(None, "--step", help="Step number (default: read from the layout)."),
    tag: str | None = typer.Option(None, "--tag", help="A name for this step."),
    force: bool = typer.Option(False, "--force", help="Replace a step that is already in the store."),
    level: int = typer.Option(1, "--level", help="zstd level (1 is best per second here)."),
    policy: str = typer.Option(
        "full", "--policy", help="Which layers to store: full, parity, filter, adaptive, budget."
    ),
    keep_first: int | None = typer.Option(
        None, "--keep-first", help="filter: blocks stored on every commit, from the start (0)."
    ),
    keep_last: int | None = typer.Option(
        None, "--keep-last", help="filter: blocks stored on every commit, from the end (0)."
    ),
    every: int | None = typer.Option(None, "--every", help="filter: store the other blocks on every E-th commit (1)."),
    threshold: float | None = typer.Option(
        None, "--threshold", help="adaptive: store a block that moved this much (0)."
    ),
    fraction: float | None = typer.Option(
        None, "--fraction", help="budget: the share of the checkpoint's bytes one commit may store (0.25)."
    ),
    max_age: int | None = typer.Option(
        None, "--max-age", help="budget: store a block left unstored for this many commits (8)."
    ),
    part: bool = typer.Option(False, "--part", help="Commit only this host's files, as one part of the step."),
    run: str = typer.Option("main", "--run", help="The run this step belongs to; steps are numbered per run."),
    metric: list[str] = typer.Option(
        [], "--metric", help="NAME=VALUE recorded with the step (repeatable): eval_loss=2.31. gc --keep-best reads it."
    ),
    finalize: str | None = typer.Option(
        None, "--finalize", help="step=N: record the step whose parts every host has committed."
    ),
    trust_pickles: bool = TrustOpt,
    store: str | None = StoreOpt,
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Store one checkpoint: every tensor piece once, under its hash."""
    if finalize is not None:
        if ckpt_dir is not None or part:
            raise TailorError("--finalize takes no directory and no --part: run it once every host committed its part.")
        _finalize(finalize, tag, force, run, store, quiet, as_json, lock_timeout, _metrics(metric))
        return
    if ckpt_dir is None:
        raise TailorError("name the checkpoint directory to commit (or pass --finalize step=N).")
    given = {
        "keep_first": keep_first,
        "keep_last": keep_last,
        "every": every,
        "threshold": threshold,
        "fraction": fraction,
        "max_age": max_age,
    }
    params = {k: v for k, v in given.items() if v is not None}  # the library refuses those of another policy
    with _open(store, run) as st:
        result = st.commit(
            ckpt_dir,
            step=step,
            tag=tag,
            policy=policy,
            force=force,
            level=level,
            trust_pickles=trust_pickles,
            lock_timeout=lock_timeout,
            part=part,
            progress=for_terminal(quiet or as_json),
            metrics=_metrics(metric),
            **params,
        )
    _say_committed(result, run, quiet, as_json)


def _say_committed(result: Any, run: str, quiet: bool, as_json: bool) -> None:
    """What `commit` prints: its result as JSON, a part's next step, or the step's layers."""
    if as_json:
        typer.echo(json.dumps(_asdict(result)))
    elif not quiet and result.part:
        typer.echo(
            f"committed a part of step {result.step}: {result.files} files, {human(result.raw_bytes)} raw, "
            f"{human(result.new_bytes)} newly stored ({result.seconds:.2f} s); once every host has committed its "
            f"part, run `tailor finalize step={result.step}{'' if run == 'main' else f' --run {run}'}`"
        )
    elif not quiet:
        typer.echo(
            f"committed step {result.step}: {result.files} files, {result.atoms} atoms, {human(result.raw_bytes)} "
            f"raw, {human(result.new_bytes)} newly stored in {result.new_blobs} blobs ({result.seconds:.2f} s)"
        )
        typer.echo(f"  stored layers: {', '.join(result.stored_layers)}")
        if result.inherited_layers:
            typer.echo(
                "  inherited layers: " + ", ".join(f"{k} (step {v})" for k, v in result.inherited_layers.items())
            )
        if result.changes:
            typer.echo("  change since last stored: " + ", ".join(f"{k} {v:.2e}" for k, v in result.changes.items()))


def _report_written(result: Any, as_json: bool, quiet: bool, line: str) -> None:
    """What a command that wrote a directory prints: its result as JSON, or one line unless quiet."""
    if as_json:
        typer.echo(json.dumps({**_asdict(result), "out": str(result.out)}))
    elif not quiet:
        typer.echo(line)


def _metrics(assignments: list[str]) -> dict[str, float] | None:
    """``--metric NAME=VALUE`` options as a mapping (the library checks names and values again)."""
    from tailorstore.core.metric_values import parse_assignment

    return dict(parse_assignment(a) for a in assignments) or None


def _finalize(
    selector: str, tag: str | None, force: bool, run: str | None, store: str | None, quiet: bool, as_json: bool,
    lock_timeout: float, metrics: dict[str, float] | None = None,
) -> None:  # fmt: skip
    match = re.fullmatch(r"(?:step=)?(\d+)", selector.strip())
    if match is None:
        raise TailorError(f"{selector!r} names no step to finalize: write step=N.")
    with _open(store, run) as st:
        waits = for_terminal(quiet=True)  # no bar: only what it waits for
        done = st.finalize(
            int(match.group(1)), tag=tag, force=force, lock_timeout=lock_timeout, metrics=metrics, progress=waits
        )
    if as_json:
        typer.echo(json.dumps(_asdict(done)))
    elif not quiet:
        typer.echo(
            f"finalized step {done.step} from {done.parts} parts: {done.files} files, {done.atoms} atoms, "
            f"{human(done.raw_bytes)} raw ({done.seconds:.2f} s)"
        )


@app.command()
def finalize(
    selector: str = typer.Argument(..., help="step=N: the step whose parts every host has committed."),
    tag: str | None = typer.Option(None, "--tag", help="A name for this step."),
    force: bool = typer.Option(False, "--force", help="Record it even where its model differs from the newest step's."),
    run: str | None = RunOpt,
    store: str | None = StoreOpt,
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Record a step from the parts several hosts committed (`commit --part`), once all are in."""
    _finalize(selector, tag, force, run, store, quiet, as_json, lock_timeout)


@app.command()
def checkout(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    out: Path = typer.Option(..., "--out", help="Directory to write; must not exist or be empty."),
    run: str | None = RunOpt,
    trust_pickles: bool = TrustOpt,
    layout: str = typer.Option(
        "native", "--format", help="native (as saved) or universal (DeepSpeed's, loadable at any world size)."
    ),
    world_size: int | None = typer.Option(
        None, "--world-size", help="Write the ZeRO layout for this many data-parallel ranks (ZeRO 1-3)."
    ),
    zero_stage: int | None = typer.Option(None, "--zero-stage", help="Write it for this ZeRO stage (1 or 2)."),
    store: str | None = StoreOpt,
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write a step back in its native layout, checking every blob's hash."""
    if layout == "universal" and (world_size is not None or zero_stage is not None):
        raise tailorstore.StoreError("--format universal loads at any world size and stage; drop --world-size.")
    if layout == "universal":
        with _open(store, run) as st:
            universal = st.checkout_universal(selector, out, progress=for_terminal(quiet or as_json))
        said = (
            f"wrote step {universal.step} as a universal checkpoint into {universal.out}: "
            f"{universal.params} parameters, {universal.files} files, {human(universal.bytes_written)}"
        )
        _report_written(universal, as_json, quiet, said)
        return
    if world_size is not None or zero_stage is not None:
        with _open(store, run) as st:
            done = st.checkout(
                selector, out, world_size=world_size, zero_stage=zero_stage, progress=for_terminal(quiet or as_json)
            )
        said = f"checked out step {done.step} for {done.world_size} ranks (ZeRO-{done.zero_stage}) into {done.out}: "
        _report_written(done, as_json, quiet, f"{said}{done.files} files, {human(done.bytes_written)}")
        return
    with _open(store, run) as st:
        result = st.checkout(
            selector,
            out,
            format=layout,  # an unknown one is refused there
            trust_pickles=trust_pickles,
            progress=for_terminal(quiet or as_json),
        )
    _report_written(
        result,
        as_json,
        quiet,
        f"checked out step {result.step} into {result.out}: {result.files} files, {human(result.bytes_written)}",
    )


@app.command()
def export(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    out: Path = typer.Option(..., "--out", help="Directory to write; must not exist or be empty."),
    dtype: str = typer.Option(
        "bf16", "--dtype", help="bf16, fp16 or fp32: the weights (the FP32 masters where held) rounded to this."
    ),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="Split model.safetensors above this size (5GB, 500MB, 2GiB)."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="A model's config.json to add (a plain DeepSpeed save holds none)."
    ),
    run: str | None = RunOpt,
    store: str | None = StoreOpt,
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write a step as a Hugging Face model folder (model.safetensors from its masters, else its weights)."""
    with _open(store, run) as st:
        result = st.export(
            selector,
            out,
            dtype=dtype,
            max_shard_size=max_shard_size,
            config=config,
            progress=for_terminal(quiet or as_json),
        )
    _report_written(
        result,
        as_json,
        quiet,
        f"exported step {result.step} into {result.out}: {result.tensors} tensors in {len(result.shards)} "
        f"file(s), {human(result.bytes_written)} ({result.dtype})"
        + (f"; copied {', '.join(result.copied)}" if result.copied else ""),
    )


def _when(ts: float) -> str:
    import datetime  # only where a time is printed: start-up imports what --help prints (tests/system/test_startup.py)

    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def log(run: str | None = typer.Option(None, "--run", help="Only this run's steps."), store: str | None = StoreOpt,
        as_json: bool = JsonOpt) -> None:  # fmt: skip
    """One line per step: id, content digest, step, time, tag, bytes held, bytes newly stored, exact or composite."""
    with _open(store, run) as st:
        steps = st.log(run=run)
        runs = st.runs()
    base = next((r.base for r in runs if r.name == run), None)
    several = len(runs) > 1
    if as_json:
        typer.echo(json.dumps([_step_json(s) for s in steps], indent=2))
        return
    if base is not None:
        typer.echo(f"run {run} branched from run {base.run} step {base.step} (id={base.id})")
    column = f"{'run':10}  " if several else ""
    typer.echo(
        f"{'id':13}  {'digest':{DIGEST_COLUMN}}  {column}{'step':>8}  {'committed':19}  {'tag':12}  {'raw':>10}  "
        f"{'new':>10}  kind"
    )
    for s in steps:
        kind = "merge" if s.origin == "merge" else "exact" if s.exact else "composite"
        kind += f", thinned to {s.tier} (saved as {human(s.raw_bytes)})" if s.tier else ""
        held = s.raw_bytes if s.held_bytes is None else s.held_bytes
        typer.echo(
            f"{'id=' + s.id:13}  {s.digest[:DIGEST_COLUMN]:{DIGEST_COLUMN}}  "
            f"{f'{s.run:10}  ' if several else ''}{s.step:>8}  {_when(s.created_at)}  "
            f"{(', '.join(s.tags) or '-'):12}  {human(held):>10}  {human(s.new_bytes):>10}  {kind}"
            f"{'  pinned' if s.pinned else ''}{_metric_text(s.metrics)}"
        )


DIGEST_COLUMN = 12  # the leading hex digits of each step's digest that `log` prints (`show` prints all)


def _step_json(summary: Any) -> dict:
    """A step as --json prints it: the index's own row number left out (another host's index numbers
    the same manifest otherwise); ``id`` and ``digest`` name it on every host."""
    doc = _asdict(summary)
    doc.pop("manifest", None)
    return doc


def _metric_text(metrics: dict[str, float | None]) -> str:
    """``  eval_loss=2.31 accuracy=0.5`` (a NaN recorded as nan), or nothing."""
    return "".join(f"  {k}={'nan' if v is None else f'{v:.6g}'}" for k, v in sorted(metrics.items()))


def _what(exact: bool, policy: dict[str, Any]) -> str:
    """exact, composite, or which average a manifest is."""
    spec = policy.get("spec") if policy.get("name") == "average" else None
    if isinstance(spec, dict):
        steps = spec.get("steps")
        listed = ", ".join(map(str, steps)) if isinstance(steps, list) else json.dumps(steps)
        return f"{spec.get('method')} average of steps {listed}"
    return "exact" if exact else "composite"


@app.command()
def show(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    run: str | None = RunOpt,
    store: str | None = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Per layer: the source step, the kinds, the raw bytes and the stored bytes."""
    with _open(store, run) as st:
        detail = st.show(selector)
    if as_json:
        typer.echo(json.dumps({**_asdict(detail), "summary": _step_json(detail.summary)}, indent=2))
        return
    s = detail.summary
    tags = f" (tag {', '.join(s.tags)})" if s.tags else ""
    typer.echo(
        f"{'' if s.run == 'main' else f'run {s.run} '}step {s.step}{tags}: "
        f"{_what(s.exact, s.policy)}, "
        f"{f'thinned to {s.tier} (exports and averages; does not resume), ' if s.tier else ''}"
        f"committed {_when(s.created_at)}, {human(s.raw_bytes)} raw, policy {s.policy.get('name')}"
    )
    typer.echo(f"id={s.id}  digest={s.digest}")
    if s.metrics:
        typer.echo("metrics:" + _metric_text(s.metrics))
    typer.echo(f"{'layer':14}  {'source':>7}  {'raw':>10}  {'stored':>10}  {'derived':>10}  kinds")
    for layer in detail.layers:
        typer.echo(
            f"{layer.layer:14}  {layer.source_step:>7}  {human(layer.raw_bytes):>10}  "
            f"{human(layer.stored_bytes):>10}  {human(layer.derived_bytes):>10}  {','.join(layer.kinds)}"
        )
    typer.echo(f"derived weights saved {human(detail.derived_bytes)} (rebuilt from the FP32 master at checkout)")


@app.command("ls")
def ls(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    run: str | None = RunOpt,
    store: str | None = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """A step's files and their sizes, as a checkout would write them, without writing anything."""
    with _open(store, run) as st:
        listed = st.files(selector)
    if as_json:
        typer.echo(json.dumps({**_asdict(listed), "summary": _step_json(listed.summary)}, indent=2))
        return
    s = listed.summary
    thinned = s.tier is not None
    typer.echo(
        f"{'' if s.run == 'main' else f'run {s.run} '}step {s.step} (id={s.id}): {len(listed.files)} file(s), "
        f"{human(sum(f.size for f in listed.files))}"
        + (f"; thinned to {s.tier}: it holds {human(sum(f.held for f in listed.files))} of them" if thinned else "")
    )
    for f in listed.files:
        held = f"  {human(f.held):>10} held" if thinned else ""
        typer.echo(f"{human(f.size):>10}{held}  {f.kind:11}  {f.mode:04o}  {f.path}")


@app.command()
def merge(
    spec: Path = typer.Argument(
        ...,
        help="YAML spec: base and slices of layer ranges (a composite), or method: sma|ema|wma and steps (an average).",
    ),
    tag: str = typer.Option(..., "--tag", help="Name of the composite; check it out as tag=NAME."),
    run: str = typer.Option("main", "--run", help="The run whose steps the spec's {step: N} name."),
    store: str | None = StoreOpt,
    as_json: bool = JsonOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Compose a checkpoint from layers of different steps (no blob written), or average several steps' masters."""
    with _open(store, run) as st:
        result = st.merge(spec, tag=tag, lock_timeout=lock_timeout)
    if as_json:
        typer.echo(json.dumps(_asdict(result)))
        return
    ms = result.seconds * 1000
    if isinstance(result, tailorstore.AverageResult):
        weights = ", ".join(f"step {s}: {c:.4g}" for s, c in result.coefficients.items())
        typer.echo(
            f"averaged ({result.method}) into tag {result.tag} (id={result.id}) on base step {result.step} "
            f"in {ms:.1f} ms: {weights}"
        )
        typer.echo(
            f"  {len(result.layers)} layers ({', '.join(result.layers)}), kinds {', '.join(result.kinds)}; "
            f"{result.new_blobs} new blobs, {human(result.new_bytes)}"
        )
        return
    typer.echo(f"merged tag {result.tag} (id={result.id}) on base step {result.step} in {ms:.1f} ms:")

    def source(layer: str, step: int) -> str:
        named = result.named.get(layer)
        return f"{layer} <- step {step}" + (f" (named {named})" if named and named != f"step={step}" else "")

    typer.echo("  " + ", ".join(source(layer, s) for layer, s in result.sources.items()))


@app.command()
def diff(
    a: str = typer.Argument(..., help=SELECTOR_HELP),
    b: str = typer.Argument(..., help=SELECTOR_HELP),
    run: str | None = RunOpt,
    store: str | None = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Per layer, the relative change ||w_B - w_A|| / ||w_A|| of the FP32 master and of the weight."""
    with _open(store, run) as st:
        step_a, step_b, rows = st.diff(a, b)
    if as_json:
        typer.echo(json.dumps({"a": step_a, "b": step_b, "layers": [_asdict(r) for r in rows]}))
        return

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3e}"

    def named(selector: str, step: int) -> str:
        """A merge carries its base's step: it is named as the user named it, not as that step; a
        step of another run than --run's with its run."""
        given_run, _, text = selector.strip().rpartition(":")
        in_run = f"run {given_run} " if given_run and given_run != (run or "main") else ""
        return f"{in_run}step {step}" if text.removeprefix("step=").isdigit() else f"{selector} (on step {step})"

    typer.echo(f"relative change from {named(a, step_a)} to {named(b, step_b)}")
    typer.echo(f"{'layer':14}  {'fp32 master':>12}  {'weight':>12}")
    for r in rows:
        typer.echo(f"{r.layer:14}  {fmt(r.master):>12}  {fmt(r.weight):>12}")


@app.command()
def plot(
    out: Path = typer.Option(..., "--out", help="PNG file to write."),
    run: str = typer.Option("main", "--run", help="The run whose steps to plot."),
    store: str | None = StoreOpt,
) -> None:
    """A heatmap of per-layer relative change (layers by committed steps)."""
    with _open(store, run) as st:
        st.plot(out)
    typer.echo(f"wrote {out}")


@app.command()
def report(
    out: Path = typer.Option(Path("report.html"), "--out", help="HTML file to write (default: report.html here)."),
    store: str | None = StoreOpt,
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One offline HTML page of the store's history: metrics, bytes, lineage, layers and every step."""
    with _open(store) as st:
        result = st.report(out)
    said = (
        f"wrote {result.out}: {result.steps} step(s) of {result.runs} run(s), {human(result.bytes_written)}, "
        f"opens offline ({result.seconds:.1f} s)"
    )
    _report_written(result, as_json, quiet, said)


@app.command("tag")
def tag_cmd(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    name: str = typer.Argument(..., help="The tag; gc never drops a tagged step."),
    force: bool = typer.Option(False, "--force", help="Move the tag if another step has it."),
    store: str | None = StoreOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Name a step. Tagged steps are kept by every gc; a step holds any number of tags."""
    with _open(store) as st:
        st.tag(selector, name, force=force, lock_timeout=lock_timeout)
    typer.echo(f"tagged {selector} as {name}")


@app.command()
def untag(name: str = typer.Argument(..., help="The tag to remove."), store: str | None = StoreOpt,
          lock_timeout: float = LockOpt) -> None:  # fmt: skip
    """Remove a tag. The manifest stays; gc may drop it unless it is pinned."""
    with _open(store) as st:
        st.untag(name, lock_timeout=lock_timeout)
    typer.echo(f"removed tag {name} (the manifest stays)")


@app.command()
def pin(selector: str = typer.Argument(..., help=SELECTOR_HELP), store: str | None = StoreOpt,
        lock_timeout: float = LockOpt) -> None:  # fmt: skip
    """Protect a step from gc."""
    with _open(store) as st:
        st.pin(selector, True, lock_timeout=lock_timeout)
    typer.echo(f"pinned {selector}")


@app.command()
def unpin(selector: str = typer.Argument(..., help=SELECTOR_HELP), store: str | None = StoreOpt,
          lock_timeout: float = LockOpt) -> None:  # fmt: skip
    """Let gc drop a step again."""
    with _open(store) as st:
        st.unpin(selector, lock_timeout=lock_timeout)
    typer.echo(f"unpinned {selector}")


@app.command()
def metric(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    assignments: list[str] = typer.Argument(..., help="NAME=VALUE, one or more (eval_loss=2.31)."),
    store: str | None = StoreOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Record metrics with a committed step (an evaluation that ended after the save); a name it has
    already takes the new value. gc --keep-best ranks steps by them."""
    given = _metrics(assignments) or {}
    with _open(store) as st:
        st.add_metrics(selector, given, lock_timeout=lock_timeout)
    typer.echo(f"recorded {', '.join(f'{k}={v}' for k, v in given.items())} with {selector}")


@app.command("remove")
def remove(
    selector: str = typer.Argument(..., help=SELECTOR_HELP),
    force: bool = typer.Option(False, "--force", help="Also drop a tagged or pinned step."),
    store: str | None = StoreOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Drop one manifest. Its blobs are freed by the next gc, unless another manifest uses them."""
    with _open(store) as st:
        st.remove(selector, force=force, lock_timeout=lock_timeout)
    typer.echo(f"removed {selector}; run `tailor gc` to free its blobs")


@app.command()
def gc(
    keep_last: int | None = typer.Option(None, "--keep-last", help="Keep the K newest committed steps."),
    keep_every: int | None = typer.Option(None, "--keep-every", help="Keep steps whose number is a multiple of N."),
    keep_best: str | None = KeepBestOpt,
    run: str | None = typer.Option(
        None, "--run", help="Apply the rules to this run only (default: to each run on its own)."
    ),
    thin: str | None = typer.Option(
        None,
        "--thin",
        help="Thin the steps the rules do not keep instead of dropping them: 'weights' keeps the model's weights, "
        "'master' the FP32 master, 'archive' the weights quantized against the previous archived step (lossy, "
        "within 1/62 of each group's largest weight by default). Thinned steps export and average; they do not resume.",
    ),
    archive_levels: int | None = ArchiveLevelsOpt,
    keyframe_every: int | None = KeyframeEveryOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and change nothing."),
    drop_parts: bool = typer.Option(
        False, "--drop-parts", help="Also drop parts no finalize has taken (abandoned multi-host commits)."
    ),
    clear_notices: bool = typer.Option(
        False,
        "--clear-notices",
        help="Delete the deletion notices of gc runs that died (S3); only when no other gc can be running.",
    ),
    store: str | None = StoreOpt,
    as_json: bool = JsonOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Drop (or --thin) steps outside the retention rules, then delete every blob no kept manifest uses."""

    def show_plan(plan: GcPlan) -> None:
        if not as_json:
            typer.echo(("plan (dry run): " if dry_run else "plan: ") + plan.summary())

    with _open(store, run) as st:
        rules = tailorstore.Retention(
            keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, thin=thin, run=run,
            archive_levels=archive_levels, keyframe_every=keyframe_every,
        )  # fmt: skip
        plan = st.gc(
            rules,
            dry_run=dry_run,
            drop_parts=drop_parts,
            lock_timeout=lock_timeout,
            progress=for_terminal(quiet=True),  # no bar: only what it waits for
            show_plan=show_plan,
            clear_notices=clear_notices,
        )
    if as_json:
        typer.echo(json.dumps({**_asdict(plan), "dry_run": dry_run}))
    elif not dry_run:
        typer.echo("done")


@app.command("usage")
def usage(store: str | None = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Where the bytes go: on disk against raw, per kind, per step, and what gc would free."""
    with _open(store) as st:
        u = st.usage()
    if as_json:
        typer.echo(json.dumps(_asdict(u), indent=2))
        return
    typer.echo(
        f"{u.manifests} manifest(s) stand for {human(u.raw_bytes)} of checkpoints"
        + (f" (saved as {human(u.saved_bytes)} before thinning)" if u.saved_bytes != u.raw_bytes else "")
        + f"; the store holds {human(u.stored_bytes)} ({human(u.index_bytes)} of it index): {u.ratio:.2f}x "
        "smaller than the saves"
    )
    typer.echo(f"{'kind':12}  {'raw':>10}  {'stored':>10}  {'derived':>10}")
    for name, k in sorted(u.kinds.items()):
        typer.echo(f"{name:12}  {human(k.raw_bytes):>10}  {human(k.stored_bytes):>10}  {human(k.derived_bytes):>10}")
    typer.echo(f"{'id':13}  {'step':>8}  {'tag':12}  {'raw':>10}  {'held alone':>10}")
    for s in u.steps:
        typer.echo(
            f"{'id=' + s.id:13}  {s.step:>8}  {(s.tag or '-'):12}  {human(s.raw_bytes):>10}  {human(s.held_alone):>10}"
        )
    typer.echo(f"`tailor gc` would free {human(u.gc_frees)} now")


@app.command()
def verify(
    selector: str | None = typer.Argument(None, help=f"{SELECTOR_HELP} (default: every manifest)"),
    deep: bool = typer.Option(False, "--deep", help="Also decode and re-hash every blob."),
    run: str | None = RunOpt,
    store: str | None = StoreOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Check that every manifest's blobs exist and every index row is consistent."""
    with _open(store, run) as st:
        report = st.verify(selector, deep=deep, progress=for_terminal(quiet or as_json))
    if as_json:
        typer.echo(json.dumps(_asdict(report)))
    else:
        for problem in report.problems:
            typer.echo(f"problem: {problem}", err=True)
        for note in report.notes:
            typer.echo(f"note: {note}")
        typer.echo(
            f"checked {report.manifests} manifest(s), {report.blobs_checked} blob(s)"
            f"{f', re-hashed {human(report.bytes_rehashed)}' if deep else ''}: "
            f"{'ok' if report.ok else f'{len(report.problems)} problem(s)'}"
        )
    if not report.ok:
        raise typer.Exit(3)


run_app = typer.Typer(no_args_is_help=True, help="Runs: lines of steps numbered on their own, sharing blobs.")
app.add_typer(run_app, name="run")


@run_app.command("list")
def run_list(store: str | None = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Every run, with the step it branched from, its number of steps and its latest step."""
    with _open(store) as st:
        runs = st.runs()
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {**_asdict(r), "base": None if r.base is None else {"run": r.base.run, "step": r.base.step}}
                    for r in runs
                ]
            )
        )
        return
    typer.echo(f"{'run':16}  {'steps':>6}  {'latest':>8}  branched from")
    for r in runs:
        base = "-" if r.base is None else f"{r.base.run}:step={r.base.step}"
        latest = "-" if r.latest_step is None else str(r.latest_step)
        typer.echo(f"{r.name:16}  {r.steps:>6}  {latest:>8}  {base}")


@run_app.command("create")
def run_create(
    name: str = typer.Argument(..., help="The new run's name: letters, digits, '-', '_' or '.'."),
    base: str | None = typer.Option(None, "--from", help="[RUN:]step=N (or tag=NAME): the step to branch from."),
    store: str | None = StoreOpt,
    lock_timeout: float = LockOpt,
) -> None:
    """Start a run, branched from a step like a git branch: its commits inherit layers from that step."""
    with _open(store) as st:
        info = st.create_run(name, base=base, lock_timeout=lock_timeout)
    where = "" if info.base is None else f" from run {info.base.run} step {info.base.step}"
    typer.echo(f"created run {name}{where}; commit to it with `tailor commit DIR --run {name}`")


@run_app.command("retention")
def run_retention(
    keep_last: int | None = typer.Option(None, "--keep-last", help="Keep the K newest committed steps whole."),
    keep_every: int | None = typer.Option(None, "--keep-every", help="Keep steps whose number is a multiple of N."),
    keep_best: str | None = KeepBestOpt,
    thin: str | None = typer.Option(None, "--thin", help="Thin the other steps to 'weights', 'master' or 'archive'."),
    archive_levels: int | None = ArchiveLevelsOpt,
    keyframe_every: int | None = KeyframeEveryOpt,
    clear: bool = typer.Option(False, "--clear", help="Carry no retention: `tailor gc` then drops nothing here."),
    run: str = typer.Option("main", "--run", help="The run that carries it."),
    store: str | None = StoreOpt,
) -> None:
    """The retention a run carries: `tailor gc` without rules applies it. Without options, print it."""
    with _open(store, run) as st:
        if clear:
            rules = st.set_retention()
        elif any(o is not None for o in (keep_last, keep_every, thin, keep_best, archive_levels, keyframe_every)):
            rules = st.set_retention(
                tailorstore.Retention(
                    keep_last=keep_last, keep_every=keep_every, thin=thin, keep_best=keep_best,
                    archive_levels=archive_levels, keyframe_every=keyframe_every,
                )
            )
        else:
            rules = st.retention()
    if rules is None:
        typer.echo(f"run {run} carries no retention; `tailor gc` without rules drops none of its steps")
        return
    parts = [
        f"keep the last {rules.keep_last}" if rules.keep_last else "",
        f"every {rules.keep_every}th step" if rules.keep_every else "",
        f"the {rules.keep_best.count} best by {rules.keep_best.metric} ({rules.keep_best.mode})"
        if rules.keep_best
        else "",
    ]
    rest = f"thin the rest to {rules.thin}" if rules.thin else "drop the rest"
    if rules.grid is not None:
        rest += f" ({rules.grid.levels} levels, a keyframe every {rules.grid.keyframe_every})"
    typer.echo(f"run {run}: {' and '.join(p for p in parts if p)} whole, {rest} (applied by `tailor gc`)")


index_app = typer.Typer(no_args_is_help=True, help="The store's SQLite index, a cache of its manifest objects.")
app.add_typer(index_app, name="index")


@index_app.command("rebuild")
def index_rebuild(store: str | None = StoreOpt) -> None:
    """Recreate the index from the manifest objects (a lost or damaged index, or a new host's cache)."""
    manifests, blobs = tailorstore.Store.rebuild_index(store)
    typer.echo(f"rebuilt the index: {manifests} manifest(s), {blobs} blob(s)")


# The short names users of git and du know, kept as aliases: one operation, the API's name first.
app.command("rm", hidden=True, help="The same as `remove`.")(remove)
app.command("du", hidden=True, help="The same as `usage`.")(usage)


def main(argv: list[str] | None = None) -> None:
    """Run the app on ``argv`` (the process's arguments unless given); every failure a user can
    cause is one line on stderr and an exit code (raised as ``SystemExit``).

    Our own errors carry their code. What the system raises (a file we cannot read, a name too
    long, a full disk under SQLite, a damaged index) is still the user's situation, not a bug:
    it gets one line too, with 2 for input and 3 for the store's index. Only other exceptions
    are bugs and keep their traceback (exit 1).
    """
    signal.signal(signal.SIGINT, _interrupted)  # typer turns KeyboardInterrupt into a silent exit 130
    # numpy's OpenBLAS starts a thread a core that spins in sched_yield after each use, and the
    # command never multiplies a matrix: one thread took a commit of an 813 MB save from 0.47-0.78
    # to 0.30 system seconds (docs/benchmarks.md). A value the user set is kept. (The library
    # itself changes no environment variable: a training process has its own reasons.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        code = app(args=argv, prog_name="tailor", standalone_mode=False)  # click's errors: said here, one line
        if isinstance(code, int) and code:
            sys.exit(code)
    except click_errors.NoArgsIsHelpError as exc:
        exc.show()  # `tailor` or `tailor run` alone: the help, as asked for
        sys.exit(exc.exit_code)
    except click_errors.UsageError as exc:
        sys.exit(_usage_error(exc))
    except click_errors.ClickException as exc:
        typer.echo(f"error: {_one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:  # click's name for a Ctrl-C it caught itself
        _say_interrupted()
        sys.exit(130)
    except TailorError as exc:
        typer.echo(f"error: {exc.render(as_command)}", err=True)
        sys.exit(EXIT_CODES[exc.category])
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # the reader went away (`tailor log | head`): nothing more to say
            sys.exit(1)
        where = f"{exc.filename}: " if exc.filename else ""
        first = (exc.strerror or str(exc) or type(exc).__name__).strip().splitlines()[0]  # one line, never a debug dump
        typer.echo(f"error: {where}{first}; the command was not carried out.", err=True)
        sys.exit(2)
    except RecursionError:
        typer.echo("error: the input nests too deeply to be read; the command was not carried out.", err=True)
        sys.exit(2)
    except (KeyboardInterrupt, Interrupted):
        _say_interrupted()
        sys.exit(130)


def _say_interrupted() -> None:
    typer.echo(
        "interrupted: what this command had not finished is not in the store (a commit is recorded at its end; "
        "what an interrupted commit or gc wrote, the next gc removes)",
        err=True,
    )


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _usage_error(exc: click_errors.UsageError) -> int:
    """A command line click cannot parse (a missing option, an unknown one, a bad value): one line
    naming the command's help, and exit 2, where click printed the usage, a hint and the error."""
    where = exc.ctx.command_path if exc.ctx is not None else "tailor"
    typer.echo(f"error: {_one_line(exc.format_message())} (see `{where} --help`)", err=True)
    return 2


def _quiet_but_ours() -> None:
    """This process's logging: other libraries say nothing (DeepSpeed warns about a missing GPU when it
    is imported), and tailorstore's own warnings (a key in the store it ignores, a save it moved) are
    one line each on stderr. Set up when a command runs (the root callback), not for --help."""
    root = logging.getLogger()
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())  # nothing reaches logging's last-resort printer
    logging.getLogger("DeepSpeed").disabled = True
    ours = logging.getLogger("tailorstore")
    if not any(isinstance(h, _ToStderr) for h in ours.handlers):  # once, however many commands a process runs
        handler = _ToStderr()
        handler.setFormatter(logging.Formatter("warning: %(message)s"))
        ours.addHandler(handler)
    ours.setLevel(logging.WARNING)
    ours.propagate = False


class _ToStderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is when a record comes, not the stream
    of the moment it was made (a test runs many commands in one process, each with its own)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


class Interrupted(Exception):
    """Ctrl-C, raised as our own so that the command line can say what it means."""


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted()


def run() -> NoReturn:
    """The ``tailor`` command: :func:`main`, then leave at once, without the interpreter's
    teardown (freeing every object and module, joining idle pool threads). A command has closed
    its store, fsynced what it wrote and joined its own threads by the time it returns, so that
    teardown does nothing a user needs, and it cost a tenth of a short command's time
    (docs/PERFORMANCE.md, "Start-up: importing on first use"). :func:`main` itself ends with
    SystemExit as usual, for callers that go on after it."""
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)  # as SystemExit prints a message it was given
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that closed the pipe: nothing more can reach it
            code = code or 1
    os._exit(code)


if __name__ == "__main__":
    run()
