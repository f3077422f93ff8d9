"""Triton code of qmoe.tensors and its launcher (``quantize``)."""
