"""Checkpoints: the directory format (format.py), a run's checkpoints written, found and restored
(manager.py), upgrades of older ones (upgrades.py), sharded model and optimizer state
(sharded_state.py) and its conversion to another world size (resharding.py), copies in object
storage (object_store.py), and the readers of a finished run: a trained model (trained_model.py)
and the weights a new run starts from (starting_weights.py)."""
