"""Launchers: how a job's ranks start. This process alone, or each rank of torchrun, `accelerate
launch` or srun (`environment.py` maps Slurm's variables), runs `vldist.training.on_each_rank.run` itself; inside
`ray job submit`, `ray_train.py` starts Ray Train workers that each run the function it is given.
No launcher imports the entry point (vldist/train.py): it hands them what they run."""
