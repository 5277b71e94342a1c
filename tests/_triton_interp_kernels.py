"""Numerics of the CUDA (Triton) kernels, run on the CPU under Triton's interpreter.

Not collected on its own (leading underscore): `test_ops.py::test_triton_interpreted` runs it in a fresh process with
`TRITON_INTERPRET=1`, which must be set before the kernels are defined. Shapes are small: the interpreter is slow.
"""
import os
assert os.environ.get('TRITON_INTERPRET') == '1', "run with TRITON_INTERPRET=1 (see test_ops.py)"
import itertools, pytest, torch
from clfast import ops, triton_kernels as tk

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-4, rtol=1e-4),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}

def _close(a, b, dt):
    torch.testing.assert_close(a.double(), b.double(), **TOL[dt])

@pytest.mark.parametrize('shape', [(1, 1, 1, 1), (2, 3, 3, 5), (3, 17, 5, 3), (1, 64, 3, 3), (2, 70, 9, 9)])
@pytest.mark.parametrize('dt', [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_stats(shape, dt):
    y = (torch.randn(shape, dtype=torch.float64) * 2 + 3).to(dt).to(memory_format=torch.channels_last)
    mean, var = tk.stats(ops.as_rows(y))
    rm, rv = ops.ref_bn_stats(y)
    assert mean.dtype == ops.acc_dtype(dt) and var.dtype == ops.acc_dtype(dt)
    torch.testing.assert_close(mean, rm, **TOL[dt if dt == torch.float64 else torch.float32])
    torch.testing.assert_close(var, rv, **TOL[dt if dt == torch.float64 else torch.float32])

def test_stats_large_mean():
    "Shifted sums: fp32 variance stays accurate when the mean dwarfs the spread"
    y = torch.randn(5000, 8, dtype=torch.float64) + 1e4
    mean, var = tk.stats(y.float())
    torch.testing.assert_close(var.double(), y.float().double().var(0, unbiased=False), rtol=1e-3, atol=0)

def test_stats_many_programs():
    "More rows than one reduction program holds: the second stage adds several partials"
    y = torch.randn(64 * 1030 + 7, 3)
    rows_per, p = tk._slabs(*y.shape, *tk._blocks(3))
    assert p > 1
    mean, var = tk.stats(y)
    torch.testing.assert_close(mean, y.mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(var, y.var(0, unbiased=False), atol=1e-4, rtol=1e-4)

CASES = list(itertools.product([(2, 3, 3, 5), (1, 17, 1, 1), (3, 64, 3, 3)], [True, False], [True, False]))

@pytest.mark.parametrize('shape,relu,res', CASES)
@pytest.mark.parametrize('dt', [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_fwd_bwd(shape, relu, res, dt):
    cl = torch.channels_last
    y = torch.randn(shape).to(dt).to(memory_format=cl)
    pdt = ops.acc_dtype(dt)
    w, b = torch.rand(shape[1], dtype=pdt) + .5, torch.randn(shape[1], dtype=pdt)
    r = torch.randn(shape).to(dt).to(memory_format=cl) if res else None
    g = torch.randn(shape).to(dt).to(memory_format=cl)
    mean, var = ops.ref_bn_stats(y)
    invstd = (var + 1e-5).rsqrt()
    scale, shift = ops.affine_params(mean, invstd, w, b, pdt)
    rr = None if r is None else ops.as_rows(r)
    out = tk.fwd(ops.as_rows(y), scale, shift, rr, relu)
    _close(out, ops.as_rows(ops.ref_bn_act_fwd(y, mean, invstd, w, b, r, relu)), dt)
    for training in (True, False):
        dy, sdz, sdx, dres = tk.bwd(ops.as_rows(g), ops.as_rows(y), mean, invstd, scale, shift, rr, relu, training,
                                    res)
        rdy, rdw, rdb, rdr = ops.ref_bn_act_bwd(g, y, mean, invstd, w, b, r, relu, training)
        _close(dy, ops.as_rows(rdy), dt)
        torch.testing.assert_close(sdz, rdb, **TOL[pdt]); torch.testing.assert_close(sdx, rdw, **TOL[pdt])
        if res: _close(dres, ops.as_rows(rdr), dt)
        else: assert dres.numel() == 0

@pytest.mark.parametrize('training', [True, False])
def test_ops_through_triton(monkeypatch, training):
    "The public ops, routed to the Triton kernels, match the reference end to end (layouts, None handling)"
    monkeypatch.setitem(ops._backends, 'cpu', tk)
    y = torch.randn(2, 5, 3, 3)                      # contiguous: converted once
    w, b, r = torch.rand(5) + .5, torch.randn(5), torch.randn(2, 5, 3, 3)
    mean, var = ops.bn_stats(y)
    rm, rv = ops.ref_bn_stats(y)
    torch.testing.assert_close(mean, rm); torch.testing.assert_close(var, rv)
    invstd = (var + 1e-5).rsqrt()
    out = ops.bn_act_fwd(y, mean, invstd, w, b, r, True)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ops.ref_bn_act_fwd(y, mean, invstd, w, b, r, True))
    g = torch.randn_like(y)
    for got, exp in zip(ops.bn_act_bwd(g, y, mean, invstd, w, b, r, True, training),
                        ops.ref_bn_act_bwd(g, y, mean, invstd, w, b, r, True, training)):
        torch.testing.assert_close(got, exp)
    dy, dw, db, dr = ops.bn_act_bwd(g, y, mean, invstd, None, None, None, False, training)
    assert dw is None and db is None and dr is None
