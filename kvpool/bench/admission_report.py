"""The report of sections 5 and 6 on the whole-model daemon (measured by kvpool.bench.admission):
admission, release, reclaim and LRU eviction against bare llama contexts; memory charged and measured
against the theoretical KV size."""

from __future__ import annotations

import math

from kvpool.bench.options import SESSIONS, as_mib, median_of
from kvpool.bench.table import Row, headline, ms
from kvpool.bench.targets import HOT_PATH_TARGETS


def summarize_admission(results: dict) -> tuple[dict, dict, list[Row]]:
    """Section 5's medians, headline ratio and table rows."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []

    admission = results["admission"]
    spares = "admits_into_spare" in admission  # a release kept its context as the worker's spare (results written since)
    decode_step = median_of(admission["decode_s"])
    summary["s5_daemon_decode_step_s"] = decode_step
    for n_ctx in results["options"]["admit_n_ctx"]:
        key = str(n_ctx)
        admit = median_of(admission["admit_s"][key])
        inprocess = median_of(admission["inprocess_admit_s"][key])
        bare = median_of(admission["bare_create_s"][key])
        net = admit - decode_step
        summary.update({f"s5_admit_{n_ctx}_s": admit, f"s5_inprocess_admit_{n_ctx}_s": inprocess, f"s5_bare_create_{n_ctx}_s": bare})
        into = admission["admits_into_spare"][key] if spares else 0
        where = f" ({into} of {len(admission['admit_s'][key])} into the context the release before left as its worker's spare)" if spares else ""
        rows.append(Row("5", f"admit n_ctx {n_ctx} on a warm worker{where}: admitting 1-token append vs in-process create + 1-token append",
                        ms(admit), ms(inprocess), f"{admit / inprocess:.2f}x time"))
        if into:  # no context created: the admitting append costs about a decode step, and a decode median taken apart
            # is no measure of its own compute (their difference is noise, of either sign): the two side by side
            rows.append(Row("5", "  the admitting append, its context a spare (none created), vs a 1-token decode through the daemon",
                            ms(admit), ms(decode_step), f"{admit / decode_step:.2f}x time"))
        else:
            rows.append(Row("5", f"  admission alone (minus a {ms(decode_step)} decode through the daemon) vs a bare llama context create",
                            ms(net), ms(bare), f"{net / bare:.2f}x time"))
        if key in admission.get("create_admit_s", {}):  # admissions that create their context (results written since)
            creates = admission["create_admit_s"][key]
            create = median_of(creates)
            summary[f"s5_create_admit_{n_ctx}_s"] = create
            freeing = admission["creates_freeing_a_spare"][key]
            rows.append(Row("5", f"  admit an n_ctx no spare holds ({n_ctx - len(creates)}..{n_ctx - 1}, one each: {len(creates) - admission['creates_into_spare'][key]} "
                                 f"of {len(creates)} created their context, {freeing} of them freeing another size's spare first, in fresh memory: "
                                 f"a worker gives freed memory back at once): admitting 1-token append vs in-process create + 1-token append at {n_ctx}",
                            ms(create), ms(inprocess), f"{create / inprocess:.2f}x time"))
            rows.append(Row("5", f"  that admission alone (minus a {ms(decode_step)} decode through the daemon) vs a bare llama context create at {n_ctx} "
                                 "(created again and again in one process: in memory the last one freed)",
                            ms(create - decode_step), ms(bare), f"{(create - decode_step) / bare:.2f}x time"))
    first = admission["first_admit_s"]
    firsts = []
    for n_ctx in results["options"]["admit_n_ctx"]:
        value = first[str(n_ctx)]
        steady = median_of(admission["admit_s"][str(n_ctx)])
        if value is None:
            firsts.append(f"{n_ctx}: at daemon start")
        else:
            summary[f"s5_first_admit_{n_ctx}_s"] = value
            firsts.append(f"{n_ctx}: {ms(value)} (+{ms(value - steady)})")
    rows.append(Row("5", "first admission of an n_ctx (charges are fitted at start-up: no admission measures; it creates its context)", "; ".join(firsts),
                    "steady state above", ""))
    unseen = [n for n in results["options"]["admit_n_ctx"] if first[str(n)] is not None]
    if unseen:
        largest = max(unseen)
        bare_create = median_of(admission["bare_create_s"][str(largest)])
        first_net = first[str(largest)] - decode_step  # the admitting append's decode left out, as in the rows above
        first_vs_bare = first_net / bare_create
        ratios["first_admission_vs_bare"] = headline(first_vs_bare, HOT_PATH_TARGETS["first_admission_vs_bare"], at_most=True)
        rows.append(Row("5", f"first admission of an unseen n_ctx ({largest}), its 1-token decode left out, vs a bare llama context creation",
                        ms(first_net), ms(bare_create), f"{first_vs_bare:.2f}x time", f"<= {HOT_PATH_TARGETS['first_admission_vs_bare']:.2f}: {'met' if first_vs_bare <= HOT_PATH_TARGETS['first_admission_vs_bare'] else 'MISSED'}"))
    release = median_of([v for values in admission["release_s"].values() for v in values])
    visible = median_of([v for values in admission["reclaim_visible_s"].values() for v in values])
    free = median_of([v for values in admission["bare_free_s"].values() for v in values])
    kept = {n_ctx: median_of(values) for n_ctx, values in admission["uss_kept_bytes"].items()}
    summary.update({"s5_release_s": release, "s5_reclaim_visible_s": visible, "s5_bare_free_s": free})
    summary.update({f"s5_uss_kept_{n_ctx}_bytes": value for n_ctx, value in kept.items()})
    if spares:  # the release frees nothing: its context stays, charged to the worker's spare
        rows.append(Row("5", "release -> bytes available: release round trip (the context kept as the worker's spare, charged apart: no llama_free); "
                             "until a stats reply shows reserved dropped", f"{ms(release)}; {ms(visible)}", f"llama_free {ms(free)} (not called)", ""))
    else:
        rows.append(Row("5", "release -> bytes available: release round trip; until a stats reply shows reserved dropped",
                        f"{ms(release)}; {ms(visible)}", f"llama_free {ms(free)}", f"{release / free:.1f}x time"))
    rows.append(Row("5", "  workers' USS still held after release (vs before the admission), by n_ctx"
                         + (" (the spare a release keeps is in both readings)" if spares else ""),
                    "; ".join(f"{n_ctx}: {as_mib(value):+.1f} MiB" for n_ctx, value in kept.items()), "", ""))
    evict = median_of(admission["evict_admit_s"])
    creating = "2048" in admission.get("create_admit_s", {})  # compared with an admission that creates its context, as the evicting one does
    admit_2048 = median_of(admission["create_admit_s" if creating else "admit_s"].get("2048", [math.nan]))
    summary.update({"s5_evict_admit_s": evict, "s5_evictions_counted": admission["evictions_counted"]})
    rows.append(Row("5", f"LRU eviction + admission, n_ctx 2048, all {SESSIONS} workers bound ({admission['evictions_counted']} evictions counted, "
                         f"{admission.get('evicted_victims_parked', 0)} of them parked in the warm tier)",
                    ms(evict), f"admit on a free worker {ms(admit_2048)}" + (" (creating its context, as the evicting one does)" if creating
                                                                              else " (into a spare; the evicting admission creates its context)" if spares else ""),
                    f"{evict / admit_2048:.2f}x time"))
    return summary, ratios, rows


def summarize_memory(results: dict) -> tuple[dict, dict, list[Row]]:
    """Section 6's figures and table rows."""
    summary: dict[str, float | int | bool] = {}
    rows: list[Row] = []

    memory = results["memory"]
    for n_ctx in results["options"]["admit_n_ctx"]:
        figures = memory["per_session"][str(n_ctx)]
        charged, theory, growth = figures["charged_bytes"], figures["theoretical_kv_bytes"], figures["uss_growth_bytes"]
        summary.update({f"s6_charged_{n_ctx}_bytes": charged, f"s6_theory_{n_ctx}_bytes": theory, f"s6_uss_over_start_{n_ctx}_bytes": growth})
        held = figures["held_before_bytes"]
        summary[f"s6_held_before_{n_ctx}_bytes"] = held
        rows.append(Row("6", f"one session n_ctx {n_ctx}: charged; its worker's USS over its start-up USS (before the admission {as_mib(held):+.1f} MiB: "
                             "a released session's context kept as its spare, or freed memory the allocator kept) vs theoretical KV "
                             "(n_ctx x every layer's K and V widths x f16)",
                        f"{as_mib(charged):.1f} MiB; {as_mib(growth):.1f} MiB", f"{as_mib(theory):.1f} MiB",
                        f"{charged / theory:.2f}x; {growth / theory:.2f}x"))
    totals = memory["daemon_uss_bytes"]
    n_ctx = memory["daemon_sessions_n_ctx"]
    per_added = (totals[str(SESSIONS)] - totals["0"]) / SESSIONS
    theory = n_ctx * memory["kv_bytes_per_position"]
    summary.update({f"s6_daemon_uss_{count}_bytes": value for count, value in totals.items()})
    # the figure at 1 session (in the JSON) is left out: the other workers may still hold the spares earlier
    # sessions left; with all SESSIONS workers bound there is none
    rows.append(Row("6", f"whole-model daemon USS (supervisor + {SESSIONS} workers) at start-up / with {SESSIONS} sessions of n_ctx {n_ctx}",
                    " / ".join(f"{as_mib(totals[key]):.0f}" for key in ("0", str(SESSIONS))) + " MiB",
                    f"+{as_mib(theory):.1f} MiB KV per session", f"+{as_mib(per_added):.1f} MiB per session = {per_added / theory:.2f}x"))
    return summary, {}, rows
