"""Two "nodes" on this machine, each with its own staging folder (its memory) and its own index
cache, sharing nothing but a store on a local S3 server (moto): each node commits what its own
ranks staged as a part, global rank 0 finalizes, and the steps check out byte-identical to
DeepSpeed's own save of the same training. Then the job resumes on one node, at another world
size, straight from the store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.integrations.common import StoreSession
from testbed.compare import same_tree
from testbed.folders import dir_bytes
from testbed.local_s3 import LocalS3
from testbed.runs import TrainingFailed, train_tiny
from tests.conftest import Run, Runs, as_of_step, manifest_rows, parts_of_any_age
from tests.system.test_reshard import STEP, DeepSpeedPath

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def universal_path(tmp_path_factory: pytest.TempPathFactory) -> DeepSpeedPath:
    """DeepSpeed's own ds_to_universal + load_universal path, the reference of a resume elsewhere."""
    return DeepSpeedPath(tmp_path_factory.mktemp("deepspeed-path"))


def node_folders(root: Path, count: int) -> list[dict[str, str]]:
    out = []
    for n in range(count):
        staging, cache = root / f"node{n}" / "shm", root / f"node{n}" / "cache"
        staging.mkdir(parents=True)
        cache.mkdir(parents=True)
        out.append({"TAILOR_STAGING": str(staging), "TAILOR_CACHE": str(cache)})
    return out


def test_two_nodes_stage_locally_commit_parts_and_resume_on_one(
    runs: Runs,
    universal_path: DeepSpeedPath,
    s3_server: LocalS3,
    tmp_path: Path,
) -> None:
    reference = runs.get("zero2-bf16")  # the same training, 2 ranks, saved to disk by DeepSpeed
    location = s3_server.new_location()
    Store.init(location).close()
    nodes = node_folders(tmp_path, 2)
    losses = train_tiny(
        tmp_path / "save", losses_out=tmp_path / "losses.json", nproc=1, node_env=nodes, steps=6, save_every=3,
        commit_to=location, tailor_engine=True, **reference.options,
    )  # fmt: skip
    assert losses == reference.losses
    with Store.open(location) as store:
        assert [s.step for s in store.log()] == [3, 6]
        for step in (3, 6):
            assert StoreSession(store).parts(step) == [], "finalize took every part of the save"
            sources = store.repo.manifest(store.repo.resolve(f"step={step}")).source.split("; ")
            assert sorted(s.split(":", 1)[1].split("/node")[1][0] for s in sources) == ["0", "1"], sources
            out = tmp_path / f"out{step}"
            store.checkout(step, out)
            theirs = as_of_step(reference.save_dir, step, tmp_path / f"theirs{step}")
            assert same_tree(out / f"global_step{step}", theirs / f"global_step{step}")
        assert store.verify(deep=True).ok
    for node in nodes:
        assert not [p for p in Path(node["TAILOR_STAGING"]).rglob("*") if p.is_file()], "staging is emptied"

    # the job restarts on both nodes: each node writes only its rank's share of step 3, and the
    # resume is exact (the same world size)
    again = train_tiny(
        tmp_path / "both", losses_out=tmp_path / "both.json", nproc=1, node_env=nodes, steps=STEP + 2, save_every=0,
        commit_to=location, tailor_engine=True, resume_from=tmp_path / "both", resume_tag=f"global_step{STEP}",
        **reference.options,
    )  # fmt: skip
    assert again == {s: reference.losses[s] for s in (STEP + 1, STEP + 2)}

    # the job restarts on one node of one rank: it resumes from the store at world size 1
    resumed = train_tiny(
        tmp_path / "again", losses_out=tmp_path / "again.json", nproc=1, node_env=nodes[:1], steps=STEP + 2,
        save_every=0, commit_to=location, tailor_engine=True, resume_from=tmp_path / "again",
        resume_tag=f"global_step{STEP}", **reference.options,
    )  # fmt: skip
    expected, _ = universal_path.loaded(reference, 1, 2)
    assert resumed == expected


def test_a_node_killed_mid_save_leaves_the_earlier_steps_and_the_job_resumes_on_one(
    runs: Runs,
    universal_path: DeepSpeedPath,
    s3_server: LocalS3,
    tmp_path: Path,
) -> None:
    """Node 1 is SIGKILLed at its third save (step 9), just before its part is published: no
    manifest of step 9 is recorded, and step 3 is whole. (By then rank 0 has passed its save of
    step 6, which waits for the commit of step 3 to end, so step 3 is in the store whatever the
    timing; step 6 may or may not be.) The job restarted on one node resumes at step 3 with
    DeepSpeed's own losses there; gc's drop_parts collects what the dead save left."""
    reference = runs.get("zero2-bf16-9steps")
    location = s3_server.new_location()
    Store.init(location).close()
    nodes = node_folders(tmp_path, 2)
    nodes[1]["TAILOR_FAILPOINTS"] = "before-part-publish=kill@3"
    with pytest.raises(TrainingFailed, match="rank 1 exited with code -9"):
        train_tiny(
            tmp_path / "save", losses_out=tmp_path / "losses.json", nproc=1, node_env=nodes, steps=9, save_every=3,
            commit_to=location, tailor_engine=True, timeout=300, **reference.options,
        )  # fmt: skip
    with Store.open(location) as store:
        steps = [s.step for s in store.log()]
        assert 3 in steps and 9 not in steps, steps
        assert len(StoreSession(store).parts(9)) <= 1, "at most node 0's part of the dead save"
    resumed = train_tiny(
        tmp_path / "again", losses_out=tmp_path / "again.json", nproc=1, node_env=nodes[:1], steps=STEP + 2,
        save_every=0, commit_to=location, tailor_engine=True, resume_from=tmp_path / "again",
        resume_tag=f"global_step{STEP}", **reference.options,
    )  # fmt: skip
    expected, _ = universal_path.loaded(reference, 1, 2)
    assert resumed == expected
    with Store.open(location) as store:
        assert 9 not in [s.step for s in store.log()]
        with parts_of_any_age():
            store.gc(drop_parts=True)
        session = StoreSession(store)
        assert session.parts(9) == [] and session.parts(6) == [] and session.parts(3) == []
        assert store.verify(deep=True).ok
        store.checkout(3, tmp_path / "out")
    theirs = as_of_step(reference.save_dir, 3, tmp_path / "theirs")
    assert same_tree(tmp_path / "out" / "global_step3", theirs / "global_step3")


def test_two_nodes_of_two_ranks_each_stage_locally_and_resume_at_three(
    runs: Runs, universal_path: DeepSpeedPath, s3_server: LocalS3, tmp_path: Path
) -> None:
    """2 nodes x 2 ranks, each node with its own staging and cache: the steps are what one
    process commits of DeepSpeed's own save of the same training at 4 ranks, and the job
    restarted at 3 ranks on one node, or at 2 ranks on both nodes, resumes as DeepSpeed's
    universal path does."""
    reference = runs.get("zero2-bf16-4ranks")
    location = s3_server.new_location()
    Store.init(location).close()
    nodes = node_folders(tmp_path, 2)
    losses = train_tiny(
        tmp_path / "save", losses_out=tmp_path / "losses.json", nproc=2, node_env=nodes, steps=6, save_every=3,
        commit_to=location, tailor_engine=True, **reference.options,
    )  # fmt: skip
    assert losses == reference.losses
    with Store.open(location) as store:
        assert [s.step for s in store.log()] == [3, 6]
        for step in (3, 6):
            sources = store.repo.manifest(store.repo.resolve(f"step={step}")).source.split("; ")
            assert len(sources) == 2, "one part a node"
            out = tmp_path / f"out{step}"
            store.checkout(step, out)
            theirs = as_of_step(reference.save_dir, step, tmp_path / f"theirs{step}")
            assert same_tree(out / f"global_step{step}", theirs / f"global_step{step}")
    resumed = train_tiny(
        tmp_path / "again", losses_out=tmp_path / "again.json", nproc=3, node_env=nodes[:1], steps=STEP + 2,
        save_every=0, commit_to=location, tailor_engine=True, resume_from=tmp_path / "again",
        resume_tag=f"global_step{STEP}", staged_resume=True, **reference.options,
    )  # fmt: skip
    expected, _ = universal_path.loaded(reference, 3, 2)
    assert resumed == expected, "the staged path, kept as staged_resume=True"
    # restarted on both nodes at one rank each: a new world size across nodes, each rank building its
    # own files of the resharded step from the store (each node's own cache), nothing staged
    across, peaks = resumed_on_nodes(reference, location, tmp_path / "across", 1, nodes)
    expected, _ = universal_path.loaded(reference, 2, 2)
    assert across == expected
    assert peaks == [0, 0], f"a node staged {peaks} bytes"


def test_a_zero3_save_resumes_across_two_nodes_at_a_new_world_size(
    runs: Runs, universal_path: DeepSpeedPath, s3_server: LocalS3, tmp_path: Path
) -> None:
    """ZeRO 3, saved at 2 ranks on one node, restarted on 2 nodes x 2 ranks (world size 4): each
    rank builds its files of the step resharded to 4 from the store, nothing staged; and with
    ``staged_resume``, each node's leader writes only its ranks' share into its own staging. Both
    ways the losses equal DeepSpeed's universal path at 4 ranks."""
    reference = runs.get("zero3-bf16")
    location = s3_server.new_location()
    with Store.init(location) as store:
        store.commit(as_of_step(reference.save_dir, STEP, tmp_path / "at"))
        store.checkout(f"step={STEP}", tmp_path / "whole4", world_size=4)
    whole = file_sizes(tmp_path / "whole4")
    nodes = node_folders(tmp_path, 2)
    resumed, peaks = resumed_on_nodes(reference, location, tmp_path / "again", 2, nodes)
    expected, _ = universal_path.loaded(reference, 4, 3)
    assert resumed == expected
    assert peaks == [0, 0], f"a node staged {peaks} bytes"
    resumed, peaks = resumed_on_nodes(reference, location, tmp_path / "staged", 2, nodes, staged_resume=True)
    assert resumed == expected
    for node, peak in enumerate(peaks):  # ZeRO 3: one model-states and one optimizer file a rank
        share = node_share(whole, [2 * node, 2 * node + 1])
        assert max(whole.values()) <= peak <= share, (node, peaks, share)


def resumed_on_nodes(
    reference: Run, location: str, out: Path, nproc: int, nodes: list[dict[str, str]], staged_resume: bool = False
) -> tuple[dict, list[int]]:
    """Training resumed from the store's step STEP on ``nodes`` of ``nproc`` ranks each, through
    ``attach``: its losses and each node's peak staging; every node's staging is left empty."""
    with StagingPeaks([Path(node["TAILOR_STAGING"]) for node in nodes]) as peaks:
        losses = train_tiny(
            out, losses_out=out.with_suffix(".json"), nproc=nproc, node_env=nodes, steps=STEP + 2, save_every=0,
            commit_to=location, tailor_engine=True, resume_from=out, resume_tag=f"global_step{STEP}",
            staged_resume=staged_resume, **reference.options,
        )  # fmt: skip
    assert not [p for node in nodes for p in Path(node["TAILOR_STAGING"]).rglob("*") if p.is_file()]
    return losses, peaks.peaks


def file_sizes(folder: Path) -> dict[str, int]:
    """Sizes of the files of a checked-out step, by name."""
    return {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def node_share(sizes: dict[str, int], ranks: list[int]) -> int:
    """Bytes a node with ``ranks`` loads of a step: the files of those ranks (``*zero_pp_rank_R_*``:
    optimizer files, and ZeRO 3's model states) and every file no one rank owns (ZeRO 1/2's model
    states, ``latest``)."""
    return sum(
        size
        for name, size in sizes.items()
        if "zero_pp_rank_" not in name or any(f"zero_pp_rank_{r}_" in name for r in ranks)
    )


class StagingPeaks:
    """The largest number of bytes each folder held while the block ran (sampled every 5 ms)."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders, self.peaks = folders, [0] * len(folders)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            for i, folder in enumerate(self.folders):
                self.peaks[i] = max(self.peaks[i], dir_bytes(folder))

    def __enter__(self) -> StagingPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("policy", ["parity", "budget"])
def test_two_nodes_commit_under_a_policy_what_one_process_commits(
    runs: Runs, s3_server: LocalS3, tmp_path: Path, policy: str
) -> None:
    """Node-local staging under a policy: the nodes' leaders decide the plan together (their own
    group, in the background) and each writes its node's pieces of the layers stored; every
    step's manifest equals a single-process commit of DeepSpeed's own save with that policy."""
    reference = runs.get("zero2-bf16")
    location = s3_server.new_location()
    Store.init(location).close()
    nodes = node_folders(tmp_path, 2)
    losses = train_tiny(
        tmp_path / "save", losses_out=tmp_path / "losses.json", nproc=1, node_env=nodes, steps=6, save_every=3,
        commit_to=location, tailor_engine=True, engine_policy=policy, **reference.options,
    )  # fmt: skip
    assert losses == reference.losses
    with Store.init(tmp_path / "single") as single:
        for step in (3, 6):
            single.commit(as_of_step(reference.save_dir, step, tmp_path / f"theirs{step}") / f"global_step{step}",
                          policy=policy)  # fmt: skip
        expected = {step: manifest_rows(single, step) for step in (3, 6)}
    assert not expected[6]["exact"], "the second save inherits layers"
    with Store.open(location) as store:
        for step in (3, 6):
            assert manifest_rows(store, step) == expected[step], step
        assert store.verify(deep=True).ok
    for node in nodes:
        assert not [p for p in Path(node["TAILOR_STAGING"]).rglob("*") if p.is_file()], "staging is emptied"
