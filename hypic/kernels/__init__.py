"""Fast paths with their PyTorch references (installed as ``hypic.kernels``)."""
