"""The tests' ranks, forked from one server process that imported torch, fastai and timm once (multiprocessing's
'forkserver'), not each a fresh interpreter importing them: a fresh one took 3-10 s to reach the test's code on these
2-core machines, a forked one 0.1 s. clfast itself is not preloaded: ranks set its environment (CLFAST_KERNELS,
CLFAST_HOST_EXCHANGE) before they import it. Triton is (torchvision imports it): ranks that run Triton's interpreter
start fresh, since Triton reads TRITON_INTERPRET when it is imported (its own library's functions, `tl.sum`'s combine,
stay compiled-only and raise "Cannot call @triton.jit'd outside of the scope of a kernel" in an interpreted kernel)"""
import importlib, multiprocessing, os
import torch.multiprocessing as mp

PRELOAD = ('torch', 'fastai.vision.all', 'timm')

def _rank(rank:int, env:dict, module:str, name:str, *args):
    "A rank's start: the spawning process's environment as it was at the spawn (the server's is its own start's), then `fn`"
    os.environ.clear(); os.environ.update(env)
    getattr(importlib.import_module(module), name)(rank, *args)

def spawn(fn, *args, nprocs:int, interpreted:bool=False):
    """Run `fn(rank, *args)` in `nprocs` processes, as `torch.multiprocessing.start_processes` does (an exception in any
    rank is raised here, the others are killed): forked from the preloaded server, or fresh interpreters where the ranks
    set TRITON_INTERPRET (`interpreted`). `fn` travels by name and is imported after the environment is set, so a
    module-level function of a test module"""
    multiprocessing.set_forkserver_preload(list(PRELOAD))   # (read when the server starts: at the first spawn)
    mp.start_processes(_rank, args=(dict(os.environ), fn.__module__, fn.__qualname__, *args), nprocs=nprocs, join=True,
                       start_method='spawn' if interpreted else 'forkserver')
