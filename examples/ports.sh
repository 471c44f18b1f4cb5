# ports.sh - sourced by the demos: port prints a free TCP port on
# 127.0.0.1 below Linux's ephemeral range (32768-60999), where a client
# that connects before its server binds cannot connect to itself (TCP
# self-connect) and hold the port.
port() {
  python3 -c 'import random, socket
for _ in range(200):
    p = random.randrange(20000, 32000); s = socket.socket()
    try: s.bind(("127.0.0.1", p)); print(p); break
    except OSError: pass
    finally: s.close()'
}
