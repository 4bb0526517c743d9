"""Stop 54: the compute locks alone. 4 processes, 2 slots; each loops: take a slot, spin COMPUTE_MS, let it go,
sleep GAP_MS (the client's round trip), for SECONDS. Prints the steps done (the two slots' throughput), from the
checkout in the current directory. Usage: lock_micro.py COMPUTE_MS GAP_MS SECONDS"""
import multiprocessing, os, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from workers.server import compute_locks

compute_s, gap_s, seconds = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, float(sys.argv[3])


def run(path, index, stop_at, counter):
    locks = compute_locks.ComputeLocks(path, 2, index)
    done = 0
    while time.monotonic() < stop_at:
        with locks:
            end = time.perf_counter() + compute_s
            while time.perf_counter() < end:
                pass
        done += 1
        time.sleep(gap_s)
    counter.put(done)


if __name__ == "__main__":
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "compute")
    open(path, "wb").write(b"\0\0")
    if hasattr(compute_locks, "bell_path"):
        os.mkfifo(compute_locks.bell_path(path))
    context = multiprocessing.get_context("fork")
    counter = context.Queue()
    stop_at = time.monotonic() + seconds
    procs = [context.Process(target=run, args=(path, i, stop_at, counter)) for i in range(4)]
    for p in procs:
        p.start()
    steps = [counter.get() for _ in procs]
    for p in procs:
        p.join()
    ideal = 2 * seconds / compute_s
    print(f"{os.getcwd()}: steps {sum(steps)} ({sorted(steps)}) of at most {ideal:.0f} with 2 slots busy: {sum(steps) / ideal:.3f}")
