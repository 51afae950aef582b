"""Adding metrics to a step after its commit (``tailor metric step=N eval_loss=2.31``).

An evaluation often ends after the save it scored was committed. A manifest object never changes,
so the step gets its next version, with the metrics merged in (a name given again takes the new
value), through the one publisher (store/publish.py), as a thinning does.

Call order: take the store lock shared (no gc between the plan and the change); bring the index
up to date; resolve the step; hand the step's next record, its metrics merged, to ``record_manifest``
as a :class:`Revision`, which publishes it create-only (the commit point; a host that changed the
step meanwhile makes this one lose and change nothing), then its refs, and after ``COMMIT``
deletes the older version (left behind by a crash, it is superseded, and gc deletes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tailorstore.core.errors import LOCK_TIMEOUT, StoreError
from tailorstore.core.metric_values import checked, decode, encode
from tailorstore.core.records import COMMIT
from tailorstore.curate.refs import changing_a_step
from tailorstore.store.publish import Revision, record_manifest
from tailorstore.store.repo import Repository


def add_metrics(
    repo: Repository, selector: str, metrics: Mapping[str, Any], *, lock_timeout: float = LOCK_TIMEOUT
) -> int:
    """Merge ``metrics`` into the step ``selector`` names; returns its manifest."""
    given = checked(metrics)  # refused before anything is locked or written
    if not given:
        raise StoreError("give at least one metric, as NAME=VALUE (eval_loss=2.31)")
    with changing_a_step(repo, "metric", lock_timeout) as lock:
        manifest = repo.resolve(selector)
        record = repo.manifest(manifest)
        if record.origin != COMMIT:
            raise StoreError(f"{selector} is a merge; metrics are recorded with committed steps only")
        text = encode({**decode(record.metrics), **given})
        record_manifest(repo, Revision(replace(record, metrics=text)), fence=lock)
    return manifest
