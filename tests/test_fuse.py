"Model surgery on real torchvision / timm / fastai models: same state_dict, same parameters, same numbers, undo, fold"
import copy, io, pickle, warnings
import pytest, torch, timm, torchvision
from torch import nn
from fastai.vision.models.xresnet import xresnet18
from clfast.fused import FusedConvBN2d, PassThroughBN2d
from clfast.fuse import fuse_conv_bn, unfuse_conv_bn, is_fused, fold_conv_bn, fusion_report, FoldedConv2d
from clfast.guard import guard_model
from clfast.stock import AsStock, stock_copy

pytestmark = pytest.mark.usefixtures('fused_way')   # the surgery's fused layers checked as clfast's op ('timed' could run them the stock way)

MODELS = {
    'tv_resnet18': lambda: torchvision.models.resnet18(num_classes=10),
    'tv_resnet50': lambda: torchvision.models.resnet50(num_classes=10),
    'timm_resnet18': lambda: timm.create_model('resnet18', pretrained=False, num_classes=10),
    'timm_resnet50': lambda: timm.create_model('resnet50', pretrained=False, num_classes=10),
    'fastai_xresnet18': lambda: xresnet18(n_out=10),
}
# residual adds fused per model: resnet18 has 8 blocks, resnet50 16
ADDS = {'tv_resnet18': 8, 'tv_resnet50': 16, 'timm_resnet18': 8, 'timm_resnet50': 16, 'fastai_xresnet18': 8}

def randomize_bn(m):
    "Non-trivial BN parameters and running stats, so that a wrong fusion cannot hide behind identity BNs"
    with torch.no_grad():
        for b in m.modules():
            if isinstance(b, nn.BatchNorm2d):
                b.weight.uniform_(0.5, 1.5); b.bias.uniform_(-0.2, 0.2)
                b.running_mean.uniform_(-0.1, 0.1); b.running_var.uniform_(0.5, 2.)
    return m

def step(m, x):
    "One training forward + backward; returns the output and the gradients by parameter name"
    m.zero_grad()
    out = m(x)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

def assert_same_state(a, b, rtol=1e-4, atol=1e-5):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa: torch.testing.assert_close(sa[k], sb[k], rtol=rtol, atol=atol, msg=k)

@pytest.mark.parametrize('mode', ['speed', 'memory'])
@pytest.mark.parametrize('name', list(MODELS))
def test_surgery_matches_stock(name, mode):
    torch.manual_seed(0)
    ref = randomize_bn(MODELS[name]())
    m = copy.deepcopy(ref)
    params = list(m.parameters())
    keys = list(m.state_dict())
    fuse_conv_bn(m, mode)
    r = fusion_report(m)
    assert sum(p == 'conv-bn-add-relu' for _, p in r.fused) == ADDS[name], r
    assert is_fused(m) and all(a is b for a, b in zip(params, m.parameters())) and len(params) == len(list(m.parameters()))
    assert list(m.state_dict()) == keys
    # float64: in fp32 a single ReLU whose input rounds to the other side of 0 changes early gradients by ~1%
    m.double(); ref.double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64).to(memory_format=torch.channels_last)
    (o1, g1), (o2, g2) = step(m, x), step(ref, x)
    torch.testing.assert_close(o1, o2, rtol=1e-9, atol=1e-10)
    for k in g2: torch.testing.assert_close(g1[k], g2[k], rtol=1e-7, atol=1e-10, msg=k)
    assert_same_state(m, ref, 1e-9, 1e-10)  # running stats and num_batches_tracked updated alike
    m.float(); ref.float()
    x = x.float()
    torch.testing.assert_close(m(x), ref(x), rtol=1e-3, atol=1e-4)  # fp32 training forward
    m.eval(); ref.eval()
    with torch.no_grad(): torch.testing.assert_close(m(x), ref(x), rtol=1e-3, atol=1e-4)

@pytest.mark.parametrize('name', ['tv_resnet18', 'timm_resnet18'])
def test_state_dict_round_trip(name):
    "A checkpoint of either model loads into the other; unfuse gives back exactly the stock module types"
    torch.manual_seed(0)
    stock, fused = randomize_bn(MODELS[name]()), fuse_conv_bn(MODELS[name]())
    fused.load_state_dict(stock.state_dict())
    assert_same_state(fused, stock, 0, 0)
    randomize_bn(fused)
    stock.load_state_dict(fused.state_dict())
    assert_same_state(fused, stock, 0, 0)
    types = [type(a) for a in MODELS[name]().modules()]
    assert [type(a) for a in unfuse_conv_bn(fused).modules()] == types and not is_fused(fused)

def test_idempotent_and_mode_switch():
    m = MODELS['tv_resnet18']()
    fuse_conv_bn(m, 'speed'); n = len(fusion_report(m).fused)
    fuse_conv_bn(m, 'memory')
    assert all(c.mode == 'memory' for c in m.modules() if isinstance(c, FusedConvBN2d))
    r = fusion_report(m)
    assert len(r.fused) == 0 and is_fused(m) and n > 0
    # the second pass's report says what the first fused: 20 conv-BN chains (each BN), not "0 fused" alone
    assert r.earlier == r.n_bn == 20 and '0 fused (20 conv-BN chains fused by an earlier pass)' in repr(r).splitlines()[0]
    unfuse_conv_bn(m); unfuse_conv_bn(m)
    assert not is_fused(m)
    with pytest.raises(ValueError, match="'speed' or 'memory'"): fuse_conv_bn(m, 'fast')

def test_optimizer_keeps_working():
    "An optimizer made before fusing (with momentum state) steps the fused model identically to the stock one"
    torch.manual_seed(0)
    a = randomize_bn(MODELS['timm_resnet18']()).double(); b = copy.deepcopy(a)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    for i in range(2):
        if i == 1: fuse_conv_bn(a)
        for m, o in ((a, oa), (b, ob)): step(m, x); o.step()
    assert_same_state(a, b, 1e-7, 1e-9)

def test_pickles_as_stock():
    "torch.save of a fused model stores only stock classes (loads without clfast); deepcopy stays fused"
    m = fuse_conv_bn(MODELS['tv_resnet18']())
    data = pickle.dumps(m)
    assert b'clfast' not in data
    loaded = pickle.loads(data)
    assert not is_fused(loaded) and [type(a) for a in loaded.modules()] == [type(a) for a in MODELS['tv_resnet18']().modules()]
    assert_same_state(loaded, m, 0, 0)
    assert is_fused(copy.deepcopy(m))
    buf = io.BytesIO(); torch.save(m, buf); buf.seek(0)
    assert not is_fused(torch.load(buf, weights_only=False))

def test_report_and_skips():
    "Unfusable chains are reported with a reason; a shared ReLU is left alone; a Sequential chain fuses its ReLU"
    seq = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode='reflect'), nn.BatchNorm2d(8),
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.ReLU(), nn.BatchNorm2d(4))
    ref = copy.deepcopy(seq)
    fuse_conv_bn(seq)
    r = fusion_report(seq)
    assert r.fused == [('2', 'conv-bn-relu')]
    reasons = dict(r.skipped)
    assert 'padding' in reasons['0'] and '7' in reasons
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(seq(x), ref(x), rtol=1e-4, atol=1e-5)

class Untraceable(nn.Module):
    "Data-dependent control flow: torch.fx cannot trace it, its Sequential children still fuse"
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    def forward(self, x): return self.body(x) if x.sum() > -1e9 else x

def test_untraceable_falls_back_to_sequentials():
    m = Untraceable(); ref = copy.deepcopy(m)
    fuse_conv_bn(m)
    r = fusion_report(m)
    assert ('body.0', 'conv-bn-relu') in r.fused and any('trace' in why for _, why in r.skipped)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize('onednn', [True, False])
@pytest.mark.parametrize('name', ['tv_resnet50', 'timm_resnet18', 'fastai_xresnet18'])
def test_fold(name, onednn):
    torch.manual_seed(0)
    m = randomize_bn(MODELS[name]()).eval()
    with pytest.raises(RuntimeError, match=r'model.eval\(\)'): fold_conv_bn(copy.deepcopy(m).train())
    f = fold_conv_bn(m, onednn=onednn)
    assert not any(isinstance(c, nn.BatchNorm2d) for c in f.modules()) and not is_fused(f)
    assert any(isinstance(c, nn.BatchNorm2d) for c in m.modules())  # the original is untouched
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    with torch.no_grad(): torch.testing.assert_close(f(x), m(x), rtol=1e-3, atol=1e-4)
    loaded = pickle.loads(pickle.dumps(f))  # pickles as stock modules that compute the same
    assert not any(isinstance(c, FoldedConv2d) for c in loaded.modules())
    with torch.no_grad(): torch.testing.assert_close(loaded(x), m(x), rtol=1e-3, atol=1e-4)

def test_a_folded_model_traces_and_exports_as_stock_convs():
    """`torch.jit.trace` under no_grad (inference's way: it failed, a PyTorch internal assert over the reordered oneDNN
    weight) and `torch.export` of a folded model record stock convs, whose results are the folded weights' in fp64"""
    torch.manual_seed(0)
    f = fold_conv_bn(randomize_bn(MODELS['tv_resnet50']()).eval())
    assert any(c.onednn for c in f.modules() if isinstance(c, FoldedConv2d))
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)   # torch.jit is deprecated, not gone
        traced = torch.jit.trace(f, x)
        exported = torch.export.export(f, (x,))
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert 'aten::_convolution' in kinds and not any('mkldnn' in k for k in kinds), kinds
    assert not any('mkldnn' in str(n.target) for n in exported.graph.nodes), exported.graph
    with torch.no_grad():
        for g in (traced, exported.module()): assert _rel64(g(x), f, x) < 1e-5

def test_fold_repacks_when_shape_or_weights_change():
    "The prepacked oneDNN weights follow the folded conv's weights (in-place edits, load_state_dict) and input shape"
    torch.manual_seed(0)
    m = randomize_bn(MODELS['timm_resnet18']()).eval()
    f = fold_conv_bn(m)
    stock = lambda x: pickle.loads(pickle.dumps(f))(x)   # the same weights through stock modules, no oneDNN prepacking
    with torch.no_grad():
        for bs, px in [(2, 64), (3, 64), (2, 48)]:
            x = torch.randn(bs, 3, px, px).to(memory_format=torch.channels_last)
            torch.testing.assert_close(f(x), stock(x), rtol=1e-4, atol=1e-5)
        f.conv1.weight.mul_(-0.5)
        torch.testing.assert_close(f(x), stock(x), rtol=1e-4, atol=1e-5)
        # bf16: the plan holds a converted bias, not a view of it (where oneDNN has no bf16 conv, as on AVX2, the
        # folded conv falls back to the stock one with a warning and this checks that path). Two bf16 results differ
        # by bf16's rounding (5% where oneDNN's bf16 conv runs), so each is compared with the same weights in fp64
        fb = fold_conv_bn(m).to(torch.bfloat16)
        xb = x.bfloat16()
        fb(xb); fb.conv1.bias.add_(1.0)
        ref = pickle.loads(pickle.dumps(fb)).double()(xb.double())
        rel_l2 = lambda got: ((got.double() - ref).norm() / ref.norm()).item()
        folded, stock_bf16 = rel_l2(fb(xb)), rel_l2(pickle.loads(pickle.dumps(fb))(xb))
        assert folded < 2e-2 and folded < 2 * stock_bf16, (folded, stock_bf16)
        f.load_state_dict({k: v * 1.5 if k.endswith('conv2.weight') else v for k, v in f.state_dict().items()})
        torch.testing.assert_close(f(x), stock(x), rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize('onednn', [True, False])
@pytest.mark.parametrize('autocast', [True, False], ids=['autocast', 'bf16_model'])
def test_a_folded_grouped_conv_on_a_narrow_map_is_right_in_bf16(onednn, autocast):
    """A folded grouped conv with one input and two output channels a group, stride (1, 2), on an output 1 wide: in bf16
    oneDNN's channels-last conv (the folded call's and the stock one's) left its output uninitialized on an AVX-512
    EPYC with AVX512-BF16 (`clfast.routes.GROUPED_NARROW_FORWARD_WRONG`); folded, it is fp64's at bf16's precision"""
    from clfast.routes import _poison_freed_memory
    torch.manual_seed(0)
    m = randomize_bn(nn.Sequential(nn.Conv2d(8, 16, (1, 2), stride=(1, 2), groups=8), nn.BatchNorm2d(16), nn.ReLU())).eval()
    f = fold_conv_bn(m, onednn=onednn)
    assert isinstance(f[0], FoldedConv2d)
    if not autocast: f = f.bfloat16()
    x = torch.randn(2, 8, 5, 2).bfloat16().to(memory_format=torch.channels_last)
    for _ in range(3):
        _poison_freed_memory()
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast): got = f(x if not autocast else x.float())
        assert got.dtype == torch.bfloat16
        assert _rel64(got, f, x) < 2e-2

def _rel64(got, model, x):
    "Relative L2 error of `got` against `model`'s weights through stock modules in float64 (the folded weights pickle as a stock conv's)"
    ref = pickle.loads(pickle.dumps(model)).double()
    with torch.no_grad(): want = ref(x.double())
    return ((got.double() - want).norm() / want.norm()).item()

def test_a_folded_model_trained_again_computes_its_new_weights():
    """A folded model made trainable and trained by a fastai optimizer (which writes through `.data`, moving neither
    a tensor's version nor its address): `get_preds` gives the new weights' output (the reordered oneDNN weights went
    stale: 8e-3 off); only the biases trainable (BitFit) get their gradients (none did: oneDNN ran, outside autograd)"""
    from fastai.vision.all import Learner, DataLoaders, CrossEntropyLossFlat, SGD
    torch.manual_seed(0)
    m = fold_conv_bn(randomize_bn(MODELS['timm_resnet18']()).eval())
    x = torch.randn(16, 3, 32, 32); y = torch.randint(0, 10, (16,))
    learn = Learner(DataLoaders.from_dsets(list(zip(x, y)), list(zip(x, y)), bs=8, device='cpu'), m,
                    loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=0.1)
    for p in m.parameters(): p.requires_grad_(True)
    with learn.no_bar(), learn.no_logging():
        learn.get_preds(); learn.fit(2)
        preds = learn.get_preds(act=lambda o: o)[0]
    assert _rel64(preds, m.eval(), x) < 1e-5
    for p in m.parameters(): p.requires_grad_(p.dim() == 1); p.grad = None
    m.eval()(x).sum().backward()
    convs = [c for c in m.modules() if isinstance(c, FoldedConv2d)]
    assert convs and all(c.bias.grad is not None for c in convs) and all(c.weight.grad is None for c in convs)

def test_a_folded_model_trained_then_frozen_again_computes_its_new_weights():
    """A folded model that predicted (its oneDNN plans made), was trained by a fastai optimizer (writes through `.data`:
    neither version nor address moves) and frozen again for inference predicts with its new weights, not the plans'
    reordered old ones (kept, they were 0.82 off fp64 in relative L2)"""
    from fastai.optimizer import SGD
    torch.manual_seed(0)
    m = fold_conv_bn(randomize_bn(MODELS['timm_resnet18']()).eval()).to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(): m(x)
    assert any('_packed' in c.__dict__ for c in m.modules() if isinstance(c, FoldedConv2d))
    m.requires_grad_(True)
    opt = SGD(list(m.parameters()), lr=0.1)
    for _ in range(2):
        m(x).square().mean().backward()
        opt.step(); opt.zero_grad()
    m.requires_grad_(False)
    with torch.no_grad(): got = m(x)
    assert _rel64(got, m, x) < 1e-5

def test_folded_parameters_are_parameters_and_take_unbatched_inputs():
    "A folded conv's weights stay `nn.Parameter`s (`.to('meta')`, `load_state_dict(assign=True)` raised); an unbatched [C, H, W] input runs as the stock conv's (oneDNN raised), fp32 and bf16, oneDNN kept for batches"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    randomize_bn(m)
    f = fold_conv_bn(m)
    assert all(type(p) is nn.Parameter and not p.requires_grad for p in f.parameters())
    assert all(p.is_meta for p in copy.deepcopy(f).to('meta').parameters())
    f2 = fold_conv_bn(m); f2.load_state_dict(f.state_dict(), assign=True)
    x = torch.randn(4, 9, 9)
    with torch.no_grad():
        assert _rel64(f(x), f, x) < 1e-6
        with torch.autocast('cpu', dtype=torch.bfloat16): assert f(x).dtype == torch.bfloat16
        assert f[0].onednn == torch.backends.mkldnn.is_available()
        assert _rel64(f(x[None]), f, x[None]) < 1e-6

def test_a_hooked_conv_or_bn_is_not_folded():
    "A conv or BN with a hook of its own (features, Grad-CAM) stays as it was, said in the report: the conv's hook saw the BN's work, the BN's was dropped"
    torch.manual_seed(0)
    m = randomize_bn(torchvision.models.resnet18(num_classes=10)).eval()
    ref = copy.deepcopy(m).double()   # fp64, before the hooks (which do not pickle)
    seen = {}
    m.layer4[1].conv2.register_forward_hook(lambda mod, i, o: seen.update(conv=o))
    m.layer4[0].bn1.register_forward_hook(lambda mod, i, o: seen.update(bn=o))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(): m(x)
    want = {k: v.clone() for k, v in seen.items()}
    f = fold_conv_bn(m)
    with torch.no_grad(): out = f(x)
    for k in want: assert ((seen[k] - want[k]).norm() / want[k].norm()).item() < 1e-5, k
    skipped = dict(fusion_report(f).skipped)
    assert 'hooks' in skipped['layer4.1.conv2'] and 'hooks' in skipped['layer4.0.conv1']
    with torch.no_grad(): want = ref(x.double())
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-5

def test_fold_of_fused_model():
    m = randomize_bn(MODELS['timm_resnet18']())
    fuse_conv_bn(m).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(): torch.testing.assert_close(fold_conv_bn(m)(x), m(x), rtol=1e-3, atol=1e-4)

@pytest.mark.parametrize('name', ['timm_resnet18', 'fastai_xresnet18'])
def test_jit_script_says_to_script_a_stock_copy(name):
    """torch.jit.script of a model fused and guarded as `to_channelslast` leaves it, or folded, refuses, naming
    `stock_copy`, and leaves the model as it was; the stock copy scripts and computes the model (against fp64)"""
    torch.manual_seed(0)
    base = randomize_bn(MODELS[name]())
    m = fuse_conv_bn(copy.deepcopy(base)); guard_model(m)
    folded = fold_conv_bn(copy.deepcopy(m).eval())
    x = torch.randn(2, 3, 64, 64)
    rel = lambda got, ref: ((got.double() - ref).norm() / ref.norm()).item()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)   # torch.jit is deprecated (torch 2.14), not gone
        for model, train in ((m, True), (folded, False)):
            types = [type(c) for c in model.modules()]
            with pytest.raises(RuntimeError, match=r"script `clfast.stock.stock_copy\(model\)`"): torch.jit.script(model)
            assert [type(c) for c in model.modules()] == types and is_fused(m)
            stock = stock_copy(model)
            assert not any(isinstance(c, AsStock) for c in stock.modules())
            scripted = torch.jit.script(stock).train(train)
            ref = copy.deepcopy(base).double().train(train)(x.double())
            assert rel(scripted(x), ref) < 1e-4, (train, rel(scripted(x), ref))

@pytest.mark.cuda
@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_surgery_cuda_amp(mode):
    "A fused resnet50's training step on CUDA is as close to fp64 as the stock model's, in fp32 and under fp16/bf16 autocast"
    from test_fused import rel_err, within_precision
    torch.manual_seed(0)
    ref = randomize_bn(MODELS['tv_resnet50']()).cuda().to(memory_format=torch.channels_last)
    m = fuse_conv_bn(copy.deepcopy(ref), mode)
    x = torch.randn(8, 3, 96, 96, device='cuda').to(memory_format=torch.channels_last)
    o64, g64 = step(copy.deepcopy(ref).double(), x.double())
    keys = ('fc.weight', 'layer4.2.bn3.weight', 'layer1.0.conv1.weight', 'conv1.weight')
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        with torch.autocast('cuda', dtype=dt, enabled=dt != torch.float32):
            (o1, g1), (o2, g2) = step(m, x), step(ref, x)
        errs = lambda o, g: {'out': rel_err(o, o64), **{k: rel_err(g[k], g64[k]) for k in keys}}
        within_precision(errs(o1, g1), errs(o2, g2), dt, factor=3.)   # 50 layers deep: roundings compound in both

def test_squeeze_excite_convs_run_as_matmul():
    "efficientnet_b0's 32 squeeze-excite 1x1 convs run as matrix products (fused and folded): same state, fp64 numbers, undone"
    from clfast.fuse import PointwiseConv2d
    torch.manual_seed(0)
    ref = randomize_bn(timm.create_model('efficientnet_b0', num_classes=10))
    m = fuse_conv_bn(copy.deepcopy(ref))
    se = [n for n, c in m.named_modules() if isinstance(c, PointwiseConv2d)]
    assert fusion_report(m).pointwise == se and len(se) == 32 and all('.se.conv_' in n for n in se), se
    assert list(m.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64).to(memory_format=torch.channels_last)
    (o1, g1), (o2, g2) = step(m.double(), x), step(ref.double(), x)
    torch.testing.assert_close(o1, o2, rtol=1e-9, atol=1e-10)
    for k in g2: torch.testing.assert_close(g1[k], g2[k], rtol=1e-7, atol=1e-10, msg=k)
    from test_fused import rel_err, within_precision
    with torch.no_grad():   # fp32 training forward against fp64: as close as the stock modules' in fp32
        o64 = copy.deepcopy(ref)(x)
        errs = [{'out': rel_err(net(x.float()), o64)} for net in (copy.deepcopy(m).float(), copy.deepcopy(ref).float())]
    within_precision(*errs, torch.float32)
    ref.eval()
    f = fold_conv_bn(copy.deepcopy(ref).float())
    assert fusion_report(f).pointwise == se and not is_fused(f)
    with torch.no_grad():
        o64 = ref(x)
        within_precision({'out': rel_err(f(x.float()), o64)}, {'out': rel_err(copy.deepcopy(ref).float()(x.float()), o64)}, torch.float32)
    assert not any(isinstance(c, PointwiseConv2d) for c in pickle.loads(pickle.dumps(m)).modules())
    types = [type(c) for c in timm.create_model('efficientnet_b0', num_classes=10).modules()]
    assert [type(c) for c in unfuse_conv_bn(m).modules()] == types and not is_fused(m)

class _OwnOrder(nn.Sequential):
    "A Sequential whose own forward does not run its children in order (and does not trace: a data-dependent branch)"
    def forward(self, x):
        y = self[1](self[0](x))
        return self[2](y) + y if x.sum() > -1e9 else y

def test_a_sequential_with_its_own_forward_is_not_fused_by_adjacency():
    "Its children are not run in order: conv -> BN -> ReLU adjacent in it is not a chain, and fusing it would change the result"
    torch.manual_seed(0)
    m = _OwnOrder(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    want = m(x)
    fuse_conv_bn(m)
    assert not is_fused(m) and any('does not trace' in why for _, why in fusion_report(m).skipped)
    torch.testing.assert_close(m(x), want, atol=1e-12, rtol=1e-12)

@pytest.mark.parametrize('act', [nn.SiLU, nn.GELU])
def test_a_folded_bn_act_keeps_its_activation_when_pickled(act):
    "timm's BatchNormAct2d folded into its conv: a pickle or `stock_copy` (a plain Conv2d of the folded weights) still applies the activation"
    from timm.layers import BatchNormAct2d
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4, act_layer=act)).double().eval()
    with torch.no_grad(): m[1].running_mean.uniform_(-1, 1); m[1].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    want, folded = m(x), fold_conv_bn(m)
    for got in (folded, pickle.loads(pickle.dumps(folded)), stock_copy(folded)):
        torch.testing.assert_close(got(x), want, atol=1e-12, rtol=1e-12)

@pytest.mark.parametrize('name', ['tv_resnet18', 'timm_resnet18', 'fastai_xresnet18'])
def test_a_guarded_model_fuses_as_a_stock_one(name):
    """`fuse_conv_bn(learn.model)` after `to_channelslast()`: the model is guarded (`guard_model`: on some CPUs every
    conv a GuardedConv2d, every BN precise); it fuses as the stock model does, and computes it (against fp64)"""
    torch.manual_seed(0)
    ref = randomize_bn(MODELS[name]())
    m = copy.deepcopy(ref).to(memory_format=torch.channels_last)
    guard_model(m, 'cpu')
    want = fusion_report(fuse_conv_bn(copy.deepcopy(ref))).fused
    assert fusion_report(fuse_conv_bn(m)).fused == want and len(want) > 0
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    for train in (True, False):
        m.train(train); ref.train(train)
        with torch.no_grad(): torch.testing.assert_close(m(x).double(), ref.double()(x.double()), rtol=1e-3, atol=1e-4)
        ref.float()

def test_tracing_runs_no_user_hooks():
    """The surgery's torch.fx trace runs no hook of the model: a hook on a module traced through was called with fx
    Proxies, and one that keeps what it sees (a feature or activation collector) kept a Proxy in the user's state"""
    seen = []
    body = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()), nn.Conv2d(8, 4, 1))
    ref = copy.deepcopy(body)
    body[0].register_forward_pre_hook(lambda m, i: seen.append(('pre', type(i[0]).__name__)))
    body[0].register_forward_hook(lambda m, i, o: seen.append(('post', type(o).__name__)))
    fuse_conv_bn(body)
    assert fusion_report(body).fused == [('0.0', 'conv-bn-relu')] and seen == []
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(body.double()(x), ref.double()(x), rtol=1e-12, atol=1e-12)
    assert seen == [('pre', 'Tensor'), ('post', 'Tensor')]   # a real call runs them (the chain then unfused: hooked)

def test_a_forward_that_changes_state_while_traced_leaves_the_model_as_it_was():
    """A forward that writes to its module's state when traced (timm's `FeatureHookNet` keys a dict by its input's
    device) is traced on a copy: the fused model holds no fx Proxy and pickles (it raised "cannot pickle 'module'
    object"), and computes the stock model's features (fp64, both fused)"""
    m = timm.create_model('resnet18', features_only=True, feature_cls='hook', pretrained=False)
    ref = copy.deepcopy(m).double()
    fuse_conv_bn(m)
    assert is_fused(m) and not any('Proxy' in type(k).__name__ or 'Attribute' in type(k).__name__
                                   for k in m.hooks._feature_outputs)
    loaded = pickle.loads(pickle.dumps(m))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for got in (m.double()(x), loaded.double()(x)):
        for a, b in zip(got, ref(x)): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
