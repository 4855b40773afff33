"""
Generate text from a trained checkpoint: prefill the prompt, then decode with the model's KV cache.

    python sample.py                                  # continue a newline: the newest checkpoint
    python sample.py --prompt "def fibonacci(n):"
    python sample.py --prompt_file prompt.txt --num_samples 3 --temperature 0.8 --top_k 50
    python sample.py --ckpt out/small-transformer/ckpt_best.pt --prompt "import os" --temperature 0
    python sample.py --ckpt hf:models/SmolLM2-135M-Instruct --chat --prompt "Capital of France?"

Without --ckpt it loads the newest checkpoint under --out_dir (default: out/), and encodes the
prompt with the tokenizer recorded in it. It stops where every sample has produced the end token
(--no_stop goes on), or after --max_new_tokens (default: 200, or as many as fit in the model's
max_seq_len), and prints the time to first token (the prefill) and the decode speed. --chat wraps
the prompt in an instruction-tuned model's chat template, as its user's message. It decodes with
orthros.py's naive KV cache, the code a student reads; on a GPU, --decoder fast uses
perf/engine.py's static cache, each step one CUDA graph replay (the same numbers, tested; nothing
to compile); capturing the graph is printed on a line of its own.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from checkpoint import (ArgumentParser, cpu_threads, find_latest_checkpoint, load_checkpoint,
                        model_from_checkpoint, pick_device, sync)
from data.tokenizer import get_tokenizer


def parse_args(argv):
    parser = ArgumentParser(prog="python sample.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--prompt", help="the text to continue (default: a newline)")
    add("--prompt_file", help="read the prompt from this UTF-8 file instead")
    add("--num_samples", type=int, default=1, help="samples, generated as one batch")
    add("--max_new_tokens", type=int, default=None,
        help="tokens to generate (default: 200, or as many as fit in the model's max_seq_len)")
    add("--temperature", type=float, default=0.8, help="0 = greedy; must be >= 0")
    add("--top_k", type=int, default=None, help="sample only from the k likeliest tokens (k >= 1)")
    add("--no_stop", action="store_true", help="continue past the end token")
    add("--seed", type=int, default=1337)
    add("--ckpt", help="a checkpoint file (default: the newest under --out_dir), or hf:DIR, a "
                       "Hugging Face Llama-architecture folder converted on load (convert/hf.py)")
    add("--window", type=int, help="the sliding window (default: the checkpoint's; 128 for hf:)")
    add("--attn", choices=["orthros", "transformer", "swa"],
        help="run the checkpoint as this architecture (default: its own); a converted model's "
             "identity scale-offsets make it its own Transformer or SWA baseline")
    add("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template, as "
                                            "the user's message (instruction-tuned hf: models)")
    add("--out_dir", default="out", help="where to look for the newest checkpoint")
    add("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    add("--warmup", action="store_true",
        help="run the prompt once before timing (first-call costs, e.g. cuBLAS set-up, excluded)")
    add("--decoder", default="naive", choices=["naive", "fast"],
        help="naive: the model's own KV cache (orthros.py, the default); fast: perf/engine.py's "
             "static cache, each step one CUDA graph replay, the same numbers, faster on a GPU")
    add("--json", action="store_true", help="end with one JSON line: timings and the samples")
    args = parser.parse_args(argv)
    if args.prompt is not None and args.prompt_file is not None:
        parser.error("give one of --prompt TEXT or --prompt_file PATH, not both")
    for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("temperature", 0), ("top_k", 1),
                      ("window", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            parser.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    prompt = "\n" if args.prompt is None else args.prompt
    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            parser.error(f"--prompt_file {args.prompt_file}: no such file")
        except IsADirectoryError:
            parser.error(f"--prompt_file {args.prompt_file} is a folder; give a UTF-8 text file")
        except UnicodeDecodeError as e:
            parser.error(f"--prompt_file {args.prompt_file} is not UTF-8 text (byte {e.start}); "
                         "save it as UTF-8 or pass --prompt")
    if not prompt:
        parser.error("the prompt is empty: the model needs at least one token to continue from")
    return args, prompt


def shown(name):
    """A tokenizer's name as the user would type it: hf:models/X, not hf:/home/.../models/X."""
    folder = Path(name.removeprefix("hf:")).resolve()
    if name.startswith("hf:") and folder.is_relative_to(Path.cwd()):
        return f"hf:{folder.relative_to(Path.cwd())}"
    return name


def load(args, prompt, device):
    """(the checkpoint, its tokenizer, the prompt's token ids, tokens to generate, the model)."""
    path = args.ckpt or find_latest_checkpoint(args.out_dir)
    ckpt = load_checkpoint(path)
    tokenizer = get_tokenizer(ckpt["tokenizer"], ckpt.get("tokenizer_files"))
    if args.chat and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"--chat: the {ckpt['tokenizer']} tokenizer has no chat template; --chat "
                         "is for instruction-tuned Hugging Face models (hf:DIR with one)")
    ids = tokenizer.encode(tokenizer.chat(prompt) if args.chat else prompt)
    trained_len = ckpt["model_config"]["max_seq_len"]
    if args.max_new_tokens is None and len(ids) >= trained_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) fills the {trained_len} tokens the model "
                         "was trained on; shorten it, or pass --max_new_tokens N to go past them")
    new_tokens = args.max_new_tokens or min(200, trained_len - len(ids))
    overrides = {k: v for k, v in (("window", args.window), ("attn", args.attn)) if v is not None}
    max_seq_len = max(len(ids) + new_tokens, trained_len)
    model = model_from_checkpoint(ckpt, max_seq_len=max_seq_len, **overrides)
    model = model.to(device).eval()
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        model = model.to(torch.bfloat16)
    cfg, path = model.config, str(path)
    window = "" if cfg.attn == "transformer" else f", window {cfg.window}"
    print(f"loaded {path} (step {ckpt['step']}, {cfg.attn}{window}, {shown(ckpt['tokenizer'])} "
          f"tokenizer) on {device}")
    if len(ids) + new_tokens > trained_len:
        print(f"note: prompt ({len(ids)} tokens) + {new_tokens} new tokens is longer than the "
              f"{trained_len} tokens the model was trained on; RoPE lets it run, quality may drop")
    converted = ckpt.get("source", "").startswith("hf:") and cfg.attn != "transformer"
    if converted and len(ids) + new_tokens > cfg.window:
        print(f"note: converted but not trained at window {cfg.window}: past {cfg.window} tokens "
              "it sees less than the original (--window N covering the text, or --attn "
              "transformer, runs the original exactly)")
    return path, tokenizer, ids, new_tokens, model


def main(argv=None):
    args, prompt = parse_args(argv)
    try:
        device = pick_device(args.device)
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_threads())   # on busy cores, fewer threads decode faster
        path, tokenizer, ids, new_tokens, model = load(args, prompt, device)
    except (FileNotFoundError, ValueError, ImportError) as e:  # ours, one line each
        sys.exit(f"error: {e}")
    if args.decoder == "naive" and device.startswith("cuda"):
        print("tip: --decoder fast (perf/engine.py) decodes about 10x faster here")

    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    decoder, setup_s = model, None  # the model's own prefill and decode
    if args.decoder == "fast":
        from perf.engine import FastDecoder
        if not device.startswith("cuda"):
            print(f"note: --decoder fast is built for CUDA GPUs; on {device} it runs without them")
        t0 = time.perf_counter()
        decoder = FastDecoder(model, args.num_samples, max_len=len(ids) + new_tokens)
        decoder.warm_up(args.temperature, args.top_k)  # capture its CUDA graph before the timing
        sync(device)
        setup_s = time.perf_counter() - t0
        print(f"fast decoder ready: {setup_s:.2f} s (its CUDA graph captured)")
    sampling = (args.temperature, args.top_k)
    if args.warmup:  # the first call's costs: cuBLAS set-up, kernels loaded for the prompt's length
        list(decoder.generate_tokens(idx, min(3, new_tokens), *sampling))
    torch.manual_seed(args.seed)
    rows, ended = [], torch.zeros(args.num_samples, dtype=torch.bool, device=device)
    sync(device)
    t0 = time.perf_counter()
    # The decoder's loop yields one token per step: the first right after prefill (TTFT).
    for step, next_idx in enumerate(decoder.generate_tokens(idx, new_tokens, *sampling)):
        rows.append(next_idx)
        if step == 0:
            sync(device)
            ttft = time.perf_counter() - t0
        ended |= next_idx[:, 0] == tokenizer.eot
        # Every sample has ended: stop. Asked every 8 tokens: reading a GPU's answer waits for it.
        if not args.no_stop and step % 8 == 0 and ended.all():
            break
    sync(device)
    decode_time = time.perf_counter() - t0 - ttft
    texts = []
    for i, row in enumerate(torch.cat(rows, dim=1).tolist()):
        if not args.no_stop and tokenizer.eot in row:
            row = row[:row.index(tokenizer.eot)]  # the end token, and what follows, not shown
        texts.append(prompt + ("\n" if args.chat else "") + tokenizer.decode(row))
        print(f"---------- sample {i + 1}" if args.num_samples > 1 else "----------")
        print(texts[-1])
    print("----------")
    n_decoded = (len(rows) - 1) * args.num_samples
    speed = n_decoded / decode_time if n_decoded else None
    print(f"prompt {len(ids)} tokens; time to first token {ttft * 1000:.1f} ms; decode "
          + (f"{speed:,.1f} tokens/s" if speed else "n/a")
          + f" (batch {args.num_samples}, {len(rows)} steps, {args.decoder} decoder)")
    if args.json:
        print(json.dumps({"ckpt": path, "device": device, "prompt_tokens": len(ids),
                          "batch": args.num_samples, "new_tokens": len(rows),
                          "ttft_ms": ttft * 1000, "decode_tokens_per_s": speed,
                          "decoder": args.decoder, "setup_s": setup_s, "samples": texts}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: sampling writes nothing, so there is nothing to save
        sys.exit("interrupted")
