"""A store with a history to look at, made of real saves: the report page's tests and benchmark.

A tiny Llama-shaped model (an embedding, ``blocks`` transformer blocks, a final norm, a head) is
trained a little between saves, each save a real ``torch.save`` of its model and AdamW states
committed as a user commits it, with metrics. :func:`build_history` then gives the store what a
history has: a tag and a pin, a run branched from a step, composite commits (a policy that
inherits layers), an average and a composite merge, steps thinned by gc to weights and archived,
and a run's retention with a keep-best rule. Tiny tensors: 10,000 steps take minutes, not hours.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from tailorstore import Retention, Store


class TinyLlama(torch.nn.Module):
    """Parameter names as a Llama's, so each lands in its layer (``block.N``, embedding, ...)."""

    def __init__(self, blocks: int = 3, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.lm_head(self.norm(x))


def saves(folder: Path, count: int, *, blocks: int = 3, seed: int = 0) -> Iterator[tuple[int, Path, float]]:
    """``count`` saves (steps 1..count) of one training, each yielded as (step, file, its loss) once
    written; the file is deleted when the next is asked for, so commit it before."""
    torch.manual_seed(seed)
    model = TinyLlama(blocks)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    folder.mkdir(parents=True, exist_ok=True)
    for step in range(1, count + 1):
        path = folder / f"ckpt_{step}.pt"
        tokens = torch.randint(0, 16, (4, 6))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "step": step}, path)
        yield step, path, loss.item()
        path.unlink()


def build_history(root: Path, *, steps: int = 8, branch_steps: int = 3, tag: str = "milestone") -> Path:
    """A store at ``root / "store"`` with the history the page shows (the module's docstring). Main
    commits ``steps`` steps (every third with the parity policy: composite), tags step 3 with
    ``tag``, pins step 2; run ``exp`` branches at step 3 and commits ``branch_steps`` steps; an
    average of exp's steps and a composite merge on main; gc thins main's old steps (to weights,
    then the oldest to the archive tier); main carries ``keep_last=2, keep_best=eval_loss:min:2``."""
    location = root / "store"
    with Store.init(location) as store:
        for step, path, loss in saves(root / "saves", steps):
            policy = "parity" if step % 3 == 0 and step > 1 else "full"
            store.commit(path, policy=policy, metrics={"eval_loss": loss, "lr": 1e-2 * math.cos(step / steps)})
        store.tag("step=3", tag)
        store.pin("step=2")
        store.create_run("exp", base="step=3")
    with Store.open(location, run="exp") as exp:
        for step, path, loss in saves(root / "exp-saves", branch_steps, seed=1):
            exp.commit(path, step=3 + step, metrics={"eval_loss": loss})
        if branch_steps >= 2:
            spec = root / "average.yaml"
            spec.write_text(f"method: sma\nsteps: [{3 + branch_steps - 1}, {3 + branch_steps}]\n")
            exp.merge(spec, tag="exp-avg")
    with Store.open(location) as store:
        spec = root / "composite.yaml"
        spec.write_text(f"base: {{step: {steps}}}\nslices:\n  - sources: [{{step: 1, layer_range: [0, 1]}}]\n")
        store.merge(spec, tag="mix")
        store.gc(Retention(keep_last=steps // 2, thin="weights", run="main"))
        store.gc(Retention(keep_last=steps // 2, keep_every=2, thin="archive", run="main"))
        store.set_retention(Retention(keep_last=2, keep_best="eval_loss:min:2"))
    return location
