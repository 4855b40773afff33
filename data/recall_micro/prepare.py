"""`recall_micro`: data/recall/prepare.py's "micro" preset (window 16), written here."""
import functools

from data.recall.prepare import prepare as prepare_recall

prepare = functools.partial(prepare_recall, "micro")  # data/prepare_utils.py calls it
