"""Runs and their retention as objects: ``refs/runs/<run>`` and ``refs/retention/<run>``.

A run's object is written create-only, before the index records the run, so two hosts
creating one name cannot both win; it never changes. A run's retention object is mutable:
the rules ``gc`` without rules of its own applies to that run.
"""

from __future__ import annotations

import json
from typing import Any

from tailorstore.core.errors import Call, CorruptStoreError, ObjectExistsError, StepExistsError, StoreError
from tailorstore.core.records import RunRecord, record
from tailorstore.core.run_names import RUN_NAME
from tailorstore.store.backends.base import Backend, check_key
from tailorstore.store.manifests.keys import RETENTION_PREFIX, RUN_PREFIX, odd_key


def run_key(name: str) -> str:
    return check_key(RUN_PREFIX + name)


def check_run_name(name: str) -> str:
    if not RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise StoreError(f"run name {name!r} is not allowed: use 1 to 100 letters, digits, '-', '_' or '.'.")
    return name


def create_run(backend: Backend, run: RunRecord) -> None:
    """Write a run's object, create-only: two hosts creating one name cannot both win."""
    doc = {"tailorstore_run": 1, "created_at": run.created_at, "base": run.base}
    try:
        backend.put(run_key(run.name), json.dumps(doc).encode(), create_only=True)
    except ObjectExistsError:
        raise StepExistsError(f"run {run.name!r} already exists; ", Call("runs"), " shows the runs.") from None


def listed_runs(backend: Backend, known: dict[str, RunRecord]) -> dict[str, RunRecord]:
    """The run objects, read only when the index does not know them yet (they never change)."""
    out: dict[str, RunRecord] = {}
    for key in backend.list(RUN_PREFIX):
        name = key[len(RUN_PREFIX) :]
        if not RUN_NAME.fullmatch(name) or name in (".", ".."):
            odd_key(key, "run")
            continue
        if name in known:
            out[name] = known[name]
            continue
        try:
            doc = json.loads(backend.get(key))
            fields = {"name": check_run_name(name), "created_at": doc["created_at"], "base": doc.get("base")}
            out[name] = record(RunRecord, fields)
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, TypeError, StoreError) as exc:
            raise CorruptStoreError(f"run object {key} is damaged ({exc}); restore it from a backup") from None
    return out


def write_retention(backend: Backend, run: str, rules: dict[str, Any] | None) -> None:
    """Set (or with None, clear) the retention rules ``run`` carries."""
    key = check_key(RETENTION_PREFIX + check_run_name(run))
    if rules is None:
        backend.delete(key)
    else:
        backend.put(key, json.dumps({"tailorstore_retention": 1, **rules}).encode())


def read_retentions(backend: Backend) -> dict[str, dict[str, Any]]:
    """Run -> the retention rules it carries (keep_last, keep_every, thin)."""
    out: dict[str, dict[str, Any]] = {}
    for key in backend.list(RETENTION_PREFIX):
        name = key[len(RETENTION_PREFIX) :]
        if not RUN_NAME.fullmatch(name) or name in (".", ".."):
            odd_key(key, "retention")
            continue
        try:
            doc = json.loads(backend.get(key))
        except FileNotFoundError:
            continue
        except ValueError as exc:
            raise CorruptStoreError(f"retention object {key} is damaged ({exc}); set it again") from None
        if not isinstance(doc, dict) or doc.pop("tailorstore_retention", None) != 1:
            raise CorruptStoreError(f"retention object {key} is not one this tailorstore reads; upgrade tailorstore")
        out[key[len(RETENTION_PREFIX) :]] = doc
    return out
