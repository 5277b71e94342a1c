"""The C++ CPU kernels (`clfast.cpu_kernels`: `layer_fwd` / `layer_bwd`, the contract of clfast/KERNELS.md) against an
fp64 oracle built from stock PyTorch: F.conv2d -> F.batch_norm -> (+ residual) -> `ACTS[name].fn`, with autograd."""
import math
import pytest, torch
import torch.nn.functional as F
from clfast import cpu_kernels, ops   # ops: the schemas the C++ kernels are registered under
from clfast.act import ACTS
from clfast.machine import clfast_isa

pytestmark = pytest.mark.skipif(bool(cpu_kernels.missing_toolchain()), reason=str(cpu_kernels.missing_toolchain()))

@pytest.fixture(scope='module')
def k():
    "The kernel ops, whose CPU kernels are the C++ ones, run on one thread: these shapes are tiny, and on a busy machine waking a thread pool per op costs far more than the work"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu_kernels.load()
    yield torch.ops.clfast
    torch.set_num_threads(n)

# every activation; leaky_relu with a positive and a negative slope
ACT_CASES = [(n, 0.) for n in ACTS if n != 'leaky_relu'] + [('leaky_relu', 0.1), ('leaky_relu', -0.2)]
ACT_IDS = [f"{n}{p:g}" if n == 'leaky_relu' else n for n, p in ACT_CASES]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
# max |got - want| / max |want|: outputs, then gradients (bf16: the kernels' outputs and dy are rounded to bf16)
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-4, 1e-3), torch.bfloat16: (1e-2, 3e-2),
       torch.float16: (3e-3, 1e-2)}
EPS = 1e-5
CL = torch.channels_last

def rel_err(got, want, scale=None):
    "max |got - want| relative to `scale`, by default max |want|"
    got, want = got.double(), want.double()
    if scale is None: scale = want.abs().max()
    return ((got - want).abs().max() / max(float(scale), 1e-30)).item()

def assert_close(got, want, tol, what, scale=None):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_err(got, want, scale)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"

def make_case(dtype, bias, affine, residual, training, n=2, cin=3, cout=5, hw=5):
    "Inputs in `dtype` (channels-last), BN vectors and statistics in fp32, as a model under the op has them"
    t = lambda *s: torch.randn(*s).to(dtype)
    c = dict(x=t(n, cin, hw, hw).to(memory_format=CL), w=t(cout, cin, 3, 3) * 0.5,
             b=t(cout) if bias else None,
             g=torch.rand(cout) + 0.5 if affine else None, beta=torch.randn(cout) * 0.5 if affine else None,
             r=t(n, cout, hw, hw).to(memory_format=CL) if residual else None,
             mean=None if training else torch.randn(cout) * 0.3, var=None if training else torch.rand(cout) + 0.5)
    c['dout'] = t(n, cout, hw, hw).to(memory_format=CL)
    return c

def oracle(c, name, p, training, dtype):
    """fp64 stock PyTorch: output, params rows, gradients (x, w, b, bn_w, bn_b, residual) of sum(out*dout), and the
    scale of the conv bias's gradient: max_c sum |dy| (with batch statistics that gradient is a sum that cancels to 0).
    Away from fp64, y goes through `dtype` as in the kernels (straight-through for the gradient): z is then the
    kernels' z up to rounding, and a piecewise activation's derivative does not flip on y's rounding."""
    d = lambda v: None if v is None else v.detach().double().requires_grad_()
    x, w, b, g, beta, r = (d(c[n]) for n in ('x', 'w', 'b', 'g', 'beta', 'r'))
    y = F.conv2d(x, w, b, padding=1)
    if dtype != torch.float64: y = y + (y.detach().to(dtype).double() - y.detach())
    yd = y.detach()
    if training: mean, var = yd.mean((0, 2, 3)), yd.var((0, 2, 3), unbiased=False)
    else: mean, var = c['mean'].double(), c['var'].double()
    z = F.batch_norm(y, None if training else mean, None if training else var, g, beta, training=training, eps=EPS)
    if r is not None: z = z + r
    out = ACTS[name].fn(z, p)
    leaves = [x, w, b, g, beta, r]
    req = [v for v in leaves if v is not None]
    *grads, dy = torch.autograd.grad(out, req + [y], c['dout'].double())
    grads = iter(grads)
    grads = [None if v is None else next(grads) for v in leaves]
    invstd = 1 / torch.sqrt(var + EPS)
    scale = invstd * (g.detach() if g is not None else 1)
    shift = (beta.detach() if beta is not None else 0) - mean * scale
    params = torch.stack([mean, invstd, scale, shift, var])
    return out.detach(), params, grads, dy.abs().sum((0, 2, 3)).max()

GEOM = ([1, 1], [1, 1], [1, 1], 1)   # stride, padding, dilation, groups

def fwd(k, c, name, p, keep_y):
    with torch.no_grad():
        return k.layer_fwd(c['x'], c['w'], c['b'], c['g'], c['beta'], c['r'], c['mean'], c['var'], *GEOM, EPS,
                           ACTS[name].code, p, keep_y)

def bwd(k, c, name, p, y, params, training, out=None, needs=None):
    if needs is None: needs = [True, True] + [c[n] is not None for n in ('b', 'g', 'beta', 'r')]   # as the op asks
    e = torch.empty(0, dtype=c['x'].dtype)
    return k.layer_bwd(c['dout'], c['x'], c['w'], c['b'], y, params, c['r'], e if out is None else out, *GEOM,
                       training, ACTS[name].code, p, needs)

@pytest.mark.parametrize('dtype', DTYPES, ids=str)
@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('residual', [False, True], ids=['', 'res'])
@pytest.mark.parametrize('bias,affine', [(False, True), (True, False), (True, True), (False, False)],
                         ids=['affine', 'bias', 'bias+affine', 'plain'])
@pytest.mark.parametrize('name,p', ACT_CASES, ids=ACT_IDS)
def test_layer(k, name, p, bias, affine, residual, training, dtype, cout=5):
    c = make_case(dtype, bias, affine, residual, training, cout=cout)
    want_out, want_params, want_grads, db_scale = oracle(c, name, p, training, dtype)
    tol_out, tol_grad = TOL[dtype]
    out, y, params = fwd(k, c, name, p, True)
    out2, y2, params2 = fwd(k, c, name, p, False)         # memory mode: no y
    assert out.dtype == dtype and out.is_contiguous(memory_format=CL)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert params.dtype == acc and params.shape == (5, cout) and params.is_contiguous()
    assert y.shape == out.shape and y.dtype == dtype and y2.numel() == 0
    assert torch.equal(out, out2) and torch.equal(params, params2)
    assert_close(out, want_out, tol_out, 'out')
    assert_close(params, want_params, tol_out, 'params')
    names = ['dx', 'dweight', 'dbias', 'dbn_weight', 'dbn_bias', 'dresidual']
    ways = {'keep_y': bwd(k, c, name, p, y, params, training), 'memory': bwd(k, c, name, p, y2, params2, training)}
    if ACTS[name].grad_from_out(p): ways['from_out'] = bwd(k, c, name, p, y, params, training, out=out)
    for way, got in ways.items():
        for n, g, want in zip(names, got, want_grads):
            if want is None: assert g.numel() == 0, f"{way} {n}: expected an empty tensor"; continue
            assert g.dtype == (acc if n in ('dbn_weight', 'dbn_bias') else dtype), f"{way} {n}: dtype {g.dtype}"
            assert_close(g, want, tol_grad, f"{way} {n}", db_scale if n == 'dbias' else None)
    # the derivative read from out is exactly the recomputed one; y kept or recomputed is the same conv
    for way in ways:
        for n, a, b in zip(names, ways['keep_y'], ways[way]): assert torch.equal(a, b), f"{way} {n} != keep_y's"

@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('name,p', [('relu', 0.), ('silu', 0.), ('leaky_relu', -0.2)], ids=['relu', 'silu', 'leaky-0.2'])
def test_layer_fp16(k, name, p, training):
    "fp16 runs the same templates as bf16: a few cases"
    test_layer(k, name, p, True, True, True, training, torch.float16)

@pytest.mark.parametrize('dtype', DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('residual', [False, True], ids=['', 'res'])
@pytest.mark.parametrize('name,p', ACT_CASES, ids=ACT_IDS)
def test_layer_wide(k, name, p, residual, training, dtype):
    """37 channels: the kernels' vector loops over C (8 floats or 16 bf16/fp16 per step on AVX2, 4 doubles) and their
    scalar tail, in every pass (test_layer's 5 channels run the tail alone)"""
    test_layer(k, name, p, True, True, residual, training, dtype, cout=37)

def test_simd_width(k):
    """The loaded library is the one of the level clfast chose (`clfast_isa()`: the host's, or lower under
    CLFAST_MAX_CPU_ISA), so a cap really takes effect: compiled with that level's ATen vectors"""
    cap, lanes = torch.ops.clfast_cpu.simd_info()
    level = clfast_isa()
    name = cpu_kernels.library_path().name   # the install's library, or the one built at first use
    assert cap == level and (name.startswith(cpu_kernels.installed_name(level) + '.') or name.startswith(f"clfast_bn_act_{level}_"))
    if level != 'generic': assert lanes == {'avx2': 8, 'avx512': 16}[level]

# act(z) and act'(z) at z = +inf and -inf: the mathematical limits (leaky_relu's act(-inf) is slope * -inf)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize('name,p', ACT_CASES, ids=ACT_IDS)
def test_act_formulas(k, name, p, dtype):
    """act.h at chosen points (the boundaries, large values, +-inf, NaN) against the table's fp64 oracle: at +-inf the
    mathematical limits, where stock PyTorch gives NaN at one end or both, differently in its scalar and vectorized
    paths; hardswish' is 0 at z = -3 and 1 at z = 3 exactly. Depthwise 1x1 conv of ones, mean 0, var 1, eps 0: z = x"""
    pts = torch.tensor([0., -0., 6., -3., 3., 1e-30, -1e-30, 5.999, 6.001, -2.999, -3.001, 2.999, 3.001, 1., -1., 0.5,
                        -0.5, 20., -20., 100., -100., math.inf, -math.inf, math.nan], dtype=dtype)
    pts = torch.cat([pts, torch.linspace(-8, 8, 57, dtype=dtype)])
    C = pts.numel()
    x = pts.view(1, C, 1, 1).contiguous(memory_format=CL)
    w = torch.ones(C, 1, 1, 1, dtype=dtype)
    zero, one = torch.zeros(C), torch.ones(C)
    geom = ([1, 1], [0, 0], [1, 1], C)
    with torch.no_grad():
        out, y, params = k.layer_fwd(x, w, None, None, None, None, zero, one, *geom, 0., ACTS[name].code, p, True)
    torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True)   # (the conv may turn -0 into +0)
    g = torch.randn_like(x).abs() + 0.5
    want, want_dx = ACTS[name].oracle(x, g, p)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)  # fp32: erf, tanh
    torch.testing.assert_close(out.double(), want, **tol, equal_nan=True)
    needs = [True, False, False, False, False, False]
    e = torch.empty(0, dtype=dtype)
    dx = k.layer_bwd(g, x, w, None, y, params, None, e, *geom, False, ACTS[name].code, p, needs)[0]
    torch.testing.assert_close(dx.double(), want_dx, **tol, equal_nan=True)
    if ACTS[name].grad_from_out(p):
        dx2 = k.layer_bwd(g, x, w, None, y, params, None, out, *geom, False, ACTS[name].code, p, needs)[0]
        torch.testing.assert_close(dx2, dx, rtol=0, atol=0, equal_nan=True)

def test_needs_and_geometry(k):
    "Only the needed results (others empty); stride/dilation/groups; NCHW-contiguous x and dout are accepted"
    d = torch.float64
    x = torch.randn(2, 4, 9, 9, dtype=d)                   # not channels-last
    w, b = torch.randn(6, 2, 3, 3, dtype=d), torch.randn(6, dtype=d)
    g, beta = torch.rand(6, dtype=d) + 0.5, torch.randn(6, dtype=d)
    mean, var = torch.randn(6, dtype=d), torch.rand(6, dtype=d) + 0.5    # given statistics: dbias does not cancel
    geom = ([2, 2], [2, 2], [2, 2], 2)
    with torch.no_grad():
        out, y, params = k.layer_fwd(x, w, b, g, beta, None, mean, var, *geom, EPS, ACTS['silu'].code, 0., False)
    xr, wr, br, gr, betar = (v.clone().requires_grad_() for v in (x, w, b, g, beta))
    ref = F.silu(F.batch_norm(F.conv2d(xr, wr, br, 2, 2, 2, 2), mean, var, gr, betar, training=False, eps=EPS))
    assert_close(out, ref.detach(), 1e-10, 'out')
    dout = torch.randn(ref.shape, dtype=d)                  # NCHW-contiguous
    want = torch.autograd.grad(ref, [xr, wr, br, gr, betar], dout)
    for i in range(5):
        needs = [j == i for j in range(6)]
        got = k.layer_bwd(dout, x, w, b, y, params, None, torch.empty(0, dtype=d), *geom, False,
                          ACTS['silu'].code, 0., needs)
        for j, t in enumerate(got):
            if j == i: assert_close(t, want[i], 1e-10, f"result {i}")
            else: assert t.numel() == 0, f"result {j} computed though not needed"

def test_errors(k):
    x, w = torch.randn(2, 3, 4, 4), torch.randn(4, 3, 1, 1)
    geom = ([1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(ValueError, match='unknown activation'):
        k.layer_fwd(x, w, None, None, None, None, None, None, *geom, EPS, 99, 0., False)
    with pytest.raises(ValueError, match='mean and var'):
        k.layer_fwd(x, w, None, None, None, None, torch.zeros(4), None, *geom, EPS, 1, 0., False)
    with pytest.raises(ValueError, match='dtype|Double|Float'):
        k.layer_fwd(x, w.double(), None, None, None, None, None, None, *geom, EPS, 1, 0., False)
    out, y, params = k.layer_fwd(x, w, None, None, None, None, None, None, *geom, EPS, ACTS['silu'].code, 0., True)
    with pytest.raises(RuntimeError, match='cannot be read from its output'):
        k.layer_bwd(torch.randn_like(out), x, w, None, y, params, None, out, *geom, True, ACTS['silu'].code, 0.,
                    [True] * 6)
    out, y, params = k.layer_fwd(x, w, None, None, None, None, None, None, *geom, EPS, 3, -0.2, True)
    with pytest.raises(RuntimeError, match='cannot be read from its output'):
        k.layer_bwd(torch.randn_like(out), x, w, None, y, params, None, out, *geom, True, 3, -0.2, [True] * 6)

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=str)
def test_thread_count_independent(k, dtype):
    "The row partition of the sums is fixed: every result is bitwise the same on 1 and 3 threads (an exact depthwise 1x1 conv of ones, so only the kernels' sums can differ)"
    N, C, H = 4, 24, 24                                    # big enough that the sums and passes run in parallel
    x = torch.randn(N, C, H, H).to(dtype).to(memory_format=CL)
    w = torch.ones(C, 1, 1, 1, dtype=dtype)
    r, dout = torch.randn_like(x), torch.randn_like(x)
    g, beta = torch.rand(C) + 0.5, torch.randn(C)
    geom = ([1, 1], [0, 0], [1, 1], C)
    def run():
        out, y, params = k.layer_fwd(x, w, None, g, beta, r, None, None, *geom, EPS, ACTS['silu'].code, 0., True)
        return (out, params) + tuple(k.layer_bwd(dout, x, w, None, y, params, r, torch.empty(0, dtype=dtype), *geom,
                                                 True, ACTS['silu'].code, 0., [True, False, False, True, True, True]))
    one = run()
    torch.set_num_threads(3)
    try: three = run()
    finally: torch.set_num_threads(1)
    for i, (a, b) in enumerate(zip(one, three)): assert torch.equal(a, b), f"result {i} depends on the thread count"

@pytest.fixture
def gemm_way():
    "Restores the conv backward's setting after the test"
    before = cpu_kernels.set_gemm_backward('timed')
    yield cpu_kernels.set_gemm_backward
    cpu_kernels.set_gemm_backward(before)

def conv_case(dtype, n=3, cin=24, cout=40, h=9, w=7, kernel=(1, 1), weight_cl=False, bias=True):
    "x, weight, bias, and a dout of the conv's output shape for `geom` (made by `gemm_bwd`)"
    x = torch.randn(n, cin, h, w).to(dtype).to(memory_format=CL)
    wt = torch.randn(cout, cin, *kernel).to(dtype)
    if weight_cl: wt = wt.to(memory_format=CL)
    return x, wt, torch.randn(cout).to(dtype) if bias else None

def gemm_bwd(k, x, wt, b, geom, needs=(True, True, True), dout=None):
    """`layer_bwd`'s conv gradients for a layer whose dy is dout exactly (no activation, given statistics mean 0, var
    1, eps 0, no BN weight): so they are known in fp64 from dout alone. Returns (dx, dweight, dbias), dout"""
    c = wt.shape[0]
    with torch.no_grad():
        out, y, params = k.layer_fwd(x, wt, b, None, None, None, torch.zeros(c), torch.ones(c), *geom, 0., 0, 0., True)
    if dout is None: dout = torch.randn(out.shape).to(x.dtype).to(memory_format=CL)
    return k.layer_bwd(dout, x, wt, b, y, params, None, torch.empty(0, dtype=x.dtype), *geom, False, 0, 0.,
                       list(needs) + [False] * 3)[:3], dout

# (kernel, stride, padding, dilation): 1x1 at stride 1 (dx and dW straight GEMMs), strided (dW over x[:, :, ::s, ::s],
# dx scattered), padded 1x1 and every kxk (dW over im2col columns, dx by ATen), a dilation, a non-square kernel
GEMM_CASES = [((1, 1), (1, 1), (0, 0), (1, 1)), ((1, 1), (2, 2), (0, 0), (1, 1)), ((1, 1), (3, 2), (0, 0), (1, 1)),
              ((1, 1), (1, 1), (1, 0), (1, 1)), ((3, 3), (1, 1), (1, 1), (1, 1)), ((3, 3), (2, 2), (1, 1), (1, 1)),
              ((3, 3), (1, 1), (2, 2), (2, 2)), ((5, 3), (2, 1), (2, 1), (1, 1)), ((3, 3), (1, 1), (0, 0), (1, 1))]
GEMM_IDS = ['1x1', '1x1s2', '1x1s32', '1x1p1', '3x3', '3x3s2', '3x3d2', '5x3s21', '3x3p0']

@pytest.mark.parametrize('case', GEMM_CASES, ids=GEMM_IDS)
@pytest.mark.parametrize('weight_cl', [False, True], ids=['w', 'w_cl'])
@pytest.mark.parametrize('dtype', DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize('how', cpu_kernels.GEMM_BACKWARD)
def test_gemm_backward(k, gemm_way, how, dtype, weight_cl, case):
    "A conv's dx, dweight, dbias, by ATen, by the GEMM way or timed, equal fp64 ATen's on the same dout; dx is channels-last as x"
    kernel, stride, padding, dilation = case
    geom = (list(stride), list(padding), list(dilation), 1)
    x, wt, b = conv_case(dtype, kernel=kernel, weight_cl=weight_cl)
    gemm_way(how)
    got, dout = gemm_bwd(k, x, wt, b, geom)
    want = torch.ops.aten.convolution_backward(dout.double(), x.double(), wt.double(), [wt.shape[0]], *geom[:3], False,
                                               [0, 0], 1, [True, True, True])
    assert got[0].stride() == x.stride()
    for name, g, w_ in zip(('dx', 'dweight', 'dbias'), got, want):
        assert g.dtype == dtype and g.shape == w_.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_close(g, w_, TOL[dtype][1], f"{how} {name}")

@pytest.mark.parametrize('hw', [(1, 1), (2, 1), (1, 3)], ids=str)
@pytest.mark.parametrize('case', [((3, 3), (1, 1), (2, 2), (2, 2)), ((5, 5), (2, 2), (2, 2), (1, 1)),
                                  ((3, 1), (1, 1), (3, 0), (1, 1))], ids=['3x3d2', '5x5s2', '3x1p3'])
@pytest.mark.parametrize('how', ['gemm', 'timed'])
def test_gemm_backward_taps_outside_the_input(k, gemm_way, how, case, hw):
    "Maps smaller than the kernel: taps that read only padding (the im2col's empty ranges) give fp64 ATen's gradients"
    kernel, stride, padding, dilation = case
    geom = (list(stride), list(padding), list(dilation), 1)
    x, wt, b = conv_case(torch.float64, n=2, cin=5, cout=3, h=hw[0], w=hw[1], kernel=kernel, weight_cl=True)
    gemm_way(how)
    got, dout = gemm_bwd(k, x, wt, b, geom)
    want = torch.ops.aten.convolution_backward(dout, x, wt, [3], *geom[:3], False, [0, 0], 1, [True, True, True])
    for name, g, w_ in zip(('dx', 'dweight', 'dbias'), got, want): assert_close(g, w_, 1e-12, f"{how} {name}")

def test_gemm_backward_timed_once_per_shape(k, gemm_way):
    "'timed' decides once per shape (x, kernel, geometry, dtype, needs, threads); convs the GEMM way does not fit, or run under deterministic algorithms, are never timed"
    n, cin, cout, h, w = 2, 16, 24, 3, 11     # a shape no other test uses
    one = ([1, 1], [0, 0], [1, 1], 1)
    key = lambda needs=3, kernel=(1, 1), stride=(1, 1), pad=(0, 0): (
        (n, cin, h, w), (cout, cin, *kernel), stride, pad, (1, 1), 'Float', needs, torch.get_num_threads(), True)
    keys = lambda: set(cpu_kernels.gemm_backward_choices())
    x, wt, b = conv_case(torch.float32, n, cin, cout, h, w, bias=False)
    before = keys()
    first, dout = gemm_bwd(k, x, wt, None, one)
    assert keys() - before == {key()}, keys() - before
    choice = cpu_kernels.gemm_backward_choices()[key()]
    assert choice in ('gemm', 'conv')
    for _ in range(3):   # the timing call gave the winner's results, bitwise
        later, _ = gemm_bwd(k, x, wt, None, one, dout=dout)
        assert all(torch.equal(a, b) for a, b in zip(first, later))
    gemm_bwd(k, x, wt, None, one, needs=(True, False, False), dout=dout)       # other results wanted: another shape
    gemm_bwd(k, x, wt, None, ([2, 2], [0, 0], [1, 1], 1))
    w3 = torch.randn(cout, cin, 3, 3)
    gemm_bwd(k, x, w3, None, ([1, 1], [1, 1], [1, 1], 1))
    assert keys() - before == {key(), key(1), key(stride=(2, 2)), key(kernel=(3, 3), pad=(1, 1))}
    assert cpu_kernels.gemm_backward_choices()[key()] == choice  # not timed again
    # does not fit: two groups, an NCHW input, a kxk conv asked for dx alone (nothing for GEMMs to do)
    seen = keys()
    gemm_bwd(k, x, wt[:, :cin // 2].contiguous(), None, ([1, 1], [0, 0], [1, 1], 2))
    gemm_bwd(k, x.contiguous(), wt, None, one)
    gemm_bwd(k, x, w3, None, ([1, 1], [1, 1], [1, 1], 1), needs=(True, False, False))
    assert keys() == seen
    # deterministic algorithms: ATen, untimed
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try: gemm_bwd(k, x.double(), wt.double(), None, one)
    finally: torch.use_deterministic_algorithms(det)
    assert keys() == seen

@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_backward_timed_with_fp32(k, gemm_way, dtype):
    "A bf16/fp16 depthwise conv (the GEMM way does not fit) is timed against ATen's way in fp32: one choice per shape, the winner's results bitwise from the first call, fp64's gradients at the dtype's precision, dtype and layout as ATen's"
    n, c, h, w = 2, 40, 13, 11    # a shape no other test uses
    geom = ([2, 2], [1, 1], [1, 1], c)
    x = torch.randn(n, c, h, w).to(dtype).to(memory_format=CL)
    wt = torch.randn(c, 1, 3, 3).to(dtype).to(memory_format=CL)
    key = ((n, c, h, w), (c, 1, 3, 3), (2, 2), (1, 1), (1, 1), {torch.bfloat16: 'BFloat16', torch.float16: 'Half'}[dtype],
           3, torch.get_num_threads(), True)
    first, dout = gemm_bwd(k, x, wt, None, geom, needs=(True, True, False))
    choice = cpu_kernels.gemm_backward_choices()[key]
    assert choice in ('conv', 'fp32'), choice
    for _ in range(2):
        later, _ = gemm_bwd(k, x, wt, None, geom, needs=(True, True, False), dout=dout)
        assert all(torch.equal(a, b) for a, b in zip(first[:2], later[:2]))
    want = torch.ops.aten.convolution_backward(dout.double(), x.double(), wt.double(), None, *geom[:3], False, [0, 0],
                                               c, [True, True, False])
    for name, g, w_, like in zip(('dx', 'dweight'), first, want, (x, wt)):
        assert g.dtype == dtype and g.stride() == like.stride(), f"{name}: {g.dtype} {g.stride()}"
        assert_close(g, w_, TOL[dtype][1], f"{choice} {name}")
    gemm_way('conv')   # forced ATen: the dtype's own kernel, untimed
    seen = set(cpu_kernels.gemm_backward_choices())
    gemm_bwd(k, x[:1], wt, None, geom, needs=(True, True, False))
    assert set(cpu_kernels.gemm_backward_choices()) == seen

def test_gemm_backward_columns_capped(k, gemm_way):
    "cols(x) over 64 MiB is never built: such a conv runs ATen's way even when the GEMM way is forced"
    x, wt, b = conv_case(torch.float32, n=16, cin=64, cout=8, h=48, w=48, kernel=(3, 3), bias=False)  # 36864 x 576 floats: 81 MiB
    gemm_way('gemm')
    got, dout = gemm_bwd(k, x, wt, None, ([1, 1], [1, 1], [1, 1], 1), needs=(False, True, False))
    gemm_way('conv')
    want, _ = gemm_bwd(k, x, wt, None, ([1, 1], [1, 1], [1, 1], 1), needs=(False, True, False), dout=dout)
    assert torch.equal(got[1], want[1])

def test_strided_input_of_a_shape_that_chose_gemm(k, gemm_way, tmp_path, monkeypatch):
    """A channel slice of a wider channels-last map (cspnet's and dpn's blocks split theirs) is not the dense rows the
    GEMM way reads: a bf16 shape whose dense calls chose the GEMM way chooses apart for it, among the ways that can read
    it, and its gradients are fp64 ATen's (it ran the GEMM way on the wrong memory: cs3darknet_s's bf16 weight gradient
    1.4 off fp64, stock's 0.0017). The dense shape's choice is planted in a fresh cache: which way wins a timing is this
    machine's to say (fp32's way planted slower). bf16: an fp32 slice has one way (ATen's) and is never timed"""
    from clfast.timing import Timing, decide
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    n, cin, cout, h, w = 3, 20, 12, 5, 7     # a shape no other test uses
    one, bf16 = ([1, 1], [0, 0], [1, 1], 1), torch.bfloat16
    wide = torch.randn(n, 2 * cin, h, w).to(bf16).to(memory_format=CL)
    dense, xs = wide[:, cin:].contiguous(memory_format=CL), wide[:, cin:]
    wt = torch.randn(cout, cin, 1, 1).to(bf16)
    dout = torch.randn(n, cout, h, w).to(bf16).to(memory_format=CL)
    dense_key = cpu_kernels.backward_key(dense, wt, *one, 3, True)
    decide(f"{dense_key} gemm", lambda: Timing(0.5, 10, True, 1e-3))
    decide(f"{dense_key} fp32", lambda: Timing(1.5, 10, False, 1e-3))
    for x in (dense, xs):
        got, _ = gemm_bwd(k, x, wt, None, one, needs=(True, True, False), dout=dout)
        want = torch.ops.aten.convolution_backward(dout.double(), x.double(), wt.double(), None, *one[:3], False, [0, 0],
                                                   1, [True, True, False])
        for name, g, w_ in zip(('dx', 'dweight'), got, want): assert_close(g, w_, TOL[bf16][1], f"{x.stride()} {name}")
    key = lambda rows: ((n, cin, h, w), (cout, cin, 1, 1), (1, 1), (0, 0), (1, 1), 'BFloat16', 3, torch.get_num_threads(), rows)
    choices = cpu_kernels.gemm_backward_choices()
    assert choices[key(True)] == 'gemm' and choices[key(False)] in ('conv', 'fp32'), choices

def test_gemm_backward_setting_errors(gemm_way):
    with pytest.raises(ValueError, match="'conv', 'gemm', 'timed'"): gemm_way('fast')
    assert gemm_way('gemm') == 'timed' and gemm_way('conv') == 'gemm'
    with pytest.raises(ValueError, match='0 \\(conv\\), 1 \\(gemm\\) or 2'): torch.ops.clfast_cpu.set_gemm_backward(5)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize('name,p', ACT_CASES, ids=ACT_IDS)
def test_act_formulas_far_out(k, name, p, dtype):
    """act.h at huge finite z, where each activation is its linear asymptote (the limits of the table's `at_inf`): no
    overflow in between (hardswish's z * 6 gave inf for fp32 z > FLT_MAX / 6; gelu_tanh's z * z inf times 1 - tanh^2 = 0
    gave a NaN derivative from |z| = 1.8e19 in fp32, 1.3e154 in fp64, where stock fp64 itself is NaN: no oracle there)"""
    big = [1e19, 1e20, 6e37, 3e38] + ([1e155, 1e300] if dtype == torch.float64 else [])
    z = torch.tensor(big + [-v for v in big], dtype=dtype)
    C = z.numel()
    x = z.view(1, C, 1, 1).contiguous(memory_format=CL)
    w = torch.ones(C, 1, 1, 1, dtype=dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    geom = ([1, 1], [0, 0], [1, 1], C)
    with torch.no_grad():
        out, y, params = k.layer_fwd(x, w, None, None, None, None, torch.zeros(C, dtype=acc), torch.ones(C, dtype=acc),
                                     *geom, 0., ACTS[name].code, p, True)
    at_pos, at_neg, d_pos, d_neg = ACTS[name].at_inf(p)
    zd = z.double()
    pos = zd > 0
    full = lambda v: torch.full_like(zd, v)   # fp64 (torch.where of Python floats would be fp32)
    want = torch.where(pos, full(at_pos) if math.isfinite(at_pos) else zd,
                       full(at_neg) if math.isfinite(at_neg) else d_neg * zd)
    want_dx = torch.where(pos, full(d_pos), full(d_neg))
    g = torch.ones_like(x)
    dx = k.layer_bwd(g, x, w, None, y, params, None, torch.empty(0, dtype=dtype), *geom, False, ACTS[name].code, p,
                     [True, False, False, False, False, False])[0]
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double().flatten(), want, **tol)
    torch.testing.assert_close(dx.double().flatten(), want_dx, **tol)
