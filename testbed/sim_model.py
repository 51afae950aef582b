"""What the store must show after a schedule, from the journal of what each operation reported.

Pure functions over the journal (no store, no process), so the rules can be read and tested alone.
Each operation of a schedule has an interval on one logical clock (``start``: when it was started,
``end``: when it ended) and an outcome: ``ok`` (exit 0), ``failed`` (any other exit) or ``unknown``
(killed: it may have taken effect up to its end, or not). Operations whose intervals overlap (one
stalled while others ran) may have taken effect in either order, so every rule below asks what
*could* be last, and a fresh host's view must be one of those possibilities:

- **I1** a step whose creation was reported (and that nothing could have removed since) exists,
  and checks out byte-exact as the input of a creation that could be its last;
- **I2** a tag or pin whose setting was reported, and that nothing could have moved since, is there;
  gc never removes a step that is surely tagged or pinned throughout the gc;
- **I3** what only failed operations tried to create is not there (a removal, ``rm`` or ``gc``,
  reported failed may have removed part of what it was asked to remove; nothing else may show);
- **I4** a step holds exactly one input: the whole of one save (parts of two tries are never mixed);
- **I7** a step reported removed after every creation that could have made it stays gone (a
  revision, ``metric`` or ``--force``, stalled meanwhile never brings it back); a revision changes
  no ref, so the tag and pin rules above need no revision events;
- **merges** (a composite or an average, named by a tag only merges take): one reported done is
  there as the manifest it reported (its id) and checks out, every blob hash-checked, whatever
  became of its sources since (replaced, removed, dropped or thinned by gc: the merge names its
  blobs itself, I6); one only failed merges tried to make is not there (I3).

I5 and I6 are checked as their consequences: the fresh host's ``verify --deep`` must pass (no
blob a kept manifest needs was deleted) and every step must check out through the same process.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, int]  # (run, step)


@dataclass
class Done:
    """One operation of the journal."""

    op: dict[str, Any]
    start: int
    end: int
    outcome: str  # ok | failed | unknown
    rc: int | None = None
    said: str = ""

    @property
    def kind(self) -> str:
        return str(self.op["op"])

    @property
    def key(self) -> Key | None:
        key = self.op.get("key")
        return (str(key[0]), int(key[1])) if key is not None else None

    @property
    def tried(self) -> bool:
        """It may have taken effect (reported done, or killed)."""
        return self.outcome != "failed"


@dataclass
class Seen:
    """What a fresh host found: each step with its tag, pin, tier and the input it checks out as."""

    steps: dict[Key, dict[str, Any]] = field(default_factory=dict)  # log --json entry + "content"
    merges: dict[str, dict[str, Any]] = field(default_factory=dict)  # tag -> log --json entry + "checks_out"
    verify_rc: int = 0
    verify_said: str = ""


def _could_be_last(events: list[Done], definite: Any = None, tried: Any = None) -> list[Done]:
    """Events that could be the last in effect, in some order consistent with the clock: none of the
    *definite* ones (an ok operation that surely set the value) surely came after it (started after
    it ended). ``tried``: which events may have taken effect at all (default: all but failed ones)."""
    definite = definite or (lambda e: e.outcome == "ok")
    tried = tried or (lambda e: e.tried)
    sure = [e for e in events if definite(e)]
    return [e for e in events if tried(e) and not any(o.start > e.end for o in sure)]


def creations(journal: Iterable[Done], key: Key) -> list[Done]:
    return [d for d in journal if d.kind in ("commit", "finalize", "dcp-save") and d.key == key]


def surely_protected(journal: list[Done], key: Key, during: Done, *, before: bool = False) -> bool:
    """A pin or tag of the step was reported set, and nothing that may undo it came after it before
    ``during`` (a gc) ended: gc must not have removed the step. This holds whenever the setting ran,
    before, during or after the gc: had the gc removed the step first, the setting would have found
    no step and failed (a step that came back was committed again, and that commit is checked).
    ``before``: the setting must have ended before the gc began. That is what keeps a step from
    thinning, which leaves the step there to be pinned or tagged after."""
    pinned = _surely_set(
        journal, during, "pin", lambda d: d.kind in ("unpin", "rm") and d.key == key, key, before=before
    )
    if pinned:
        return True
    for d in journal:
        if d.outcome != "ok" or (before and d.end >= during.start):
            continue
        name = d.op.get("tag")
        if d.kind not in ("tag", "commit") or name is None or d.key != key:
            continue
        movers = [
            e
            for e in journal
            if e is not d
            and e.tried
            and e.end > d.start
            and e.start < during.end
            and (
                (e.kind in ("tag", "untag", "commit") and e.op.get("tag") == name)
                or (e.kind == "rm" and e.key == key)  # a step holds any number of tags: no other moves this one
            )
        ]
        if not movers:
            return True
    return False


def _surely_set(journal: list[Done], during: Done, kind: str, undoes: Any, key: Key, *, before: bool) -> bool:
    for d in journal:
        if d.kind == kind and d.key == key and d.outcome == "ok" and not (before and d.end >= during.start):
            if not any(e.tried and undoes(e) and e.end > d.start and e.start < during.end for e in journal):
                return True
    return False


def removers(journal: list[Done], key: Key) -> list[Done]:
    """Operations that may have removed the step: any ``rm`` of it (a failed one may have got part
    way), and any gc with retention rules that did not surely find it tagged or pinned."""
    out = [d for d in journal if d.kind == "rm" and d.key == key]
    out += [d for d in journal if d.kind == "gc" and d.op.get("drops") and not surely_protected(journal, key, d)]
    return out


def thinners(journal: list[Done], key: Key) -> list[Done]:
    return [
        d
        for d in journal
        if d.kind == "gc" and d.op.get("thins") and not surely_protected(journal, key, d, before=True)
    ]


def check(journal: list[Done], seen: Seen, keys: Iterable[Key], contents: dict[str, set[str]]) -> list[str]:
    """Every way the fresh host's view breaks I1-I4; empty when it holds them all.

    ``contents`` maps each input's name to the names of the inputs it may check out as (a
    finalize's parts name both tries, each whole: the check is that the step is one of them).
    """
    problems: list[str] = []
    if seen.verify_rc != 0:
        problems.append(f"I1/I6: a fresh host's verify --deep failed (exit {seen.verify_rc}): {seen.verify_said}")
    for key in sorted(set(keys) | set(seen.steps)):
        problems += _check_step(journal, seen, key, contents)
    problems += _check_tags(journal, seen)
    problems += _check_merges(journal, seen)
    return problems


def reported_id(d: Done) -> str | None:
    """The manifest id a merge printed (``--json``), when it printed one."""
    found = re.search(r'"id": "([0-9a-f]+)"', d.said)
    return found.group(1) if found else None


def _check_merges(journal: list[Done], seen: Seen) -> list[str]:
    problems = []
    merges = [d for d in journal if d.kind == "merge"]
    for tag in sorted({str(d.op["tag"]) for d in merges} | set(seen.merges)):
        made = [d for d in merges if d.op["tag"] == tag]
        entry = seen.merges.get(tag)
        done = [d for d in made if d.outcome == "ok"]
        if entry is None:
            if done:
                problems.append(f"merges: tag={tag} was reported merged ({_name(done[0])}) but is gone")
            continue
        if not any(d.tried for d in made):
            problems.append(f"I3: tag={tag} is a merge, but every operation that tried to make it failed")
            continue
        ids = {reported_id(d) for d in done}
        if done and entry.get("id") not in ids:
            reported = sorted(map(str, ids))
            problems.append(f"merges: tag={tag} is manifest {entry.get('id')}, not the one reported: {reported}")
        if entry.get("checks_out") is False:
            problems.append(f"merges: tag={tag} does not check out: {entry.get('checkout_said', '')}")
    return problems


def _check_step(journal: list[Done], seen: Seen, key: Key, contents: dict[str, set[str]]) -> list[str]:
    made = creations(journal, key)
    gone = removers(journal, key)
    at = f"{key[0]}:step={key[1]}"
    entry = seen.steps.get(key)
    problems = []
    sure = [c for c in made if c.outcome == "ok" and not any(r.end > c.start for r in gone)]
    if sure and entry is None:
        problems.append(f"I1: {at} was reported committed ({_name(sure[0])}) and nothing removed it, but it is gone")
    if entry is None:
        return problems
    last = _could_be_last(made)
    if not last:
        problems.append(f"I3: {at} exists, but every operation that tried to create it failed")
        return problems
    removed = [r for r in journal if r.kind == "rm" and r.key == key and r.outcome == "ok"]
    if any(all(r.start > c.end for c in made if c.tried) for r in removed):
        problems.append(f"I7: {at} was reported removed after every operation that could have made it, but it is back")
    if entry.get("tier") is not None:
        if not any(t.end > min(c.start for c in made) for t in thinners(journal, key)):
            problems.append(f"I1: {at} is thinned ({entry['tier']}) though no gc could have thinned it")
        return problems
    content = entry.get("content")
    allowed = set().union(*(contents[str(c.op["save"])] for c in last))
    if content is None:
        problems.append(f"I1: {at} exists but does not check out: {entry.get('checkout_said', '')}")
    elif content not in allowed:
        problems.append(
            f"I4/I1: {at} checks out as {content}, not as any input that could be its last: {sorted(allowed)}"
        )
    pins = [d for d in journal if d.kind in ("pin", "unpin", "rm") and d.key == key]
    pins += [c for c in made if not c.op.get("force")]  # a new step starts unpinned; --force keeps the pin
    last_pins = _could_be_last(pins, tried=lambda e: e.tried or e.kind == "rm")  # a failed rm may have got part way
    could = {d.kind == "pin" for d in last_pins}
    if not any(d.outcome == "ok" for d in pins):
        could.add(False)  # what was tried may never have taken effect
    if bool(entry.get("pinned")) not in could:
        problems.append(f"I2/I3: {at} is {'pinned' if entry.get('pinned') else 'not pinned'}, which no order allows")
    return problems


def _check_tags(journal: list[Done], seen: Seen) -> list[str]:
    """Where each tag may be now. Its *setters* (a ``tag`` or tagged ``commit`` of that name puts it
    on their step, an ``untag`` takes it off) decide it: the last one in effect, of those that could
    be last. A *clear* acts only on the step it touches, and only while the tag is there: an ``rm``
    of the step, a gc that may drop it. So a clear of a step the tag was moved away from leaves the
    tag where it was moved (an ``rm`` of step 6 that dropped t1 by name after another host moved t1
    to step 9 is a broken I2). A step holds any number of tags: setting another name on it clears
    none (when it held one, a retag was two objects, and a stop between them could leave both)."""
    names = {d.op.get("tag") for d in journal if d.kind in ("tag", "untag", "commit")} - {None}
    holders = {tag: key for key, entry in seen.steps.items() for tag in entry.get("tags", [])}
    problems = []
    for name in sorted(names):
        moves = [d for d in journal if d.kind in ("tag", "untag", "commit") and d.op.get("tag") == name]

        def clears(d: Done, on: Key) -> bool:
            """Whether ``d`` may take the tag off step ``on``, were the tag there when it ran."""
            if d.kind == "rm":
                return d.key == on and d.tried
            return d.kind == "gc" and bool(d.op.get("drops")) and not surely_protected(journal, on, d)

        last = _could_be_last(
            moves,
            definite=lambda e: e.outcome == "ok",
            tried=lambda e: e.tried,
        )
        could: set[Key | None] = set()
        for d in last:
            on = d.key if d.kind != "untag" else None
            could.add(on)
            if on is not None and any(e is not d and clears(e, on) and e.end > d.start for e in journal):
                could.add(None)  # cleared after it (or while it ran) by what touched its step
        if not any(d.outcome == "ok" for d in moves):
            could.add(None)  # it may never have been set
        if holders.get(name) not in could:
            where = holders.get(name)
            now = f"on {where[0]}:step={where[1]}" if where else "on no step"
            problems.append(f"I2/I3: tag {name!r} is {now}, which no order of the reported operations allows")
    return problems


def _name(d: Done) -> str:
    return f"operation {d.op.get('n')} ({d.kind})"
