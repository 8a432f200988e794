"""The PyTorch side of zero_step_bench: the GPT of examples/models/gpt.h, trained on CPU ranks over
gloo (or, with --device cuda, one GPU per rank over NCCL) with FSDP2 (torch.distributed.fsdp.fully_shard
on every block, then the root) or with DDP (--mode ddp), fp32, AdamW and gradient clipping at 1.0, on
the tokens zero_step_bench wrote.

Each rank measures what zero_step_bench measures for zeal: the peak resident memory (VmHWM, reset
through /proc/self/clear_refs after start-up) above the resident memory before the model is built, or
on a GPU the caching allocator's peak of allocated bytes above what was allocated then, and the wall
time of every step (forward, backward, clip, optimizer step; on a GPU after the device finished it). Prints one JSON object
on stdout: {"ok": true, "step_s": [...max over ranks per step], "peak_bytes": max over ranks}, or
{"ok": false, "why": "..."} when the peer cannot run here.
"""
import argparse, json, math, os, sys, time

import peer_ranks
from peer_ranks import rss


def build(args, torch, nn, F):
    C, H, L, V, T = args.dim, args.heads, args.layers, args.vocab, args.context

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn, self.attn_proj = nn.LayerNorm(C), nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.ln2, self.fc, self.fc_proj = nn.LayerNorm(C), nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            for l in (self.attn, self.attn_proj, self.fc, self.fc_proj):
                nn.init.normal_(l.weight, 0, 0.02)
                nn.init.zeros_(l.bias)
            with torch.no_grad():
                self.attn_proj.weight.mul_(1 / math.sqrt(2 * L))
                self.fc_proj.weight.mul_(1 / math.sqrt(2 * L))

        def forward(self, x):
            B, T_, C_ = x.shape
            q, k, v = self.attn(self.ln1(x)).split(C_, 2)
            heads = lambda t: t.view(B, T_, H, C_ // H).transpose(1, 2)
            y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            h = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T_, C_))
            return h + self.fc_proj(F.gelu(self.fc(self.ln2(h)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            nn.init.normal_(self.wte.weight, 0, 0.02)
            nn.init.normal_(self.wpe.weight, 0, 0.01)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.h:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.t()

    return Gpt()


def rank_main(rank, args, out_dir):
    port = args.port
    import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"ok": False}
    try:
        tokens = torch.from_file(args.tokens, size=(args.steps + 1) * args.world * args.micro_batch * (args.seq_len + 1),
                                 dtype=torch.int64).view(args.steps + 1, args.world, args.micro_batch, args.seq_len + 1)
        if args.mode == "fsdp2":  # imported before the baseline, as zeal's code is loaded before its
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
        peer_ranks.reset_peak()
        base = rss("VmRSS")
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        torch.manual_seed(1234)
        model = build(args, torch, nn, F).to(device)
        if args.mode == "fsdp2":
            mesh = init_device_mesh(device.type, (args.world,))
            for b in model.h:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        times = []
        for step in range(args.steps + 1):
            batch = tokens[step, rank].to(device)
            sync()
            t0 = time.perf_counter()
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) - base if cuda else rss("VmHWM") - base
        result = {"ok": True, "step_s": times[1:], "peak_bytes": peak, "loss": float(loss.detach())}
    except Exception as e:  # the peer cannot run here: say why
        result = peer_ranks.failure(e)
    peer_ranks.finish(out_dir, rank, result)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fsdp2", "ddp"], default="fsdp2")
    p.add_argument("--tokens", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    for name, default in [("world", 2), ("threads", 1), ("steps", 3), ("micro_batch", 2), ("seq_len", 128),
                          ("vocab", 50257), ("context", 1024), ("layers", 12), ("dim", 768), ("heads", 12),
                          ("port", 29611)]:
        p.add_argument("--" + name, type=int, default=default)
    args = p.parse_args()
    try:
        import torch  # noqa: F401
    except Exception as e:
        print(json.dumps({"ok": False, "why": f"cannot import torch: {e}"}))
        return
    peer_ranks.run(rank_main, args)


if __name__ == "__main__":
    main()
