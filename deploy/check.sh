#!/usr/bin/env bash
# Offline checks of deploy/ (no cluster, no Prometheus, no Grafana, no network):
#  1. renders the kustomizations (base, overlays/gpu) with `kubectl kustomize` and validates every
#     rendered object against the Kubernetes $K8S_VERSION schemas with kubernetes-validate --strict,
#     plus the deployment's own invariants (grace period > drain, HPA target < max_sessions, ...);
#  2. promtool: the Prometheus configuration, the alert rules and their unit tests;
#  3. the prometheus-adapter rules and every query of the Grafana dashboard (PromQL parsed by
#     promtool), the dashboard's layout, the provisioning files;
#  4. writes the sorted names of the antiphon_ metrics that the dashboard, the alert rules and the
#     adapter query (histograms without _bucket/_sum/_count) to $1, and checks each is defined in
#     src/ (a live test checks them against /metrics);
#  5. the nginx files of base/nginx/ are the same as their sources in deploy/nginx/ (where present).
# Optional: ANTIPHON_BIN=target/release/antiphon also runs `antiphon check-config` on both
# rendered antiphon.toml files (unknown keys are refused), with the image's paths mapped to stand-ins.
#
#   VENV=/tmp/antiphon-deploy-venv deploy/install-tools.sh     # once: the tools
#   VENV=/tmp/antiphon-deploy-venv deploy/check.sh [/tmp/antiphon-queried-metrics.txt]
# Tools: kubectl, kubernetes-validate and python (with PyYAML) from $VENV/bin when VENV is set,
# else from PATH; promtool from PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-/tmp/antiphon-queried-metrics.txt}
K8S_VERSION=${K8S_VERSION:-1.30.0}
step() { echo "== $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }
tool() { command -v "$1" || fail "$1 not found (install the tools: deploy/install-tools.sh; pass VENV=)"; }
if [ -n "${VENV:-}" ]; then
  KUBECTL=$(tool "$VENV/bin/kubectl")
  KVALIDATE=$(tool "$VENV/bin/kubernetes-validate")
  PY=$(tool "$VENV/bin/python")
else
  KUBECTL=$(tool kubectl)
  KVALIDATE=$(tool kubernetes-validate)
  PY=$(tool python3)
fi
PROMTOOL=$(tool promtool)
WORK=$(mktemp -d /tmp/antiphon-deploy-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

step "tools"
"$KUBECTL" version --client 2>/dev/null | head -2
echo "kubernetes-validate $("$KVALIDATE" --version)"
"$PROMTOOL" --version 2>&1 | head -1
"$PY" --version

step "kustomize: render base and overlays/gpu"
mkdir -p "$WORK/rendered"
"$KUBECTL" kustomize deploy/kubernetes/base > "$WORK/rendered/base.yaml"
"$KUBECTL" kustomize deploy/kubernetes/overlays/gpu > "$WORK/rendered/gpu.yaml"
wc -l "$WORK/rendered/base.yaml" "$WORK/rendered/gpu.yaml"

step "kubernetes-validate --strict, Kubernetes $K8S_VERSION"
"$KVALIDATE" --kubernetes-version "$K8S_VERSION" --strict --quiet "$WORK/rendered/base.yaml" "$WORK/rendered/gpu.yaml"
echo "every rendered object is valid"

step "the deployment's invariants"
"$PY" - "$WORK/rendered" <<'PY'
import re, sys, tomllib, yaml
d = sys.argv[1]
EXPECT = {"ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
for name in ("base", "gpu"):
    docs = [x for x in yaml.safe_load_all(open(f"{d}/{name}.yaml")) if x]
    by = {}
    for x in docs:
        by.setdefault(x["kind"], {})[x["metadata"]["name"]] = x
    def need(ok, what):
        if not ok:
            sys.exit(f"{name}: {what}")
    need(EXPECT <= set(by), f"kinds {sorted(EXPECT - set(by))} missing")
    sts = by["StatefulSet"]["antiphon"]
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    cm = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "config")
    toml_text = by["ConfigMap"][cm]["data"]["antiphon.toml"]
    open(f"{d}/{name}.antiphon.toml", "w").write(toml_text)
    cfg = tomllib.loads(toml_text)
    srv = cfg.get("server", {})
    drain = srv.get("shutdown_drain_s", 10)
    hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    need(re.search(r"kill -TERM 1\b", hook) and "kill -0 1" in hook, f"preStop does not drain the server and wait for it: {hook}")
    sleep = int(re.search(r"sleep (\d+);", hook).group(1))
    grace = pod["terminationGracePeriodSeconds"]
    need(grace >= drain + sleep + 5, f"terminationGracePeriodSeconds {grace} < shutdown_drain_s {drain} + preStop {sleep} + 5")
    need("replica_id" not in srv, "server.replica_id in antiphon.toml: it comes from the pod name")
    need(srv.get("listen", "").endswith(":8080") and not srv["listen"].startswith("127."), f"server.listen {srv.get('listen')!r}")
    need(c["args"][:3] == ["serve", "--config", "/etc/antiphon/antiphon.toml"], f"args {c['args']}")
    envs = {e["name"]: e for e in c.get("env", [])}
    need(envs.get("ANTIPHON_REPLICA_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
         "ANTIPHON_REPLICA_ID is not the pod name")
    need(c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz", "probes")
    need(sts["spec"]["podManagementPolicy"] == "Parallel", "podManagementPolicy")
    gov = by["Service"].get(sts["spec"]["serviceName"])
    # every pod's name resolves, ready or not (a full or draining replica still gets its resumes);
    # new sessions go to the ready pods only
    need(gov is not None and gov["spec"].get("clusterIP") == "None" and gov["spec"].get("publishNotReadyAddresses") is True,
         "the StatefulSet's serviceName is not a headless Service publishing not-ready pods")
    ready = by["Service"].get("antiphon-ready")
    need(ready is not None and ready["spec"].get("clusterIP") == "None" and ready["spec"].get("publishNotReadyAddresses") is False,
         "antiphon-ready is not a headless Service of the ready pods")
    book0 = by["ConfigMap"][by["Deployment"]["antiphon-proxy"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]]["data"]["replicas.conf"]
    need("server antiphon-ready." in book0 and "antiphon-pods." in book0, "replicas.conf: new sessions via antiphon-ready, resumes via antiphon-pods")
    need(by["Service"]["antiphon-proxy"]["spec"]["selector"].items() <= by["Deployment"]["antiphon-proxy"]["spec"]["template"]["metadata"]["labels"].items(),
         "antiphon-proxy selects no proxy pod")
    for svc in ("antiphon", "antiphon-pods", "antiphon-ready"):
        need(by["Service"][svc]["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items(), f"{svc} selects no replica")
    hpa = by["HorizontalPodAutoscaler"]["antiphon"]["spec"]
    need(hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "antiphon"}, "HPA target")
    m = hpa["metrics"][0]
    need(m["type"] == "Pods" and m["pods"]["metric"]["name"] == "antiphon_sessions", "HPA metric")
    target = float(m["pods"]["target"]["averageValue"])
    need(target < srv.get("max_sessions", 16), f"HPA averageValue {target} is not below server.max_sessions")
    need("replicas" not in sts["spec"], "StatefulSet.spec.replicas is set: the HPA owns it")
    px = by["Deployment"]["antiphon-proxy"]["spec"]["template"]["spec"]["containers"][0]
    pcm = by["Deployment"]["antiphon-proxy"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    need(set(by["ConfigMap"][pcm]["data"]) == {"nginx.conf", "routing.conf", "replicas.conf"}, "the proxy's ConfigMap keys")
    need(px["image"].startswith("nginx:"), "proxy image")
    # the address book names replicas antiphon-N.<serviceName>.<namespace>.svc: with a namespace
    # set by the kustomization, it must be that one (${POD_NAMESPACE} is filled in at start)
    book = by["ConfigMap"][pcm]["data"]["replicas.conf"]
    book_ns = set(re.findall(r"\." + re.escape(sts["spec"]["serviceName"]) + r"\.([a-z0-9-]+|\$\{POD_NAMESPACE\})\.svc\b", book))
    ns = sts["metadata"].get("namespace")
    need({x.get("metadata", {}).get("namespace") for x in docs if x["kind"] != "Namespace"} == {ns}, "objects in more than one namespace")
    if ns and book_ns:
        need(book_ns <= {ns, "${POD_NAMESPACE}"}, f"replicas.conf names namespace(s) {sorted(book_ns)}, the objects are in {ns}")
    gpu = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if name == "gpu":
        need(gpu == 1 and c["image"] == "antiphon:cuda", "GPU limit / image")
        need(cfg["model"]["device"].startswith("cuda") and cfg["model"]["dtype"] == "bf16" and cfg["model"]["source"] == "checkpoint", "GPU [model]")
        mounts = {v["mountPath"] for v in c["volumeMounts"]}
        need("/models" in mounts and cfg["model"]["path"].startswith("/models/"), "the checkpoint volume")
    else:
        need(gpu is None and c["image"] == "antiphon:latest" and cfg["model"]["device"] == "cpu", "base is CPU")
    print(f"{name}: {len(docs)} objects ({', '.join(sorted(f'{k}/{n}' for k in by for n in by[k]))}); "
          f"grace {grace}s > drain {drain}s + {sleep}s; HPA {target:g} < max_sessions {srv.get('max_sessions')}")
PY
if [ -n "${ANTIPHON_BIN:-}" ]; then
  step "antiphon check-config on the rendered antiphon.toml files ($ANTIPHON_BIN)"
  STAND=$WORK/stand-in
  mkdir -p "$STAND/share" "$STAND/models/MiniCPM-o-4_5/assets"
  cp -r web assets "$STAND/share/"
  echo '{}' > "$STAND/models/MiniCPM-o-4_5/config.json"
  cp assets/voices/default.wav "$STAND/models/MiniCPM-o-4_5/assets/HT_ref_audio.wav"
  for n in base gpu; do
    sed "s#\"/usr/share/antiphon/#\"$STAND/share/#g; s#\"/models/#\"$STAND/models/#g" "$WORK/rendered/$n.antiphon.toml" > "$WORK/$n.toml"
    "$ANTIPHON_BIN" check-config --file-only "$WORK/$n.toml"
  done
fi

step "promtool check config deploy/prometheus/prometheus.yml"
if "$PROMTOOL" check config deploy/prometheus/prometheus.yml > "$WORK/promtool-config.log" 2>&1; then
  cat "$WORK/promtool-config.log"
elif grep -q "field kubernetes_sd_configs not found" "$WORK/promtool-config.log"; then
  # Debian's promtool is built without Kubernetes discovery: check everything else with
  # kubernetes_sd_configs swapped for a static target, and the discovery blocks' keys here
  echo "(this promtool has no Kubernetes discovery: its blocks are checked here, the rest by promtool)"
  mkdir -p "$WORK/prometheus"
  cp deploy/prometheus/alerts.yml "$WORK/prometheus/"
  "$PY" - deploy/prometheus/prometheus.yml "$WORK/prometheus/prometheus.yml" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
KEYS = {"api_server", "role", "kubeconfig_file", "namespaces", "selectors", "attach_metadata", "basic_auth", "authorization",
        "oauth2", "proxy_url", "no_proxy", "proxy_from_environment", "proxy_connect_header", "follow_redirects",
        "enable_http2", "tls_config"}
ROLES = {"node", "pod", "service", "endpoints", "endpointslice", "ingress"}
n = 0
for sc in cfg["scrape_configs"]:
    for sd in sc.pop("kubernetes_sd_configs", []):
        n += 1
        bad = set(sd) - KEYS
        assert not bad, f"{sc['job_name']}: unknown kubernetes_sd_configs keys {bad}"
        assert sd["role"] in ROLES, f"{sc['job_name']}: role {sd['role']!r}"
        for s in sd.get("selectors", []):
            assert set(s) <= {"role", "label", "field"} and s["role"] in ROLES, f"{sc['job_name']}: selector {s}"
        ns = sd.get("namespaces", {})
        assert set(ns) <= {"own_namespace", "names"}, f"{sc['job_name']}: namespaces {ns}"
        sc.setdefault("static_configs", []).append({"targets": ["127.0.0.1:8080"]})
assert n, "no kubernetes_sd_configs"
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
print(f"{n} kubernetes_sd_configs block(s): keys, roles and selectors valid")
PY
  "$PROMTOOL" check config "$WORK/prometheus/prometheus.yml"
else
  cat "$WORK/promtool-config.log"
  fail "promtool check config"
fi

step "promtool check rules / test rules deploy/prometheus/alerts.yml"
"$PROMTOOL" check rules deploy/prometheus/alerts.yml
"$PROMTOOL" test rules deploy/prometheus/alerts.test.yml

step "the dashboard, the adapter rules, the provisioning files; the queried metrics"
"$PY" - "$WORK/queries.yml" "$WORK/metrics.txt" <<'PY'
import json, re, sys, yaml
queries = []  # (where, PromQL)

dash = json.load(open("deploy/grafana/antiphon.json"))
assert dash.get("schemaVersion", 0) >= 36, "schemaVersion"
names = {v["name"] for v in dash["templating"]["list"]}
assert {"datasource", "namespace", "pod"} <= names, f"variables {names}"
ids, cells = set(), {}
for p in dash["panels"]:
    assert p["id"] not in ids, f"panel id {p['id']} twice"
    ids.add(p["id"])
    g = p["gridPos"]
    assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, f"panel {p['title']!r} gridPos {g}"
    for x in range(g["x"], g["x"] + g["w"]):
        for y in range(g["y"], g["y"] + g["h"]):
            assert (x, y) not in cells, f"panels {cells[(x, y)]!r} and {p['title']!r} overlap"
            cells[(x, y)] = p["title"]
    if p["type"] == "row":
        continue
    assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, f"panel {p['title']!r} datasource"
    assert p.get("targets"), f"panel {p['title']!r} has no query"
    for t in p["targets"]:
        queries.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
for v in dash["templating"]["list"]:
    if v["type"] == "query":
        m = re.fullmatch(r"label_values\((.+), *(\w+)\)", v["query"]["query"])
        assert m, f"variable {v['name']}: {v['query']}"
        queries.append((f"variable {v['name']}", m.group(1)))
panels = sum(p["type"] != "row" for p in dash["panels"])

alerts = yaml.safe_load(open("deploy/prometheus/alerts.yml"))
rules = [r for g in alerts["groups"] for r in g["rules"]]
for r in rules:
    queries.append((f"alert {r['alert']}", r["expr"]))

adapter = yaml.safe_load(open("deploy/prometheus/adapter.yaml"))
for i, r in enumerate(adapter["rules"]):
    assert set(r) <= {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}, f"adapter rule {i}: keys {set(r)}"
    assert {"namespace", "pod"} <= set(r["resources"]["overrides"]), f"adapter rule {i}: resources"
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", r["seriesQuery"]).group(0)
    q = (r["metricsQuery"].replace("<<.Series>>", series)
         .replace("<<.LabelMatchers>>", 'namespace="antiphon",pod=~"antiphon-0|antiphon-1"').replace("<<.GroupBy>>", "pod"))
    assert "<<" not in q, f"adapter rule {i}: {q}"
    queries += [(f"adapter rule {i} seriesQuery", r["seriesQuery"]), (f"adapter rule {i} metricsQuery", q)]

for f in ("deploy/grafana/provisioning/datasources/antiphon.yaml", "deploy/grafana/provisioning/dashboards/antiphon.yaml"):
    assert yaml.safe_load(open(f))["apiVersion"] == 1, f

# each query as a recording rule, for promtool to parse (Grafana's variables given values)
subst = lambda e: (e.replace("$__rate_interval", "5m").replace("$__interval", "1m")
                   .replace('"$namespace"', '"antiphon"').replace('"$pod"', '".*"'))
rec = [{"record": f"check:q{i}", "expr": subst(e)} for i, (_, e) in enumerate(queries)]
for r, (where, _) in zip(rec, queries):
    assert "$" not in r["expr"], f"{where}: unreplaced variable in {r['expr']}"
yaml.safe_dump({"groups": [{"name": "queries", "rules": rec}]}, open(sys.argv[1], "w"), sort_keys=False)

metrics = set()
for _, e in queries:
    for m in re.findall(r"\bantiphon_[A-Za-z0-9_]+", e):
        metrics.add(re.sub(r"_(bucket|sum|count)$", "", m))
open(sys.argv[2], "w").write("".join(f"{m}\n" for m in sorted(metrics)))
print(f"dashboard: {panels} panels, variables {sorted(names)}; alert rules: {len(rules)}; adapter rules: {len(adapter['rules'])}; "
      f"{len(queries)} queries; {len(metrics)} antiphon_ metrics")
PY
"$PROMTOOL" check rules "$WORK/queries.yml" > "$WORK/queries.log" 2>&1 || { cat "$WORK/queries.log"; fail "a query does not parse"; }
echo "every query parses as PromQL ($(grep -o '[0-9]* rules found' "$WORK/queries.log"))"
if [ -d src ]; then
  missing=$(while read -r m; do grep -rqF "\"$m\"" src || echo "$m"; done < "$WORK/metrics.txt")
  [ -z "$missing" ] || fail "queried but not defined in src/: $missing"
  echo "each is defined in src/"
fi
mkdir -p "$(dirname "$OUT")"
cp "$WORK/metrics.txt" "$OUT"
echo "queried metrics -> $OUT:"
sed 's/^/  /' "$OUT"

step "nginx: base/nginx/ against deploy/nginx/"
for pair in routing.conf:routing.conf nginx.conf:nginx.conf replicas.kubernetes.conf:replicas.conf; do
  src=deploy/nginx/${pair%%:*}
  copy=deploy/kubernetes/base/nginx/${pair##*:}
  if [ -f "$src" ]; then
    cmp -s "$src" "$copy" || { diff -u "$src" "$copy" || true; fail "$copy differs from $src (cp $src $copy)"; }
    echo "$copy = $src"
  else
    echo "$src absent: $copy not compared"
  fi
done

echo "== deploy checks passed"
