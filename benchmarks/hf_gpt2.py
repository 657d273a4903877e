"""A tiny GPT-2 on a datasets.Dataset (examples/hf_gpt2.yaml): our exported model's next-token
test perplexity against a plain single-process Hugging Face loop, over several seeds.

Workload: examples.huggingface tiny_gpt2 (~240k parameters) on byte_windows (8,721 train and 969
test 48-byte windows of English that ships with Python), AdamW lr 3e-3, 4 epochs, a global
batch of 128 rows an update on every side:
  plain      one process: torch.manual_seed(seed), a random permutation of the train rows a
             epoch (generator seeded with seed), batches of 128, model(input_ids, labels).loss,
             AdamW at torch's defaults (weight_decay 0.01)
  allreduce  ElasticTrainer(config, data=(train, test)): 2 replicas x 64 rows, data.seed = seed
  downpour   the same with strategy.mode downpour (each replica's 64-row gradient pushed alone)
  plain_stale_64  the plain loop at batch 64 with every gradient computed at the parameters one
             update old and applied to the current ones: downpour's arithmetic with two replicas
             (the other replica's push lands between a replica's pull and its push), no Ray
Each side's perplexity is computed the same way, outside the project, from the model itself
(ours: the run's save_pretrained export loaded with from_pretrained). Repetition r uses seed r
on every side. What differs between the sides beyond the mode: ours takes weight_decay 0 (the
config's default), and its partitions end an epoch with short batches (72 updates an epoch
against the plain loop's 69).

    python benchmarks/hf_gpt2.py [--quick] [--seeds 0 1 2] [--json PATH]

--quick: one seed, 1 epoch. Needs the hf extra (pip install -e .[hf]).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from common import REPO, parse_args, report

from examples.huggingface import perplexity

CONFIG = os.path.join(REPO, "examples", "hf_gpt2.yaml")


def plain(train, test, seed: int, epochs: int, batch: int = 128, stale: bool = False) -> float:
    """The plain loop; `stale`: each gradient is computed at the parameters one update old (what
    a downpour replica sees when the other replica's push lands between its pull and its push),
    then applied to the current ones."""
    import torch

    from examples.huggingface import tiny_gpt2

    torch.manual_seed(seed)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = train["input_ids"]
    g = torch.Generator().manual_seed(seed)
    previous = None
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(ids), generator=g).split(batch):
            current = [p.detach().clone() for p in model.parameters()]
            if stale and previous is not None:
                torch._foreach_copy_([p.data for p in model.parameters()], previous)
            opt.zero_grad()
            model(input_ids=ids[idx], labels=ids[idx]).loss.backward()
            torch._foreach_copy_([p.data for p in model.parameters()], current)
            opt.step()
            previous = current
    return perplexity(model, test["input_ids"])


def ours(train, test, mode: str, seed: int, epochs: int, tmp: str) -> float:
    from transformers import AutoModelForCausalLM

    from orchestrator.config import JobConfig
    from orchestrator.trainer import ElasticTrainer

    cfg = JobConfig.from_yaml(CONFIG, [f"strategy.mode={mode}", f"data.seed={seed}", f"stop.epochs={epochs}",
                                       "scaling.cpus_per_replica=0.5", f"checkpoint.storage={tmp}/ck",
                                       f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db"])
    result = ElasticTrainer(cfg, show_progress=False, data=(train, test)).fit()
    [exported] = [e for e in result.events if e["kind"] == "exported"]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(exported["final"], "pretrained"))
    return perplexity(model, test["input_ids"])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], (("--seeds", {"type": int, "nargs": "+", "default": [0, 1, 2]}),))
    seeds, epochs = ([0], 1) if args.quick else (args.seeds, 4)
    import ray

    from examples.huggingface import byte_windows

    train, test = byte_windows(torch_format=True)
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    sides: dict[str, list[float]] = {"plain": [], "allreduce": [], "downpour": [], "plain_stale_64": []}
    try:
        for seed in seeds:  # the sides in turn, seed by seed
            for side in sides:
                t = time.perf_counter()
                with tempfile.TemporaryDirectory(prefix="eo-hf-") as tmp:
                    ppl = (plain(train, test, seed, epochs) if side == "plain"
                           else plain(train, test, seed, epochs, batch=64, stale=True) if side == "plain_stale_64"
                           else ours(train, test, side, seed, epochs, tmp))
                sides[side].append(round(ppl, 4))
                print(f"seed {seed} {side:<9} perplexity {ppl:7.3f}  ({time.perf_counter() - t:.0f}s)", flush=True)
    finally:
        ray.shutdown()
    med = {side: statistics.median(v) for side, v in sides.items()}
    for side, v in sides.items():
        print(f"{side:<9} median {med[side]:7.3f}  range {min(v):.3f}-{max(v):.3f}")
    results = {"seeds": seeds, "epochs": epochs, "perplexity": sides, "median": med}
    ratios = {f"{side}_vs_plain_median_perplexity": med[side] / med["plain"] for side in sides if side != "plain"}
    report("hf_gpt2", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
