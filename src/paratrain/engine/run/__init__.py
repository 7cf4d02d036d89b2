"""The run's own room: the one step, its control (non-finite and preemption agreement),
the schedule, precision, preemption, fault injection, the recipe's parts, the progress
state. It imports nothing else of engine/."""
