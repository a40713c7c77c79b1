"""hpcnft: DiffusionNFT fine-tuning of Stable Diffusion 3.5 against a PickScore reward, as one
torch.distributed job on HPC clusters (Slurm, submitit, MPI)."""

__version__ = "0.1.0"


def submit(*args, **kwargs):
    """Submit a run through submitit and return the submitit job (see hpcnft.submit_job)."""
    from hpcnft.run.submit import submit as _submit

    return _submit(*args, **kwargs)
