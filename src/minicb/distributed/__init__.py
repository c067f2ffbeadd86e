"""Tensor parallelism: one model split across N processes that run every step together.

With tensor parallelism (Megatron-LM's scheme) every rank holds a slice of every weight matrix and runs
the *same* step on the *same* flat batch; two all-reduces per layer sum the ranks' partial results. So
the warning that closes the static-batching note applies literally: all ranks must agree on every
step's batch. If they do not, their collectives pair up wrongly: a rank may hang, fail with an error
far from the cause, or (when the shapes happen to agree) silently sum unrelated numbers. minicb's
answer, in one picture::

    rank 0 (the driver: LLMEngine + TPRunner)       ranks 1 .. N-1 (workers: a ModelRunner each)
    plan = scheduler.schedule()                     no scheduler, no sampler: they follow
    store.set("plan/k", plan) ───────────────────►  plan = store.get("plan/k")    (waits while idle)
    all_gather(digest(plan)) ◄─────────────────────► all_gather(digest(plan))     (differ: error on all)
    runner.run(plan, params) ◄─ 2 all-reduces per layer ─► runner.run(plan)     (the same method)
    scheduler.update(...)

Rank 0 is the engine's ordinary step loop: only its runner differs (``TPRunner`` sends the plan,
then runs its shard), so aborts, outputs and failure handling are the same code as in one process.

**One rank schedules.** Only rank 0 runs the scheduler and the sampler; each executed plan goes to the
others through the key-value store that every ``torch.distributed`` job already has (a ``TCPStore``),
as plan number ``k``. Then every rank all-gathers an 8-byte digest of ``(k, plan.fingerprint())``
(slot ids, token counts, positions, block tables, swaps) and compares: any difference raises
``DistributedError`` on *every* rank before the forward, so ranks never enter all-reduces of different
shapes. The store (not a broadcast) carries the plan because a worker may wait for the next plan for
as long as the user leaves the engine idle, while the driver must never block on a worker that is not
listening: it writes the plan and moves on, and every collective after that has a deadline.

**Never a hang.** All collectives run on a process group created with ``timeout`` (default 60 s): a
rank that dies closes its sockets and the others' pending collective fails at once; a rank that hangs
makes the others' collective fail when the deadline passes. Either way each surviving rank raises
``DistributedError``; workers print it, report it to the driver and exit with status 1; the driver's
``step()`` raises it (after the step's requests end with ``finish_reason == "error"``), stops the
workers it launched and includes their reports. If the driver dies, a waiting worker's store
connection breaks and it exits too. A failure is final: the runner keeps it (``TPRunner.failure``)
and the engine refuses further steps with it.

**Sharding of each layer** (``shard_layout`` decides which heads and columns rank ``r`` holds)::

    x ─ RMSNorm ─┬ q_proj[q heads of r]  ─┐ attention over r's heads,
                 ├ k_proj[kv heads of r] ─┼ r's own KV cache ─ o_proj[:, q heads of r] ─ all-reduce ─ + x
                 └ v_proj[kv heads of r] ─┘
    x ─ RMSNorm ─ gate_proj[cols of r], up_proj[cols of r] ─ silu(g)·u ─ down_proj[:, cols of r]
                                                                          ─ all-reduce ─ + x

q / k / v and gate / up are *column-parallel* (each rank computes some output features, no
communication); o_proj and down_proj are *row-parallel* (each rank multiplies its slice of the input
features and the partial products are summed by an all-reduce, ``RowParallelLinear``). Everything
else (RMSNorm, RoPE, the residual stream) is computed on every rank. Each rank's KV cache holds only
its own KV heads, so KV memory per rank is divided as well.

Heads are split *by KV group*, so each rank's query heads use only KV heads it holds and its
attention is an ordinary grouped-query attention (no change to any attention backend):

* ``N <= kv heads``: rank ``r`` gets a contiguous, near-equal share of the KV heads and all of their
  query heads. SmolLM2 (9 q / 3 kv) with N = 3: one KV head and 3 query heads per rank. With N = 2:
  rank 0 gets kv heads 0-1 (q heads 0-5), rank 1 kv head 2 (q heads 6-8): uneven, so rank 0 does twice
  the attention work, but no KV head is stored twice.
* ``N > kv heads``: the ranks are split into one near-equal group per KV head; every rank of a group
  holds (replicates) that KV head and a share of its query heads. 4 q / 1 kv with N = 2: both ranks
  hold kv head 0, rank 0 q heads 0-1, rank 1 q heads 2-3. N may not exceed the number of query heads.

The MLP's intermediate columns are split near-equally (uneven when N does not divide them).

**Embedding and LM head: replicated.** Every rank holds the whole embedding (it needs the whole
residual stream anyway); only rank 0 applies the LM head, to the rows it samples. A vocab-parallel
head would divide those weights too (at the price of a gather of logits every step); for the models
minicb runs, replication keeps the code and the step shorter.

**Launching.** ``LLM(..., tensor_parallel_size=N)`` / ``minicb generate --tp N`` run rank 0 in the
calling process and start ranks 1..N-1 with ``torch.multiprocessing`` (spawn; each gets only its
shard of the weights, through shared memory). Under ``torchrun`` (environment ``RANK`` /
``WORLD_SIZE``, any number of machines) nothing is spawned: every process loads the model and keeps
its shard; rank 0 returns the engine, and on the other ranks ``LLM(...)`` serves rank 0's plans and
then exits the process (``SystemExit(0)``) when rank 0 shuts down. Backend: gloo for CPU tensors,
NCCL on CUDA (plan digests always go through gloo). On the CPU each rank uses
``cpu_count // N`` intra-op threads (at least 1).

Process groups here are plain objects owned by the runner (no ``init_process_group``), so nothing
global is left behind and several engines can live in one process. ``Fault`` lets the tests make one
rank diverge, die or hang at a chosen plan.

The modules, in the order a step meets them:

==============  ==================================================================================
``sharding``    ``shard_layout`` (who holds what), ``shard_state_dict``, ``ShardedLlama`` and its
                row-parallel layers (``RowParallelLinear``)
``group``       ``TPGroup`` (the store, the process groups, ``send_plan`` / ``recv_plan``, the
                digest check, ``all_reduce``), ``plan_digest``, ``Fault``, ``CommStats``
``runner``      ``TPRunner`` (rank 0's runner) and ``serve`` (the workers' loop)
``launch``      ``launch``: spawn the ranks here, or join a ``torchrun`` job
==============  ==================================================================================
"""

from minicb.distributed.group import CommStats, Fault, TPGroup, plan_digest
from minicb.distributed.launch import launch
from minicb.distributed.runner import TPRunner, serve
from minicb.distributed.sharding import RankShard, ShardedLlama, local_config, shard_layout, shard_state_dict

__all__ = ["CommStats", "Fault", "RankShard", "ShardedLlama", "TPGroup", "TPRunner", "launch", "local_config",
           "plan_digest", "serve", "shard_layout", "shard_state_dict"]
