"""Where a CUDA training step of resnet50 spends its time, channels-last stock vs fused (AMP): wall time per step,
the host's time to issue a step (no sync), and the top kernels/ops by GPU and by CPU time (torch.profiler).

    python benchmarks/gpu_profile.py [--dtype bfloat16] [--bs 256]
"""
import argparse, copy, sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository's clfast, run from anywhere (the GPU machine installs none)
import torch, torchvision
from torch.profiler import profile, ProfilerActivity
from clfast.fuse import fuse_conv_bn

def main():
    p = argparse.ArgumentParser(); p.add_argument('--dtype', default='bfloat16'); p.add_argument('--bs', type=int, default=256)
    p.add_argument('--modes', nargs='+', default=['stock', 'speed']); p.add_argument('--rows', type=int, default=25)
    p.add_argument('--cprofile', action='store_true', help="also the host's Python time by function (cProfile)")
    a = p.parse_args(); dt = getattr(torch, a.dtype)
    torch.manual_seed(0)
    x = torch.randn(a.bs, 3, 224, 224, device='cuda').to(memory_format=torch.channels_last)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    for mode in a.modes:
        m = copy.deepcopy(base) if mode == 'stock' else fuse_conv_bn(copy.deepcopy(base), mode)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        def step():
            with torch.autocast('cuda', dtype=dt): loss = m(x).float().logsumexp(1).mean()
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        for _ in range(3): step()
        torch.cuda.synchronize()
        walls, issue = [], []
        for _ in range(10):
            t = time.perf_counter(); step(); i = time.perf_counter() - t; torch.cuda.synchronize()
            walls.append(time.perf_counter() - t); issue.append(i)
        print(f"\n## {mode}: {statistics.median(walls)*1e3:.1f} ms per step, host issues it in "
              f"{statistics.median(issue)*1e3:.1f} ms (median of 10)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2): step()
            torch.cuda.synchronize()
        if a.cprofile:
            import cProfile, pstats
            pr = cProfile.Profile(); pr.enable()
            for _ in range(3): step()
            torch.cuda.synchronize(); pr.disable()
            pstats.Stats(pr).sort_stats('tottime').print_stats(30)
        ka = prof.key_averages()
        print(ka.table(sort_by='self_cuda_time_total', row_limit=a.rows, max_name_column_width=60))
        print(ka.table(sort_by='self_cpu_time_total', row_limit=15, max_name_column_width=60))
        del m, opt

def launch_cost():
    "Host microseconds per Triton launch of a tiny kernel: through `kernel[grid]`, and through its compiled handle"
    import triton, triton.language as tl
    @triton.jit
    def _k(x_ptr, y_ptr, n, A: tl.constexpr, B: tl.constexpr):
        i = tl.arange(0, 16); tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)
    x, y = torch.zeros(16, device='cuda'), torch.zeros(16, device='cuda')
    ck = _k[(1,)](x, y, 16, A=1, B=2); torch.cuda.synchronize()
    for name, f in [('kernel[grid]', lambda: _k[(1,)](x, y, 16, A=1, B=2)), ('compiled[grid]', lambda: ck[(1, 1, 1)](x, y, 16)),
                    ('compiled[grid] (constexprs too)', lambda: ck[(1, 1, 1)](x, y, 16, 1, 2))]:
        try: f(); torch.cuda.synchronize(); assert torch.equal(x, y)
        except Exception as e: print(f"launch through {name}: {e!r}"); continue
        for _ in range(50): f()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(2000): f()
        dt = (time.perf_counter() - t) / 2000; torch.cuda.synchronize()
        print(f"launch through {name}: {dt*1e6:.1f} us of host time")

if __name__ == '__main__':
    main()
    try: launch_cost()
    except Exception as e: print('launch_cost failed:', repr(e))
