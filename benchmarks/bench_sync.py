"""Synchronized vs unsynchronized fused BN on 2 CPU ranks (gloo over loopback): what SyncBatchNorm's collectives
cost a fused training step.

Each rank trains two DDP copies of the same fused model, one converted with nn.SyncBatchNorm.convert_sync_batchnorm
(every fused layer all-gathers its statistics in forward and all-reduces two per-channel sums in backward) and one not,
taking turns round by round (order reversed every other round) so the machine's noise hits both alike; rank 0 prints
the per-round ratio synced/unsynced. 'synced' exchanges the statistics as clfast does by default (ranks on one host
share memory: clfast.exchange); 'synced-msg' through gloo's messages, as across hosts. A last setup, 'no-comm' (a
control, not a valid training), runs the synced code path with each exchange replaced by this rank's own values: what
is left of the gap is the computation, the rest is communication (latency and waiting for the other rank). One thread
per rank (two ranks on two cores):

    flock /tmp/clfast-cpu.lock python benchmarks/bench_sync.py --arch resnet50 --bs 8 --size 160 --rounds 6
"""
from __future__ import annotations
import argparse, copy, os, statistics, sys, tempfile, time
from datetime import timedelta
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

def worker(rank, args, init):
    import timm
    from clfast.fuse import fuse_conv_bn, fusion_report
    dist.init_process_group('gloo', init_method=f'file://{init}', rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=600))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = timm.create_model(args.arch, pretrained=False, num_classes=10)
    fuse_conv_bn(base, args.mode)
    import clfast.syncstats as syncstats
    setups = {'unsynced': base, 'synced': nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))}
    setups['synced-msg'] = copy.deepcopy(setups['synced'])
    setups['no-comm'] = copy.deepcopy(setups['synced'])
    gather = syncstats._gather_rows
    paths = {'no-comm': lambda t, g: torch.stack([t] * args.ranks),
             'synced-msg': lambda t, g: syncstats._message_rows(t, syncstats._twin(g).group)}
    models = {k: DDP(m.to(memory_format=torch.channels_last)) for k, m in setups.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    torch.manual_seed(rank)
    x = torch.randn(args.bs, 3, args.size, args.size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.bs,))
    def steps(k):
        syncstats._gather_rows = paths.get(k, gather)
        for _ in range(args.steps):
            nn.functional.cross_entropy(models[k](x), y).backward()
            opts[k].step(); opts[k].zero_grad()
    times = {k: [] for k in setups}
    for r in range(1 + args.rounds):   # round 0 warms up
        for k in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
            dist.barrier()
            t = time.perf_counter(); steps(k); dist.barrier(); dt = (time.perf_counter() - t) / args.steps
            if r: times[k].append(dt)
    if rank == 0:
        rep = fusion_report(base)
        print(f"{args.arch} fuse={args.mode!r}, {args.ranks} ranks x bs {args.bs}, {args.size} px, fp32, "
              f"{args.threads} thread(s) per rank; {rep.n_bn - len(rep.unfused)}/{rep.n_bn} BN fused")
        for k, v in times.items(): print(f"  {k:10s} step: median {statistics.median(v)*1e3:8.1f} ms  ({', '.join(f'{t*1e3:.0f}' for t in v)})")
        for k in ('synced', 'synced-msg', 'no-comm'):
            ratios = sorted(s / u for s, u in zip(times[k], times['unsynced']))
            print(f"  {k}/unsynced per round: median {statistics.median(ratios):.3f} "
                  f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}, n={len(ratios)})")
    dist.destroy_process_group()

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--arch', default='resnet50'); p.add_argument('--bs', type=int, default=8)
    p.add_argument('--size', type=int, default=160); p.add_argument('--mode', default='speed', choices=('speed', 'memory'))
    p.add_argument('--ranks', type=int, default=2); p.add_argument('--threads', type=int, default=1)
    p.add_argument('--rounds', type=int, default=6); p.add_argument('--steps', type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(worker, args=(args, f'{d}/init'), nprocs=args.ranks, join=True, start_method='spawn')
