"Tests of `clfast.ops`: reference vs C++ CPU kernel vs Triton (interpreted) vs autograd of stock BN + add + ReLU"
import os, subprocess, sys, textwrap
from math import prod
from pathlib import Path
import pytest, torch
import torch.nn.functional as F
from hypothesis import given, settings, HealthCheck, strategies as st
from clfast import ops, cpu_kernels

ROOT = Path(__file__).parent.parent
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}

def _env(**kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    env.update(kw)
    return env

def stock(y, w, b, r, relu, training, rm, rv, eps=1e-5):
    "Stock BN (+ add) (+ ReLU), differentiable"
    z = F.batch_norm(y, None if training else rm, None if training else rv, w, b, training=training, eps=eps)
    if r is not None: z = z + r
    return F.relu(z) if relu else z

def check(shape, dt, cl, affine, res, relu, training, device='cpu', seed=0):
    "Kernel (through the public ops) and reference both match autograd of stock ops computed in fp64"
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    lay = (lambda t: t.to(memory_format=fmt)) if cl else (lambda t: t.contiguous())
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    y = lay((mk(*shape) * 2 + 1).to(dt)).to(device)
    c, pdt = shape[1], ops.acc_dtype(dt)
    w = (mk(c).abs() + .5).to(pdt).to(device) if affine else None
    b = mk(c).to(pdt).to(device) if affine else None
    r = lay(mk(*shape).to(dt)).to(device) if res else None
    dout = lay(mk(*shape).to(dt)).to(device)
    rm, rv = mk(c).to(pdt).to(device), (mk(c).abs() + .5).to(pdt).to(device)
    # truth: stock autograd in fp64 on the very same (rounded) inputs
    y64 = y.double().requires_grad_()
    p64 = [t.double().requires_grad_() if t is not None else None for t in (w, b, r)]
    out64 = stock(y64, *p64, relu, training, rm.double(), rv.double())
    want = [y64] + [t for t in p64 if t is not None]
    grads64 = iter(torch.autograd.grad(out64, want, dout.double()))
    g64 = [next(grads64)] + [next(grads64) if t is not None else None for t in p64]

    for impl in ('kernel', 'ref'):
        stats, fwd, bwd = ((ops.bn_stats, ops.bn_act_fwd, ops.bn_act_bwd) if impl == 'kernel' else
                           (ops.ref_bn_stats, ops.ref_bn_act_fwd, ops.ref_bn_act_bwd))
        if training:
            mean, var = stats(y)
            assert mean.dtype == pdt and var.dtype == pdt and mean.shape == (c,)
            torch.testing.assert_close(mean.double(), y.double().mean([0, *range(2, y.dim())]), **TOL[pdt])
            torch.testing.assert_close(var.double(), y.double().var([0, *range(2, y.dim())], unbiased=False),
                                       **TOL[pdt])
        else: mean, var = rm, rv
        invstd = (var + 1e-5).rsqrt()
        out = fwd(y, mean, invstd, w, b, r, relu)
        assert out.dtype == dt and out.shape == y.shape
        assert out.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(out.double(), out64.detach(), **TOL[dt])
        dy, dw, db, dr = bwd(dout, y, mean, invstd, w, b, r, relu, training)
        assert dy.dtype == dt
        # dy's terms scale with invstd*|w|, and cancel when M is tiny (M=2: x_hat = +-1): scale atol with them
        k = (invstd * (1 if w is None else w.abs())).max().item()
        torch.testing.assert_close(dy.double(), g64[0], atol=TOL[dt]['atol'] * max(1, k), rtol=TOL[dt]['rtol'])
        for got, exp in zip((dw, db), g64[1:3]):
            if exp is None: assert got is None
            else:
                assert got.dtype == pdt
                # per-channel sums over M rounded inputs: scale the tolerance with M
                m = y.numel() // c
                tol = TOL[pdt] if dt in (torch.float32, torch.float64) else dict(atol=2e-2 * m**.5, rtol=2e-2)
                torch.testing.assert_close(got.double(), exp, **tol)
        if r is None: assert dr is None
        else:
            assert dr.dtype == r.dtype
            torch.testing.assert_close(dr.double(), g64[3], **TOL[dt])

shapes = st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([1, 3, 17, 64]), st.sampled_from([1, 3, 5]),
                   st.sampled_from([1, 2, 7]))

@settings(deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=shapes, dt=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       cl=st.booleans(), affine=st.booleans(), res=st.booleans(), relu=st.booleans(), training=st.booleans(),
       seed=st.integers(0, 2**16))
def test_against_stock_cpu(shape, dt, cl, affine, res, relu, training, seed):
    training = training and shape[0] * shape[2] * shape[3] > 1   # stock refuses one value per channel
    check(shape, dt, cl, affine, res, relu, training, seed=seed)

@pytest.mark.parametrize('shape', [(1, 1, 1, 1), (1, 3, 1, 1), (2, 17, 1, 1, 1), (2, 5, 2, 3, 3)])
def test_degenerate_and_3d_cpu(shape):
    "N=1, H=W=1 (one value per channel in eval), C=1 and 5D inputs"
    check(shape, torch.float64, True, True, True, True, training=prod(shape) // shape[1] > 1)
    check(shape, torch.float32, False, False, False, False, training=False)

def test_uses_cpp_kernel():
    "The CPU dispatch really runs the C++ kernel (not the reference) when a compiler is present"
    if cpu_kernels.missing_toolchain(): pytest.skip(cpu_kernels.missing_toolchain())
    k = ops.kernel_backend('cpu')
    assert k is not None and k.stats is torch.ops.clfast_cpu.stats

def test_stats_numerics_cpu():
    "fp32 variance stays accurate when the mean dwarfs the spread; bf16 input accumulates in fp32"
    y = torch.randn(20000, 8, dtype=torch.float64) + 1e4
    x = y.float().t().reshape(1, 8, 100, 200)
    mean, var = ops.bn_stats(x)
    torch.testing.assert_close(var.double(), x.double().var((0, 2, 3), unbiased=False), rtol=1e-3, atol=0)
    yb = (torch.rand(1, 4, 300, 301) + 1).bfloat16()
    mean, var = ops.bn_stats(yb)
    torch.testing.assert_close(mean.double(), yb.double().mean((0, 2, 3)), rtol=1e-5, atol=0)
    torch.testing.assert_close(var.double(), yb.double().var((0, 2, 3), unbiased=False), rtol=1e-4, atol=0)

def test_triton_interpreted():
    "The CUDA (Triton) kernels' numerics, interpreted on the CPU in a fresh process"
    pytest.importorskip('triton')
    p = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-x',
                        str(ROOT/'tests'/'_triton_interp_kernels.py')],
                       env=_env(TRITON_INTERPRET='1'), capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    assert ' passed' in p.stdout and 'skipped' not in p.stdout

def _op_args():
    cl = torch.channels_last
    y = torch.randn(2, 5, 3, 3).to(memory_format=cl)
    m, v = ops.bn_stats(y)
    inv, w, b, r = (v + 1e-5).rsqrt(), torch.randn(5), torch.randn(5), torch.randn(2, 5, 3, 3).to(memory_format=cl)
    g = torch.randn_like(y)
    yb = torch.randn(3, 4, 5, 1, 2).bfloat16()
    mb, vb = ops.bn_stats(yb)
    return dict(
        stats=[(y,), (y.contiguous(),), (yb,)],
        fwd=[(y, m, inv, w, b, r, True), (y, m, inv, None, None, None, False), (y.contiguous(), m, inv, w, b, r, False),
             (yb, mb, vb, None, None, yb, True)],
        bwd=[(g, y, m, inv, w, b, r, True, True, True), (g, y, m, inv, None, None, None, False, False, False),
             (g.contiguous(), y, m, inv, w, None, r, True, False, True), (yb, yb, mb, vb, None, None, None, True, True, False)])

def test_opcheck():
    "Schemas, fake (meta) implementations and dispatch pass torch.library.opcheck"
    args = _op_args()
    for op, key in ((ops.bn_stats_op, 'stats'), (ops.bn_act_fwd_op, 'fwd'), (ops.bn_act_bwd_op, 'bwd')):
        for a in args[key]: torch.library.opcheck(op, a)

def _fn(y, w, b, r):
    mean, var = ops.bn_stats(y)
    invstd = (var + 1e-5).rsqrt()
    out = ops.bn_act_fwd(y, mean, invstd, w, b, r, True)
    dy, dw, db, dr = ops.bn_act_bwd(out, y, mean, invstd, w, b, r, True, True)
    return out, dy, dw, db, dr

def _compiled_matches(backend):
    torch._dynamo.reset()
    y = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    w, b, r = torch.rand(6) + .5, torch.randn(6), torch.randn_like(y)
    got = torch.compile(_fn, fullgraph=True, backend=backend)(y, w, b, r)
    for a, e in zip(got, _fn(y, w, b, r)): torch.testing.assert_close(a, e)

def test_compile_traces_fullgraph():
    "Dynamo + AOT autograd trace the ops with their fake implementations, no graph break"
    _compiled_matches('aot_eager')

@pytest.mark.slow
def test_compile_inductor():
    "The default inductor backend compiles around the ops (CPU C++ codegen: slow)"
    _compiled_matches('inductor')

def test_bad_input():
    y = torch.randn(2, 3, 4, 4)
    m, v = ops.bn_stats(y)
    with pytest.raises(TypeError, match='floating-point'): ops.bn_stats(torch.ones(2, 3, 4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match='at least 2 dims'): ops.bn_stats(torch.randn(5))
    with pytest.raises(ValueError, match='at least one value'): ops.bn_stats(torch.randn(0, 3, 4, 4))
    with pytest.raises(ValueError, match='Per-channel'): ops.bn_act_fwd(y, m[:2], v)
    with pytest.raises(ValueError, match='residual shape'): ops.bn_act_fwd(y, m, v, residual=torch.randn(2, 3, 4, 5))
    with pytest.raises(ValueError, match='dout shape'): ops.bn_act_bwd(torch.randn(1, 3, 4, 4), y, m, v)

def test_ref_env_forces_reference(monkeypatch):
    monkeypatch.setenv('CLFAST_KERNELS', 'ref')
    assert ops.kernel_backend('cpu') is None
    check((2, 3, 2, 2), torch.float32, True, True, True, True, True)

def test_no_compiler_falls_back_with_one_warning(tmp_path):
    "Without a C++ compiler the ops still work, on the pure-PyTorch path, after exactly one warning"
    code = textwrap.dedent("""
        import warnings, torch
        from clfast import ops, cpu_kernels
        assert 'compiler' in cpu_kernels.missing_toolchain()
        y = torch.randn(2, 3, 4, 4)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter('always')
            for _ in range(3):
                m, v = ops.bn_stats(y)
                out = ops.bn_act_fwd(y, m, (v + 1e-5).rsqrt(), relu=True)
        msgs = [str(w.message) for w in ws if 'clfast' in str(w.message)]
        assert len(msgs) == 1 and 'pure-PyTorch' in msgs[0], msgs
        torch.testing.assert_close(out, ops.ref_bn_act_fwd(y, m, (v + 1e-5).rsqrt(), relu=True))
        print('OK')""")
    p = subprocess.run([sys.executable, '-c', code], env=_env(CXX=str(tmp_path/'no-such-c++'),
                       TORCH_EXTENSIONS_DIR=str(tmp_path/'ext')), capture_output=True, text=True)
    assert p.returncode == 0 and 'OK' in p.stdout, p.stdout + p.stderr

def test_second_process_reuses_cache():
    "A second process loads the cached library without rebuilding it"
    if cpu_kernels.missing_toolchain(): pytest.skip(cpu_kernels.missing_toolchain())
    cpu_kernels.load()
    lib = cpu_kernels.library_path()
    assert lib is not None and lib.exists()
    before = lib.stat().st_mtime_ns
    code = "from clfast import cpu_kernels as c; c.load(); print(c.library_path())"
    p = subprocess.run([sys.executable, '-c', code], env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(lib)
    assert lib.stat().st_mtime_ns == before

@pytest.mark.cuda
@pytest.mark.parametrize('dt', [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize('res,relu,training', [(True, True, True), (False, True, False), (True, False, True),
                                               (False, False, False)])
def test_against_stock_cuda(dt, res, relu, training):
    "CUDA dispatch (Triton kernels) matches stock autograd"
    assert ops.kernel_backend('cuda') is not None
    for shape in [(2, 64, 7, 9), (1, 17, 1, 1), (3, 3, 5, 5), (8, 256, 14, 14)]:
        if training and shape[0] * shape[2] * shape[3] == 1: continue
        check(shape, dt, True, True, res, relu, training, device='cuda')
    check((2, 17, 5, 5), dt, False, False, res, relu, training, device='cuda')

@pytest.mark.cuda
def test_opcheck_cuda():
    args = _op_args()
    to = lambda a: tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in a)
    for op, key in ((ops.bn_stats_op, 'stats'), (ops.bn_act_fwd_op, 'fwd'), (ops.bn_act_bwd_op, 'bwd')):
        for a in args[key]: torch.library.opcheck(op, to(a))

class _BnAct(torch.autograd.Function):
    "Test-only autograd wrapper: statistics (training) or running stats (eval) + fused fwd, fused bwd"
    @staticmethod
    def forward(ctx, y, w, b, r, relu, training, rm, rv):
        mean, var = ops.bn_stats(y) if training else (rm, rv)
        invstd = (var + 1e-5).rsqrt()
        ctx.save_for_backward(y, w, b, r, mean, invstd)
        ctx.relu, ctx.training = relu, training
        return ops.bn_act_fwd(y, mean, invstd, w, b, r, relu)
    @staticmethod
    def backward(ctx, g):
        y, w, b, r, mean, invstd = ctx.saved_tensors
        return (*ops.bn_act_bwd(g.contiguous(memory_format=torch.channels_last), y, mean, invstd, w, b, r,
                                ctx.relu, ctx.training), None, None, None, None)

@pytest.mark.parametrize('relu,res,training', [(True, True, True), (True, False, False), (False, True, False),
                                               (False, False, True)])
def test_gradcheck_fp64(relu, res, training, device='cpu'):
    "float64 gradcheck of the kernels' backward, batch statistics included (their dependence on y)"
    cl, kw = torch.channels_last, dict(dtype=torch.float64, device=device)
    y = torch.randn(2, 3, 3, 3, **kw).to(memory_format=cl).requires_grad_()
    w = (torch.rand(3, **kw) + .5).requires_grad_()
    b = torch.randn(3, **kw, requires_grad=True)
    r = torch.randn(2, 3, 3, 3, **kw).to(memory_format=cl).requires_grad_() if res else None
    rm, rv = torch.randn(3, **kw), torch.rand(3, **kw) + .5
    f = lambda y, w, b, *r: _BnAct.apply(y, w, b, r[0] if r else None, relu, training, rm, rv)
    assert torch.autograd.gradcheck(f, (y, w, b, *([r] if res else [])))

@pytest.mark.cuda
@pytest.mark.parametrize('relu,res,training', [(True, True, True), (False, False, False)])
def test_gradcheck_fp64_cuda(relu, res, training): test_gradcheck_fp64(relu, res, training, 'cuda')
