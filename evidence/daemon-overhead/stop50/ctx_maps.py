"""Which mappings a PlainContext's creation makes (size, flags) and what MADV_COLLAPSE says to each; AnonHugePages after."""
import sys, re
sys.path.insert(0, "/work/main")
from workers.runtime.model import ShardModel
from workers.runtime import huge_pages as hp
from kvpool.bench.reference import PlainContext
import numpy as np


def rollup():
    return {l.split(":")[0]: int(l.split()[1]) // 1024 for l in open("/proc/self/smaps_rollup") if l.startswith(("AnonHugePages", "Anonymous"))}


with ShardModel(sys.argv[1], n_threads=1) as m:
    print("after load", rollup())
    before = hp.anonymous_ranges(hp._read_maps())
    c = PlainContext(m, 1024, n_threads=1)
    after = hp.anonymous_ranges(hp._read_maps())
    new = hp.new_ranges(before, after)
    print("after context", rollup(), [(hex(s), (e - s) / 2**20) for s, e in new])
    smaps = open("/proc/self/smaps").read()
    for s, e in hp.whole_huge_pages(new, hp.huge_page_bytes()):
        print("range", hex(s), (e - s) / 2**20, "MiB:", hp._advise(s, e) or "collapsed")
    print("after collapse", rollup())
    c.append(0, np.arange(200, 328, dtype=np.int32))
    print("after prefill", rollup())
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        first = block.split("\n", 1)[0]
        start = int(first.split("-")[0], 16)
        if any(s <= start < e for s, e in new):
            print(first[:60], [l for l in block.split("\n") if l.startswith(("Size", "Rss", "AnonHuge", "THPeligible", "VmFlags"))])
