"""torch.func's transforms (`grad`, `vmap` of `grad`) over a model `to_channelslast()` prepared: torch refuses clfast's
C++ op inside them, so its modules compute with stock ops there, summing as precisely as outside (fp64's gradients
within a few times stock contiguous fp32's error), and routing round the stock kernels the guard routes round"""
import copy, pytest, torch
from torch import nn
from torch.func import functional_call, grad, vmap, replace_all_batch_norm_modules_
from fastai.vision.all import Learner, CrossEntropyLossFlat, Adam, set_seed
import clfast.callback   # Learner.to_channelslast: clfast's
from clfast.core import is_channels_last
from clfast.stock import stock_copy
from clfast.fused import FusedConvBN2d
from clfast.bn import is_precise, imprecise_cl_batch_norm
from clfast.routes import GuardedConvTranspose2d, one_by_one_wgrad_class
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

@pytest.fixture(scope='module', params=[False, 'speed'], ids=['default', 'fused'])
def prepared(request):
    """`net()` after a fit under `to_channelslast()` (its defaults, then fused): what it made precise, guarded and
    fused"""
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
