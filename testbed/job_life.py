"""A seeded simulation of a training job's life around the store: saves, kills, restarts.

The store's own simulation (testbed/simulation.py) searches the protocol between hosts. What a
training job does around it (stage a save, return to training, commit in the background, be
killed anywhere, restart at another world size and recover what the dead run left) is a
sequence across ranks and processes that no single test walks. Here each seed draws one
schedule:

- a tiny real DeepSpeed training through ``attach`` (ZeRO-2 or ZeRO-3, 1 or 2 gloo ranks),
  saving every 2 steps (testbed/job_life_train.py); or an FSDP2 training saving through the DCP
  writer and resuming through the reader (testbed/job_life_dcp.py), sync or async; or, named
  (``--integration titan``), through torchtitan's manager with ``keep_latest_k``
  (testbed/job_life_titan.py); or (``--integration hf``, ``hf-delete``) the HF Trainer with
  DeepSpeed, ``TailorCallback`` committing each ``checkpoint-N`` and ``checkout_for_resume``
  resuming (testbed/job_life_hf.py);
- a fault on the save's whole path: SIGKILL of one rank or of all before ``save_checkpoint``, as
  it returns, a moment later (while the copy, the staging writes or the commit run), after the
  next step, or at one of the commit's own requests (a blob's put, the manifest's create-only
  put, either side of the publish) through ``TAILOR_FAILPOINTS``;
- sometimes a rewind first (resume an earlier tag, train on other data, with each
  ``on_existing``), faulted the same way;
- then a restart at the same or another world size, sometimes killed again during its
  recovery, and a last clean launch that trains past the last save.

After every launch that resumes, and at the end, the invariants (each with its reason):

- **one decision**: every rank of a launch resumed the same step, or none did;
- **durable**: the step resumed is no older than the newest step the job had committed (the
  head names it), and no newer than its newest save;
- **exact**: the weights a launch loaded are bit for bit what the job held when it saved that
  step (the witness its rank 0 wrote before the save), and, where the whole history ran at one
  world size on the reference data, every later loss equals an uninterrupted run's;
- **bounded**: a launch that is not killed on purpose ends, with exit 0, within ``BOUND`` s (a
  deadlock between ranks shows here);
- **agreeing**: at the end, ``latest`` names the head's step, the head's run holds it as its
  newest step, each step of that run once, and ``verify`` finds nothing wrong;
- **kept**: a rewind's restart left in the store the very state it resumed from (a probe launch
  loads that step again and compares);
- **contained**: nothing was written outside the job's save folder, staging and the store.

``python -m benchmarks.job_life --schedules N`` runs a soak; tests/system/test_job_life.py runs the
regressions and a few fresh seeds. Every schedule replays from its seed.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from testbed.runs import TrainingFailed, torchrun

BOUND = 240.0  # seconds a launch not killed on purpose may take; a tiny run takes under 20 here
STEPS = 6
SAVE_EVERY = 2
SCRIPT_POINTS = ("before-save", "after-save", "after-save-delay", "next-step")
STORE_POINTS = (
    "commit/put=kill@{n}",  # between the commit's blob puts
    "commit/put-create=kill",  # at the manifest's create-only put
    "before-publish=kill",
    "after-publish=kill",
)
ON_EXISTING = ("branch", "replace")
# the other faults of a save's path (``--faults stalls``, DeepSpeed schedules): staging full while
# a save is written (that file goes where DeepSpeed writes it, and the save is committed from there;
# it must never be lost), a rank's background writes or its commit stalled while training goes on
STALL_POINTS = (
    "snapshot-file-written=enospc@{n}",
    "snapshot-file-written=enospc",  # every file of every save
    "snapshot-file-written=sleep:3@{n}",
    "commit/put=sleep:2@{n}",
    "before-publish=sleep:4",
)
FAULTS = ("kills", "stalls")
LONGEST = STEPS + 2 * SAVE_EVERY  # the last launch of a stalls schedule; the references train this far


@dataclass(frozen=True)
class Launch:
    """One start of the training job: its world size, how it resumes, and the fault it meets."""

    nproc: int
    steps: int = STEPS
    fresh: bool = False  # a first launch that does not call load_checkpoint
    tag: str | None = None  # a rewind: resume this DeepSpeed tag
    data_offset: int = 0  # a rewind trains on other data, so its timeline differs from the one abandoned
    on_existing: str = "branch"
    kill_at: str | None = None  # a point of job_life_train, or None
    kill_step: int = 0
    kill_rank: str = "0"
    kill_delay: float = 0.0
    failpoints: str | None = None  # TAILOR_FAILPOINTS: a kill at one of the store's own points

    @property
    def faulted(self) -> bool:
        return self.kill_at is not None or self.failpoints is not None


# the integrations a schedule drives, and the launch script of each
INTEGRATIONS = {
    "deepspeed": ("testbed.job_life_train", []),  # attach, as the README shows it
    "dcp": ("testbed.job_life_dcp", []),  # FSDP2, dcp.save through TailorStorageWriter, TailorStorageReader
    "dcp-async": ("testbed.job_life_dcp", ["--async-save"]),  # the same with dcp.async_save
    # named, never drawn (so that every drawn seed keeps its schedule): torchtitan's manager
    "titan": ("testbed.job_life_titan", []),  # TailorCheckpointManager, keep_latest_k beside the saves
    "titan-async": ("testbed.job_life_titan", ["--async-save"]),  # its async_mode="async"
    # the HF Trainer with DeepSpeed, TailorCallback committing, checkout_for_resume resuming
    "hf": ("testbed.job_life_hf", []),
    "hf-delete": ("testbed.job_life_hf", ["--delete-after-commit"]),  # each folder deleted once durable
}
DRAWN = ("deepspeed", "dcp", "dcp-async")  # what schedule_for draws from a seed alone
# the store's own kill points a DCP save reaches: each rank's part, the coordinator's finalize
DCP_STORE_POINTS = (
    "part/put=kill@{n}",
    "part/put-create=kill",
    "before-part-publish=kill",
    "finalize/put-create=kill",
    "before-publish=kill",
    "after-publish=kill",
)


@dataclass(frozen=True)
class Schedule:
    seed: int
    stage: int  # the ZeRO stage (DeepSpeed schedules)
    launches: tuple[Launch, ...]
    integration: str = "deepspeed"

    def describe(self) -> str:
        parts = []
        for i, launch in enumerate(self.launches):
            fault = ""
            if launch.kill_at:
                fault = f" kill {launch.kill_at}@{launch.kill_step} rank {launch.kill_rank}"
                if launch.kill_at == "after-save-delay":
                    fault += f" +{launch.kill_delay:.2f}s"
            if launch.failpoints:
                fault += f" {launch.failpoints}"
            how = "fresh" if launch.fresh else (f"tag {launch.tag}" if launch.tag else "latest")
            extra = f" {launch.on_existing}" if launch.on_existing != "branch" else ""
            parts.append(f"L{i}[{launch.nproc}r {how}{extra}{fault}]")
        what = f"ZeRO-{self.stage}" if self.integration == "deepspeed" else self.integration
        what += f" ZeRO-{self.stage}" if self.integration.startswith("hf") else ""
        return f"seed {self.seed} {what}: " + " ".join(parts)


def _fault(
    rng: random.Random, nproc: int, steps: int, first_save: int, store_points: tuple[str, ...] = STORE_POINTS
) -> dict[str, object]:
    """A fault drawn from the save's whole path, at one of the saves from ``first_save`` on."""
    saves = list(range(first_save, steps + 1, SAVE_EVERY))
    if rng.random() < 0.6:
        point = rng.choice(SCRIPT_POINTS)
        rank = rng.choice(["0", "all", *(["1"] if nproc > 1 else [])])
        step = rng.choice(saves)
        return {
            "kill_at": point,
            "kill_step": step,
            "kill_rank": rank,
            "kill_delay": round(rng.uniform(0.01, 0.4), 2) if point == "after-save-delay" else 0.0,
        }
    point = rng.choice(store_points).format(n=rng.randint(1, 12))
    if "@" not in point and len(saves) > 1 and rng.random() < 0.5:
        point += f"@{rng.randint(2, len(saves))}"  # a later save's commit, not the first
    return {"failpoints": point}


def schedule_for(seed: int, integration: str | None = None, faults: str = "kills") -> Schedule:
    """The schedule ``seed`` draws (no process is started); ``integration`` names one that is
    never drawn (torchtitan's), whose schedules are the DCP writer's, driven by its manager;
    ``faults="stalls"``: a DeepSpeed schedule whose first launch meets a full staging folder or a
    stall (:data:`STALL_POINTS`) instead of a kill, then maybe a kill, then a restart."""
    rng = random.Random(seed)
    drawn = rng.choices(DRAWN, weights=[3, 1, 1])[0]
    stage = rng.choice([2, 3])
    first = rng.choice([1, 2])
    if faults == "stalls":
        return _stalls_schedule(seed, rng, stage, first)
    if integration is not None and integration.startswith("hf"):
        return _hf_schedule(seed, rng, integration, stage, first)
    if integration is not None and integration not in DRAWN:
        return _dcp_schedule(seed, rng, integration, first)
    integration = drawn
    if integration != "deepspeed":
        return _dcp_schedule(seed, rng, integration, first)
    launches = [Launch(first, fresh=True, **_fault(rng, first, STEPS, SAVE_EVERY))]
    if rng.random() < 0.3:  # a rewind: the first launch ran whole, and a second goes back and saves again
        launches[0] = Launch(first, fresh=True)
        back = rng.choice([2, 4])
        launches.append(
            Launch(
                first,
                tag=f"global_step{back}",
                data_offset=1000,
                on_existing=rng.choice(ON_EXISTING),
                **_fault(rng, first, STEPS, back + SAVE_EVERY),
            )
        )
    restart = rng.choice([1, 2])
    if rng.random() < 0.25:  # killed again while it recovers what the dead run left (its first commit)
        launches.append(Launch(restart, failpoints=rng.choice(["commit/put-create=kill", "commit/put=kill@1"])))
    launches.append(Launch(rng.choice([1, 2]), steps=STEPS + SAVE_EVERY))  # the last: clean, past the last save
    return Schedule(seed, stage, tuple(launches))


def _stalls_schedule(seed: int, rng: random.Random, stage: int, first: int) -> Schedule:
    """Staging full or a stall on the first launch's saves (it must end with exit 0, every save
    kept), sometimes a launch killed on its save's path after it, then a clean restart."""
    stall = rng.choice(STALL_POINTS).format(n=rng.randint(1, 6))
    launches = [Launch(first, fresh=True, failpoints=stall)]
    if rng.random() < 0.5:  # the next launch resumes, and is killed on its one save's path (step 8)
        nproc, last = rng.choice([1, 2]), STEPS + SAVE_EVERY
        launches.append(Launch(nproc, steps=last, **_fault(rng, nproc, last, last)))
    launches.append(Launch(rng.choice([1, 2]), steps=LONGEST))
    return Schedule(seed, stage, tuple(launches))


def _dcp_schedule(seed: int, rng: random.Random, integration: str, first: int) -> Schedule:
    """A DCP schedule: the saves through the writer, faulted; a restart through the reader."""
    launches = [Launch(first, fresh=True, **_fault(rng, first, STEPS, SAVE_EVERY, DCP_STORE_POINTS))]
    restart = rng.choice([1, 2])
    if rng.random() < 0.25:  # the restart killed too, at its first save's part
        launches.append(Launch(restart, failpoints="part/put-create=kill"))
    launches.append(Launch(rng.choice([1, 2]), steps=STEPS + SAVE_EVERY))
    return Schedule(seed, 0, tuple(launches), integration)


def _hf_schedule(seed: int, rng: random.Random, integration: str, stage: int, first: int) -> Schedule:
    """An HF Trainer schedule: the callback's commits, faulted (a rank-parallel commit's parts and
    finalize at 2 ranks, a plain commit at 1); restarts through ``checkout_for_resume``."""
    points = STORE_POINTS + DCP_STORE_POINTS[:4] if first > 1 else STORE_POINTS
    launches = [Launch(first, fresh=True, **_fault(rng, first, STEPS, SAVE_EVERY, points))]
    restart = rng.choice([1, 2])
    if rng.random() < 0.25:  # the restart killed too, in its first save's commit
        launches.append(Launch(restart, **_fault(rng, restart, STEPS, STEPS, points)))
    launches.append(Launch(rng.choice([1, 2]), steps=STEPS + SAVE_EVERY))
    return Schedule(seed, stage, tuple(launches), integration)


@dataclass
class Outcome:
    schedule: str
    seed: int
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    launches: list[str] = field(default_factory=list)  # what each launch did, for the report

    @property
    def ok(self) -> bool:
        return not self.violations


class _Job:
    """The folders of one schedule's job, and what its launches left there."""

    def __init__(self, root: Path, stage: int, integration: str = "deepspeed") -> None:
        self.root = root
        self.stage = stage
        self.integration = integration
        self.store = root / "store"
        self.save = root / "save"
        self.staging = root / "staging"
        self.witness = root / "witness"
        self.logs = root / "logs"
        for folder in (self.save, self.staging, self.witness, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        from tailorstore.api import Store

        Store.init(str(self.store)).close()

    def run(self, launch: Launch, number: int, *, probe_ref: str | None = None) -> tuple[str, list[dict]]:
        """Start ``launch``; returns how it ended ('ok', 'killed', 'failed: ...', 'hung') and its ranks' reports."""
        reports = self.root / "reports" / f"launch{number}{'-probe' if probe_ref else ''}"
        args = [
            "--save-dir", str(self.save), "--store", str(self.store), "--report-dir", str(reports),
            "--witness-dir", str(self.witness), "--steps", str(launch.steps), "--save-every", str(SAVE_EVERY),
            "--stage", str(self.stage), "--on-existing", launch.on_existing, "--launch", str(number),
            "--data-offset", str(launch.data_offset),
        ]  # fmt: skip
        module, extra = INTEGRATIONS[self.integration]
        args += extra
        if launch.fresh:
            args.append("--fresh")
        if launch.tag:
            args += ["--tag", launch.tag]
        if probe_ref:
            args += ["--probe-ref", probe_ref]
        elif launch.kill_at:
            args += ["--kill-at", launch.kill_at, "--kill-step", str(launch.kill_step), "--kill-rank", launch.kill_rank]
            args += ["--kill-delay", str(launch.kill_delay)]
        env = {"TAILOR_STAGING": str(self.staging), "TAILOR_CACHE": str(self.root / "cache")}
        if launch.failpoints and not probe_ref:
            env["TAILOR_FAILPOINTS"] = launch.failpoints
        log = self.logs / f"launch{number}{'-probe' if probe_ref else ''}.log"
        try:
            torchrun(module, args, nproc=launch.nproc, log=log, timeout=BOUND, node_env=[env])
            ended = "ok"
        except TrainingFailed as exc:
            text = str(exc)
            if "no end after" in text:
                ended = "hung"
            elif "exited with code -9" in text:
                ended = "killed"
            else:
                ended = "failed: " + _last_error(log)
        return ended, _reports(reports)

    def head(self) -> dict | None:
        try:
            return json.loads((self.save / "tailorstore-head.json").read_text())
        except (OSError, ValueError):
            return None

    def newest_in_store(self) -> int:
        """The newest step of run main (DCP schedules: what a resume from latest must not go below)."""
        from tailorstore.api import Store

        with Store.open(str(self.store)) as store:
            return max((s.step for s in store.log(run="main")), default=0)

    def witnesses_of(self, step: int, before: int) -> set[str]:
        """The digests a resume of ``step`` may load, from the launches before ``before``: the newest
        launch's witness alone where every one of its ranks returned from that save (a save whose
        ranks all returned and that became durable is the newest state of its step), else any
        launch's witness of it (rank 0 writes its witness before the save, which a kill or a
        rank that died may leave undone)."""
        found: list[tuple[int, str]] = []
        for launch in range(before):
            path = self.witness / f"launch{launch}-step{step}.json"
            if path.is_file():
                found.append((launch, str(json.loads(path.read_text())["digest"])))
        if not found:
            return set()
        newest, digest = found[-1]
        reports = _reports(self.root / "reports" / f"launch{newest}")
        if reports and all(step in r.get("saved", []) for r in reports):
            return {digest}
        return {d for _, d in found}


def _reports(folder: Path) -> list[dict]:
    if not folder.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def _last_error(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(empty log)"])[-1][-300:]


def _reference_losses(schedule: Schedule, nproc: int, cache: dict[tuple, dict[str, str]]) -> dict[str, str]:
    """An uninterrupted run's losses, steps 1 to the longest launch's (:data:`LONGEST`), at this
    integration, stage and world size."""
    stage = schedule.stage
    key = (schedule.integration.removesuffix("-async").removesuffix("-delete"), stage, nproc)
    if key not in cache:
        with tempfile.TemporaryDirectory(prefix="tailor-joblife-ref-") as tmp:
            job = _Job(Path(tmp), stage, schedule.integration)
            ended, reports = job.run(Launch(nproc, steps=LONGEST, fresh=True), 0)
            if ended != "ok" or not reports:
                raise RuntimeError(f"the reference run at ZeRO-{stage}, {nproc} ranks failed: {ended}")
            cache[key] = dict(reports[0].get("losses", {}))
    return cache[key]


def run_schedule(schedule: Schedule, *, keep: Path | None = None, references: dict | None = None) -> Outcome:
    """Run every launch of ``schedule`` in a fresh folder and check the invariants; ``keep`` copies
    the folder there when an invariant broke (for the replay's report)."""
    began = time.monotonic()
    outcome = Outcome(schedule.describe(), schedule.seed)
    references = {} if references is None else references
    with tempfile.TemporaryDirectory(prefix="tailor-joblife-") as tmp:
        job = _Job(Path(tmp), schedule.stage, schedule.integration)
        history_sizes: set[int] = set()  # the world sizes the state resumed next has been trained at
        on_reference_data = True
        floor = 0  # the newest step of the job's current timeline known durable: no resume may go below it
        for number, launch in enumerate(schedule.launches):
            head_before = job.head()
            if schedule.integration != "deepspeed":
                floor = job.newest_in_store()  # no head: every step the store holds is durable
            newest_save = max((int(p.stem.split("step")[1]) for p in job.witness.glob("launch*-step*.json")), default=0)
            ended, reports = job.run(launch, number)
            outcome.launches.append(f"L{number}: {ended}")
            if ended == "hung":
                outcome.violations.append(f"bounded: launch {number} did not end within {BOUND:.0f} s")
                break
            if ended.startswith("failed") or (ended == "killed" and not launch.faulted):
                outcome.violations.append(f"bounded: launch {number} {ended}")
                break
            on_reference_data = on_reference_data and not launch.data_offset
            if not launch.fresh:
                rewound = any(earlier.tag for earlier in schedule.launches[:number])
                _check_resume(outcome, job, number, launch, reports, floor, newest_save, rewound)
                resumed = _agreed_step(reports)
                one_size = len(history_sizes | {launch.nproc}) == 1
                if resumed is not None and resumed > 0 and on_reference_data and one_size:
                    want = _reference_losses(schedule, launch.nproc, references)
                    _check_losses(outcome, number, resumed, reports, want)
            history_sizes.add(launch.nproc)
            head_after = job.head()
            if head_after is not None and head_after != head_before:
                floor = int(head_after["step"])  # this launch committed it (or its recovery did): durable
            elif launch.tag:
                floor = int(launch.tag.removeprefix("global_step"))  # the rewind went back to this durable step
        if outcome.ok:
            _check_end(outcome, job, schedule)
        if outcome.ok and any(launch.tag for launch in schedule.launches):
            _check_kept(outcome, job, schedule)
        if outcome.ok:
            _check_contained(outcome, job)
        if not outcome.ok and keep is not None:
            shutil.copytree(tmp, keep / f"seed-{schedule.seed}", dirs_exist_ok=True, ignore_dangling_symlinks=True)
    outcome.seconds = time.monotonic() - began
    return outcome


def _check_losses(outcome: Outcome, number: int, resumed: int, reports: list[dict], want: dict[str, str]) -> None:
    """Rank 0's losses after the resume equal an uninterrupted run's, bit for bit."""
    for step, loss in reports[0].get("losses", {}).items():
        if want.get(step) != loss:
            theirs = float.fromhex(want[step]) if step in want else None
            outcome.violations.append(
                f"exact: launch {number} resumed step {resumed}; its loss at step {step} is "
                f"{float.fromhex(loss)!r}, an uninterrupted run's {theirs!r}"
            )
            return


def _agreed_step(reports: list[dict]) -> int | None:
    steps = {r.get("resumed_step") for r in reports if "resumed_step" in r}
    return steps.pop() if len(steps) == 1 else None


def _check_resume(
    outcome: Outcome,
    job: _Job,
    number: int,
    launch: Launch,
    reports: list[dict],
    floor: int,
    newest_save: int,
    rewound: bool = False,
) -> None:
    """J1 and J2 for one launch. ``rewound``: a launch before went back to an earlier tag, so the
    job's run may hold a later step of the timeline it abandoned, which it rightly does not resume."""
    loaded = [r for r in reports if "resumed_step" in r]
    if not loaded:
        return  # killed before any rank loaded: nothing was decided
    if len(loaded) < launch.nproc and launch.faulted:
        return  # a rank was killed before it reported: the others' decisions are checked when they agree
    decisions = {(r["resumed"], r["resumed_step"]) for r in loaded}
    if len(decisions) > 1:
        outcome.violations.append(f"one decision: launch {number}'s ranks resumed differently: {sorted(decisions)}")
        return
    resumed, step = decisions.pop()
    if launch.tag:
        want = int(launch.tag.removeprefix("global_step"))
        if step != want:
            outcome.violations.append(f"durable: launch {number} asked for {launch.tag} and resumed step {step}")
        return
    if step < floor:
        outcome.violations.append(
            f"durable: launch {number} resumed step {step}, older than step {floor}, which the job had made durable"
        )
    if step > newest_save:
        outcome.violations.append(
            f"durable: launch {number} resumed step {step}; the job never saved past {newest_save}"
        )
    at_resume = next((r["store_steps_at_resume"] for r in loaded if "store_steps_at_resume" in r), None)
    if at_resume is not None and not rewound:
        durable = max((s for s in at_resume if s <= newest_save), default=0)
        if step < durable:
            outcome.violations.append(
                f"durable: launch {number} resumed step {step}; the store held step {durable} of the job's run "
                "when it decided"
            )
    if resumed and step > 0:
        wanted = job.witnesses_of(step, number)
        got = {r.get("loaded_digest") for r in loaded}
        if len(got) != 1 or not got <= wanted:
            outcome.violations.append(
                f"exact: launch {number} resumed step {step} with weights {sorted(map(str, got))}, not what the "
                f"job saved as step {step} ({sorted(wanted)})"
            )


def _check_end(outcome: Outcome, job: _Job, schedule: Schedule) -> None:
    from tailorstore.api import Store

    last = schedule.launches[-1].steps
    if schedule.integration != "deepspeed":
        with Store.open(str(job.store)) as store:
            steps = [s.step for s in store.log(run="main")]
            if len(steps) != len(set(steps)) or not steps or max(steps) != last:
                outcome.violations.append(f"agreeing: run 'main' holds {steps}; the job last saved step {last}")
            report = store.verify()
            if not report.ok:
                outcome.violations.append(f"agreeing: verify found {report.problems[:3]}")
        return
    head = job.head()
    if head is None:
        outcome.violations.append("agreeing: the job's head is missing after its last launch")
        return
    try:
        latest = (job.save / "latest").read_text().strip()
    except OSError:
        latest = None
    if latest != f"global_step{last}" or head["step"] != last:
        outcome.violations.append(
            f"agreeing: latest names {latest}, the head {head['run']}:{head['step']}; want step {last}"
        )
    with Store.open(str(job.store)) as store:
        steps = [s.step for s in store.log(run=head["run"])]
        if len(steps) != len(set(steps)):
            outcome.violations.append(f"agreeing: run {head['run']!r} holds a step twice: {steps}")
        if not steps or max(steps) != head["step"]:
            outcome.violations.append(f"agreeing: run {head['run']!r} holds {steps}; the head names {head['step']}")
        report = store.verify()
        if not report.ok:
            outcome.violations.append(f"agreeing: verify found {report.problems[:3]}")


def _check_kept(outcome: Outcome, job: _Job, schedule: Schedule) -> None:
    """After a rewind: the step the restart resumed from is, in the store, what it resumed."""
    head = job.head()
    for number, launch in enumerate(schedule.launches):
        if launch.fresh or launch.tag or number == 0 or head is None:
            continue
        reports = _reports(job.root / "reports" / f"launch{number}")
        step = _agreed_step(reports)
        if not step:
            continue
        digest = reports[0].get("loaded_digest")
        ref = f"{head['run']}:step={step}"
        ended, probe = job.run(Launch(schedule.launches[-1].nproc), 100 + number, probe_ref=ref)
        got = probe[0].get("loaded_digest") if probe else None
        if ended != "ok" or got != digest:
            outcome.violations.append(
                f"kept: launch {number} resumed step {step} ({digest}); the store's step {step} now loads as {got} "
                f"({ended})"
            )
        return


def _check_contained(outcome: Outcome, job: _Job) -> None:
    allowed = {"store", "save", "staging", "witness", "logs", "reports", "cache"}
    stray = sorted(p.name for p in job.root.iterdir() if p.name not in allowed)
    if stray:
        outcome.violations.append(f"contained: the job wrote {stray} beside its folders")


def outcome_line(outcome: Outcome) -> str:
    verdict = "ok" if outcome.ok else "BROKEN " + "; ".join(outcome.violations)
    return f"{outcome.schedule} ({outcome.seconds:.0f} s; {', '.join(outcome.launches)}): {verdict}"


def as_json(outcome: Outcome) -> dict:
    return asdict(outcome)


# The schedules that found what the last round of attacks found, kept as regressions (each also
# drawn by the seed beside it where the generator draws that shape).
REGRESSIONS: dict[str, Schedule] = {
    # killed a whole training step after save_checkpoint returned; the restart's ranks took two load paths
    "restart-after-a-save": Schedule(
        -1, 2, (Launch(2, fresh=True, kill_at="next-step", kill_step=4, kill_rank="all"), Launch(2, steps=8))
    ),
    # killed as save_checkpoint returned, its files still being written: the partial save must not be loaded
    "partial-save-zero3": Schedule(
        -2, 3, (Launch(2, fresh=True, kill_at="after-save", kill_step=4, kill_rank="all"), Launch(2, steps=8))
    ),
    # a rewind with replace, killed as it records its first step: the restart must replace the old step
    "replace-rewind": Schedule(
        -3,
        2,
        (
            Launch(2, fresh=True),
            Launch(2, tag="global_step2", data_offset=1000, on_existing="replace", failpoints="commit/put-create=kill"),
            Launch(2, steps=8),
        ),
    ),
    # the README's loop on its first launch: load_checkpoint on an empty store starts fresh
    "first-launch-loads": Schedule(-4, 2, (Launch(2, steps=4),)),
    # steps 8 and 10 left in staging (8's publish stalled, every rank killed after 10): recovered in
    # name order (global_step10 first), the head ended on 8 and the restart resumed 8, then branched
    "recovery-in-step-order": Schedule(
        -5,
        2,
        (
            Launch(
                2,
                steps=10,
                fresh=True,
                kill_at="after-save-delay",
                kill_step=8,
                kill_rank="all",
                kill_delay=6.0,
                failpoints="before-publish=sleep:25@4",
            ),
            Launch(2, steps=10),
        ),
    ),
}
