"""--huge-pages on real workers: a generated Q4_K_M llama whose weights llama.cpp repacks for this CPU (the bundled
Q4_1 is not repacked), served whole. By default each worker asks for the memory its load mapped (the repacked
weights) in transparent huge pages and, where the kernel offers them and has MADV_COLLAPSE, holds them there when
it becomes ready, which `kvpool status` says; with `off` nothing is asked. The logits are the same bits either way."""

from __future__ import annotations

import numpy as np

from kvpool.tools.synthetic import SPM_VOCAB, ZooSpec, zoo_model
from tests.support.daemons import DaemonProcess
from workers.runtime.huge_pages import OFFERED, transparent_huge_pages

ONE_PLACE = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--calibration-cache", "off")
MIB = 1024**2
# 2 layers of n_embd 1024 and n_ff 4096 in Q4_K_M: 14.3 MiB of weights repacked (q4_K_8x8 on AVX2 and later), in
# one buffer: at least 6 whole 2 MiB pages wherever it lands. A small vocabulary keeps the file at 19 MiB.
SPEC = ZooSpec("huge-pages", n_layer=2, n_embd=1024, n_head=8, n_head_kv=4, n_ff=4096, vocab=SPM_VOCAB)
TOKENS = [1, 50, 60, 70, 80, 90, 100, 110, 120]


def test_workers_collapse_their_loaded_weights_where_offered_and_not_with_off(socket_dir):
    model = zoo_model(SPEC, "Q4_K_M")
    outputs, stats = {}, {}
    for setting in ("auto", "off"):
        daemon = DaemonProcess(model, socket_dir / f"huge-{setting}.sock", *ONE_PLACE, "--huge-pages", setting)
        try:
            with daemon.client() as client:
                stats[setting] = client.stats()
                outputs[setting] = [client.append("s", 1, 0, tokens=TOKENS[:8]).rows, client.append("s", 1, 8, tokens=TOKENS[8:]).rows]
        finally:
            assert daemon.stop() == 0
    mode = transparent_huge_pages()
    auto, off = stats["auto"], stats["off"]
    assert off.huge_pages == "--huge-pages off; the first worker's load: nothing asked (--huge-pages off)"
    if mode in OFFERED:
        assert auto.huge_pages.startswith("--huge-pages auto; the first worker's load: ")
        assert auto.huge_pages.endswith(f" s (transparent huge pages: {mode})") or "refused" in auto.huge_pages, auto.huge_pages
        asked = float(auto.huge_pages.split("the first worker's load: ")[1].split(" MiB")[0])
        assert asked >= 6 * 2, auto.huge_pages  # the repacked buffer's whole huge pages (the load's other mappings are smaller)
        if "refused" not in auto.huge_pages:
            assert all(worker.huge_page_bytes >= 12 * MIB for worker in auto.workers), [worker.huge_page_bytes for worker in auto.workers]
        if mode == "madvise":
            assert all(worker.huge_page_bytes == 0 for worker in off.workers), [worker.huge_page_bytes for worker in off.workers]
    else:
        assert auto.huge_pages == f"--huge-pages auto; the first worker's load: nothing asked (transparent huge pages: {mode or 'not offered'})"
    for with_them, without in zip(outputs["auto"], outputs["off"]):
        np.testing.assert_array_equal(with_them, without)  # same bits: where the weights sit changes no arithmetic
