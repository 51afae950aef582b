"""DeepSpeed: a checkpoint engine that saves into the store, and a save-then-commit helper.

The package holds every DeepSpeed-only module: :mod:`.engine` (the checkpoint engine, over its
:mod:`.save_path` and its :mod:`.load_path`), :mod:`.startup` (what an engine's start does, once),
:mod:`.attaching` (``attach``, ``start_engine``), :mod:`.loading` (``load_checkpoint`` without
``attach``), :mod:`.saving` (``save_checkpoint``); beneath them :mod:`.snapshot` and
:mod:`.side_copy` (a save that blocks only for a copy), :mod:`.staging` and :mod:`.recovery` (the
staging folders, and what a dead run left in them), :mod:`.serving`, :mod:`.resume` and
:mod:`.staged_reads` (a resume from the store), :mod:`.nodes` (several nodes, a part each),
:mod:`.head` (the job's head beside ``latest``) and :mod:`.helpers` (what they share).

The engine (every rank attaches it; ``attach`` is collective)::

    from tailorstore.integrations.deepspeed import attach

    store = tailorstore.Store.open("ckpt-store")        # needed on global rank 0 only
    tailor = attach(engine, store)                       # after deepspeed.initialize
    for step in ...:
        ...
        engine.save_checkpoint("saves")                  # into the store, in the background
    engine.load_checkpoint("saves")                      # resumes from the store
    tailor.flush()                                       # before exit: the last commit's errors

``engine.save_checkpoint`` hands each file to :class:`TailorCheckpointEngine`, which
serializes it into a staging folder in memory (``/dev/shm``, or ``$TAILOR_STAGING``), never
into ``save_dir``. Once every rank has saved, global rank 0 commits the staged step through
the same container path as ``tailor commit`` (one process, so every policy works) and
deletes the staged copy once the manifest is durable and its blobs are checked. DeepSpeed
still writes its small ``latest`` pointer and recovery scripts into ``save_dir`` itself.

Memory: a save waits in the staging folder while it is committed, so up to two raw saves
of this node's ranks sit in memory (the one being committed, the next being saved). On
several nodes, global rank 0 must see every rank's staged files: pass ``staging=`` a folder
all nodes share, or use :func:`save_checkpoint` (save to disk, then commit).

If a background commit fails, its staged files are moved to where DeepSpeed would have
written them (``save_dir/tag``), so nothing is lost, and the error is raised at the next
save or at :meth:`TailorCheckpointEngine.flush`. What a killed run left staged (perhaps cut
short) is moved by the next engine to start beside that folder, under a name DeepSpeed never
loads, and global rank 0 commits it from there (:mod:`.staging`, :mod:`.recovery`), when the
next engine starts (:mod:`.startup`).
"""

from tailorstore.integrations.deepspeed.attaching import attach, start_engine
from tailorstore.integrations.deepspeed.engine import TailorCheckpointEngine
from tailorstore.integrations.deepspeed.helpers import ENGINE_NAME, default_staging, step_of_tag
from tailorstore.integrations.deepspeed.loading import load_checkpoint, staged_loads
from tailorstore.integrations.deepspeed.saving import save_checkpoint
from tailorstore.integrations.deepspeed.staged_reads import load_staged, mapped

__all__ = [
    "ENGINE_NAME",
    "TailorCheckpointEngine",
    "attach",
    "default_staging",
    "load_checkpoint",
    "load_staged",
    "mapped",
    "save_checkpoint",
    "staged_loads",
    "start_engine",
    "step_of_tag",
]
