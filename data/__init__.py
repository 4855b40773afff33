"""Tokenizers and datasets for Orthros. Knows nothing of the model.

    from data.tokenizer import get_tokenizer          # "byte" or "gpt2"
    from data.prepare_utils import ensure_prepared    # writes data/<name>/train.bin, val.bin, meta.json
"""
