"""Triton code of qmoe.ops and its launchers, one module per op family (the op module of
the same name in ``qmoe.ops`` defines the op and calls the launcher on CUDA)."""
