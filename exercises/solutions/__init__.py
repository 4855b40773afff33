"""The stored solutions; each exNN_*_also.py: another right answer, written otherwise."""
