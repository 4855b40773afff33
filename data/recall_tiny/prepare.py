"""The recall task at CPU scale (window 32): data/recall/prepare.py's "tiny" preset, written here.

    python data/recall_tiny/prepare.py
"""

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.recall.prepare import prepare as prepare_recall


def prepare(out_dir=None):
    return prepare_recall("tiny", out_dir or Path(__file__).resolve().parent)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    prepare()
