"""The plumbing floor: what every part of the RL step stands on but no equation of the paper
is about. Processes and collectives (distributed), the run folder and its checkpoints (run_dir,
checkpoints), an evaluation folder's resume key (eval_folder), the options table -> argparse
(options), AdamW (optimizer; the RL LR schedule is train.lr_factor), batch geometry (batching), the
per-GPU memory plan (memory_plan) and time model (time_model, lengths_file), the grader's process
pool (mathverify_pool), Ctrl-C / SIGTERM (interrupts), one-line errors (errors), failpoints
(faults), figures (plots), the end-of-run summary (run_summary) and how OpenMP's threads wait
(threads, set before torch loads).

These modules import only each other, torch, losses.py and the standard library (a test checks
it); the files a reader of the paper needs stay at the top of the repository.
"""
