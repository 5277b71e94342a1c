"Small real fastai Learners and probes shared by the tests"
import torch
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
