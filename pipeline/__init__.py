"""GPipe-style pipeline parallelism for PyTorch."""
