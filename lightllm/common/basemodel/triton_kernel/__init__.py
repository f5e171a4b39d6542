"""Triton kernels for the CUDA path, one kernel per module, each with its torch reference.

Modules here import ``triton`` at import time and decorate their kernels then; Triton decides
at decoration time whether a kernel is compiled for the GPU or run by its CPU interpreter
(``TRITON_INTERPRET=1``).  Nothing in the package imports these modules eagerly, so the
interpreter setting of a test process takes effect as long as it is set before the first import.
"""
