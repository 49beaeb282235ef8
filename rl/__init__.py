"""The parts of an RL step that are not the loss: the run a step works with, built once
(run_setup.py); one step's experience -- rollouts and rewards, the plan of its forwards, its metrics
(experience.py); the Query-KL reference and its cache (query_reference.py); the step's memory measured
on fake tensors (memory_measure.py); per-step rules for a loss coefficient, e.g. --entropy-target
(controllers.py)."""
