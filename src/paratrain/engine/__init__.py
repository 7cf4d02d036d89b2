"""The training loop, exact evaluation and checkpoints."""
