"""The benchmarks and their shared parts, run from the repository root, one module a benchmark:
`python -m bench.<name>` or `torchrun --nproc-per-node N -m bench.<name>` (docs/gpu.md lists
them). Not part of the installed package: the wheel holds dep_ep alone."""
