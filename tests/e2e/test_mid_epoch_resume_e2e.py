"""End to end, in Downpour (asynchronous, the model in the shards; the lock-step modes' pause part
way through a partition, checkpointed inside an epoch and resumed: tests/integration/test_fsdp_ray.py
and tests/integration/test_mid_epoch_ray.py): a named run checkpointing inside its epochs (`checkpoint.every_steps`) whose driver's
process group is SIGKILLed part way through epoch 2 (after a checkpoint inside it, and steps
past that checkpoint) is started again with the same command: it goes on inside epoch 2, in the
same MLflow run, and every training row of epoch 2 is trained exactly once across the crash (the
rows trained up to the checkpoint's step by the killed run plus the rows the resumed run trained
in that epoch). The replicas write every step's row ids to a file as they train (the trainer's
test hook `_trace_ids` given a directory), so what the killed run trained outlives it."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from orchestrator.persistence.checkpoint import CheckpointStore
from tests.conftest import REPO

pytestmark = pytest.mark.e2e

DRIVER = """
import json, sys
from orchestrator.config import JobConfig
from orchestrator.trainer import ElasticTrainer
trainer = ElasticTrainer(JobConfig.from_yaml(sys.argv[1], sys.argv[4:]), show_progress=False)
trainer._trace_ids = sys.argv[2]  # every step's row ids, appended to files there by the replicas
result = trainer.fit()
ids = sorted(int(i) for i in trainer._dataset.train.ids)
open(sys.argv[3], "w").write(json.dumps({"result": json.loads(result.to_json()), "train_ids": ids}))
"""


def traced(directory) -> list[dict]:
    lines = []
    for path in glob.glob(f"{directory}/rows-*.jsonl"):
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.endswith("\n")]  # a line cut by the kill: not trained
    return lines


def past_the_newest_checkpoint(ck, rows) -> list[dict]:
    """The traced steps of epoch 2 past the newest good checkpoint's place (none if that is not inside epoch 2)."""
    newest = CheckpointStore(str(ck), "inside", keep=1000).latest_good()
    place = newest and newest[1]["run"]["in_epoch"]
    if not place or place["epoch"] != 2:
        return []
    return [x for x in traced(rows) if x["epoch"] == 2 and x["step"] > place["replica_steps"][x["rank"]]]


@pytest.mark.full  # ~80 s: two drivers on the session's head
def test_a_run_killed_inside_an_epoch_goes_on_inside_it_and_trains_each_row_once(ray_head, tmp_path):
    example = "mnist_downpour.yaml"
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    ck, first, second = tmp_path / "ck", tmp_path / "rows1", tmp_path / "rows2"
    first.mkdir()
    second.mkdir()
    sets = ["run.name=inside", "stop.epochs=3", "stop.target_accuracy=null", "data.partitions=62",
            "checkpoint.every_steps=6", f"checkpoint.storage={ck}", "faults.slow_replicas={0: 0.08, 1: 0.08}",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "tracking.progress_interval_s=0"]

    def command(rows, out):
        return [sys.executable, "-c", DRIVER, os.path.join(REPO, "examples", example), str(rows), str(out), *sets]

    driver = subprocess.Popen(command(first, tmp_path / "never.json"), cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    inside = f"{ck}/inside/ckpt-*-in_epoch_0002.pt.json"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            epoch1 = [x for x in traced(first) if x["epoch"] == 1]
            rows2 = sum(len(x["ids"]) for x in traced(first) if x["epoch"] == 2)
            if glob.glob(inside) and epoch1 and rows2 >= 0.6 * sum(len(x["ids"]) for x in epoch1):
                # the driver writes the checkpoints: stopped, its newest one stays the newest while we look
                os.killpg(driver.pid, signal.SIGSTOP)
                if past_the_newest_checkpoint(ck, first):
                    break
                os.killpg(driver.pid, signal.SIGCONT)  # stopped right at a checkpoint: let it train on
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint inside epoch 2 with steps past it in 300 s")
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its process group die at once: no handler runs
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)

    newest, state = CheckpointStore(str(ck), "inside", keep=1000).latest_good()  # before the restart prunes it
    place = state["run"]["in_epoch"]
    assert place is not None and place["epoch"] == 2 and (place["done"] or place["skips"]), place

    out = tmp_path / "result.json"
    proc = subprocess.run(command(second, out), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    [said] = [line for line in proc.stdout.splitlines() if line.startswith("run inside: resuming")]
    assert said.endswith(f"from {newest} (inside epoch 2)"), said

    done = json.loads(out.read_text())
    result, ids = done["result"], done["train_ids"]
    rows = traced(first)
    assert sorted(i for x in rows if x["epoch"] == 1 for i in x["ids"]) == ids  # the uncut epoch: each row once
    before = [i for x in rows if x["epoch"] == 2 and x["step"] <= place["replica_steps"][x["rank"]] for i in x["ids"]]
    lost = [x for x in rows if x["epoch"] == 2 and x["step"] > place["replica_steps"][x["rank"]]]
    after = [i for x in traced(second) if x["epoch"] == 2 for i in x["ids"]]
    twice = [i for i, n in Counter(before + after).items() if n > 1]
    assert sorted(before + after) == ids, (f"{len(before)} rows before the checkpoint, {len(after)} after the "
                                           f"restart, {len(twice)} twice, {len(set(ids) - set(before + after))} never")
    assert lost, "the kill came at the checkpoint: nothing past it was redone"
    assert sorted(i for x in traced(second) if x["epoch"] == 3 for i in x["ids"]) == ids
    [resumed] = [e for e in result["events"] if e["kind"] == "resumed"]
    assert resumed["epoch"] == 1 and resumed["in_epoch"]["epoch"] == 2, resumed
    ends = {e["epoch"]: e for e in result["events"] if e["kind"] == "epoch_end" and e["t_wall"] > resumed["t_wall"]}
    assert sorted(ends) == [2, 3] and ends[2]["rows"] == len(ids)  # the epoch's rows: before the crash and after
    assert result["epochs"] == 3 and result["mlflow_run_id"] == state["mlflow_run_id"]  # the same MLflow run goes on
