"""ZeRO-1/2/3: sharded optimizer states, gradients and parameters (zero.py)."""
from .loss_scaler import DynamicLossScaler
from .zero import ZeroDataParallel

__all__ = ["ZeroDataParallel", "DynamicLossScaler"]
