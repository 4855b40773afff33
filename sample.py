"""
Generate text from a trained checkpoint with the KV-cache decoder (prefill, then decode).

    python sample.py --prompt "def fibonacci(n):"
    python sample.py --prompt_file prompt.txt --num_samples 3 --temperature 0.8 --top_k 50
    python sample.py --ckpt out/small-transformer/ckpt_best.pt --prompt "import os" --temperature 0

Without --ckpt it loads the newest checkpoint under --out_dir (default: out/). Prompts are
encoded with the tokenizer recorded in the checkpoint. It prints the time to first token (the
prefill) and the decode speed in tokens/s.
"""

import argparse
import os
import sys
import time

import torch

from checkpoint import find_latest_checkpoint, load_checkpoint, model_from_checkpoint
from data.tokenizer import get_tokenizer
from orthros import sample_next


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", help="the text to continue")
    parser.add_argument("--prompt_file", help="read the prompt from this file instead")
    parser.add_argument("--num_samples", type=int, default=1, help="samples, generated as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None, help="sample only from the k most likely tokens")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--ckpt", help="a checkpoint file (default: the newest under --out_dir)")
    parser.add_argument("--out_dir", default="out", help="where to look for the newest checkpoint")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    parser.add_argument("--warmup", action="store_true",
                        help="run the prompt once before timing (first-call costs, e.g. kernel compilation, excluded)")
    args = parser.parse_args(argv)

    if (args.prompt is None) == (args.prompt_file is None):
        parser.error("give exactly one of --prompt TEXT or --prompt_file PATH")
    if args.prompt_file is not None and not os.path.isfile(args.prompt_file):
        parser.error(f"--prompt_file {args.prompt_file}: no such file")
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    if not prompt:
        parser.error("the prompt is empty: the model needs at least one token to continue from")
    if args.num_samples < 1 or args.max_new_tokens < 1:
        parser.error("--num_samples and --max_new_tokens must be >= 1")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    try:
        path = args.ckpt or find_latest_checkpoint(args.out_dir)
        ckpt = load_checkpoint(path, device)
        tokenizer = get_tokenizer(ckpt["tokenizer"])
        ids = tokenizer.encode(prompt)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    config = ckpt["model_config"]
    needed = len(ids) + args.max_new_tokens
    if needed > config["max_seq_len"]:
        print(f"note: prompt ({len(ids)} tokens) + max_new_tokens ({args.max_new_tokens}) is longer than the "
              f"{config['max_seq_len']} tokens the model was trained on; RoPE lets it run, quality may drop")
    model = model_from_checkpoint(ckpt, max_seq_len=max(needed, config["max_seq_len"])).to(device).eval()
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        model = model.to(torch.bfloat16)
    print(f"loaded {path} (step {ckpt['step']}, {config['attn']}, {ckpt['tokenizer']} tokenizer) on {device}")

    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    if args.warmup:
        with torch.inference_mode():
            logits, cache = model.prefill(idx)
            for _ in range(2):
                logits, cache = model.decode(logits[:, -1:].argmax(-1), cache)
    torch.manual_seed(args.seed)
    # Generate by hand from prefill/decode (model.generate does the same) so the two phases can be timed.
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        logits, cache = model.prefill(idx)
        next_idx = sample_next(logits, args.temperature, args.top_k)
        sync(device)
        ttft = time.perf_counter() - t0
        out = [next_idx]
        for _ in range(args.max_new_tokens - 1):
            logits, cache = model.decode(next_idx, cache)
            next_idx = sample_next(logits, args.temperature, args.top_k)
            out.append(next_idx)
        sync(device)
        decode_time = time.perf_counter() - t0 - ttft
    generated = torch.cat(out, dim=1).tolist()
    for i, row in enumerate(generated):
        print(f"---------- sample {i + 1}" if args.num_samples > 1 else "----------")
        print(prompt + tokenizer.decode(row))
    print("----------")
    n_decoded = (args.max_new_tokens - 1) * args.num_samples
    speed = f"{n_decoded / decode_time:,.1f} tokens/s" if n_decoded else "n/a"
    print(f"prompt {len(ids)} tokens; time to first token {ttft * 1000:.1f} ms; decode {speed} "
          f"(batch {args.num_samples})")


if __name__ == "__main__":
    main()
