"""The stored solutions (python -m exercises solution N --show); each exNN_*_also.py is another
right answer, written otherwise, which the check must pass too."""
