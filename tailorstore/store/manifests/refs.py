"""Tags and pins as objects: writing them as the index says, and reading them back.

A tag object holds the key of the manifest it names, then a line of its own (a token unique to the
write); a pin object pins its manifest while it holds anything but :data:`PIN_TOMBSTONE` (an
empty one, as writers before the tokens made it, included). Refs are written only after the
manifest object they name exists (store/manifests/objects.py), and a tag or pin left on an
older version of a step counts for the step's current version (:func:`current_refs`,
``keys.current_of``).

Every write of a ref object is a conditional swap (:func:`put_tag`, :func:`put_pin`): it reads the
object with its version, replaces exactly that version, and returns a :class:`RefWrite` that can
take the write back exactly: only while the object still holds this write's own bytes (the token
makes two hosts' writes of one key differ), and to what it replaced. So a write taken back never
restores what a stale index said, and never undoes another host's write (FORMAT.md 8.1, I2, I3).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from tailorstore.core.errors import (
    Call,
    CorruptStoreError,
    LeaseLostError,
    LockTimeoutError,
    ObjectExistsError,
    StepExistsError,
    first_line,
)
from tailorstore.core.records import MAIN_RUN, ManifestRecord
from tailorstore.store.backends.base import Backend
from tailorstore.store.manifests.keys import (
    COMMIT_KEY,
    PIN_PREFIX,
    SUPERSEDED,
    TAG_KEY,
    TAG_PREFIX,
    current_of,
    drop_marker,
    is_manifest_key,
    keys_by_name,
    listed_manifest_keys,
    odd_key,
    pin_key,
    pinned_by,
    removed_marker,
    run_of_key,
    same_step,
    step_versions,
    tag_key,
    tag_of_key,
    versions_of,
)

log = logging.getLogger("tailorstore")


class RefSource(Protocol):
    """What writing a manifest's refs reads of the index: the manifests, and each one's record.
    Operations hand their role view (it names these two), or the index itself."""

    def manifest(self, manifest: int) -> ManifestRecord | None: ...

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...


def write_refs(
    backend: Backend, index: RefSource, manifests: Iterable[int], *, fence: Callable[[], None] | None = None
) -> list[RefWrite]:
    """Make the tag and pin objects of these manifests say what the index says; returns the
    writes, each to be taken back exactly should the change fail. ``fence`` is checked just before
    each put (after its request's failpoint), as before gc's deletions.

    An unpinned record deletes no pin: the index may not know that another host pinned the
    manifest since (ref changes hold the lock shared, side by side). A commit that did so deleted
    that host's reported pin (the soak, seed 269 on S3); only `unpin` deletes one, and a new main
    manifest takes the plain key over from a branch's legacy pin."""
    written = []
    for m in manifests:
        record = index.manifest(m)
        if record is None or record.object_key is None:
            continue
        for tag in record.tags:
            written.append(put_tag(backend, tag, record.object_key, fence=fence))
        if record.pinned:
            written.append(put_pin(backend, record.object_key, fence=fence))
        else:
            hand_over_plain_pin(backend, index, record.object_key, fence=fence)
    return written


TOMBSTONE = b"dropped\n"
"""What a dropped tag's object holds: it names no manifest, so it tags nothing. It stays until the
tag is set again over it (deleted by name, a late delete could take a tag written over it since)."""

PIN_TOMBSTONE = b"unpinned\n"
"""What a pin object holds once a failed pin took its write back: it pins nothing, and stays (as a
tag's tombstone does) until the step is pinned again, unpinned or dropped."""

_SWAP_TRIES = 5  # reads and conditional puts of one ref before another host's writes are said to win


@dataclass(frozen=True)
class RefWrite:
    """One ref object's write: its key, this write's bytes, and what it replaced (None: nothing).
    A write is known by its token (:func:`token_of`), which a carry by gc keeps."""

    key: str
    ours: bytes
    before: bytes | None
    gone: bytes  # what stands for "nothing" here: the tag or pin tombstone

    @property
    def token(self) -> bytes:
        return token_of(self.ours)

    def holds(self, data: bytes) -> bool:
        """Whether ``data`` is this write (as put, or as a gc's carry rewrote it)."""
        return bool(self.token) and token_of(data) == self.token

    def holds_now(self, backend: Backend) -> bool:
        """Whether the object still holds this write (a change that could not settle or take back
        reports what it left)."""
        try:
            return self.holds(read_ref(backend, self.key)[0])
        except FileNotFoundError:
            return False

    def take_back(self, backend: Backend, *, fence: Callable[[], None] | None = None) -> None:
        """Put back what this write replaced, only while the object still holds this write (another
        host's write since stays), fenced (store/lock.py, fence_for_follow_up: a lease lost meanwhile
        is raised, the write left). Otherwise best effort: it runs when the change fails anyway. An
        object gone (its version deleted by gc) holds nothing to take back. A tag is put back as a
        ref change is written (:meth:`_put_tag_back`)."""
        try:
            data, version = read_ref(backend, self.key)
        except FileNotFoundError:
            return
        try:
            if not self.holds(data):
                return
            if self.key.startswith(TAG_PREFIX) and self.before not in (None, TOMBSTONE):
                self._put_tag_back(backend, data, version, fence)
            else:
                backend.put_if(self.key, self.before if self.before is not None else self.gone, version, fence=fence)
        except LeaseLostError:
            raise
        except Exception as exc:  # the change's own failure is what the caller reports
            log.warning("tailorstore: could not take back %s after a failed change: %s", self.key, first_line(exc))

    def _put_tag_back(self, backend: Backend, data: bytes, version: str, fence: Callable[[], None] | None) -> None:
        """A tag put back is a ref write like any other: it names the standing version of the step it
        named (the one it named then may have been retired, superseded or withdrawn since), and that
        version is read again after the put (write, then read, as a dropper marks, then reads). Where
        no version of that step stands (removed, being dropped), this write stays, its own bytes put
        back if need be, and the caller reports what it left: put back blindly, the tag named a
        deleted version, tagged nothing, and gc dropped the step)."""
        assert self.before is not None
        mine, was = data, named(self.before)  # this write as it stands (a carry may have moved it)
        for _ in range(_SWAP_TRIES):
            target = standing_version(backend, was) if is_manifest_key(was) else None
            if target is None:  # nowhere to go back to: this write stays
                if data != mine:
                    backend.put_if(self.key, mine, version, fence=fence)
                return
            restored = renamed(self.before, target) if target != named(self.before) else self.before
            if not backend.put_if(self.key, restored, version, fence=fence):
                return  # another host wrote it meanwhile: theirs stands
            if standing_version(backend, target) == target:
                return
            data, version = read_ref(backend, self.key)
            if data != restored:
                return
            was = target  # the version put back went meanwhile: look again
        raise LockTimeoutError(f"{self.key} could not be put back: its step kept changing.")


def standing_version(backend: Backend, key: str) -> str | None:
    """The version of ``key``'s step a ref must name now: its newest listed version that carries no
    drop marker; None when every listed one carries one (a gc or ``rm`` is dropping the step) or none
    is listed (it is gone). A version a gc superseded or a revision retired has a newer one, and one
    a failed publication withdraws an older one, so their markers never make a ref fail: the ref
    moves on with the step. A merge has one version, its own key."""
    match = COMMIT_KEY.fullmatch(key)
    if match is None:
        return key if backend.exists(key) and not backend.exists(drop_marker(key)) else None
    versions, removed = step_versions(backend, match.group(1), int(match.group(2)))
    standing = [v for v in versions if v not in removed]
    return versions[max(standing)] if standing else None


def token_of(data: bytes) -> bytes:
    """The token of the write that made a tag or pin object: a tag's second line, a pin's second word
    (empty for objects written before tokens, and for tombstones)."""
    head = data[:4096]
    if head.startswith(b"pinned "):
        return head[len(b"pinned ") :].strip()
    lines = head.split(b"\n")
    return lines[1].strip() if len(lines) > 1 else b""


REF_MOST = 64 << 10  # bytes of a ref object read whole, at most: tailorstore writes well under one KiB


def read_ref(backend: Backend, key: str) -> tuple[bytes, str]:
    """A ref object's bytes and version, read whole only within :data:`REF_MOST` (its size asked
    first): a huge object where a ref belongs is damage, refused in one line, not read into memory."""
    size = backend.size(key)
    if size > REF_MOST:
        raise CorruptStoreError(
            f"{key} holds {size} bytes, which no ref tailorstore writes does: it was written behind the "
            "store's back. Delete that object, then set the tag or pin again."
        )
    return backend.get_versioned(key)


def named(data: bytes) -> str:
    """The manifest key a tag object names: its first line (a token of the write may follow)."""
    return data[:4096].split(b"\n", 1)[0].decode(errors="replace")


def put_tag(
    backend: Backend,
    tag: str,
    manifest_key: str,
    *,
    force: bool = True,
    fence: Callable[[], None] | None = None,
) -> RefWrite:
    """Tag the manifest whose object is ``manifest_key``: one object, whatever tags the step holds
    already (a step holds any number; a tag names one step, so putting it moves it). Without
    ``force``, a tag another host set on another step meanwhile (which this host's index did not
    know) is refused, not overwritten."""

    def refuse(held: bytes | None) -> None:
        if force or held is None or held == TOMBSTONE:
            return
        target = named(held)
        if not is_manifest_key(target) or same_step(target, manifest_key) or not _still_there(backend, target):
            return  # damaged, this step's, or a removed step's: nothing another host reported holds it
        raise StepExistsError(
            f"tag {tag!r} was set on another step by another host meanwhile; choose another tag, or move it: ",
            Call("tag", "STEP", tag, force=True),
        )

    return _swap(backend, tag_key(tag), f"{manifest_key}\n{secrets.token_hex(8)}\n".encode(), TOMBSTONE, fence, refuse)


def put_pin(backend: Backend, manifest_key: str, *, fence: Callable[[], None] | None = None) -> RefWrite:
    """Pin the manifest whose object is ``manifest_key``: a pin object of this write's own, over
    whatever was there (another host's pin of the step too: taking this one back restores that)."""
    return _swap(backend, pin_key(manifest_key), f"pinned {secrets.token_hex(8)}\n".encode(), PIN_TOMBSTONE, fence)


def _swap(
    backend: Backend,
    key: str,
    ours: bytes,
    gone: bytes,
    fence: Callable[[], None] | None,
    refuse: Callable[[bytes | None], None] = lambda held: None,
) -> RefWrite:
    """Replace exactly what was read: create-only where there was nothing, else ``If-Match`` on the
    version read; a refused put means another host wrote meanwhile, so read again."""
    for _ in range(_SWAP_TRIES):
        try:
            before, version = read_ref(backend, key)
        except FileNotFoundError:
            before, version = None, ""
        refuse(before)
        if before is None:
            try:
                backend.put(key, ours, create_only=True, fence=fence)
                return RefWrite(key, ours, None, gone)
            except ObjectExistsError:
                continue
        if backend.put_if(key, ours, version, fence=fence):
            return RefWrite(key, ours, before, gone)
    raise LockTimeoutError(
        f"{key} could not be set: other hosts changed it {_SWAP_TRIES} times meanwhile, or it holds what "
        "tailorstore does not write (a folder?). Run it again, or remove that object."
    )


def _still_there(backend: Backend, key: str) -> bool:
    """Whether the step ``key`` names is still stored: this version, or a newer one that superseded
    it. A version removed (``rm``, a retirement: an empty removal marker) names nothing, whatever
    was committed as that step since."""
    if backend.exists(key):
        return True
    marker = removed_marker(key)
    if marker is not None:
        try:
            if backend.get(marker) != SUPERSEDED:
                return False
        except FileNotFoundError:
            pass
    _, newer = versions_of(backend, key)
    return bool(newer)


def pin_live(backend: Backend, key: str) -> bool:
    """Whether the pin object ``key`` pins: there, and no tombstone, which is known by its size
    (no writer makes a pin of that size that is no tombstone; :func:`pinned_keys` reads the same rule
    off a listing). An empty one (every pin before the tokens) pins, and so does one too large for a
    ref (damage fails safe: gc keeps the step)."""
    try:
        return backend.size(key) != len(PIN_TOMBSTONE)
    except FileNotFoundError:
        return False


def write_pin(backend: Backend, index: RefSource, manifest: int, *, fence: Callable[[], None] | None = None) -> None:
    """The manifest's pin object, put or dropped as the index says; nothing else of its refs."""
    record = index.manifest(manifest)
    if record is None or record.object_key is None:
        return
    if record.pinned:
        put_pin(backend, record.object_key, fence=fence)
    else:
        _unpin(backend, index, record.object_key, fence)


def drop_pin(backend: Backend, pin: str, *, fence: Callable[[], None] | None = None) -> None:
    """Unpin: the pin object replaced by :data:`PIN_TOMBSTONE` on exactly the version read
    (``put_if``: S3 ``If-Match``), fenced, never deleted by name. A pin another host wrote after the
    read stays; an unpin that stalled past its lease writes nothing (a delete by name, unfenced,
    took a pin set after the lease lapsed, and gc then dropped the step)."""
    for _ in range(_SWAP_TRIES):
        try:
            data, version = read_ref(backend, pin)
        except FileNotFoundError:
            return
        if data == PIN_TOMBSTONE:
            return
        if backend.put_if(pin, PIN_TOMBSTONE, version, fence=fence):
            return
    raise LockTimeoutError(f"{pin} could not be unpinned: other hosts changed it {_SWAP_TRIES} times meanwhile.")


def drop_tag(backend: Backend, tag: str, held_by: str, *, fence: Callable[[], None] | None = None) -> bool:
    """Drop ``tag`` from the step whose manifest key is ``held_by``, only while the tag's object still
    names that step (any version of it): another host may have moved the tag to another step since
    this host's index said where it was (``tag --force``), and that move was reported done. The
    object is read with its version and replaced by a tombstone only while it has that version
    (``put_if``: S3 ``If-Match``), never deleted by name, and the tombstone stays (docs/FORMAT.md
    3.3). Returns whether this call dropped it."""
    key = tag_key(tag)
    for _ in range(3):  # a refused replace means another host wrote it meanwhile: look again
        try:
            data, version = read_ref(backend, key)
        except FileNotFoundError:
            return False
        if data == TOMBSTONE or not same_step(named(data), held_by):
            return False  # untagged already, or the tag now names another step: leave it there
        if backend.put_if(key, TOMBSTONE, version, fence=fence):
            return True
    return False


def hand_over_plain_pin(
    backend: Backend, index: RefSource, key: str, *, fence: Callable[[], None] | None = None
) -> None:
    """A main manifest whose name another run's pinned manifest has, pinned under the plain key by
    a writer before pins named their run: that run gets its own form, and the plain key is main's.
    Only an empty plain pin can be such a one (writers before pins named their run wrote no token);
    one with a token was written for main's key by this tailorstore, another host's pin of this new
    step, and stays (handed over, it was deleted, and gc dropped the step). The legacy pin is
    replaced by a tombstone on exactly the version read."""
    if run_of_key(key) != MAIN_RUN:
        return
    name = key.rsplit("/", 1)[-1]
    namesakes = [
        m.object_key
        for m in index.manifests()
        if m.pinned and m.object_key not in (None, key) and str(m.object_key).endswith("/" + name)
    ]
    if not namesakes:
        return
    plain = PIN_PREFIX + name
    try:
        data, version = read_ref(backend, plain)
    except FileNotFoundError:
        return
    if data != b"":
        return
    for other in namesakes:
        put_pin(backend, str(other), fence=fence)
    backend.put_if(plain, PIN_TOMBSTONE, version, fence=fence)


def _unpin(backend: Backend, index: RefSource, key: str, fence: Callable[[], None] | None) -> None:
    """Drop the pin of ``key``, and then those of the step's other versions: a pin left on an
    older version counts for the newest (``keys.current_of``; a revision leaves it there), and one
    on a newer version than this host's index knows pins the step as well. A plain-form pin may
    also be what pins another run's manifest of the same name (one written before pins named their
    run): those the index holds pinned get a pin of their own first."""
    _unpin_one(backend, index, key, fence)
    older, newer = versions_of(backend, key)
    for other in (*older, *newer):
        drop_pin(backend, pin_key(other), fence=fence)


def _unpin_one(backend: Backend, index: RefSource, key: str, fence: Callable[[], None] | None) -> None:
    pin = pin_key(key)
    name = key.rsplit("/", 1)[-1]
    if run_of_key(key) != MAIN_RUN:
        drop_pin(backend, pin, fence=fence)
        plain = PIN_PREFIX + name
        # every listed version, not the index's current ones: main's older version of that name,
        # which a revision left holding main's pin, makes the plain pin main's, not this branch's
        holders = keys_by_name(listed_manifest_keys(backend))
        if key not in pinned_by(plain, holders) or not pin_live(backend, plain):
            return
        pin = plain  # main has no manifest of that name: the plain pin was this branch's
    for other in index.manifests():
        if other.pinned and other.object_key and other.object_key != key and other.object_key.endswith("/" + name):
            put_pin(backend, other.object_key, fence=fence)
    drop_pin(backend, pin, fence=fence)


def carry_refs(backend: Backend, superseded: list[str], *, fence: Callable[[], None] | None = None) -> None:
    """Before gc deletes superseded versions: each ref still on one of them moves to its step's
    current version, so a pin or tag left on an old version outlives it. From the objects, not an
    index, and only while a tag's object still names that version (a conditional swap, fenced): a
    gc whose lease lapsed while another host moved or dropped the tag writes nothing over that
    (written from the index, its carry undid a reported ``tag --force`` and came back after an
    ``untag``). Carrying changes no step's refs, only the version they name."""
    if not superseded:
        return
    current = current_of(listed_manifest_keys(backend))
    heirs = {key: current[key] for key in superseded if current.get(key, key) != key}
    for tag, target in listed_tags(backend, log_damaged=False).items():
        if target in heirs:
            _move_tag(backend, tag, target, heirs[target], fence)
    for key, heir in heirs.items():
        if pin_live(backend, pin_key(key)) and not pin_live(backend, pin_key(heir)):
            _copy_pin(backend, pin_key(key), pin_key(heir), fence)


def _copy_pin(backend: Backend, source: str, target: str, fence: Callable[[], None] | None) -> None:
    """The pin object ``source`` written at ``target`` as it is (its write's token kept), over nothing
    or a tombstone only: a live pin there already pins the step."""
    try:
        data = backend.get(source) if backend.size(source) else b""
    except FileNotFoundError:
        return
    _swap(backend, target, data, PIN_TOMBSTONE, fence)


def _move_tag(backend: Backend, tag: str, was: str, heir: str, fence: Callable[[], None] | None) -> None:
    key = tag_key(tag)
    for _ in range(_SWAP_TRIES):
        try:
            data, version = read_ref(backend, key)
        except FileNotFoundError:
            return
        if data == TOMBSTONE or named(data) != was:
            return  # dropped or moved since it was listed: it stays as the other host left it
        # the write's own token stays: the host that wrote it still knows it as its own (RefWrite)
        if backend.put_if(key, renamed(data, heir), version, fence=fence):
            return


def renamed(data: bytes, target: str) -> bytes:
    """A tag object's bytes naming ``target`` instead, its write's token kept."""
    rest = data.split(b"\n", 1)[1] if b"\n" in data else b""
    return f"{target}\n".encode() + (rest if rest.strip() else f"{secrets.token_hex(8)}\n".encode())


def listed_tags(backend: Backend, *, log_damaged: bool = True) -> dict[str, str]:
    """Tag -> the manifest object key it names, from the tag objects (several tags may name one
    key: a step holds any number). Bytes that are not UTF-8 name no key, and are
    ignored as any tag naming a key that does not exist is (docs/FORMAT.md 3.3), not a decode error
    that stopped every command of the store."""
    out: dict[str, str] = {}
    for key, target in _tag_targets(backend, log_damaged=log_damaged):
        if log_damaged and not is_manifest_key(target) and key not in _WARNED:
            _WARNED.add(key)
            log.warning(
                "tailorstore: tag object %s is damaged: it names no manifest object, so its tag keeps no step "
                "(gc refuses to run until it is set again or removed)",
                key[:200],
            )
        out[tag_of_key(key)] = target
    return out


def _tag_targets(backend: Backend, *, log_damaged: bool) -> Iterator[tuple[str, str]]:
    """(tag object key, the key its bytes name) for every tag object of a key tailorstore writes,
    tombstones left out (a dropped tag tags nothing and is no damage)."""
    for key, size in backend.sizes(TAG_PREFIX):
        if not TAG_KEY.fullmatch(key):
            if log_damaged:
                odd_key(key, "tag")
            continue
        if size == len(TOMBSTONE):  # known by its size, unread: tombstones stay, and every open reads the tags
            continue
        try:  # a key is short: a huge object is damaged whatever it ends with
            data = backend.get(key, 0, 4096)
        except FileNotFoundError:  # untagged while we listed
            continue
        if data != TOMBSTONE:
            yield key, named(data)


_WARNED: set[str] = set()  # each damaged tag object is named once a process


def damaged_tags(backend: Backend) -> list[str]:
    """The tags whose objects name no manifest object at all (not a step since removed: bytes that
    are no key). gc refuses to run while there is one: it cannot tell which step that tag keeps
    (docs/FORMAT.md 8.1, I2)."""
    return [tag_of_key(key) for key, target in _tag_targets(backend, log_damaged=False) if not is_manifest_key(target)]


def pinned_keys(backend: Backend, current: dict[str, str]) -> list[str]:
    """The manifest keys the pin objects pin (``keys.pinned_by``)."""
    by_name = keys_by_name(current)
    # a pin object pins unless it is a tombstone, known by its size unread (tombstones stay, and
    # every gc and ref change reads the pins); of any other size it pins without a read
    return [
        key for pin, size in backend.sizes(PIN_PREFIX) if size != len(PIN_TOMBSTONE) for key in pinned_by(pin, by_name)
    ]


def current_refs(tags: dict[str, str], current: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The current version of each tagged step -> its tags, sorted (:func:`listed_tags` gives
    tag -> the key it names). A tag left on an older version of a step counts for the current one
    (``keys.current_of``). Each tag stands alone: a step holds any number, so a retag is one object
    and two hosts tagging one step at once both keep their tag (when a step held one tag, one of
    two such tags was invisible though both were reported set)."""
    out: dict[str, list[str]] = {}
    for tag, key in sorted(tags.items()):
        out.setdefault(current.get(key, key), []).append(tag)
    return {key: tuple(names) for key, names in out.items()}
