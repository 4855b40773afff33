"""General text for continued pre-training: software documentation, English prose with code, from
Debian 12's documentation packages (their reST, POD, AsciiDoc, Markdown and YAML sources), fetched
without root by `apt-get download` (after `apt-get update`, once) and opened by `dpkg-deb`.

    python data/docs/prepare.py --tokenizer hf:models/SmolLM2-135M-Instruct   # 36M tokens, 5 min

Each file is one document; a duplicate, or one holding repro/smollm2.py's passkey filler (its
probe stays unseen), is dropped. Train and val are split, and ordered, by a hash of package/path.
Each package's licence is beside it below ("Files: *" of /usr/share/doc/<package>/copyright).
"""

import fnmatch
import gzip
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.prepare_utils import hashed, prepare_main, write_dataset
from data.tokenizer import get_tokenizer

SPHINX = ("*/_sources/*.txt",)  # the reST that Sphinx keeps beside the HTML it built
sphinx = lambda names, licence: dict.fromkeys(names.split(), (licence, SPHINX))
KERNEL = tuple(f"*/Documentation/*.{ext}.gz" for ext in ("rst", "txt", "yaml"))
PACKAGES = {  # Debian package: (licence, the files taken: fnmatch patterns; "*" spans folders)
    "linux-doc-6.12": ("GPL-2.0", KERNEL),
    "python3.11-doc": ("PSF-2.0", SPHINX),
    "perl-doc": ("GPL-1.0+ or Artistic", ("*/pod/*.pod",)),
    "llvm-15-doc": ("Apache-2.0 with LLVM exception", SPHINX),
    "clang-15-doc": ("Apache-2.0 with LLVM exception", SPHINX),
    "git-doc": ("GPL-2.0", ("*/doc/git-doc/*.txt",)),
    "nodejs-doc": ("MIT", ("*/api/*.md.gz",)),
    "sagemath-doc": ("GPL-2.0+", ("*/html/en/*/_sources/*.txt",)),  # not its translations
    "python-sqlalchemy-doc": ("MIT", ("*.rst",)),
    **sphinx("python-pytest-doc mypy-doc python-setuptools-doc twisted-doc", "MIT"),
    **sphinx("cmake-doc python-sklearn-doc python-statsmodels-doc python-pandas-doc "
             "python-astropy-doc numba-doc python-sympy-doc python-ipython-doc python-celery-doc "
             "python-skimage-doc python-dask-doc python-distributed-doc python-flask-doc "
             "python-qutip-doc sphinx-doc", "BSD"),
    **sphinx("python-xarray-doc neutron-doc cinder-doc ironic-doc", "Apache-2.0"),
}  # NOTE: in this order, a file that two packages hold is kept as the first's
EXCLUDED = ("*/translations/*",)  # the kernel's documents in other languages
PASSKEY_FILLER = "The grass is green. The sky is blue."  # the start of repro/smollm2.py's FILLER


def fetch(packages, into):
    """apt-get download each package into the folder into; {package: its .deb file}."""
    done = subprocess.run(["apt-get", "download", *packages], cwd=into, capture_output=True,
                          text=True)
    debs = {p: next(Path(into).glob(f"{p}_*.deb"), None) for p in packages}
    if done.returncode or None in debs.values():
        why = (done.stderr.strip().splitlines() or ["no .deb"])[-1]
        raise RuntimeError(f"apt-get download failed ({why}); run `apt-get update` once (as root), "
                           "or `apt-cache search` for a package's current name and edit PACKAGES")
    return debs


def read_deb(deb, patterns):
    """(path, text) of the files of the .deb that match a pattern and no EXCLUDED one, gunzipped."""
    matches = lambda name, globs: any(fnmatch.fnmatchcase(name, g) for g in globs)
    tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=tar.stdout, mode="r|") as files:  # a stream: nothing goes to disk
        for f in files:
            if f.isfile() and matches(f.name, patterns) and not matches(f.name, EXCLUDED):
                data = files.extractfile(f).read()
                data = gzip.decompress(data) if f.name.endswith(".gz") else data
                yield f.name.removeprefix("./"), data.decode("utf-8", "replace")
    if tar.wait():
        raise RuntimeError(f"dpkg-deb could not read {deb}")


def prepare(out_dir=None, tokenizer="byte", val_fraction=0.03, packages=None):
    """Fetch the packages (default: all), split their files by the hash of package/path."""
    packages = packages or tuple(PACKAGES)
    if set(packages) - PACKAGES.keys():
        raise ValueError(f"unknown packages {sorted(set(packages) - PACKAGES.keys())}: "
                         f"choose from {list(PACKAGES)}")
    docs, seen, dropped = [], set(), 0
    with tempfile.TemporaryDirectory() as tmp:
        debs = fetch(packages, tmp)
        for package, deb in debs.items():
            for path, text in read_deb(deb, PACKAGES[package][1]):
                digest = hashlib.sha256(text.encode()).digest()
                if PASSKEY_FILLER in text or not text.strip() or digest in seen:
                    dropped += 1
                    continue
                seen.add(digest)
                docs.append((hashed(f"{package}/{path}"), f"{package}/{path}", text))
    docs.sort()  # by the hash: each split mixes the packages
    val, train = [d for d in docs if d[0] < val_fraction], [d for d in docs if d[0] >= val_fraction]
    return write_dataset(out_dir or Path(__file__).resolve().parent, get_tokenizer(tokenizer),
        [text for *_, text in train], [text for *_, text in val],
        source="Debian 12 documentation packages (data/docs/prepare.py PACKAGES); one document per "
               "file; split by sha256 of package/path",
        packages={deb.name: PACKAGES[p][0] for p, deb in debs.items()}, dropped_files=dropped,
        val_fraction=val_fraction, val_files=[name for _, name, _ in val])


if __name__ == "__main__":
    prepare_main(prepare, __doc__, packages=lambda names: names.split(","))
