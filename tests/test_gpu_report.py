"""The CUDA backend as far as a machine without a GPU can check it (`clfast.gpu_report`): every Triton kernel
specialization the launch code picks compiles for sm_80 and sm_90 (sm_100 for the models' layers) with no spill, the
memory-bound ones keep enough bytes in flight for Little's law, and the tables of `clfast/KERNELS.md` are what the
code generates (the compile report and the memory-traffic model)."""
import fcntl, json, os, subprocess, sys
from pathlib import Path
import pytest, torch

triton = pytest.importorskip('triton')
from clfast import gpu_report as gr, triton_kernels as tk
from clfast.fused import MODES

ROOT = Path(__file__).parent.parent

@pytest.fixture(scope='module')
def report(tmp_path_factory) -> dict:
    """`python -m clfast.gpu_report --json`, once, in a fresh process: the kernels must be JIT functions, which they are
    not in a process that imported them under `TRITON_INTERPRET=1`. About 1100 compiles, in one process per CPU: 5
    minutes on the project's 2-core AVX2 EPYC with an empty Triton cache (about 11 in one process), 25-40 s once
    Triton's on-disk cache (~/.triton/cache) holds them. The test command (tools/test.sh) runs it in the background
    from its start, at the lowest priority, holding `CLFAST_TEST_GPU_REPORT`.lock while it runs: its report is taken
    once the lock is free, and this fixture runs its own only where there is none (run apart, or that run failed)"""
    given = os.environ.get('CLFAST_TEST_GPU_REPORT')
    if given:
        with open(given + '.lock', 'a') as lock: fcntl.flock(lock, fcntl.LOCK_EX)   # free once the background run ends
        if Path(given).exists(): return json.loads(Path(given).read_text())
    out = tmp_path_factory.mktemp('gpu_report') / 'report.json'
    env = {k: v for k, v in os.environ.items() if k not in ('TRITON_INTERPRET', 'CLFAST_KERNELS')}
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
    p = subprocess.run([sys.executable, '-m', 'clfast.gpu_report', '--json', str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(out.read_text())

def test_processes_must_be_one_or_more(capsys):
    with pytest.raises(SystemExit): gr.main(['--processes', '0'])
    assert '--processes 0: give 1 or more' in capsys.readouterr().err

def test_warm_only_takes_the_gpus_it_knows(capsys):
    "`--warm-only` (the GPU script fills Triton's cache with it) refuses a GPU with no figures, before any compile"
    with pytest.raises(SystemExit): gr.main(['--warm-only', '90', '75'])
    assert '--warm-only 75: give compute capabilities among 80, 90, 100' in capsys.readouterr().err

def _rows(report, cc=None):
    return [r for r in report['compiled'] if cc is None or r['cc'] == cc]

def test_every_specialization_compiles(report):
    "No compile error, for every specialization of every kernel, on sm_80 and sm_90 at least"
    assert not report['errors'], '\n'.join(f"{w}: {e}" for w, e in report['errors'][:10])
    assert {80, 90} <= set(report['archs'])
    for cc in report['archs']:
        # the models' training steps (all an arch outside FULL_ARCHS compiles) normalize with batch statistics only
        # and update their running statistics by a momentum, in the statistics pass: `_params`, for given
        # statistics, comes from the options' eval steps, `_running` from a cumulative average and the traced step
        want = set(gr.KERNEL_ORDER) - (set() if cc in gr.FULL_ARCHS else {'_params', '_running'})
        assert {r['kernel'] for r in _rows(report, cc)} == want, cc
    # the plan reaches every dtype, activation code (0 is left out of `describe`: it is off) and residual
    fwd = [r['spec'].split() for r in _rows(report, 90) if r['kernel'] == '_fwd']
    for dt in ('fp32', 'bf16', 'fp16'):
        for a in gr.ACTS.values():
            for res in (True, False):
                assert any(s[0] == dt and (f"ACT={a.code}" in s or a.code == 0 and not any(w.startswith('ACT=') for w in s))
                           and ('HAS_RES' in s) == res for s in fwd), (dt, a.name, res)

@pytest.mark.parametrize('traced', [False, True], ids=['eager', 'kernel-ops'])
def test_every_launch_says_its_fma_contraction(traced):
    """Each launch asks for FMA contraction (`tk.FP_FUSION`, as every GPU figure ran) rather than take Triton's
    default, which Triton 3.9 warns turns off in 3.10: with that default off, every specialization still has it"""
    from triton import knobs
    launches = gr.layer_step(torch.bfloat16, 'silu', residual=True, traced=traced)
    assert launches
    with knobs.language.scope():
        knobs.language.default_fp_fusion = False
        assert [gr.specialize(l, 90).options.enable_fp_fusion for l in launches] == [tk.FP_FUSION] * len(launches)

def test_no_spills(report):
    "`ptxas` keeps every specialization in registers: no stack frame, no local memory"
    spilled = [f"{r['kernel']} sm_{r['cc']} {r['spec']}: stack {r['stack']} local {r['local']}"
               for r in report['compiled'] if r['stack'] or r['local']]
    assert not spilled, '\n'.join(spilled)

@pytest.mark.parametrize('cc', [80, 90])
def test_bytes_in_flight(report, cc):
    """Every memory-bound specialization keeps enough bytes in flight per SM to stream at the part's bandwidth:
    Little's law with a 2x margin (30 KB on an H100, 23 KB on an A100)"""
    need = gr.bytes_needed(gr.GPUS[cc])
    short = [f"{r['kernel']} {r['spec']}: {r['blocks']} blocks x {r['loads']} B = {r['in_flight']} B < {need} B"
             for r in _rows(report, cc) if r['loads'] and r['in_flight'] < need]
    assert not short, '\n'.join(short)

def test_kernels_md_is_generated(report):
    "KERNELS.md's tables are the code's: regenerate them with `python -m clfast.gpu_report --write`"
    have = gr.read_sections()
    assert set(have) == {'compile', 'traffic'}
    if report['toolchain'] not in have['compile']:
        pytest.skip(f"KERNELS.md's table was generated with another toolchain than this one ({report['toolchain']})")
    for name, body in report['sections'].items():
        assert have[name] == body, f"KERNELS.md's {name} section is stale: run python -m clfast.gpu_report --write"

def test_traffic_model():
    """The traffic model's fused passes are the launches' (2 forward, 2 backward over the activations), and for
    ResNet's conv-BN-add-ReLU the fused step moves 12 elements' bytes per output element where stock moves 16"""
    for mode in MODES:
        launches = gr.layer_step(torch.bfloat16, 'relu', residual=True, mode=mode, grads=(True, True, True))
        fused = gr.fused_passes(launches, mode, 2)
        kernels = [p for p in fused if not p.conv]
        assert [p.phase for p in kernels] == ['forward', 'forward', 'backward', 'backward']
        assert [p.what.split()[0] for p in kernels] == ['`_stats`', '`_fwd`', '`_bwd_sums`', '`_bwd_dx`']
        assert gr._sum(fused) == 12 * 2 and gr._sum(gr.stock_passes('relu', True, 2)) == 16 * 2
        assert sum(p.conv for p in fused) == (1 if mode == 'speed' else 2)   # 'memory' recomputes y

def test_further_fusion():
    """The prediction of item 5's further fusions counts the same bytes as the model's table ('now'), each fusion
    takes bytes away, and the prologue takes only the layers whose output is one conv's input: in ResNet-50 the first
    two convs of each bottleneck; in EfficientNet-B0 no depthwise conv (a squeeze-excite uses its output)"""
    for arch in gr.MODELS:
        f = gr.further_fusion(arch)
        assert f['bytes']['now'] == pytest.approx(gr.model_traffic(arch)['fused_bytes'], rel=1e-9), arch
        assert f['bytes']['stock'] > f['bytes']['now'] > f['bytes']['epilogue'] > f['bytes']['prologue'], arch
    rn = gr.fused_layers('resnet50')
    assert {l.name for l in rn if l.feeds_conv} == {f"layer{i}.{b}.conv{k}" for i, n in enumerate((3, 4, 6, 3), 1)
                                                    for b in range(n) for k in (1, 2)}
    eff = gr.fused_layers('efficientnet_b0')
    dw = {l.name for l in eff if l.name.endswith('block.1.0') or l.name == 'features.1.0.block.0.0'}   # the depthwise convs
    assert len(dw) == 16 and not any(l.feeds_conv for l in eff if l.name in dw)
    # no residual fused: torchvision's MBConv adds after its stochastic depth
    assert {l.act for l in eff} == {'silu', 'none'} and not any(l.residual for l in eff)

def test_occupancy():
    "CUDA's occupancy calculator's rules (`cuda_occupancy.h`), on figures worked by hand"
    h100, a100 = gr.GPUS[90], gr.GPUS[80]
    assert gr.occupancy(192, 0, 4, h100) == (2, .125)      # 6144 registers a warp: 2 warps per sub-partition
    assert gr.occupancy(128, 0, 4, h100) == (4, .25)
    assert gr.occupancy(96, 0, 4, h100) == (5, .3125)      # 3072 a warp: 5 per sub-partition, 20 warps
    assert gr.occupancy(33, 0, 4, h100) == (12, .75)       # 33 x 32 rounds up to 1280 a warp
    assert gr.occupancy(32, 0, 4, h100) == (16, 1.)        # bound by 2048 threads
    assert gr.occupancy(32, 0, 1, h100) == (32, .5)        # bound by 32 blocks
    assert gr.occupancy(32, 100 * 1024, 4, h100) == (2, .125)   # 228 KB / (100 KB + 1 KB reserved)
    assert gr.occupancy(32, 100 * 1024, 4, a100) == (1, .0625)  # 164 KB
    assert gr.bytes_needed(h100) == 30455 and gr.bytes_needed(a100) == 22656   # 2 x bandwidth x 600 ns / SMs

@pytest.mark.cuda
@pytest.mark.usefixtures('fused_way')   # the fused op's launches, not the stock way's nor the per-layer timing's
def test_offline_compile_matches_the_gpu():
    """On a GPU, the JIT's kernels are the offline compile's: the same cache key (so the report is about what runs, and
    the offline compile, run there first, would fill the JIT's cache) and the registers it reports (same Triton, same
    ptxas)"""
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    if cc not in gr.GPUS: pytest.skip(f"no figures for sm_{cc}")
    x = torch.randn(4, 16, 9, 9, device='cuda', dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(16, 64, 3, padding=1, bias=False).cuda().to(torch.bfloat16)
    bn = torch.nn.BatchNorm2d(64).cuda()
    from clfast.fused import conv_bn_act
    with gr.recording() as launches:
        conv_bn_act(x.requires_grad_(), conv, bn, act='relu').float().sum().backward()
    torch.cuda.synchronize()
    assert [l.name for l in launches] == ['_stats', '_fwd', '_bwd_sums', '_bwd_dx']   # a training step's four launches
    for l in launches:
        k = l.kernel.warmup(*l.args, grid=l.grid, **l.meta)
        k._init_handles()
        c = gr.compile_spec(gr.specialize(l, cc))
        assert (k.n_regs, k.n_spills) == (c.regs, 0), l.name
        assert k.hash == c.key, (l.name, gr.specialize(l, cc).describe())
