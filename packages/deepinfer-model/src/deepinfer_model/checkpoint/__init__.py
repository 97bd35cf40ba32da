"""Synthetic checkpoints in the exact released format: random weights for any configuration, and a small tokenizer."""
