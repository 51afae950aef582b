"""Fast tests of the pure functions and of store checks that need no training."""

from __future__ import annotations

import json
import math
import pickle
import re
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tailorstore.access import structure
from tailorstore.core import atom_types as A
from tailorstore.core.errors import (
    BackendError,
    BadCheckpointError,
    CorruptStoreError,
    MergeSpecError,
    PolicyError,
    RecordError,
    StoreError,
    UnknownStepError,
)
from tailorstore.core.object_keys import check_name
from tailorstore.core.policies import PARAMETERS, POLICIES, CommitFacts, PolicySpec, decide, policy_spec
from tailorstore.core.records import LayerRecord, ManifestRecord, from_table, record
from tailorstore.curate.gc import Retention, kept_manifests
from tailorstore.curate.merge import parse_spec
from tailorstore.formats.layout import check_files
from tailorstore.formats.safetensors_file import parse_header
from tailorstore.formats.skeleton import split_tensors
from tailorstore.formats.source import Identity
from tailorstore.store.backends.s3 import S3Backend
from tailorstore.store.repo import Repository, check_step

BLOCKS = [f"block.{i}" for i in range(6)]
LAYERS = frozenset([*BLOCKS, "embedding", "final_norm", "lm_head", "state"])
AUX = {"embedding", "final_norm", "lm_head", "state"}


# -- policies -------------------------------------------------------------------------------


def facts(index: int, changes: dict[str, float] | None = None, inheritable: frozenset[str] = LAYERS) -> CommitFacts:
    return CommitFacts(LAYERS, index, inheritable - {"state"}, changes)


def test_first_commit_stores_everything_whatever_the_policy() -> None:
    for name in ("full", "parity", "filter", "adaptive", "budget"):
        assert decide(PolicySpec(name, {"threshold": 1e9, "fraction": 0.01}), facts(0)) == LAYERS


def test_parity_alternates_blocks_and_the_aux_groups_join_the_lighter_half() -> None:
    # no sizes known: the aux groups alternate by count, in layer order
    assert decide(PolicySpec("parity"), facts(1)) == {"state", "final_norm", "block.1", "block.3", "block.5"}
    assert decide(PolicySpec("parity"), facts(2)) == {"state", "embedding", "lm_head", "block.0", "block.2", "block.4"}
    # a large vocabulary: embedding and head outweigh a half of the blocks and split between the halves
    sizes = {**dict.fromkeys(BLOCKS, 100), "embedding": 500, "lm_head": 500, "final_norm": 1, "state": 50}
    odd, even = (decide(PolicySpec("parity"), CommitFacts(LAYERS, i, LAYERS - {"state"}, None, sizes)) for i in (1, 2))
    big = {"embedding", "lm_head"}
    assert (odd & big, even & big) in (({"embedding"}, {"lm_head"}), ({"lm_head"}, {"embedding"}))
    assert odd & even == {"state"} and odd | even == LAYERS  # every group every other commit
    weights = [sum(sizes[name] for name in half - {"state"}) for half in (odd, even)]
    assert abs(weights[0] - weights[1]) <= 1, weights


def test_filter_keeps_edges_and_the_middle_every_e_th_commit() -> None:
    spec = PolicySpec("filter", {"keep_first": 1, "keep_last": 2, "every": 3})
    assert decide(spec, facts(1)) == AUX | {"block.0", "block.4", "block.5"}
    assert decide(spec, facts(3)) == LAYERS
    with pytest.raises(PolicyError):
        decide(PolicySpec("filter", {"every": 0}), facts(1))


def test_adaptive_stores_exactly_the_blocks_that_moved_enough() -> None:
    changes = {"block.0": 0.5, "block.1": 1e-4, "block.2": 2e-3, "block.3": 1e-3, "block.4": 0.0}
    chosen = decide(PolicySpec("adaptive", {"threshold": 1e-3}), facts(4, changes))
    # block.5 has no measured change (nothing to compare with): stored, to be safe.
    assert chosen == AUX | {"block.0", "block.2", "block.3", "block.5"}
    for bad in (-1, float("nan"), float("inf")):  # nan and inf would never store a block again
        with pytest.raises(PolicyError, match="a finite number"):
            decide(PolicySpec("adaptive", {"threshold": bad}), facts(1, changes))


def test_a_layer_whose_change_is_nan_is_stored() -> None:
    """A master gone NaN makes its change NaN, which is below no threshold and sorts nowhere:
    inherited, the step's checkout would hold the older, healthy weights instead of what training
    held. adaptive and budget store it, as they store a layer whose change was not measured."""
    changes = {"block.0": math.nan, "block.1": 1e-4, "block.2": 1e-4, "block.3": 1e-4, "block.4": 1e-4}
    changes |= {"block.5": 1e-4}
    chosen = decide(PolicySpec("adaptive", {"threshold": 1e-3}), facts(4, changes))
    assert chosen == AUX | {"block.0"}
    changes |= {"embedding": 0.001, "final_norm": 0.002, "lm_head": 0.45}
    young = dict.fromkeys(LAYERS - {"state"}, 1)
    chosen = decide(PolicySpec("budget", {"fraction": 0.5, "max_age": 4}), budget_facts(changes, young))
    # state 280 of 500; block.0 first (100), then by change the head and norms (40 each); no other block fits
    assert chosen == {"state", "block.0", "lm_head", "final_norm", "embedding"}


def budget_facts(changes: dict[str, float], ages: dict[str, int]) -> CommitFacts:
    """Six blocks of 100 bytes, the aux groups and state 400 (1,000 bytes in all)."""
    sizes = {**dict.fromkeys(BLOCKS, 100), "embedding": 40, "final_norm": 40, "lm_head": 40, "state": 280}
    return CommitFacts(LAYERS, 5, LAYERS - {"state"}, changes, sizes, ages)


def test_budget_stores_the_layers_that_moved_most_until_the_bytes_are_spent() -> None:
    changes = {"block.0": 0.1, "block.1": 0.5, "block.2": 0.3, "block.3": 0.2, "block.4": 0.05, "block.5": 0.4}
    changes |= {"embedding": 0.001, "final_norm": 0.002, "lm_head": 0.45}
    young = dict.fromkeys(LAYERS - {"state"}, 1)
    # state takes 280 of a 550 budget; then by change: block.1, lm_head, block.5 (520); nothing else fits
    chosen = decide(PolicySpec("budget", {"fraction": 0.55, "max_age": 4}), budget_facts(changes, young))
    assert chosen == {"state", "block.1", "lm_head", "block.5"}
    # a layer unstored for max_age commits is stored first (the embedding, which hardly moved);
    # the greedy fill then skips block.5 (it would pass 550) and takes the small final norm
    old = young | {"embedding": 4}
    chosen = decide(PolicySpec("budget", {"fraction": 0.55, "max_age": 4}), budget_facts(changes, old))
    assert chosen == {"state", "embedding", "block.1", "lm_head", "final_norm"}
    # an unmeasured change counts as the largest
    unmeasured = {k: v for k, v in changes.items() if k != "block.0"}
    chosen = decide(PolicySpec("budget", {"fraction": 0.5, "max_age": 4}), budget_facts(unmeasured, young))
    assert chosen == {"state", "block.0", "block.1"}
    # a budget smaller than state stores state only
    assert decide(PolicySpec("budget", {"fraction": 0.1}), budget_facts(changes, young)) == {"state"}
    for bad in ({"fraction": 0}, {"fraction": 1.5}, {"max_age": 0}):
        with pytest.raises(PolicyError, match="budget needs"):
            decide(PolicySpec("budget", bad), budget_facts(changes, young))


def test_a_layer_no_earlier_step_has_is_stored() -> None:
    inheritable = LAYERS - {"block.2"}
    assert "block.2" in decide(PolicySpec("parity"), facts(1, inheritable=inheritable))


def test_unknown_policy() -> None:
    with pytest.raises(PolicyError, match="unknown policy"):
        decide(PolicySpec("nope"), facts(1))
    with pytest.raises(PolicyError, match="unknown policy"):
        policy_spec("nope", {})


def test_a_parameter_the_policy_does_not_take_is_refused() -> None:
    """Ignored, it would be recorded in the manifest as if it had counted; a misspelt keyword of
    Store.commit lands among the policy's parameters too."""
    assert set(PARAMETERS) == set(POLICIES)
    assert policy_spec("filter", {"every": 3, "keep_first": 1}) == PolicySpec("filter", {"every": 3, "keep_first": 1})
    with pytest.raises(PolicyError, match="policy full takes no parameters, not `every=3`"):
        policy_spec("full", {"every": 3})
    with pytest.raises(PolicyError, match="policy adaptive takes `threshold=N`, not `delete_after_comit=True`"):
        policy_spec("adaptive", {"threshold": 0.1, "delete_after_comit": True})


# -- retention ------------------------------------------------------------------------------


def rows(*specs: tuple) -> list[ManifestRecord]:
    return [
        ManifestRecord(
            step, origin, 0.0, "deepspeed", None, None, None, "{}", True, 0, 0, "", tag, bool(pinned), id=mid
        )
        for mid, step, origin, tag, pinned in specs
    ]


def test_kept_manifests() -> None:
    manifests = rows(
        (1, 1, "commit", None, 0),
        (2, 2, "commit", "warm", 0),
        (3, 3, "commit", None, 1),
        (4, 4, "commit", None, 0),
        (5, 5, "commit", None, 0),
        (6, 6, "commit", None, 0),
        (7, 6, "merge", "mix", 0),
    )
    assert kept_manifests(manifests, Retention()) == {1, 2, 3, 4, 5, 6, 7}
    assert kept_manifests(manifests, Retention(keep_last=2)) == {2, 3, 5, 6, 7}
    assert kept_manifests(manifests, Retention(keep_every=4)) == {2, 3, 4, 7}
    assert kept_manifests(manifests, Retention(keep_last=1, keep_every=5)) == {2, 3, 5, 6, 7}


def test_retention_counts_each_run_on_its_own_and_keeps_run_bases() -> None:
    from dataclasses import replace

    main = rows((1, 1, "commit", None, 0), (2, 2, "commit", None, 0), (3, 3, "commit", None, 0))
    ft = [replace(m, run="ft") for m in rows((4, 1, "commit", None, 0), (5, 2, "commit", None, 0))]
    manifests = main + ft
    assert kept_manifests(manifests, Retention(keep_last=1)) == {3, 5}, "the newest step of every run"
    assert kept_manifests(manifests, Retention(keep_last=1), bases=frozenset({1})) == {1, 3, 5}
    assert kept_manifests(manifests, Retention(keep_last=1, run="ft")) == {1, 2, 3, 5}, "main untouched"
    assert kept_manifests(manifests, Retention(keep_every=2, run="main")) == {2, 4, 5}


def test_selectors_read_in_a_run() -> None:
    from tailorstore.curate.runs import qualify
    from tailorstore.store.manifests.runs import check_run_name

    assert qualify("step=3", "ft") == "ft:step=3"
    assert qualify("latest", "ft") == "ft:latest"
    assert qualify("main:step=3", "ft") == "main:step=3"
    assert qualify("tag=warm", "ft") == "tag=warm" and qualify("id=4", "ft") == "id=4"
    assert qualify("step=3", None) == "step=3"
    for bad in ("", "a/b", "a:b", "..", "x" * 101, "ü"):
        with pytest.raises(StoreError):
            check_run_name(bad)


@pytest.mark.parametrize("bad", [{"keep_last": 0}, {"keep_last": -1}, {"keep_every": 0}])
def test_retention_refuses_numbers_below_one(bad: dict) -> None:
    with pytest.raises(StoreError):
        Retention(**bad)


# -- merge specs ----------------------------------------------------------------------------


def spec(**over: object) -> dict:
    return {"base": {"step": 18}, "slices": [{"sources": [{"step": 6, "layer_range": [0, 2]}]}], **over}


def test_parse_spec_names_only_what_the_spec_names() -> None:
    base, chosen = parse_spec(spec(norm={"tag": "warm"}, lm_head={"id": 3}), list(range(6)), "s")
    assert base == "step=18"
    assert chosen == {"block.0": "step=6", "block.1": "step=6", "final_norm": "tag=warm", "lm_head": "id=3"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {
                "slices": [
                    {"sources": [{"step": 6, "layer_range": [0, 4]}]},
                    {"sources": [{"step": 12, "layer_range": [3, 6]}]},
                ]
            },
            "overlap",
        ),
        ({"slices": [{"sources": [{"step": 6, "layer_range": [0, 9]}]}]}, "block 6 does not exist"),
        ({"slices": [{"sources": [{"step": 6}]}]}, "layer_range must be"),
        ({"slices": [{"sources": [{"step": 6, "layer_range": [3, 1]}]}]}, "layer_range must be"),
        ({"slices": [{"sources": [{"step": 6, "tag": "x", "layer_range": [0, 1]}]}]}, "one of step, tag or id"),
        ({"slices": [{"sources": [{"a": 1}, {"b": 2}]}]}, "exactly one source"),
        ({"slices": []}, "non-empty list"),
        ({"base": {"step": -1}}, "not a valid step"),
        ({"base": {"tag": ""}}, "not a valid tag"),
        ({"weights": 1}, "unknown keys"),
    ],
)
def test_parse_spec_refusals(change: dict, message: str) -> None:
    with pytest.raises(MergeSpecError, match=message):
        parse_spec(spec(**change), list(range(6)), "s")


def test_parse_spec_on_a_model_without_numbered_blocks() -> None:
    """A model whose names hold no layers.N (any DeepSpeed model commits) has no blocks to slice:
    a message saying so, not max() of an empty list."""
    with pytest.raises(MergeSpecError, match="block 0 does not exist; the model has no numbered blocks"):
        parse_spec(spec(), [], "s")


# -- structure, steps, names ---------------------------------------------------------------


def test_structure_from_pieces_and_its_differences() -> None:
    segs = [
        A.Segment(0, 10, "w1", A.MASTER, 0, 0, "block.0"),
        A.Segment(0, 6, "w1", A.MASTER, 1, 10, "block.0"),
        A.Segment(0, 16, "w1", A.WEIGHT, 0, 0, "block.0"),
        A.Segment(0, 4, "w2", A.EXP_AVG, 0, 0, "block.0"),
    ]
    assert structure.from_segments(segs) == {"w1": 16}
    assert structure.differences({"w1": 16}, {"w1": 16}) == []
    assert structure.differences({"w1": 16, "w0": 1}, {"w1": 15, "w3": 2}) == [
        "w3 is new",
        "w0 is gone",
        "w1 has 15 elements, not 16",
    ]


def test_steps_out_of_range() -> None:
    assert check_step(0) == 0
    for bad in (-7, 1 << 63):
        with pytest.raises(StoreError, match="out of range"):
            check_step(bad)


@pytest.mark.parametrize("name", ["../../../tmp/x", "ABCDEF" * 5 + "00", "0" * 31, "0" * 33, "g" * 32])
def test_blob_names_must_be_hashes(name: str) -> None:
    with pytest.raises(CorruptStoreError):
        check_name(name)


def test_identity_says_what_changed() -> None:
    base = Identity(1, 2, 100, 5, 6)
    assert base.differs(base) == ""
    assert "replaced" in base.differs(Identity(1, 3, 100, 5, 6))
    assert "size" in base.differs(Identity(1, 2, 99, 5, 6))
    assert "written" in base.differs(Identity(1, 2, 100, 7, 6))


def test_commit_path_rules(tmp_path: Path) -> None:
    (tmp_path / "ok.json").write_text("{}")
    check_files(tmp_path, ["ok.json"])
    for bad in ("a\\b", "x/../y", "/abs", "bad\udcffname"):
        with pytest.raises(BadCheckpointError, match="cannot be stored"):
            check_files(tmp_path, [bad])
    (tmp_path / "out").symlink_to("/etc/hostname")
    with pytest.raises(BadCheckpointError, match="outside the checkpoint"):
        check_files(tmp_path, ["out"])


# -- hostile pickles and headers, without files ---------------------------------------------


@pytest.mark.slow  # seconds: the fast tier keeps its minute
def test_object_trees_are_walked_at_a_bounded_cost() -> None:
    node: list = []
    for _ in range(9):
        node = [node] * 10
    with pytest.raises(BadCheckpointError, match="nodes"):
        split_tensors({"x": node}, where="f")
    deep = pickle.loads(b"\x80\x02" + b"]" * 500 + b"a" * 499 + b".")
    with pytest.raises(BadCheckpointError, match="deeper"):
        split_tensors(deep, where="f")
    with pytest.raises(BadCheckpointError, match="TensorSlot"):
        split_tensors({"x": A.TensorSlot(0, "float32", (1,))}, where="f")
    skeleton, entries = split_tensors({"a": [torch.zeros(3), 1]}, where="f")
    assert isinstance(skeleton["a"][0], A.TensorSlot) and len(entries) == 1


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"shape": [1]}},
        {"w": ["x"]},
        {"w": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 4]}},
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
        {"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}},
        [1, 2],
    ],
)
def test_malformed_safetensors_headers_are_one_clear_error(header: object) -> None:
    raw = json.dumps(header).encode()
    with pytest.raises(BadCheckpointError):
        parse_header(struct.pack("<Q", len(raw)) + raw, "f")


# -- stores without a training ------------------------------------------------------------


def test_store_open_and_resolve_refusals(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        Repository.init(tmp_path / "file")
    with Repository.init(tmp_path / "st") as st:
        refusals = (
            ("latest", "no steps yet"),
            ("id=3", "at least 4"),
            ("id=abcd", "no manifest has id abcd"),
            ("id=../x", "names no manifest"),
            ("step=x", "cannot read"),
        )
        for selector, message in refusals:
            with pytest.raises(UnknownStepError, match=message):
                st.resolve(selector)
    (tmp_path / "st" / "index.sqlite").write_bytes(b"\0" * 4096)
    for side in ("index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / "st" / side).unlink(missing_ok=True)
    with pytest.raises(CorruptStoreError, match="damaged"):
        Repository.open(tmp_path / "st")


def test_format_version_that_is_not_a_number(tmp_path: Path) -> None:
    Repository.init(tmp_path / "st").close()
    conn = sqlite3.connect(tmp_path / "st" / "index.sqlite")
    conn.execute("UPDATE meta SET value='abc' WHERE key='format_version'")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError, match="format_version"):
        Repository.open(tmp_path / "st")


@pytest.mark.parametrize("command", [["log"], ["log", "--json"], ["show", "latest"], ["tag", "latest", "x"], ["gc"]])
def test_light_commands_import_neither_torch_nor_deepspeed(tmp_path: Path, command: list[str]) -> None:
    """What `tailor log` costs is what users feel: it must not pay for importing torch (2 s)."""
    Repository.init(tmp_path / "store").close()
    probe = (
        "import sys\n"
        "from tailorstore.cli.app import app\n"
        "try:\n"
        f"    app({[*command, '--store', str(tmp_path / 'store')]!r})\n"
        "except BaseException:  # an empty store: show and tag refuse, which is fine here\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_a_next_step_is_named_by_each_front_end_its_own_way() -> None:
    """The library says what to do next as calls of its API; the command line names them as its
    commands and flags, from the structure (no rewriting of message text), and maps categories
    to exit codes."""
    from tailorstore.cli.naming import EXIT_CODES, as_command

    from tailorstore.core.errors import Call, Category, CorruptStoreError, LeaseLostError, StepExistsError

    refused = StepExistsError("step 3 is in the store; commit under another ", Call(step="N"), ", or pass ",
                              Call(force=True), " to replace it.")  # fmt: skip
    assert str(refused) == "step 3 is in the store; commit under another `step=N`, or pass `force=True` to replace it."
    assert refused.render(as_command) == "step 3 is in the store; commit under another --step N, or pass --force " \
        "to replace it."  # fmt: skip
    damaged = CorruptStoreError("blob x is damaged. ", Call("verify", deep=True), "; ", Call("rebuild_index"), ".")
    assert str(damaged) == "blob x is damaged. `verify(deep=True)`; `rebuild_index()`."
    assert damaged.render(as_command) == "blob x is damaged. `tailor verify --deep`; `tailor index rebuild`."
    assert as_command(Call("commit", "DIR", part=True, force=True)) == "`tailor commit DIR --part --force`"
    assert as_command(Call("finalize", "step=N")) == "`tailor finalize step=N`"
    assert [EXIT_CODES[e.category] for e in (refused, damaged, LeaseLostError("x"))] == [2, 3, 4]
    assert set(EXIT_CODES) == set(Category)
    again = pickle.loads(pickle.dumps(refused))  # a rank hands its error to the others whole
    assert type(again) is StepExistsError and again.render(as_command) == refused.render(as_command)


def test_no_message_below_the_command_line_names_a_command() -> None:
    """The library never names a CLI command or flag: every string it holds (docstrings aside,
    which may say which command uses a module) is free of `tailor ...` and `--flag` advice."""
    import ast

    root = Path(__file__).resolve().parents[1] / "tailorstore"
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):  # an f-string, its values as {}: "`{name}={value}`" names an option
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            else:
                continue
            # a flag anywhere ("(--format universal)", "without --world-size"), not only in backticks
            if "`tailor " in text or re.search(r"(^|[\s(`'\"])--[a-z]|`(\{\}|[a-z_]+)=", text):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {text[:80]!r}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("location", ["s3://", "s3:///p", "s3://b/p1/../p2", "s3://b/./p", "s3://b/p1//p2"])
def test_an_s3_location_with_odd_prefix_parts_is_refused_before_any_request(location: str) -> None:
    """S3 keeps '..' and empty parts literally: s3://b/p1/../p2 was a third store, not p2. A name is
    the user's input (exit 2), not a server's failure (BackendError, exit 5)."""
    with pytest.raises(StoreError, match="s3://bucket/prefix") as refused:
        S3Backend(location)
    assert not isinstance(refused.value, BackendError)


@pytest.mark.parametrize(
    ("field", "value", "taken"),
    [
        ("stored", 1, True),  # flags are 0/1, as SQL and manifest objects write them
        ("stored", False, False),
        ("stored", 2, "error"),
        ("stored", 1.0, "error"),
        ("change", 3, 3.0),  # JSON writes a whole-number float as an int
        ("change", None, None),
        ("change", "0.1", "error"),
        ("change", True, "error"),
        ("raw_bytes", True, "error"),  # a bool is no count, though Python calls it an int
        ("raw_bytes", 5.0, "error"),
        ("layer", None, "error"),  # not a nullable column
    ],
)
def test_a_record_takes_only_values_of_its_fields_types(field: str, value: object, taken: object) -> None:
    """Manifest objects and parts come from other hosts: each value must be of its column's type."""
    named = {"layer": "block.0", "source": 1, "source_step": 3, "raw_bytes": 8, "stored": 1, "change": None}
    named[field] = value
    if taken == "error":
        with pytest.raises(RecordError, match=f"LayerRecord.{field} is"):
            record(LayerRecord, named)
    else:
        assert getattr(record(LayerRecord, named), field) == taken
    with pytest.raises(RecordError, match="has no source_step"):
        record(LayerRecord, {k: v for k, v in named.items() if k != "source_step"})
    table = {"columns": list(named), "rows": [[*named.values()][:-1]]}
    with pytest.raises(RecordError, match="row has 5 values for 6 columns"):
        from_table(table, LayerRecord)


def test_stored_skeletons_name_tensor_slot_as_they_always_did() -> None:
    """The class a skeleton pickle names is part of the format (FORMAT.md 3.2): moving the module
    into core/ must not change the bytes a commit stores, nor stop old skeletons from loading."""
    data = pickle.dumps(A.TensorSlot(0, "float32", (1,)), protocol=2)
    assert b"tailorstore.atoms" in data and b"tailorstore.core" not in data
    assert pickle.loads(data) == A.TensorSlot(0, "float32", (1,))


def test_every_call_an_error_names_is_a_method_of_store_and_a_command() -> None:
    """Errors name operations as ``Call("unpin", ...)``, which the API shows as a method
    of ``Store`` and the command line as a command; ``unpin`` was no method of ``Store``."""
    import ast

    from tailorstore.cli.app import app
    from tailorstore.cli.naming import COMMANDS

    from tailorstore import Store

    commands = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    commands |= {f"{g.name} {c.name}" for g in app.registered_groups for c in g.typer_instance.registered_commands}
    named = set()
    for path in Path("tailorstore").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Call" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    named.add(first.value)
    assert named, "no Call found: the scan is broken"
    assert {n for n in named if not callable(getattr(Store, n, None))} == set()
    assert {n for n in named if COMMANDS.get(n, n) not in commands} == set()


@pytest.mark.parametrize(
    ("names", "refused"),
    [
        (["layers.0.weight", "model.embed_tokens.weight", "lm_head.weight"], False),
        (["layers.0.weight", "optim.state.layers.0.weight.exp_avg"], True),
        (["app.optim.state.0.exp_avg_sq"], True),
        (["layers.0.weight.exp_avg"], True),
        (["optimizer.param_groups.0.lr"], True),
        (["model.optimal.weight", "state_proj.weight"], False),
    ],
)
def test_an_export_refuses_names_of_optimizer_state(names: list[str], refused: bool) -> None:
    """An export that would write Adam's moments as weights stops, naming one."""
    from tailorstore.restore.export import refuse_optimizer_names

    if refused:
        with pytest.raises(BadCheckpointError, match="named as optimizer state"):
            refuse_optimizer_names(6, names)
    else:
        refuse_optimizer_names(6, names)
