"""The Hugging Face Trainer: commit every ``checkpoint-N`` as the Trainer saves it.

::

    from tailorstore.integrations.hf import TailorCallback

    trainer = Trainer(..., callbacks=[TailorCallback("ckpt-store", delete_after_commit=True)])
    trainer.train()

    # to resume: check out the latest step and hand the folder to the Trainer as it is
    with tailorstore.Store.open("ckpt-store") as store:
        store.checkout("latest", "restored/checkpoint-latest")
    trainer.train(resume_from_checkpoint="restored/checkpoint-latest")

Only the main process (global rank 0) commits, once every rank has written its files:
DeepSpeed's ``save_checkpoint`` ends with a barrier before the Trainer calls ``on_save``.
With ``save_total_limit``, the Trainer deletes the oldest checkpoint when it writes the next
one; the callback therefore waits for the commits in flight before each save, so a commit
never reads a folder the Trainer is deleting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..api import Store


class TailorCallback(TrainerCallback):
    def __init__(
        self,
        store: Store | str | os.PathLike,
        policy: str = "full",
        delete_after_commit: bool = False,
        asynchronous: bool = True,
        **policy_params: float,
    ) -> None:
        self._store_arg = store
        self._store: Store | None = store if isinstance(store, Store) else None
        self.policy = policy
        self.policy_params = policy_params
        self.delete_after_commit = delete_after_commit
        self.asynchronous = asynchronous

    def _open(self) -> Store:
        if self._store is None:
            self._store = Store.open(self._store_arg)  # type: ignore[arg-type]
        return self._store

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if control.should_save and self._store is not None and args.save_total_limit:
            self._store.flush()  # the coming save may delete a folder a commit is still reading

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        store = self._open()
        options: dict[str, Any] = {"step": state.global_step, "policy": self.policy, **self.policy_params}
        if self.asynchronous:
            store.commit_async(folder, delete_after_commit=self.delete_after_commit, **options)
        else:
            store.commit(folder, delete_after_commit=self.delete_after_commit, **options)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self._store is not None:
            self._store.flush()

    def close(self) -> None:
        """Flush and close the store this callback opened (one passed in stays open)."""
        if self._store is not None and not isinstance(self._store_arg, Store):
            self._store.close()
            self._store = None
