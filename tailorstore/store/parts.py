"""Parts: what one host (or one rank) committed of a step that several write together.

A part is an immutable, create-only object ``parts/<run>/step-<step:020d>/<token>.json.zst``,
written after every blob it names is durable. It holds the part's file and atom records,
the rows of the blobs they use, and the facts its files told (layout, tag folder, ZeRO
stage, world size). A part is not a manifest: no command sees it as a step. ``finalize``
reads every part of a step, checks that together they hold every rank's files, records one
manifest, and only then deletes the parts. gc keeps every blob a part names, so a part
waits safely for its finalize (``tailor gc --drop-parts`` drops abandoned ones).
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zstandard

from tailorstore.core.environment import TRY_ENV
from tailorstore.core.errors import CorruptStoreError, StoreError
from tailorstore.core.records import (
    ATOM_COLUMNS,
    DOC_BLOB_COLUMNS,
    FILE_COLUMNS,
    MAIN_RUN,
    AtomRecord,
    BlobRecord,
    FileRecord,
    check_rows,
    from_table,
    to_table,
)
from tailorstore.store.backends.base import Backend, check_key
from tailorstore.store.codec import decompress_bounded

PART_PREFIX = "parts/"
READERS = 16  # parts fetched at once: requests that wait on the network, not on a core
DOC_VERSION = 1
PLANNED_VERSION = 2  # a part that carries a plan: a reader that knows no plans must refuse it
_PART_KEY = re.compile(r"parts/([A-Za-z0-9._-]+)/step-(\d{20})/([A-Za-z0-9._-]+)\.json\.zst")


@dataclass
class Part:
    """One part, as written or as read back."""

    step: int
    layout: str
    ds_tag: str | None
    facts: dict[str, int]  # zero_stage, world_size, global_steps: what the part's files said
    source: str  # the directory this part was committed from (host:path)
    created_at: float
    raw_bytes: int
    new_bytes: int
    files: list[FileRecord] = field(default_factory=list)
    atoms: list[AtomRecord] = field(default_factory=list)
    blobs: list[BlobRecord] = field(default_factory=list)
    key: str = ""
    run: str = MAIN_RUN  # the run the step belongs to (its key says it)
    label: str = ""  # what its key begins with instead of the host name: one save's parts share it
    plan: dict | None = None  # a rank-parallel commit's decision under a policy (section 8); None: every layer
    attempt: str = ""  # the try token every part of one try of the save carries ("": none, an older part)

    def blob_hashes(self) -> set[str]:
        """Every hash this part needs kept: its files, containers and stored atoms."""
        out = {f.blob for f in self.files} | {f.container for f in self.files if f.container}
        return out | {a.blob for a in self.atoms if a.derived is None}


def step_prefix(step: int, run: str) -> str:
    return f"{PART_PREFIX}{run}/step-{step:020d}/"


LABEL = re.compile(r"[A-Za-z0-9._-]{1,120}")
_MEMBER = re.compile(r"(.+)-n\d{1,9}")  # an integration's label of one member: SAVE-nRANK


def try_token(label: str = "") -> str:
    """The try token of a part committed now: ``$TAILOR_TRY`` (each host of one try is given the
    same), else its label without a member's ``-nRANK`` (a save's label, which every part of that
    save begins with: unique to one start of the job), else none. FORMAT.md 8.1, I4."""
    given = os.environ.get(TRY_ENV, "")
    if given:
        if not LABEL.fullmatch(given):
            raise StoreError(f"{TRY_ENV}={given[:130]!r}: use 1 to 120 letters, digits, '.', '_' or '-'")
        return given
    if not label:
        return ""
    member = _MEMBER.fullmatch(label)
    return member.group(1) if member else label


def new_key(step: int, run: str, label: str = "") -> str:
    """``parts/<run>/step-<step>/<label or host>-<random>.json.zst``."""
    if label and not LABEL.fullmatch(label):
        raise StoreError(f"part label {label[:130]!r}: use 1 to 120 letters, digits, '.', '_' or '-'")
    first = label or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40] or "host"
    return check_key(f"{step_prefix(step, run)}{first}-{os.urandom(6).hex()}.json.zst")


def labelled(key: str, label: str | None) -> bool:
    """Whether the part at ``key`` was published with ``label`` (None: every part)."""
    return label is None or key.rsplit("/", 1)[-1].startswith(f"{label}-")


def encode(part: Part) -> bytes:
    doc = {
        "tailorstore_part": DOC_VERSION,
        "step": part.step,
        "layout": part.layout,
        "ds_tag": part.ds_tag,
        "facts": part.facts,
        "source": part.source,
        "created_at": part.created_at,
        "raw_bytes": part.raw_bytes,
        "new_bytes": part.new_bytes,
        "files": to_table(part.files, FILE_COLUMNS),
        "atoms": to_table(part.atoms, ATOM_COLUMNS),
        "blobs": to_table(part.blobs, DOC_BLOB_COLUMNS),
    }
    if part.attempt:  # older readers ignore it, and fall back to comparing shared files
        doc["try"] = part.attempt
    if part.plan is not None:
        doc["plan"] = part.plan
        doc["tailorstore_part"] = PLANNED_VERSION
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())


_TABLES = (("files", FileRecord), ("atoms", AtomRecord), ("blobs", BlobRecord))


def decode(data: bytes, key: str) -> Part:
    try:
        doc = json.loads(decompress_bounded(data, 1 << 31))
        version = doc.get("tailorstore_part") if isinstance(doc, dict) else None
        if version not in (DOC_VERSION, PLANNED_VERSION) or (version == PLANNED_VERSION) != ("plan" in doc):
            raise ValueError("not a part this tailorstore reads")
        files, atoms, blobs = (from_table(doc[n], c) for n, c in _TABLES)
        check_rows(files, atoms, blobs)
        named = _PART_KEY.search(key)
        if named is not None and int(named.group(2)) != int(doc["step"]):
            raise ValueError(
                f"it holds step {int(doc['step'])} where its name says step {int(named.group(2))}: it was copied "
                "or changed behind the store's back"
            )
        return Part(
            step=int(doc["step"]),
            layout=doc["layout"],
            ds_tag=doc["ds_tag"],
            facts={k: int(v) for k, v in doc["facts"].items()},
            source=doc["source"],
            created_at=float(doc["created_at"]),
            raw_bytes=int(doc["raw_bytes"]),
            new_bytes=int(doc["new_bytes"]),
            files=files,
            atoms=atoms,
            blobs=blobs,
            key=key,
            run=key[len(PART_PREFIX) :].split("/", 1)[0],
            plan=_plan(doc.get("plan")),
            attempt=_attempt(doc.get("try", "")),
        )
    except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
        raise CorruptStoreError(f"part object {key} is damaged ({exc}); delete it and commit that part again") from None


def _attempt(found: object) -> str:
    if not isinstance(found, str) or (found and not LABEL.fullmatch(found)):
        raise ValueError("its try token is not 1 to 120 letters, digits, '.', '_' or '-'")
    return found


def _plan(found: object) -> dict | None:
    """A part's plan, read as input from a stranger: every field of the type section 8 gives it."""
    if found is None:
        return None
    if not isinstance(found, dict) or set(found) != {"policy", "stored", "inherited", "changes"}:
        raise ValueError("its plan is not an object of policy, stored, inherited and changes")
    policy, stored, inherited, changes = found["policy"], found["stored"], found["inherited"], found["changes"]
    if not (isinstance(policy, dict) and isinstance(policy.get("name"), str)):
        raise ValueError("its plan's policy names no policy")
    if not (isinstance(stored, list) and all(isinstance(x, str) for x in stored)):
        raise ValueError("its plan's stored layers are not a list of names")
    if not isinstance(inherited, dict) or not all(
        isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and isinstance(v[1], str)
        and isinstance(v[2], int) and not isinstance(v[2], bool)
        for v in inherited.values()
    ):  # fmt: skip
        raise ValueError("its plan's inherited layers are not [manifest, source, step] triples")
    if not isinstance(changes, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in changes.values()
    ):
        raise ValueError("its plan's changes are not numbers")
    return {"policy": policy, "stored": stored, "inherited": inherited, "changes": changes}


def part_keys(backend: Backend, step: int | None = None, run: str = MAIN_RUN, label: str | None = None) -> list[str]:
    prefix = PART_PREFIX if step is None else step_prefix(step, run)
    return sorted(k for k in backend.list(prefix) if _PART_KEY.fullmatch(k) and labelled(k, label))


def read_parts(backend: Backend, step: int | None = None, run: str = MAIN_RUN, label: str | None = None) -> list[Part]:
    """Every part (of one step of ``run``; with no step, of every run; with ``label``, only the
    parts published with it), read back; a part deleted while listing is skipped. The parts are
    fetched :data:`READERS` at a time: a step of many hosts' parts costs about one round trip."""

    def fetch(key: str) -> Part | None:
        try:
            return decode(backend.get(key), key)
        except FileNotFoundError:
            return None

    keys = part_keys(backend, step, run, label)
    if len(keys) <= 1:
        found = [fetch(k) for k in keys]
    else:
        with ThreadPoolExecutor(min(READERS, len(keys)), thread_name_prefix="tailor-parts") as pool:
            found = list(pool.map(fetch, keys))
    return [p for p in found if p is not None]


def publish(backend: Backend, part: Part, *, fence: Callable[[], None] | None = None) -> str:
    """Write the part, create-only; its blobs must be durable already. ``fence`` is checked just
    before the put, after its request's failpoint."""
    part.key = new_key(part.step, part.run, part.label)
    backend.put(part.key, encode(part), create_only=True, fence=fence)
    return part.key
