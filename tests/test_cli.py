"The `clfast` command: options parsed before torch loads, defaults shown, any torchvision/timm arch trains with progress."
import json, os, subprocess, sys, pytest
import preloaded
from clfast.cli import main

def _run(*args, commands:tuple=(), fresh:bool=True):
    """`clfast ARGS` in a fresh interpreter, or `clfast C ARGS` for each C of `commands` in turn in one (the first pays
    the imports); also reports whether torch or fastai got imported. Not `fresh`: forked from the tests' server that
    imported torch and fastai (`preloaded.run`), for a test of what the command says, not of what it imports"""
    code = ("import sys, json; from clfast.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
            "    try: main(argv)\n    except SystemExit as e: print('exit', e.code)\n"
            "print('heavy', any(m in sys.modules for m in ('torch', 'fastai')))")
    runs = [[c, *args] for c in commands] or [list(args)]
    cmd = [sys.executable, '-c', code, json.dumps(runs)]
    return subprocess.run(cmd, capture_output=True, text=True) if fresh else preloaded.run(cmd)

@pytest.mark.parametrize('cmd', ['demo', 'audit-models'])
def test_help_without_torch(cmd):
    r = _run(cmd, '--help')
    assert 'exit 0' in r.stdout and 'heavy False' in r.stdout, r.stdout + r.stderr
    assert '(default: ' in r.stdout

def test_help_shows_defaults():
    out = ' '.join(_run('demo', '--help').stdout.split())   # argparse wraps lines
    for d in ['(default: simple)', '(default: 3)', '(default: auto)', '(default: 64)', '(default: 42)',
              "default: fastai's default device", 'default: no fusion']: assert d in out, d

@pytest.mark.parametrize('args,msg', [(['--epochs', '0'], 'argument --epochs: must be at least 1, got 0'),
                                      (['--bs', 'x'], "argument --bs: 'x' is not an integer"),
                                      (['--amp', 'fp8'], "argument --amp: invalid choice: 'fp8'"),
                                      (['--nope'], 'unrecognized arguments: --nope')])
def test_bad_options_fail_fast(args, msg):
    r = _run('demo', *args)
    assert 'exit 2' in r.stdout and msg in r.stderr and 'heavy False' in r.stdout, r.stdout + r.stderr

def test_demo_any_arch(capsys):
    "`clfast demo --arch` with a torchvision and a timm classifier (both failed to infer a loss function before)"
    for arch in ('resnet18', 'resnet18d'):
        res = main(['demo', '--arch', arch, '--epochs', '1', '--bs', '8', '--items', '20', '--device', 'cpu'])
        out = capsys.readouterr().out
        assert res == 0
        # progress first: a line before each run and one per epoch, then the table
        assert out.index('[1/2] contiguous fp32') < out.index('epoch 1/1: train_loss') < out.index('[2/2] to_channelslast')
        assert out.index('[2/2] to_channelslast') < out.index('setup ') and f'arch={arch}, 1 epoch, bs=8' in out
        assert '(20 real scans' in out
        assert "note: one epoch: its images/s include the first epoch's warm-up" in out   # (the ratio read as a comparison)

_TORCH_CHECKED = [
    (['--items', '60'], "60 digits leave 48 to train on and 12 to validate: at least one training batch of 64 (fastai drops a partial one) and one digit to validate are needed; use at least 79 items, or a smaller batch size"),
    (['--items', '1', '--bs', '1'], "1 digit leaves 1 to train on and 0 to validate"),
    (['--device', 'foo'], "device 'foo' is not one torch knows"),
    (['--device', 'cuda'], "device 'cuda': no CUDA GPU here; use cpu"),
    (['--device', 'meta'], "device 'meta': the demo trains on cpu, cuda or mps"),   # (it failed inside fastai)
    (['--bs', '2048'], "bs=2048: the 1,797 digits leave 1,438 to train on, so the batch size can be 1,438 at most"),   # (a StopIteration)
    (['--arch', 'vit_tiny_patch16_224', '--items', '20', '--bs', '8'],   # (a traceback once the first run had started)
     "--arch vit_tiny_patch16_224 cannot train on the demo's 3x32x32 digits in batches of 8 (AssertionError: Input height (32) doesn't match model (224).)"),
    (['--arch', 'resnet18', '--items', '20', '--bs', '1'],   # (fastai's head's BatchNorm1d: a traceback once training had started)
     "--arch resnet18 cannot train on the demo's 3x32x32 digits in batches of 1 (ValueError: Expected more than 1 value per channel when training")]

def test_demo_options_torch_must_check_fail_before_training():
    """What only torch can check (a device here; enough digits for one batch) ends the demo at once with exit 2 and one
    line (a traceback after both runs trained, or a ZeroDivisionError). The cases in turn in one interpreter, each
    ending before the next starts (a fresh one each cost 5.5 s, most of it the imports)"""
    import torch
    cases = [(a, m) for a, m in _TORCH_CHECKED if not ('cuda' in a and torch.cuda.is_available())]   # no GPU case on one
    code = ("import sys, json; from clfast.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
            "    try: code = main(argv)\n    except SystemExit as e: code = e.code\n"
            "    print('exit', code, flush=True); print('end of run', file=sys.stderr, flush=True)")
    runs = [['demo', '--amp', 'none', '--epochs', '1', *args] for args, _ in cases]
    r = preloaded.run([sys.executable, '-c', code, json.dumps(runs)], timeout=300)
    assert r.returncode == 0 and 'Traceback' not in r.stderr and '[1/2]' not in r.stdout, r.stdout + r.stderr
    assert r.stdout.split() == ['exit', '2'] * len(cases), r.stdout + r.stderr
    for (args, msg), err in zip(cases, r.stderr.split('end of run')):   # each run's own line
        assert f'clfast demo: error: {msg}' in err, (args, r.stderr)

def test_check_timeout_above_zero():
    r = _run('check', '--timeout', '0')
    assert 'exit 2' in r.stdout and 'argument --timeout: must be above 0, got 0' in r.stderr and 'heavy False' in r.stdout, \
        r.stdout + r.stderr

def test_unknown_arch_is_an_option_error():
    "A misspelt --arch stops at the options with the nearest names, as any bad option does, not in a traceback"
    cmds = ('demo', 'bench', 'check')
    r = _run('--arch', 'resnet1', commands=cmds)
    assert r.stdout.count('exit 2') == len(cmds) and 'Traceback' not in r.stderr, r.stdout + r.stderr
    assert 'torch.jit.script' not in r.stderr, r.stderr   # fastai's import, torch's deprecation: nothing to act on
    for cmd in cmds:
        assert (f"clfast {cmd}: error: argument --arch: Unknown arch 'resnet1': not a torchvision or timm classifier; "
                "did you mean 'resnet18'") in r.stderr, (cmd, r.stderr)

def test_audit_models_names_a_misspelt_model_before_auditing():
    r = _run('audit-models', '--source', 'timm', '--models', 'resnet18d', 'efficentnet_b0', '--out', '/nonexistent/x', fresh=False)
    assert "exit clfast audit-models: Unknown arch 'efficentnet_b0': not a timm classifier; did you mean 'efficientnet_b0'" \
        in r.stdout and 'Traceback' not in r.stderr, r.stdout + r.stderr

def test_check_says_which_kernel_levels_are_built(tmp_path):
    "`clfast check` ends with the C++ kernels' levels built for this torch, and where (package or cache)"
    r = preloaded.run([sys.executable, '-c', 'import sys; from clfast.cli import main; sys.exit(main(sys.argv[1:]))',
                       'check', '--arch', 'resnet18', '--size', '32'], env={**os.environ, 'CLFAST_CACHE_DIR': str(tmp_path)})
    import torch
    from clfast.cpu_kernels import built_levels
    assert r.returncode == 0, r.stderr[-2000:]
    want = ', '.join(f"{l} ({w or 'not built'})" for l, w in built_levels().items())
    assert f"clfast's C++ CPU kernels for torch {torch.__version__}: {want}" in r.stdout, r.stdout[-2000:]

def test_build_says_where_the_kernels_are():
    "`clfast build` names the folder its library lands in (torch's extension builder adds a folder per Python and CUDA)"
    r = preloaded.run([sys.executable, '-c', 'import sys; from clfast.cli import main; sys.exit(main(sys.argv[1:]))', 'build'])
    assert r.returncode == 0, r.stderr[-2000:]
    from pathlib import Path
    from clfast.cpu_kernels import ext_name
    where = Path(r.stdout.split(' into ', 1)[1].split(' ...', 1)[0])
    assert (where/ext_name()/f"{ext_name()}.so").exists(), r.stdout

def test_check_whose_child_cannot_start_says_so(tmp_path, monkeypatch, capsys):
    "`clfast check --arch` whose checking process cannot import clfast: the reason and what to do, no traceback, exit 1"
    from clfast import check
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', 'import no_such_module'])
    with pytest.raises(SystemExit, match=r"^clfast check: check_channelslast checked, cached and guarded nothing: its child "
                                         r"process died \(exit 1: ModuleNotFoundError: No module named 'no_such_module'\)"):
        main(['check', '--arch', 'resnet18', '--size', '32'])

def test_audit_models_out_keeps_dots_in_its_name(tmp_path):
    "`--out cov_torch2.5` writes cov_torch2.5.md and .csv (the '.5' was taken for an extension: cov_torch2.md)"
    r = _run('audit-models', '--source', 'torchvision', '--models', 'resnet18', '--size', '48', '--bs', '1',
             '--out', str(tmp_path/'cov_torch2.5'), fresh=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['cov_torch2.5.csv', 'cov_torch2.5.md'], r.stdout + r.stderr
    import pandas as pd   # audited at the size asked (it was the next of its list of sizes: 64)
    assert pd.read_csv(tmp_path/'cov_torch2.5.csv')['size'].tolist() == [48]

def test_build_names_a_level_it_cannot_build_in_one_line(monkeypatch, capsys):
    "`clfast build --levels` of a level this CPU does not run: one line naming the ones it does, exit 2, nothing built (a traceback)"
    from clfast import cpu_kernels
    monkeypatch.setattr(cpu_kernels, 'levels_here', lambda: ['generic'])
    monkeypatch.setattr(cpu_kernels, 'build', lambda levels: pytest.fail("built"))
    assert main(['build', '--levels', 'avx2']) == 2
    out, err = capsys.readouterr()
    assert err == "clfast build: this CPU runs levels generic, not avx2\n" and out == ''
    with pytest.raises(SystemExit): main(['build', '--levels', 'avx3'])
    assert "argument --levels: invalid choice: 'avx3'" in capsys.readouterr().err

def test_check_takes_its_channels_and_says_what_a_model_cannot_take(tmp_path, monkeypatch, capsys):
    """`clfast check --channels 1` builds a timm model for one channel (it never could: the model kept 3) and refuses a
    torchvision one in a line; a model that cannot run at `--size` is a line and exit 2 (a traceback and exit 1,
    the exit of a failing conv)"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    assert main(['check', '--arch', 'mobilenetv3_small_050', '--size', '32', '--channels', '1']) == 0
    assert 'mobilenetv3_small_050 at 32px, float32:' in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"torchvision's resnet18 takes 3 input channels, not --channels 1"):
        main(['check', '--arch', 'resnet18', '--channels', '1'])
    assert main(['check', '--arch', 'inception_v3', '--size', '32']) == 2
    assert "clfast check: inception_v3 cannot run on a 3x32x32 input:" in capsys.readouterr().err

def _cli(*args, **env):
    "`clfast ARGS` in a process of its own (`preloaded.run`), with `env` added to the environment"
    return preloaded.run([sys.executable, '-c', 'import sys; from clfast.cli import main; sys.exit(main(sys.argv[1:]))', *args],
                         timeout=300, env={**os.environ, **env})

@pytest.mark.parametrize('args,env,msg', [
    (['bench', '--arch', 'resnet18', '--device', 'foo'], {}, "clfast bench: error: device 'foo' is not one torch knows"),
    (['bench', '--arch', 'resnet18', '--device', 'cuda'], {}, "clfast bench: error: device 'cuda': no CUDA GPU here; use cpu"),
    (['check', '--arch', 'resnet18'], {'CLFAST_MAX_CPU_ISA': 'bogus'}, "clfast check: error: CLFAST_MAX_CPU_ISA='bogus' is not a clfast CPU level"),
    (['build'], {'CXX': '/nonexistent/c++'}, "clfast build: cannot build the C++ CPU kernels: no C++ compiler"),
    (['build'], {'TORCH_EXTENSIONS_DIR': '/proc/nope'}, "set TORCH_EXTENSIONS_DIR to a writable folder")])
def test_bad_input_found_after_the_options_is_one_line(args, env, msg):
    "What the options cannot show (no such device here, a bad level or compiler, an unwritable cache): one line, no traceback"
    if 'cuda' in args:
        import torch
        if torch.cuda.is_available(): pytest.skip('a CUDA GPU is here')
    r = _cli(*args, **env)
    assert r.returncode in (1, 2) and msg in r.stderr and 'Traceback' not in r.stderr, r.stderr[-2000:]

def test_audit_models_refuses_an_unwritable_out_before_auditing():
    r = _cli('audit-models', '--source', 'torchvision', '--models', 'resnet18', '--out', '/proc/nope/cov')
    assert r.returncode == 1 and 'give --out a writable path' in r.stderr and 'Traceback' not in r.stderr
    assert '[1/1]' not in r.stdout, r.stdout   # nothing audited first

def test_a_closed_pipe_ends_the_command_quietly():
    """`clfast check | head -1` (its full listing is thousands of lines): the reader leaving is no error (it was a
    BrokenPipeError traceback). The command's listing stands in for the real one, long enough to outlast the pipe"""
    code = ("import sys, clfast.check as c; c.main = lambda o: [print('x' * 80) for _ in range(100_000)] and 0\n"
            "from clfast.cli import main; sys.exit(main(['check']))")
    sh = subprocess.run(f"{sys.executable} -c \"{code}\" | head -c 1; exit ${{PIPESTATUS[0]}}", shell=True,
                        executable='/bin/bash', capture_output=True, text=True, timeout=300)
    assert sh.returncode == 0 and 'Traceback' not in sh.stderr, sh.stderr[-2000:]
