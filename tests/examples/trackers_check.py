"""Reads what train_gpt's trackers wrote (through zeal::Trainer's logs, every step) with Python's own
readers and compares it with the run's --log_jsonl (rank 0's own record of every step):
TensorBoard's EventAccumulator (tensorboard package), csv and json. usage: trackers_check.py WORK STEPS"""
import csv, glob, json, math, os, sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

work, steps = sys.argv[1], int(sys.argv[2])
truth = [json.loads(l) for l in open(os.path.join(work, "train.jsonl"))]
assert len(truth) == steps, f"--log_jsonl holds {len(truth)} steps, not {steps}"
loss = {r["step"] + 1: r["loss"] for r in truth}  # the trackers count steps from 1
evals = {r["step"] + 1: r["eval_loss"] for r in truth if "eval_loss" in r}
assert evals, "the run made no evaluation to compare"

def close(a, b, rel):
    return abs(a - b) <= rel * max(1.0, abs(b))

# TensorBoard: one event file (only the main process writes), the scalars by tag and step.
tb_dir = os.path.join(work, "ds", "job")
files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
assert len(files) == 1, f"expected one event file in {tb_dir}, found {files}"
acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
acc.Reload()
tags = set(acc.Tags()["scalars"])
want = {"train/loss", "train/grad_norm", "train/learning_rate", "train/tokens_per_s", "train/step_s", "train/epoch",
        "memory/rss_bytes", "memory/peak_rss_bytes", "eval/loss"}
assert want <= tags, f"TensorBoard tags {sorted(tags)} lack {sorted(want - tags)}"
got = {e.step: e.value for e in acc.Scalars("train/loss")}
assert sorted(got) == list(range(1, steps + 1)), f"train/loss steps {sorted(got)}"
for s, v in got.items():
    assert close(v, loss[s], 1e-6), f"train/loss at step {s}: TensorBoard {v}, the run {loss[s]}"  # float32
got_eval = {e.step: e.value for e in acc.Scalars("eval/loss")}
assert got_eval.keys() == evals.keys(), f"eval/loss steps {sorted(got_eval)} vs {sorted(evals)}"
for s, v in got_eval.items():
    assert close(v, evals[s], 1e-6), f"eval/loss at step {s}: {v} vs {evals[s]}"
lrs = [e.value for e in acc.Scalars("train/learning_rate")]
assert len(lrs) == steps and all(close(v, 1e-3, 1e-6) for v in lrs), f"train/learning_rate {lrs}"

# CSV: DeepSpeed's csv_monitor layout, one file per metric, in the same job folder.
rows = list(csv.reader(open(os.path.join(tb_dir, "train_loss.csv"))))
assert rows[0] == ["step", "train/loss"], rows[0]
assert [int(r[0]) for r in rows[1:]] == list(range(1, steps + 1)), rows
for r in rows[1:]:
    assert close(float(r[1]), loss[int(r[0])], 1e-6), f"train_loss.csv {r} vs {loss[int(r[0])]}"  # --log_jsonl has 6 decimals

# JSON lines: log_with's jsonl in logging_dir/<project>: the config first (the training arguments and
# the program's own), then one record per log: every step's, and each evaluation's.
lines = [json.loads(l) for l in open(os.path.join(work, "runs", "train_gpt", "metrics.jsonl"))]
config = lines[0]["config"]
assert config["model"] == "tiny" and config["zeal.world_size"] == "2" and config["learning_rate"] == "0.001", config
records = [r for r in lines[1:] if "train/loss" in r]
eval_records = {r["step"]: r["eval/loss"] for r in lines[1:] if "eval/loss" in r}
assert eval_records.keys() == evals.keys(), f"eval/loss records at {sorted(eval_records)} vs {sorted(evals)}"
assert [r["step"] for r in records] == list(range(1, steps + 1)), [r["step"] for r in records]
for r in records:
    assert close(r["train/loss"], loss[r["step"]], 1e-6), r
print(f"PASS: {len(tags)} TensorBoard tags over {steps} steps, {len(rows) - 1} CSV rows and {len(records)} JSON "
      f"records agree with the run's own log")
