"""
sample.py in this process, timed in parts: the imports, main(), and (for the caller's clock) the
moment main() returned, so that the process's exit can be told apart. Ends with one line
"TIMING {json}". Every argument goes to sample.py:

    python perf/time_sample.py --prompt "import os" --max_new_tokens 200 --no_stop --json --decoder fast
"""
import time

t0 = time.time()
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: import from the repository root
import sample  # noqa: E402

t1 = time.time()
sample.main(sys.argv[1:])
t2 = time.time()
print("TIMING " + json.dumps({"import_s": t1 - t0, "main_s": t2 - t1, "t_start": t0, "t_end": t2}), flush=True)
