"""Conversion of pretrained models into Orthros (the paper's section 4.3): convert/hf.py reads a
Hugging Face checkpoint folder of a Llama-architecture model. checkpoint.load_checkpoint("hf:DIR")
calls it."""
