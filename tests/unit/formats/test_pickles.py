"""One reader of pickles (formats/pickles.py): every unpickling of outside bytes in the library
goes through its allowlisted unpickler, or through torch's ``weights_only`` loader in
formats/safe_load.py under the same allowlist, and every function that unpickles has a fuzz
target (testbed/fuzz_targets.py), so a new call site cannot appear unfuzzed."""

from __future__ import annotations

import ast
import io

import pytest

from tailorstore.core.errors import CorruptStoreError
from testbed.fuzz_targets import TARGETS
from tests.conftest import REPO_ROOT

LIBRARY = REPO_ROOT / "tailorstore"
# every function of the library that unpickles bytes from outside -> the fuzz target that reads as it does
CALL_SITES = {
    "formats/torch_pickle.py:read_torch_zip": "torch-zip",
    "formats/torch_pickle.py:load_pickle_tree": "pickle",
    "formats/dcp.py:read_metadata": "dcp-metadata",
    "formats/safe_load.py:_load": "torch-fallback",
    "formats/safe_load.py:load_skeleton": "skeleton",
}
# callers of those that read other formats through them
INDIRECT = {
    "formats/torch_pickle.py:object_refusal": "dcp-object",
    "formats/dcp.py:read_metadata(megatron=True)": "megatron-metadata",  # the widening for Megatron's saves
}
UNPICKLERS = {"_Unpickler", "_MetadataUnpickler", "AllowlistUnpickler"}
# loads of bytes the same call has just dumped (no outside bytes): whether an error survives the trip
OWN_ROUND_TRIPS = {"core/errors.py"}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(LIBRARY)), ast.parse(p.read_text())) for p in sorted(LIBRARY.rglob("*.py"))]


def _name(node: ast.expr) -> str:
    return ast.unparse(node)


def test_only_the_pickles_module_subclasses_an_unpickler_and_no_module_calls_pickle_to_load() -> None:
    found = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {_name(b) for b in node.bases}
                if "pickle.Unpickler" in bases and rel != "formats/pickles.py":
                    found.append(f"{rel}: class {node.name} subclasses pickle.Unpickler")
            if isinstance(node, ast.Call):
                called = _name(node.func)
                loads = ("pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.loads", "dill.loads")
                if called in loads and rel not in OWN_ROUND_TRIPS:
                    found.append(f"{rel}:{node.lineno}: {called}")
                if called == "torch.load" and rel != "formats/safe_load.py":
                    found.append(f"{rel}:{node.lineno}: torch.load outside formats/safe_load.py")
    assert not found, found


def test_every_function_that_unpickles_has_a_fuzz_target() -> None:
    sites = set()
    for rel, tree in _modules():
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call):
                    called = _name(node.func)
                    if called == "torch.load" or called.split(".")[-1] in UNPICKLERS:
                        sites.add(f"{rel}:{func.name}")
    methods = {s for s in sites if s.split(":")[1] == "__init__"}  # a subclass's constructor calling its base
    assert sites - methods == set(CALL_SITES), "an unpickling call site without a fuzz target (CALL_SITES)"
    assert set(CALL_SITES.values()) | set(INDIRECT.values()) <= set(TARGETS)


def test_a_committed_skeleton_that_does_not_load_is_one_line_naming_the_store() -> None:
    """Found by the skeleton target: a skeleton blob whose hash matches but that is no torch zip
    (written by a co-tenant with write access) raised torch's RuntimeError, a traceback."""
    torch = pytest.importorskip("torch")
    from tailorstore.formats.safe_load import load_skeleton

    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    for data in (buf.getvalue()[:200], b"not a zip"):
        with pytest.raises(CorruptStoreError, match="no commit of tailorstore wrote it"):
            load_skeleton(data, "step 3's model.pt", trusted=False, trust_pickles=False)


def test_an_enum_member_pickled_by_name_loads_and_no_other_getattr_does() -> None:
    """Python 3.11.0-3.11.4 (Debian 12's 3.11.2) pickle an Enum member as ``getattr(cls, name)``:
    a fresh clone's suite failed 25 cases there. Only a member of an allowlisted stand-in is taken."""
    import pickle as _pickle
    from enum import Enum

    from tailorstore.core.errors import BadCheckpointError as _Bad
    from tailorstore.formats.pickles import AllowlistUnpickler
    from tailorstore.formats.torch_pickle import opaque_class

    stage = opaque_class("deepspeed.runtime.zero.config.ZeroStageEnum")

    def by_name(owner: str, name: str) -> bytes:
        return (
            b"\x80\x02c__builtin__\ngetattr\n"
            + f"c{owner.rsplit('.', 1)[0]}\n{owner.rsplit('.', 1)[1]}\n".encode()
            + b"X"
            + len(name).to_bytes(4, "little")
            + name.encode()
            + b"\x86R."
        )

    def load(data: bytes, allowed: dict) -> object:
        return AllowlistUnpickler(data, "x", allowed, lambda m, n: _Bad(f"{m}.{n} refused")).load()

    allowed = {stage.name: stage, "collections.OrderedDict": dict}
    member = load(by_name(stage.name, "weights"), allowed)
    assert isinstance(member, stage) and member.member == "weights"
    for owner, name in ((stage.name, "__class__"), (stage.name, "_private"), ("collections.OrderedDict", "fromkeys")):
        with pytest.raises(_Bad, match="no enum member"):
            load(by_name(owner, name), allowed)
    assert _pickle.loads(by_name("enum.Enum", "__class__")) is type(Enum)  # what plain pickle would have reached
