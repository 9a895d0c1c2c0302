"""Two antiphon replicas behind real nginx with the shipped routing config (deploy/nginx/).

Starts two replicas of the embedded default on loopback ports with different replica ids, and
nginx in front with deploy/nginx/{nginx.conf,routing.conf} and the fixed-address book
replicas.local.conf.template (only the ports are filled in). Then, through nginx:

1. the independent protocol client (tests/client/realtime_client.py: basic exchange, many forced
   drops with resume, bad input, cancel, a duplex drop): every resume must land on the replica
   that holds its session, or it would get session_not_found and the client fails;
2. both replicas took sessions, and their resumes add up;
3. `promtool check metrics` on each replica's /metrics, and every metric the dashboard and the
   alert rules query (the list deploy/check.sh writes) is in a live /metrics;
4. one replica killed (SIGKILL): the other's session goes on untouched, a resume of the dead
   replica's session gets session_not_found from the survivor, new sessions land on the survivor;
5. the survivor drained with SIGTERM: its client gets session.closing, and it exits.

  python tests/deploy/two_replicas.py --antiphon target/release/antiphon [--queried FILE]
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "client"))
import realtime_client as rc  # noqa: E402  (the independent client's connection helpers)

REPLICAS = ("replica-a", "replica-b")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_until(pred, what, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.25)
    rc.check(False, f"timed out waiting for {what}")


def metric(text, name):
    """The value of an unlabelled sample `name` in Prometheus text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


class Cluster:
    def __init__(self, antiphon, nginx, tmp):
        self.antiphon, self.nginx, self.tmp = antiphon, nginx, tmp
        self.ports = {r: free_port() for r in REPLICAS}
        self.proxy_port = free_port()
        self.procs = {}

    def start_replica(self, r):
        log = open(os.path.join(self.tmp, f"{r}.log"), "w")
        p = subprocess.Popen([self.antiphon, "serve", "--listen", f"127.0.0.1:{self.ports[r]}", "--replica-id", r],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.procs[r] = p

    def base(self, r):
        return f"http://127.0.0.1:{self.ports[r]}"

    def wait_ready(self, r, timeout=300):
        def ready():
            rc.check(self.procs[r].poll() is None, f"{r} exited: see {self.tmp}/{r}.log")
            return json.loads(http(self.base(r) + "/readyz")).get("ready") is True
        wait_until(ready, f"{r} ready", timeout)

    def start_proxy(self):
        d = os.path.join(self.tmp, "nginx")
        os.makedirs(d)
        src = os.path.join(ROOT, "deploy", "nginx")
        shutil.copy(os.path.join(src, "nginx.conf"), d)
        routing = open(os.path.join(src, "routing.conf")).read()
        rc.check("listen 8080;" in routing, "routing.conf listens on 8080")
        open(os.path.join(d, "routing.conf"), "w").write(routing.replace("listen 8080;", f"listen 127.0.0.1:{self.proxy_port};"))
        book = open(os.path.join(src, "replicas.local.conf.template")).read()
        book = book.replace("PORT_A", str(self.ports["replica-a"])).replace("PORT_B", str(self.ports["replica-b"]))
        open(os.path.join(d, "replicas.conf"), "w").write(book)
        conf = os.path.join(d, "nginx.conf")
        t = subprocess.run([self.nginx, "-t", "-c", conf, "-p", d], capture_output=True, text=True)
        rc.check(t.returncode == 0, f"nginx -t: {t.stderr}")
        log = open(os.path.join(self.tmp, "nginx.log"), "w")
        self.procs["nginx"] = subprocess.Popen([self.nginx, "-c", conf, "-p", d, "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: http(self.proxy("http") + "/proxy/healthz").strip() == "ok", "nginx", 30)

    def proxy(self, scheme="ws"):
        return f"{scheme}://127.0.0.1:{self.proxy_port}"

    def metrics(self, r):
        return http(self.base(r) + "/metrics")

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


async def new_session(url):
    c = await rc.Conn.open(url)
    await c.send(rc.CREATE)
    created = await c.event("session.created")
    return c, created


async def one_turn(c, text, seq):
    await c.send({"type": "input.text", "text": text, "seq": seq, "generation": rc.gen(10)})
    ms = await c.until(rc.is_done)
    rc.check(rc.is_done(ms[-1]) and ms[-1][1].get("status") == "completed", f"response: {ms[-3:]}")
    return ms


def owner(created):
    return created["session_id"].split(".", 1)[0]


async def failover(cl):
    url = cl.proxy() + "/v1/realtime"
    # a session on each replica (least connections alternates; open until both are held)
    held = {}
    extra = []
    for _ in range(8):
        c, created = await new_session(url)
        r = owner(created)
        rc.check(r in REPLICAS, f"session id {created['session_id']} names a replica")
        if r in held:
            extra.append(c)
        else:
            held[r] = (c, created)
        if len(held) == 2:
            break
    rc.check(len(held) == 2, f"new sessions reach both replicas: {list(held)}")
    for c in extra:
        await c.close()
    (ca, a), (cb, b) = held["replica-a"], held["replica-b"]
    await one_turn(cb, "before the kill", 1)
    cl.procs["replica-a"].send_signal(signal.SIGKILL)
    cl.procs["replica-a"].wait()
    # the survivor's session goes on, on the same socket and across a drop and resume
    await one_turn(cb, "after the kill", 2)
    cb.cut()
    cb = await rc.Conn.open(rc.resume_url(url, b["session_id"]))
    await cb.send({"type": "session.resume", "session_id": b["session_id"], "resume_token": b["resume_token"], "last_seq": 0})
    r = await cb.event("session.resumed")
    rc.check(r["input_seq"] == 2, f"resumed on the survivor: {r}")
    # the dead replica's session: a live replica answers session_not_found
    ca.cut()
    cz = await rc.Conn.open(rc.resume_url(url, a["session_id"]))
    await cz.send({"type": "session.resume", "session_id": a["session_id"], "resume_token": a["resume_token"], "last_seq": 0})
    m = await cz.event("error")
    rc.check(m["code"] == "session_not_found", f"a resume of the dead replica's session: {m}")
    await cz.close()
    # new sessions land on the survivor
    for i in range(4):
        c, created = await new_session(url)
        rc.check(owner(created) == "replica-b", f"new session {i} after the kill: {created['session_id']}")
        await c.close()
    print("ok   replica-a killed: replica-b's session went on, a-resume -> session_not_found, new sessions on replica-b")
    return cb


async def drain(cl, cb):
    await cb.send({"type": "input.text", "text": "during the drain", "seq": 3, "generation": rc.gen(200)})
    await cb.event("response.created")
    cl.procs["replica-b"].send_signal(signal.SIGTERM)
    ms = await cb.until(lambda m: m[0] == "closed", timeout=90)
    events = [m[1] for m in ms if m[0] == "event"]
    closing = [e for e in events if e["type"] == "session.closing"]
    rc.check(closing and closing[0].get("reason") == "shutdown", f"session.closing on SIGTERM: {events[-3:]}")
    # the response in flight finishes within the drain period (the tiny model makes 200 codes in
    # well under server.shutdown_drain_s), and the socket then closes with 1001 (going away)
    done = [e for e in events if e["type"] == "response.done"]
    rc.check(done and done[0]["status"] == "completed", f"the response in flight completes: {done}")
    rc.check(ms[-1] == ("closed", 1001), f"close 1001 after the drain: {ms[-1]}")
    rc.check(cl.procs["replica-b"].wait(timeout=60) is not None, "replica-b exits after its drain")
    print("ok   replica-b drained on SIGTERM: session.closing, the response in flight completed, close 1001, the process exited")


async def failover_then_drain(cl):
    cb = await failover(cl)
    await drain(cl, cb)


def check_metrics(cl, promtool, queried):
    for r in REPLICAS:
        text = cl.metrics(r)
        if promtool:
            p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
            rc.check(p.returncode == 0, f"promtool check metrics on {r}: {p.stdout}{p.stderr}")
        rc.check(f'antiphon_replica_info{{replica="{r}"}} 1' in text, f"{r} names itself in /metrics")
    if queried:
        names = [n.strip() for n in open(queried) if n.strip()]
        rc.check(names, f"{queried} lists the queried metrics")
        live = cl.metrics("replica-a") + cl.metrics("replica-b")
        families = {line.split()[2] for line in live.splitlines() if line.startswith("# TYPE ")}
        missing = [n for n in names if n not in families]
        rc.check(not missing, f"queried by the dashboard or the rules but not in a live /metrics: {missing}")
        print(f"ok   all {len(names)} metrics the dashboard and the alert rules query are in a live /metrics")
    print("ok   promtool check metrics passes on both replicas" if promtool else "skip promtool (not given)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--antiphon", default=os.path.join(ROOT, "target", "release", "antiphon"))
    ap.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    ap.add_argument("--promtool", default=shutil.which("promtool"))
    ap.add_argument("--queried", help="the metric names deploy/check.sh wrote")
    ap.add_argument("--drops", type=int, default=50)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="antiphon-deploy-")
    cl = Cluster(a.antiphon, a.nginx, tmp)
    try:
        for r in REPLICAS:
            cl.start_replica(r)
        for r in REPLICAS:
            cl.wait_ready(r)
        cl.start_proxy()
        print(f"ok   two replicas (ports {cl.ports}) behind nginx on {cl.proxy_port}")
        before = {r: cl.metrics(r) for r in REPLICAS}
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "client", "realtime_client.py"), cl.proxy() + "/v1/realtime",
                            "--drops", str(a.drops)], capture_output=True, text=True, timeout=600)
        print(p.stdout, end="")
        rc.check(p.returncode == 0, f"the independent client through nginx: {p.stdout[-2000:]}{p.stderr[-2000:]}")
        after = {r: cl.metrics(r) for r in REPLICAS}
        created = {r: metric(after[r], "antiphon_sessions_created_total") - metric(before[r], "antiphon_sessions_created_total") for r in REPLICAS}
        resumes = {r: metric(after[r], "antiphon_resumes_total") - metric(before[r], "antiphon_resumes_total") for r in REPLICAS}
        rc.check(all(v > 0 for v in created.values()), f"both replicas took sessions: {created}")
        rc.check(sum(resumes.values()) >= a.drops + 1, f"every forced drop resumed on its replica: {resumes}")
        print(f"ok   through nginx: sessions per replica {created}, resumes per replica {resumes}, each on its owner")
        check_metrics(cl, a.promtool, a.queried)
        asyncio.run(failover_then_drain(cl))
        print("deploy checks passed")
    finally:
        cl.stop()


if __name__ == "__main__":
    main()
