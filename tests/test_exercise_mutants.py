"""Each wrong answer of tests/exercise_mutants.md fails, naming the property and the input."""

import collections
from pathlib import Path

import pytest

from exercises import framework
from exercises.framework import EXERCISES, load_spec

NO_RUNS = {"runs": {"swa": "/nowhere/swa", "orthros": "/nowhere/orthros"}}   # the recall lab waits
Mutant = collections.namedtuple("Mutant", "n kind name expect edits")   # edits: [[old, new], ...]


def catalogue(path=Path(__file__).with_name("exercise_mutants.md")):
    found, kind = [], None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            kind = line.rsplit("(", 1)[-1].rstrip(")")
        elif line.startswith("### ex"):
            found.append(Mutant(int(line[6:8]), kind, line[10:], [], []))
        elif line.startswith("expect: "):
            found[-1].expect.extend(line[8:].split(" | "))
        elif line[:1] in ("-", "+") and found and kind:
            edits, side = found[-1].edits, line[0] == "+"
            if not edits or edits[-1][1] is not None and not side:
                edits.append([None, None])
            text = edits[-1][side]
            edits[-1][side] = line[1:] if text is None else f"{text}\n{line[1:]}"
    return found


MUTANTS = catalogue()
KINDS = ("autograd", "inputs", "edges", "magnitudes", "state", "python", "crash", "shortcut")


@pytest.mark.parametrize("m", MUTANTS, ids=[f"ex{m.n:02d}-{m.kind}-{m.name}" for m in MUTANTS])
def test_a_wrong_answer_fails_naming_the_property_and_the_input(m):
    source = framework.solved_source(load_spec(m.n))
    for old, new in m.edits:
        assert source.count(old) == 1, f"{m.name}: the solution holds {old!r} not once"
        source = source.replace(old, new)
    answer = framework.load_answer(load_spec(m.n), source, f"/nowhere/{EXERCISES[m.n]}.py")
    result = framework.check(load_spec(m.n), answer, summary=False, **NO_RUNS)
    assert result.status == "FAIL" and all(w in result.message for w in m.expect), result.message


def test_every_class_of_wrong_answer_is_tried_in_several_exercises():
    """Each class the held-out set showed (issue 42) has wrong answers in three exercises at least,
    and each exercise has five."""
    assert {m.kind for m in MUTANTS} == set(KINDS) and all(m.expect and m.edits for m in MUTANTS)
    assert all(len({m.n for m in MUTANTS if m.kind == kind}) >= 3 for kind in KINDS)
    assert all(sum(m.n == n for m in MUTANTS) >= 5 for n in EXERCISES)
