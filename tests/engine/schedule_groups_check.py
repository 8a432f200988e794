"""DeepSpeed's schedulers on two parameter groups against the rates zeal's engine gave them.

Reads a JSON file {"type", "params", "base_lrs": [g0, g1], "zeal": [[lr of each group] per step]},
builds torch.optim.AdamW with the same two groups, DeepSpeed's scheduler of that type over it, and
compares get_lr() at each iteration with zeal's rates (relative 1e-12). Exit 77 without deepspeed
(1 under ZEAL_REQUIRE_PEERS=1).
"""
import json, os, sys

try:
    import torch
    from deepspeed.runtime import lr_schedules
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks torch or deepspeed: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

spec = json.load(open(sys.argv[1]))
groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in spec["base_lrs"]]
opt = torch.optim.AdamW(groups)
sched = getattr(lr_schedules, spec["type"])(opt, **spec["params"])
failures = 0
for t, zeal in enumerate(spec["zeal"]):
    sched.step(t)
    ds = sched.get_lr()
    for g, (a, b) in enumerate(zip(zeal, ds)):
        if abs(a - b) > 1e-12 * max(abs(b), 1e-30):
            print(f"FAIL: {spec['type']} step {t} group {g}: zeal {a!r}, DeepSpeed {b!r}")
            failures += 1
print(f"{spec['type']}: {len(spec['zeal'])} steps x {len(spec['base_lrs'])} groups, {failures} differ")
sys.exit(1 if failures else 0)
