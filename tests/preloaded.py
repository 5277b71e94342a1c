"""The tests' ranks and child processes, forked from one server process that imported torch, fastai and timm once
(multiprocessing's 'forkserver'), not each a fresh interpreter importing them: a fresh one took 3-10 s to reach the
test's code on these 2-core machines, a forked one 0.1 s. clfast itself is not preloaded: ranks set its environment
(CLFAST_KERNELS, CLFAST_HOST_EXCHANGE) before they import it. Triton is (torchvision imports it): ranks that run
Triton's interpreter start fresh, since Triton reads TRITON_INTERPRET when it is imported (the functions it defines
then, `triton.language.standard`'s, stay compiled-only, and an interpreted kernel raised "Cannot call @triton.jit'd
outside of the scope of a kernel")"""
import atexit, gc, importlib, multiprocessing, os, subprocess, sys, tempfile, threading, traceback
import torch.multiprocessing as mp

PRELOAD = ('torch', 'fastai.vision.all', 'timm')
# what the preloaded modules read from the environment as they are imported (the server's, at its start): a child
# asking for other values of these starts fresh
_AT_IMPORT = ('OMP_', 'MKL_', 'KMP_', 'ATEN_', 'ONEDNN_', 'DNNL_', 'TORCH', 'PYTORCH_', 'TRITON_', 'PYTHON', 'LD_', 'CUDA')
_server_env = None

def _server():
    "multiprocessing's forkserver context, its server to import `PRELOAD` when it starts (at the first process)"
    global _server_env
    if _server_env is None: _server_env = dict(os.environ)
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return multiprocessing.get_context('forkserver')

def _rank(rank:int, env:dict, module:str, name:str, *args):
    "A rank's start: the spawning process's environment as it was at the spawn (the server's is its own start's), then `fn`"
    os.environ.clear(); os.environ.update(env)
    getattr(importlib.import_module(module), name)(rank, *args)

def spawn(fn, *args, nprocs:int, interpreted:bool=False):
    """Run `fn(rank, *args)` in `nprocs` processes, as `torch.multiprocessing.start_processes` does (an exception in any
    rank is raised here, the others are killed): forked from the preloaded server, or fresh interpreters where the ranks
    set TRITON_INTERPRET (`interpreted`). `fn` travels by name and is imported after the environment is set, so a
    module-level function of a test module"""
    _server()
    mp.start_processes(_rank, args=(dict(os.environ), fn.__module__, fn.__qualname__, *args), nprocs=nprocs, join=True,
                       start_method='spawn' if interpreted else 'forkserver')

def _python(code:str, argv:list, env:dict, cwd:str, out:str, err:str):
    "`python -c code *argv` in this forked process: its environment, folder, output files, exit status, atexit handlers"
    os.environ.clear(); os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(f, fd); os.close(f)
    sys.argv, sys.path[0] = ['-c', *argv], ''
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
    changed = (env.keys() ^ _server_env.keys()) | {k for k in env if env[k] != _server_env.get(k)}
    if args[:2] != [sys.executable, '-c'] or any(k.startswith(_AT_IMPORT) for k in changed):
        return subprocess.run(args, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as d:
        out, err = f"{d}/out", f"{d}/err"
        p = ctx.Process(target=_python, args=(args[2], args[3:], env, str(cwd or os.getcwd()), out, err), daemon=True)
        p.start(); p.join(timeout)
        if p.exitcode is None:
            p.kill(); p.join()
            raise subprocess.TimeoutExpired(args, timeout, open(out).read(), open(err).read())
        return subprocess.CompletedProcess(args, p.exitcode, open(out).read(), open(err).read())
