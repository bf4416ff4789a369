"""What a model's layers run on, below the models: the layer-ops seam (`layer_ops.py`) and the
portable paged attention (`attention.py`), the CPU kernels and the per-machine choices around them
(`cpu/`), the GPU kernels (`cuda/`). The engine hands the model its layer ops; nothing here
imports the engine or the models."""
