"""clfast.recompute: inside `recomputed_outputs()` the outputs of fused 'memory' layers without a residual are saved as
recipes and recomputed element-wise in backward: the same gradients bit for bit as the conv recomputed (the old way),
at its memory, with fewer convs in backward; the old way outside the block and under a checkpoint"""
import contextlib, copy, random
import pytest, timm, torch
from clfast import fused, recompute, timing
from torch import nn
from torch.profiler import profile, ProfilerActivity
from torch.utils.checkpoint import checkpoint
import clfast.callback   # noqa: F401  (Learner.to_channelslast is clfast's)
from clfast.fuse import fuse_conv_bn
from clfast.fused import FusedConvBN2d, recomputes
from clfast.recompute import recomputed_outputs, recomputing
from clfast.finder import _saved_bytes as saved_bytes   # the finder's count of saved storages: (params, store)
from helpers import tiny_learner

def train_steps(model, x, recipes:bool, dtype=None, steps:int=2) -> dict:
    """`steps` training forwards and backwards of `model` on `x` (no optimizer: the same weights), under autocast to
    `dtype` where given, the forward inside `recomputed_outputs()` where `recipes`; the last step's gradients, the
    buffers, its saved bytes and the convs that its backward ran (a 'memory' layer recomputing its conv runs one)"""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for _ in range(steps):
        model.zero_grad()
        store = {}
        with saved_bytes(params, store), torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            if recipes:
                with recomputed_outputs(): out = model(x)
            else: out = model(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof: out.float().square().mean().backward()
    return dict(grads=[p.grad for p in model.parameters()], buffers=[b.clone() for b in model.buffers()],
                saved=sum(store.values()), convs=sum(e.name == 'aten::convolution' for e in prof.events()))

@pytest.mark.parametrize('hooks', ['finder', 'timings'])
def test_a_forward_never_backpropagated_is_freed_under_clfasts_saved_tensor_hooks(hooks):
    """The format finder's count of saved memory, and the hooks probes and timings run under inside a step, kept each
    saved tensor itself: an op that saves its own output (exp, ReLU) then held itself through its graph, a cycle
    Python's collector cannot see, and a forward that raised before its backward (a setup failing in the finder: a model
    that `.view`s its channels-last activation) was never freed, about 100 MB a failed setup there"""
    import gc
    from torch.multiprocessing.reductions import StorageWeakRef
    x = torch.randn(1000, requires_grad=True)
    with contextlib.ExitStack() as stack:
        if hooks == 'finder': stack.enter_context(saved_bytes(set(), {}))
        else:   # (`plain_saves` puts its pair over a caller's only: a checkpoint's, here one that keeps tensors as they are)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t))
            stack.enter_context(timing.plain_saves())
        y = x.exp()
    ref = StorageWeakRef(y.untyped_storage())
    del y; gc.collect()
    assert ref.expired()

@pytest.mark.usefixtures('recipe_way')
@pytest.mark.parametrize('bf16', [False, True])
@pytest.mark.parametrize('arch', ['resnet18', 'efficientnet_b0'])
def test_recipes_train_as_the_conv_recompute_bit_for_bit(arch, bf16):
    """Residual blocks, a downsample whose output only an addition reads, depthwise convs, squeeze-excitation products
    that save a layer's output: the recipes give the old way's gradients and statistics exactly, at its memory"""
    model = timm.create_model(arch, num_classes=4).to(memory_format=torch.channels_last)
    fuse_conv_bn(model, 'memory')
    assert recomputes(model)
    x = torch.randn(2, 3, 48, 48).to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if bf16 else None
    old = train_steps(copy.deepcopy(model), x, recipes=False, dtype=dtype)
    new = train_steps(copy.deepcopy(model), x, recipes=True, dtype=dtype)
    for what in ('grads', 'buffers'):
        assert all(torch.equal(a, b) for a, b in zip(old[what], new[what])), what
    fused = sum(isinstance(m, FusedConvBN2d) for m in model.modules())
    assert old['convs'] == fused, "the old way recomputes every fused layer's conv"
    # the others remembered (the fixture's way): their outputs' consumers recomputed them, element-wise
    assert new['convs'] < old['convs'], f"{new['convs']} of {fused} fused layers recomputed their conv"
    # the second step: a layer whose recipe nothing took (the downsample) went back to recomputing its conv
    assert new['saved'] <= 1.01 * old['saved'], (new['saved'], old['saved'])

@pytest.mark.usefixtures('recipe_way')
def test_a_model_trained_frozen_first_remembers_once_unfrozen():
    """Frozen, a layer's outputs require no gradient and nothing saves them (a frozen backbone; fastai's `freeze` with
    `train_bn=False`): their recipes, never taken, must not stop the layer remembering once it is unfrozen"""
    model = fuse_conv_bn(timm.create_model('resnet18', num_classes=4).to(memory_format=torch.channels_last), 'memory')
    x = torch.randn(2, 3, 48, 48).to(memory_format=torch.channels_last)
    body = [p for n, p in model.named_parameters() if not n.startswith('fc.')]
    for p in body: p.requires_grad_(False)
    frozen = train_steps(model, x, recipes=True)
    assert frozen['convs'] == 0, "frozen, no fused layer's backward runs"
    for p in body: p.requires_grad_(True)
    old = train_steps(copy.deepcopy(model), x, recipes=False)
    new = train_steps(model, x, recipes=True)
    for what in ('grads', 'buffers'):
        assert all(torch.equal(a, b) for a, b in zip(old[what], new[what])), what
    fused = sum(isinstance(m, FusedConvBN2d) for m in model.modules())
    # resnet18's 3 downsamples (whose output only an addition reads) and 8 layers with a residual recompute their conv
    assert old['convs'] == fused and new['convs'] == 11 < fused, (new['convs'], fused)
    assert new['saved'] <= 1.01 * old['saved'], (new['saved'], old['saved'])

@pytest.mark.cuda
@pytest.mark.usefixtures('recipe_way')
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_recipes_on_cuda_bit_for_bit(dtype, monkeypatch):
    """On CUDA (Triton's kernels called directly, their apply pass recomputing): the old way's gradients, bit for bit.
    cuDNN's deterministic algorithms: some of its weight-gradient ones sum with atomics, whose order differs run to run"""
    monkeypatch.setattr(torch.backends.cudnn, 'deterministic', True)
    model = fuse_conv_bn(timm.create_model('resnet18', num_classes=4).cuda().to(memory_format=torch.channels_last), 'memory')
    x = torch.randn(4, 3, 64, 64, device='cuda').to(memory_format=torch.channels_last)
    old = train_steps(copy.deepcopy(model), x, recipes=False, dtype=dtype)
    new = train_steps(copy.deepcopy(model), x, recipes=True, dtype=dtype)
    for what in ('grads', 'buffers'):
        assert all(torch.equal(a, b) for a, b in zip(old[what], new[what])), what
    assert new['convs'] < old['convs'] and new['saved'] <= 1.01 * old['saved']

@pytest.mark.usefixtures('recipe_way')
def test_recipes_against_fp64():
    "A chain of 'memory' layers and a product that saves a layer's output, trained in fp32 with recipes, against fp64"
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(6, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.SiLU(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8))
    with torch.no_grad():
        for m in stock:
            if isinstance(m, nn.BatchNorm2d): m.weight.uniform_(0.5, 1.5); m.bias.uniform_(-0.5, 0.5)
    oracle, model = copy.deepcopy(stock).double(), fuse_conv_bn(copy.deepcopy(stock), 'memory')
    assert sum(isinstance(m, FusedConvBN2d) for m in model.modules()) == 3
    x = torch.randn(4, 6, 10, 10)
    g = torch.randn(4, 8, 10, 10)
    def step(m, x, recipes):
        with recomputed_outputs() if recipes else torch.enable_grad():
            h = m[:3](x)
            out = m[3:](h * h.sum((2, 3), keepdim=True).sigmoid())   # a squeeze-excitation-like product saves h
        (out * g.to(out.dtype)).sum().backward()
        return [p.grad for p in m.parameters()] + list(m.buffers())
    got = step(model, x.to(memory_format=torch.channels_last), recipes=True)
    want = step(oracle, x.double(), recipes=False)
    for a, b in zip(got, want):
        if not b.is_floating_point():   # num_batches_tracked
            assert torch.equal(a, b)
            continue
        err = ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, err

@pytest.mark.usefixtures('recipe_way')
def test_old_way_outside_the_block_and_under_a_checkpoint():
    """Outside `recomputed_outputs()` a 'memory' layer keeps its input alone; a non-reentrant checkpoint's block inside
    it saves and recomputes as without (its recomputation must save what its forward saved), and trains the same"""
    layer = FusedConvBN2d(8, 8, 3, padding=1, mode='memory').to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last).requires_grad_()
    def saved(recipes):
        store = {}
        with saved_bytes({p.untyped_storage().data_ptr() for p in layer.parameters()}, store):
            with recomputed_outputs() if recipes else torch.enable_grad(): layer(x)
        return sum(store.values())
    assert saved(False) < saved(True)   # y kept inside the block: a later layer's save takes the recipe
    grads = []
    for recipes in (False, True):
        layer.zero_grad()
        with recomputed_outputs() if recipes else torch.enable_grad():
            out = checkpoint(lambda t: layer(layer(t)), x, use_reentrant=False)
            assert recomputing() == recipes
        out.sum().backward()
        grads.append(layer.weight.grad.clone())
    assert torch.equal(*grads)

@pytest.mark.usefixtures('recipe_way')
@pytest.mark.parametrize('hooks', ['checkpoint', 'save_on_cpu'])
def test_the_block_inside_other_hooks_saves_through_them(hooks):
    """Inside hooks that do more than observe, the block does nothing and 'memory' layers save as those hooks say: a
    non-reentrant checkpoint whose function enters the block (its recomputation must save what its forward saved, and
    a recipe's `y` would outlive the checkpoint's forward), `save_on_cpu` (a recipe's `y` would stay on the GPU):
    nothing remembered, the old way's gradients and statistics bit for bit"""
    torch.manual_seed(0)
    a, b = (FusedConvBN2d(c, 8, 3, padding=1, mode='memory').to(memory_format=torch.channels_last) for c in (4, 8))
    x = torch.randn(2, 4, 12, 12).to(memory_format=torch.channels_last)
    def block(t, layers, recipes):
        with recomputed_outputs() if recipes else torch.enable_grad():
            assert not recomputing()
            h = layers[1](layers[0](t))
            return h * h   # saves b's output, as b saves a's
    def step(recipes):
        layers = copy.deepcopy((a, b))
        t = x.clone().requires_grad_()
        if hooks == 'checkpoint': out = checkpoint(block, t, layers, recipes, use_reentrant=False)
        else:
            with torch.autograd.graph.save_on_cpu(): out = block(t, layers, recipes)
        out.sum().backward()
        assert all(m not in recompute._layers for m in layers), "a layer remembered"
        return [t.grad, *(p.grad for m in layers for p in m.parameters()), *(s for m in layers for s in m.buffers())]
    old, new = step(False), step(True)
    assert all(torch.equal(u, v) for u, v in zip(old, new))

@pytest.mark.usefixtures('recipe_way')
def test_a_layer_whose_output_is_saved_through_a_view_stops_remembering():
    """A global-context block's matrix product saves a view of a layer's output, which keeps the output's storage: the
    `y` its recipes keep would be memory the old way does not spend. From the second step it recomputes its conv again,
    at the old way's memory, its gradients bit for bit"""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.attn = FusedConvBN2d(8, 16, 3, padding=1, mode='memory'), nn.Conv2d(16, 1, 1)
        def forward(self, x):
            h = self.a(x); n, c, hh, ww = h.shape
            w = self.attn(h).reshape(n, 1, hh * ww).softmax(-1).unsqueeze(3)   # the 1x1 conv saves h: a recipe
            ctx = h.reshape(n, c, hh * ww).unsqueeze(1) @ w                     # the product saves a view of h
            return h * ctx.view(n, c, 1, 1).sigmoid()
    model = Block().to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last)
    old = train_steps(copy.deepcopy(model), x, recipes=False)
    new_model = copy.deepcopy(model)
    new = train_steps(new_model, x, recipes=True)
    assert not recompute.remembers(new_model.a)
    assert new['saved'] <= old['saved'], (new['saved'], old['saved'])
    for what in ('grads', 'buffers'):
        assert all(torch.equal(u, v) for u, v in zip(old[what], new[what])), what

def test_timing_a_recipe_saves_nothing_of_the_step(tmp_path, monkeypatch):
    """'timed' (the default) times a layer's recipe against its old way on copies, in the first step that meets its
    shape: what the copies save is not the step's (a count of the step's memory, as the format finder's, reads the
    same then as in the next step)"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {}); monkeypatch.setattr(fused, '_recipe_ways', {})
    layer = FusedConvBN2d(8, 8, 3, padding=1, mode='memory').to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = []
    for _ in range(2):
        store = {}
        with saved_bytes(params, store), recomputed_outputs():
            h = layer(x)
            out = h * h
        out.sum().backward()
        saved.append(sum(store.values()))
    assert len(timing.timings('recipe:')) == 1 and saved[0] == saved[1], saved

@pytest.mark.usefixtures('recipe_way')
def test_in_place_changes():
    """A tensor saved as it is and changed in place before backward raises as autograd does; a remembered output
    changed in place after its save is recomputed as it was when saved (what its consumer's backward needs), and one
    changed before it is saved as it is"""
    x = torch.randn(5, requires_grad=True)
    with recomputed_outputs(): y = x.exp()
    with torch.no_grad(): y.mul_(2)
    with pytest.raises(RuntimeError, match='modified by an inplace operation'): y.sum().backward()
    torch.manual_seed(0)
    a = FusedConvBN2d(4, 4, 3, padding=1, mode='memory').to(memory_format=torch.channels_last)
    w = torch.randn(1, 4, 1, 1, requires_grad=True)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    grads = []
    for change in (None, 'after', 'before'):
        w.grad = None
        with recomputed_outputs():
            h = a(x)
            if change == 'before':
                with torch.no_grad(): h.add_(0)   # a new version: saved as it is
            p = h * w   # saves h (w's gradient is the sum of h)
        if change == 'after':
            with torch.no_grad(): h.add_(1)   # autograd would refuse; the recipe gives the saved values
        p.sum().backward()
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])

@pytest.mark.usefixtures('recipe_way', 'fused_way')
def test_a_recipe_lives_as_long_as_its_output():
    """A remembered output's recipe, and the `y` it holds, go when the output goes, without the cyclic collector (a
    forward never backpropagated, or a backward done, leaves no activation behind); a recipe is its output's alone
    (looked up by identity: a later tensor is not taken for a freed one)"""
    from torch.multiprocessing.reductions import StorageWeakRef
    torch.manual_seed(0)
    layer = FusedConvBN2d(4, 4, 3, padding=1, mode='memory').to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(1, 4, 1, 1, requires_grad=True)
    for backward in (False, True):
        with recomputed_outputs():
            h = layer(x)
            p = h * w   # saves h: its recipe
        key = id(h)
        r = recompute._recipes[key]
        assert r.out() is h
        y = StorageWeakRef(r.y.untyped_storage())
        if backward: p.sum().backward()
        del p, h, r
        assert y.expired() and key not in recompute._recipes   # (other tests' live outputs may keep theirs)
    t = torch.randn(3)
    recompute._recipes[id(t)] = recompute._Recipe(torch.randn(3), None, None, 0, 0., False, [0, 0, 0])   # a stale entry
    try: assert recompute._recipe(t) is None
    finally: del recompute._recipes[id(t)]

def test_not_reentrant_and_left_cleanly():
    ctx = recomputed_outputs()
    with ctx:
        with pytest.raises(RuntimeError, match='not reentrant'): ctx.__enter__()
        assert recomputing()
    assert not recomputing()
    with pytest.raises(ZeroDivisionError):
        with recomputed_outputs(): 1 / 0
    assert not recomputing()

def test_fit_enters_the_block_for_training_forwards_only():
    """`to_channelslast(fuse='memory')`: each training forward runs inside `recomputed_outputs()` (seen from the user's
    event functions, which run after ChannelsLast's own work), validation and what follows the forward outside it,
    also after a step that raised; and the fit trains as `fuse='speed'` run fused does, bit for bit"""
    seen = []
    def look(event): return lambda cb: seen.append((event, cb.training, recomputing()))
    learn = tiny_learner().to_channelslast(use_amp=False, fuse='memory')
    cl = learn.cbs.filter(lambda c: type(c).__name__ == 'ChannelsLast')[0]
    cl.user_events.update(before_batch=look('before_batch'), after_pred=look('after_pred'))
    learn.fit(1, 1e-2)
    assert ('before_batch', True, True) in seen and ('before_batch', False, False) in seen
    assert all(not inside for e, train, inside in seen if e == 'after_pred' or not train)
    assert not recomputing()

    class Boom(Exception): pass
    def boom(cb): raise Boom('raised in a training step')
    cl.user_events['before_batch'] = boom   # after ChannelsLast entered the block
    with pytest.raises(Boom, match='raised in a training step'): learn.fit(1)
    assert not recomputing()

    from clfast.fused import set_layer_way
    weights = []
    for fuse in ('memory', 'speed'):
        before = set_layer_way('fused')   # 'speed' fused in every layer, as 'memory' always is
        try:
            torch.manual_seed(0); random.seed(0)   # the same initial weights, the same shuffles
            learn = tiny_learner().to_channelslast(use_amp=False, fuse=fuse)
            learn.fit(1, 1e-2)
        finally: set_layer_way(before)
        weights.append([p.detach().clone() for p in learn.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))

def test_recipe_ways():
    """'timed' (the default) decides each layer shape once on this machine, between the recipe and the conv's recompute;
    'conv' is the old way everywhere; either trains the same bits"""
    from clfast.fused import set_recipe_way, _recipe_ways
    from clfast.timing import timings
    with pytest.raises(ValueError, match="one of \\('recipe', 'conv', 'timed'\\)"): set_recipe_way('fast')
    model = fuse_conv_bn(timm.create_model('resnet18', num_classes=4).to(memory_format=torch.channels_last), 'memory')
    x = torch.randn(2, 3, 40, 40).to(memory_format=torch.channels_last)   # shapes no other test decides
    before = set(_recipe_ways)
    timed = train_steps(copy.deepcopy(model), x, recipes=True)
    decided = {f"recipe:{k}" for k in set(_recipe_ways) - before}   # each layer shape's choice, in this machine's timings
    assert decided and decided <= set(timings('recipe:'))
    before = set_recipe_way('conv')
    try: old = train_steps(copy.deepcopy(model), x, recipes=True)
    finally: set_recipe_way(before)
    assert old['convs'] == sum(isinstance(m, FusedConvBN2d) for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(timed['grads'], old['grads']))
