"""zeal::Trainer's learning rates against transformers' schedules on two parameter groups.

Reads a JSON list of {"type", "warmup_steps", "warmup_ratio", "total", "base_lrs", "lr_init",
"zeal": [[rate of each group] per step]}, builds torch.optim.AdamW with those groups,
transformers.get_scheduler(type) with TrainingArguments' warm-up rule, and compares every step's
rates with zeal's (relative 1e-15). Exit 77 without transformers (1 under ZEAL_REQUIRE_PEERS=1).
"""
import json, math, os, sys

try:
    import torch
    from transformers import get_scheduler
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks torch or transformers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

failures = 0
for case in json.load(open(sys.argv[1])):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in case["base_lrs"]]
    opt = torch.optim.AdamW(groups, lr=case["lr_init"])
    total = case["total"]
    # TrainingArguments.get_warmup_steps
    warmup = case["warmup_steps"] if case["warmup_steps"] > 0 else math.ceil(total * case["warmup_ratio"])
    sched = get_scheduler(case["type"], opt, num_warmup_steps=warmup, num_training_steps=total)
    if len(case["zeal"]) != total:
        print(f"FAIL: {case['type']}: zeal gave {len(case['zeal'])} steps, expected {total}")
        failures += 1
    for t, zeal in enumerate(case["zeal"]):
        hf = sched.get_last_lr()
        for g, (a, b) in enumerate(zip(zeal, hf)):
            if abs(a - b) > 1e-15 * max(abs(b), 1e-30):
                print(f"FAIL: {case['type']} step {t} group {g}: zeal {a!r}, transformers {b!r}")
                failures += 1
        opt.step()
        sched.step()
    print(f"{case['type']} (warm-up {warmup} of {total}): {len(case['zeal'])} steps x {len(case['base_lrs'])} groups checked")
print(f"{failures} rates differ")
sys.exit(1 if failures else 0)
