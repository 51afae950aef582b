"""A rank-parallel commit as a torchrun job: ``python -m torch.distributed.run --nproc_per_node 2
-m testbed.rank_commit STORE SAVE OUT_JSON``. Each rank writes what its part
wrote to ``OUT_JSON.rank<R>``, so a test can count every blob written once."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from tailorstore import Store
from tailorstore.integrations.distributed import commit_rank_parallel


def main() -> None:
    store_path, save, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Store.open(store_path) as store:
        result = commit_rank_parallel(store, save)
    Path(f"{out}.rank{rank}").write_text(json.dumps(asdict(result)))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
