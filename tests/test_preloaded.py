"`preloaded.run`, the tests' stand-in for a fresh interpreter: what it gives is what `python -c` gives"
import os, subprocess, sys, pytest
import preloaded

@pytest.mark.parametrize('code', [
    "import sys; print('out', sys.argv); print('err', file=sys.stderr)",
    "import sys; sys.exit(3)",
    "import sys; sys.exit('a message')",
    "raise ValueError('boom')",
    "import atexit, os; atexit.register(lambda: print('at exit', os.environ['CLFAST_TEST_VALUE'], os.getcwd()))"])
def test_run_is_python_c(code, tmp_path):
    "The exit status, stdout and stderr of `python -c code a b` with a variable set and another folder, as a fresh interpreter's"
    args, env = [sys.executable, '-c', code, 'a', 'b'], {**os.environ, 'CLFAST_TEST_VALUE': 'v'}
    want = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True)
    got = preloaded.run(args, env=env, cwd=tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)

def test_run_starts_fresh_where_an_import_reads_the_environment():
    """A variable the preloaded torch read as it was imported (its thread count: 1, where the server's is more; torch
    takes no more than the cores) is the child's: a fresh interpreter"""
    import torch
    if torch.get_num_threads() == 1: pytest.skip("torch runs one thread here: no thread count tells the two apart")
    r = preloaded.run([sys.executable, '-c', "import torch; print(torch.get_num_threads())"], env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.stdout.strip() == '1', r.stderr[-2000:]

def test_run_times_out():
    with pytest.raises(subprocess.TimeoutExpired): preloaded.run([sys.executable, '-c', 'import time; time.sleep(30)'], timeout=1)

@pytest.mark.parametrize('code', [
    "import tempfile; print(tempfile.gettempdir())",
    "import importlib.util; print(importlib.util.find_spec('helpers') is not None)",
    "import torch; from torch.utils.data import DataLoader; print(sum(b.sum().item() for b in DataLoader(torch.arange(8.), batch_size=2, num_workers=2)))"],
    ids=['tmpdir', 'path', 'workers'])
def test_run_is_python_c_in_what_the_server_set_up(code, tmp_path):
    """What the server process fixed before the fork is a fresh interpreter's in the child: tempfile's folder (from this
    TMPDIR), the module path (a fresh one does not find the tests' own modules), processes of its own (a daemon
    cannot start a DataLoader's workers)"""
    args, env = [sys.executable, '-c', code], {**os.environ, 'TMPDIR': str(tmp_path)}
    want = subprocess.run(args, env=env, capture_output=True, text=True)
    got = preloaded.run(args, env=env)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)

def test_run_draws_random_states_of_its_own():
    "Each child's torch and numpy draw their own seeds, as fresh interpreters do (forked ones shared the server's)"
    code = "import torch, numpy; print(torch.initial_seed(), numpy.random.rand())"
    assert len({preloaded.run([sys.executable, '-c', code]).stdout for _ in range(2)}) == 2

def test_run_in_a_missing_folder_raises_as_subprocess_does(tmp_path):
    with pytest.raises(FileNotFoundError): preloaded.run([sys.executable, '-c', 'pass'], cwd=tmp_path/'missing')
