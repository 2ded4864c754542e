"""Hand-written Triton kernels, each with a plain-PyTorch reference."""
