"""Tokenizers and datasets; of the model they know only its ignore value (orthros.IGNORE).

    from data.tokenizer import get_tokenizer          # "byte", "gpt2" or "hf:DIR"
    from data.prepare_utils import ensure_prepared    # data/<name>/train.bin, val.bin, meta.json
"""
