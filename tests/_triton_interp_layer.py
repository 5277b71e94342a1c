"""The CUDA code path, end to end, on the CPU: the fused layer and whole fused models with `CLFAST_KERNELS=triton`
under `TRITON_INTERPRET=1`, i.e. the op of `clfast.ops` dispatching to the Triton backend exactly as it does on CUDA.

Not collected on its own (leading underscore): `test_ops.py::test_triton_interpreted_layer` runs it in a fresh process
with both variables set (they must be set before the kernels are defined)."""
import os
assert os.environ.get('TRITON_INTERPRET') == '1' and os.environ.get('CLFAST_KERNELS') == 'triton', \
    "run with TRITON_INTERPRET=1 CLFAST_KERNELS=triton (see test_ops.py)"
import contextlib, copy, pytest, torch
from pathlib import Path
from torch import nn
from clfast import ops, triton_kernels
from clfast.act import ACTS
from clfast.fuse import fuse_conv_bn, fusion_report
from test_fused import pair, compare, act_param

pytestmark = pytest.mark.usefixtures('fused_way')   # the Triton path of clfast's op, and its launches: 'timed' could run the stock way

def test_cpu_kernels_are_tritons():
    "The CPU's kernel ops run the Triton kernels (CLFAST_KERNELS=triton), and the layer really reaches them"
    assert ops.kernels_ready()
    # the layer op: its Python twin calling the Triton kernels as functions, as on CUDA, whether the C++ library loaded
    # or not (an install without it, no compiler: test_ops.py)
    op = ops._layer_op(torch.empty(1))
    assert op.func is ops._conv_bn_act and op.keywords == {'direct': True}
    if os.environ.get('CLFAST_TEST_LAYER_OP') == 'none':
        assert 'no C++ compiler' in ops._loaded['cpu']
        assert not list(Path(ops.__file__).parent.glob('*.so'))   # the copy, with no library
    else: assert ops._loaded['cpu'] is None
    cpu = next(l for l in torch._C._dispatch_dump('clfast::layer_fwd').splitlines() if l.startswith('CPU:'))
    assert 'clfast/ops.py' in cpu, cpu
    calls = []
    real = triton_kernels.bn_act_fwd   # the forward's kernels past the conv, whichever node holds the conv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_kernels, 'bn_act_fwd', lambda *a, **k: calls.append(1) or real(*a, **k))
        ops.fused_conv_bn(torch.randn(2, 3, 4, 4), torch.randn(5, 3, 1, 1), None, None, None, None, None, None, True, 0.1, 1e-5)
    assert calls == [1]

@pytest.mark.parametrize('act', list(ACTS))
@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_layer(act, mode):
    "Every activation, with and without a residual, both modes: forward, backward, running stats vs fp64 stock"
    torch.manual_seed(0)
    for res in (True, False):
        f, conv, bn = pair(5, 6, act=act, mode=mode)
        x = torch.randn(2, 5, 6, 6).to(memory_format=torch.channels_last)
        compare(f, conv, bn, x, torch.randn(2, 6, 6, 6) if res else None, act)

def _train_step_matches(make, x, mode='speed', **tol):
    """A training step of the fused model (in `mode`; 'memory' as a fit runs it, inside `recomputed_outputs()`) equals
    the stock one: outputs, every gradient, running stats. In fp64: a random-init network in training mode amplifies
    rounding (late BNs normalise a handful of values), so fp32 against fp32 would compare two roundings; fp64 compares
    the computations."""
    from clfast.recompute import recomputed_outputs
    torch.manual_seed(0)
    stock = make().double()
    fused = fuse_conv_bn(copy.deepcopy(stock), mode)
    assert fusion_report(fused).fused, "nothing fused"
    for m in (stock, fused): m.train()
    outs, grads = [], []
    for m in (stock, fused):
        m.zero_grad()
        with recomputed_outputs() if m is fused and mode == 'memory' else contextlib.nullcontext(): out = m(x)
        out.square().mean().backward()
        outs.append(out.detach()); grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-9)
    # gradients by relative norm: a max-pool window with two maxima equal to the last bits routes its gradient to
    # either one, a rounding-level difference that moves whole gradient entries (seen on resnet18's stem, fp64)
    # a gradient that cancels to ~0 (a BN bias whose every path runs through another batch-statistics BN) is compared
    # at the scale of the largest gradient
    floor = 1e-6 * max(g.norm() for g in grads[0].values())
    for n in grads[0]:
        err = (grads[1][n] - grads[0][n]).norm() / grads[0][n].norm().clamp_min(floor)
        assert err < tol['rtol'], f"{n}: gradient differs by {err:.2e} of its norm"
    sa, sb = stock.state_dict(), fused.state_dict()
    assert list(sa) == list(sb)
    for k in sa: torch.testing.assert_close(sb[k], sa[k], rtol=1e-9, atol=1e-9, msg=k)

def test_resnet_step():
    import torchvision
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).to(memory_format=torch.channels_last)
    _train_step_matches(lambda: torchvision.models.resnet18(num_classes=4).to(memory_format=torch.channels_last), x,
                        rtol=1e-5)

def test_efficientnet_step():
    "tinynet_e: timm's EfficientNet (DepthwiseSeparable and InvertedResidual blocks, SE, SiLU) at a size the interpreter runs quickly"
    import timm
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).to(memory_format=torch.channels_last)
    _train_step_matches(lambda: timm.create_model('tinynet_e', num_classes=4).to(memory_format=torch.channels_last),
                        x, rtol=1e-5)

@pytest.mark.usefixtures('recipe_way')   # the recipes' path itself ('timed' may pick the old way at this size)
def test_memory_resnet_step_recomputes_each_recipe_once():
    """resnet18 in 'memory' as a fit runs it against stock in fp64. A basic block's second layer has a residual: it
    recomputes its conv, and on CUDA's eager path its conv node and its BN node both save its input, the first layer's
    output, as the one recipe: recomputed once in backward (`layer_out`), not once for each"""
    import torchvision
    from clfast import recompute
    packed, calls = {}, []
    real_recipe, real_out = recompute._recipe, triton_kernels.layer_out
    def recipe(t):
        r = real_recipe(t)
        if r is not None: packed[id(r)] = r
        return r
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).to(memory_format=torch.channels_last)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, '_recipe', recipe)
        mp.setattr(triton_kernels, 'layer_out', lambda *a: calls.append(1) or real_out(*a))
        _train_step_matches(lambda: torchvision.models.resnet18(num_classes=4).to(memory_format=torch.channels_last), x,
                            'memory', rtol=1e-5)
    # the stem's output (saved by the max pool) and each block's first layer's, twice each
    assert sum(r.packs == 2 for r in packed.values()) == 8 and len(packed) == 9
    assert len(calls) == len(packed) and all(r.kept is None for r in packed.values())

def _memory_pair():
    "A remembering 'memory' layer (no residual) and a conv-recomputing one after it (a residual), channels-last"
    from clfast.fused import FusedConvBN2d
    torch.manual_seed(0)
    a = FusedConvBN2d(4, 6, 3, padding=1, act='relu', mode='memory').to(memory_format=torch.channels_last)
    b = FusedConvBN2d(6, 6, 3, padding=1, act='relu', mode='memory').to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    r = torch.randn(2, 6, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    return a, b, x, r

def test_memory_step_saves_each_tensor_once_under_copying_hooks():
    """Under a saved-tensor hooks pair that copies what it saves (`save_on_cpu`, FSDP's offload), a 'memory' layer that
    recomputes its conv saves x and its weight once: autograd's conv node and clfast's node each saving them, as where
    saves are kept as they are, would copy them twice (twice the pinned memory and the copies on CUDA)"""
    a, b, x, r = _memory_pair()
    saved = []
    def pack(t):
        if t.numel(): saved.append(t.untyped_storage().data_ptr())   # (not the empty placeholders: no storage)
        return t.clone()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = b(a(x), r)
    out.square().sum().backward()
    assert len(saved) == len(set(saved)), saved
    assert x.grad is not None and b.weight.grad is not None

@pytest.mark.usefixtures('recipe_way')
def test_a_convless_layer_takes_its_inputs_recipe():
    """A conv-less fused layer (the precise BN) on a remembering layer's output saves it as the recipe, step after step
    (set aside from the hooks as a conv's output would be, it was saved whole and the layer stopped remembering)"""
    from clfast.bn import PreciseBatchNorm2d
    from clfast.recompute import recomputed_outputs, remembers
    from clfast import recompute
    a, _, x, _ = _memory_pair()
    bn = PreciseBatchNorm2d(6)
    for _ in range(2):
        packed = []
        real = recompute._recipe
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(recompute, '_recipe', lambda t: (lambda r: packed.append(r) or r)(real(t)))
            with recomputed_outputs(): out = bn(a(x))
        out.square().sum().backward()
        assert sum(p is not None for p in packed) == 1 and remembers(a)

@pytest.mark.usefixtures('recipe_way')
def test_a_kept_recipe_goes_with_its_backward():
    """A recipe saved by two nodes is recomputed once and kept for the second: not past the backward that recomputed
    it, also one that reached only some nodes (`inputs=`), nor where a node's saved tensor is read outside a backward"""
    from clfast.recompute import recomputed_outputs
    from clfast import recompute
    a, b, x, r = _memory_pair()
    packed = {}
    real = recompute._recipe
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, '_recipe', lambda t: (lambda r: r is not None and packed.setdefault(id(r), r) or r)(real(t)))
        with recomputed_outputs(): out = b(a(x), r)
    (recipe,) = packed.values()
    assert recipe.packs == 2
    assert out.grad_fn.saved_tensors[0].shape == (2, 6, 6, 6) and recipe.kept is None   # read outside a backward
    out.square().sum().backward(inputs=[b.bn.weight], retain_graph=True)   # b's BN node alone: one unpack of two
    assert recipe.kept is None
    out.square().sum().backward()
    assert recipe.kept is None and x.grad is not None

@pytest.mark.usefixtures('recipe_way')   # the recipes' path itself ('timed' may pick the old way at this size)
def test_memory_recipes_step():
    """'memory' inside `recomputed_outputs()` (`clfast.recompute`): each recipe recomputes its layer's output by the
    forward's apply pass over its params (`triton_kernels.layer_out`), and the step's gradients and statistics are the
    conv recompute's, bit for bit, with fewer convs in backward (tinynet_e: SE products, depthwise convs, residuals)"""
    import timm
    from test_recompute import train_steps
    model = timm.create_model('tinynet_e', num_classes=4).to(memory_format=torch.channels_last)
    fuse_conv_bn(model, 'memory')
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    old = train_steps(copy.deepcopy(model), x, recipes=False, steps=1)
    calls, real = [], triton_kernels.layer_out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_kernels, 'layer_out', lambda *a: calls.append(1) or real(*a))
        new = train_steps(copy.deepcopy(model), x, recipes=True, steps=1)
    assert calls
    for what in ('grads', 'buffers'): assert all(torch.equal(a, b) for a, b in zip(old[what], new[what])), what
    assert new['convs'] < old['convs']

@pytest.mark.parametrize('mode', ['speed', 'memory'])
@pytest.mark.parametrize('act,res', [('relu', True), ('silu', False), ('none', False)])
def test_launches_are_the_traffic_models(act, res, mode):
    """The passes `clfast.gpu_report` counts in its traffic model (and compiles) are those a real step launches: an
    interpreted fused layer's training step, launch counter on, launches the kernels, flags and order of the dry run"""
    from clfast import gpu_report
    torch.manual_seed(0)
    f, _, _ = pair(8, 64, act=act, mode=mode)
    x = torch.randn(2, 8, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    r = torch.randn(2, 64, 8, 8).to(memory_format=torch.channels_last).requires_grad_() if res else None
    with gpu_report.recording(phase='forward') as fwd: out = f(x, r)
    with gpu_report.recording(phase='backward') as bwd: out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    dry = gpu_report.layer_step(torch.float32, act, residual=res, mode=mode, grads=(True, True, res))
    assert [(l.phase, l.name, l.flags) for l in fwd + bwd] == [(l.phase, l.name, l.flags) for l in dry]
    streams = [l.name for l in fwd + bwd if l.name in ('_stats', '_fwd', '_bwd_sums', '_bwd_dx')]
    assert streams == ['_stats', '_fwd', '_bwd_sums', '_bwd_dx']   # 2 passes forward, 2 backward

@pytest.mark.parametrize('momentum', [0.1, None])
@pytest.mark.parametrize('stats,nbt', [(True, True), (True, False), (False, True)])
def test_direct_step_is_the_ops(momentum, stats, nbt):
    """CUDA's eager layer step (the Triton kernels called as functions, the running statistics updated in the statistics
    pass; 'speed' and the conv-less layer with autograd's own conv node) gives the kernel ops' step (what
    torch.compile traces: `update_running` a launch of its own) bit for bit: output, every gradient, running statistics
    and count; a launch fewer, except for a cumulative average (momentum None)"""
    from clfast import gpu_report
    from test_ops import _layer_step
    assert ops.kernels_ready()   # the kernel ops' CPU key served by the Triton kernels (CLFAST_KERNELS), whichever test ran first
    def step(op, training=True, res=True, act='relu', keep_y=True, conv=True):
        with gpu_report.recording() as launches:
            got = _layer_step(op, torch.float32, training, res, act, keep_y, conv, momentum, stats, nbt)
        return got, [l.name for l in launches]
    # 'speed', 'memory' recomputing its conv and the conv-less layer (autograd's conv node, `_BnActStep`), in training
    # and eval, an activation whose derivative is read from the output or recomputed, or none
    # (a 'memory' layer remembering its output: `test_direct_remembering_step_is_the_ops`)
    for case in [(True, True, 'relu', True, True), (False, True, 'silu', True, True), (True, False, 'none', True, True),
                 (True, True, 'relu', False, True), (False, False, 'silu', False, True), (True, True, 'silu', True, False)]:
        (want, ops_launches), (got, direct_launches) = step(ops._conv_bn_act, *case), step(ops._DIRECT, *case)
        for i, (a, b) in enumerate(zip(want, got)):
            assert (a is None) == (b is None), (case, i)
            if a is not None: assert a.stride() == b.stride() and torch.equal(a, b), (case, i)
    (want, ops_launches), (got, direct_launches) = step(ops._conv_bn_act), step(ops._DIRECT)
    assert ops_launches == ['_stats', '_fwd', '_running', '_bwd_sums', '_bwd_dx']
    assert direct_launches == (ops_launches if momentum is None else ['_stats', '_fwd', '_bwd_sums', '_bwd_dx'])

@pytest.mark.parametrize('dt', [torch.float32, torch.float64])
def test_direct_step_is_the_ops_in_any_layout(dt):
    """The direct 'speed' step gives the kernel ops' bit for bit whatever the input's and the weight's layouts (a conv
    of contiguous ones rounds otherwise than `_conv`'s of channels-last copies: autograd's conv node takes channels-last
    ones only), with gradients in the same layouts"""
    assert ops.kernels_ready()
    def step(direct, x_cl, w_cl):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(4, 16, 12, 12, generator=g, dtype=dt), torch.randn(32, 16, 3, 3, generator=g, dtype=dt)
        if x_cl: x = x.to(memory_format=torch.channels_last)
        if w_cl: w = w.to(memory_format=torch.channels_last)
        x.requires_grad_(); w.requires_grad_()
        bw, bb = (torch.rand(32, generator=g, dtype=dt).requires_grad_() for _ in range(2))
        acc = torch.float64 if dt == torch.float64 else torch.float32
        rm, rv, nbt = torch.zeros(32, dtype=acc), torch.ones(32, dtype=acc), torch.tensor(0)
        out = ops._conv_bn_act(x, w, None, bw, bb, None, rm, rv, nbt, True, 0.1, 1e-5, [1, 1], [1, 1], [1, 1], 1,
                               ACTS['silu'].code, 0., True, '', direct=direct)
        out.backward(torch.randn(out.shape, generator=g, dtype=dt))
        return [out, x.grad, w.grad, bw.grad, bb.grad, rm, rv]
    for x_cl, w_cl in ((True, True), (True, False), (False, True), (False, False)):
        for i, (a, b) in enumerate(zip(step(False, x_cl, w_cl), step(True, x_cl, w_cl))):
            assert a.stride() == b.stride() and torch.equal(a, b), (x_cl, w_cl, i)

def test_direct_remembering_step_is_the_ops():
    """A 'memory' layer remembering its output (`clfast.recompute`), CUDA's eager way (autograd's own conv node and
    `_BnActStep`), gives the kernel ops' step (`_LayerStep`) bit for bit: output, every gradient, running statistics;
    in both the output read by the next op is saved as the recipe, recomputed once in backward (`layer_out`)"""
    from clfast.recompute import recomputed_outputs
    assert ops.kernels_ready()
    def step(direct):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 4, 6, 6, generator=g).to(memory_format=torch.channels_last).requires_grad_()
        w = torch.randn(5, 4, 3, 3, generator=g).to(memory_format=torch.channels_last).requires_grad_()
        bw, bb = torch.rand(5, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()
        factor = torch.full((), 1.5, requires_grad=True)
        rm, rv, nbt, key = torch.zeros(5), torch.ones(5), torch.tensor(0), nn.Identity()
        calls, real = [], triton_kernels.layer_out
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(triton_kernels, 'layer_out', lambda *a: calls.append(1) or real(*a))
            with recomputed_outputs():
                out = ops._conv_bn_act(x, w, None, bw, bb, None, rm, rv, nbt, True, 0.1, 1e-5, [1, 1], [1, 1], [1, 1], 1,
                                       ACTS['silu'].code, 0., True, '', direct=direct, remember=key)
                prod = out * factor   # saves the output: the recipe
            assert type(out.grad_fn).__name__ == ('_BnActStepBackward' if direct else '_LayerStepBackward')
            prod.backward(torch.randn(out.shape, generator=g))
        assert calls == [1]   # (the kernel ops' `clfast::layer_out` is the same function, served by the Triton kernels)
        return [out, x.grad, w.grad, bw.grad, bb.grad, factor.grad, rm, rv, nbt]
    for i, (a, b) in enumerate(zip(step(False), step(True))):
        assert a.stride() == b.stride() and torch.equal(a, b), i

def test_direct_step_computes_in_the_inputs_dtype_under_autocast():
    """`fused_conv_bn` under autocast computes in its inputs' dtypes, as the kernel ops do (the fused modules cast
    first): the direct step's output and gradients are the step's without autocast, bit for bit (its conv, autograd's
    own node, ran in bf16 under it)"""
    from clfast.reference import ConvGeometry
    def step(amp:bool):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 4, 6, 6, generator=g).to(memory_format=torch.channels_last).requires_grad_()
        w = torch.randn(5, 4, 3, 3, generator=g).to(memory_format=torch.channels_last).requires_grad_()
        bw, bb = torch.rand(5, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()
        with torch.autocast('cpu', torch.bfloat16, enabled=amp):
            out = ops.fused_conv_bn(x, w, None, bw, bb, torch.zeros(5), torch.ones(5), None, True, 0.1, 1e-5,
                                    ConvGeometry(padding=(1, 1)), act='relu')
        out.backward(torch.randn(out.shape, generator=g).to(memory_format=torch.channels_last))
        return out, x.grad, w.grad, bw.grad, bb.grad
    for a, b in zip(step(False), step(True)): assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)

def test_compiled_launches_keep_tritons_way_when_nothing_is_compiled():
    """The interpreter compiles nothing: launched the 'compiled' way, every kernel is keyed to Triton's own launch, and
    the step's results are the same bit for bit (the compiled kernels themselves: `test_ops`' CUDA test)"""
    from test_ops import _layer_step
    triton_kernels._COMPILED.clear()
    step = lambda: _layer_step(ops._DIRECT, torch.float32, True, True, 'silu', True, True, 0.1, True)
    want = step()
    with triton_kernels.launching('compiled'): got = step()
    for i, (a, b) in enumerate(zip(want, got)): assert (a is None and b is None) or torch.equal(a, b), i
    assert len(triton_kernels._COMPILED) == 4 and all(v is None for v in triton_kernels._COMPILED.values())
    with pytest.raises(ValueError, match="way must be one of"):
        with triton_kernels.launching('fast'): pass

@pytest.mark.parametrize('act', ['none', 'silu'])
def test_layer_without_conv(act):
    "The conv-less layer (clfast.bn's precise BatchNorm, timm's BatchNormAct2d with its activation) on the Triton "
    "backend: output, input and BN gradients, running statistics against stock fp64"
    import timm.layers
    from clfast.bn import make_precise
    torch.manual_seed(0)
    bn = timm.layers.BatchNormAct2d(6, act_layer=nn.SiLU) if act == 'silu' else nn.BatchNorm2d(6)
    with torch.no_grad(): bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-0.5, 0.5)
    ref = copy.deepcopy(bn).double()
    bn = make_precise(bn)
    x = (torch.randn(2, 6, 5, 5) * 2 + 1).to(memory_format=torch.channels_last).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    dy = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    out, out64 = bn(x), ref(x64)
    out.backward(dy.float().contiguous(memory_format=torch.channels_last)); out64.backward(dy)
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()
    for a, b in ((out, out64), (x.grad, x64.grad), (bn.weight.grad, ref.weight.grad), (bn.bias.grad, ref.bias.grad),
                 (bn.running_mean, ref.running_mean), (bn.running_var, ref.running_var)):
        assert rel(a, b) < 1e-4

@pytest.mark.parametrize('act', ['none', 'relu', 'silu'])
def test_double_backward_direct(act):
    """Backward under `create_graph=True` through the nodes CUDA's eager step runs (`_BnActStep` past autograd's conv:
    `y` kept, the conv recomputed, no conv; `_LayerStep` on a contiguous weight): the stock composition's second
    derivatives, fp64, to 1e-9"""
    import itertools
    from helpers import second_order, stock_layer, op_layer
    cl = lambda t: t if t is None else t.contiguous(memory_format=torch.channels_last)
    for training, res, keep_y, conv, cl_weight in itertools.product([True, False], repeat=5):
        if cl_weight and not conv: continue
        layer = op_layer(ops._DIRECT, training, act, 0., keep_y)
        want = second_order(stock_layer(training, act, 0.), res, conv)
        got = second_order(lambda x, w, *rest: layer(x, cl(w) if cl_weight else w, *rest), res, conv)
        for i, (a, e) in enumerate(zip(got, want)):
            err = ((a - e).abs().max() / e.abs().max().clamp_min(1e-12)).item()
            assert err < 1e-9, (act, training, res, keep_y, conv, cl_weight, i, err)

def test_opcheck_half_precision_backward():
    """The Triton kernels' backward, bf16, passes opcheck with results not needed (empty): in x's dtype, the BN
    parameters' gradients in params', as the fake states (they were x's dtype for all, the fake fp32 for all)"""
    from test_ops import _op_args
    x, w, b, bw, bb, r, mean, var, *geom, eps, act, p, keep_y = _op_args()
    x, w, b, r = (t.to(torch.bfloat16) for t in (x, w, b, r))
    out, y, params = torch.ops.clfast.layer_fwd(x, w, b, bw, bb, r, mean, var, *geom, eps, act, p, keep_y)
    for needs in [(True,) * 6, (True, False, False, True, True, False), (False, True, True, False, False, True)]:
        args = (torch.randn_like(out), x, w, b, y, params, r, torch.empty(0), *geom, True, act, p, list(needs))
        torch.library.opcheck(torch.ops.clfast.layer_bwd.default, args, test_utils=('test_schema', 'test_faketensor'))
