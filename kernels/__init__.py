"""Triton kernels of areal_fast, shipped inside the wheel as ``areal_fast.kernels``.

One module per op (``<op>.py`` holding ``_<op>_fwd_kernel`` / ``_<op>_bwd_kernel``); the
launchers, autograd functions and torch fallbacks live in ``areal_fast.ops``. Importing this
package does not import Triton: each kernel module does, and ``areal_fast.ops`` imports those
only when Triton and a GPU are available.
"""
