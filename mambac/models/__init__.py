"""Reference Mamba-1/2/3 blocks and a causal LM in plain PyTorch plus mambac ops."""
from mambac.models.config import MambaConfig
from mambac.models.lm import MambaLMHeadModel
from mambac.models.mamba1 import Mamba
from mambac.models.mamba2 import Mamba2

__all__ = ["MambaConfig", "MambaLMHeadModel", "Mamba", "Mamba2"]
