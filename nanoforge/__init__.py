"""nanoforge: train small GPT language models from scratch with one readable PyTorch training loop."""
__version__ = "0.1.0"
