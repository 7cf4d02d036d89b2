"""What a trained model is used for: exact evaluation (and ``paratrain eval``'s worker),
prediction, export. It imports engine/checkpointing and engine/run."""
