"""`recall_tiny`: data/recall/prepare.py's "tiny" preset (window 32), written here."""
import functools

from data.recall.prepare import prepare as prepare_recall

prepare = functools.partial(prepare_recall, "tiny")  # data/prepare_utils.py calls it
