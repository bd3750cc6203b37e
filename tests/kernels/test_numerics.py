"""Numerics matrix: every kernel in fp32, bf16 and fp16, causal and bidirectional, at N = 1, 2, chunk ± 1,
4k and 32k, with q/k at ×1 and ×100: outputs and gradients finite, half precision within a fixed tolerance of fp32
on the same rounded inputs (figures in docs/robustness.md). Decoding continues a 32k-token recurrent state.

Heads are small (2 query heads, 1 KV head, head dim 8) so that 32k costs milliseconds; for the quadratic kernels
(softmax, gaussian, cosine) "32k" is 16 queries against 32k keys, the reduction whose length matters."""

from __future__ import annotations

import pytest

from tests.kernels import numerics as nm

# max |out_half - out_fp32| / max |out_fp32| over real rows; measured at most 4.6e-3 (bf16) and 7.0e-4 (fp16)
OUT_TOL = {"bf16": 1e-2, "fp16": 2e-3}
# the same over dq, dk, dv together; measured at most 1.7e-2 (bf16) and 3.2e-3 (fp16)
GRAD_TOL = {"bf16": 4e-2, "fp16": 8e-3}
SHORT = (1, 2, 63, 65)  # chunk_size 64 ± 1
HALF = ("bf16", "fp16")


def check(o: nm.Outcome, dtype: str, where: str, grad: bool = True) -> None:
    assert o.out_finite, f"{where}: non-finite output"
    assert o.out_err <= OUT_TOL[dtype], f"{where}: output off fp32 by {o.out_err:.2e}"
    if grad:
        assert o.grad_finite, f"{where}: non-finite gradient"
        assert o.grad_err <= GRAD_TOL[dtype], f"{where}: gradient off fp32 by {o.grad_err:.2e}"


@pytest.mark.parametrize("name,causal", nm.kernel_modes(),
                         ids=[f"{n}-{'causal' if c else 'bidir'}" for n, c in nm.kernel_modes()])
def test_half_precision_matrix(name: str, causal: bool):
    for dtype in HALF:
        for scale in (1.0, 100.0):
            for n in SHORT:  # batch of 2, one row padded by a quarter (and key-less pad rows at N = 1, 2)
                check(nm.measure(name, causal, n, n, dtype, scale), dtype, f"{dtype} x{scale:g} N={n}")
            # long inputs: ×1 through the no-grad (inference) path, ×100 through the autograd path with gradients
            # (at 32k in bf16 only; fp16 there runs the inference path), which keeps the file within its budget:
            # ×100 inputs make subnormal floats, up to 3× slower on CPU
            grad = scale > 1
            o = nm.measure(name, causal, 4096, 4096, dtype, scale, batch=1, grad=grad)
            check(o, dtype, f"{dtype} x{scale:g} N=4k", grad=grad)
            n, m = nm.long_shape(name)
            grad = grad and dtype == "bf16"
            o = nm.measure(name, causal, n, m, dtype, scale, batch=1, grad=grad)
            check(o, dtype, f"{dtype} x{scale:g} N={n} M={m}", grad=grad)


@pytest.mark.parametrize("name", [n for n, c in nm.kernel_modes() if c and nm.KERNELS[n].is_linear])
def test_decoding_after_32k_tokens(name: str):
    """A 32k-token prefill into the recurrent state, then 4 single-token steps, in bf16/fp16 vs fp32."""
    for dtype in HALF:
        for scale in (1.0, 100.0):
            check(nm.measure_decode(name, dtype, scale=scale), dtype, f"{dtype} x{scale:g} decode", grad=False)
