"""Tokenizers, offline: get_tokenizer("byte" | "gpt2" | "hf:DIR"), each with .name, .vocab_size,
.eot (the end of a document, which encode() never emits but for hf:DIR), .encode and .decode.
GPT-2 BPE reads its ranks from $ORTHROS_TIKTOKEN_FILE, else data/gpt2.tiktoken, fetched once from
openai-whisper's sdist on PyPI (tiktoken's own download site is out of many machines' reach)."""

import base64
import hashlib
import importlib
import itertools
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import tiktoken

from data.prepare_utils import atomic_write

GPT2_BPE_FILE = Path(__file__).resolve().parent / "gpt2.tiktoken"
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER = "openai-whisper==20250625"  # pinned: every release carries the same file
GPT2_BPE_HOWTO = (f"Offline, `pip download --no-deps --no-binary :all: {WHISPER}` elsewhere and "
                  "copy whisper/assets/gpt2.tiktoken from its tarball to data/gpt2.tiktoken (or "
                  "point ORTHROS_TIKTOKEN_FILE at it).")
# tiktoken's r50k_pat_str (tiktoken_ext/openai_public.py, 0.14): GPT-2's pattern, faster
GPT2_PAT_STR = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++"""
                r"""|\s++$|\s+(?!\S)|\s""")
GPT2_EOT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 is the end-of-document token. Needs no files."""
    name, eot, eot_text, vocab_size = "byte", 256, "<|end|>", 257

    def encode(self, text):
        # surrogatepass: a str holding lone surrogates (read with surrogateescape) encodes too
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, ids):
        ids = list(ids)  # the check would spend a generator
        if bad := [i for i in ids if not 0 <= i <= self.eot]:
            raise ValueError(f"byte tokenizer: id {bad[0]} is outside its vocabulary 0..256")
        # each run between end tokens decoded on its own: no character spans an end token
        return "".join(self.eot_text * len(list(run)) if end else
                       bytes(run).decode("utf-8", errors="replace")
                       for end, run in itertools.groupby(ids, lambda i: i == self.eot))


class GPT2Tokenizer:
    """GPT-2 BPE (tiktoken's "gpt2" = r50k_base): 50257 ids, the last one is <|endoftext|>."""
    name, eot, eot_text, vocab_size = "gpt2", 50256, GPT2_EOT, 50257

    def __init__(self):
        path = os.environ.get("ORTHROS_TIKTOKEN_FILE")
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"ORTHROS_TIKTOKEN_FILE={path!r}: no file. {GPT2_BPE_HOWTO}")
        if not path and not GPT2_BPE_FILE.is_file():  # once, from the whisper sdist on PyPI
            print(f"fetching the GPT-2 BPE ranks from PyPI ({WHISPER}, source distribution) into "
                  f"{GPT2_BPE_FILE}, once", file=sys.stderr)
            ranks = fetch_from_pip(WHISPER, "whisper/assets/gpt2.tiktoken", GPT2_BPE_HOWTO, True)
            check_sha256(ranks, f"whisper/assets/gpt2.tiktoken in {WHISPER}")
            atomic_write(GPT2_BPE_FILE, lambda f: f.write(ranks))
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR,
                                     mergeable_ranks=read_ranks(path or GPT2_BPE_FILE),
                                     special_tokens={GPT2_EOT: 50256}, explicit_n_vocab=50257)

    def encode(self, text):
        # NOTE: tiktoken would raise a long traceback, or (encode_ordinary) silently split the
        # marker into ordinary tokens; neither tells the user what is wrong with their text.
        if GPT2_EOT in text:
            raise ValueError(f"gpt2 tokenizer: the text contains the special marker {GPT2_EOT!r}; "
                             "remove it (documents are separated by appending tok.eot)")
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(ids, errors="replace")


def fetch_from_pip(package, member, howto, sdist=False):
    """The file ending in `member` of package's wheel (or sdist), fetched by pip without deps."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                               "--no-binary" if sdist else "--only-binary", ":all:", package,
                               "-d", tmp], capture_output=True, text=True)
        found = list(Path(tmp).glob("*.tar.gz" if sdist else "*.whl"))
        if done.returncode or not found:
            why = (done.stderr.strip().splitlines() or ["nothing downloaded"])[-1]
            raise FileNotFoundError(f"pip could not fetch {package} ({why}). {howto}")
        if sdist:
            with tarfile.open(found[0]) as tar:
                return tar.extractfile(next(m for m in tar if m.name.endswith(member))).read()
        with zipfile.ZipFile(found[0]) as wheel:
            return wheel.read(next(n for n in wheel.namelist() if n.endswith(member)))


def check_sha256(contents, what):
    if (sha256 := hashlib.sha256(contents).hexdigest()) != GPT2_BPE_SHA256:
        raise ValueError(f"{what} is not the GPT-2 ranks file (corrupt, or another vocabulary): "
                         f"its sha256 is {sha256}, not {GPT2_BPE_SHA256}. {GPT2_BPE_HOWTO}")


def read_ranks(path):
    """A .tiktoken file ("<base64 token> <rank>" per line) as {token bytes: rank}."""
    # NOTE: not tiktoken's load_tiktoken_bpe, which copies even local files into a cache keyed by
    # the path: a file later replaced at the same path could be shadowed by its stale copy.
    contents = Path(path).read_bytes()
    check_sha256(contents, path)
    lines = (line.split() for line in contents.splitlines() if line)
    return {base64.b64decode(token): int(rank) for token, rank in lines}


class HFTokenizer:
    """A Hugging Face tokenizer.json (.files: HF_FILES' texts, kept in checkpoints, read back)."""

    def __init__(self, folder, files=None):
        folder = Path(folder).expanduser().resolve()
        self.name = f"hf:{folder}"
        if files is None:
            hf_tokenizer_file(folder)
            files = {name: (folder / name).read_text() for name in HF_FILES
                     if (folder / name).is_file()}
        self.files = files
        self.tokenizer = require("tokenizers").Tokenizer.from_str(files["tokenizer.json"])
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        settings = json.loads(files.get("tokenizer_config.json", "{}"))
        model_config = json.loads(files.get("config.json", "{}"))
        self.bos = self._token_id(settings.get("bos_token"), model_config.get("bos_token_id"))
        self.eot = self._token_id(settings.get("eos_token"), model_config.get("eos_token_id"))
        if self.eot is None:
            raise ValueError(f"{folder}: no EOS token (tokenizer_config.json's eos_token, "
                             "config.json's eos_token_id); add eos_token to tokenizer_config.json")
        template = files.get("chat_template.jinja", settings.get("chat_template"))
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template = template

    def chat(self, prompt):
        """prompt as one user message, as transformers' apply_chat_template renders it."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # jinja2 comes with torch
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = {name: None if i is None else self.tokenizer.id_to_token(i)
                   for name, i in (("bos_token", self.bos), ("eos_token", self.eot))}
        return env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **special)

    def _token_id(self, token, fallback):
        """The id of a token's text (or {"content": text}), else config.json's (first) id."""
        token = token.get("content") if isinstance(token, dict) else token
        if (found := self.tokenizer.token_to_id(token) if token else None) is not None:
            return found
        return fallback[0] if isinstance(fallback, list) else fallback

    def encode(self, text):
        return self.tokenizer.encode(text).ids

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def hf_tokenizer_file(folder):
    """folder/tokenizer.json, or a one-line FileNotFoundError that names the path."""
    if not (path := Path(folder) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no {path}: an hf: checkpoint is read with its own tokenizer; "
                                "save it beside the weights (tokenizer.save_pretrained(DIR))")
    return path


def require(module):
    """Import a package only hf: checkpoints need (safetensors, tokenizers), or say how."""
    try:
        return importlib.import_module(module)
    except ImportError:
        name = module.split(".")[0]
        raise ImportError(f"hf: checkpoints need the {name} package: pip install {name}") from None


TOKENIZERS = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def get_tokenizer(name, files=None):
    """"byte", "gpt2", or "hf:DIR" (from files, {file name: text}, where given: a checkpoint's)."""
    if name.startswith("hf:"):
        return HFTokenizer(name[3:], files)
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {sorted(TOKENIZERS)}, hf:DIR")
    return TOKENIZERS[name]()
