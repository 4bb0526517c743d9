"""The whole ~1B model's one-token decode step (1 thread) in turns: a PlainContext (the bench's section-2
reference) and a ShardContext (what a worker runs) on one load in this process, and a PlainContext in each of
`children` fresh processes of their own (spawned, driven over a pipe, timed there). `rounds` turns of `steps`
steps each after a 128-token prompt. Usage: python ref_probe.py MODEL ROUNDS STEPS CHILDREN"""
import multiprocessing as mp, pathlib, statistics, sys, time
sys.path.insert(0, "/work/main")
import numpy as np

N_CTX = 1024


def steps_of(context, steps, plain):
    if plain:
        context.reset(); context.append(0, np.arange(200, 328, dtype=np.int32))
    else:
        context.truncate(0); context.append(0, tokens=np.arange(200, 328, dtype=np.int32))
    out = []
    for p in range(128, 128 + steps):
        s = time.perf_counter()
        if plain:
            context.append(p, np.asarray([p % 1000], np.int32))
        else:
            context.append(p, tokens=np.asarray([p % 1000], np.int32))
        out.append(time.perf_counter() - s)
    return out


def rollup():
    """This process's Rss, AnonHugePages, FilePmdMapped (MiB)."""
    fields = {}
    for line in open("/proc/self/smaps_rollup"):
        name, _, rest = line.partition(":")
        if name in ("Rss", "AnonHugePages", "FilePmdMapped", "Anonymous"):
            fields[name] = int(rest.split()[0]) // 1024
    return fields


def child(model, connection):
    from workers.runtime.model import ShardModel
    from kvpool.bench.reference import PlainContext
    with ShardModel(model, n_threads=1) as m:
        plain = PlainContext(m, N_CTX, n_threads=1)
        connection.send(("ready", rollup()))
        while (steps := connection.recv()) is not None:
            connection.send(steps_of(plain, steps, True))
        plain.close()


def main():
    model, rounds, steps, children = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from workers.runtime.model import ShardModel
    from kvpool.bench.reference import PlainContext
    context = mp.get_context("spawn")
    pipes = []
    for _ in range(children):
        mine, theirs = context.Pipe()
        process = context.Process(target=child, args=(model, theirs), daemon=True)
        process.start(); pipes.append(mine)
    pages = {}
    for index, pipe in enumerate(pipes):
        word, pages[f"child{index} plain"] = pipe.recv()
        assert word == "ready"
    with ShardModel(model, n_threads=1) as m:
        plain = PlainContext(m, N_CTX, n_threads=1)
        shard = m.new_context(N_CTX)
        pages["here plain"] = pages["here shard"] = rollup()
        variants = {"here plain": lambda: steps_of(plain, steps, True), "here shard": lambda: steps_of(shard, steps, False)}
        for index, pipe in enumerate(pipes):
            variants[f"child{index} plain"] = lambda pipe=pipe: (pipe.send(steps), pipe.recv())[1]
        times = {name: [] for name in variants}
        names = list(variants)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                times[name].extend(variants[name]()[3:])
        for pipe in pipes:
            pipe.send(None)
        plain.close(); shard.close()
    base = statistics.median(times["here plain"])
    for name, values in times.items():
        print(f"{name:14s} median {statistics.median(values)*1e3:7.3f} ms  vs here plain {base / statistics.median(values):.4f}  {pages[name]}")


if __name__ == "__main__":
    main()
