"""Seed inputs for the fuzz targets (testbed/fuzz_targets.py), made by the real writers: torch.save,
dcp.save, safetensors, and a small store's own objects (a manifest, a part, a pack, its marker),
written as ``DIR/<target>/<n>.bin``. ``python -m testbed.fuzz_seeds DIR``; it imports torch, so the
fuzz runner (which must not) starts it as a child process."""

from __future__ import annotations

import io
import json
import sys
import time
import warnings
import zipfile
from pathlib import Path

MEGATRON_SEED = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron"


def _put(out: Path, target: str, *seeds: bytes) -> None:
    folder = out / target
    folder.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(seeds):
        (folder / f"{i}.bin").write_bytes(data)


def make(out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save as save_safetensors

    from tailorstore import Store
    from tailorstore.store import gc_notices
    from tailorstore.store.backends.location import resolve

    state = {
        "module": {"w": torch.ones(4, 3, dtype=torch.bfloat16), "b": torch.zeros(3)},
        "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(12)}},
                                 "param_groups": [{"lr": 0.1, "params": [0]}]},
        "global_steps": 3,
        "dtype": torch.bfloat16,
    }  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    zipped = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(zipped)) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    _put(out, "torch-zip", zipped)
    _put(out, "pickle", pickled)
    _put(out, "torch-fallback", zipped, _deflated(zipped))  # the second only torch's loader takes
    from tailorstore.formats.skeleton import split_tensors
    from tailorstore.formats.torch_fallback import skeleton_bytes

    _put(out, "skeleton", skeleton_bytes(split_tensors(state, where="seed", file_size=len(zipped))[0]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2, 3), "step": 7}, checkpoint_id=str(out / "dcp"))
    _put(out, "dcp-metadata", (out / "dcp" / ".metadata").read_bytes())
    _put(out, "dcp-object", *_dcp_objects(out / "dcp"), _hostile_object())
    # a real Megatron-Core save's (testbed/train_megatron.py, tensor parallel 2, bf16 with FP32 main
    # parameters and Adam's moments): Megatron needs two ranks to save, so its bytes are checked in
    _put(out, "megatron-metadata", (MEGATRON_SEED / "iter_0000002.metadata").read_bytes())
    _put(out, "safetensors", save_safetensors({"w": torch.ones(4, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}))

    save = out / "save"
    save.mkdir()
    torch.save({"w": torch.arange(300, dtype=torch.float32)}, save / "ckpt.pt")
    with Store.init(out / "store") as store:
        store.commit(save, step=1, metrics={"eval_loss": 1.5})
        store.commit(save, step=2, part=True)
    backend = resolve(str(out / "store")).backend
    key = next(k for k in backend.list("manifests/"))
    _put(out, "manifest", backend.get(key))
    _put(out, "part", backend.get(next(iter(backend.list("parts/")))))
    _put(out, "pack-trailer", backend.get(next(iter(backend.list("packs/")))))
    _put(out, "store-marker", backend.get("tailorstore.json"))
    notice = gc_notices.announce(backend, ["cd" * 16], ["ef" * 16])  # as a gc puts it before its deletes
    _put(out, "gc-notice", backend.get(notice.key))
    now = time.time()
    lease = {"exclusive": False, "host": "h", "pid": 7, "created": now, "expires": now + 120}
    _put(out, "lease", json.dumps(lease).encode())
    archive = {"id": "archive-delta", "v": 1, "dtype": "float32", "group": 64, "width": 1, "levels": 127, "bases": []}
    _put(out, "archive-descriptor", json.dumps(archive).encode())
    _put(
        out,
        "merge-spec",
        b"base: {step: 2}\nslices:\n  - {layers: [0, 2], from: {step: 1}}\n",
        b"method: ema\nsteps: [{step: 1}, {step: 2}]\nalpha: 0.5\n",
    )
    _put(out, "metrics", b'{"eval_loss": 1.5, "acc": null}')
    head = {"tailorstore_head": 1, "store": "ab" * 16, "run": "main", "step": 3, "created_at": now}
    _put(out, "head", json.dumps(head).encode())


def _deflated(zipped: bytes) -> bytes:
    """The same torch.save zip with compressed records, which the torch-free reader refuses to cut."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(zipped)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


def _dcp_objects(folder: Path) -> list[bytes]:
    """The object items (``BYTE_IO``) of a folder dcp.save wrote, each its own torch.save record."""
    from tailorstore.formats.dcp import read_metadata

    sizes = {p.name: p.stat().st_size for p in folder.glob("*.distcp")}
    meta = read_metadata((folder / ".metadata").read_bytes(), ".metadata", sizes)
    out = []
    for name, items in meta.items.items():
        data = (folder / name).read_bytes()
        out += [data[i.offset : i.offset + i.length] for i in items if i.chunk is None]
    return out


class _Runs:
    """An object whose pickle names ``os.system``: what the allowlist must refuse."""

    def __reduce__(self) -> tuple:
        import os

        return (os.system, ("true",))


def _hostile_object() -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"lr": 0.1, "hook": _Runs()}, buf)
    return buf.getvalue()


if __name__ == "__main__":
    make(Path(sys.argv[1]))
