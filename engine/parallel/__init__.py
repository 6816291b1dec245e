"""Tensor parallelism inside one worker: N processes joined by torch.distributed, each holding
1/N of the model (Megatron-LM's and vLLM's split), driven by the engine core's process, rank 0.

| file | what |
| --- | --- |
| `sharding.py` | which slice of each checkpoint tensor a rank holds, the sizes that must divide, reading only a rank's slices |
| `layers.py` | the layers that differ on a rank: vocabulary-parallel embedding, all-reduce after row-parallel projections |
| `group.py` | one rank's process groups (compute: gloo / NCCL; control: gloo) and its collectives |
| `messages.py` | rank 0's messages to the others (the step's flattened inputs, logits rows, threads, stop) |
| `rank_worker.py` | the process of a rank other than 0: load the shard, then run rank 0's messages |
| `driver.py` | rank 0: spawn the ranks, wait for them, stand in for the model, fail loudly when a rank dies |
"""
