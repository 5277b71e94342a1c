"A fused timm MixedConv2d synchronizes its BN over ranks, split by split (2 ranks on gloo, as tests/test_distributed.py)"
import copy, torch
from torch import nn
from timm.layers import MixedConv2d
from test_distributed import _init, _spawn

def _mixed():
    torch.manual_seed(0)
    m = nn.Sequential(MixedConv2d(6, 10, [3, 5], depthwise=False), nn.BatchNorm2d(10), nn.ReLU())
    with torch.no_grad(): m[1].weight.uniform_(0.5, 1.5); m[1].bias.uniform_(-0.5, 0.5)
    return m

def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, 9, 9, generator=g) * torch.linspace(0.5, 3, 8).view(8, 1, 1, 1)   # ranks' statistics differ

def _worker(rank, init, out):
    import torch.distributed as dist
    from clfast.fuse import fuse_conv_bn
    _init(rank, init)
    try:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(fuse_conv_bn(_mixed()))
        assert type(m[0]).__name__ == 'FusedMixedConv2d'
        x = _batch()[rank * 4:(rank + 1) * 4].contiguous(memory_format=torch.channels_last).requires_grad_()
        y = m(x)
        y.square().sum().backward()
        torch.save(dict(y=y.detach(), dx=x.grad, mean=m[1].running_mean, var=m[1].running_var), f"{out}/rank{rank}.pt")
    finally: dist.destroy_process_group()

def test_fused_mixed_conv_synchronizes(tmp_path):
    "Against the stock modules in fp64 over both ranks' batch: outputs, input gradients, running statistics"
    _spawn(_worker, str(tmp_path/'init'), str(tmp_path))
    ref = _mixed().double()
    x = _batch().double().requires_grad_()
    y = ref(x)
    y.square().sum().backward()
    for rank in (0, 1):
        got, part = torch.load(tmp_path/f"rank{rank}.pt"), slice(rank * 4, (rank + 1) * 4)
        torch.testing.assert_close(got['y'].double(), y[part].detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got['dx'].double(), x.grad[part], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(got['mean'].double(), ref[1].running_mean, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got['var'].double(), ref[1].running_var, rtol=1e-4, atol=1e-6)
