"""What a client's send costs when it wakes a peer process sleeping in select / epoll / recv: 3 peers, each spinning
SPIN_MS on a request then answering 8 KiB; the client relays around them; the client's sendall wall time and CPU
a call. Usage: send_micro.py WAIT(select|epoll|recv) STEPS"""
import os, select, selectors, socket, sys, time
SPIN_S = 0.010
def peer(sock, wait):
    sel = selectors.EpollSelector() if wait == "epoll" else None
    if sel: sel.register(sock, selectors.EVENT_READ)
    while True:
        if wait == "select": select.select([sock], [], [])
        elif sel: sel.select()
        data = sock.recv(65536)
        if not data: return
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end: pass
        sock.sendall(b"x" * 8192)
def main():
    wait, steps = sys.argv[1], int(sys.argv[2])
    socks = []
    for k in range(3):
        a, b = socket.socketpair()
        if os.fork() == 0:
            a.close(); peer(b, wait); os._exit(0)
        b.close(); socks.append(a)
    send_wall = send_cpu = 0.0; total = time.perf_counter()
    for i in range(steps):
        for s in socks:
            w, c = time.perf_counter(), time.thread_time()
            s.sendall(b"y" * 8192)
            send_cpu += time.thread_time() - c; send_wall += time.perf_counter() - w
            got = 0
            while got < 8192: got += len(s.recv(65536))
    total = time.perf_counter() - total
    print(f"{wait:6s}: sendall {send_wall / steps / 3 * 1e6:.1f} us wall, {send_cpu / steps / 3 * 1e6:.1f} us CPU a call; a round of 3 hops {total / steps * 1e3:.3f} ms (spin 3 x {SPIN_S * 1e3:.0f})")
    for s in socks: s.close()
    for k in range(3): os.wait()
main()
