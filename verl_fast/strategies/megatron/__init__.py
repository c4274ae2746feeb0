"""The Megatron-core strategy and everything Megatron: the GPTModel built from an HF config, its
training, its distributed checkpoints, the run checkpoints, the rollout beside it, and reading
Megatron checkpoints into HF state dicts without Megatron (``checkpoint_loader.py``, ``convert.py``).
Importing this package imports no megatron-core."""
