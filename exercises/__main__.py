"""The exercises' command line.

    python -m exercises list            the ten exercises, their files and difficulty
    python -m exercises start 4         your own copy of exercise 4: exercises/mine/ex04_algorithm1.py
    python -m exercises check 4         check exercise 4 (your copy once `start 4` made it)
    python -m exercises check all       check every exercise
    python -m exercises hint 4          the first hint of exercise 4; `hint 4 2` the second, ...
    python -m exercises show mask       the attention pattern of Figure 1, from orthros.py

The recall lab (exercise 10) reads two trained runs: --runs swa=DIR,orthros=DIR (or the environment
variable ORTHROS_RECALL_RUNS), by default out/lab-recall-swa and out/lab-recall-orthros.
The syllabus, and what the checker refuses: exercises/README.md.
"""

import argparse
import os
import shutil
import signal
import sys
import textwrap


def interrupted_while_loading(*_):
    """Ctrl-C while torch loads: one line, and exit at once (os._exit: a SystemExit or KeyboardInterrupt
    raised inside `import torch` can be swallowed there, or end in a traceback)."""
    sys.stderr.write("\npython -m exercises: interrupted\n")
    os._exit(130)


signal.signal(signal.SIGINT, interrupted_while_loading)
from exercises import framework  # noqa: E402  (imports torch)
from exercises.framework import ORDER, load, load_spec  # noqa: E402
signal.signal(signal.SIGINT, signal.default_int_handler)   # from here on: main() catches KeyboardInterrupt

TEACHER_FLAGS = ("--yes-i-am-a-teacher", "--show")


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block)."""

    def error(self, message):
        message = message.replace(", 'solution'", "")   # a teachers' command: not advertised
        self.exit(2, f"{self.prog}: {message} (see python -m exercises --help)\n")


def main(argv=None):
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("python -m exercises: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # e.g. `... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def run(argv):
    parser = Parser(prog="python -m exercises", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    sub.add_parser("list", help="the exercises")
    p = sub.add_parser("start", help="make your own copy of an exercise: N or all")
    p.add_argument("which", help="1-10, or all")
    p = sub.add_parser("check", help="check an exercise: N or all")
    p.add_argument("which", help="1-10, or all")
    p.add_argument("--solution", action="store_true", help=argparse.SUPPRESS)   # teachers: the reference
    p.add_argument("--runs", default=os.environ.get("ORTHROS_RECALL_RUNS"),
                   help="exercise 10: the trained runs, swa=DIR,orthros=DIR")
    p = sub.add_parser("hint", help="a hint: N, then K (1, 2, 3) for the K-th")
    p.add_argument("n", type=exercise_number)
    p.add_argument("k", type=hint_number, nargs="?", default=1)
    p = sub.add_parser("solution")   # for teachers: not in --help (exercises/README.md documents it)
    p.add_argument("n", type=exercise_number)
    for flag in TEACHER_FLAGS:
        p.add_argument(flag, action="store_true", dest="teacher")
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
        return solution(args.n, args.teacher)
    if args.command == "show":
        return show(args)
    which = exercises(args.which, parser, args.command)
    if args.command == "start":
        return start(which)
    return run_checks(which, args.solution, parse_runs(args.runs, parser))


def exercise_number(text):
    if not text.isdigit() or not 1 <= int(text) <= len(ORDER):
        raise argparse.ArgumentTypeError(f"{text!r} is not an exercise: choose one from 1 to {len(ORDER)}")
    return int(text)


def hint_number(text):
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a hint number: 1, 2 or 3")
    return int(text)


def exercises(text, parser, command):
    if text.lower() == "all":
        return list(range(1, len(ORDER) + 1))
    try:
        return [exercise_number(text)]
    except argparse.ArgumentTypeError as e:
        parser.error(f"{command}: {e}, or all")


def parse_runs(text, parser):
    if not text:
        return None
    try:
        return dict(item.split("=", 1) for item in text.split(","))
    except ValueError:
        parser.error(f"--runs {text!r}: write it as swa=DIR,orthros=DIR")


def list_exercises():
    print(f"{'#':>2}  {'exercise':<36} {'kind':<17} {'difficulty':<10} {'minutes':>7}  your file")
    for n, name in enumerate(ORDER, start=1):
        spec = load_spec(n)
        path = framework.answer_file(n)
        mine = framework.relpath(path) if path.parent == framework.MINE else f"(python -m exercises start {n})"
        print(f"{n:>2}  {spec.TITLE:<36} {framework.kind(spec):<17} {'*' * spec.DIFFICULTY:<10} {spec.MINUTES:>7}  {mine}")
    print("\npython -m exercises start N makes your copy; check N checks it; hint N gives a hint. "
          "The syllabus: exercises/README.md")


def start(which):
    framework.MINE.mkdir(parents=True, exist_ok=True)
    made = 0
    for n in which:
        stub, mine = framework.STUBS / f"{ORDER[n - 1]}.py", framework.MINE / f"{ORDER[n - 1]}.py"
        if mine.exists():
            if len(which) == 1:
                print(f"python -m exercises: {framework.relpath(mine)} exists already: edit it (delete it to start "
                      "over)", file=sys.stderr)
                return 1
            continue
        shutil.copyfile(stub, mine)
        made += 1
        print(f"exercise {n}: wrote {framework.relpath(mine)}. Open it, read its docstring, write the function(s), "
              f"then: python -m exercises check {n}")
    if len(which) > 1:
        print(f"{made} new file(s) in {framework.relpath(framework.MINE)}/ (the others were there already)")
    return 0


def hint(n, k):
    spec = load_spec(n)
    if not 1 <= k <= len(spec.HINTS):
        print(f"python -m exercises: exercise {n} has hints 1 to {len(spec.HINTS)}", file=sys.stderr)
        return 2
    text = "\n".join(textwrap.fill(line, 100) for line in spec.HINTS[k - 1].splitlines())
    print(f"Exercise {n}, {spec.TITLE}: hint {k} of {len(spec.HINTS)}\n\n{text}")
    if k < len(spec.HINTS):
        print(f"\nThe next one: python -m exercises hint {n} {k + 1}")
    return 0


def solution(n, teacher):
    if not teacher:
        print(f"A student learns more from `python -m exercises hint {n} 2` (the shapes or pseudocode) than "
              f"from the answer. Teachers: python -m exercises solution {n} --show", file=sys.stderr)
        return 1
    print(f"# Exercise {n}, {load_spec(n).TITLE}: the reference solution as a whole file "
          f"(what exercises/mine/{ORDER[n - 1]}.py could hold)\n")
    print(framework.solved_source(n))
    return 0


def show(args):
    from exercises.show import show_mask
    png = args.png if args.png is not None else "" if args.mine else str(framework.REPO / "out" / "attention_pattern.png")
    if png:
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    if not args.mine:
        return show_mask(args.T, args.w, args.t_out, png)
    _, mine = load(1)
    if mine.problem or not mine.started:
        print(f"python -m exercises: {mine.problem or 'exercise 1 is not started: python -m exercises start 1'}",
              file=sys.stderr)
        return 1
    print(f"With YOUR in_window and attention_mask ({framework.relpath(mine.path)}):\n")
    with framework.patched(framework.orthros, in_window=mine.in_window, attention_mask=mine.attention_mask):
        try:
            return show_mask(args.T, args.w, args.t_out, png)
        except NotImplementedError:
            print("python -m exercises: exercise 1 is not finished: write in_window and attention_mask first",
                  file=sys.stderr)
            return 1


def run_checks(which, use_solution, runs):
    counts = {}
    for n in which:
        spec, answer = load(n, solution=use_solution)
        result = framework.check(spec, answer, runs=runs)
        where = "the reference" if use_solution else framework.relpath(answer.path)
        print(f"exercise {n}, {spec.TITLE} ({where}): {result.status}  ({result.seconds:.2f} s)"
              + (f"\n{result.message}" if result.message else ""))
        if result.status == "FAIL":
            print(f"  Stuck? python -m exercises hint {n}")
        counts[result.status] = counts.get(result.status, []) + [n]
        if len(which) > 1:
            print()
    if len(which) > 1:
        others = ", ".join(f"{len(ns)} {status} (exercise{'s' if len(ns) > 1 else ''} {', '.join(map(str, ns))})"
                           for status, ns in counts.items() if status != "PASS")
        print(f"{len(counts.get('PASS', []))} of {len(which)} PASS" + (f"; {others}" if others else ""))
    return 0 if set(counts) <= {"PASS", "waiting"} else 1


if __name__ == "__main__":
    sys.exit(main())
