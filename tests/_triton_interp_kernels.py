"""Numerics of the CUDA (Triton) backend, run on the CPU under Triton's interpreter.

Not collected on its own (leading underscore): `test_ops.py::test_triton_interpreted` runs it in a fresh process with
`TRITON_INTERPRET=1`, which must be set before the kernels are defined. Shapes are small: the interpreter is slow.

The backend's `layer_fwd` / `layer_bwd` (the contract in `clfast/KERNELS.md`) are compared with an fp64 oracle built
from stock PyTorch: `F.conv2d -> F.batch_norm -> + residual -> ACTS[name].fn`, gradients by autograd, on the same
(rounded) inputs. The oracle stores the conv output `y` in the layer's dtype (as stock PyTorch in that dtype does; the
gradient passes straight through), so a half-precision `y` does not flip a kink of the activation between the two.
"""
import os
assert os.environ.get('TRITON_INTERPRET') == '1', "run with TRITON_INTERPRET=1 (see test_ops.py)"
import pytest, torch
import torch.nn.functional as F
from clfast import triton_kernels as tk
from clfast.act import ACTS
from clfast.reference import ConvGeometry

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
DTYPES = [F64, F32, BF16, F16]
TOL = {F64: dict(atol=1e-10, rtol=1e-10), F32: dict(atol=1e-4, rtol=1e-4),
       BF16: dict(atol=2e-2, rtol=2e-2), F16: dict(atol=2e-3, rtol=2e-3)}
# the layer's tolerances, relative to the largest magnitude of each result: (outputs and statistics, gradients)
LTOL = {F64: (1e-10, 1e-10), F32: (1e-4, 1e-3), BF16: (2e-2, 3e-2), F16: (2e-3, 5e-3)}
ACT_CASES = [('none', 0.), ('relu', 0.), ('relu6', 0.), ('leaky_relu', .1), ('leaky_relu', -.2), ('silu', 0.),
             ('hardswish', 0.), ('gelu', 0.), ('gelu_tanh', 0.)]
ACT_IDS = [f'{n}{p:+g}' if n == 'leaky_relu' else n for n, p in ACT_CASES]

def acc_dtype(dt): return F64 if dt == F64 else F32
def rows(t): return t.movedim(1, -1).reshape(-1, t.shape[1])

# ---------------------------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize('shape', [(1, 1, 1, 1), (2, 3, 3, 5), (3, 17, 5, 3), (1, 64, 3, 3), (2, 70, 9, 9)])
@pytest.mark.parametrize('dt', DTYPES)
def test_stats(shape, dt):
    y = (torch.randn(shape, dtype=F64) * 2 + 3).to(dt).to(memory_format=torch.channels_last)
    mean, var = tk.stats(rows(y))
    assert mean.dtype == acc_dtype(dt) and var.dtype == acc_dtype(dt)
    yd = y.double()
    tol = TOL[dt if dt == F64 else F32]
    torch.testing.assert_close(mean.double(), yd.mean((0, 2, 3)), **tol)
    torch.testing.assert_close(var.double(), yd.var((0, 2, 3), unbiased=False), **tol)

def test_stats_large_mean():
    "Shifted sums: fp32 variance stays accurate when the mean dwarfs the spread"
    y = torch.randn(5000, 8, dtype=F64) + 1e4
    mean, var = tk.stats(y.float())
    torch.testing.assert_close(var.double(), y.float().double().var(0, unbiased=False), rtol=1e-3, atol=0)

def test_stats_many_programs():
    "More rows than one reduction program holds, several column blocks: the last program of each adds the partials"
    y = torch.randn(64 * 1030 + 7, 70, dtype=F64)   # 70 channels: two column blocks of 64
    plan = tk._plan(*y.shape)   # as `stats` cuts the rows
    assert plan.stats_p > 1 and plan.n_c == 2
    mean, var = tk.stats(y)
    torch.testing.assert_close(mean, y.mean(0), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(var, y.var(0, unbiased=False), atol=1e-12, rtol=1e-12)

def test_reductions_leave_their_counters_zero():
    "Each reduction leaves the per-device counters as it found them, so the next launch needs no clearing: the same "
    "inputs give bit-equal results launch after launch, in statistics and in backward's sums"
    m = 4 * 128 + 5   # several programs of two column blocks each, in statistics and in backward's sums
    y, g = torch.randn(m, 70), torch.randn(m, 70)
    plan = tk._plan(m, 70)
    assert plan.n_c == 2 and plan.stats_p > 1 and plan.bwd_p > 1
    first = tk.stats(y)
    assert not tk._LOCKS[y.device].any()
    mean, var = first
    invstd = (var + 1e-5).rsqrt()
    sums = tk.bwd(g, y, mean, invstd, invstd, -mean * invstd, None, ACTS['relu'].code, True, False)
    assert not tk._LOCKS[y.device].any()
    for a, b in zip(first + sums, tk.stats(y) + tk.bwd(g, y, mean, invstd, invstd, -mean * invstd, None,
                                                         ACTS['relu'].code, True, False)):
        assert torch.equal(a, b)

@pytest.mark.parametrize('big', [100., 1e4, float('inf'), -float('inf')])
@pytest.mark.parametrize('dt', [F32, BF16, F16])
def test_stats_first_row_outlier(dt, big):
    """An outlier in the first row (sample 0, pixel (0,0)) leaves the statistics as accurate as without one: the sums
    were shifted by that row, so a value 100 standard deviations off cost the fp32 variance 1e-3 of fp64 (stock: 4e-8),
    and an infinity there made the mean NaN where it is +-inf (as csrc/bn_act.cpp's median-of-samples shift)"""
    y = torch.randn(8, 4, 32, 32, dtype=F64, generator=torch.Generator().manual_seed(0))
    y[0, :, 0, 0] = big
    y = y.to(dt).to(memory_format=torch.channels_last)
    mean, var = tk.stats(rows(y))
    yd = y.double()
    if big in (float('inf'), -float('inf')):
        assert (mean == big).all() and var.isnan().all()
        return
    # (the outlier's own rounding in fp32 sums stays: ~2e-6 of the mean at 1e4, where the first-row shift cost 1e-3)
    torch.testing.assert_close(mean.double(), yd.mean((0, 2, 3)), atol=5e-6, rtol=0)
    torch.testing.assert_close(var.double(), yd.var((0, 2, 3), unbiased=False), atol=0, rtol=4e-6)

def test_stats_shift_ignores_non_finite_samples():
    "Rows of NaN or inf among those the shift is sampled from: the channels' statistics are still the sums' (a NaN "
    "channel NaN, an all-finite channel exact), never a shift that is not finite"
    y = torch.randn(100, 3, dtype=F64) + 50
    y[::3, 0] = float('inf')      # a third of the samples infinite: channel 0's mean is inf, its variance NaN
    y[:, 1] = float('nan')        # every value NaN
    mean, var = tk.stats(y.float())
    assert mean[0] == float('inf') and var[0].isnan() and mean[1].isnan() and var[1].isnan()
    torch.testing.assert_close(mean[2].double(), y[:, 2].float().double().mean(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(var[2].double(), y[:, 2].float().double().var(unbiased=False), atol=0, rtol=2e-6)

@pytest.mark.parametrize('momentum', [0.1, None, 0.75])
@pytest.mark.parametrize('running_dt', [F32, F64, F16])
def test_update_running(momentum, running_dt):
    """BatchNorm's bookkeeping in one launch: the count, and the running averages as `F.batch_norm` updates them in
    fp64; half-precision ones (a `model.half()`) computed in fp32 and rounded once, as ATen does: within half an ulp.
    (Not bf16 here: Triton's interpreter truncates fp32 to bf16, where a GPU rounds to nearest)"""
    y = torch.randn(4, 70, 3, 5, dtype=F64) * 3 + 1
    prm = torch.stack([y.mean((0, 2, 3)), y.new_zeros(70), y.new_zeros(70), y.new_zeros(70),
                       y.var((0, 2, 3), unbiased=False)]).to(acc_dtype(running_dt))
    rm, rv = torch.randn(70, dtype=F64).to(running_dt), torch.rand(70, dtype=F64).to(running_dt)
    nbt = torch.tensor(6)
    want_m, want_v = rm.double(), rv.double()
    F.batch_norm(y, want_m, want_v, training=True, momentum=1 / 7 if momentum is None else momentum)
    tk.update_running(rm, rv, nbt, prm, momentum, 4 * 3 * 5)
    assert nbt.item() == 7
    if running_dt == F16:   # rounded once: at most half an ulp of the fp64 result (and fp32's error)
        for got, want in ((rm, want_m), (rv, want_v)):
            ulp = torch.finfo(running_dt).eps * 2. ** torch.floor(torch.log2(want.abs()))
            assert ((got.double() - want).abs() <= 0.5 * ulp + 1e-6 * want.abs()).all(), running_dt
        return
    tol = TOL[running_dt]
    torch.testing.assert_close(rm.double(), want_m, **tol)
    torch.testing.assert_close(rv.double(), want_v, **tol)

def test_update_running_without_statistics_or_count():
    "A BatchNorm without running statistics bumps only its count; without a count, momentum None leaves them (ATen's)"
    prm, nbt = torch.rand(5, 8), torch.tensor(0)
    tk.update_running(None, None, nbt, prm, 0.1, 10)
    assert nbt.item() == 1
    rm, rv = torch.zeros(8), torch.ones(8)
    tk.update_running(rm, rv, None, prm, None, 10)
    assert torch.equal(rm, torch.zeros(8)) and torch.equal(rv, torch.ones(8))
    tk.update_running(rm, rv, None, prm, 0.5, 10)
    torch.testing.assert_close(rm, prm[0] / 2)
    torch.testing.assert_close(rv, 0.5 + prm[4] * 10 / 9 / 2)


# ------------------------------------------------------------------------------------------------ the activations
@pytest.mark.parametrize('name,p', ACT_CASES, ids=ACT_IDS)
@pytest.mark.parametrize('dt', [F64, F32])
def test_act_formulas(name, p, dt):
    """`_act`, `_act_grad` and `_act_grad_from_out` against the table's fp64 oracle (`ACTS[name].oracle`), kinks
    included: at +-inf the mathematical limits, at NaN PyTorch's conventions, as act.h (tests/test_cpu_backend.py)"""
    a = ACTS[name]
    inf, nan = float('inf'), float('nan')
    z = torch.cat([torch.linspace(-8, 8, 161, dtype=F64), torch.tensor([-3., 0., 3., 6., 100., -100., inf, -inf, nan], dtype=F64),
                   torch.randn(99, dtype=F64) * 3]).to(dt)[:, None].repeat(1, 2).contiguous()
    one, zero = torch.ones(2, dtype=dt), torch.zeros(2, dtype=dt)
    g = torch.ones_like(z)
    ref, d_ref = a.oracle(z, g, p)
    tol = dict(atol=1e-13, rtol=1e-13) if dt == F64 else dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(tk.fwd(z, one, zero, None, a.code, p).double(), ref, **tol, equal_nan=True)
    dz = tk.bwd(g, z, zero, one, one, zero, None, a.code, False, True, act_param=p)[3]
    torch.testing.assert_close(dz.double(), d_ref, **tol, equal_nan=True)
    if a.grad_from_out(p):
        fin = torch.isfinite(z[:, 0])   # read from out: exact where out tells z's side (not at NaN: out is NaN too)
        dz = tk.bwd(g[fin], None, zero, one, one, zero, None, a.code, False, True, act_param=p, out=ref[fin].to(dt))[3]
        torch.testing.assert_close(dz.double(), d_ref[fin], **tol)

@pytest.mark.parametrize('dt', [F32, BF16])
def test_act_huge_finite(dt):
    """Huge finite z, where a formula's intermediate overflows: hardswish(z) is z from 3 up (its z * 6 was inf above
    fp32's max / 6, 5.7e37), gelu_tanh's derivative 1 and 0 far out (act.h's fixes; the oracle is fp64 stock)"""
    z = torch.tensor([5.7e37, 1e38, 3e38, -3e38, 1.8e19, -1.8e19, 1e20, -1e20, 1e30, -1e30], dtype=F64).to(dt)
    z = z[:, None].repeat(1, 2).contiguous()
    one, zero = torch.ones(2, dtype=F32), torch.zeros(2, dtype=F32)
    for name in ('relu', 'relu6', 'silu', 'hardswish', 'gelu', 'gelu_tanh'):
        a = ACTS[name]
        ref, d_ref = a.oracle(z, torch.ones_like(z))
        torch.testing.assert_close(tk.fwd(z, one, zero, None, a.code).double(), ref.to(dt).double(), atol=0, rtol=1e-6,
                                   msg=lambda m: f'{name}: {m}')
        dz = tk.bwd(torch.ones_like(z), z, zero, one, one, zero, None, a.code, False, True)[3]
        torch.testing.assert_close(dz.double(), d_ref, atol=0, rtol=1e-6, msg=lambda m: f"{name}': {m}")

# ------------------------------------------------------------------------------------------------------ the layer
def _close(got, want, tol, what, scale=0.):
    "`got` within `tol` of `want`, relative to the largest magnitude of `want` (or `scale` where larger)"
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(scale, want.abs().max().item() if want.numel() else 0.)
    torch.testing.assert_close(got.double(), want, atol=tol * max(scale, 1e-30), rtol=tol, msg=lambda m: f'{what}: {m}')

def check_layer(dt, name, p, res, training, keep_y, from_out, *, x_shape=(2, 3, 4, 4), c=5, k=3, stride=1,
                padding=1, dilation=1, groups=1, affine=True, conv_bias=True, stats_dtype=None, needs=(True,) * 6,
                seed=0):
    "`layer_fwd` then `layer_bwd` on one configuration, each result against the fp64 stock oracle"
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64)
    cl, acc, act = torch.channels_last, acc_dtype(dt), ACTS[name]
    nd = len(x_shape) - 2
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    x = mk(*x_shape).to(dt)                                           # contiguous: the backend converts
    w = (mk(c, x_shape[1] // groups, *[k] * nd) / (x_shape[1] // groups * k**nd) ** .5 * 2).to(dt)
    cb = mk(c).to(dt) if conv_bias else None
    gw = (mk(c).abs() + .5).to(acc) if affine else None
    gb = mk(c).to(acc) if affine else None
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    with torch.no_grad(): y_shape = conv(x.double(), w.double(), None, **kw).shape
    fmt = torch.channels_last_3d if nd == 3 else cl
    r = mk(*y_shape).to(dt).to(memory_format=fmt) if res else None
    dout = mk(*y_shape).to(dt)
    sdt = stats_dtype or acc
    rm, rv = (None, None) if training else (mk(c).to(sdt), (mk(c).abs() + .5).to(sdt))
    eps = 1e-5

    # the oracle
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, w, cb, gw, gb, r)]
    x64, w64, cb64, gw64, gb64, r64 = leaves
    yc64 = conv(x64, w64, cb64, **kw)
    y64 = yc64 + (yc64.detach().to(dt).double() - yc64.detach())      # y stored in dt
    z = F.batch_norm(y64, None if training else rm.double(), None if training else rv.double(), gw64, gb64,
                     training=training, eps=eps)
    if res: z = z + r64
    out64 = act.fn(z, p)
    want = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out64, want + [yc64], dout.double()))
    g64 = [next(grads) if t is not None else None for t in leaves]
    # the conv bias's gradient, sum(dy), cancels to ~0 under batch statistics: measure it against sum(|dy|)
    dbias_scale = next(grads).abs().sum((0, *range(2, len(x_shape)))).max().item()
    yd = y64.detach()
    m64, v64 = ((yd.mean((0, *range(2, yd.dim()))), yd.var((0, *range(2, yd.dim())), unbiased=False)) if training
                else (rm.double(), rv.double()))
    inv64 = (v64 + eps).rsqrt()
    sc64 = inv64 * (gw64.detach() if affine else 1)
    sh64 = (gb64.detach() if affine else 0) - m64 * sc64

    # the backend
    t_out, t_grad = LTOL[dt]
    args = [x, w, cb, gw, gb, r]
    geom = ConvGeometry([stride] * nd, [padding] * nd, [dilation] * nd, groups)
    out, y, prm = tk.layer_fwd(*args, rm, rv, geom, eps, act.code, p, keep_y)
    assert out.dtype == dt and out.shape == y_shape and (nd == 1 or out.is_contiguous(memory_format=fmt))
    assert prm.dtype == acc and prm.shape == (5, c) and prm.is_contiguous()
    _close(out, out64.detach(), t_out, 'out')
    if keep_y:
        assert y.dtype == dt and (nd == 1 or y.is_contiguous(memory_format=fmt))
        _close(y, yd, t_out, 'y')
    else: assert y.numel() == 0
    for i, (got, ref) in enumerate(zip(prm, (m64, inv64, sc64, sh64, v64))):
        _close(got, ref, 1e-10 if dt == F64 else 1e-4 if dt == F32 else t_out, f'params[{i}]')

    if from_out: assert act.grad_from_out(p)
    needs = [n and t is not None for n, t in zip(needs, args)]         # as the op asks: nothing for absent tensors
    grads = tk.layer_bwd(dout, x, w, cb, y, prm, r, out if from_out else out.new_empty(0), geom, training, act.code, p,
                         needs)
    assert len(grads) == 6
    names = ['dx', 'dweight', 'dbias', 'dbn_weight', 'dbn_bias', 'dresidual']
    for nm, got, ref, need, src in zip(names, grads, g64, needs, args):
        if not need or ref is None:
            assert got.numel() == 0, nm
            continue
        assert got.dtype == (acc if nm.startswith('dbn') else dt), nm
        _close(got, ref, t_grad, nm, dbias_scale if nm == 'dbias' else 0.)
    return grads

def _modes(name, p, half=False):
    """(res, training, keep_y, from_out): every combination of residual, training and y kept / recomputed, or with
    `half` the half of them with an even number of True (each pair of factors still meets in all four ways);
    from_out alternates with keep_y where the activation allows it (both y modes are met either way)"""
    fo = ACTS[name].grad_from_out(p)
    return [(res, tr, ky, fo and (ky != res)) for res in (False, True) for tr in (True, False) for ky in (True, False)
            if not half or (res + tr + ky) % 2 == 0]

@pytest.mark.parametrize('name,p', ACT_CASES, ids=ACT_IDS)
@pytest.mark.parametrize('dt', DTYPES)
def test_layer(dt, name, p):
    """Every activation x dtype, with and without residual, training and eval, y kept and recomputed, derivative from
    out (the half-precision dtypes take half the modes: the interpreter is slow)"""
    for i, (res, training, keep_y, from_out) in enumerate(_modes(name, p, half=dt in (BF16, F16))):
        check_layer(dt, name, p, res, training, keep_y, from_out, seed=i)

@pytest.mark.parametrize('name,p', [('relu', 0.), ('leaky_relu', .1)])
@pytest.mark.parametrize('dt', [F64, F32])
def test_layer_from_out_and_recompute_agree(dt, name, p):
    "Where the derivative may come from `out`, the other way (recomputed z) gives the same gradients"
    for res in (False, True):
        a = check_layer(dt, name, p, res, True, False, True, seed=7)
        b = check_layer(dt, name, p, res, True, False, False, seed=7)
        for u, v in zip(a, b): torch.testing.assert_close(u, v, **TOL[dt])

@pytest.mark.parametrize('dt,name,p', [(F64, 'relu', 0.), (F64, 'gelu', 0.), (F32, 'silu', 0.),
                                        (BF16, 'leaky_relu', -.2), (F16, 'gelu_tanh', 0.), (F16, 'relu6', 0.)])
def test_layer_many_channels(dt, name, p):
    "C > 64: several channel blocks per row tile"
    fo = ACTS[name].grad_from_out(p)
    for i, (res, training) in enumerate([(True, True), (False, False)]):
        check_layer(dt, name, p, res, training, i == 0, fo, x_shape=(2, 4, 3, 3), c=70, k=1, padding=0, seed=i)

# the tilings at the ends of what `benchmarks/sweep_kernel_tiles.py` times: a 128-channel tile over 70 channels (one
# column block, masked) with an 8-row accumulator, loaded 8 (statistics) and 1 (backward) times a step, in 3 programs;
# and 16-channel tiles (5 column blocks) in as many programs as there are slabs
TILINGS = {'wide': tk.Tiles(tile=2048, reduce_tile=1024, stats_unroll=8, bwd_unroll=1, max_block_c=128,
                            stats_programs=3, bwd_programs=3),
           'narrow': tk.Tiles(tile=1024, reduce_tile=512, stats_unroll=2, bwd_unroll=4, max_block_c=16,
                              stats_programs=4096, bwd_programs=4096, warps_stats=8, warps_fwd=4, warps_bwd=4, warps_dx=8)}

@pytest.mark.parametrize('tiling', TILINGS)
@pytest.mark.parametrize('dt', [F64, BF16])
def test_layer_under_other_tilings(dt, tiling):
    "Other tilings than the default compute the same layer (against fp64), with several programs in each reduction"
    tiles = TILINGS[tiling]
    with tk.tiling(tiles):
        plan = tk._plan(2 * 9 * 9, 70)
        assert plan.tiles is tiles and plan.stats_p > 1 and plan.bwd_p > 1
        assert plan.n_c == (1 if tiling == 'wide' else 5)
        check_layer(dt, 'relu', 0., True, True, False, True, x_shape=(2, 4, 9, 9), c=70, k=1, padding=0)
        check_layer(dt, 'silu', 0., False, True, True, False, x_shape=(2, 4, 9, 9), c=70, k=1, padding=0, seed=1)
    assert tk._plan(2 * 9 * 9, 70).tiles == tk.Tiles()   # the default again after the block
    with pytest.raises(TypeError, match='Tiles'):
        with tk.tiling(dict(tile=1024)): pass

@pytest.mark.parametrize('kw', [dict(stride=2, padding=1), dict(dilation=2, padding=2), dict(groups=3, c=6),
                                dict(x_shape=(1, 3, 5, 4), k=1, padding=0), dict(x_shape=(2, 2, 3, 3, 3), c=4),
                                dict(affine=False, conv_bias=False), dict(stats_dtype=F16)],
                         ids=['stride', 'dilation', 'groups', '1x1', '3d', 'plain', 'half-stats'])
@pytest.mark.parametrize('dt', [F64, F32])
def test_layer_conv_variants(dt, kw):
    "Strides, dilation, groups, 3d convs, no affine / conv bias, running statistics in another dtype"
    training = 'stats_dtype' not in kw
    check_layer(dt, 'hardswish', 0., True, training, False, False, **kw)
    check_layer(dt, 'relu', 0., False, training, True, True, seed=1, **kw)

@pytest.mark.parametrize('needs', [(True, False, False, False, False, False), (False, True, True, False, False, False),
                                   (False, False, False, True, True, False), (False, False, False, False, False, True),
                                   (False,) * 6])
@pytest.mark.parametrize('training', [True, False])
def test_layer_needs(needs, training):
    "Results not needed come back empty; the others are unchanged (eval without dbn_weight skips y altogether)"
    for name, p, fo in [('relu', 0., True), ('gelu', 0., False)]:
        check_layer(F64, name, p, True, training, False, fo, needs=needs)

def test_an_empty_batch_in_eval():
    """No rows (an empty batch normalised with running statistics): the output and the input's gradient are empty, the
    weights' and the BN parameters' gradients zero, as sums over nothing are (exact math, not a division by zero)"""
    x = torch.randn(0, 3, 5, 5, dtype=F64).to(memory_format=torch.channels_last)
    w, bw, bb = torch.randn(4, 3, 3, 3, dtype=F64), torch.rand(4, dtype=F64) + .5, torch.randn(4, dtype=F64)
    geom = ConvGeometry(padding=(1, 1))
    out, y, prm = tk.layer_fwd(x, w, None, bw, bb, None, torch.randn(4, dtype=F64), torch.rand(4, dtype=F64) + .5, geom,
                               1e-5, ACTS['relu'].code, 0., True)
    assert out.shape == (0, 4, 5, 5)
    dx, dw, db, dbw, dbb, dres = tk.layer_bwd(torch.randn_like(out), x, w, None, y, prm, None, None, geom, False,
                                              ACTS['relu'].code, 0., [True, True, False, True, True, False])
    assert dx.shape == x.shape and dres.numel() == 0 and db.numel() == 0
    for g in (dw, dbw, dbb): assert torch.equal(g, torch.zeros_like(g))
