"""The partition server (in memory, and streaming Parquet) vs Ray Data vs an in-memory tensor: batches/s to 2 replicas.

Data: a Parquet directory written by the benchmark (784 float32 features as a fixed-size-list
column, like flattened MNIST, plus an int label; 6 files of one row group each). Two consumer
actors (1 CPU each) take an epoch of batches of 64 each; batches/s = all batches / wall time of
the epoch, median over the epochs after the first. The sides run interleaved epoch by epoch.
Every side reads every row of the directory each epoch (checked: rows counted per epoch).

In memory (the rows are read once, outside the timing):
- ours: the train rows cut into 8 partitions, each put once into the object store; a
  PartitionServer grants them and each consumer reads them with one PartitionReader for the
  whole run (the replicas' code, used as ModelReplica and the controller use it: each epoch's
  first grants are computed on the driver and sent with the epoch call, beside one server call
  that starts the epoch and reports the last epoch's final completions). Two servers: `ours`
  shares one queue (downpour, easgd), `ours_pinned` pins partitions round-robin (allreduce);
  both read every row, each partition cut into batches of 64 with a short last one; shuffled:
  partition order per epoch, and rows within each partition;
- Ray Data, default: `read_parquet(...).materialize()` (also in the object store),
  `streaming_split(2, equal=True)`, `iter_torch_batches(batch_size=64,
  local_shuffle_buffer_size=256)` per epoch;
- Ray Data, tuned: read into one block per consumer, the features turned into a tensor column
  before `materialize()` (outside the timing), `streaming_split(2, equal=True)`,
  `iter_torch_batches(batch_size=64, prefetch_batches=PREFETCH)` without any shuffle (it does
  less than ours: rows come in file order every epoch);
- the limit: each consumer gathers shuffled batches (index_select, the fastest CPU gather) from
  its own half, already an in-memory tensor.

Streaming (every epoch reads every row from the files again; nothing is kept across epochs):
- streaming: the product's file-source path. The driver plans the directory from its metadata
  as the controller does (`orchestrator.data.sources.load_dataset` -> `orchestrator/data/planning.py`,
  then `orchestrator.data.placement.place_data`: a StreamedData whose `train` is the plan; the
  driver reads the footers and a 64-row sample, no partition's rows). `data.test_source` is a
  separate 1,000-row file (planned, never read here), so no row of the directory is held out by
  the row hash: the train plan is all its rows, 8 contiguous row ranges (of 7,500 with --quick)
  (data.partitions 8, the default for 2 replicas). A PartitionServer (shared queue, as `ours`)
  grants them; each consumer's PartitionReader is given the plan once (as ModelReplica.set_data)
  and runs, per granted partition, a zero-CPU read task pinned to its node
  (StreamedPartitions), at most data.prefetch_partitions (default 2) ahead of the one being
  consumed; a partition is let go once consumed (checked: a reader holds none after an epoch).
  Shuffled as ours: partition order per epoch, rows within each partition;
- Ray Data streaming: `read_parquet(dir, override_num_blocks=2)` with the tuned side's tensor
  column (the identity `map_batches(batch_format="numpy", batch_size=None)`, fused into the read
  tasks) and NOT materialized, `streaming_split(2, equal=True)` once, then every epoch
  `iter_torch_batches(batch_size=64, prefetch_batches=PREFETCH)`: the split coordinator runs
  the read again each epoch. No shuffle (it does less than ours: file order every epoch);
  override_num_blocks as the tuned side (one block per consumer; Ray Data's default and 6, 12,
  24 blocks were no faster in trials).
Both streaming sides run the first STREAM_EPOCHS epochs only (seconds each, vs milliseconds),
interleaved with all the others; `streaming_vs_in_memory` divides by `ours` over those same
epochs. Ray runs with its defaults (as the product's local cluster does): idle worker processes
beyond num_cpus are ended after about a second, so between two streaming epochs Ray ends some
of the read tasks' workers and the next epoch starts new ones (docs/benchmarks.md).

    python benchmarks/loader.py [--quick] [--json PATH]
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from common import median, parse_args, report

DIM, BATCH, CONSUMERS = 784, 64, 2
# Ray Data's tuned side: prefetch_batches 1 is the default; 0 and 4 were no faster in trials on
# this 2-core machine (prefetch threads compete with the consumer for the same cores)
PREFETCH = 1
# Ray Data reading the files every epoch: blocks to read them into, one per consumer as on the
# tuned side (None: Ray Data's default; the default, 6, 12 and 24 were no faster in trials)
RD_STREAM_BLOCKS = CONSUMERS
STREAM_EPOCHS = {True: 12, False: 20}  # epochs of the two streaming sides (--quick, full)


def write_parquet(directory: str, rows: int, files: int = 6) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    per = rows // files
    for i in range(files):
        x = rng.random((per, DIM), dtype=np.float32)
        pq.write_table(pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
                                 "label": rng.integers(0, 10, per)}), os.path.join(directory, f"part-{i}.parquet"))


def consumer_class():
    import ray

    @ray.remote(num_cpus=1)
    class Consumer:
        def __init__(self) -> None:
            self.readers: dict = {}

        def warm_up(self) -> None:
            import actors.partitions.reader  # noqa: F401  (torch and ray imports, outside the timing)

        def set_data(self, side: str, server, refs: list, rank: int, read_ahead: int = 2) -> None:
            """As ModelReplica.set_data: one PartitionReader per run, given once the partitions'
            refs (in memory) or the file source's plan (streamed), wrapped in a list."""
            import torch

            from actors.partitions.reader import PartitionReader

            self.readers[side] = PartitionReader(server, refs[0], rank, BATCH, True, torch.device("cpu"), 120,
                                                 read_ahead)

        def ours(self, side: str, first_grant: dict) -> tuple[int, int, list[int]]:
            """As ModelReplica.run_epoch: every batch of the partitions granted this epoch; the
            last completions go back to the driver, which reports them when the next epoch starts.
            Returns (batches, rows, last completions). A streamed reader holds no partition once
            the epoch is over: the next epoch reads every one of them from the files again."""
            reader, n, rows = self.readers[side], 0, 0
            for x, y, _, _ in reader.epoch_batches(first_grant):
                n += int(x.shape[0] > 0)
                rows += int(x.shape[0])
            held = getattr(reader.source, "reads", {})
            assert not held, f"{side}: partitions {list(held)} still held after the epoch"
            return n, rows, reader.unreported

        def ray_data(self, it, tuned: bool) -> tuple[int, int]:
            n, rows = 0, 0
            options = ({"prefetch_batches": PREFETCH} if tuned else {"local_shuffle_buffer_size": 4 * BATCH})
            for batch in it.iter_torch_batches(batch_size=BATCH, **options):
                n += int(batch["features"].shape[0] > 0)
                rows += int(batch["features"].shape[0])
            return n, rows

        def load_half(self, x, y) -> None:
            import torch

            self.x, self.y = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())

        def in_memory(self, seed: int) -> int:
            import torch

            order = torch.from_numpy(np.random.default_rng(seed).permutation(len(self.y)))
            n = 0
            for idx in order.split(BATCH):  # the fastest CPU gather we know (index_select), as ours
                x, y = torch.index_select(self.x, 0, idx), torch.index_select(self.y, 0, idx)
                n += int(x.shape[0] == y.shape[0])
            return n

    return Consumer


class OursSide:
    """The driver's part, as the controller does it: each epoch's first grants are computed on
    the driver (the plan the server follows) and go to the consumers with their epoch call; the
    server call that starts the epoch (carrying the last epoch's final completions) is checked
    once the consumers are done; `close` reports the last completions and checks that every
    epoch was served whole."""

    def __init__(self, name: str, consumers: list, refs, rows: list[int], pinned: bool, read_ahead: int = 2):
        import ray

        from actors.partitions.server import PartitionServer
        from policies.decisions.leases import first_grant_messages

        self.first_grants = first_grant_messages  # imported here, outside the timed epochs
        self.name, self.consumers, self.unreported = name, consumers, {}
        self.plan = (rows, len(consumers), 0, pinned, True)
        self.total = sum(rows)
        self.server = PartitionServer.remote(*self.plan)
        ray.get([c.set_data.remote(name, self.server, [refs], r, read_ahead) for r, c in enumerate(consumers)])

    def __call__(self, epoch: int) -> int:
        import ray

        ranks = list(range(len(self.consumers)))
        first = self.first_grants(*self.plan, epoch, ranks)
        calls = [c.ours.remote(self.name, first[r]) for r, c in enumerate(self.consumers)]
        started = self.server.start_epoch.remote(epoch, ranks, self.unreported)
        done = ray.get(calls)
        ray.get(started)
        self.unreported = {rank: unreported for rank, (_, _, unreported) in enumerate(done)}
        rows = sum(r for _, r, _ in done)
        assert rows == self.total, f"{self.name}: epoch {epoch} read {rows} rows of {self.total}"
        return sum(n for n, _, _ in done)

    def close(self) -> None:
        import ray

        status = ray.get(self.server.finish.remote(self.unreported))
        assert status.complete, status


def timed_epochs(runners: dict, epochs: int, fewer: "dict[str, int] | None" = None) -> dict[str, list[float]]:
    """batches/s of each side's epochs, the sides interleaved epoch by epoch so that the
    machine's drift hits all of them alike. `fewer`: sides that run only the first so many
    epochs (interleaved with all the others in those)."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for epoch in range(1, epochs + 1):
        for name, run_epoch in runners.items():
            if epoch > (fewer or {}).get(name, epochs):
                continue
            t0 = time.perf_counter()
            batches = run_epoch(epoch)
            rates[name].append(batches / (time.perf_counter() - t0))
    return rates


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    from actors.partitions.decoding import DecodeSpec
    from orchestrator.config import DataConfig
    from orchestrator.data.in_memory import partition
    from orchestrator.data.placement import StreamedData, place_data
    from orchestrator.data.loading import load_dataset
    from orchestrator.data.sources import read_table, table_to_split

    rows, epochs = (60_000, 30) if args.quick else (120_000, 60)
    stream_epochs = STREAM_EPOCHS[args.quick]
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        Consumer = consumer_class()
        consumers = [Consumer.remote() for _ in range(CONSUMERS)]
        ray.get([c.warm_up.remote() for c in consumers])
        results: dict = {"rows": rows, "batch": BATCH, "epochs": epochs, "streaming_epochs": stream_epochs,
                         "partitions": 4 * CONSUMERS,
                         "ray_data_tuned": {"blocks": CONSUMERS, "tensor_column": True, "local_shuffle": None,
                                            "prefetch_batches": PREFETCH}}
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as test_dir:
            write_parquet(tmp, rows)
            write_parquet(test_dir, 1000, files=1)  # the streamed plan's data.test_source, never read here

            t0 = time.perf_counter()
            split = table_to_split(read_table(tmp), DecodeSpec(("label",), False, ("features",), None, None), tmp)
            parts = partition(split, 4 * CONSUMERS, seed=0)
            refs = [ray.put({"x": p.x, "y": p.y, "ids": p.ids}) for p in parts]
            sizes = [len(p) for p in parts]
            shared = OursSide("shared", consumers, refs, sizes, pinned=False)
            results["ours_setup_s"] = time.perf_counter() - t0
            pinned = OursSide("pinned", consumers, refs, sizes, pinned=True)

            t0 = time.perf_counter()
            ds = ray.data.read_parquet(tmp).materialize()
            iterators = ds.streaming_split(CONSUMERS, equal=True)
            results["ray_data_setup_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            # one block per consumer; the fixed-size-list column becomes a tensor column (numpy
            # batches), so batches are cut from one ndarray without a per-batch list conversion
            tuned_ds = (ray.data.read_parquet(tmp, override_num_blocks=CONSUMERS)
                        .map_batches(lambda b: b, batch_format="numpy", batch_size=None).materialize())
            tuned_iterators = tuned_ds.streaming_split(CONSUMERS, equal=True)
            results["ray_data_tuned_setup_s"] = time.perf_counter() - t0
            results["ray_data_blocks"] = {"default": ds.num_blocks(), "tuned": tuned_ds.num_blocks()}

            half = len(split) // CONSUMERS
            ray.get([c.load_half.remote(split.x[i * half:(i + 1) * half], split.y[i * half:(i + 1) * half])
                     for i, c in enumerate(consumers)])

            # streaming: the same files planned from metadata as the controller plans a file
            # source (orchestrator/data/planning.py via load_dataset, orchestrator/data/placement.py); the
            # test split is a separate small file (data.test_source), so nothing of the train
            # directory is held out: the train rows are all its rows, as on the other sides
            t0 = time.perf_counter()
            data_cfg = DataConfig(source=tmp, test_source=test_dir, label_column="label", feature_columns=["features"],
                                  batch_size=BATCH, partitions=4 * CONSUMERS, seed=0)
            planned = load_dataset(data_cfg, replicas=CONSUMERS)
            placed = place_data(planned, 4 * CONSUMERS, data_cfg.seed)
            assert isinstance(placed, StreamedData) and sum(placed.rows) == rows, (type(placed), placed.rows)
            streamed = OursSide("streamed", consumers, placed.train, placed.rows, pinned=False,
                                read_ahead=data_cfg.prefetch_partitions)
            results["streaming_setup_s"] = time.perf_counter() - t0
            results["streaming"] = {"partitions": len(placed.rows), "rows": placed.rows,
                                    "read_ahead": data_cfg.prefetch_partitions, "held_out": rows - sum(placed.rows),
                                    "row_groups": len(planned.train_plan.blocks)}

            # Ray Data reading the same files every epoch: not materialized; the tuned side's
            # tensor column (identity numpy map_batches, fused into the read tasks) and prefetch
            t0 = time.perf_counter()
            stream_ds = ray.data.read_parquet(tmp, **({"override_num_blocks": RD_STREAM_BLOCKS} if RD_STREAM_BLOCKS else {}))
            stream_ds = stream_ds.map_batches(lambda b: b, batch_format="numpy", batch_size=None)
            stream_iterators = stream_ds.streaming_split(CONSUMERS, equal=True)
            results["ray_data_streaming_setup_s"] = time.perf_counter() - t0
            results["ray_data_streaming"] = {"override_num_blocks": RD_STREAM_BLOCKS, "tensor_column": True,
                                             "local_shuffle": None, "prefetch_batches": PREFETCH,
                                             "materialized": False}

            def ray_data(its: list, tuned: bool):
                def epoch(e: int) -> int:
                    done = ray.get([c.ray_data.remote(it, tuned) for c, it in zip(consumers, its)])
                    assert sum(r for _, r in done) == rows, f"Ray Data read {sum(r for _, r in done)} rows of {rows}"
                    return sum(n for n, _ in done)
                return epoch

            rates = timed_epochs({
                "ours": shared,
                "ours_pinned": pinned,
                "streaming": streamed,
                "ray_data": ray_data(iterators, False),
                "ray_data_tuned": ray_data(tuned_iterators, True),
                "ray_data_streaming": ray_data(stream_iterators, True),
                "in_memory": lambda e: sum(ray.get([c.in_memory.remote(e) for c in consumers])),
            }, epochs, fewer={"streaming": stream_epochs, "ray_data_streaming": stream_epochs})
            shared.close()
            pinned.close()
            streamed.close()
            results.update({f"{name}_rates": r for name, r in rates.items()})
    finally:
        ray.shutdown()

    sides = ("ours", "ours_pinned", "streaming", "ray_data", "ray_data_tuned", "ray_data_streaming", "in_memory")
    steady = {k: median(results[f"{k}_rates"][1:]) for k in sides}
    # the in-memory side over the epochs the streaming side ran (2..stream_epochs): side by side
    steady["ours_in_streaming_epochs"] = median(results["ours_rates"][1:stream_epochs])
    results["steady_batches_per_s"] = steady
    for k in sides:
        print(f"{k:>18}: {steady[k]:8.0f} batches/s (first epoch {results[f'{k}_rates'][0]:.0f})")
    print(f"{'ours, epochs 2-' + str(stream_epochs):>18}: {steady['ours_in_streaming_epochs']:8.0f} batches/s")
    ratios = {"ours_vs_ray_data": steady["ours"] / steady["ray_data"],
              "ours_vs_ray_data_tuned": steady["ours"] / steady["ray_data_tuned"],
              "ours_vs_in_memory_limit": steady["ours"] / steady["in_memory"],
              "ours_pinned_vs_in_memory_limit": steady["ours_pinned"] / steady["in_memory"],
              "ours_vs_ray_data_first_epoch": results["ours_rates"][0] / results["ray_data_rates"][0],
              "ours_vs_ray_data_tuned_first_epoch": results["ours_rates"][0] / results["ray_data_tuned_rates"][0],
              "streaming_vs_ray_data_streaming": steady["streaming"] / steady["ray_data_streaming"],
              "streaming_vs_in_memory": steady["streaming"] / steady["ours_in_streaming_epochs"]}
    report("loader", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
