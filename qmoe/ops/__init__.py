"""MoE permutation custom ops (qmoe::...). Built on the tensors in qmoe.tensors."""
