"""Checkpoints and the run folder: the typed, versioned checkpoint (save, resume,
migrate), each rank's shards, and the run folder's lock. It imports engine/run alone."""
