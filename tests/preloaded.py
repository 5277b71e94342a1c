"""The tests' ranks and child processes, forked from one server process that imported torch, fastai and timm once
(multiprocessing's 'forkserver'), not each a fresh interpreter importing them: a fresh one took 3-10 s to reach the
test's code on these 2-core machines, a forked one 0.1 s. clfast itself is not preloaded: ranks set its environment
(CLFAST_KERNELS, CLFAST_HOST_EXCHANGE) before they import it. Triton is (torchvision imports it): ranks that run
Triton's interpreter start fresh, since Triton reads TRITON_INTERPRET when it is imported (the functions it defines
then, `triton.language.standard`'s, stay compiled-only, and an interpreted kernel raised "Cannot call @triton.jit'd
outside of the scope of a kernel")"""
import atexit, errno, gc, importlib, json, multiprocessing, os, subprocess, sys, tempfile, threading, traceback
import torch.multiprocessing as mp

PRELOAD = ('torch', 'fastai.vision.all', 'timm')
# what the preloaded modules read from the environment as they are imported (the server's, at its start): a child
# asking for other values of these starts fresh
_AT_IMPORT = ('OMP_', 'MKL_', 'KMP_', 'ATEN_', 'ONEDNN_', 'DNNL_', 'TORCH', 'PYTORCH_', 'TRITON_', 'PYTHON', 'LD_', 'CUDA')
_server_env = None
_path = None

def _fresh_path() -> list:
    """The module path of a fresh `python -c` with the server's environment (once): a forked child's is pytest's, which
    finds the tests' own modules a fresh interpreter does not"""
    global _path
    if _path is None:
        code = 'import sys, json; print(json.dumps(sys.path))'
        _path = json.loads(subprocess.run([sys.executable, '-c', code], env=_server_env, capture_output=True, text=True,
                                          check=True).stdout)
    return _path

def _server():
    "multiprocessing's forkserver context, its server to import `PRELOAD` when it starts (at the first process)"
    global _server_env
    if _server_env is None: _server_env = dict(os.environ)
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return multiprocessing.get_context('forkserver')

def _as_fresh(env:dict):
    """This forked process made as a fresh interpreter with `env` would be: its environment, `tempfile`'s folder (read
    from TMPDIR once, in the server), and random states of its own (forked ones share the server's torch and numpy
    states; Python's `random` is reseeded at each fork by Python itself)"""
    os.environ.clear(); os.environ.update(env)
    tempfile.tempdir = None
    sys.modules['torch'].seed()
    if 'numpy' in sys.modules: sys.modules['numpy'].random.seed()

def _rank(rank:int, env:dict, module:str, name:str, *args):
    "A rank's start: the spawning process's environment as it was at the spawn (the server's is its own start's), then `fn`"
    _as_fresh(env)
    getattr(importlib.import_module(module), name)(rank, *args)

def _fresh_needed(env:dict) -> bool:
    "Whether `env` changes what the preloaded modules read at import (`_AT_IMPORT`) from the server's: a fresh interpreter then"
    changed = (env.keys() ^ _server_env.keys()) | {k for k in env if env[k] != _server_env.get(k)}
    return any(k.startswith(_AT_IMPORT) for k in changed)

def spawn(fn, *args, nprocs:int, interpreted:bool=False):
    """Run `fn(rank, *args)` in `nprocs` processes, as `torch.multiprocessing.start_processes` does (an exception in any
    rank is raised here, the others are killed): forked from the preloaded server, or fresh interpreters where the ranks
    set TRITON_INTERPRET (`interpreted`) or the environment changes what the preloaded modules read at import. `fn` travels by name and is imported after the environment is set, so a
    module-level function of a test module"""
    _server()
    fresh = interpreted or _fresh_needed(dict(os.environ))
    mp.start_processes(_rank, args=(dict(os.environ), fn.__module__, fn.__qualname__, *args), nprocs=nprocs, join=True,
                       start_method='spawn' if fresh else 'forkserver')

def _python(code:str, argv:list, env:dict, path:list, cwd:str, out:str, err:str):
    """`python -c code *argv` in this forked process: its environment, module path, folder, output files, exit status,
    atexit handlers"""
    for fd, name in ((1, out), (2, err)):   # first: what goes wrong after is read as a fresh interpreter's would be
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(f, fd); os.close(f)
    _as_fresh(env)
    os.chdir(cwd)
    sys.argv, sys.path[:] = ['-c', *argv], path
    gc.freeze()   # (what it inherited, out of its collector's sight)
    try: exec(compile(code, '<string>', 'exec'), {'__name__': '__main__'}); status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))): print(e.code, file=sys.stderr)
    except BaseException as e:   # as the interpreter prints it: from the code's frame on, not this function's
        traceback.print_exception(e.with_traceback(e.__traceback__.tb_next)); status = 1
    threading._shutdown(); atexit._run_exitfuncs()   # as the interpreter's own exit, then none of its teardown
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(status)

def run(args:list, env:dict|None=None, cwd=None, timeout:float|None=None) -> subprocess.CompletedProcess:
    """`subprocess.run(args, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)` for
    `args = [sys.executable, '-c', code, *argv]`, forked from the preloaded server: the exit status, stdout and stderr as a
    fresh interpreter's. Where `env` changes what the preloaded modules read at import (`_AT_IMPORT`), a fresh one"""
    env = dict(os.environ if env is None else env)
    ctx = _server()
    if args[:2] != [sys.executable, '-c'] or _fresh_needed(env):
        return subprocess.run(args, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
    cwd = os.fspath(cwd or os.getcwd())
    if not os.path.isdir(cwd): raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)   # as subprocess's
    with tempfile.TemporaryDirectory() as d:
        out, err = f"{d}/out", f"{d}/err"
        # not a daemon: a fresh interpreter may start processes of its own (a DataLoader's workers)
        p = ctx.Process(target=_python, args=(args[2], args[3:], env, _fresh_path(), cwd, out, err))
        p.start(); p.join(timeout)
        read = lambda name: open(name).read() if os.path.exists(name) else ''
        if p.exitcode is None:
            p.kill(); p.join()
            raise subprocess.TimeoutExpired(args, timeout, read(out), read(err))
        return subprocess.CompletedProcess(args, p.exitcode, read(out), read(err))
