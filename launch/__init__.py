"""Entry points: `torchrun -m launch.train` and `torchrun -m launch.check_cp`."""
