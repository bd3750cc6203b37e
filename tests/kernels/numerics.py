"""Shared code of the numerics matrix (tests/kernels/test_numerics.py) and its measurement script: run one
kernel in fp32, bf16 or fp16 and compare with the same kernel in fp32 on the same (rounded) inputs and parameters."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from hf_kernel_attn.kernels import KERNELS
from hf_kernel_attn.kernels.linear import PastKeys
from tests.kernels.helpers import make_kernel

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 8  # GQA 2/1; small heads keep 32k cheap
LONG = 32768
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Outcome:
    """Finite flags and the relative errors of one half-precision (or fp32) run against fp32."""

    out_finite: bool
    grad_finite: bool
    out_err: float  # max |out - out_fp32| / max |out_fp32| over real rows
    grad_err: float  # max |dx - dx_fp32| / max |dx_fp32| over dq, dk, dv together; nan without gradients


def build(name: str) -> torch.nn.Module:
    params = {"horizon": 2 * LONG} if name == "cosformer" else {}
    if name == "skyformer":
        params = {"num_landmarks": 16}
    return make_kernel(name, HEADS, KV_HEADS, params, max_positions=2 * LONG, head_dim=HEAD_DIM)


def inputs(n: int, m: int, scale: float, batch: int, causal: bool, seed: int = 0):
    """q, k scaled by ``scale``; batch row 1 padded by a quarter of the keys (left for causal, right otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(batch, HEADS, n, HEAD_DIM, generator=gen)
    k = scale * torch.randn(batch, KV_HEADS, m, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, m, HEAD_DIM, generator=gen)
    mask = None
    if batch > 1 and m >= 4:
        mask = torch.ones(batch, m, dtype=torch.bool)
        if causal:
            mask[1, : m // 4] = False
        else:
            mask[1, m - m // 4:] = False
    return q, k, v, mask


def _run(kern, q, k, v, mask, causal, grad):
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    with torch.set_grad_enabled(grad):
        out = kern(*leaves, key_mask=mask, causal=causal)
        if grad:
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            (out.float() * w).sum().backward()
    grads = [t.grad for t in leaves] if grad else []
    return out.detach(), grads


def rows(batch: int, n: int, m: int, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """Real query rows that see at least one key: ``[B, N]`` (O(B·M), no N×M matrix)."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool)
    if causal:  # query i sits at key position m - n + i and sees keys 0..m - n + i
        sees = (mask.long().cumsum(-1) > 0)[:, m - n:]
    else:
        sees = mask.any(-1, keepdim=True).expand(batch, n)
    return sees & mask[:, m - n:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a.float() - b.float()).abs().max().item() / scale if scale > 0 else 0.0


def measure(name: str, causal: bool, n: int, m: int, dtype: str, scale: float = 1.0, batch: int = 2,
            grad: bool = True) -> Outcome:
    """Run ``name`` in ``dtype`` (kernel parameters cast too) and in fp32 on the rounded inputs and parameters;
    the finite flags cover both runs, so the fp32 run is checked too."""
    half = DTYPES[dtype]
    base = build(name)
    q, k, v, mask = inputs(n, m, scale, batch, causal)
    q, k, v = (t.to(half) for t in (q, k, v))
    kern = copy.deepcopy(base).to(half)
    ref = copy.deepcopy(kern).float()
    out, grads = _run(kern, q, k, v, mask, causal, grad)
    out32, grads32 = _run(ref, q.float(), k.float(), v.float(), mask, causal, grad)
    real = rows(batch, n, m, causal, mask)
    out_err = _rel(out.transpose(1, 2)[real.unsqueeze(1).expand(-1, HEADS, -1)],
                   out32.transpose(1, 2)[real.unsqueeze(1).expand(-1, HEADS, -1)]) if real.any() else 0.0
    grad_err = float("nan")
    if grads:  # over dq, dk, dv together: a gradient that vanishes mathematically (dq with one key) is all noise
        scale = max(g.abs().max().item() for g in grads32)
        diff = max((g.float() - g32).abs().max().item() for g, g32 in zip(grads, grads32, strict=True))
        grad_err = diff / scale if scale > 0 else 0.0
    grad_finite = all(bool(torch.isfinite(g).all()) for g in grads) and all(
        p.grad is None or bool(torch.isfinite(p.grad).all()) for p in kern.parameters())
    grad_finite = grad_finite and all(bool(torch.isfinite(g).all()) for g in grads32)
    return Outcome(bool(torch.isfinite(out).all() and torch.isfinite(out32).all()), grad_finite, out_err, grad_err)


def measure_decode(name: str, dtype: str, context: int = LONG, steps: int = 4, scale: float = 1.0) -> Outcome:
    """Prefill ``context`` tokens into a recurrent state, then ``steps`` single-token steps, in ``dtype`` and in
    fp32; errors over the decoded steps."""
    half = DTYPES[dtype]
    base = build(name)
    q, k, v, _ = inputs(context + steps, context + steps, scale, 1, True)
    q, k, v = (t.to(half) for t in (q, k, v))
    outs = []
    for kern, cast in ((copy.deepcopy(base).to(half), half), (copy.deepcopy(base).to(half).float(), torch.float32)):
        qc, kc, vc = (t.to(cast) for t in (q, k, v))
        with torch.no_grad():
            _, state = kern.forward_with_state(qc[:, :, :context], kc[:, :, :context], vc[:, :, :context],
                                               causal=True)
            steps_out = []
            for t in range(context, context + steps):
                sl = slice(t, t + 1)
                o, state = kern.forward_with_state(qc[:, :, sl], kc[:, :, sl], vc[:, :, sl], causal=True,
                                                   past=PastKeys(state, t))
                steps_out.append(o)
        outs.append(torch.cat(steps_out, 1))
    finite = bool(torch.isfinite(outs[0]).all() and torch.isfinite(outs[1]).all())
    return Outcome(finite, True, _rel(outs[0], outs[1]), float("nan"))


def kernel_modes() -> list[tuple[str, bool]]:
    """(kernel, causal) pairs: each mode a kernel supports (causal, bidirectional or both)."""
    return [(n, c) for n in sorted(KERNELS) for c in (True, False)
            if (KERNELS[n].supports_causal if c else KERNELS[n].supports_bidirectional)]


def long_shape(name: str) -> tuple[int, int]:
    """32k context: the full N = M = 32k for O(N) kernels; 16 queries against 32k keys for the quadratic ones."""
    quadratic = not KERNELS[name].is_linear and name != "skyformer"
    return (16, LONG) if quadratic else (LONG, LONG)


def table() -> str:
    """The markdown table of docs/robustness.md: worst errors per kernel and mode over N = 1, 2, 63, 65, 4k, 32k
    and ×1/×100 inputs, gradients included everywhere (unlike the time-boxed test)."""
    lines = ["| kernel | mode | out bf16 | out fp16 | grad bf16 | grad fp16 | decode 32k bf16 | decode 32k fp16 "
             "| finite |", "|---|---|---|---|---|---|---|---|---|"]
    for name, causal in kernel_modes():
        worst: dict[str, float] = {}
        finite = True
        for dtype in ("bf16", "fp16"):
            for scale in (1.0, 100.0):
                shapes = [(n, n, 2) for n in (1, 2, 63, 65)] + [(4096, 4096, 1), (*long_shape(name), 1)]
                for n, m, batch in shapes:
                    o = measure(name, causal, n, m, dtype, scale, batch=batch)
                    worst[f"out {dtype}"] = max(worst.get(f"out {dtype}", 0.0), o.out_err)
                    worst[f"grad {dtype}"] = max(worst.get(f"grad {dtype}", 0.0), o.grad_err)
                    finite &= o.out_finite and o.grad_finite
                if causal and KERNELS[name].is_linear:
                    d = measure_decode(name, dtype, scale=scale)
                    worst[f"dec {dtype}"] = max(worst.get(f"dec {dtype}", 0.0), d.out_err)
                    finite &= d.out_finite
        cells = [f"{worst[k]:.1e}" if k in worst else "–" for k in
                 ("out bf16", "out fp16", "grad bf16", "grad fp16", "dec bf16", "dec fp16")]
        lines.append(f"| {name} | {'causal' if causal else 'bidir'} | " + " | ".join(cells) +
                     f" | {'yes' if finite else 'NO'} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(table())
