"""Kernel generation for fused SSM regions: kernel IR, Triton renderers, cache, compile, autotune.

Importing this package does not import Triton; generated modules do when they are loaded, so
``TRITON_INTERPRET`` may still be set by the caller beforehand.
"""
from mambac.codegen.kernel_ir import SSDRegion, TileConfig, region_for
from mambac.codegen.compile import CodegenError, STAGES, load_kernel
from mambac.codegen.ssd_kernels import SSDSaved, register_cuda_kernels, ssd_forward
from mambac.codegen.ssd_kernels_bwd import ssd_backward, ssd_triton

__all__ = ["SSDRegion", "TileConfig", "region_for", "CodegenError", "STAGES", "load_kernel",
           "SSDSaved", "register_cuda_kernels", "ssd_forward", "ssd_backward", "ssd_triton"]
