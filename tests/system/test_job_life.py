"""The job-life simulation's CI tier (testbed/job_life.py): the kept regressions, then a few seeds.

Each schedule is a tiny real training (DeepSpeed through ``attach``, FSDP2 through the DCP writer
and reader, or through torchtitan's manager), killed on its save's path,
restarted (at the same or another world size) and checked against the simulation's invariants:
every rank took one decision, the job resumed its newest durable step bit for bit, no launch
hung, ``latest``, the head and the store agree, and nothing was written outside the job's
folders. The soak (``python -m benchmarks.job_life --schedules 200``) runs many more.
"""

from __future__ import annotations

import re

import pytest

from testbed.job_life import REGRESSIONS, outcome_line, run_schedule, schedule_for

pytestmark = pytest.mark.slow

# seeds whose schedules cover the other shapes: an async DCP save killed after the next step (0), a kill after the
# publish with a restart at another world size (3, broke on e8fd939), DCP parts killed at their blobs (6), a
# replacing ZeRO-3 rewind killed after its publish and restarted at another world size (8, broke on e8fd939)
SEEDS = (0, 3, 6, 8)
_references: dict = {}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_a_kept_regression_holds_every_invariant(name: str) -> None:
    outcome = run_schedule(REGRESSIONS[name], references=_references)
    assert outcome.ok, outcome_line(outcome)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_schedule_holds_every_invariant(seed: int) -> None:
    outcome = run_schedule(schedule_for(seed), references=_references)
    assert outcome.ok, outcome_line(outcome)


# torchtitan's manager (never drawn): a finalize killed at its manifest put, then a restart (3, sync); an
# async save killed as it returned, the restart at one rank (2). The HF Trainer (never drawn): at 2 ranks
# the callback's finalize killed at its manifest put, then a restart whose save of the same step must
# not take the dead try's parts for its own (hf 3: "the parts are of different tries" before the fix)
NAMED = (("titan", 3), ("titan-async", 2), ("hf", 3))


@pytest.mark.parametrize(("integration", "seed"), NAMED, ids=[f"{i}-{s}" for i, s in NAMED])
def test_a_schedule_of_a_named_integration_holds_every_invariant(integration: str, seed: int) -> None:
    outcome = run_schedule(schedule_for(seed, integration), references=_references)
    assert outcome.ok, outcome_line(outcome)


# staging full or a stall instead of a kill (``--faults stalls``): every staged file of every save on
# ENOSPC at 2 ranks, ZeRO-3 (9); one file of the fourth save full at 2 ranks (1)
STALLS = (9, 1)


@pytest.mark.parametrize("seed", STALLS)
def test_a_save_whose_staging_fills_or_stalls_is_kept_and_the_job_goes_on(seed: int) -> None:
    outcome = run_schedule(schedule_for(seed, faults="stalls"), references=_references)
    assert outcome.ok, outcome_line(outcome)


def test_the_schedules_cover_every_fault_and_restart_shape() -> None:
    """The generator reaches every kill point, both stages, both rewind rules and a world-size change
    within the first 300 seeds (the soak, `--schedules 300`, covers every one)."""
    schedules = [schedule_for(seed) for seed in range(300)]
    launches = [launch for s in schedules for launch in s.launches]
    points = {launch.kill_at for launch in launches if launch.kill_at}
    store_points = {launch.failpoints.split("=")[0] for launch in launches if launch.failpoints}
    assert points == {"before-save", "after-save", "after-save-delay", "next-step"}
    assert store_points == {"commit/put", "commit/put-create", "before-publish", "after-publish"} | {
        "part/put",
        "part/put-create",
        "before-part-publish",
        "finalize/put-create",
    }, "every store point of a DeepSpeed commit and of a DCP save's parts and finalize"
    assert {s.integration for s in schedules} == {"deepspeed", "dcp", "dcp-async"}
    assert {s.stage for s in schedules if s.integration == "deepspeed"} == {2, 3}
    assert {launch.on_existing for launch in launches if launch.tag} == {"branch", "replace"}
    assert any(len({launch.nproc for launch in s.launches}) > 1 for s in schedules)
    assert any(sum(1 for launch in s.launches if launch.faulted) >= 2 for s in schedules)
    stalls = [schedule_for(seed, faults="stalls") for seed in range(100)]
    points = [launch.failpoints for s in stalls for launch in s.launches if launch.failpoints]
    drawn = {re.sub(r"[:@].*", "", p) for p in points if "kill" not in p}
    assert drawn == {"snapshot-file-written=enospc", "snapshot-file-written=sleep", "commit/put=sleep",
                     "before-publish=sleep"}, drawn  # fmt: skip
