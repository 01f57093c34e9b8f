"""The docs/benchmarks.md section of bench.ckpt: command, machine, state, tables, how numbers are taken."""

from __future__ import annotations

SECTION = "## Checkpoint save and load: undying vs torch.distributed.checkpoint"


def docs_section(result: dict, tables: str) -> str:
    m, load, args = result["machine"], result["load_during"], result["args"]
    gib = result["total_bytes"] / 2**30
    return f"""{SECTION}

Measured by `python -m bench.ckpt` on {result['date']} ({result['wall_s'] / 60:.1f} minutes). Command:

```bash
{result['command']}
```

Machine: {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB RAM, no GPU; {m['versions']}. 1-minute load
average {m['load_at_start'][0]:.1f} at the start, {load['min']:.1f} to {load['max']:.1f} (mean {load['mean']:.1f})
during the run, on {m['cores']} cores (what else ran, if anything, is said in the notes).

State: {gib:.2f} GiB over 4 gloo ranks (one intra-op thread each): a stack of {result['layers']} Linear layers
(width {args['width']} <-> {4 * args['width']}) wrapped with FSDP2 `fully_shard`, and its AdamW state after one step
(params + exp_avg + exp_avg_sq, fp32, each sharded by rows over the 4 ranks; AdamW's scalar `step` replicated).
Medians over {args['repeats']} repeats, [min-max]; ratios are median / median. The first repeat bit-checks every
load against the saved state (outside the timings).

{tables}

How each number is taken (`time.time()` stamps of the rank processes and of the driver, one clock):
- every operation starts after a barrier on the training group; no collective runs inside a timed region
  of ours (the barrier, the gathering of timings and the bit checks are outside). Before every save, of
  either system, rank 0 runs `os.sync()` and waits 1 s (untimed), so no save waits for the writeback of
  the one before it: a training job saves minutes apart, not back to back.
- blocking: the worst rank's time inside the save call: `ShardWriter.save` (async: staging only; sync: the
  whole write), `dcp.async_save` until it returns, `dcp.save` until it returns. Both systems save warm, as a
  job that has saved before: our writers keep their staging buffers (`ckpt.staging.StagingPool`) and every
  `dcp.async_save` gets the same `DefaultStager`, which keeps its host copy; an untimed warm-up fills both.
- total save: first rank starting -> the save is a checkpoint. Ours: the driver, playing the controller,
  gets each rank's receipt through a TCPStore (a side channel, not the training group) and commits the
  manifest with `ckpt.commit.Committer`; the time is that of the durable manifest. DCP: the last
  rank's `dcp.save` returning or `async_save` future completing (rank 0 writes `.metadata` inside).
  Throughput = logical state bytes / total.
- loads: first rank starting -> last loading rank done, including the manifest / metadata read. Ours:
  `read_slices` into pre-allocated zeroed tensors of the layout; DCP: `dcp.load` into pre-allocated zeroed
  DTensors of the layout (allocations not timed). dp2 loads run on ranks 0 and 1 only (DCP on a 2-rank
  sub-mesh), tp4 on all 4 ranks: every weight's rows are spread over 4 shard files and each rank wants a
  column band of every row.
- raw read (floor): each rank reads its own shard file of our checkpoint with one `fs.cat_file`.
- file:// loads and the raw read are cold: before each one, rank 0 drops both systems' checkpoint files
  from the page cache (`posix_fadvise(DONTNEED)`, untimed), so every load reads the disk, as a restore on
  a replaced machine does. Our shard files are written past the page cache (O_DIRECT), DCP's through it.
- every rank process (both systems) starts with the environment the orchestrator gives its ranks
  (`ckpt.staging.staging_env`: glibc's non-temporal copy threshold at 1 MiB, used by our staging copy;
  DCP stages with `Tensor.copy_`, which it does not affect).
- thread vs process: rank 0 alone (the others idle in a barrier), writing its shard
  ({result['total_bytes'] / 4 / 2**20:.0f} MiB) while a training loop (small MLP, forward/backward/AdamW on one
  thread) keeps stepping. Windows of training of one length (1.5 x the slowest warm-up write, 1 s to 15 s):
  none, thread, process, rotated in every repeat. Lost = window - steps x the median seconds per step of the
  save-free windows (blocking included); the save-free windows' own spread is the noise floor. The process
  writer copies into a shared-memory buffer allocated at its untimed warm-up save and reused; the thread
  writer (ShardWriter) likewise reuses the staging buffers of its warm-up save.
"""
