"""The job: wiring a rank, resume, checkpoint schedule, entry and exit codes, submitit submission."""
