"""The GPU script's training benchmark runs end to end (on the CPU, tiny), so that a lent GPU's minutes are not spent on
a broken script: every row it is asked for measured or failing with its reason, and the table printed last, with
what Triton's compiler did"""
import runpy, sys
from pathlib import Path

def test_bench_gpu_fit_dry_run(capsys):
    bench = runpy.run_path(str(Path(__file__).parents[1] / 'benchmarks' / 'bench_gpu_fit.py'))
    bench['main'](['--device', 'cpu', '--models', 'resnet18', '--bs', '2', '--px', '32', '--steps', '1', '--warm', '5', '--rounds', '2',
                   '--dtypes', 'bfloat16', '--setups', 'stock-cl', 'fastai', 'speed', 'graphs', 'speed-compiled'])
    out = capsys.readouterr().out
    table, after = out[out.index('| model |'):].strip().split('\n\n')
    table = table.splitlines()[2:]
    # the five setups, and stock channels-last again beside the eager 'speed' ways (a later group: `plan`)
    assert len(table) == 6 and not any('failed' in r or 'not run' in r for r in table)
    assert sum('stock channels-last, fastai AMP' in r for r in table) == 2
    # then what Triton's compiler did in the fits: nothing on the CPU, where the fused layers run clfast's C++ kernels
    assert after.startswith('Triton compiled 0 kernel specialization(s) in 0.0 s; 0 came from its on-disk cache'), after
    rows = {r.split(' | ')[3]: r.split(' | ') for r in table}
    assert rows['stock channels-last, fastai AMP'][5] == '1.00' and float(rows["clfast fuse='speed'"][4]) > 0
    assert 'CUDA graphs need a model on a CUDA GPU' in rows['clfast graphs=True'][9]
