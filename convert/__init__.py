"""Pretrained models into Orthros (section 4.3): load_checkpoint("hf:DIR") calls convert/hf.py."""
