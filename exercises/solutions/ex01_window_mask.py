"""Exercise 1, the stored solution: orthros.py's own in_window and attention_mask (`solution 1 --show` writes
them out; the check compares a student's with orthros.py's, live)."""

import torch

from orthros import in_window
from orthros import attention_mask
