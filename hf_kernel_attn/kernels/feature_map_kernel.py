"""``FeatureMapKernel``: the public base class for a linear-attention kernel defined by its feature map alone.

    @hf_kernel_attn.register_kernel
    class SquaredReLU(hf_kernel_attn.FeatureMapKernel):
        name = "sqrelu"
        def feature_map(self, x):          # [..., D] -> [..., F]
            return torch.relu(x) ** 2

The subclass gets everything the built-in feature maps have, from the same code (:class:`.LinearKernel`):

    out_i = Σ_j φ(q_i)·φ(k_j) v_j / max(Σ_j φ(q_i)·φ(k_j), eps)

in its bidirectional, chunked causal and recurrent (decoding) forms, the options of :class:`.LinearOptions`
(``window=W`` for the sliding-window hybrid, ``sinks``, ``softmax_heads``, ``chunk_size``, ``eps``), attention
transfer of its parameters, and ``layers="auto:K"``. φ must be non-negative (a normaliser of sums of
φ(q)·φ(k) must stay positive), and is applied to RoPE-rotated queries and keys in fp32 with their head axes
in front (``[B, Hkv, G, N, D]`` for queries, ``[B, Hkv, M, D]`` for keys). Parameters go in ``__init__``
(call ``super().__init__(shape, options)`` first) and are (re)initialised in ``reset_parameters``; options of
your own: a dataclass subclassing ``LinearOptions`` as ``options_cls``. Override ``feature_q`` /
``feature_k`` for different query and key maps, ``log_decay`` for a fixed per-KV-head decay (ln γ_h ``[Hkv]``) or
``log_gate`` for a gate per token (log α_t ``[B, Hkv, M, Γ]``, gated linear attention); either runs the gated
engine in every form.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .feature_maps.base import LinearKernel


class FeatureMapKernel(LinearKernel):
    """A linear kernel from ``feature_map(x)``: φ(q)·φ(k) in place of exp(s q·k) (Katharopoulos et al., ICML
    2020, "Transformers are RNNs", for the linear form)."""

    paper: ClassVar[str] = ""
    scale_inputs: ClassVar[bool] = False  # True: φ receives s^1/2 x (s the softmax scale) instead of x

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """φ: ``[..., D]`` -> ``[..., F]``, non-negative."""
        raise NotImplementedError(f"{type(self).__name__} must define feature_map(self, x)")

    def feature(self, x: torch.Tensor, pos: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.feature_map(x * scaling ** 0.5 if self.scale_inputs else x)

    def num_features(self) -> int:
        """F, measured once by mapping one key."""
        if getattr(self, "_num_features", None) is None:
            device = next((t.device for t in self.state_dict().values()), torch.device("cpu"))
            probe = torch.zeros(1, self.shape.num_kv_heads, 1, self.shape.head_dim, device=device)
            with torch.no_grad():
                self._num_features = int(self.feature_k(probe, torch.zeros(1, dtype=torch.long, device=device),
                                                        self.shape.head_dim ** -0.5).shape[-1])
        return self._num_features
