"""The public Python API, as a training script uses it: ``tailorstore.Store``, commits in
the background, errors that surface, originals deleted only when safe. Real DeepSpeed saves."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

import tailorstore
from tailorstore import BackgroundCommitError, BadCheckpointError, Retention, Store
from tailorstore.integrations.common import StoreSession
from testbed.compare import same_tree
from tests.conftest import TEST_DATA, Runs, as_of_step, copy_tree


def test_the_public_api_end_to_end(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero2-bf16").save_dir
    with Store.init(tmp_path / "store") as store:
        first = store.commit(as_of_step(save, 3, tmp_path / "at3"), tag="warm")
        assert first.step == 3 and first.new_bytes > 0
        future = store.commit_async(as_of_step(save, 6, tmp_path / "at6"))
        result = future.result(timeout=300)
        assert result.step == 6
        assert [(s.step, s.tag) for s in store.log()] == [(3, "warm"), (6, None)]
        assert {layer.layer for layer in store.show(3).layers} >= {"block.0", "lm_head"}
        store.checkout(6, tmp_path / "by-int")
        store.checkout("latest", tmp_path / "by-latest")
        store.checkout("tag=warm", tmp_path / "by-tag")
        assert same_tree(tmp_path / "by-int" / "global_step6", save / "global_step6")
        assert same_tree(tmp_path / "by-latest", tmp_path / "by-int")
        assert same_tree(tmp_path / "by-tag" / "global_step3", save / "global_step3")
        assert store.verify(deep=True).ok
        spec = tmp_path / "spec.yaml"
        spec.write_text("base: {step: 6}\nslices:\n  - sources: [{step: 3, layer_range: [0, 2]}]\n")
        assert store.merge(spec, tag="mixed").sources["block.0"] == 3
        plan = store.gc(Retention(keep_last=1))
        assert [m for m, _ in plan.drop] == []  # 3 is tagged, the merge is tagged
        store.untag("warm")
        assert len(store.gc(Retention(keep_last=1)).drop) == 1
        with pytest.raises(tailorstore.UnknownStepError):
            store.checkout(3, tmp_path / "gone")
        with pytest.raises(tailorstore.StoreError):
            store.checkout(True, tmp_path / "bool")  # type: ignore[arg-type]
        with pytest.raises(tailorstore.StepExistsError) as again:  # the library's advice names its own options
            store.commit(tmp_path / "at6")
        assert "`force=True`" in str(again.value) and "--" not in str(again.value)

    with Store.init(tmp_path / "tailored") as store:  # a policy and its parameters pass through
        store.commit(tmp_path / "at3")
        result = store.commit_async(tmp_path / "at6", policy="filter", keep_first=1, every=2).result(timeout=300)
        assert result.stored_layers[:2] == ["embedding", "block.0"] and result.inherited_layers
        assert not store.log()[-1].exact


def test_a_failed_background_commit_surfaces_at_flush_and_keeps_the_original(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero2-bf16").save_dir
    damaged = as_of_step(save, 6, tmp_path / "damaged")
    victim = damaged / "global_step6" / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with Store.init(tmp_path / "store") as store:
        future = store.commit_async(damaged, delete_after_commit=True)
        with pytest.raises(BackgroundCommitError, match=r"background commit of .*damaged failed") as caught:
            store.flush()
        assert isinstance(caught.value.__cause__, BadCheckpointError)
        assert future.exception() is caught.value.__cause__
        assert victim.exists() and (damaged / "global_step6").is_dir(), "the original is kept"
        assert store.log() == [] and store.verify(deep=True).ok
        store.flush()  # an error is raised once, then the store goes on
        store.commit(as_of_step(save, 6, tmp_path / "good"))


def test_a_failure_is_reported_at_the_next_save(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero2-bf16").save_dir
    damaged = as_of_step(save, 3, tmp_path / "damaged")
    (damaged / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    store = Store.init(tmp_path / "store")
    assert isinstance(store.commit_async(damaged).exception(timeout=60), BadCheckpointError)  # it ended
    with pytest.raises(BackgroundCommitError):
        store.commit_async(as_of_step(save, 6, tmp_path / "at6"))
    store.close()  # nothing else failed


def test_close_raises_a_failure_nobody_collected(runs: Runs, tmp_path: Path) -> None:
    damaged = as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "damaged")
    (damaged / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(BackgroundCommitError):
        with Store.init(tmp_path / "store") as store:
            store.commit_async(damaged)


def test_the_bound_on_commits_in_flight_waits_and_says_so(
    runs: Runs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save = runs.get("ten-saves").save_dir
    saves = [as_of_step(save, s, tmp_path / f"at{s}") for s in (1, 2, 3)]
    caplog.set_level(logging.INFO, logger="tailorstore")  # the wait is said at INFO (ordinary back-pressure)
    gate = threading.Event()
    with Store.init(tmp_path / "store", max_in_flight=1) as store:
        blocker = StoreSession(store).background("a slow commit", lambda _store: gate.wait())  # holds the one slot
        waited = threading.Thread(target=lambda: store.commit_async(saves[0]))
        waited.start()
        deadline = time.monotonic() + 30  # the message is logged just before the wait for the slot
        while "1 commit(s) already in flight; waiting" not in caplog.text and time.monotonic() < deadline:
            waited.join(0.01)
        assert "1 commit(s) already in flight; waiting" in caplog.text
        assert waited.is_alive(), "the second commit waits for the slot"
        gate.set()
        waited.join(timeout=60)
        blocker.result(timeout=5)
        for s in saves[1:]:
            store.commit_async(s)
        store.flush()
        assert [s.step for s in store.log()] == [1, 2, 3]


def test_delete_after_commit_takes_only_the_committed_step(runs: Runs, tmp_path: Path) -> None:
    save = copy_tree(runs.get("zero2-bf16").save_dir, tmp_path / "save")  # holds global_step3 and 6
    hf_like = copy_tree(save / "global_step3", tmp_path / "tagdir")
    with Store.init(tmp_path / "store") as store:
        store.commit_async(save, delete_after_commit=True).result(timeout=300)
        assert not (save / "global_step6").exists()
        assert (save / "latest").exists() and (save / "global_step3").is_dir(), "latest and other steps stay"
        store.commit(hf_like, step=3, delete_after_commit=True)
        assert not hf_like.exists()
        store.checkout(6, tmp_path / "out")
    assert same_tree(tmp_path / "out" / "global_step6", runs.get("zero2-bf16").save_dir / "global_step6")


def test_the_library_changes_nothing_process_wide(runs: Runs, tmp_path: Path) -> None:
    root_handlers = list(logging.getLogger().handlers)
    with Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "at6"))
        store.checkout(6, tmp_path / "out")
    assert logging.root.manager.disable == logging.NOTSET
    assert logging.getLogger().handlers == root_handlers
    assert logging.getLogger("tailorstore").handlers == []


def test_every_result_of_the_api_is_a_named_type_it_exports() -> None:
    """A caller can name what every Store method returns: each type in a return annotation is
    exported by ``tailorstore`` (no tuples of positions, no internal records)."""
    import inspect
    import re

    import tailorstore

    builtin = {"None", "int", "str", "float", "bool", "Path", "Future", "Any", "list", "dict", "tuple"}
    missing = {}
    for name, method in inspect.getmembers(tailorstore.Store, inspect.isfunction):
        if name.startswith("_"):
            continue
        annotation = inspect.signature(method).return_annotation
        names = set(re.findall(r"[A-Za-z_]\w*", str(annotation))) - builtin - {"Store"}
        if unknown := sorted(n for n in names if n not in tailorstore.__all__):
            missing[name] = unknown
        assert "tuple" not in str(annotation), (name, annotation)
    assert not missing, missing


def test_every_method_that_writes_a_folder_returns_a_folder_result() -> None:
    """A common base for the results that write a folder. Each Store method that takes an
    ``out`` folder returns a ``FolderResult`` (step, manifest, out, bytes written, seconds)."""
    import inspect

    import tailorstore

    writers = {
        name: getattr(tailorstore, inspect.signature(method).return_annotation)
        for name, method in inspect.getmembers(tailorstore.Store, inspect.isfunction)
        if "out" in inspect.signature(method).parameters and name not in ("plot", "report")  # each writes one file
    }
    assert set(writers) >= {"checkout", "checkout_universal", "export"}
    assert all(issubclass(kind, tailorstore.FolderResult) for kind in writers.values()), writers


def test_a_typed_policy_and_one_request_for_commit_and_commit_async(tmp_path: Path) -> None:
    """``policy=Budget(...)`` is the same policy as ``policy="budget", fraction=...``, and one
    CommitRequest serves commit and commit_async alike."""
    import tailorstore
    from tailorstore import Budget, CommitRequest, PolicyError

    checkpoint = TEST_DATA / "format1" / "checkpoint"
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(checkpoint, CommitRequest(step=1))
        typed = store.commit(checkpoint, step=2, policy=Budget(fraction=0.3, max_age=4))
        named = store.commit_async(checkpoint, CommitRequest(step=3, policy="budget"), fraction=0.3, max_age=4).result()
        assert typed.stored_layers == named.stored_layers and len(typed.stored_layers) < len(typed.stored_layers) + len(
            typed.inherited_layers
        )
        policies = [s.policy for s in store.log()]
        assert policies[1] == policies[2] == {"name": "budget", "fraction": 0.3, "max_age": 4}
        with pytest.raises(PolicyError, match="set fraction on it"):
            store.commit(checkpoint, step=4, policy=Budget(), fraction=0.5)
        tagged = store.tag(2, "typed")
        assert isinstance(tagged, tailorstore.StepSummary) and tagged.step == 2 and tagged.tag == "typed"
        assert store.remove(3).step == 3 and [s.step for s in store.log()] == [1, 2]
        changed = store.diff(1, 2)
        assert isinstance(changed, tailorstore.DiffResult) and (changed.step_a, changed.step_b) == (1, 2)


def test_verify_reports_progress_as_every_long_operation_does(small_store: Path) -> None:
    """One progress convention. verify took a bare callable where checkout, commit and
    export take a ``Progress``; now it starts once, advances by each blob's raw bytes, and closes."""
    from tailorstore.core.progress import Progress

    class Recorded(Progress):
        def __init__(self) -> None:
            self.calls: list[tuple[str, object]] = []

        def start(self, description: str, total: int) -> None:
            self.calls.append(("start", total))

        def advance(self, amount: int) -> None:
            self.calls.append(("advance", amount))

        def close(self) -> None:
            self.calls.append(("close", None))

    seen = Recorded()
    with Store.open(small_store) as store:
        report = store.verify(deep=True, progress=seen)
    assert report.ok and report.blobs_checked > 1
    kinds = [kind for kind, _ in seen.calls]
    assert kinds[0] == "start" and kinds[-1] == "close" and kinds.count("advance") == report.blobs_checked
    total = seen.calls[0][1]
    assert total == sum(amount for kind, amount in seen.calls if kind == "advance") > 0


def test_waits_and_warnings_reach_the_one_progress_a_verb_takes(small_store: Path, tmp_path: Path) -> None:
    """One convention for what a verb reports while it runs. gc took ``on_wait=``, checkout
    ``warn=`` and the others a ``Progress``; now each takes its ``progress``, whose ``note`` hears the
    wait for a lock another handle holds, and no public method takes a callback per concern."""
    import inspect

    from tailorstore.core.progress import Silent

    class Recorded(Silent):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def note(self, message: str) -> None:
            self.notes.append(message)

    store_copy = copy_tree(small_store, tmp_path / "store")
    seen = Recorded()
    with Store.open(store_copy) as holder, Store.open(store_copy) as other:
        with holder.repo.lock(exclusive=True, timeout=5), pytest.raises(tailorstore.LockTimeoutError):
            other.gc(Retention(keep_last=1), lock_timeout=0.3, progress=seen)
    assert seen.notes and "waiting for the exclusive store lock" in seen.notes[0]
    callbacks = [
        f"Store.{name}({parameter})"
        for name, method in inspect.getmembers(Store, inspect.isfunction)
        for parameter in inspect.signature(method).parameters
        if parameter in ("warn", "on_wait", "on_progress")
    ]
    assert not callbacks, callbacks


def test_a_checkout_says_which_deepspeed_tag_folder_it_wrote(small_store: Path, tmp_path: Path) -> None:
    """``CheckoutResult.tag``: the folder ``engine.load_checkpoint(out, tag)`` loads, told by the
    checkout, so that no caller lists the folder it wrote to learn it (the resume did)."""
    with Store.open(small_store) as store:
        done = store.checkout("latest", tmp_path / "out")
    folders = [p.name for p in (tmp_path / "out").iterdir() if p.is_dir()]
    assert done.tag is not None and folders == [done.tag]
    assert (tmp_path / "out" / "latest").read_text().strip() == done.tag
