"""The Python side of lora_bench: all-MiniLM-L6-v2 as Hugging Face transformers'
BertForSequenceClassification (--model minilm), or a LLaMA-shaped LlamaForCausalLM (--model llama,
the causal-LM loss on every token), each with its default attention (SDPA, as zeal's), fine-tuned on
CPU ranks over gloo with DistributedDataParallel, fp32, AdamW: with peft's LoRA (--mode lora: query
and value projections; BERT's classifier in modules_to_save) or every parameter trained (--mode
full), on the token ids and labels lora_bench wrote.

--make_llama DIR --llama_config FILE writes the decoder first: LlamaForCausalLM(LlamaConfig(FILE))
initialized with seed 0 and saved with save_pretrained (safetensors), for both sides to load.

Each rank measures what lora_bench measures for zeal: the peak resident memory (VmHWM, reset
through /proc/self/clear_refs after the imports) above the resident memory before the model is
loaded, and the wall time of every step (forward, backward, optimizer step, zero_grad). Prints one
JSON object on stdout: {"ok": true, "step_s": [max over ranks per step], "peak_bytes": max over
ranks, "trainable": count}, or {"ok": false, "why": "..."} when the peer cannot run here.
"""
import argparse, json, os

import peer_ranks
from peer_ranks import rss


def rank_main(rank, args, out_dir):
    import torch, torch.nn.functional as F, torch.distributed as dist
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    result = {"ok": False}
    try:
        import transformers, peft
        transformers.logging.set_verbosity_error()
        shape = (args.steps + 1, args.world, args.micro_batch)
        n = shape[0] * shape[1] * shape[2]
        ids = torch.from_file(args.ids, size=n * args.seq_len, dtype=torch.int64).view(*shape, args.seq_len)
        labels = torch.from_file(args.labels, size=n, dtype=torch.int64).view(*shape)
        peer_ranks.reset_peak()
        base = rss("VmRSS")
        torch.manual_seed(1234)
        llama = args.model == "llama"
        if llama:
            model = transformers.LlamaForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
            lora = dict(target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        else:
            model = transformers.BertForSequenceClassification.from_pretrained(args.model_dir, num_labels=args.num_labels)
            lora = dict(target_modules=["query", "value"], modules_to_save=["classifier"], task_type="SEQ_CLS")
        if args.mode == "lora":
            cfg = peft.LoraConfig(r=args.r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, **lora)
            model = peft.get_peft_model(model, cfg)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01)
        times = []
        import time
        for step in range(args.steps + 1):
            x, y = ids[step, rank], labels[step, rank]
            t0 = time.perf_counter()
            if llama:
                loss = ddp(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
            else:
                logits = ddp(input_ids=x, attention_mask=torch.ones_like(x)).logits
                loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        result = {"ok": True, "step_s": times[1:], "peak_bytes": rss("VmHWM") - base, "loss": float(loss.detach()),
                  "trainable": sum(p.numel() for p in trainable)}
    except Exception as e:  # the peer cannot run here: say why
        result = peer_ranks.failure(e)
    peer_ranks.finish(out_dir, rank, result)


def make_llama(out_dir, config_path):
    try:
        import torch, transformers
        with open(config_path) as f:
            cfg = transformers.LlamaConfig(**json.load(f))
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
        print(json.dumps({"ok": True}))
    except Exception as e:
        print(json.dumps({"ok": False, "why": f"{type(e).__name__}: {e}"}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--make_llama")
    p.add_argument("--llama_config")
    p.add_argument("--model", choices=["minilm", "llama"], default="minilm")
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--model_dir")
    p.add_argument("--ids")
    p.add_argument("--labels")
    for name, default in [("world", 2), ("threads", 1), ("steps", 5), ("micro_batch", 8), ("seq_len", 128),
                          ("num_labels", 5), ("r", 8), ("lora_alpha", 16), ("port", 29621)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--lora_dropout", type=float, default=0.1)
    args = p.parse_args()
    if args.make_llama:
        return make_llama(args.make_llama, args.llama_config)
    try:
        import torch  # noqa: F401
        import transformers, peft  # noqa: F401 (fail here, with the reason, when they are missing)
    except Exception as e:
        print(json.dumps({"ok": False, "why": f"cannot import torch, transformers and peft: {e} (scripts/peers)"}))
        return
    peer_ranks.run(rank_main, args, extra=["trainable"])


if __name__ == "__main__":
    main()
