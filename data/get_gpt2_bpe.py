"""Fetch the GPT-2 BPE ranks file to data/gpt2.tiktoken, through pip (no other network needed).

    python data/get_gpt2_bpe.py

tiktoken downloads this file from openaipublic.blob.core.windows.net, which offline machines
(and many CI runners) cannot reach. The same file ships inside the openai-whisper source
distribution on PyPI as whisper/assets/gpt2.tiktoken, so we pip-download that and extract it.
"""

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `data` importable
from data.prepare_utils import atomic_write
from data.tokenizer import GPT2_BPE_FILE, GPT2_BPE_SHA256

WHISPER = "openai-whisper==20250625"  # pinned: any release carries the same file, this one is checked


def main():
    with tempfile.TemporaryDirectory() as tmp:
        # --no-binary: we want the source tarball, which tarfile can open; --no-deps: whisper's own
        # dependencies (torch, numba, ...) are not needed for one text file.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        WHISPER, "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            contents = tar.extractfile(member).read()
    sha256 = hashlib.sha256(contents).hexdigest()
    if sha256 != GPT2_BPE_SHA256:
        sys.exit(f"error: {member.name} in {sdist.name} has sha256 {sha256}, expected {GPT2_BPE_SHA256}")
    atomic_write(GPT2_BPE_FILE, lambda f: f.write(contents))  # a half-written file never sits at the real path
    print(f"wrote {GPT2_BPE_FILE} ({len(contents):,} bytes, sha256 ok)")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
