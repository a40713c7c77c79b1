"""Files: the run file, following a live run, checkpoints, metric comparison, TensorBoard export, live trackers."""
