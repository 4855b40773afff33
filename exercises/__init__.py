"""Auto-checked exercises that teach Orthros from the real code (exercises/README.md)."""
