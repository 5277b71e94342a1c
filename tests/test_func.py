"""torch.func's transforms (`grad`, `vmap` of `grad`, `jvp`) and autograd's other modes (backward with
`create_graph=True`, forward-mode AD) over a model `to_channelslast()` prepared: torch refuses clfast's C++ op inside
transforms and forward-mode AD, so its modules compute with stock ops there, summing as precisely as outside (fp64's
gradients within a few times stock contiguous fp32's error), and routing round the stock kernels the guard routes
round; under `create_graph=True` its layers' gradients are graphs autograd differentiates again"""
import contextlib, copy, pytest, torch
from torch import nn
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, jvp, vmap, replace_all_batch_norm_modules_
from fastai.vision.all import Learner, CrossEntropyLossFlat, Adam, set_seed
import clfast.callback   # Learner.to_channelslast: clfast's
from clfast.core import is_channels_last
from clfast.stock import stock_copy
from clfast.fused import FusedConvBN2d, recomputes
from clfast.bn import is_precise, imprecise_cl_batch_norm
from clfast.routes import GuardedConvTranspose2d, one_by_one_wgrad_class
from clfast.recompute import recomputed_outputs
from clfast.amp import cpu_native_dtypes
from helpers import image_dls

MARGIN = 3   # as tests/test_zoo.py: the setup's error against fp64 may be this many times stock contiguous fp32's

def net():
    # SiLU, not ReLU: a ReLU input within fp32's rounding of 0 takes the other side in one run and moves every gradient
    # upstream far beyond any precision's error (tests/test_zoo.py's FLIP_FLOOR)
    # (convs before a BN without bias, as CNNs have them: a bias's gradient there is zero, its float result noise alone)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.SiLU(),   # fused
                         nn.AvgPool2d(2), nn.BatchNorm2d(16),                              # precise where stock is imprecise here
                         nn.ConvTranspose2d(16, 3, 1, stride=2, output_padding=1),        # routed where its class is here
                         nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(),   # fused
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

@pytest.fixture(scope='module', params=[False, 'speed', 'memory'], ids=['default', 'fused', 'memory'])
def prepared(request):
    """`net()` after a fit under `to_channelslast()` (its defaults, then fused in either mode): what it made precise,
    guarded and fused"""
    fuse = request.param
    set_seed(0)   # (a module's fixture runs before the per-test seeding: the model and its fit alike in any test order)
    learn = Learner(image_dls(size=32), net(), loss_func=CrossEntropyLossFlat(), opt_func=Adam).to_channelslast(fuse=fuse)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    m = learn.model
    assert [isinstance(m[i], FusedConvBN2d) for i in (0, 6)] == [bool(fuse)] * 2
    assert is_precise(m[4]) == imprecise_cl_batch_norm()
    assert isinstance(m[5], GuardedConvTranspose2d) == one_by_one_wgrad_class(nn.ConvTranspose2d(16, 3, 1, stride=2))
    return m

def stock(m:nn.Module, dtype=torch.float32) -> nn.Module:
    "A stock contiguous copy of `m` in `dtype` (channels-last, its transposed 1x1 conv can reach oneDNN issue 6035's kernel, which aborts)"
    return stock_copy(m).to(dtype, memory_format=torch.contiguous_format)

def errors(grads, ref) -> float:
    "The worst parameter gradient's error relative to its fp64 norm (floored at 1e-3 of the largest, as tests/test_zoo.py's)"
    big = max(g.norm().item() for g in ref.values())
    return max(((grads[k].double() - ref[k]).norm() / max(ref[k].norm().item(), 1e-3 * big)).item() for k in ref)

def test_grad_with_batch_statistics(prepared):
    """`grad` of a training step's loss (BN normalizing by the batch's statistics: torch.func's way, without running
    statistics) against fp64's: within a few times stock contiguous fp32's error. Stock channels-last BN sums in fp32
    on CPUs where clfast measured it imprecise (where clfast's precise BN runs outside the transform): 60x stock
    contiguous's error on resnet-sized sums"""
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 3 + 2
    def step_grads(m, x):
        replace_all_batch_norm_modules_(m.train())
        return grad(lambda p: functional_call(m, p, (x,)).double().square().mean())(dict(m.named_parameters()))
    ref = step_grads(stock(prepared, torch.float64), x.double())
    floor = errors(step_grads(stock(prepared), x), ref)
    got = step_grads(copy.deepcopy(prepared), x.contiguous(memory_format=torch.channels_last))
    assert errors(got, ref) <= MARGIN * floor, (errors(got, ref), floor)

def test_per_sample_gradients(prepared):
    "`vmap` of `grad` in eval (per-sample gradients, as differential privacy takes them) against fp64's"
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    def per_sample(m, x):
        m.eval()
        loss = lambda p, xi: functional_call(m, p, (xi[None],)).double().square().sum()
        return vmap(grad(loss), in_dims=(None, 0))(dict(m.named_parameters()), x)
    ref = per_sample(stock(prepared, torch.float64), x.double())
    floor = per_sample(stock(prepared), x)
    got = per_sample(prepared, x.contiguous(memory_format=torch.channels_last))
    for i in range(len(x)):
        sample = lambda g: {k: v[i] for k, v in g.items()}
        assert errors(sample(got), sample(ref)) <= MARGIN * errors(sample(floor), sample(ref))
    assert is_channels_last(prepared[0].weight)   # (the transform changed nothing of the model's)

def batch(seed, shape=(8, 3, 32, 32)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3 + 2

def _recipes(m):
    "Where `ChannelsLast` runs a 'memory' model's forward: inside `recomputed_outputs()`"
    return recomputed_outputs() if recomputes(m) else contextlib.nullcontext()

# bf16 autocast where this CPU computes it natively (emulated it is only slow), as tests/test_zoo.py's
AMPS = [None] + [torch.bfloat16] * (torch.bfloat16 in cpu_native_dtypes())

@pytest.mark.parametrize('amp', AMPS, ids=lambda dt: 'fp32' if dt is None else 'bf16')
def test_gradient_penalty(prepared, amp):
    """A WGAN-GP critic's training step: the loss plus the squared norm of the output's gradient with respect to the
    input, that gradient taken with `create_graph=True`, differentiated with respect to the parameters (second
    derivatives through every fused layer and precise BN, on the batch's statistics) against fp64's; in fp32 and bf16
    autocast (stock channels-last's error there: 7.6x stock contiguous's on Zen 5)"""
    x = batch(2)
    def penalized(m, x):
        m = copy.deepcopy(m).train()
        x = x.clone().requires_grad_()
        with torch.autocast('cpu', dtype=amp, enabled=amp is not None and x.dtype != torch.float64), _recipes(m):
            out = m(x)
        dx, = torch.autograd.grad(out.sum(), x, create_graph=True)
        (dx.double().square().sum() + out.double().square().mean()).backward()
        return {k: p.grad for k, p in m.named_parameters()}
    ref = penalized(stock(prepared, torch.float64), x.double())
    floor = errors(penalized(stock(prepared), x), ref)
    got = penalized(prepared, x.contiguous(memory_format=torch.channels_last))
    assert errors(got, ref) <= MARGIN * floor, (errors(got, ref), floor)

def test_double_backward_in_eval(prepared):
    """Eval (BN on its running statistics): the squared norm of the parameters' gradient, taken with
    `create_graph=True`, differentiated again (a Hessian-vector product's way) against fp64's"""
    x = batch(3)
    def penalized(m, x):
        m = copy.deepcopy(m).eval()
        params = list(m.parameters())
        gs = torch.autograd.grad(m(x).double().square().mean(), params, create_graph=True)
        return dict(zip([k for k, _ in m.named_parameters()], torch.autograd.grad(sum(g.square().sum() for g in gs), params)))
    ref = penalized(stock(prepared, torch.float64), x.double())
    floor = errors(penalized(stock(prepared), x), ref)
    got = penalized(prepared, x.contiguous(memory_format=torch.channels_last))
    assert errors(got, ref) <= MARGIN * floor, (errors(got, ref), floor)

def tangent_error(t, ref) -> float: return ((t.double() - ref).norm() / ref.norm()).item()

def test_forward_mode(prepared):
    """Forward-mode AD in eval: `torch.func.jvp` and dual tensors (`torch.autograd.forward_ad`), the output's tangent
    along an input direction against fp64's"""
    x, v = batch(4), batch(5)
    def tangents(m, x, v):
        m = copy.deepcopy(m).eval()
        _, t = jvp(m, (x,), (v,))
        with fwAD.dual_level(): dual = fwAD.unpack_dual(m(fwAD.make_dual(x, v))).tangent
        return t, dual
    ref = tangents(stock(prepared, torch.float64), x.double(), v.double())
    floor = [tangent_error(t, r) for t, r in zip(tangents(stock(prepared), x, v), ref)]
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)
    got = [tangent_error(t, r) for t, r in zip(tangents(prepared, cl(x), cl(v)), ref)]
    assert all(g <= MARGIN * f for g, f in zip(got, floor)), (got, floor)

def test_hessian_vector_product(prepared):
    """`jvp` of `grad` (forward over reverse: a Hessian-vector product) of a training step's loss with batch
    statistics against fp64's"""
    x = batch(6)
    def hvp(m, x):
        m = replace_all_batch_norm_modules_(copy.deepcopy(m).train())
        params = dict(m.named_parameters())
        g = torch.Generator().manual_seed(7)
        v = {k: torch.randn(p.shape, generator=g).to(p) for k, p in params.items()}
        loss = lambda p: functional_call(m, p, (x,)).double().square().mean()
        return jvp(grad(loss), (params,), (v,))[1]
    ref = hvp(stock(prepared, torch.float64), x.double())
    floor = errors(hvp(stock(prepared), x), ref)
    got = hvp(prepared, x.contiguous(memory_format=torch.channels_last))
    assert errors(got, ref) <= MARGIN * floor, (errors(got, ref), floor)
