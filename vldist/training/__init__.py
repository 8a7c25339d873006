"""Training a job: what each rank runs (on_each_rank.py), the loop and its step (loop.py), the
optimizers and their schedules (optimizers.py), the evaluations it schedules, the best epoch and
the results (evaluations.py), evaluating a whole split (split_evaluation.py), stop requests
(stopping.py) and the output directory's lock (run_lock.py)."""
