"""One rank's share of a rank-parallel commit: survey first, then write, then one manifest.

Under ``torch.distributed`` every rank sees the whole save (a shared or node-local folder)
but commits only its own files: ``zero_pp_rank_R_*``, ``rng_state_R.pth`` and DCP's
``__R_K.distcp`` are rank R's, everything else is global rank 0's. Doing that naively would differ from a single-process
commit twice over:

- a bf16 weight (in rank 0's model states) is derived only if its whole FP32 master rounds
  to it, but the master is spread over every rank's optimizer file;
- the same bytes in two ranks' files (Adam's step counters, say) would be written twice.

So a rank first *surveys* its files, writing nothing: it names every piece it would write,
and for every master range it owns, it rounds it and compares it with the matching range of
the weight, in every file that holds the weight. The surveys are exchanged (the caller
gathers them; :mod:`tailorstore.integrations.distributed` does it with torch.distributed), and
two pure functions decide: a blob is written by the lowest rank that has it, and a weight
is derived where the ranks' ranges cover it and all matched. Each rank then writes its
share as a part (store/parts.py), and rank 0 finalizes the step into one manifest. The
result has the same atom rows and blobs as a single-process commit of the same save.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tailorstore.core import atom_types as A
from tailorstore.core.progress import Silent
from tailorstore.core.rounding import rounded
from tailorstore.formats import dcp
from tailorstore.formats.deepspeed import file_rank, is_model_states
from tailorstore.formats.layout import CheckpointLayout
from tailorstore.formats.reader import ReadFile, write_order
from tailorstore.formats.source import InputFile
from tailorstore.ingest.commit import Scan, commit_part, detect_input, scan_checkpoint, step_of, write_files
from tailorstore.ingest.commit_options import CommitOptions, CommitResult
from tailorstore.ingest.derive import is_derivable_weight
from tailorstore.ingest.pieces_ahead import Prepared
from tailorstore.store.codec import content_hash
from tailorstore.store.repo import BlobReader, Repository

WeightKey = tuple[str, str]  # (file path in the checkpoint, parameter)


def owner_of(rel: str) -> int:
    """The global rank that commits a file of the save: its DeepSpeed rank, or the rank that
    wrote a DCP ``__R_K.distcp`` file, else 0."""
    name = PurePosixPath(rel).name
    if "zero_pp_rank_" in name:
        return file_rank(name)
    if dcp.is_distcp(name):
        return dcp.file_rank(name)
    if name.startswith("rng_state_"):
        return _rng_rank(name)
    return 0


def _rng_rank(name: str) -> int:
    digits = name.removeprefix("rng_state_").split(".")[0]
    return int(digits) if digits.isdigit() else 0


@dataclass
class Survey:
    """What one rank tells the others before it writes anything (it must pickle small)."""

    rank: int
    files: list[str]  # the files this rank commits
    new_hashes: set[str] = field(default_factory=set)  # blobs it would write that the store lacks
    ranges: dict[WeightKey, list[tuple[int, int, bool]]] = field(default_factory=dict)  # (start, numel, equal)
    weights: dict[WeightKey, int] = field(default_factory=dict)  # low-precision weights seen, by elements
    layer_bytes: dict[str, int] = field(default_factory=dict)  # raw bytes of each layer in its own files
    # which layer each new blob is a piece of ("" for a file's skeleton, container or whole bytes):
    # under a policy only the stored layers' blobs are written, so only they are shared out
    new_layers: dict[str, set[str]] = field(default_factory=dict)  # blob -> layers


@dataclass
class Share:
    """A rank's scanned files, kept from the survey for the write."""

    layout: CheckpointLayout
    scan: Scan
    step: int
    order: list[str] = field(default_factory=list)  # every file of the step, in the order a commit writes them


def survey(
    repo: Repository, ckpt_dir: Path, options: CommitOptions, rank: int, owns: Callable[[str], bool] | None = None
) -> tuple[Share, Survey]:
    """Scan this rank's files (and the model states that cut them), then name every piece
    and compare every owned master range with its weight. Reads only; writes nothing.
    ``owns`` says which files are this committer's (default: those DeepSpeed's rank ``rank``
    wrote); a node's leader committing its node's staged files owns its node's ranks' files."""
    layout = detect_input(repo, Path(ckpt_dir), part=owns is not None)  # a node's folder lacks other nodes' files
    own = [rel for rel in layout.files if (owns(rel) if owns is not None else owner_of(rel) == rank)]
    helpers = [rel for rel in layout.files if rel not in own and _helps(rel, rank)]
    scan = scan_checkpoint(layout, options.trust_pickles, files=helpers + own)
    step = step_of(options, layout, scan.files)
    weight_files = [f for f in scan.files if any(is_derivable_weight(e, s) for e in f.entries for s in e.segments)]
    mine = dataclasses.replace(layout, files=own)
    own_scan = dataclasses.replace(scan, files=[f for f in scan.files if f.path in own])
    own_scan.layers = frozenset(s.layer for f in own_scan.files for e in f.entries for s in e.segments)
    found = Survey(rank, own)
    for f in own_scan.files:
        for entry in f.entries:
            for seg in entry.segments:
                nbytes = seg.numel * entry.tensor.element_size()
                found.layer_bytes[seg.layer] = found.layer_bytes.get(seg.layer, 0) + nbytes
    namer = _Namer(repo, found.new_hashes)
    with _WeightRanges(weight_files, found) as checker:
        named = write_files(mine, own_scan, own_scan.layers, {}, namer, checker, Silent(), release=False)
    for atom in named.atoms:
        if atom.blob in found.new_hashes:
            found.new_layers.setdefault(atom.blob, set()).add(atom.layer)
    for record in named.files:
        for digest in (record.blob, record.container):
            if digest in found.new_hashes:
                found.new_layers.setdefault(digest, set()).add("")
    return Share(mine, own_scan, step, write_order(layout)), found


def _helps(rel: str, rank: int) -> bool:
    """Files another rank commits that this one reads: the model states (their param_shapes cut
    the optimizer states) and anything holding low-precision weights its masters may derive."""
    name = PurePosixPath(rel).name
    if is_model_states(name):
        return owner_of(rel) in (0, rank)
    return name.endswith(".safetensors")


class _Namer:
    """A writer that only names: every piece hashed, nothing written; the new names collected."""

    def __init__(self, repo: BlobReader, new: set[str]) -> None:
        self.store = repo
        self.new = new

    def _note(self, digest: str) -> str:
        if self.store.blob(digest) is None:
            self.new.add(digest)
        return digest

    def add(self, data: memoryview, *, itemsize: int = 1, is_float: bool = False, digest: str | None = None) -> str:
        return self._note(digest or content_hash(data))

    def add_stream(self, src: InputFile, offset: int, length: int) -> str:
        return self._note(src.hash(offset, length))


class _WeightRanges:
    """Sees this rank's master pieces; compares each, rounded, with the same range of the weight."""

    def __init__(self, weight_files: list[ReadFile], found: Survey) -> None:
        self.found = found
        self._files = weight_files
        self._sources: list[InputFile] = []
        self._where: dict[str, list[tuple[ReadFile, InputFile, A.TensorEntry, A.Segment]]] = {}

    def __enter__(self) -> _WeightRanges:
        for f in self._files:
            src = f.open()
            self._sources.append(src)
            for entry in f.entries:
                for seg in entry.segments:
                    if is_derivable_weight(entry, seg):
                        self._where.setdefault(seg.param, []).append((f, src, entry, seg))
                        self.found.weights[(f.path, seg.param)] = seg.numel
        return self

    def __exit__(self, *exc: object) -> None:
        for src in self._sources:
            src.close()

    def rounding_of(self, seg: A.Segment, dtype: str) -> tuple[str, bool] | None:
        return None  # each range is rounded against its weight in add_piece

    def add_piece(self, seg: A.Segment, dtype: str, prepared: Prepared) -> None:
        piece = prepared.data
        if dtype != "float32" or seg.kind != A.MASTER or not seg.numel:
            return
        for f, src, entry, weight in self._where.get(seg.param, []):
            if seg.start + seg.numel > weight.numel:
                continue
            span = dataclasses.replace(weight, offset=weight.offset + seg.start, numel=seg.numel)
            equal = bytes(rounded(piece, entry.dtype_name)) == bytes(f.piece(src, entry, span))
            self.found.ranges.setdefault((f.path, seg.param), []).append((seg.start, seg.numel, equal))

    def may_derive(self, path: str, param: str) -> bool:
        return False  # the survey names every weight as a blob: the decision needs every rank

    def derivable(self, path: str, seg: A.Segment, weight_hash: str) -> bool:
        return False


def writers(surveys: Sequence[Survey], stored: frozenset[str] | None = None) -> dict[int, frozenset[str]]:
    """Pure: for each rank, the new blobs a lower rank writes (so it does not write them again).
    With ``stored`` (a policy's plan), a rank writes only its new blobs of those layers and of its
    files' own bytes, so only those count as taken: a blob both ranks hold (the optimizer's
    ``step``) is written once, and one a lower rank holds only in a layer it inherits is not
    taken for written (tests/system/test_rank_parallel.py, where a blob both ranks hold is counted once)."""
    taken: set[str] = set()
    out: dict[int, frozenset[str]] = {}
    for s in sorted(surveys, key=lambda s: s.rank):
        writes = s.new_hashes if stored is None else {h for h in s.new_hashes if _written(s, h, stored)}
        out[s.rank] = frozenset(writes & taken)
        taken |= writes
    return out


def _written(survey: Survey, digest: str, stored: frozenset[str]) -> bool:
    layers = survey.new_layers.get(digest)
    return layers is None or any(layer == "" or layer in stored for layer in layers)


def checked_weights(surveys: Sequence[Survey]) -> frozenset[WeightKey]:
    """Pure: the weights whose masters' ranges, from all ranks, cover them and all matched."""
    ranges: dict[WeightKey, list[tuple[int, int, bool]]] = {}
    numel: dict[WeightKey, int] = {}
    for s in surveys:
        numel.update(s.weights)
        for key, found in s.ranges.items():
            ranges.setdefault(key, []).extend(found)
    out = set()
    for key, found in ranges.items():
        cursor = 0
        for start, n, equal in sorted(set(found)):
            if start != cursor or not equal:
                break
            cursor += n
        if key in numel and cursor == numel[key]:
            out.add(key)
    return frozenset(out)


def write_share(
    repo: Repository,
    share: Share,
    options: CommitOptions,
    elsewhere: frozenset[str],
    derived: frozenset[WeightKey],
) -> CommitResult | None:
    """Write this rank's share as a part of the step, under the shared lock. None when the rank
    commits no file (ZeRO 0 keeps everything in rank 0's files)."""
    if not share.layout.files:
        return None
    began = time.perf_counter()
    part_options = dataclasses.replace(options, part=True, step=share.step)
    with repo.lock(exclusive=False, timeout=options.lock_timeout) as lock:
        repo.refresh(lock)
        return commit_part(
            repo,
            str(Path(share.layout.root).resolve()),
            share.layout,
            share.scan,
            share.step,
            part_options,
            lock,
            Silent(),
            began,
            checked_weights=derived,
            elsewhere=elsewhere,
        )
