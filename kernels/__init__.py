"""Triton kernels behind pyrl.ops (installed as pyrl.kernels). Each module holds the kernels of one op
and launchers that take and return torch tensors. On CPU tensors they run under TRITON_INTERPRET=1,
which must be set before this package is imported."""
