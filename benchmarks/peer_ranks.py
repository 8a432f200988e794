"""What the Python peers of zeal's benchmarks share: the resident-set readings they measure with
(the same the C++ side takes), and running one function on `world` ranks and reducing their JSON
results into the one line a benchmark reads.
"""
import json, os, tempfile


def rss(field):
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    """VmHWM := VmRSS (Linux 4.0 and later)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def failure(e):
    """A rank's result when the peer cannot run here: why, and the end of the trace."""
    import traceback
    return {"ok": False, "why": f"{type(e).__name__}: {e}".splitlines()[0][:400], "trace": traceback.format_exc()[-2000:]}


def finish(out_dir, rank, result):
    """Writes the rank's result for run() and leaves the process group."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        import torch.distributed as dist
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (already gone, or never made)
        pass


def run(rank_main, args, extra=None):
    """Runs rank_main(rank, args, out_dir) on args.world spawned processes; prints one JSON line:
    {"ok": true, "step_s": [slowest rank per step], "peak_bytes": most over ranks, "loss": rank 0's,
    "torch": version, ...} with rank 0's `extra` keys, or {"ok": false, "why": ...}."""
    import torch, torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(rank_main, args=(args, d), nprocs=args.world, start_method="spawn", join=True)
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(args.world)]
    bad = [r for r in ranks if not r["ok"]]
    if bad:
        print(json.dumps({"ok": False, "why": bad[0]["why"], "trace": bad[0].get("trace", ""), "torch": torch.__version__}))
        return
    steps = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    out = {"ok": True, "step_s": steps, "peak_bytes": max(r["peak_bytes"] for r in ranks), "loss": ranks[0]["loss"],
           "torch": torch.__version__}
    for k in extra or []:
        out[k] = ranks[0][k]
    print(json.dumps(out))
