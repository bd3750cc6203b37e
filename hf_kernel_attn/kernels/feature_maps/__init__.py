"""Linear-attention kernels: feature maps φ with φ(q)·φ(k) standing in for exp(s q·k), one file per map.

:mod:`.base` holds what they share (:class:`LinearKernel`, :class:`LinearOptions`); the evaluation orders are the
engine's (:mod:`..linear`). The maps: elu, relu, cosformer, performer, dijiang, hedgehog, taylor, and the gated
ones (:mod:`.gated`): liger, gla.
"""

from __future__ import annotations

from .base import LinearKernel, LinearOptions, dense
from .cosformer import CosformerKernel, CosformerOptions
from .dijiang import DijiangKernel, DijiangOptions
from .elu import EluKernel, positive_elu
from .gated import GatedKernel, GatedOptions
from .gla import GlaKernel, GlaOptions
from .hedgehog import HedgehogKernel, HedgehogOptions
from .liger import LigerKernel, LigerOptions
from .performer import PerformerKernel, PerformerOptions, PositiveRandomFeatures
from .relu import ReluKernel
from .taylor import TaylorFeatures, TaylorKernel, TaylorOptions

__all__ = ["CosformerKernel", "CosformerOptions", "DijiangKernel", "DijiangOptions", "EluKernel", "GatedKernel",
           "GatedOptions", "GlaKernel", "GlaOptions", "HedgehogKernel", "HedgehogOptions", "LigerKernel",
           "LigerOptions", "LinearKernel", "LinearOptions", "PerformerKernel", "PerformerOptions",
           "PositiveRandomFeatures", "ReluKernel", "TaylorFeatures", "TaylorKernel", "TaylorOptions", "dense",
           "positive_elu"]
