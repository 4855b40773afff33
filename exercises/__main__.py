"""The exercises' command line.

Students:
    python -m exercises list                 the ten exercises, their files and difficulty
    python -m exercises check 4              check exercise 4 (your exercises/ex04_*.py)
    python -m exercises check all            check every exercise
    python -m exercises hint 4               the first hint of exercise 4; `hint 4 2` the second, ...
    python -m exercises show mask            the attention pattern of Figure 1, from orthros.py
Teachers:
    python -m exercises solution 4           the reference solution's source
    python -m exercises check all --solution check the reference solutions instead of the student files
The recall lab (exercise 10) reads two trained runs: --runs swa=DIR,orthros=DIR (or the environment
variable ORTHROS_RECALL_RUNS), by default out/lab-recall-swa and out/lab-recall-orthros.
"""

import argparse
import inspect
import os
import sys
import textwrap

from exercises import framework
from exercises.framework import ORDER, load


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises")
    p = sub.add_parser("check", help="check an exercise: N or all")
    p.add_argument("which", help="1-10, or all")
    p.add_argument("--solution", action="store_true", help="check the reference solutions (teachers)")
    p.add_argument("--runs", default=os.environ.get("ORTHROS_RECALL_RUNS"),
                   help="exercise 10: the trained runs, swa=DIR,orthros=DIR")
    p = sub.add_parser("hint", help="a hint: N, then K (1, 2, 3) for the K-th")
    p.add_argument("n", type=exercise_number)
    p.add_argument("k", type=int, nargs="?", default=1)
    p = sub.add_parser("solution", help="print the reference solution (teachers)")
    p.add_argument("n", type=exercise_number)
    p = sub.add_parser("show", help="draw a picture: mask")
    p.add_argument("what", choices=["mask"])
    p.add_argument("--T", type=int, default=16, help="sequence length")
    p.add_argument("--w", type=int, default=4, help="window")
    p.add_argument("--t_out", type=int, default=4, help="output positions")
    p.add_argument("--png", default=None, help="where to write the picture (needs matplotlib); '' for none "
                   "(default: out/attention_pattern.png, none with --mine)")
    p.add_argument("--mine", action="store_true", help="draw it with your exercise 1 (in_window, attention_mask)")
    args = parser.parse_args(argv)
    if args.command == "list":
        return list_exercises()
    if args.command == "hint":
        return hint(args.n, args.k)
    if args.command == "solution":
        return solution(args.n)
    if args.command == "show":
        return show(args)
    which = range(1, len(ORDER) + 1) if args.which == "all" else [exercise_number(args.which)]
    return run_checks(which, args.solution, parse_runs(args.runs))


def exercise_number(text):
    if not text.isdigit() or not 1 <= int(text) <= len(ORDER):
        raise argparse.ArgumentTypeError(f"{text!r}: choose an exercise from 1 to {len(ORDER)}")
    return int(text)


def parse_runs(text):
    if not text:
        return None
    try:
        return dict(item.split("=", 1) for item in text.split(","))
    except ValueError:
        sys.exit(f"--runs {text!r}: write it as swa=DIR,orthros=DIR")


def list_exercises():
    print(f"{'#':>2}  {'exercise':<36} {'kind':<17} {'difficulty':<10} {'minutes':>7}  your file")
    for n, name in enumerate(ORDER, start=1):
        spec, _ = load(n, solution=True)
        print(f"{n:>2}  {spec.TITLE:<36} {framework.kind(spec):<17} {'*' * spec.DIFFICULTY:<10} "
              f"{spec.MINUTES:>7}  exercises/{name}.py")
    print("\npython -m exercises check N   checks one; hint N gives a hint. The syllabus: exercises/README.md")


def hint(n, k):
    spec, _ = load(n, solution=True)
    if not 1 <= k <= len(spec.HINTS):
        sys.exit(f"exercise {n} has hints 1 to {len(spec.HINTS)}")
    text = "\n".join(textwrap.fill(line, 100) for line in spec.HINTS[k - 1].splitlines())
    print(f"Exercise {n}, {spec.TITLE}: hint {k} of {len(spec.HINTS)}\n\n{text}")
    if k < len(spec.HINTS):
        print(f"\nThe next one: python -m exercises hint {n} {k + 1}")


def solution(n):
    spec, _ = load(n, solution=True)
    for name in spec.FUNCTIONS:
        fn = getattr(spec.REFERENCE, name)
        print(f"# {name}: from {framework.relpath(inspect.getsourcefile(fn))}\n")
        print(inspect.getsource(fn))


def show(args):
    from exercises.show import show_mask
    png = args.png if args.png is not None else "" if args.mine else str(framework.REPO / "out" / "attention_pattern.png")
    if png:
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    if not args.mine:
        return show_mask(args.T, args.w, args.t_out, png)
    _, mine = load(1)
    print("With YOUR in_window and attention_mask (exercises/ex01_window_mask.py):\n")
    with framework.patched(framework.orthros, in_window=mine.in_window, attention_mask=mine.attention_mask):
        try:
            return show_mask(args.T, args.w, args.t_out, png)
        except NotImplementedError:
            sys.exit("exercise 1 is not started: write in_window and attention_mask first")


def run_checks(which, use_solution, runs):
    failed = 0
    for n in which:
        try:
            spec, impl = load(n, solution=use_solution)
        except Exception as e:  # a syntax error in the student's file, say: report it, go on
            print(f"exercise {n}: FAIL. exercises/{ORDER[n - 1]}.py does not import: {type(e).__name__}: {e}")
            failed += 1
            continue
        result = framework.check(spec, impl, runs=runs)
        head = f"exercise {n}, {spec.TITLE}: {result.status}"
        print(f"{head}  ({result.seconds:.2f} s)" + (f"\n{result.message}" if result.message else ""))
        if result.status == "FAIL":
            print(f"  Stuck? python -m exercises hint {n}")
        failed += result.status != "PASS"
        if len(which) > 1:
            print()
    if len(which) > 1:
        print(f"{len(which) - failed} of {len(which)} PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
