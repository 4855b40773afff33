"""Tokenizers and datasets; of the model they know only its ignore value (orthros.IGNORE)."""
