"""One node of a trainer group for the launcher tests: `python -m helpers.node_launch NODE ADDRESS PORT [FAIL_RANK]`.

Launches this node's 2 ranks of a world of 4 (2 nodes) meeting on ADDRESS:PORT; every rank joins the
process group and all-reduces its rank; rank FAIL_RANK exits 3 instead. Prints one JSON line: the
ranks' results, or the failure the launcher raised.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def rank_entry(fail_rank: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == fail_rank:
        print(f"rank {fail_rank} fails on purpose", flush=True)
        raise SystemExit(3)
    if fail_rank >= 0:
        # The others reach their collective only after the failure is seen: in it they would fail in the same
        # instant (a lost peer), and the launcher's failure times are whole seconds.
        time.sleep(5)
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "local": int(os.environ["LOCAL_RANK"]),
           "node": int(os.environ["GROUP_RANK"]), "sum": total.item(), "master": os.environ["MASTER_ADDR"]}
    dist.destroy_process_group()
    return out


def main(argv: list[str]) -> None:
    from rlfleet.trainer.launch import RankFailed, launch_ranks

    node, address, port = int(argv[0]), argv[1], int(argv[2])
    fail_rank = int(argv[3]) if len(argv) > 3 else -1
    logs = Path(tempfile.mkdtemp(prefix=f"node{node}-"))
    try:
        results = launch_ranks(rank_entry, (fail_rank,), world=4, nodes=2, node_rank=node, rendezvous=(address, port),
                               log_dir=logs, run_id="nodes-test", rendezvous_timeout_s=120)
        print(json.dumps({"results": {str(k): v for k, v in results.items()}}), flush=True)
    except RankFailed as exc:
        print(json.dumps({"failed": exc.rank, "exitcode": exc.exitcode, "message": str(exc)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
