"""Text, torch-free, shared by the router, the offline engine and the bench: the chat template and
tokenizer the router loads (tokenizer.py) and the incremental detokenizer with stop strings
(detok.py)."""
