#!/usr/bin/env python3
"""The Python peers of optim_bench, served one measured step at a time.

    OMP_NUM_THREADS=T python3 benchmarks/optim_peers.py --params N --threads T

optim_bench keeps this process running for one thread count and interleaves its steps with
zeal's, round by round. On start it builds every peer, runs one untimed step of each, and prints
one JSON line:
    {"ready": true, "torch": "...", "deepspeed": "...", "peers": {name: null or "why it cannot run"}}
Then, for every line it reads, a peer's name, it runs one step of that peer and prints
    {"name": name, "seconds": s}        (or {"name": name, "error": "..."})
and "quit" ends it. The peers, each on its own buffers of N float32 elements:
  torch_fused_adamw       torch.optim.AdamW(fused=True), fp32 gradients
  deepspeed_cpu_adam      deepspeed.ops.adam.DeepSpeedCPUAdam (AdamW mode), fp32 gradients
  deepspeed_whole_step    what a DeepSpeed ZeRO-Offload step does around that optimizer with bf16
                          parameters: inf/nan check of the gradients (sum), the norm (in float64),
                          unscale and clip (one multiply), DeepSpeedCPUAdam, copy of the fp32 master
                          into the bf16 parameters; the loss-scaled gradient is refilled, untimed,
                          before each step
A peer that cannot run says why instead of giving a time (never a made-up number).
"""
import argparse
import json
import sys
import time


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def build_peers(n, torch):
    """name -> (setup, step) or the reason it cannot run; setup runs untimed before each step."""
    peers = {}
    try:
        p = torch.nn.Parameter(torch.full((n,), 0.5))
        p.grad = torch.full((n,), 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
        peers["torch_fused_adamw"] = (lambda: None, opt.step)
    except Exception as e:  # noqa: BLE001 - any failure is the peer's reason
        peers["torch_fused_adamw"] = f"{type(e).__name__}: {e}"
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        master = torch.nn.Parameter(torch.full((n,), 0.5))
        master.grad = torch.full((n,), 1e-3 * 1024.0)
        ds = DeepSpeedCPUAdam([master], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        peers["deepspeed_cpu_adam"] = (lambda: None, ds.step)

        whole = torch.nn.Parameter(torch.full((n,), 0.5))
        whole.grad = torch.full((n,), 1e-3 * 1024.0)
        ds_whole = DeepSpeedCPUAdam([whole], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        bf16 = torch.empty(n, dtype=torch.bfloat16)
        loss_scale, clip = 1024.0, 1.0

        def whole_step():
            g = whole.grad
            s = float(g.float().sum())  # DeepSpeed's _has_inf_or_nan
            overflow = s in (float("inf"), -float("inf")) or s != s
            norm = float(g.double().norm(2)) / loss_scale  # the offload path's float64 norm
            combined = loss_scale * max(1.0, norm / clip)  # unscale_and_clip_grads
            if not overflow:
                g.mul_(1.0 / combined)
                ds_whole.step()
                bf16.copy_(whole.data)  # the bf16 partition from the fp32 one

        peers["deepspeed_whole_step"] = (lambda: whole.grad.fill_(1e-3 * 1024.0), whole_step)
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        peers.setdefault("deepspeed_cpu_adam", why)
        peers["deepspeed_whole_step"] = why
    return peers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        say({"ready": False, "error": f"import torch failed: {e}"})
        return
    torch.set_num_threads(args.threads)
    info = {"ready": True, "torch": torch.__version__, "threads": args.threads}
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001
        pass
    peers = build_peers(args.params, torch)
    for name, peer in list(peers.items()):
        if isinstance(peer, str):
            continue
        try:
            peer[0]()
            peer[1]()  # warm-up: page faults, lazy initialisation
        except Exception as e:  # noqa: BLE001
            peers[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    info["peers"] = {k: (v if isinstance(v, str) else None) for k, v in peers.items()}
    say(info)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        peer = peers.get(name)
        if peer is None or isinstance(peer, str):
            say({"name": name, "error": peer or "no such peer"})
            continue
        setup, step = peer
        setup()
        start = time.perf_counter()
        step()
        say({"name": name, "seconds": time.perf_counter() - start})


if __name__ == "__main__":
    sys.exit(main())
