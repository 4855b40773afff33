"""The exercises' command line (the syllabus: exercises/README.md).

    python -m exercises list            the exercises, their files and difficulty
    python -m exercises start 4         your copy of exercise 4: exercises/mine/ex04_algorithm1.py
    python -m exercises check 4         check your copy of exercise 4 (check all: every exercise)
    python -m exercises hint 4          the first hint of exercise 4; `hint 4 2` the second, ...
    python -m exercises show mask       the attention pattern of Figure 1, from orthros.py
"""

import argparse
import ast
import os
import re
import shutil
import sys
import textwrap

from exercises import framework
from exercises.framework import EXERCISES, MINE, STUBS, Result, load_spec, relpath


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block)."""

    def error(self, message):
        message = re.sub(r", '(solution|new)'", "", message)   # teachers' commands: not advertised
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
    for command, what in (("start", "make your copy of an exercise"), ("check", "check one")):
        p = sub.add_parser(command, help=f"{what}: N or all")
        p.add_argument("which", help=f"{NUMBERS}, or all")
    p.add_argument("--solution", action="store_true", help=argparse.SUPPRESS)   # teachers
    p.add_argument("--runs", default=os.environ.get("ORTHROS_RECALL_RUNS"),
                   help="exercise 10: the trained runs, swa=DIR,orthros=DIR")
    p = sub.add_parser("hint", help="a hint: N, then K (1, 2, 3) for the K-th")
    p.add_argument("n", type=exercise_number)
    p.add_argument("k", type=hint_number, nargs="?", default=1)
    p = sub.add_parser("solution")   # teachers: not in --help (exercises/README.md documents it)
    p.add_argument("n", type=exercise_number)
    for flag in ("--yes-i-am-a-teacher", "--show"):
        p.add_argument(flag, action="store_true", dest="teacher")
    sub.add_parser("new").add_argument("name", type=exercise_name)   # teachers: a new exercise
    p = sub.add_parser("show", help="draw a picture: mask")
    p.add_argument("what", choices=["mask"])
    p.add_argument("--T", type=int, default=16, help="sequence length")
    p.add_argument("--w", type=int, default=4, help="window")
    p.add_argument("--t_out", type=int, default=4, help="output positions")
    p.add_argument("--png", default=str(framework.REPO / "out" / "attention_pattern.png"),
                   help="where to write the picture (needs matplotlib); '' for none")
    args = parser.parse_args(argv)
    if args.command in ("list", "hint", "solution", "new", "show"):
        from exercises.show import show_mask
        return {"list": lambda: list_exercises(), "hint": lambda: hint(args.n, args.k),
                "new": lambda: new(args.name), "solution": lambda: solution(args.n, args.teacher),
                "show": lambda: show_mask(args.T, args.w, args.t_out, args.png)}[args.command]()
    try:
        which = list(EXERCISES) if args.which.lower() == "all" else [exercise_number(args.which)]
    except argparse.ArgumentTypeError as e:
        parser.error(f"{args.command}: {e}, or all")
    if args.command == "start":
        return start(which)
    try:
        runs = dict(item.split("=", 1) for item in args.runs.split(",")) if args.runs else None
    except ValueError:
        parser.error(f"--runs {args.runs!r}: write it as swa=DIR,orthros=DIR")
    return run_checks(which, args.solution, runs)


def argument(test, what):
    """An argparse type: the text (a number as an int) where test(text), else what it is not."""
    def parse(text):
        if not test(text):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return int(text) if text.isdigit() else text
    return parse


NUMBERS = ", ".join(map(str, EXERCISES))
exercise_number = argument(lambda t: t.isdigit() and int(t) in EXERCISES,
                           f"an exercise: choose one from {NUMBERS}")
hint_number = argument(str.isdigit, "a hint number: 1, 2 or 3")
exercise_name = argument(lambda t: re.fullmatch(r"[a-z][a-z0-9_]*", t), "a name for an exercise: "
                         "lower-case letters, digits and _")


def list_exercises():
    print(f"{'#':>2}  {'exercise':<36} {'kind':<17} {'difficulty':<10} {'minutes':>7}  your file")
    for n, name in EXERCISES.items():
        spec, mine = load_spec(n), MINE / f"{name}.py"
        where = relpath(mine) if mine.is_file() else f"(python -m exercises start {n})"
        kind = " + ".join(dict.fromkeys(  # "replace": the reference is the repo's own function
            "build" if getattr(spec.REFERENCE, f).__module__.startswith("exercises") else "replace"
            for f in spec.FUNCTIONS))
        print(f"{n:>2}  {spec.TITLE:<36} {kind:<17} {'*' * spec.DIFFICULTY:<10} "
              f"{spec.MINUTES:>7}  {where}")
    print("\npython -m exercises start N makes your copy; check N checks it; hint N gives a hint. "
          "The syllabus: exercises/README.md")
    return 0


def start(which):
    MINE.mkdir(parents=True, exist_ok=True)
    made = 0
    for n in which:
        stub, mine = STUBS / f"{EXERCISES[n]}.py", MINE / f"{EXERCISES[n]}.py"
        if mine.exists() and len(which) == 1:
            print(f"python -m exercises: {relpath(mine)} exists already: edit it (delete it to "
                  "start over)", file=sys.stderr)
            return 1
        if not mine.exists():
            shutil.copyfile(stub, mine)
            made += 1
            print(f"exercise {n}: wrote {relpath(mine)}. Open it, read its docstring, write the "
                  f"function(s), then: python -m exercises check {n}")
    if len(which) > 1:
        print(f"{made} new file(s) in {relpath(MINE)}/ (the others were there already)")
    return 0


def hint(n, k):
    spec, hints = load_spec(n), framework.hints(load_spec(n))
    if not 1 <= k <= len(hints):
        print(f"python -m exercises: exercise {n} has hints 1 to {len(hints)}", file=sys.stderr)
        return 2
    text = "\n".join(textwrap.fill(line, 100) for line in hints[k - 1].splitlines())
    print(f"Exercise {n}, {spec.TITLE}: hint {k} of {len(hints)}\n\n{text}")
    if k < len(hints):
        print(f"\nThe next one: python -m exercises hint {n} {k + 1}")
    return 0


def solution(n, teacher):
    if not teacher:
        print(f"A student learns more from `python -m exercises hint {n} 2` (the shapes or "
              f"pseudocode). Teachers: python -m exercises solution {n} --show", file=sys.stderr)
        return 1
    print(f"# Exercise {n}, {load_spec(n).TITLE}: the reference solution as a whole file (what "
          f"exercises/mine/{EXERCISES[n]}.py could hold)\n")
    print(framework.solved_source(load_spec(n)))
    return 0


def run_checks(which, use_solution, runs):
    counts = {}
    for n in which:
        spec, mine = load_spec(n), MINE / f"{EXERCISES[n]}.py"
        if use_solution:
            result, where = framework.check(spec, spec.REFERENCE, runs=runs), "the reference"
        elif mine.is_file():
            answer = framework.load_answer(spec, mine.read_text(), mine)
            result, where = framework.check(spec, answer, runs=runs), relpath(mine)
        else:
            result, where = Result("not started", f"not started: you have no {relpath(mine)} yet. "
                                   f"`python -m exercises start {n}` copies the stub there; open "
                                   "it, read its docstring, and write it."), "-"
        print(f"exercise {n}, {spec.TITLE} ({where}): {result.status}  "
              f"({result.seconds:.2f} s)" + (f"\n{result.message}" if result.message else ""))
        for line in [] if use_solution else in_place(n, spec):
            print(line)
        if result.status == "FAIL":
            print(f"  Stuck? python -m exercises hint {n}")
        counts.setdefault(result.status, []).append(n)
        if len(which) > 1:
            print()
    if len(which) > 1:
        others = "".join(f"; {len(ns)} {status} (exercise{'s' * (len(ns) > 1)} "
                         f"{', '.join(map(str, ns))})" for status, ns in counts.items()
                         if status != "PASS")
        print(f"{len(counts.get('PASS', []))} of {len(which)} PASS{others}")
    return 0 if set(counts) <= {"PASS", "waiting"} else 1


def in_place(n, spec):
    """A line for each answer written where `check` does not read it (in place)."""
    name = EXERCISES[n]
    old, stub = framework.HERE / f"{name}.py", STUBS / f"{name}.py"
    bodies = [node.body[-1] for node in ast.parse(stub.read_text()).body
              if isinstance(node, ast.FunctionDef) and node.name in spec.FUNCTIONS]
    edited = any(not (isinstance(b, ast.Raise) and ast.unparse(b) == "raise NotImplementedError")
                 for b in bodies)
    mine, then = relpath(MINE / f"{name}.py"), ", then `git checkout` the stub"
    return [f"NOTE: {relpath(path)} is not checked: check reads only your copy, {mine} (python -m "
            f"exercises start {n} makes it; move your work there{then * (path == stub)})"
            for path, found in ((old, old.exists()), (stub, edited)) if found]


def new(name):
    """Write a new exercise's files (the next number) and its hints: a small one to change."""
    n = max(EXERCISES) + 1
    stem = f"ex{n:02d}_{name}"
    files = {framework.STUBS: STUB, framework.HERE / "solutions": SOLUTION,
             framework.CHECKS: CHECKER}
    if any((folder / f"{stem}.py").exists() for folder in files):
        print(f"python -m exercises: exercise {n} ({stem}) exists already", file=sys.stderr)
        return 1
    for folder, text in files.items():
        (folder / f"{stem}.py").write_text(text.replace("NN", str(n)).replace("STEM", stem))
        print(f"wrote {relpath(folder / f'{stem}.py')}")
    with open(framework.HERE / "hints.md", "a") as f:
        f.write(HINTS.replace("STEM", stem))
    print(f"wrote its hints at the end of exercises/hints.md\nTry it: python -m exercises check "
          f"{n} --solution; then make it yours (exercises/README.md, 'For teachers').")
    return 0


STUB = '''"""Exercise NN: the output positions. Which positions carry an output token (the twin
of each of the last t_out of T, the paper's section 3.2)?
"""


def output_positions(T, t_out):
    """The positions (a list of ints, in order) whose next token is predicted, 1 <= t_out <= T."""
    raise NotImplementedError
'''

SOLUTION = STUB.replace("NN: the output positions. Which", "NN, the stored solution: which")
SOLUTION = SOLUTION.replace("    raise NotImplementedError", "    return list(range(T - t_out, T))")

CHECKER = '''"""Exercise NN, the output positions: the checker."""

from exercises.framework import Domain
from exercises.solutions import STEM as solution

TITLE, DIFFICULTY, MINUTES = "The output positions", 1, 10
FUNCTIONS = ("output_positions",)
REFERENCE, PAPER = solution, "T=2048"
DOMAIN = {"output_positions": Domain(pairs=True, T=[1, 2, 5, 2048],
                                     t_out=lambda T: sorted({1, 2, T - 1, T} - {0, T + 1}))}
ALSO_RIGHT = "def output_positions(T, t_out):\\n    return [T - t_out + i for i in range(t_out)]\\n"
'''

HINTS = ("\n## STEM\n\n### 1\n\nThe output positions are a suffix: the last t_out of the T."
         "\n\n### 2\n\nPositions count from 0: the last is T - 1, the first of the last T - t_out."
         "\n\n### 3\n\nPaper, section 3.2: SFT has T_in = T - T_out; the output tokens are last.\n")


if __name__ == "__main__":
    sys.exit(main())
