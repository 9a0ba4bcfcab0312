"""mambac's SSM primitives, one module per op (reference, fake, autograd, checks)."""
from mambac.ops.causal_conv1d import causal_conv1d

__all__ = ["causal_conv1d"]
from mambac.ops.gated_rmsnorm import gated_rmsnorm  # noqa: E402
from mambac.ops.add_rmsnorm import add_rmsnorm, rms_norm  # noqa: E402

__all__ += ["gated_rmsnorm", "add_rmsnorm", "rms_norm"]
from mambac.ops.ssd import ssd  # noqa: E402
from mambac.ops.selective_scan import selective_scan  # noqa: E402

__all__ += ["ssd", "selective_scan"]
from mambac.ops.mamba3_siso import Mamba3State, mamba3_siso  # noqa: E402
from mambac.ops.mamba3_mimo import mamba3_mimo  # noqa: E402

__all__ += ["Mamba3State", "mamba3_siso", "mamba3_mimo"]
from mambac.ops._common import (KERNEL_MODES, kernel_mode, kernels_enabled,  # noqa: E402
                                register_device_kernels, registered_device_kernels,
                                unregister_device_kernels, use_kernels)

__all__ += ["KERNEL_MODES", "kernel_mode", "kernels_enabled", "register_device_kernels",
            "registered_device_kernels", "unregister_device_kernels", "use_kernels"]
from mambac.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
__all__ += ["linear_cross_entropy"]
