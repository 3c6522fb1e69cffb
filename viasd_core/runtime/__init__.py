"""The machine that runs a model: the static-cache pass, its kernels bound at load, weight formats."""
