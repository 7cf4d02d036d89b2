"""Speed: the training step on synthetic data, scaling runs and the communication cost model."""
