"""CuTeDSL device code: dispatch, combine and MXFP8 kernels (compiled on first use, never on the
hot path). Importing this package needs the `gpu` extra (nvidia-cutlass-dsl)."""
