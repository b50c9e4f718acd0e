"""A trainer process of a 2-D (data-parallel x tensor-parallel) gloo job, for test_model_parallel_procs.

Launched with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (as torchrun does). The process mesh is
torchtitan's layout, `init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))`: the members of a
tensor-parallel group consume their data-parallel rank's batches through one `BatchClient` each
(`group_rank` = the tp index, `group_size` = tp). Every step:

* the tensor-parallel group checks that its members hold the same batch (an all_gather of a digest: a
  tensor-parallel layer silently computes garbage otherwise);
* a DDP step over the data-parallel group with batchd's loss scale (`train_step`);
* one JSON line {"dp", "tp", "step", "ids"} is appended to OUT.

A failing step raises `JobFailed` with the job's reason when the rank service knows it (the collective
broke because a peer died), and the process exits 1 printing it.

    python tests/_mp_trainer.py DP TP OUT STEP_TIME SERVICE0 SERVICE1 ...
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import batchd
from batchd.client import BatchClient, ClientOptions, train_step
from batchd.testing import FailureWatch as _FailureWatch
from batchd.testing import raise_job_failure


def main() -> int:
    dp, tp, out, step_time = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    services = sys.argv[5:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    model = DDP(
        batchd.TinyCausalLM(vocab_size=512, d_model=32, n_layers=1, n_heads=2),
        process_group=mesh["dp"].get_group(),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = ClientOptions(reconnect_timeout_s=5)
    client = BatchClient(services[dp_rank], dp_rank, dp, group_rank=tp_rank, group_size=tp, options=options)
    batches = iter(client)
    watch = _FailureWatch(client)
    try:
        with open(out, "a") as log:
            for batch, info in batches:
                ids = batch["sample_ids"].tolist()
                digest = torch.tensor([info.step, len(ids), int(batch["input_ids"].sum()), int(sum(ids))])
                gathered = [torch.zeros_like(digest) for _ in range(tp)]
                dist.all_gather(gathered, digest, group=mesh["tp"].get_group())
                if any(not torch.equal(g, digest) for g in gathered):
                    raise AssertionError(
                        f"dp {dp_rank}: the tensor-parallel group holds different batches: {gathered}"
                    )
                train_step(model, opt, {k: v for k, v in batch.items() if k != "sample_ids"}, info)
                log.write(json.dumps({"dp": dp_rank, "tp": tp_rank, "step": info.step, "ids": ids}) + "\n")
                log.flush()
                if step_time:
                    time.sleep(step_time)
    except batchd.JobFailed as exc:
        print(f"[dp {dp_rank} tp {tp_rank}] the job failed: {exc}", flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - reported with the job's reason when there is one
        try:
            raise_job_failure(client, watch, exc)
        except batchd.JobFailed as failed:
            print(f"[dp {dp_rank} tp {tp_rank}] the job failed: {failed}", flush=True)
            return 1
        raise
    finally:
        watch.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
