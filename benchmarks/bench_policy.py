#!/usr/bin/env python
"""The CPU precision policy, measured as a user meets it: a fastai fit of resnet18 on real images (scikit-learn's digits
at 64 px), contiguous fp32 against the default `learn.to_channelslast()` (amp_mode='fp16'), `amp_mode='bf16'`, and
`fuse='speed'`, side by side: the setups take turns, one epoch each, for several rounds, and each round's ratio is
paired. Each CPU kind runs in its own process: oneDNN as it is here, and capped with ONEDNN_MAX_CPU_ISA (AVX2: a CPU
without native bf16/fp16; AVX512_CORE: AVX-512 without bf16) where this CPU has more than the cap."""
import argparse, json, os, statistics, subprocess, sys

CHILD = r'''
import copy, json, sys, time, warnings, torch, torchvision
from fastai.vision.all import Learner, Callback, CrossEntropyLossFlat, accuracy
from clfast.all import *
from clfast.demo import digits_dls
from clfast.amp import resolve_amp
arch, bs, px, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
dls = digits_dls(bs=bs, size=px, valid_pct=0.05)
dls.train.n = min(n, len(dls.train.dataset))   # the same n training images (shuffled) every epoch
model0 = getattr(torchvision.models, arch)(num_classes=10)
class TrainTime(Callback):
    def before_train(self): self.t0 = time.perf_counter()
    def after_train(self): self.learn.train_time = time.perf_counter() - self.t0
setups = {'contiguous fp32': lambda l: l,
          "to_channelslast() (default, amp_mode='fp16')": lambda l: l.to_channelslast(),
          "to_channelslast(amp_mode='bf16')": lambda l: l.to_channelslast(amp_mode='bf16'),
          "to_channelslast(fuse='speed')": lambda l: l.to_channelslast(fuse='speed')}
learners, chosen = {}, {}
with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    for name, setup in setups.items():
        learners[name] = setup(Learner(dls, copy.deepcopy(model0), loss_func=CrossEntropyLossFlat(), cbs=TrainTime()))
        with learners[name].no_bar(), learners[name].no_logging(): learners[name].fit(1, 1e-3)   # warm-up epoch
        mp = getattr(learners[name], 'mixed_precision', None)
        chosen[name] = str(mp.dtype if mp else torch.float32).replace('torch.', '')
    times = {n: [] for n in setups}
    names = list(setups)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):   # alternate the order: no setup always runs first
            l = learners[name]
            with l.no_bar(), l.no_logging(): l.fit(1, 1e-3)
            times[name].append(l.train_time)
print(json.dumps(dict(times=times, chosen=chosen, isa=torch.backends.cpu.get_cpu_capability(),
                      bf16=resolve_amp('cpu', 'bf16')[0] == torch.bfloat16)))
'''

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--arch', default='resnet18'); p.add_argument('--bs', type=int, default=32)
    p.add_argument('--px', type=int, default=64); p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--n', type=int, default=512, help='training images per epoch')
    p.add_argument('--caps', nargs='*', default=['', 'AVX512_CORE', 'AVX2'], help="ONEDNN_MAX_CPU_ISA values ('' = none)")
    a = p.parse_args(argv)
    print(f"{a.arch}, batch {a.bs}, {a.px} px, {a.n} digits images per epoch, CPU, {a.rounds} rounds of one epoch per setup; "
          "speedup = contiguous fp32 epoch time / setup's, median of the paired rounds [quartiles]")
    for cap in a.caps:
        env = {**os.environ, 'ONEDNN_MAX_CPU_ISA': cap} if cap else dict(os.environ)
        out = subprocess.run([sys.executable, '-c', CHILD, a.arch, str(a.bs), str(a.px), str(a.rounds), str(a.n)], env=env,
                             capture_output=True, text=True)
        if out.returncode: print(f"ONEDNN_MAX_CPU_ISA={cap or '(none)'}: failed\n{out.stderr[-2000:]}"); continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\nONEDNN_MAX_CPU_ISA={cap or '(none)'} (ATen {r['isa']}; bf16 fast: {r['bf16']})")
        base = r['times']['contiguous fp32']
        for name, ts in r['times'].items():
            ratios = [b / t for b, t in zip(base, ts)]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            print(f"  {name:<46} {r['chosen'][name]:<9} epoch {statistics.median(ts):6.2f} s   "
                  f"speedup {statistics.median(ratios):5.3f}x [{q[0]:.3f}-{q[2]:.3f}]")

if __name__ == '__main__': main()
