"""A model's files, torch-free: resolving a name to its files (source.py), its configuration
(config.py), reading GGUF files (gguf_file.py) and their tokenizer (gguf_tokenizer.py). The router
reads these too; the torch side (models/: the network, weights) builds on them."""
