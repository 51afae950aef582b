"""A blob's raw size, as a stranger's manifest object gives it, is checked against its stored size
before memory is allocated for it (a planted 9-byte archive blob that
claims 2 GiB cost ``verify --deep`` 2.1 GB, and 2**40 a MemoryError traceback)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zstandard

from tailorstore import Store
from tailorstore.core.object_keys import blob_key
from tailorstore.store.archive_codec import ARCHIVE, VERSION
from tailorstore.store.backends.location import resolve

FAKE = "ab" * 16


@pytest.mark.parametrize("claimed", [1 << 31, 1 << 40])
def test_verify_deep_refuses_a_blob_that_claims_more_than_it_can_hold(claimed: int, tmp_path: Path) -> None:
    save = tmp_path / "save"
    save.mkdir()
    torch.save({"epoch": 3}, save / "state.pt")  # no tensor: kept whole, one file row naming one blob
    location = tmp_path / "store"
    with Store.init(location) as store:
        store.commit(save, step=1)
    backend = resolve(str(location)).backend
    key = next(iter(backend.list("manifests/")))
    doc = json.loads(zstandard.ZstdDecompressor().decompress(backend.get(key), max_output_size=1 << 20))
    descriptor = json.dumps({"id": ARCHIVE, "v": VERSION, "dtype": "float32", "group": 64, "width": 1,
                             "levels": 127, "bases": []})  # fmt: skip
    columns = doc["blobs"]["columns"]
    row = dict(zip(columns, doc["blobs"]["rows"][0], strict=True))
    row.update(hash=FAKE, raw_size=claimed, stored_size=9, codec=descriptor, pack=None, pack_offset=None)
    doc["blobs"]["rows"] = [[row[c] for c in columns]]
    files = doc["files"]
    files["rows"][0][files["columns"].index("blob")] = FAKE
    files["rows"][0][files["columns"].index("raw_size")] = claimed
    doc["manifest"]["step"] = 2
    backend.put(key.replace("step-00000000000000000001", "step-00000000000000000002"),
                zstandard.ZstdCompressor().compress(json.dumps(doc).encode()))  # fmt: skip
    backend.put(blob_key(FAKE), b"123456789")

    cap = 1536 << 20  # far less than the 2 GiB claimed: a verify that allocates it fails here

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    done = subprocess.run(
        [sys.executable, "-m", "tailorstore.cli.app", "verify", "--deep", "--store", str(location)],
        capture_output=True, text=True, timeout=120, preexec_fn=capped,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    assert "more than any codec gives" in done.stdout + done.stderr
