"""
Generate text from a trained checkpoint: prefill the prompt, then decode with the model's KV cache.

    python sample.py                                   # continue a newline, from the newest checkpoint
    python sample.py --prompt "def fibonacci(n):"
    python sample.py --prompt_file prompt.txt --num_samples 3 --temperature 0.8 --top_k 50
    python sample.py --ckpt out/small-transformer/ckpt_best.pt --prompt "import os" --temperature 0
    python sample.py --ckpt hf:models/SmolLM2-135M-Instruct --chat --prompt "What is the capital of France?"

Without --ckpt it loads the newest checkpoint under --out_dir (default: out/), and encodes the
prompt with the tokenizer recorded in it. It stops where every sample has produced the end token
(--no_stop goes on), or after --max_new_tokens (default: 200, or as many as fit in the model's
max_seq_len), and prints the time to first token (the prefill) and the decode speed. --chat wraps the
prompt in an instruction-tuned model's chat template, as its user's message. It decodes
with orthros.py's naive KV cache, the code a student reads; on a GPU, --decoder fast uses
perf/engine.py's static cache, each step one compiled graph replayed as a CUDA graph (the same
numbers, tested); its one-time cost (compiling, capturing the graph) is printed on a line of its own.
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
    parser.add_argument("--prompt", help="the text to continue (default: a newline)")
    parser.add_argument("--prompt_file", help="read the prompt from this UTF-8 file instead")
    parser.add_argument("--num_samples", type=int, default=1, help="samples, generated as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="tokens to generate (default: 200, or as many as fit in the model's max_seq_len)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; must be >= 0")
    parser.add_argument("--top_k", type=int, default=None, help="sample only from the k most likely tokens (k >= 1)")
    parser.add_argument("--no_stop", action="store_true", help="continue past the end token")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--ckpt", help="a checkpoint file (default: the newest under --out_dir), or hf:DIR, a Hugging "
                                       "Face Llama-architecture folder converted on load (convert/hf.py)")
    parser.add_argument("--window", type=int, help="the sliding window to run with (default: the checkpoint's; 128 for hf:)")
    parser.add_argument("--attn", choices=["orthros", "transformer", "swa"],
                        help="run the checkpoint as this architecture (default: its own); a converted model's "
                             "identity scale-offsets make it its own Transformer or SWA baseline")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the checkpoint's chat template, as the user's message (instruction-tuned hf: models)")
    parser.add_argument("--out_dir", default="out", help="where to look for the newest checkpoint")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    parser.add_argument("--warmup", action="store_true",
                        help="run the prompt once before timing (first-call costs, e.g. cuBLAS set-up, excluded)")
    parser.add_argument("--decoder", default="naive", choices=["naive", "fast"],
                        help="naive: the model's own KV cache (orthros.py, the default); fast: perf/engine.py's "
                             "static cache, one compiled graph per step, the same numbers, faster on a GPU")
    parser.add_argument("--json", action="store_true", help="end with one JSON line: timings and the samples")
    args = parser.parse_args(argv)
    if args.prompt is not None and args.prompt_file is not None:
        parser.error("give one of --prompt TEXT or --prompt_file PATH, not both")
    for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("temperature", 0), ("top_k", 1), ("window", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            parser.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.prompt_file is None:
        prompt = "\n" if args.prompt is None else args.prompt
    else:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            parser.error(f"--prompt_file {args.prompt_file}: no such file")
        except IsADirectoryError:
            parser.error(f"--prompt_file {args.prompt_file} is a folder; give the path of a UTF-8 text file")
        except UnicodeDecodeError as e:
            parser.error(f"--prompt_file {args.prompt_file} is not UTF-8 text (byte {e.start}); "
                         "save it as UTF-8 or pass --prompt")
    if not prompt:
        parser.error("the prompt is empty: the model needs at least one token to continue from")
    return args, prompt


def shown(name):
    """A tokenizer's name as the user would type it: hf:models/X rather than hf:/home/.../models/X."""
    folder = Path(name.removeprefix("hf:")).resolve()
    return f"hf:{folder.relative_to(Path.cwd())}" if name.startswith("hf:") and folder.is_relative_to(Path.cwd()) else name


def main(argv=None):
    args, prompt = parse_args(argv)
    try:
        device = pick_device(args.device)
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # busy cores: fewer threads
            torch.set_num_threads(cpu_threads())
        path = args.ckpt or find_latest_checkpoint(args.out_dir)
        ckpt = load_checkpoint(path)
        tokenizer = get_tokenizer(ckpt["tokenizer"], ckpt.get("tokenizer_files"))
        if args.chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"--chat: the {ckpt['tokenizer']} tokenizer has no chat template; --chat is for "
                             "instruction-tuned Hugging Face models (hf:DIR with a chat template)")
        ids = tokenizer.encode(tokenizer.chat(prompt) if args.chat else prompt)
        trained_len = ckpt["model_config"]["max_seq_len"]
        if args.max_new_tokens is None and len(ids) >= trained_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) fills the {trained_len} tokens the model was trained on; "
                             "shorten it, or pass --max_new_tokens N to generate past them")
        overrides = {k: v for k, v in (("window", args.window), ("attn", args.attn)) if v is not None}
        new_tokens = args.max_new_tokens or min(200, trained_len - len(ids))
        model = model_from_checkpoint(ckpt, max_seq_len=max(len(ids) + new_tokens, trained_len), **overrides)
    except (FileNotFoundError, ValueError, ImportError) as e:  # ours, one line each; anything else keeps its traceback
        sys.exit(f"error: {e}")
    model = model.to(device).eval()
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        model = model.to(torch.bfloat16)
    cfg = model.config
    print(f"loaded {path} (step {ckpt['step']}, {cfg.attn}" + ("" if cfg.attn == "transformer" else f", window {cfg.window}")
          + f", {shown(ckpt['tokenizer'])} tokenizer) on {device}")
    if len(ids) + new_tokens > trained_len:
        print(f"note: prompt ({len(ids)} tokens) + {new_tokens} new tokens is longer than the {trained_len} "
              "tokens the model was trained on; RoPE lets it run, quality may drop")
    if ckpt.get("source", "").startswith("hf:") and cfg.attn != "transformer" and len(ids) + new_tokens > cfg.window:
        print(f"note: converted but not trained at window {cfg.window}: past {cfg.window} tokens it sees less than the "
              "original (--window N covering the text, or --attn transformer, runs the original exactly)")
    if args.decoder == "naive" and device.startswith("cuda"):
        print("tip: --decoder fast (perf/engine.py) decodes about 20x faster here, after a compile of a few seconds")

    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    decoder, compile_s = model, None  # the model's own prefill and decode
    if args.decoder == "fast":
        from perf.engine import FastDecoder
        cuda = device.startswith("cuda")
        if not cuda:
            print(f"note: --decoder fast is built for CUDA GPUs; on {device} it runs without CUDA graphs or compiled "
                  "layers, slower than the naive decoder")
        # Inductor starts a pool of compile workers even when its on-disk cache holds every kernel (any run after the
        # first), and waits for them at exit: 8-10 s on an H200's host. One thread: no pool.
        torch._inductor.config.compile_threads = 1
        t0 = time.perf_counter()
        decoder = FastDecoder(model, args.num_samples, max_len=len(ids) + new_tokens, compile=cuda)
        decoder.warm_up(args.temperature, args.top_k)  # compile the step (PyTorch caches it on disk) and capture it
        sync(device)
        compile_s = time.perf_counter() - t0
        print(f"compiling the fast decoder: {compile_s:.1f} s (once per process)")
    if args.warmup:  # the first call's costs: cuBLAS set-up, kernels compiled for the prompt's length
        for _ in decoder.generate_tokens(idx, min(3, new_tokens), args.temperature, args.top_k):
            pass
    torch.manual_seed(args.seed)
    rows, ended = [], torch.zeros(args.num_samples, dtype=torch.bool, device=device)
    sync(device)
    t0 = time.perf_counter()
    # The decoder's loop (the model's, or the fast one's) yields one token per step: the first right after prefill (TTFT).
    for step, next_idx in enumerate(decoder.generate_tokens(idx, new_tokens, args.temperature, args.top_k)):
        rows.append(next_idx)
        if step == 0:
            sync(device)
            ttft = time.perf_counter() - t0
        ended |= next_idx[:, 0] == tokenizer.eot
        # Every sample has ended: stop. Asked every 8 tokens, not each: reading a GPU's answer waits for its queue.
        if not args.no_stop and step % 8 == 0 and ended.all():
            break
    sync(device)
    decode_time = time.perf_counter() - t0 - ttft
    texts = []
    for i, row in enumerate(torch.cat(rows, dim=1).tolist()):
        if not args.no_stop and tokenizer.eot in row:
            row = row[:row.index(tokenizer.eot)]  # the end token and what would follow it are not shown
        texts.append(prompt + ("\n" if args.chat else "") + tokenizer.decode(row))
        print(f"---------- sample {i + 1}" if args.num_samples > 1 else "----------")
        print(texts[-1])
    print("----------")
    n_decoded = (len(rows) - 1) * args.num_samples
    speed = n_decoded / decode_time if n_decoded else None
    print(f"prompt {len(ids)} tokens; time to first token {ttft * 1000:.1f} ms; decode "
          + (f"{speed:,.1f} tokens/s" if speed else "n/a") + f" (batch {args.num_samples}, {len(rows)} steps, "
          f"{args.decoder} decoder)")
    if args.json:
        print(json.dumps({"ckpt": str(path), "device": device, "prompt_tokens": len(ids), "batch": args.num_samples,
                          "new_tokens": len(rows), "ttft_ms": ttft * 1000, "decode_tokens_per_s": speed,
                          "decoder": args.decoder, "compile_s": compile_s, "samples": texts}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: sampling writes nothing, so there is nothing to save
        sys.exit("interrupted")
