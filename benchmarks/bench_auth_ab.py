"""A/B of one host-backend READ over forced TCP with and without auth_key, two agents in one process,
alternating three times (median of 150 reads each).  Run under bench-quiet."""
import time, numpy as np, statistics
from kvt import Agent
from kvt.config import load_config
def run(key, n=150, bs=65536, batch=64):
    env = {"KVT_AUTH_KEY": key} if key else {}
    a = Agent(config=load_config("host", options={"transport": "tcp"}, env=env))
    b = Agent(config=load_config("host", options={"transport": "tcp"}, env=env))
    src = np.ones((batch * 2, bs), np.uint8); dst = np.zeros_like(src)
    b.register_blocks("kv", [src]); a.register_blocks("kv", [dst])
    p = a.connect(b.listen()); ids = list(range(batch))
    for _ in range(10): a.read_blocks(p, ids, ids).wait()
    t = []
    for _ in range(n):
        t0 = time.perf_counter(); a.read_blocks(p, ids, ids).wait(); t.append(time.perf_counter() - t0)
    a.close(); b.close()
    return statistics.median(t) * 1e3
for bs, batch in ((65536, 64), (4096, 1024)):
    res = {k: [] for k in ("none", "key")}
    for _ in range(3):
        res["none"].append(run(None, bs=bs, batch=batch)); res["key"].append(run("k" * 20, bs=bs, batch=batch))
    print(bs, batch, {k: [round(x, 2) for x in v] for k, v in res.items()})
