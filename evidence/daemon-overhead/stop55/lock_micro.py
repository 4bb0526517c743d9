"""Stop 55: the compute bound alone, old (fcntl locks, workers.server.compute_locks) or new (the semaphore,
workers.server.compute_semaphore), whichever the checkout in the current directory has. 4 processes, 2 slots;
each loops: take a slot, spin COMPUTE_MS, let it go, sleep GAP_MS (the client's round trip), for SECONDS. Prints
the steps done against two slots always busy, and the processes' moves between CPUs (se.nr_migrations of
/proc/self/sched) and involuntary context switches. (stop54/lock_micro.py's loop.) Usage: lock_micro.py COMPUTE_MS GAP_MS SECONDS"""
import multiprocessing, os, sys, tempfile, time
sys.path.insert(0, os.getcwd())
try:
    from workers.server import compute_semaphore as semaphore_module
except ImportError:
    semaphore_module = None
    from workers.server import compute_locks

compute_s, gap_s, seconds = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, float(sys.argv[3])


def bound(path, index):
    return semaphore_module.ComputeSemaphore(path) if semaphore_module else compute_locks.ComputeLocks(path, 2, index)  # path: the semaphore's id for the new


def run(path, index, stop_at, counter):
    slot = bound(path, index)
    done = 0
    while time.monotonic() < stop_at:
        with slot:
            end = time.perf_counter() + compute_s
            while time.perf_counter() < end:
                pass
        done += 1
        time.sleep(gap_s)
    sched = dict(line.replace(" ", "").split(":", 1) for line in open("/proc/self/sched").read().splitlines() if line.count(":") == 1)
    counter.put((done, int(float(sched["se.nr_migrations"])), int(float(sched["nr_involuntary_switches"]))))


if __name__ == "__main__":
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "compute")
    if semaphore_module:
        made = semaphore_module.create(path, 2)
        path = made.id
    else:
        open(path, "wb").write(b"\0\0")
    context = multiprocessing.get_context("fork")
    counter = context.Queue()
    stop_at = time.monotonic() + seconds
    procs = [context.Process(target=run, args=(path, i, stop_at, counter)) for i in range(4)]
    for p in procs:
        p.start()
    results = [counter.get() for _ in procs]
    steps = [done for done, _, _ in results]
    for p in procs:
        p.join()
    if semaphore_module:
        semaphore_module.destroy(made)
    ideal = 2 * seconds / compute_s
    kind = "semaphore" if semaphore_module else "fcntl locks"
    print(f"{os.getcwd()} ({kind}): steps {sum(steps)} ({sorted(steps)}) of at most {ideal:.0f} with 2 slots busy: {sum(steps) / ideal:.3f}; "
          f"CPU migrations {sum(m for _, m, _ in results)}, involuntary switches {sum(i for _, _, i in results)}")
