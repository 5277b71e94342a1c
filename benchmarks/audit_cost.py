"""Cost of `clfast.audit.audit` relative to a plain training step (forward + backward), measured side by side.

Run: `flock /tmp/clfast-cpu.lock python benchmarks/audit_cost.py` (CPU) or `--device cuda`.
Prints the times of each and their ratio (median of the per-pair ratios, best of each, ratio of medians); alternating
the two in one run keeps the comparison fair on a noisy machine.
"""
import argparse, statistics, time
import torch, torchvision
from clfast.core import model_to, to_channels_last
from clfast.audit import audit

def plain_step(model, x):
    "What a training step does apart from the optimizer: forward, backward on the output's sum"
    model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)

def sync(device):
    if device.startswith('cuda'): torch.cuda.synchronize()

def timed(f, device):
    sync(device); t = time.perf_counter(); f(); sync(device)
    return time.perf_counter() - t

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='resnet50', help='torchvision model name (default resnet50)')
    p.add_argument('--size', type=int, default=64)
    p.add_argument('--bs', type=int, default=8)
    p.add_argument('--reps', type=int, default=11)
    p.add_argument('--device', default='cpu')
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model = model_to(torchvision.models.get_model(a.model, weights=None).to(a.device))
    x = to_channels_last(torch.randn(a.bs, 3, a.size, a.size, device=a.device))
    plain, audited = [], []
    plain_step(model, x); audit(model, x)   # warm up allocator and kernels
    for _ in range(a.reps):
        plain.append(timed(lambda: plain_step(model, x), a.device))
        audited.append(timed(lambda: audit(model, x), a.device))
    mp, ma = statistics.median(plain), statistics.median(audited)
    pairs = statistics.median(a_ / p_ for p_, a_ in zip(plain, audited))
    print(f"{a.model} {a.size}px bs={a.bs} on {a.device}, {a.reps} alternating reps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"plain step (fwd+bwd): median {mp*1e3:.1f} ms  (all: {', '.join(f'{t*1e3:.0f}' for t in plain)})")
    print(f"audit (fwd+bwd):      median {ma*1e3:.1f} ms  (all: {', '.join(f'{t*1e3:.0f}' for t in audited)})")
    print(f"ratio audit / plain: {pairs:.2f}x median of paired reps, {min(audited)/min(plain):.2f}x best of each, "
          f"{ma/mp:.2f}x of medians")
    return pairs

if __name__ == '__main__': main()
