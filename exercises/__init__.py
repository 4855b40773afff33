"""Auto-checked exercises that teach Orthros from the real code: python -m exercises list.
The syllabus is exercises/README.md."""
