"""`clfast.exchange.HostExchange` with real processes (gloo over loopback, file init): rows in rank order over many
exchanges with ranks out of step, every rank falling back together, a peer that exits or stalls ending the wait"""
import glob, os, random, time, pytest, torch, torch.distributed as dist, torch.multiprocessing as mp
from datetime import timedelta
from clfast.exchange import CAPACITY, STORES_IN_ORDER, HostExchange

pytestmark = pytest.mark.skipif(not STORES_IN_ORDER,
                                reason="the shared-memory exchange is used on x86-64 only")

def _spawn(fn, n, *args): mp.start_processes(fn, args=(n, *args), nprocs=n, join=True, start_method='spawn')

def _init(rank, n, init, timeout=60):
    dist.init_process_group('gloo', init_method=f'file://{init}', rank=rank, world_size=n,
                            timeout=timedelta(seconds=timeout))

def _rows_worker(rank, n, init):
    _init(rank, n, init)
    before = set(glob.glob('/dev/shm/clfast-exchange-*'))
    ex = HostExchange.open(dist.group.WORLD)
    assert ex is not None
    dist.barrier()   # the first rank has unlinked the file once every rank mapped it: nothing is left behind
    assert set(glob.glob('/dev/shm/clfast-exchange-*')) <= before
    rng = random.Random(rank)
    for k in range(200):
        if rng.random() < 0.2: time.sleep(rng.random() * 2e-3)   # ranks out of step
        c = 1 + k % 37
        t = torch.arange(3 * c, dtype=torch.float32).view(3, c) + 1000 * rank + k
        every = ex.gather(t)
        want = torch.stack([torch.arange(3 * c, dtype=torch.float64).view(3, c) + 1000 * r + k for r in range(n)])
        assert torch.equal(every, want), f"exchange {k}"
    assert ex.gather(torch.zeros(CAPACITY + 1)) is None   # too large: the caller uses gloo, on every rank alike
    dist.destroy_process_group()

@pytest.mark.parametrize('n', [2, 3])
def test_rows_in_rank_order(tmp_path, n): _spawn(_rows_worker, n, str(tmp_path/'init'))

def _optout_worker(rank, n, init):
    if rank == 1: os.environ['CLFAST_HOST_EXCHANGE'] = '0'
    _init(rank, n, init)
    assert HostExchange.open(dist.group.WORLD) is None   # one rank says no: no rank uses it
    dist.destroy_process_group()

def test_one_rank_opting_out_turns_it_off_for_all(tmp_path): _spawn(_optout_worker, 2, str(tmp_path/'init'))

def _no_room_worker(rank, n, init):
    import clfast.exchange as ex
    if rank == 0: ex._shared_dir = lambda: '/nonexistent-clfast-dir'   # the first rank cannot create the file
    _init(rank, n, init, timeout=10)
    assert HostExchange.open(dist.group.WORLD) is None   # every rank hears of it and keeps gloo: no hang
    dist.destroy_process_group()

def test_no_shared_file_turns_it_off_for_all(tmp_path): _spawn(_no_room_worker, 2, str(tmp_path/'init'))

def _gone_worker(rank, n, init, stall):
    _init(rank, n, init, timeout=3)
    ex = HostExchange.open(dist.group.WORLD)
    ex.gather(torch.ones(4))
    if rank == 1:   # never comes to the second exchange: exits, or stays alive past the group's timeout
        if stall: time.sleep(8); return
        # at once, as a crashed peer does: an orderly exit with the process group alive sometimes aborts in gloo's
        # teardown ("terminate called without an active exception"), which spawn reports before rank 0's error
        os._exit(0)
    ex.gather(torch.ones(4))

@pytest.mark.parametrize('stall,match', [(False, 'exited while rank 0 waited'), (True, 'waited 3 s')])
def test_a_peer_that_never_comes_ends_the_wait(tmp_path, stall, match):
    t = time.time()
    with pytest.raises(mp.ProcessRaisedException, match=match): _spawn(_gone_worker, 2, str(tmp_path/'init'), stall)
    assert time.time() - t < 30
