"""The keys of manifest objects and refs: what each is named, and what a listing of them says.

Every host names the same manifest by the same key, so the key is the truth a listing is read
by (docs/FORMAT.md 3.3):

- ``manifests/<run>/step-<step:020d>-v<n>.json.zst``: a commit; ``--force`` writes v(n+1)
  and then deletes v(n); a reader takes the highest version of a step (:func:`current_of`);
- ``manifests/<run>/step-<step:020d>-v<n>.removed``: the empty marker a removed (or dropping)
  version leaves, so that its version is never taken again;
- ``manifests/<run>/merge-<token>.json.zst``: a merge;
- ``refs/tags/<tag>``: the object key a tag names (mutable; tag bytes outside
  ``[A-Za-z0-9._-]`` are written ``=XX``);
- ``refs/pins/<manifest object name>`` (``refs/pins/<run>/<name>`` for a run other than main):
  present while the manifest is pinned;
- ``refs/runs/<run>``: a run created by name, with its base (create-only JSON);
- ``refs/retention/<run>``: the retention a run carries, which ``gc`` without rules applies (mutable JSON).

Pure naming, plus the listings that only read keys (no object's bytes): the other modules of
this package (document, objects, refs, drop marks, runs, sync) all name their objects here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from tailorstore.core.records import MAIN_RUN
from tailorstore.store.backends.base import Backend, check_key

log = logging.getLogger("tailorstore")

MANIFEST_PREFIX = "manifests/"
TAG_PREFIX = "refs/tags/"
PIN_PREFIX = "refs/pins/"
RUN_PREFIX = "refs/runs/"
RETENTION_PREFIX = "refs/retention/"
COMMIT_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/step-(\d{20})-v(\d+)\.json\.zst")
TAG_KEY = re.compile(r"refs/tags/(?:[A-Za-z0-9._-]|=[0-9A-F]{2})+")  # what tag_key writes
# A removed commit manifest leaves this empty object behind, so that its version is never taken again
# (a cache that still holds the removed manifest's rows under that key would take a new manifest
# under the same key for the old one, and gc would delete the new one's blobs as unreferenced).
REMOVED_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/step-(\d{20})-v(\d+)\.removed")
MERGE_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/merge-[0-9a-f]+\.json\.zst")


def tag_key(tag: str) -> str:
    escaped = "".join(
        chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "._-") else f"={b:02X}" for b in tag.encode()
    )
    return check_key(TAG_PREFIX + escaped)


def tag_of_key(key: str) -> str:
    escaped = key[len(TAG_PREFIX) :]
    return re.sub(rb"=([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), escaped.encode()).decode()


def pin_key(object_key: str) -> str:
    """``refs/pins/<name>`` for run main's manifests (as pins always were, so older readers see them),
    ``refs/pins/<run>/<name>`` for another run's. A pin named by the key's last segment alone was
    shared by every run's step of that number: committing step 8 in a branch deleted main's pin of
    step 8 (section 8, I2)."""
    run, name = run_of_key(object_key), object_key.rsplit("/", 1)[-1]
    return PIN_PREFIX + name if run == MAIN_RUN else check_key(f"{PIN_PREFIX}{run}/{name}")


def pinned_by(pin: str, by_name: dict[str, list[str]]) -> list[str]:
    """The manifest keys a pin object pins (the reading rule of FORMAT.md 3.3): a run's own form pins
    that run's manifest; the plain form pins main's manifest of that name, or, where main has none,
    the other runs' (a branch's pin written before pins named their run)."""
    rest = pin[len(PIN_PREFIX) :]
    if "/" in rest:
        run, _, name = rest.partition("/")
        return [k for k in by_name.get(name, []) if run_of_key(k) == run]
    keys = by_name.get(rest, [])
    mains = [k for k in keys if run_of_key(k) == MAIN_RUN]
    return mains or keys


def keys_by_name(keys: Iterable[str]) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for key in keys:
        by_name.setdefault(key.rsplit("/", 1)[-1], []).append(key)
    return by_name


def listed_manifest_keys(backend: Backend) -> list[str]:
    """Every manifest object the backend lists (versions and merges; not the removal markers)."""
    return [k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k)]


def is_manifest_key(key: str) -> bool:
    return bool(COMMIT_KEY.fullmatch(key) or MERGE_KEY.fullmatch(key))


def key_version(key: str) -> int:
    """The version in a commit manifest's key (0 for a merge's)."""
    match = COMMIT_KEY.fullmatch(key)
    return int(match.group(3)) if match else 0


def step_versions(backend: Backend, run: str, step: int) -> tuple[dict[int, str], set[int]]:
    """One listing of a commit step's objects: its versions (version -> key) and the versions
    whose removal marker is there (removed, or being removed or dropped)."""
    versions: dict[int, str] = {}
    removed: set[int] = set()
    for key in backend.list(f"{MANIFEST_PREFIX}{run}/"):  # a backend lists by folder
        if (m := COMMIT_KEY.fullmatch(key)) and int(m.group(2)) == step:
            versions[int(m.group(3))] = key
        elif (m := REMOVED_KEY.fullmatch(key)) and int(m.group(2)) == step:
            removed.add(int(m.group(3)))
    return versions, removed


def versions_of(backend: Backend, key: str) -> tuple[list[str], list[str]]:
    """The other listed versions of a commit manifest's step: (older than ``key``, newer)."""
    match = COMMIT_KEY.fullmatch(key)
    if match is None:
        return [], []
    versions, _ = step_versions(backend, match.group(1), int(match.group(2)))
    own = int(match.group(3))
    return [k for v, k in sorted(versions.items()) if v < own], [k for v, k in sorted(versions.items()) if v > own]


def same_step(a: str, b: str) -> bool:
    """Whether two manifest keys are versions of one step (a merge's random key: the same key)."""
    first, second = COMMIT_KEY.fullmatch(a), COMMIT_KEY.fullmatch(b)
    if first is None or second is None:
        return a == b
    return first.group(1, 2) == second.group(1, 2)


SUPERSEDED = b"superseded\n"
"""What gc's removal marker of a superseded version holds (others are empty): the step lives on in a
newer version, which a publisher that stalled past its lease must not take back (store/publish.py),
and a ref still naming the version counts for the step."""


def drop_marker(key: str) -> str:
    """The object that says a manifest is being dropped (for a commit manifest, the same object
    that reserves its version once it is gone: :func:`removed_marker`)."""
    return key.removesuffix(".json.zst") + ".removed"


def removed_marker(key: str) -> str | None:
    """The object that reserves a removed commit manifest's version (none for a merge: its key is random)."""
    return key.removesuffix(".json.zst") + ".removed" if COMMIT_KEY.fullmatch(key) else None


def run_of_key(key: str) -> str:
    """The run a manifest object belongs to, from its key."""
    return key[len(MANIFEST_PREFIX) :].split("/", 1)[0]


def current_of(keys: Iterable[str]) -> dict[str, str]:
    """Every manifest key listed -> the key readers take for its step: the highest version of a
    commit's step (older ones are left by a --force or a thinning interrupted before it deleted
    them), a merge's own key. A tag or pin object that names an older version counts for the
    current one, so a replacement that crashed before it wrote its refs keeps the step's tag
    and pin (docs/FORMAT.md 8, I2)."""
    best: dict[tuple[str, int], tuple[int, str]] = {}
    slots: dict[str, tuple[str, int]] = {}
    out: dict[str, str] = {}
    for key in keys:
        match = COMMIT_KEY.fullmatch(key)
        if match is None:
            if MERGE_KEY.fullmatch(key):
                out[key] = key
            continue
        slot = (match.group(1), int(match.group(2)))
        slots[key] = slot
        version = int(match.group(3))
        if slot not in best or best[slot][0] < version:
            best[slot] = (version, key)
    out.update({key: best[slot][1] for key, slot in slots.items()})
    return out


def _current_versions(keys: Iterable[str]) -> set[str]:
    """Of several versions of one step, the highest (see :func:`current_of`)."""
    return set(current_of(keys).values())


def superseded(backend: Backend) -> list[str]:
    """Manifest objects an interrupted ``--force`` or thinning left behind: older versions of a step
    whose newer version is the one readers take. Only gc, under the exclusive lock, deletes them."""
    keys = listed_manifest_keys(backend)
    current = _current_versions(keys)
    return sorted(k for k in keys if k not in current)


def odd_key(key: str, what: str) -> None:
    """A key under refs/ that no tailorstore writes: someone with access to the bucket put it there.
    It names nothing, so it is left alone with a warning, not fatal to every command of the store."""
    log.warning("tailorstore: ignoring %r: no %s object of tailorstore has such a key", key[:200], what)
