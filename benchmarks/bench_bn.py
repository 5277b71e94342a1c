"""The precise BatchNorm (clfast.bn) against stock channels-last BatchNorm on the CPU: one training forward + backward
of a BatchNorm2d alone, paired, order alternating; prints the median of the per-pair time ratios (precise / stock).
With --models, whole training steps of timm models instead: stock channels-last against the same model with its BNs
made precise (what `to_channelslast()` trains with fuse off), in fp32 and under bf16 autocast.

    python benchmarks/bench_bn.py [--rounds 15] [--dtypes float32 bfloat16] [--models resnet50 efficientnet_b0] [--null]

--null pairs each model with an unchanged copy of itself instead (the noise floor of the paired ratio).

Shapes are the BN inputs of resnet50 and efficientnet_b0 at batch 8, 128 px (and one large early map). bf16 is the
batch's dtype under CPU autocast (the BN's parameters stay fp32, as stock). Prints the CPU and thread count.
"""
import argparse, copy, statistics
import torch
from torch import nn
from clfast.bn import make_precise
from clfast.timing import paired_ratio   # fixed pairs: a figure, not a decision
from clfast.machine import cpu_name, machine_key

SHAPES = [(8, 64, 64, 64), (8, 64, 32, 32), (8, 256, 32, 32), (8, 128, 16, 16), (8, 512, 16, 16), (8, 1024, 8, 8),
          (8, 2048, 4, 4), (8, 32, 64, 64), (8, 96, 32, 32), (8, 144, 32, 32), (8, 240, 8, 8), (8, 672, 8, 8)]

def _step(bn, x, dy):
    def run():
        x.grad = None
        bn(x).backward(dy)
    return run

def model_steps(names, dtypes, rounds, bs=8, px=128, null=False):
    "Paired training steps of each timm model: stock channels-last vs its BNs precise (guard_model; `null`: left stock); ratio precise/stock"
    import timm
    from clfast.guard import guard_model
    for name in names:
        torch.manual_seed(0)
        stock = timm.create_model(name, num_classes=10).to(memory_format=torch.channels_last)
        precise = copy.deepcopy(stock)
        if not null: guard_model(precise)
        x = torch.randn(bs, 3, px, px).contiguous(memory_format=torch.channels_last)
        for dt in dtypes:
            dtype = getattr(torch, dt)
            def step(m):
                def run():
                    with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32): out = m(x)
                    out.float().sum().backward()
                return run
            r, t = paired_ratio(step(stock), step(precise), rounds)
            print(f"{name:22s} {dt:9s} {t * 1e3:9.1f} {r:13.3f}x", flush=True)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rounds', type=int, default=15)
    p.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'])
    p.add_argument('--models', nargs='*', default=None, help="timm models: whole training steps instead of single BNs")
    p.add_argument('--null', action='store_true', help="with --models: the 'precise' model left stock (the noise floor)")
    a = p.parse_args(argv)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; {machine_key()}")
    if a.models:
        print(f"{'model (batch 8, 128 px)':22s} {'dtype':9s} {'stock ms':>9s} {'precise/stock':>14s}")
        return model_steps(a.models, a.dtypes, a.rounds, null=a.null)
    print(f"{'shape':22s} {'dtype':9s} {'stock ms':>9s} {'precise/stock':>14s}")
    ratios = {d: [] for d in a.dtypes}
    for shape in SHAPES:
        for dt in a.dtypes:
            dtype = getattr(torch, dt)
            x = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
            dy = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
            stock = nn.BatchNorm2d(shape[1])
            precise = make_precise(copy.deepcopy(stock))
            r, t = paired_ratio(_step(stock, x, dy), _step(precise, x, dy), a.rounds)
            ratios[dt].append(r)
            print(f"{str(shape):22s} {dt:9s} {t * 1e3:9.2f} {r:13.2f}x", flush=True)
    for dt, rs in ratios.items():
        print(f"geomean {dt}: {statistics.geometric_mean(rs):.3f}x")

if __name__ == '__main__': main()
