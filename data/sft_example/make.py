"""Write the SFT example in this folder, the first and last letters of a short word, one line per
example in data/sft.py's format (the files are committed: this documents how they were made):

    python data/sft_example/make.py   # rewrites train.jsonl, val.jsonl, test.jsonl, the same
    {"prompt": "first and last letters of cafe:", "response": "ce", "bucket": 4}   # its length
"""

import json
import random
import string
from pathlib import Path

rng, seen, here = random.Random(0), set(), Path(__file__).resolve().parent
for split, n in {"train": 600, "val": 60, "test": 120}.items():
    lines = []
    while len(lines) < n:  # no word twice: val and test measure unseen words
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        if word not in seen:
            seen.add(word)
            lines.append(json.dumps({"prompt": f"first and last letters of {word}:",
                                     "response": word[0] + word[-1], "bucket": len(word)}))
    (here / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {here / split}.jsonl ({n} examples)")
