"""A rank-parallel commit as a torchrun job: ``python -m torch.distributed.run --nproc_per_node 2
-m testbed.rank_commit STORE OUT_JSON SAVE [SAVE ...] [--policy NAME] [--param KEY=VALUE ...]``.
The saves are committed in order; each rank writes what its parts wrote to ``OUT_JSON.rank<R>``
(a list, one entry a save), so a test can count every blob written once."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from tailorstore import Store
from tailorstore.integrations.common.distributed import commit_rank_parallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("saves", nargs="+")
    p.add_argument("--policy", default="full")
    p.add_argument("--param", action="append", default=[], help="a policy parameter, KEY=VALUE")
    args = p.parse_args()
    params = {k: float(v) for k, v in (item.split("=", 1) for item in args.param)}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    with Store.open(args.store) as store:
        for save in args.saves:
            results.append(asdict(commit_rank_parallel(store, save, policy=args.policy, **params)))
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(results))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
