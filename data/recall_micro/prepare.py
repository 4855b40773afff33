"""The recall task at the smallest scale (window 16, 40-token contexts): data/recall/prepare.py's
"micro" preset, written here. The `recall_micro` config trains on it in seconds on a CPU.

    python data/recall_micro/prepare.py
"""

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.recall.prepare import prepare as prepare_recall


def prepare(out_dir=None):
    return prepare_recall("micro", out_dir or Path(__file__).resolve().parent)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    prepare()
