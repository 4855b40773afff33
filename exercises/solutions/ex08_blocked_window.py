"""Exercise 8, the stored solution: orthros.py's own blocked_sliding_window_attention (`solution 8 --show` writes
it out; the check compares a student's with orthros.py's, live)."""

import math

import torch
import torch.nn.functional as F

from orthros import in_window, sdpa
from orthros import blocked_sliding_window_attention
