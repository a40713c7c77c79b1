"""hpcnft: DiffusionNFT fine-tuning of Stable Diffusion 3.5 and FLUX.1-dev against a PickScore reward
(or a mix of reward terms), as one torch.distributed job on HPC clusters (Slurm, submitit, MPI).
The package's layers are in docs/architecture.md; from Python, a run is submitted with
hpcnft.run.submit.submit."""

__version__ = "0.1.0"
