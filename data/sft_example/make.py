"""Write the small SFT example dataset in this folder: the first and last letters of a short word.

    python data/sft_example/make.py      # rewrites train.jsonl, val.jsonl, test.jsonl (deterministic)

Each line is one SFT example in the format of data/sft.py, for example

    {"prompt": "first and last letters of cafe:", "response": "ce", "bucket": 4}

"bucket" (here the word's length, a number) groups the exact-match report that train.py prints
at the end of an SFT run. The files are committed, so `--task sft --dataset data/sft_example`
works without running this script; it documents how they were made.
"""

import argparse
import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SIZES = {"train": 600, "val": 60, "test": 120}


def example(rng):
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    return {"prompt": f"first and last letters of {word}:", "response": word[0] + word[-1], "bucket": len(word)}


def main():
    rng = random.Random(0)
    here = Path(__file__).resolve().parent
    seen = set()  # no word appears in two examples, so val and test measure unseen words
    for split, n in SIZES.items():
        lines = []
        while len(lines) < n:
            ex = example(rng)
            if ex["prompt"] not in seen:
                seen.add(ex["prompt"])
                lines.append(json.dumps(ex))
        (here / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"wrote {here / split}.jsonl ({n} examples)")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
