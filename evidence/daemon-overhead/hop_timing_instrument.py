"""Applied to the working tree for a probe run only (evidence/daemon-overhead/hop_ab.sh; `git checkout -- kvpool workers`
undoes it): timing marks in workers/server/direct.py (_serve, _append) and around llama_decode in
workers/runtime/context.py, each worker writing its marks to /tmp/fine_times.PID.json when its channel closes."""
import pathlib
import sys
ROOT = pathlib.Path(__file__).resolve().parents[2]
p = ROOT / "workers/server/direct.py"
s = open(p).read()
def rep(a, b):
    global s
    assert a in s, a
    s = s.replace(a, b)
rep('''    def _serve(self, peer: Peer) -> None:
        request = read_append(peer)
        if request is None:
            return''', '''    def _serve(self, peer: Peer) -> None:
        t_in = time.perf_counter()
        request = read_append(peer)
        _T.append([t_in, time.perf_counter()])
        if request is None:
            _T.pop()
            return''')
rep('''        send(peer, self._append(request))

    def _drop''', '''        reply = self._append(request)
        _T[-1].append(time.perf_counter())
        send(peer, reply)
        _T[-1].append(time.perf_counter())

    def _drop''')
rep('''            check_position(request.start_pos, context.length, rows.shape[0], context.n_ctx)
''', '''            check_position(request.start_pos, context.length, rows.shape[0], context.n_ctx)
            _T[-1].append(time.perf_counter())
''')
rep('''        words = self.words
        words.busy_since.value''', '''        _T[-1].append(time.perf_counter())
        words = self.words
        words.busy_since.value''')
rep('''            with server.compute:
''', '''            _T[-1].append(time.perf_counter())
            with server.compute:
                _T[-1].append(time.perf_counter())
''')
rep('''        words.appends.value += 1''', '''        _T[-1].append(time.perf_counter())
        words.appends.value += 1''')
rep('''def listen(address: str)''', '''_T = []


def listen(address: str)''')
rep('''    def close(self) -> None:
        """Drop every peer''', '''    def close(self) -> None:
        import json, os
        with open(f"/tmp/fine_times.{os.getpid()}.json", "w") as f:
            json.dump(_T, f)
        """Drop every peer''')
open(p, "w").write(s)
p = ROOT / "workers/runtime/context.py"
s = open(p).read()
rep('''            status = llama_cpp.llama_decode(ctx, batch)''', '''            import workers.server.direct as _d, time as _t
            if _d._T: _d._T[-1].append(_t.perf_counter())
            status = llama_cpp.llama_decode(ctx, batch)
            if _d._T: _d._T[-1].append(_t.perf_counter())''')
open(p, "w").write(s)
