"""The rendered manifests' invariants (run by check.sh, with the venv's python and kubectl)."""

import json
import os
import re
import subprocess
import sys
import tomllib
import unittest

import yaml

DEPLOY = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DEPLOY)
OVERLAYS = ["base", "overlays/sim", "overlays/vllm", "overlays/sglang", "loadgen"]
# The overlays of a real engine's fleet: the StatefulSet, its Service and policies share its name.
ENGINES = {"overlays/vllm": "vllm", "overlays/sglang": "sglang"}


KUBECTL = os.path.join(os.path.dirname(sys.executable), "kubectl")


def rendered(overlay):
    """The objects kustomize (kubectl's own) renders from `overlay`."""
    out = subprocess.run(
        [KUBECTL, "kustomize", os.path.join(DEPLOY, overlay)], check=True, capture_output=True, text=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def pod_specs(obj):
    """Every pod spec inside a workload (Deployment, StatefulSet, Job, CronJob, Pod, ...)."""
    spec = obj.get("spec", {})
    if obj.get("kind") == "Pod":
        return [spec]
    if obj.get("kind") == "CronJob":
        return [spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec", {})]
    if "template" in spec:
        return [spec["template"].get("spec", {})]
    return []


def one(resources, kind, prefix=""):
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"].startswith(prefix)]
    assert len(found) == 1, f"{kind} {prefix}: {len(found)}"
    return found[0]


class Manifests(unittest.TestCase):
    def test_every_overlay_renders_with_namespaces_and_hashed_config(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                res = rendered(overlay)
                for r in res:
                    if r["kind"] != "Namespace":
                        self.assertEqual(r["metadata"].get("namespace"), "kvroute", r["metadata"]["name"])
                config_maps = {r["metadata"]["name"] for r in res if r["kind"] == "ConfigMap"}
                for r in res:
                    for pod in pod_specs(r):
                        for v in pod.get("volumes", []):
                            if "configMap" in v:
                                self.assertIn(v["configMap"]["name"], config_maps)

    def test_router_deployment(self):
        for overlay in ["base", "overlays/sim", *ENGINES]:
            with self.subTest(overlay=overlay):
                res = rendered(overlay)
                d = one(res, "Deployment", "kvroute-router")
                self.assertEqual(d["spec"]["replicas"], 2)
                pod = d["spec"]["template"]
                self.assertEqual(pod["metadata"]["annotations"]["prometheus.io/scrape"], "true")
                c = pod["spec"]["containers"][0]
                self.assertEqual(c["readinessProbe"]["httpGet"]["path"], "/ready")
                self.assertEqual(c["livenessProbe"]["httpGet"]["path"], "/health")
                # Both on the health port: the proxy port's connections may all be taken.
                for probe in ["readinessProbe", "livenessProbe"]:
                    self.assertEqual(c[probe]["httpGet"]["port"], "health", probe)
                self.assertIn("requests", c["resources"])
                env = {e["name"]: e for e in c["env"]}
                # Client API keys come from a Secret only if one was made: the API is open without.
                keys = env["KVROUTE_API_KEY"]["valueFrom"]["secretKeyRef"]
                self.assertEqual((keys["name"], keys.get("optional")), ("kvroute-api-keys", True))
                for threads in ["KVROUTE_HTTP_THREADS", "TOKIO_WORKER_THREADS"]:
                    field = env[threads]["valueFrom"]["resourceFieldRef"]
                    self.assertEqual((field["containerName"], field["resource"]), (c["name"], "requests.cpu"), threads)
                self.assertTrue(c["securityContext"]["readOnlyRootFilesystem"])
                self.assertTrue(pod["spec"]["securityContext"]["runAsNonRoot"])
                self.assertEqual(pod["spec"]["serviceAccountName"], "kvroute-router")
                budget = one(res, "PodDisruptionBudget", "kvroute-router")["spec"]
                # Routers are unready while no replica serves: a drain must not wait on them.
                self.assertEqual(budget["unhealthyPodEvictionPolicy"], "AlwaysAllow")
                # Admin changes reach every router: admin is only on the headless Service.
                services = {r["metadata"]["name"]: r for r in res if r["kind"] == "Service"}
                ports = {p["name"] for p in services["kvroute-router"]["spec"]["ports"]}
                self.assertNotIn("grpc-admin", ports, "admin behind a load balancer reaches one router")
                admin = services["kvroute-router-admin"]
                self.assertEqual(admin["spec"]["clusterIP"], "None", "headless: one address per router")
                policy = one(res, "NetworkPolicy", "kvroute-router")
                open_ports = [p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]]
                self.assertEqual(open_ports, ["http", "health"], "only the API and the health port are open to every pod")
                # A scraper reaches the port the pod says to scrape.
                scraped = pod["metadata"]["annotations"]["prometheus.io/port"]
                named = {str(p["containerPort"]): p["name"] for p in c["ports"]}
                self.assertIn(named[scraped], open_ports)
                # In-flight requests get the router's default drain timeout (590 s, and a
                # second for the streams' error events) after the preStop sleep, and the
                # router exits before the grace period is out.
                pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
                self.assertGreater(pod["spec"]["terminationGracePeriodSeconds"] - pre_stop, 591)
                role = one(res, "Role", "kvroute-router-discovery")
                self.assertEqual(
                    role["rules"],
                    [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                      "verbs": ["list", "watch"]}],
                    "least privilege: read EndpointSlices only",
                )

    def test_the_load_test_sends_the_optional_loadgen_key(self):
        job = one(rendered("loadgen"), "Job", "kvroute-loadgen-compare")
        env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        key = env["KVROUTE_LOADGEN_API_KEY"]["valueFrom"]["secretKeyRef"]
        self.assertEqual((key["name"], key["key"], key.get("optional")), ("kvroute-api-keys", "loadgen", True))

    def test_baseline_router_is_sized_like_the_router(self):
        """`compare`'s round-robin baseline gets the threads and health port the cache-aware
        router has, so the two differ only in their policy."""
        template = one(rendered("loadgen"), "Deployment", "kvroute-router-baseline")["spec"]["template"]
        c = template["spec"]["containers"][0]
        router = one(rendered("base"), "Deployment", "kvroute-router")["spec"]["template"]
        self.assertEqual(template["metadata"]["annotations"], router["metadata"]["annotations"], "scraped alike")
        env = {e["name"]: e for e in c["env"]}
        self.assertEqual(env["KVROUTE_POLICY"]["value"], "round-robin")
        for threads in ["KVROUTE_HTTP_THREADS", "TOKIO_WORKER_THREADS"]:
            field = env[threads]["valueFrom"]["resourceFieldRef"]
            self.assertEqual((field["containerName"], field["resource"]), (c["name"], "requests.cpu"), threads)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ["livenessProbe", "readinessProbe"]:
            self.assertEqual(c[probe]["httpGet"]["port"], "health", f"{probe} outside the proxy's connection limit")
        # Its streams get the cache-aware router's time to end when it is deleted mid-run.
        mine = router["spec"]["containers"][0]
        self.assertEqual(c["lifecycle"], mine["lifecycle"])
        grace = "terminationGracePeriodSeconds"
        self.assertEqual(template["spec"].get(grace), router["spec"][grace])
        self.assertTrue(env["KVROUTE_HEALTH_LISTEN"]["value"].endswith(f":{ports['health']}"))

    def test_fleets_expose_the_named_ports_discovery_reads(self):
        for overlay, service, engine in [("overlays/sim", "kvroute-agent", "kvroute"), *((o, e, e) for o, e in ENGINES.items())]:
            with self.subTest(overlay=overlay):
                res = rendered(overlay)
                svc = one(res, "Service", service)
                self.assertEqual(svc["spec"]["clusterIP"], "None", "headless")
                names = {p["name"] for p in svc["spec"]["ports"]}
                self.assertTrue({"http", "kv-events", "kv-replay"} <= names, names)
                cm = one(res, "ConfigMap", "kvroute-router-config")
                config = tomllib.loads(cm["data"]["router.toml"])
                self.assertEqual(config["discovery"], "k8s")
                self.assertEqual(config["discovery-service"], service)
                self.assertEqual(config["discovery-engine"], engine)
                self.assertEqual(one(res, "StatefulSet")["spec"]["serviceName"], service)

    def test_engine_pods_stop_gracefully_and_keep_their_event_ports_to_the_routers(self):
        for overlay, engine in ENGINES.items():
            with self.subTest(overlay=overlay):
                self.engine_pods_stop_gracefully_and_keep_their_event_ports_to_the_routers(overlay, engine)

    def engine_pods_stop_gracefully_and_keep_their_event_ports_to_the_routers(self, overlay, engine):
        res = rendered(overlay)
        pod = one(res, "StatefulSet", engine)["spec"]["template"]
        c = pod["spec"]["containers"][0]
        router = one(res, "Deployment", "kvroute-router")["spec"]["template"]["spec"]
        # The engine lets running requests finish for as long as a router waits for a stream
        # (vLLM for its --shutdown-timeout; SGLang until none runs), and Kubernetes waits for
        # that after the engine's own preStop sleep.
        router_c = router["containers"][0]
        router_wait = router["terminationGracePeriodSeconds"] - router_c["lifecycle"]["preStop"]["sleep"]["seconds"]
        shutdown = router_wait
        if engine == "vllm":
            (shutdown,) = [int(a.split("=")[1]) for a in c["args"] if a.startswith("--shutdown-timeout=")]
            self.assertGreaterEqual(shutdown, router_wait)
            self.assertFalse(any(a.startswith("--model") for a in c["args"]), "vllm serve takes the model as its argument")
        self.assertGreater(
            pod["spec"]["terminationGracePeriodSeconds"], c["lifecycle"]["preStop"]["sleep"]["seconds"] + shutdown
        )
        for probe in ["readinessProbe", "livenessProbe"]:
            self.assertGreaterEqual(c[probe]["timeoutSeconds"], 5, f"{probe}: a busy engine answers late")
        budget = one(res, "PodDisruptionBudget", engine)["spec"]
        self.assertEqual((budget["maxUnavailable"], budget["unhealthyPodEvictionPolicy"]), (1, "AlwaysAllow"))
        # Chat templates that print the date: the router and the engine render it alike.
        zone = lambda container: {e["name"]: e.get("value") for e in container["env"]}.get("TZ")
        self.assertEqual((zone(c), zone(router_c)), ("UTC", "UTC"))
        policy = one(res, "NetworkPolicy", engine)
        router_labels = one(res, "Deployment", "kvroute-router")["spec"]["template"]["metadata"]["labels"]
        baseline = one(rendered("loadgen"), "Deployment", "kvroute-router-baseline")
        baseline_labels = baseline["spec"]["template"]["metadata"]["labels"]
        pod_labels = pod["metadata"]["labels"]
        self.assertTrue(policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items())
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if "from" not in rule:
                self.assertEqual(ports, {"http"}, "only the API is open to every pod")
            else:
                self.assertEqual(ports, {"kv-events", "kv-replay"})
                # The routers, and `compare`'s baseline router (deploy/loadgen).
                routers = [router_labels, baseline_labels]
                for peer in rule["from"]:
                    selector = peer["podSelector"]["matchLabels"].items()
                    self.assertTrue(any(selector <= labels.items() for labels in routers), selector)
                self.assertTrue(
                    all(any(p["podSelector"]["matchLabels"].items() <= labels.items() for p in rule["from"])
                        for labels in routers)
                )

    def test_vllm_publishes_kv_events_with_prefix_caching(self):
        res = rendered("overlays/vllm")
        args = one(res, "StatefulSet", "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
        self.assertIn("--enable-prefix-caching", args)
        self.assertIn("--enable-prompt-tokens-details", args)
        (events,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-events-config=")]
        events = json.loads(events)
        self.assertEqual(
            (events["enable_kv_cache_events"], events["publisher"], events["endpoint"], events["replay_endpoint"]),
            (True, "zmq", "tcp://*:5557", "tcp://*:5558"),
        )
        config = tomllib.loads(one(res, "ConfigMap", "kvroute-router-config")["data"]["router.toml"])
        self.assertEqual(config["discovery-topic"], events["topic"])
        block = [a for a in args if a.startswith("--block-size=")][0].split("=")[1]
        self.assertEqual(config["block-size"], int(block))
        served = [a for a in args if a.startswith("--served-model-name=")][0].split("=")[1]
        self.assertEqual(config["model"], served)

    def test_sglang_publishes_kv_events_a_page_a_block_and_reports_cached_tokens(self):
        res = rendered("overlays/sglang")
        c = one(res, "StatefulSet", "sglang")["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(c["command"], ["python3", "-m", "sglang.launch_server"], "the image has no entrypoint")
        args = dict(a.split("=", 1) if "=" in a else (a, "") for a in c["args"])
        self.assertIn("--enable-cache-report", args)
        self.assertIn("--enable-metrics", args)
        self.assertNotIn("--disable-radix-cache", args)
        events = json.loads(args["--kv-events-config"])
        self.assertEqual(
            (events["enable_kv_cache_events"], events["publisher"], events["endpoint"], events["replay_endpoint"]),
            (True, "zmq", "tcp://*:5557", "tcp://*:5558"),
        )
        config = tomllib.loads(one(res, "ConfigMap", "kvroute-router-config")["data"]["router.toml"])
        self.assertEqual(config["discovery-topic"], events["topic"])
        self.assertEqual(config["block-size"], int(args["--page-size"]))
        self.assertEqual(config["model"], args["--served-model-name"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(int(args["--port"]), ports["http"])
        self.assertEqual(args["--host"], "0.0.0.0", "SGLang listens on 127.0.0.1 by default")
        # The router tokenizes with the model's files, fetched for it before it starts.
        router = one(res, "Deployment", "kvroute-router")["spec"]["template"]["spec"]
        (fetch,) = router["initContainers"]
        env = {e["name"]: e.get("value") for e in fetch["env"]}
        self.assertEqual(env["MODEL"], config["model"])
        mounts = {m["mountPath"]: m["name"] for m in fetch["volumeMounts"]}
        router_mounts = {m["mountPath"]: m["name"] for m in router["containers"][0]["volumeMounts"]}
        self.assertEqual(router_mounts[config["tokenizer"]], mounts[config["tokenizer"]])
        self.assertNotIn("remote-tokenize", config)

    def test_images_are_the_workspace_version(self):
        with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
            version = tomllib.load(f)["workspace"]["package"]["version"]
        for overlay in OVERLAYS:
            for r in rendered(overlay):
                for pod in pod_specs(r):
                    for c in pod["containers"]:
                        if c["image"].split(":")[0] == "kvroute":
                            self.assertEqual(c["image"], f"kvroute:{version}", f"{overlay}: a tag, never latest")

    def test_router_config_keys_are_router_flags(self):
        fields = set()
        for path in ["router/src/config.rs", "router/src/discovery/config.rs"]:
            full = os.path.join(ROOT, path)
            if os.path.exists(full):
                with open(full, encoding="utf-8") as f:
                    fields |= {m.replace("_", "-") for m in re.findall(r"^\s*pub (\w+):", f.read(), re.M)}
        if not os.path.exists(os.path.join(ROOT, "router/src/config.rs")):
            self.skipTest("router/src/config.rs not there yet")
        for overlay in ["base", "overlays/sim", *ENGINES]:
            with open(os.path.join(DEPLOY, overlay, "router.toml"), "rb") as f:
                keys = set(tomllib.load(f))
            self.assertEqual(keys - fields, set(), overlay)

    def test_dashboard_queries_registered_metrics(self):
        with open(os.path.join(DEPLOY, "base/kvroute-router.json"), encoding="utf-8") as f:
            dashboard = json.load(f)
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        self.assertGreater(len(exprs), 10)
        metrics = {m for e in exprs for m in re.findall(r"kvroute_\w+", e)}
        sources = ""
        for directory, _, files in os.walk(os.path.join(ROOT, "router/src")):
            for name in files:
                if name.endswith(".rs"):
                    with open(os.path.join(directory, name), encoding="utf-8") as f:
                        sources += f.read()
        missing = []
        for metric in sorted(metrics):
            prefix, name = re.match(r"(kvroute_(?:router|ingest|discovery))_(\w+)", metric).groups()
            name = re.sub(r"_(total|bucket)$", "", name)
            if f'"{name}"' not in sources or f'"{prefix}"' not in sources:
                missing.append(metric)
        self.assertEqual(missing, [], "dashboard metrics not registered in router/src")
        self.assertTrue(any(m.startswith("kvroute_ingest_") for m in metrics))


if __name__ == "__main__":
    unittest.main()
