"Small real fastai Learners and probes shared by the tests"
import torch
import torch.nn.functional as F
from torch import nn
from fastai.vision.all import (DataLoaders, Learner, ConvLayer, Flatten, CrossEntropyLossFlat, Adam, Callback,
                               TensorImage, TensorCategory)

def image_dls(n=48, c=3, size=16, n_out=2, bs=16, seed=0, n_train=None, **kwargs):
    """Random images with learnable labels (class = sign of the mean of channel 0), `size` square or (height, width);
    the first `n_train` (default: three quarters) to train on; `kwargs` to fastai's loaders"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, *((size, size) if isinstance(size, int) else size), generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() % n_out
    x, y = TensorImage(x), TensorCategory(y)
    cut = n * 3 // 4 if n_train is None else n_train
    return DataLoaders.from_dsets(list(zip(x[:cut], y[:cut])), list(zip(x[cut:], y[cut:])), bs=bs, device='cpu', **kwargs)

def conv_net(c=3, n_out=2):
    return nn.Sequential(ConvLayer(c, 8), ConvLayer(8, 16, stride=2), nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(16, n_out))

def tiny_learner(c=3, **kw):
    return Learner(image_dls(c=c), conv_net(c), loss_func=CrossEntropyLossFlat(), opt_func=Adam, **kw)

class Probe(Callback):
    "Records what the model receives and produces, and the format of params/grads/optimizer state"
    order = 5   # after ChannelsLast (-1), before MixedPrecision (10)
    def __init__(self): self.xb, self.pred_dtypes, self.grads, self.raw_xb = [], [], [], []
    def before_batch(self): self.xb.append(self.learn.xb)
    def after_pred(self): self.pred_dtypes.append(self.learn.pred.dtype)
    def after_backward(self):
        self.grads.append({n: p.grad for n, p in self.learn.model.named_parameters() if p.grad is not None})

class RawProbe(Callback):
    "Records the batch before ChannelsLast sees it"
    order = -5
    def __init__(self): self.xb = []
    def before_batch(self): self.xb.append(self.learn.xb)

def datasets_learner(n=48, c=3, size=16, bs=16, seed=0, **kw):
    "`tiny_learner` over fastai `Datasets` (split indices, typed items), so `tta` and `predict` work as on real data"
    from fastai.data.core import Datasets
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, size, size, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    cut = n * 3 // 4
    dsets = Datasets(range(n), [[lambda i: TensorImage(x[i])], [lambda i: TensorCategory(y[i])]],
                     splits=[list(range(cut)), list(range(cut, n))])
    return Learner(dsets.dataloaders(bs=bs, device='cpu'), conv_net(c), loss_func=CrossEntropyLossFlat(), opt_func=Adam, **kw)

def second_order(layer, res:bool, conv:bool, seed:int=2) -> list:
    """Second derivatives of one fp64 layer step on seeded inputs: the gradients of its gradients (taken with
    `create_graph=True`, as a gradient penalty takes them) along seeded directions, with respect to every input, the
    upstream gradient among them (zeros where none reaches). `layer(x, w, bw, bb, r)`: the layer with the inputs it
    is given (`w` None: no conv, `r` None: no residual)"""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    c = 5 if conv else 4
    x = rand(3, 4, 6, 6).to(memory_format=torch.channels_last)
    w = rand(5, 4, 3, 3) * 0.3 if conv else None
    bw, bb = rand(c).abs() + 0.5, rand(c)
    r = rand(3, c, 6, 6).to(memory_format=torch.channels_last) if res else None
    dout = rand(3, c, 6, 6)
    inputs = [t.requires_grad_() for t in (x, w, bw, bb, r, dout) if t is not None]
    out = layer(x, w, bw, bb, r)
    first = torch.autograd.grad(out, inputs[:-1], dout, create_graph=True)
    penalty = sum((d * rand(*d.shape)).sum() for d in first)
    return [torch.zeros_like(t) if d is None else d
            for d, t in zip(torch.autograd.grad(penalty, inputs, allow_unused=True), inputs)]

def _stats(c): return torch.zeros(c, dtype=torch.float64), torch.full((c,), 2., dtype=torch.float64)

def stock_layer(training:bool, act:str, p:float):
    "The stock composition a fused layer computes, as `second_order` takes a layer (running statistics 0 and 2)"
    from clfast.act import ACTS
    def layer(x, w, bw, bb, r):
        rm, rv = _stats(bw.shape[0])
        y = x if w is None else F.conv2d(x, w, None, 1, 1)
        z = F.batch_norm(y, None if training else rm, None if training else rv, bw, bb, training=training, eps=1e-5)
        return ACTS[act](z if r is None else z + r, p)
    return layer

def op_layer(op, training:bool, act:str, p:float, keep_y:bool):
    "The layer op `op` (`clfast::conv_bn_act`'s arguments) as `second_order` takes a layer, as `stock_layer` computes"
    from clfast.act import ACTS
    def layer(x, w, bw, bb, r):
        rm, rv = _stats(bw.shape[0])
        return op(x, w, None, bw, bb, r, rm, rv, None, training, 0.1, 1e-5, [1, 1], [0, 0] if w is None else [1, 1],
                  [1, 1], 1, ACTS[act].code, p, keep_y, '')
    return layer
