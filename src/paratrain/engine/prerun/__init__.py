"""Before a run: the checks made once before any process (preflight), the dry run and the
start lines (describe), timed steps on synthetic batches (probe) and --budget's plan and
recipe (budget). It imports engine/checkpointing and engine/run."""
