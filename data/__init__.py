"""Tokenizers and datasets for Orthros. Knows nothing of the model but its ignore value (orthros.IGNORE).

    from data.tokenizer import get_tokenizer          # "byte", "gpt2" or "hf:DIR"
    from data.prepare_utils import ensure_prepared    # writes data/<name>/train.bin, val.bin, meta.json
"""
