#!/usr/bin/env python3
"""The Python peers of optim_bench, timed on the same data sizes and thread count.

    OMP_NUM_THREADS=T python3 benchmarks/optim_peers.py --params N --threads T --repeats R

Prints one JSON object: seconds per step (median of R after a warm-up) for
  torch_fused_adamw       torch.optim.AdamW(fused=True) on CPU, fp32 gradients
  deepspeed_cpu_adam      deepspeed.ops.adam.DeepSpeedCPUAdam (AdamW mode), fp32 gradients
  deepspeed_whole_step    what a DeepSpeed ZeRO-Offload step does around that optimizer with bf16
                          parameters: inf/nan check of the gradients (sum), the norm (in float64),
                          unscale and clip (one multiply), DeepSpeedCPUAdam, copy of the fp32 master
                          into the bf16 parameters
A peer that cannot run gets {"error": "..."} instead of a time (never a made-up number).
optim_bench runs this script and prints its rows beside zeal's.
"""
import argparse
import json
import statistics
import sys
import time


def median_seconds(repeats, fn, setup=lambda: None):
    setup()
    fn()  # warm-up: page faults, lazy initialisation
    times = []
    for _ in range(repeats):
        setup()  # untimed
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = {"params": args.params, "threads": args.threads}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - report any import failure as the reason
        for k in ("torch_fused_adamw", "deepspeed_cpu_adam", "deepspeed_whole_step"):
            out[k] = {"error": f"import torch failed: {e}"}
        print(json.dumps(out))
        return
    torch.set_num_threads(args.threads)
    out["torch"] = torch.__version__
    n = args.params

    try:
        p = torch.nn.Parameter(torch.full((n,), 0.5))
        p.grad = torch.full((n,), 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
        out["torch_fused_adamw"] = {"seconds": median_seconds(args.repeats, opt.step)}
        del opt, p
    except Exception as e:  # noqa: BLE001
        out["torch_fused_adamw"] = {"error": f"{type(e).__name__}: {e}"}

    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out["deepspeed"] = deepspeed.__version__
        master = torch.nn.Parameter(torch.full((n,), 0.5))
        master.grad = torch.full((n,), 1e-3 * 1024.0)  # a loss-scaled gradient
        opt = DeepSpeedCPUAdam([master], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        out["deepspeed_cpu_adam"] = {"seconds": median_seconds(args.repeats, opt.step)}

        bf16 = torch.empty(n, dtype=torch.bfloat16)
        loss_scale, clip = 1024.0, 1.0

        def whole_step():
            g = master.grad
            s = float(g.float().sum())  # DeepSpeed's _has_inf_or_nan
            overflow = s in (float("inf"), -float("inf")) or s != s
            norm = float(g.double().norm(2)) / loss_scale  # the offload path's float64 norm
            combined = loss_scale * max(1.0, norm / clip)  # unscale_and_clip_grads
            if not overflow:
                g.mul_(1.0 / combined)
                opt.step()
                bf16.copy_(master.data)  # the bf16 partition from the fp32 one

        # The same loss-scaled gradient before every timed step (the refill is not timed).
        refill = lambda: master.grad.fill_(1e-3 * 1024.0)  # noqa: E731
        out["deepspeed_whole_step"] = {"seconds": median_seconds(args.repeats, whole_step, refill)}
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        out.setdefault("deepspeed_cpu_adam", {"error": msg})
        out["deepspeed_whole_step"] = {"error": msg}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
