"""CuTeDSL device code: the dispatch, combine, reject and MXFP8 kernels, each beside its launcher
(the host side: compile, grid rule, launch parameters; launcher.py holds what they share). Compiled
on first use, never on the hot path. Importing the kernels' modules needs the `gpu` extra
(nvidia-cutlass-dsl)."""
