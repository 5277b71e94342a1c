"""Channels-last as precise as contiguous: the gradients of one fastai training step (fp32, no autocast) against fp64,
for each way clfast trains a model, as a multiple of contiguous fp32's error; and the saved activations of
`to_channelslast()` against stock channels-last's.

    python benchmarks/bench_precision.py [--size 112] [--bs 16] [--nets conv_bn_relu conv_relu_bn guard_stem1 ...]

Error: `clfast.check.grad_error` (each parameter's max |g - g64| over max(its max |g64|, 1e-3 x the largest of any
parameter)), worst parameter. Setups: 'contiguous' (the model as built, stock kernels), 'stock CL' (the model and the
batch in channels-last, stock kernels: what `model.to(memory_format=torch.channels_last)` gives), and
`to_channelslast(use_amp=False, fuse=...)` with fuse off, 'speed' and 'memory'. No timing: the figures do not depend
on the machine's load. Prints the CPU and thread count it ran with.
"""
import argparse, copy, math
import torch
from torch import nn
from fastai.vision.all import (ConvLayer, Flatten, Learner, DataLoaders, CrossEntropyLossFlat, Adam, Callback,
                               CancelFitException, TensorImage, TensorCategory)
import clfast.callback  # noqa: F401  (Learner.to_channelslast)
from clfast.check import grad_error
from clfast.core import model_to
from clfast.machine import cpu_name, machine_key

def _head(c): return [nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(c, 10)]

NETS = {   # name -> (in channels, model builder)
    'conv_bn_relu': (3, lambda: nn.Sequential(ConvLayer(3, 16), ConvLayer(16, 32, stride=2), ConvLayer(32, 64, stride=2), *_head(64))),
    'conv_relu_bn': (3, lambda: nn.Sequential(*[ConvLayer(i, o, stride=s, bn_1st=False) for i, o, s in ((3, 16, 1), (16, 32, 2), (32, 64, 2))], *_head(64))),
    # clfast.guard's learner: a 1x1 stride-2 stem on a thin input (oneDNN issue 6035's conv), 224 px
    **{f'guard_stem{c}': (c, lambda c=c: nn.Sequential(ConvLayer(c, 8, ks=1, stride=2), ConvLayer(8, 16, stride=2), *_head(16)))
       for c in (1, 3, 4)},
}

class _Grads(Callback):
    "After the first backward: keep the gradients and stop (no optimizer step: the weights stay as they were)"
    order = 90
    def after_backward(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.learn.model.named_parameters() if p.grad is not None}
        raise CancelFitException()

def _dls(c, size, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(bs, c, size, size, generator=g) * 2 + 0.5, torch.randint(0, 10, (bs,), generator=g)
    items = list(zip(TensorImage(x), TensorCategory(y)))
    # in order: a sum over the batch in another order rounds differently, and that alone moves these errors 2-3x
    return DataLoaders.from_dsets(items, items[:1], bs=bs, device='cpu', drop_last=False, shuffle=False), x, y

def step_grads(net, c, size, bs, how, seed=0) -> dict:
    "One fastai training step's gradients with `net`, set up `how`: 'contiguous', 'stock CL', or a fuse mode ('off', 'speed', 'memory')"
    dls, *_ = _dls(c, size, bs, seed)
    learn = Learner(dls, net, loss_func=CrossEntropyLossFlat(), opt_func=Adam)
    if how == 'stock CL':
        learn.model.to(memory_format=torch.channels_last)
        class _CL(Callback):
            order = -1
            def before_batch(self): self.learn.xb = tuple(t.contiguous(memory_format=torch.channels_last) for t in self.xb)
        learn.add_cb(_CL())
    elif how != 'contiguous': learn.to_channelslast(use_amp=False, fuse=False if how == 'off' else how)
    cb = _Grads()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3, cbs=[cb])
    return cb.grads

def fp64_grads(net, c, size, bs, seed=0) -> dict:
    _, x, y = _dls(c, size, bs, seed)
    net = copy.deepcopy(net).double().train()
    loss = CrossEntropyLossFlat()(net(x.double()), y)
    loss.backward()
    return {n: p.grad for n, p in net.named_parameters()}

SETUPS = ('contiguous', 'stock CL', 'off', 'speed', 'memory')

def precision_table(nets, size, bs, setups=SETUPS) -> dict:
    "{net: {setup: error against fp64}}"
    table = {}
    for name in nets:
        c, build = NETS[name]
        torch.manual_seed(0)
        net = build()
        size_n = 224 if name.startswith('guard') else size
        ref = fp64_grads(net, c, size_n, bs)
        # the guard's nets meet oneDNN issue 6035 in stock channels-last (a heap overrun: wrong, or the process dies)
        table[name] = {s: (math.nan if s == 'stock CL' and name.startswith('guard') else
                           grad_error(step_grads(copy.deepcopy(net), c, size_n, bs, s), ref)) for s in setups}
    return table

def saved_activations_mib(model, x) -> float:
    "MiB of tensors autograd keeps for backward in one forward of `model` on `x`"
    total = 0
    def pack(t):
        nonlocal total
        total += t.untyped_storage().nbytes() if t.device.type == 'cpu' else 0
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): model(x)
    return total / 2**20

def saved_ratio(bs=32, px=64) -> tuple:
    "resnet18 (torchvision) at `px`, batch `bs`: saved activations of to_channelslast() (fuse off) and of stock channels-last"
    import torchvision
    torch.manual_seed(0)
    x = torch.randn(bs, 3, px, px).contiguous(memory_format=torch.channels_last)
    stock = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
    learn = Learner(_dls(3, px, bs)[0], copy.deepcopy(stock), loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    model_to(learn.model, channels_last=True)   # what ChannelsLast.before_fit does; to_channelslast has guarded it
    return saved_activations_mib(learn.model, x), saved_activations_mib(stock, x)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--size', type=int, default=112)
    p.add_argument('--bs', type=int, default=16)
    p.add_argument('--nets', nargs='+', default=list(NETS), choices=list(NETS))
    a = p.parse_args(argv)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; {machine_key()}")
    print(f"gradient error against fp64 / contiguous fp32's (one step, batch {a.bs}, {a.size} px; guard_stem* 224 px)")
    print(f"{'net':14s} {'contiguous':>12s}" + ''.join(f"{s:>10s}" for s in SETUPS[1:]))
    for name, row in precision_table(a.nets, a.size, a.bs).items():
        base = row['contiguous']
        print(f"{name:14s} {base:12.2e}" + ''.join(f"{row[s] / base:9.2f}x" for s in SETUPS[1:]), flush=True)
    ours, stock = saved_ratio()
    print(f"saved activations, torchvision resnet18 64 px batch 32: to_channelslast() {ours:.1f} MiB, stock "
          f"channels-last {stock:.1f} MiB ({ours / stock:.3f}x)")

if __name__ == '__main__': main()
