"""Tests of `clfast.ops`: the fused layer's op (`clfast::conv_bn_act`) over every kernel set that can run here (C++ on
the CPU, the pure-PyTorch reference, Triton interpreted in a subprocess, CUDA when present) against the fp64 oracle:
stock conv -> batch_norm -> (+ residual) -> activation, differentiated by autograd."""
import contextlib, itertools, math, os, shutil, signal, subprocess, sys, textwrap, warnings
from pathlib import Path
from unittest import mock
import pytest, torch
import torch.nn.functional as F
from clfast import timing
from clfast import ops, cpu_kernels
from clfast.act import ACTS
from clfast.reference import ConvGeometry
import preloaded
from helpers import second_order, stock_layer, op_layer

ROOT = Path(__file__).parent.parent
# outputs / gradients, relative to the tensor's scale
TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-4, 1e-3), torch.bfloat16: (3e-2, 6e-2),
       torch.float16: (4e-3, 1e-2)}
BACKENDS = ['kernel', 'ref']
# each activation with a parameter that exercises it (leaky: a slope whose derivative can and one that cannot be read
# from the output)
ACT_CASES = [(a, 0.) for a in ACTS if a != 'leaky_relu'] + [('leaky_relu', 0.1), ('leaky_relu', -0.2)]

def _env(**kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    env.update(kw)
    return env

def backend(name):
    "'kernel': the device's own kernels; 'ref': the pure-PyTorch ones"
    return contextlib.nullcontext() if name == 'kernel' else ops.kernels_from('ref')

def oracle(x, w, b, bw, bb, res, rm, rv, training, act, p, stride=1, padding=1, y_as=None):
    """The stock composition, in whatever dtype its inputs are (fp64 for the oracle). With `y_as` the conv output takes
    those values (gradient passed straight through): the layer's own conv output in its dtype. Otherwise a value near an
    activation's kink lands on different sides of it in the two and a low-precision comparison fails at random (rounding
    the fp64 conv output is not enough: cuDNN's bf16 conv rounds 1 ulp off it here and there)."""
    y = F.conv2d(x, w, b, stride, padding)
    if y_as is not None: y = y + (y_as.to(y) - y).detach()
    z = F.batch_norm(y, None if training else rm, None if training else rv, bw, bb, training=training, eps=1e-5)
    if res is not None: z = z + res
    return ACTS[act](z, p)

def _close(got, exp, tol, what, floor=1e-12):
    "`got` within `tol` of `exp` relative to `exp`'s scale, at least `floor` (elementwise relative error is meaningless near 0)"
    scale = exp.abs().max().clamp_min(floor)
    err = (got.double() - exp).abs().max() / scale
    assert err <= tol, f"{what}: max error {err:.3g} of scale {scale:.3g} > {tol}"

def check(dt, act, p, res, training, keep_y, affine=True, bias=True, shape=(2, 6, 5, 5), cout=7, seed=0,
          device='cpu'):
    "The op through `fused_conv_bn` (forward, backward, running stats) against the fp64 oracle"
    g = torch.Generator().manual_seed(seed)
    n, cin, h, wd = shape
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x, w = mk(n, cin, h, wd), mk(cout, cin, 3, 3) * 0.3
    b = mk(cout) if bias else None
    bw, bb = (mk(cout).abs() + 0.5, mk(cout)) if affine else (None, None)
    r = mk(n, cout, h, wd) if res else None
    rm, rv = mk(cout) * 0.1, mk(cout).abs() + 0.5
    dout = mk(n, cout, h, wd)
    # the oracle computes in fp64 on the values the layer gets: inputs rounded to its dtype
    rnd = lambda t: None if t is None else t.to(dt).double()
    x, w, b, r, dout = rnd(x), rnd(w), rnd(b), rnd(r), rnd(dout)
    lead = [x, w] + [t for t in (b, bw, bb, r) if t is not None]
    pdt = torch.float64 if dt == torch.float64 else torch.float32   # BN's parameters and buffers
    exp_in = [t.clone().requires_grad_() for t in lead]
    it = iter(exp_in[2:])
    eb, ebw, ebb, er = (next(it) if t is not None else None for t in (b, bw, bb, r))
    cl = lambda t: t.to(device, dt).to(memory_format=torch.channels_last) if t.dim() == 4 else t.to(device, dt)
    y_dev = F.conv2d(cl(x), cl(w), None if b is None else cl(b), 1, 1).cpu()   # the conv the layer runs, in dt
    exp = oracle(exp_in[0], exp_in[1], eb, ebw, ebb, er, rm, rv, training, act, p, y_as=y_dev)
    exp_grads = torch.autograd.grad(exp, exp_in, dout)
    got_in = [cl(t).requires_grad_() for t in [x, w]] + [t.to(device).requires_grad_() if t is not bw and t is not bb and t is not b
              else t.to(device, pdt).requires_grad_() for t in lead[2:]]
    if r is not None: got_in[-1] = cl(r).requires_grad_()
    if b is not None: got_in[2] = b.to(device, dt).requires_grad_()
    it = iter(got_in[2:])
    gb, gbw, gbb, gr = (next(it) if t is not None else None for t in (b, bw, bb, r))
    grm, grv = rm.to(device, pdt, copy=True), rv.to(device, pdt, copy=True)
    nbt = torch.zeros((), dtype=torch.long, device=device)
    out = ops.fused_conv_bn(got_in[0], got_in[1], gb, gbw, gbb, grm, grv, nbt,
                            training, 0.1, 1e-5, ConvGeometry(padding=(1, 1)), gr, act, p, keep_y)
    assert out.dtype == dt and out.is_contiguous(memory_format=torch.channels_last)
    assert out._base is None, "a backend's output must not be a view (the next module may modify it in place)"
    tout, tgrad = TOL[dt]
    _close(out.cpu(), exp.detach(), tout, f'output ({act})')
    got_grads = torch.autograd.grad(out, got_in, dout.to(device, dt))
    names = ['dx', 'dweight'] + [n for n, t in zip(('dbias', 'dbn_weight', 'dbn_bias', 'dresidual'), (b, bw, bb, r))
                                 if t is not None]
    for n_, a, e in zip(names, got_grads, exp_grads):
        assert a.dtype == got_in[names.index(n_)].dtype, n_
        # with batch statistics the conv bias gradient is a sum that cancels to ~0: compare it at the scale of dx
        floor = exp_grads[0].abs().max() if n_ == 'dbias' else 1e-12
        _close(a.cpu(), e, tgrad, f'{n_} ({act}, p={p})', floor)
    if training:   # running statistics: momentum 0.1 from the batch's mean and unbiased variance
        yy = F.conv2d(x, w, b, 1, 1)
        st = 1e-10 if dt == torch.float64 else max(1e-5, tout)   # statistics of the conv output rounded to dt
        _close(grm.cpu(), 0.9 * rm + 0.1 * yy.mean((0, 2, 3)), st, 'running_mean')
        _close(grv.cpu(), 0.9 * rv + 0.1 * yy.var((0, 2, 3)), st, 'running_var')
        assert nbt.item() == 1
    else: assert nbt.item() == 0

@pytest.mark.parametrize('act,p', ACT_CASES)
@pytest.mark.parametrize('res', [True, False])
@pytest.mark.parametrize('which', BACKENDS)
def test_every_activation_fp64(act, p, res, which):
    "fp64: every activation, with and without a residual, training and eval, y kept and recomputed"
    with backend(which):
        for training, keep_y in [(True, True), (False, False)]:
            check(torch.float64, act, p, res, training, keep_y)

@pytest.mark.parametrize('dt', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('act,p', [('relu', 0.), ('silu', 0.), ('leaky_relu', -0.2), ('hardswish', 0.), ('gelu', 0.)])
@pytest.mark.parametrize('which', BACKENDS)
def test_low_precision(dt, act, p, which):
    "fp32 and bf16 inputs (fp32 statistics and BN parameters): within the dtype's rounding of the fp64 oracle"
    with backend(which):
        check(dt, act, p, True, True, True, shape=(3, 8, 6, 6), cout=16)
        check(dt, act, p, False, False, False, affine=False, bias=False, shape=(3, 8, 6, 6), cout=16)

def _cpu_kernel_of(op:str) -> str:
    "Where the active CPU kernel of `clfast::op` was registered (the dispatcher's own record)"
    line = next(l for l in torch._C._dispatch_dump(f'clfast::{op}').splitlines() if l.startswith('CPU:'))
    return line.split('registered at ')[1].split(' ')[0]

def test_uses_cpp_kernel():
    "The CPU's kernels are the C++ ones when a compiler is present, and the layer's autograd node is C++'s"
    if cpu_kernels.missing_toolchain(): pytest.skip(cpu_kernels.missing_toolchain())
    assert ops.kernels_ready()
    for op in ('layer_fwd', 'layer_bwd', 'batch_stats'): assert 'csrc/conv_bn_act.cpp' in _cpu_kernel_of(op)
    out = ops.fused_conv_bn(torch.randn(2, 3, 4, 4, requires_grad=True), torch.randn(5, 3, 1, 1), None, None, None,
                            None, None, None, True, 0.1, 1e-5)
    assert out.grad_fn.name() == 'torch::autograd::CppNode<clfast::ConvBnAct>'

def test_kernels_from():
    "Inside the block the CPU runs the named kernel set (here the reference's), after it the C++ kernels again"
    calls = []
    ref = ops.REFERENCE.layer_fwd
    args = (torch.randn(2, 3, 4, 4), torch.randn(5, 3, 1, 1), None, None, None, None, None, None, True, 0.1, 1e-5)
    with mock.patch.object(ops.REFERENCE, 'layer_fwd', lambda *a, **k: calls.append(1) or ref(*a, **k)):
        with ops.kernels_from('ref'):
            assert 'clfast/ops.py' in _cpu_kernel_of('layer_fwd')
            ops.fused_conv_bn(*args)
        assert calls == [1]
        ops.fused_conv_bn(*args)
        assert calls == [1]
    if not cpu_kernels.missing_toolchain(): assert 'csrc/conv_bn_act.cpp' in _cpu_kernel_of('layer_fwd')
    with pytest.raises(ValueError, match="one of \\('ref', 'triton'\\)"): ops.kernels_from('cuda').__enter__()

def _op_args(keep_y=True, res=True, training=True, act=1):
    cl = torch.channels_last
    x = torch.randn(2, 3, 5, 5).to(memory_format=cl)
    w, b = torch.randn(4, 3, 3, 3).to(memory_format=cl), torch.randn(4)
    bw, bb = torch.rand(4) + .5, torch.randn(4)
    r = torch.randn(2, 4, 5, 5).to(memory_format=cl) if res else None
    mean, var = (None, None) if training else (torch.randn(4), torch.rand(4) + .5)
    return (x, w, b, bw, bb, r, mean, var, [1, 1], [1, 1], [1, 1], 1, 1e-5, act, 0.1, keep_y)

def _layer_args(res=True, training=True, act=1, momentum=0.1, keep_y=True, requires_grad=True):
    x, w, b, bw, bb, r, _, _, *geom, eps, act, p, keep_y = _op_args(keep_y, res, training, act)
    rm, rv, nbt = torch.randn(4), torch.rand(4) + .5, torch.zeros((), dtype=torch.long)
    grad = lambda t: t if t is None or not requires_grad else t.requires_grad_()
    return (grad(x), grad(w), grad(b), grad(bw), grad(bb), grad(r), rm, rv, nbt, training, momentum, eps, *geom, act, p,
            keep_y)

def _bwd_args(keep_y=True, res=True, training=True, act=1, needs=(True,) * 6):
    x, w, b, bw, bb, r, mean, var, *geom, eps, act, p, keep_y = _op_args(keep_y, res, training, act)
    out, y, params = torch.ops.clfast.layer_fwd(x, w, b, bw, bb, r, mean, var, *geom, eps, act, p, keep_y)
    return (torch.randn_like(out), x, w, b, y, params, r, torch.empty(0), *geom, training, act, p, list(needs))

@pytest.mark.parametrize('kw', [{}, dict(keep_y=False), dict(res=False, training=False), dict(act=4, res=True)])
def test_opcheck(kw):
    "The kernel ops' schemas, fakes and dispatch pass torch.library.opcheck; so does the layer (its C++ autograd)"
    ops.kernels_ready()
    torch.library.opcheck(torch.ops.clfast.layer_fwd.default, _op_args(**kw))
    torch.library.opcheck(torch.ops.clfast.layer_bwd.default, _bwd_args(**kw))
    torch.library.opcheck(torch.ops.clfast.batch_stats.default, (_op_args()[0],))
    for momentum in (0.1, None):
        torch.library.opcheck(torch.ops.clfast.conv_bn_act.default, _layer_args(**kw, momentum=momentum))

@pytest.mark.parametrize('dt', [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize('kernels', ['kernel', 'ref'])
def test_layer_out_is_the_forwards_output(kernels, dt):
    """`clfast::layer_out` (`clfast.recompute`'s recipes) gives back a layer's output from its conv output and params,
    bit for bit, for every activation (a layer without a residual, batch or given statistics); it passes opcheck"""
    ops.kernels_ready()
    x, w, b, bw, bb, _, _, _, *geom, eps, _, _, _ = _op_args(res=False)
    x, w, b = x.to(dt), w.to(dt), b.to(dt)
    given = (torch.randn(4), torch.rand(4) + .5)
    with (contextlib.nullcontext() if kernels == 'kernel' else ops.kernels_from('ref')):
        for name, a in ACTS.items():
            p = 0.1 if name == 'leaky_relu' else 0.
            for mean, var in ((None, None), given):
                out, y, params = torch.ops.clfast.layer_fwd(x, w, b, bw, bb, None, mean, var, *geom, eps, a.code, p, True)
                again = torch.ops.clfast.layer_out(y, params, a.code, p)
                assert torch.equal(again, out) and again.stride() == out.stride(), (name, mean is None)
        torch.library.opcheck(torch.ops.clfast.layer_out.default, (y, params, a.code, p))

@pytest.mark.parametrize('kernels', ['kernel', 'ref', 'triton', 'fake'])
def test_layer_out_refuses_other_params(kernels):
    """Every kernel set reads params' scale and shift rows as the forward wrote them (the C++ and Triton kernels from
    raw memory): any other tensor is refused, with the C++ kernel's message (the Triton set's check runs before its
    kernel, which needs no GPU to be refused; the fake's on shapes alone)"""
    if kernels == 'kernel' and cpu_kernels.missing_toolchain(): pytest.skip(cpu_kernels.missing_toolchain())
    ops.kernels_ready()
    x, w, b, bw, bb, _, mean, var, *geom, eps, act, p, _ = _op_args(res=False)
    _, y, params = torch.ops.clfast.layer_fwd(x, w, b, bw, bb, None, mean, var, *geom, eps, act, p, True)
    if kernels == 'fake': y, params = y.to('meta'), params.to('meta')
    served = ops.kernels_from(kernels) if kernels in ('ref', 'triton') else contextlib.nullcontext()
    where = 'META' if kernels == 'fake' else 'CPU'
    with served:
        for bad in (params[:4], params.double(), params.t().contiguous().t()):
            with pytest.raises(ValueError, match=rf"layer_out \({where}\): params must be the layer forward's contiguous "
                                                 r"\[5, 4\] Float tensor"):
                torch.ops.clfast.layer_out(y, bad, act, p)
        if kernels != 'triton':   # (its kernel runs on a GPU, or under the interpreter: tests/_triton_interp_layer.py)
            assert torch.ops.clfast.layer_out(y, params, act, p).shape == y.shape   # the forward's own: taken

@pytest.mark.parametrize('kernels', ['kernel', 'ref'])
def test_opcheck_half_precision_backward(kernels):
    """A bf16 layer's backward passes opcheck with results not needed (empty): the fake's empties are the kernels', in
    x's dtype (the BN parameters' gradients in params'); it said fp32 for all, where the C++ kernels give bf16"""
    ops.kernels_ready()
    x, w, b, bw, bb, r, mean, var, *geom, eps, act, p, keep_y = _op_args()
    x, w, b, r = (t.to(torch.bfloat16) for t in (x, w, b, r))
    with (contextlib.nullcontext() if kernels == 'kernel' else ops.kernels_from('ref')):
        out, y, params = torch.ops.clfast.layer_fwd(x, w, b, bw, bb, r, mean, var, *geom, eps, act, p, keep_y)
        for needs in [(True,) * 6, (True, False, False, True, True, False), (False, True, True, False, False, True),
                      (False,) * 6]:
            args = (torch.randn_like(out), x, w, b, y, params, r, torch.empty(0), *geom, True, act, p, list(needs))
            torch.library.opcheck(torch.ops.clfast.layer_bwd.default, args, test_utils=('test_schema', 'test_faketensor'))

def test_cumulative_average():
    "momentum=None: the running statistics are the plain average over the batches seen, as BatchNorm2d's"
    bn = torch.nn.BatchNorm2d(3, momentum=None)
    rm, rv, nbt = torch.zeros(3), torch.ones(3), torch.zeros((), dtype=torch.long)
    w = torch.randn(3, 2, 1, 1)
    for _ in range(3):
        x = torch.randn(4, 2, 3, 3)
        ops.fused_conv_bn(x, w, None, None, None, rm, rv, nbt, True, None, 1e-5)
        bn(F.conv2d(x, w))
    torch.testing.assert_close(rm, bn.running_mean); torch.testing.assert_close(rv, bn.running_var)
    assert nbt == bn.num_batches_tracked == 3

def test_bad_input():
    x, w = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 3, 3)
    args = lambda **kw: dict(dict(x=x, weight=w, bias=None, bn_weight=None, bn_bias=None, running_mean=None,
                                  running_var=None, num_batches_tracked=None, training=True, momentum=0.1, eps=1e-5,
                                  geometry=ConvGeometry(padding=(1, 1))), **kw)
    with pytest.raises(ValueError, match='4D input'): ops.fused_conv_bn(**args(x=torch.randn(3, 4, 4)))
    with pytest.raises(ValueError, match='residual shape'): ops.fused_conv_bn(**args(residual=torch.randn(2, 5, 4, 5)))
    with pytest.raises(ValueError, match='more than 1 value'): ops.fused_conv_bn(**args(x=torch.randn(1, 3, 1, 1), geometry=ConvGeometry(), weight=torch.randn(5, 3, 1, 1)))
    with pytest.raises(ValueError, match='unknown activation'): ops.fused_conv_bn(**args(act='mish'))

def test_ref_env_serves_the_cpu_with_the_reference():
    "CLFAST_KERNELS=ref: the whole process's CPU kernels are the reference's"
    code = ("from clfast import ops; import torch; ops.kernels_ready(); "
            "print(next(l for l in torch._C._dispatch_dump('clfast::layer_bwd').splitlines() if l.startswith('CPU:')))")
    p = subprocess.run([sys.executable, '-c', code], env=_env(CLFAST_KERNELS='ref'), capture_output=True, text=True)
    assert p.returncode == 0 and 'ops.py' in p.stdout and 'conv_bn_act.cpp' not in p.stdout, p.stdout + p.stderr

def test_a_misspelt_kernel_set_is_refused_at_every_call():
    """A CLFAST_KERNELS that names no kernel set is refused as a fused layer is made, and at each CPU call where it is
    set later: it was refused at the first call only, then the machine's own kernels ran as if unset"""
    code = textwrap.dedent("""
        import os, torch
        from clfast import ops
        from clfast.fused import FusedConvBN2d
        try: FusedConvBN2d(3, 4, 3, padding=1); print('made')
        except ValueError as e: print('refused when made:', e)
        del os.environ['CLFAST_KERNELS']
        f = FusedConvBN2d(3, 4, 3, padding=1)
        os.environ['CLFAST_KERNELS'] = 'bogus'
        for _ in range(2):
            try: f(torch.randn(2, 3, 5, 5)); print('ran')
            except ValueError: print('refused')
        print('served:', ops._SERVED)""")
    r = preloaded.run([sys.executable, '-c', code], env=_env(CLFAST_KERNELS='bogus'), timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0].startswith("refused when made: CLFAST_KERNELS='bogus' is not a kernel set"), r.stdout + r.stderr[-3000:]
    assert lines[1:] == ['refused', 'refused', 'served: {}'], r.stdout

def test_a_cpu_level_this_machine_cannot_take_is_refused_as_a_module_is_made():
    """A CLFAST_MAX_CPU_ISA that names no level is refused as fused and precise modules are made, before anything loads:
    at the first CPU call it would be inside torch.compile's trace, where dynamo calls it an internal error of its own"""
    code = textwrap.dedent("""
        from torch import nn
        from clfast import ops
        from clfast.machine import CpuIsaError
        from clfast.fused import FusedConvBN2d
        from clfast.bn import make_precise
        for make in (lambda: FusedConvBN2d(3, 4, 3, padding=1), lambda: make_precise(nn.BatchNorm2d(4)),
                     lambda: FusedConvBN2d.from_modules(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))):
            try: make(); print('made')
            except CpuIsaError as e: print('refused:', e)
        print('loaded:', 'cpu' in ops._loaded)""")
    r = preloaded.run([sys.executable, '-c', code], env=_env(CLFAST_MAX_CPU_ISA='avx3'), timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 4, r.stdout + r.stderr[-3000:]
    assert all(l.startswith("refused: CLFAST_MAX_CPU_ISA='avx3' is not a clfast CPU level") for l in lines[:3]), r.stdout
    assert lines[3] == 'loaded: False'

def test_two_threads_first_cpu_calls_load_once():
    """Two threads making a process's first CPU call at once load the kernels once: each served CLFAST_KERNELS's set,
    twice over (the load held up here so that both are inside it, as a real first load's build or disk read does)"""
    code = textwrap.dedent("""
        import threading, time
        from clfast import ops, cpu_kernels
        real = cpu_kernels.load
        def slow(*a, **k): time.sleep(0.3); return real(*a, **k)
        cpu_kernels.load = slow
        both = threading.Barrier(2)
        def first(): both.wait(); ops.kernels_ready()
        threads = [threading.Thread(target=first) for _ in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        print('served:', ops._SERVED, len(ops._FORCED))""")
    r = preloaded.run([sys.executable, '-c', code], env=_env(CLFAST_KERNELS='ref'), timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "served: {'CPU': ['ref']} 1", r.stdout + r.stderr[-3000:]

@pytest.mark.isa_neutral
def test_no_compiler_falls_back_with_one_warning(tmp_path):
    "Without a C++ compiler the fused layer still works, as its stock modules, after exactly one warning"
    code = textwrap.dedent(f"""
        import warnings, torch
        from pathlib import Path
        from clfast import cpu_kernels
        from clfast.fused import FusedConvBN2d
        assert 'compiler' in cpu_kernels.missing_toolchain()
        cpu_kernels.PACKAGE = Path({str(tmp_path)!r})   # as an install without a compiler: no installed library
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter('always')
            f = FusedConvBN2d(3, 4, 3, padding=1, act='silu')
            for _ in range(3): f(torch.randn(2, 3, 5, 5)).sum().backward()
        msgs = [str(w.message) for w in ws if 'clfast' in str(w.message)]
        assert len(msgs) == 1 and 'run as their stock modules' in msgs[0] and 'compiler' in msgs[0], msgs
        print('OK')""")
    p = subprocess.run([sys.executable, '-c', code], env=_env(CXX=str(tmp_path/'no-such-c++'),
                       TORCH_EXTENSIONS_DIR=str(tmp_path/'ext')), capture_output=True, text=True)
    assert p.returncode == 0 and 'OK' in p.stdout, p.stdout + p.stderr

@pytest.mark.isa_neutral
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

@pytest.fixture(scope='module')
def interpreted(tmp_path_factory):
    """The Triton interpreter's three runs, each a fresh pytest process (`run(name)`: its exit status and output): the
    kernels ('kernels'), the CUDA code path with no C++ library ('none') and over it ('cpp'; see
    `test_triton_interpreted_layer`). All three start at the first test that asks: the interpreter is numpy on one
    core, so on two cores they take about the longest one's time, not the sum (40 s against 80 on Zen 3)"""
    pytest.importorskip('triton')
    tmp, runs = tmp_path_factory.mktemp('interpreted'), {}
    def start(name, test_file, select=(), path_first=None, **env):
        log, env = tmp/f'{name}.log', _env(TRITON_INTERPRET='1', **env)
        if path_first: env['PYTHONPATH'] = f"{path_first}{os.pathsep}{env['PYTHONPATH']}"
        with open(log, 'w') as out:   # a file, not a pipe: three children writing at once never block on a full pipe
            runs[name] = log, subprocess.Popen([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *select,
                                                str(ROOT/'tests'/test_file)], env=env,
                                               stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    start('kernels', '_triton_interp_kernels.py', ['-x'])
    # a copy of clfast with no C++ library built and no compiler to build one, as on a GPU machine without a C++ toolchain
    shutil.copytree(ROOT/'clfast', tmp/'none'/'clfast', ignore=shutil.ignore_patterns('*.so', '__pycache__'))
    start('none', '_triton_interp_layer.py', path_first=tmp/'none', CLFAST_KERNELS='triton', CLFAST_TEST_LAYER_OP='none',
          CXX=str(tmp/'no-compiler'), TORCH_EXTENSIONS_DIR=str(tmp/'extensions'))
    start('cpp', '_triton_interp_layer.py', ['-k', 'not (test_layer or resnet_step or efficientnet_step or recipes_step or double_backward)'],
          CLFAST_KERNELS='triton', CLFAST_TEST_LAYER_OP='cpp')
    def run(name) -> tuple[int, str]:
        log, p = runs[name]
        return p.wait(), log.read_text()
    yield run
    for _, p in runs.values():
        if p.poll() is None: p.kill(); p.wait()   # a run no selected test asked for

def test_triton_interpreted(interpreted):
    "The CUDA (Triton) kernels' numerics, interpreted on the CPU in a fresh process"
    code, out = interpreted('kernels')
    assert code == 0, out[-8000:]
    assert ' passed' in out and 'skipped' not in out

def _layer_step(op, dt, training, res, act, keep_y, conv, momentum, stats, count=None):
    """One forward + backward of the layer op `op` on seeded inputs: the output, every gradient, the running statistics
    (`stats`) and their count (`count`; unless given, with the statistics)"""
    g = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=g).to(dt)
    c = 5 if conv else 4
    x = rand(3, 4, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    w = rand(5, 4, 3, 3).requires_grad_() if conv else None
    bw, bb = rand(c).requires_grad_(), rand(c).requires_grad_()
    r = rand(3, c, 6, 6).requires_grad_() if res else None
    acc = torch.float64 if dt == torch.float64 else torch.float32
    rm, rv = (rand(c).to(acc), rand(c).to(acc).abs() + .5) if stats else (None, None)
    nbt = torch.tensor(3) if (stats if count is None else count) else None
    out = op(x, w, None, bw, bb, r, rm, rv, nbt, training, momentum, 1e-5, [1, 1], [1, 1] if conv else [0, 0], [1, 1], 1,
             ACTS[act].code, 0.1, keep_y, '')
    out.backward(rand(*out.shape))
    return [out, *(None if t is None else t.grad for t in (x, w, bw, bb, r)), rm, rv, nbt]

@pytest.mark.parametrize('dt', [torch.float32, torch.bfloat16, torch.float64])
def test_python_layer_op_is_the_cpp_ops_twin(dt):
    """The layer op's Python autograd node (`ops._conv_bn_act`, what runs where the C++ library is not loaded) gives the
    C++ op's results over the same kernels: output, every gradient and the running statistics (both update them with
    the kernel op `update_running`) bit for bit, in the same layouts. Training and eval, residual, activations
    (from the output or not), both modes, with and without a conv, cumulative momentum"""
    if not ops.kernels_ready() or ops._loaded['cpu']: pytest.skip(f"no C++ library to compare with: {ops._loaded['cpu']}")
    cases = itertools.product([True, False], [True, False], ['none', 'relu', 'silu', 'leaky_relu'], [True, False],
                              [True, False], [0.1, None], [True, False])
    for case in cases:
        want, got = (_layer_step(op, dt, *case) for op in (torch.ops.clfast.conv_bn_act, ops._conv_bn_act))
        for i, (a, b) in enumerate(zip(want, got)):
            assert (a is None) == (b is None), (case, i)
            if a is None: continue
            assert a.stride() == b.stride(), (case, i)
            assert torch.equal(a, b), (case, i)

@pytest.mark.parametrize('act,p', ACT_CASES)
def test_double_backward_is_stocks_in_fp64(act, p):
    """Backward under `create_graph=True` (a gradient penalty, MAML's inner steps, a Hessian-vector product) through
    the C++ node and its Python twin: the second derivatives of the stock composition (fp64, to 1e-9) in training and
    eval, with and without a residual and a conv, `y` kept and not"""
    assert ops.kernels_ready()
    ops_ = [ops._conv_bn_act] + [torch.ops.clfast.conv_bn_act] * (ops._loaded['cpu'] is None)   # (the C++ one: loaded)
    for training, res, keep_y, conv in itertools.product([True, False], repeat=4):
        want = second_order(stock_layer(training, act, p), res, conv)
        for op in ops_:
            got = second_order(op_layer(op, training, act, p, keep_y), res, conv)
            for i, (a, e) in enumerate(zip(got, want)):
                _close(a, e, 1e-9, f'{op} {act} {p} {(training, res, keep_y, conv)} input {i}')

def test_an_old_gpu_runs_stock_and_says_so_once(monkeypatch):
    "A CUDA GPU older than sm_80 runs the fused layers as stock, said once. (Faked: no such GPU here, nor any GPU)"
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda i=None: (7, 5))
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda i=None: 'Tesla T4')
    monkeypatch.delitem(ops._loaded, 'cuda:0', raising=False)   # decided afresh, restored after the test
    with pytest.warns(UserWarning, match=r"on cuda:0 the fused layers run as their stock modules \(Tesla T4 is sm_75"):
        assert not ops.kernels_ready('cuda:0')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert not ops.kernels_ready(torch.device('cuda', 0))   # said once

@pytest.mark.parametrize('library', ['cpp', 'none'])
def test_triton_interpreted_layer(library, interpreted):
    """The CUDA code path end to end on the CPU: the fused layer (every activation, residual, both modes) and a training
    step of a fused ResNet and EfficientNet through the op's Triton backend, interpreted, against stock. `library`
    'none': a copy of clfast with no C++ library built and no compiler to build one, as on a GPU machine without a C++
    toolchain: the layer op is then its Python twin. Untraced, Triton's layer op is that twin calling the kernels as
    functions whether the library loaded or not (`test_cpu_kernels_are_tritons` checks it in both), so the layers' and
    the models' steps, the same code, run once: in 'none'"""
    code, out = interpreted(library)
    assert code == 0, out[-8000:]
    assert ' passed' in out and 'skipped' not in out

@pytest.mark.cuda
@pytest.mark.parametrize('dt', [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize('act,p', ACT_CASES)
def test_against_fp64_cuda(dt, act, p):
    "CUDA dispatch (Triton kernels) matches the fp64 oracle"
    from clfast import triton_kernels as tk
    for res, training, keep_y in [(True, True, True), (False, False, False)]:
        check(dt, act, p, res, training, keep_y, device='cuda', shape=(4, 16, 9, 9), cout=70)
    torch.cuda.synchronize()   # the reductions' last programs left their counters at zero, on a GPU's threads too
    assert not tk._LOCKS[torch.device('cuda', torch.cuda.current_device())].any()

def _cuda_step(dt, offset:int, launch:str):
    """A fused layer step on CUDA (batch statistics, residual, SiLU) launched `launch`'s way: its output, every gradient
    and the running statistics. The residual and the BN weight start `offset` elements into their storage"""
    from clfast import triton_kernels as tk
    g = torch.Generator(device='cuda').manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device='cuda')
    def placed(*s, dtype=torch.float32):   # `offset` elements into a fresh storage of `dtype`
        return rand(math.prod(s) + offset).to(dtype)[offset:].view(*s)
    x = rand(4, 24, 7, 7).to(dt).to(memory_format=torch.channels_last).requires_grad_()
    w = rand(40, 24, 3, 3).to(dt).to(memory_format=torch.channels_last).requires_grad_()
    r = placed(4, 7, 7, 40, dtype=dt).permute(0, 3, 1, 2).detach().requires_grad_()
    bw, bb = placed(40).detach().requires_grad_(), rand(40).requires_grad_()
    rm, rv, nbt = rand(40), rand(40).abs(), torch.zeros((), dtype=torch.long, device='cuda')
    with tk.launching(launch), torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        out = ops.fused_conv_bn(x, w, None, bw, bb, rm, rv, nbt, True, 0.1, 1e-5, ConvGeometry(padding=(1, 1)),
                                residual=r, act='silu')
        out.backward(rand(*out.shape).to(dt))
    return [out, x.grad, w.grad, bw.grad, bb.grad, r.grad, rm, rv, nbt]

@pytest.mark.cuda
@pytest.mark.parametrize('dt', [torch.float32, torch.bfloat16])
def test_compiled_launches_are_tritons_cuda(dt):
    """Through the compiled kernels (`launching('compiled')`) a fused layer step gives what Triton's own launches give,
    bit for bit: output, every gradient, the running statistics; aligned, and with a residual and a BN weight one
    element off 16 bytes (another specialization: a compiled kernel of its own). The second step of each finds its kernels by key"""
    from clfast import triton_kernels as tk
    tk._COMPILED.clear()
    for offset in (0, 1, 0, 1):
        want, got = _cuda_step(dt, offset, 'jit'), _cuda_step(dt, offset, 'compiled')
        for i, (a, b) in enumerate(zip(want, got)): assert torch.equal(a, b), (offset, i)
    found = [k for k, v in tk._COMPILED.items() if v is not None]
    assert len(found) == len(tk._COMPILED) and tk.launch_way == 'jit'
    # the offset's tensors are keyed apart: more keys than kernels, each kernel's launches in both alignments
    assert len(found) > len({k[0] for k in found})

def test_compiled_launches_call_tritons_launch_hooks_once_set():
    """The compiled way calls Triton's launcher with no launch metadata or hooks only while none is set (Triton 3.6 keeps
    empty `HookChain`s, which its own launches call at every launch); a hook set (a profiler's, such as proton's)
    sends the launches through the compiled kernel's own launch, which builds the metadata and calls it"""
    import triton
    from clfast import triton_kernels as tk
    if tk._RUNTIME_KNOBS is None: pytest.skip(f"Triton {triton.__version__} has no triton.knobs (3.4+): the compiled kernels' own launch")
    rt = triton.knobs.runtime
    assert tk._no_launch_hooks()
    hook = lambda metadata: None
    chain = isinstance(rt.launch_enter_hook, tk._HOOK_CHAIN)
    old = rt.launch_enter_hook
    if chain: rt.launch_enter_hook.add(hook)
    else: rt.launch_enter_hook = hook
    try: assert not tk._no_launch_hooks()
    finally:
        if chain: rt.launch_enter_hook.remove(hook)
        else: rt.launch_enter_hook = old
    assert tk._no_launch_hooks()

@pytest.mark.cuda
def test_opcheck_cuda():
    # the composite op's kernel is the C++ library's: loaded here, not by whichever test ran before
    if not ops.kernels_ready(): pytest.skip("clfast::conv_bn_act's kernel is the C++ library's, which did not load here")
    to = lambda a: tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in a)
    torch.library.opcheck(torch.ops.clfast.layer_fwd.default, to(_op_args()))
    torch.library.opcheck(torch.ops.clfast.conv_bn_act.default, to(_layer_args()))

@pytest.mark.parametrize('act,res,training', [('relu', True, True), ('silu', False, False), ('leaky_relu', True, False),
                                              ('gelu_tanh', False, True)])
@pytest.mark.parametrize('which', BACKENDS)
def test_gradcheck_fp64(act, res, training, which, device='cpu'):
    "float64 gradcheck of the op's backward, batch statistics included (their dependence on y)"
    kw = dict(dtype=torch.float64, device=device)
    x = torch.randn(2, 3, 4, 4, **kw, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, **kw, requires_grad=True)
    bw, bb = (torch.rand(4, **kw) + .5).requires_grad_(), torch.randn(4, **kw, requires_grad=True)
    r = torch.randn(2, 4, 4, 4, **kw, requires_grad=True) if res else None
    rm, rv = torch.randn(4, **kw), torch.rand(4, **kw) + .5
    f = lambda x, w, bw, bb, *r: ops.fused_conv_bn(x, w, None, bw, bb, rm, rv, None, training, 0., 1e-5,
                                                   ConvGeometry(padding=(1, 1)), r[0] if r else None, act, 0.1)
    with backend(which): assert torch.autograd.gradcheck(f, (x, w, bw, bb, *([r] if res else [])))

@pytest.mark.cuda
def test_gradcheck_fp64_cuda():
    "Also checks that the CUDA backward is deterministic (gradcheck runs it twice), given cuDNN's deterministic convs"
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        test_gradcheck_fp64('silu', True, True, 'kernel', 'cuda')

def test_installed_library_only_when_current(tmp_path, monkeypatch):
    "The package's library of a level (a wheel's) loads only when its name says: this level, this torch, these sources and flags"
    monkeypatch.setattr(cpu_kernels, 'PACKAGE', tmp_path)
    assert cpu_kernels.installed_library('generic') == (None, "none was built into the package")
    current = cpu_kernels.installed_name('generic')
    (tmp_path/(current.replace('_torch', '_torch0_1_') + '.cpython-311-x86_64-linux-gnu.so')).touch()
    lib, why = cpu_kernels.installed_library('generic')
    assert lib is None and 'another torch (0_1_' in why and torch.__version__ in why, why
    (tmp_path/(current[:-4] + 'beef.cpython-311-x86_64-linux-gnu.so')).touch()
    assert cpu_kernels.installed_library('generic') == (None, "the package's was built from other sources or flags")
    (tmp_path/(current + '.cpython-311-x86_64-linux-gnu.so')).touch()
    assert cpu_kernels.installed_library('generic')[0].name.startswith(current + '.')
    assert cpu_kernels.installed_library('avx2')[0] is None   # another level's never stands in

def test_kernels_build_with_the_environments_ninja(monkeypatch, tmp_path):
    """The C++ kernels build with the ninja installed beside this interpreter (clfast requires it) whether or not PATH
    finds it first: a system ninja of another version discards the other's build log and compiles everything again"""
    from clfast.cpu_kernels import own_ninja
    here = Path(sys.executable).parent
    assert (here/'ninja').exists(), "clfast's requirements install ninja into the environment"
    monkeypatch.setenv('PATH', os.pathsep.join(p for p in os.environ['PATH'].split(os.pathsep) if p != str(here)))
    before = os.environ['PATH']
    with own_ninja(): assert Path(shutil.which('ninja')).parent == here
    assert os.environ['PATH'] == before
    (tmp_path/'c++').symlink_to(shutil.which(os.environ.get('CXX', 'c++')))
    monkeypatch.setenv('PATH', str(tmp_path))   # a compiler, and no ninja on PATH: the environment's builds
    assert shutil.which('ninja') is None and cpu_kernels.missing_toolchain() is None

@pytest.mark.isa_neutral
@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for a CUDA toolkit without a GPU")
def test_kernels_load_without_torchs_cuda_home_warning(tmp_path):
    """Loading the CPU kernels on a machine with a CUDA toolkit and no GPU says nothing about CUDA: importing torch's
    extension builder there logs 'No CUDA runtime is found, using CUDA_HOME=...', which the CPU kernels do not use"""
    run = lambda code: subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                                      env=_env(CUDA_HOME=str(tmp_path)))   # a toolkit's folder: torch looks no further
    stock = run('import torch.utils.cpp_extension')
    assert 'No CUDA runtime is found' in stock.stderr, stock.stderr   # what the machine would show
    ours = run('from clfast import ops; print(ops.kernels_ready())')
    assert ours.returncode == 0 and 'No CUDA runtime' not in ours.stderr, ours.stderr

@pytest.mark.isa_neutral
def test_setup_builds_no_kernels_unless_asked(tmp_path):
    """setup.py needs neither torch nor a compiler (the kernels build on first use); a wheel asked to build them in
    (CLFAST_BUILD_KERNELS) where it cannot stops with why, never a wheel silently without them"""
    p = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=ROOT, capture_output=True, text=True,
                       env=_env(CXX=str(tmp_path/'no-such-c++')))
    assert p.returncode == 0 and p.stdout.strip() and 'clfast' not in p.stderr, p.stderr
    for which, says in [('all', 'no C++ compiler'), ('every', "must be 'all' or 'host'")]:
        p = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=ROOT, capture_output=True, text=True,
                           env=_env(CXX=str(tmp_path/'no-such-c++'), CLFAST_BUILD_KERNELS=which))
        assert p.returncode != 0 and says in p.stderr, p.stderr

@pytest.fixture
def cache_copy(tmp_path, monkeypatch):
    """`(level, library)`: this process's cached library of its level (built once, loaded), copied with its build folder
    into a cache of its own (TORCH_EXTENSIONS_DIR, for this test and its child processes), so that a test changing it
    leaves the suite's alone"""
    if cpu_kernels.missing_toolchain(): pytest.skip(cpu_kernels.missing_toolchain())
    level = cpu_kernels.clfast_isa()
    if cpu_kernels.installed_library(level)[0]: pytest.skip("this install's package holds the library: no cache")
    ops.kernels_ready()
    folder = cpu_kernels._cached_library(level).parent
    shutil.copytree(folder, tmp_path/folder.name)   # (the files' times kept: ninja's)
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))
    return level, cpu_kernels._cached_library(level)

@pytest.mark.isa_neutral
def test_clfast_build_seals_what_it_builds(cache_copy):
    """What `clfast build` builds is sealed, as a first use seals it, so that the next load takes it as it is, and
    `built_levels` lists it: here a library older than its sources, which ninja only links again (a missing seal would
    have the next load drop it as a killed build's and compile it again, 45 s of the test command)"""
    level, lib = cache_copy
    assert cpu_kernels._ready(level) and cpu_kernels.built_levels()[level] == 'cache'
    objects = {o: o.stat().st_mtime_ns for o in lib.parent.glob('*.o')}
    older = min(s.stat().st_mtime_ns for s in cpu_kernels.CSRC.glob('*.[ch]*')) - 10**9
    os.utime(lib, ns=(older, older))
    assert not cpu_kernels._ready(level)
    cpu_kernels.build([level])
    assert lib.stat().st_mtime_ns > older and objects == {o: o.stat().st_mtime_ns for o in objects}   # linked, nothing compiled
    assert cpu_kernels._ready(level) and cpu_kernels.built_levels()[level] == 'cache'

@pytest.mark.isa_neutral
def test_a_load_seals_the_library_it_loads(cache_copy):
    """A library its seal does not name, where ninja finds nothing to do, is sealed by the load that builds it: the next
    process loads it, rather than take it for a killed build's and compile it once more (each process compiled it, 100
    s apiece on Zen 3, seen with one venv reached by two paths)"""
    level, lib = cache_copy
    lib.with_suffix('.sha1').write_text('')   # not the library's
    built = lib.stat().st_mtime_ns
    # (not dropped as unsealed: this test is of the seal a load leaves, not of the drop)
    code = "from clfast import cpu_kernels as c; c._drop_unsealed = lambda level: False; c.load(); print(c._sealed(c.clfast_isa()))"
    p = subprocess.run([sys.executable, '-c', code], env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.split()[-1] == 'True', p.stdout + p.stderr[-3000:]
    assert lib.stat().st_mtime_ns == built and cpu_kernels._sealed(level)   # nothing compiled; sealed

@pytest.mark.isa_neutral
def test_a_ready_library_loads_without_a_compiler_or_a_build(cache_copy):
    """A cached library as its build sealed it, no source newer, loads as it is: with no compiler on PATH (it was refused
    for want of one) and no build run (ninja ran at every load; a read-only cache failed on torch's lock file)"""
    level, lib = cache_copy
    code = "from clfast import cpu_kernels as c; c._build = c._building = None; print(c.load())"
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                       env=_env(PATH=str(Path(sys.executable).parent)))   # (this environment's ninja, no compiler)
    assert p.returncode == 0 and p.stdout.split()[-1] == str(lib), p.stdout + p.stderr[-3000:]

def _waits_for_the_build(level:str, code:str) -> str:
    """Run `python -c code` while this process holds the build lock of the cached library of `level` (linked, not yet
    sealed, as a build in progress leaves it) until it says it waits (a failure after 120 s of silence), then seal the
    library and let go: its exit status must be 0; what it said on stderr"""
    import threading, time
    cpu_kernels._cached_library(level).with_suffix('.sha1').unlink()
    with cpu_kernels._building(level):   # this process builds
        p = subprocess.Popen([sys.executable, '-c', code], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)   # (a group of its own: killed with its children)
        said = []
        reader = threading.Thread(target=lambda: said.extend(p.stderr), daemon=True)   # (line by line, as they come)
        reader.start()
        deadline = time.monotonic() + 120
        while (not any('another process is compiling the C++ CPU kernels' in l for l in said) and reader.is_alive()
               and time.monotonic() < deadline): time.sleep(0.1)
        if not any('another process is compiling' in l for l in said): os.killpg(p.pid, signal.SIGKILL)
        else: cpu_kernels._seal(level)
    p.wait(timeout=300); reader.join()
    assert p.returncode == 0 and any('another process is compiling' in l for l in said), ''.join(said)[-3000:]
    return p.stdout.read()

@pytest.mark.isa_neutral
def test_a_second_process_waits_for_a_build_in_progress(cache_copy):
    """A process that finds the cached library linked but not sealed while another builds it waits for that build,
    saying so, and loads what it built: it took the library for a killed build's and deleted the build in progress"""
    level, lib = cache_copy
    out = _waits_for_the_build(level, "from clfast import cpu_kernels as c; c._build = None; print(c.load())")
    assert out.split()[-1] == str(lib), out

@pytest.mark.isa_neutral
def test_clfast_build_says_what_its_build_says_as_it_says_it(cache_copy):
    """`clfast build` passes on what its level's build process says, as it says it: here that it waits for another
    process's build (it showed that process's output only after a failure: a silent wait)"""
    level, lib = cache_copy
    _waits_for_the_build(level, f"from clfast import cpu_kernels as c; c.build([{level!r}])")
    assert cpu_kernels._ready(level)

@pytest.mark.isa_neutral
def test_a_source_newer_than_the_cached_library_is_found(tmp_path, monkeypatch):
    """A source written after the cached library (a reinstall, a checkout) is found, so that `load` says it compiles
    again, as ninja will then (it said nothing: 100 s of silence at a fused layer's first call)"""
    lib = tmp_path/'clfast_bn_act_generic_x.so'
    monkeypatch.setattr(cpu_kernels, '_cached_library', lambda level=None: lib)
    newest = max(s.stat().st_mtime_ns for s in cpu_kernels.CSRC.glob('*.[ch]*'))
    lib.write_bytes(b'')
    os.utime(lib, ns=(newest, newest + 1))
    assert not cpu_kernels._older_than_sources('generic')
    os.utime(lib, ns=(newest, newest - 1))
    assert cpu_kernels._older_than_sources('generic')

@pytest.mark.isa_neutral
def test_each_build_environment_has_its_own_cached_library(tmp_path):
    """Two environments over one install (another compiler; a venv reached through a link, whose torch headers ninja's
    build file names by that path) build into caches of their own: sharing one, each compiled the other's library
    again at every switch"""
    code = "from clfast.cpu_kernels import ext_name; print(ext_name())"
    name = lambda python, **env: subprocess.run([python, '-c', code], env=_env(**env), capture_output=True, text=True,
                                                timeout=300).stdout.split()[-1]
    here = name(sys.executable)
    assert here == cpu_kernels.ext_name()
    assert name(sys.executable, CXX=str(tmp_path/'another-c++')) != here   # (a name: nothing is compiled)
    if sys.prefix == sys.base_prefix: return   # not a venv: no link to reach it through
    (tmp_path/'env').symlink_to(sys.prefix)
    linked = tmp_path/'env'/Path(sys.executable).relative_to(sys.prefix)
    assert name(str(linked)) != here

def test_build_refuses_levels_above_this_cpu():
    with pytest.raises(ValueError, match='this CPU runs levels'): cpu_kernels.build(['avx1024'])

def test_a_cached_library_loads_only_as_built(tmp_path, monkeypatch):
    """The cache's library is loaded only when it is what its build sealed: a truncated one kills the loading process
    (SIGBUS, measured), so `load` rebuilds it instead (seen end to end: 'not as built ... rebuilding', then the layer ran)"""
    lib = tmp_path/'clfast_bn_act_generic_x.so'
    monkeypatch.setattr(cpu_kernels, '_cached_library', lambda level=None: lib)
    lib.write_bytes(b'\x7fELF' + bytes(5000))
    assert not cpu_kernels._sealed('generic')               # never sealed: a build that did not finish
    cpu_kernels._seal('generic')
    assert cpu_kernels._sealed('generic')
    lib.write_bytes(lib.read_bytes()[:1000])                 # truncated since
    assert not cpu_kernels._sealed('generic')

def test_another_kernel_set_is_never_timed(tmp_path, monkeypatch):
    """Under another kernel set (`kernels_from`, `CLFAST_KERNELS`: a way to test a code path) the default per-layer way
    runs clfast's op and times nothing: a timing of the reference or interpreted kernels would be cached as this
    machine's choice, and a test of that path would run the stock layer instead"""
    from clfast import fused
    from clfast.fused import FusedConvBN2d
    if not ops.kernels_ready() or ops._loaded['cpu']: pytest.skip(f"no C++ library: {ops._loaded['cpu']}")
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
    before = fused.set_layer_way('timed')
    try:
        f, x = FusedConvBN2d(3, 4, 3, padding=1), torch.randn(2, 3, 6, 6).requires_grad_()
        with ops.kernels_from('ref'):
            assert ops.kernels_served('cpu')
            out = f(x)
        assert out.grad_fn.name() == 'torch::autograd::CppNode<clfast::ConvBnAct>'   # clfast's op, not the stock layer
        assert fused.layer_ways() == {} and not ops.kernels_served('cpu')
    finally: fused.set_layer_way(before)
