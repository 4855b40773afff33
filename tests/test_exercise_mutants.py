"""
The exercise checkers, proven by the wrong answers they reject (MUTANTS: each fails as it `expect`s, none as a known
bug does; the score is printed) and the right answers they accept (ALSO_RIGHT, or exercises/solutions/exNN_*_also.py),
with a case at the paper's sizes (PAPER).
"""

import pytest
from test_exercises import IDS, NO_RUNS, NUMBERS

from exercises import framework
from exercises.framework import EXERCISES, load_spec

SHORTCUT = ("refuses", "is not available to your code")   # a refused call or name, a refused import


def declared(spec, name):
    assert hasattr(spec, name), f"{spec.__name__} declares no {name}: see exercises/README.md, 'For teachers'"
    return getattr(spec, name)


@pytest.mark.parametrize("n", NUMBERS, ids=IDS)
def test_mutation_score(n, capsys):
    """Every mutant fails, saying why, and as no known bug does; the score is printed, e.g. "exercise 1: 10 of 10 mutants
    caught"."""
    spec = load_spec(n)
    results = [(mutant, framework.check(spec, mutant, summary=False, **NO_RUNS)) for mutant in declared(spec, "MUTANTS")]
    caught = [m for m, r in results if r.status == "FAIL" and m.expect in r.message and
              ("(off by one)" in r.message) == ("off by one" in m.expect)]   # "off by one" only where the rule is
    with capsys.disabled():
        print(f"\nexercise {n}: {len(caught)} of {len(results)} mutants caught (FAIL, saying why)")
    missed = [f"{m.name}: {r.status}, expected {m.expect!r} in:\n{r.message}" for m, r in results if m not in caught]
    assert not missed, "\n\n".join(missed)
    assert len(results) >= 5 and any(w in r.message for _, r in results for w in SHORTCUT), "five mutants, one a shortcut"
    assert not [(m.name, r.named) for m, r in results if r.named], "a mutant that fails as a known bug does is that bug"


@pytest.mark.parametrize("n", NUMBERS, ids=IDS)
def test_a_case_at_the_papers_sizes_and_another_right_answer(n):
    """Each checker runs a case at the paper's sizes (w = 128, T >= 300, 12 layers, ..., as it applies). A right answer
    written otherwise than the reference passes: the cases test what the docstring asks, not one way to write it (the
    recall lab: its made-up runs, then it waits)."""
    spec = load_spec(n)
    assert any(declared(spec, "PAPER") in case.what for case in spec.cases(**NO_RUNS)), f"no case says {spec.PAPER!r}"
    also = getattr(spec, "ALSO_RIGHT", None) or (framework.SOLUTIONS / f"{EXERCISES[n]}_also.py").read_text()
    answer = framework.load_answer(spec, also, f"/nowhere/{EXERCISES[n]}_also.py")
    result = framework.check(spec, answer, summary=False, **NO_RUNS)
    assert result.status == ("waiting" if hasattr(spec, "DEFAULT_RUNS") else "PASS"), result.message
