"""A step's content digest: the same for the same checkpoint bytes in two unrelated stores (and
runs and step numbers), another for a --force replacement with other bytes (which keeps its id),
printed by log and show, a selector (`digest=HEX`), and computable from the manifest object alone
as docs/FORMAT.md (section 3.3, "Digests") says."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash
import zstandard
from safetensors.torch import save_file

from tests.conftest import one_line, tailor_here


def save(folder: Path, seed: int) -> Path:
    """A plain safetensors save of a small model's weights (two files, one raw file beside)."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    layers = {f"model.layers.{i}.mlp.weight": torch.randn(32, 16, generator=gen) for i in range(2)}
    save_file(layers, folder / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": torch.randn(8, 16, generator=gen)}, folder / "model-00002-of-00002.safetensors")
    (folder / "notes.txt").write_text(f"seed {seed}\n")
    return folder


def log_json(store: Path) -> list[dict]:
    done = tailor_here("log", "--json", store=store)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_digest_names_content_not_the_step(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for store in (a, b):
        assert tailor_here("init", str(store)).returncode == 0
    first, second = save(tmp_path / "s1", 1), save(tmp_path / "s2", 2)
    assert tailor_here("commit", str(first), "--step", "5", store=a).returncode == 0
    assert tailor_here("commit", str(second), "--step", "5", store=b).returncode == 0
    assert tailor_here("commit", str(first), "--step", "9", "--run", "other", store=b).returncode == 0
    in_a, in_b = log_json(a), log_json(b)
    assert in_a[0]["id"] == in_b[0]["id"]  # the id names run main, step 5: unrelated stores agree
    assert in_a[0]["digest"] != in_b[0]["digest"]  # the digest names the bytes, which differ
    assert {s["digest"] for s in in_b if s["run"] == "other"} == {in_a[0]["digest"]}  # the same bytes agree
    assert all(len(s["digest"]) == 32 and "manifest" not in s for s in in_a + in_b)

    # --force with other bytes: the id stays, the digest follows the content
    done = tailor_here("commit", str(second), "--step", "5", "--force", store=a)
    assert done.returncode == 0, done.stderr
    replaced = log_json(a)[0]
    assert replaced["id"] == in_a[0]["id"] and replaced["digest"] == in_b[0]["digest"] != in_a[0]["digest"]

    # a selector: a unique prefix; printed by log and show
    shown = tailor_here("show", f"digest={replaced['digest'][:10]}", "--json", store=a)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["summary"]["digest"] == replaced["digest"]
    assert "manifest" not in json.loads(shown.stdout)["summary"]
    assert f"digest={replaced['digest']}" in tailor_here("show", "step=5", store=a).stdout
    assert replaced["digest"][:12] in tailor_here("log", store=a).stdout.splitlines()[1]
    out = tmp_path / "out"
    assert tailor_here("checkout", f"digest={replaced['digest']}", "--out", str(out), store=a).returncode == 0
    assert (out / "s2" / "notes.txt").read_text() == "seed 2\n"  # a plain folder is recorded under its name

    # the same content twice in one store: the digest names both, and is refused with their ids
    assert tailor_here("commit", str(first), "--step", "10", "--run", "other", store=b).returncode == 0
    one_line(tailor_here("show", f"digest={in_a[0]['digest'][:8]}", store=b), 2, "2 manifests", "id=")
    one_line(tailor_here("show", "digest=abc", store=a), 2, "8 to 32")
    one_line(tailor_here("show", "digest=" + "0" * 12, store=a), 2, "no manifest")


def test_the_digest_follows_the_format_spec(tmp_path: Path) -> None:
    """Another implementation computes it from the manifest object as FORMAT.md says."""
    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    assert tailor_here("commit", str(save(tmp_path / "s", 3)), "--step", "1", store=store).returncode == 0
    (key,) = (store / "manifests" / "main").glob("*.json.zst")
    doc = json.loads(zstandard.ZstdDecompressor().decompress(key.read_bytes()))

    def table(name: str) -> list[dict]:
        return [dict(zip(doc[name]["columns"], row, strict=True)) for row in doc[name]["rows"]]

    atoms = table("atoms")
    h = xxhash.xxh3_128()
    for f in sorted(table("files"), key=lambda f: f["path"].encode()):
        line = ["file", f["path"], f["kind"], f["raw_size"], f["blob"], f["container"]]
        h.update(json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")
        for a in sorted((a for a in atoms if a["path"] == f["path"]), key=lambda a: (a["slot"], a["offset"])):
            line = ["atom", a["slot"], a["offset"], a["nbytes"], a["blob"]]
            h.update(json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")
    assert len(atoms) == 3
    assert log_json(store)[0]["digest"] == h.hexdigest()


def test_log_keeps_digests_beside_the_index_and_never_a_stale_one(tmp_path: Path) -> None:
    """log computes each digest once per object key (the rows under one key never change) and
    keeps it beside the index; a --force replacement (a new key) gets its own, and a cache of an
    index since rebuilt is not read."""
    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    assert tailor_here("commit", str(save(tmp_path / "s", 1)), "--step", "1", store=store).returncode == 0
    first = log_json(store)[0]["digest"]
    cache = store / "index.sqlite-digests.json"
    doc = json.loads(cache.read_text())
    assert list(doc["digests"].values()) == [first]
    assert log_json(store)[0]["digest"] == first  # read back from the cache
    other = save(tmp_path / "t", 2)
    (other / "notes.txt").rename(other / "renamed.txt")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (other / name).replace(tmp_path / "s" / name)
    assert tailor_here("commit", str(tmp_path / "s"), "--step", "1", "--force", store=store).returncode == 0
    replaced = log_json(store)[0]["digest"]
    assert replaced != first
    now = json.loads(cache.read_text())
    assert set(now["digests"]) != set(doc["digests"]) and replaced in now["digests"].values()
    cache.write_text(json.dumps({"index": now["index"], "digests": dict.fromkeys(now["digests"], "0" * 32)}))
    assert log_json(store)[0]["digest"] == "0" * 32  # (the cache is this host's own, trusted as its index is)
    assert tailor_here("index", "rebuild", store=store).returncode == 0  # a new index: the old cache is not its
    assert log_json(store)[0]["digest"] == replaced
