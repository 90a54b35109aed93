#!/usr/bin/env python3
"""Render a kustomization directory to one multi-document YAML stream on stdout.

kustomize cannot be installed here, so this implements the subset deploy/ uses, with
kustomize's semantics, and refuses anything else (an unknown field is an error, never
silently ignored):

- ``resources``: files (one or more documents) and directories holding a kustomization
  (built recursively, bases first);
- ``namespace``: set on every namespaced object and on ServiceAccount subjects of
  (Cluster)RoleBindings that name none (or ``default``);
- ``configMapGenerator``: ``files`` (``path`` or ``key=path``), ``literals`` (``k=v``),
  ``behavior`` create / replace / merge (against a generator of a base), ``options``
  (``labels``, ``annotations``, ``disableNameSuffixHash``) and ``generatorOptions`` with the
  same keys; generated names get a content-hash suffix and every reference from a pod template
  (volumes, projected volumes, envFrom, env valueFrom) is rewritten to it;
- ``patches``: strategic-merge patches (``path`` or inline ``patch``; the target is the
  patch's kind and name, or ``target.kind``/``target.name``): maps merge, lists of named
  things merge by their Kubernetes merge key (containers/env/volumes by ``name``,
  volumeMounts by ``mountPath``, container ports by ``containerPort``, Service ports by
  ``port``), other lists are replaced, ``null`` deletes a key;
- ``images``: ``name`` → ``newName`` / ``newTag`` / ``digest`` on every container and init
  container.

Output is ordered like kustomize's legacy order (Namespace, ServiceAccount, RBAC, ConfigMap,
Service, workloads, ...).

Usage: render.py DIR [--out FILE]
"""

import copy
import hashlib
import json
import os
import sys

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "configMapGenerator",
    "generatorOptions",
    "patches",
    "images",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "CustomResourceDefinition",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
}
ORDER = [
    "Namespace",
    "ResourceQuota",
    "LimitRange",
    "PodSecurityPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicationController",
    "ReplicaSet",
    "Deployment",
    "HorizontalPodAutoscaler",
    "StatefulSet",
    "Job",
    "CronJob",
    "Ingress",
]
# Strategic-merge keys of the lists deploy/ patches (path of parent keys is not needed:
# these names are unambiguous in the core workload and Service schemas).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "envFrom": None,
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeClaimTemplates": None,
    "imagePullSecrets": "name",
    "tolerations": None,
}
# Internal bookkeeping key on generated ConfigMaps, removed before output.
GEN = "__kvroute_render_generated__"


class RenderError(Exception):
    pass


def load_yaml_documents(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kustomization_path(directory):
    for name in KUSTOMIZATION_FILES:
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            return p
    raise RenderError(f"{directory}: no kustomization.yaml")


def key_of(obj):
    meta = obj.get("metadata", {})
    return (obj.get("kind"), meta.get("name"))


def build(directory):
    """The resources of the kustomization in `directory`, before final name hashing."""
    path = kustomization_path(directory)
    docs = load_yaml_documents(path)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise RenderError(f"{path}: expected one mapping")
    k = docs[0]
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise RenderError(f"{path}: unsupported fields {sorted(unknown)} (extend deploy/render.py)")

    resources = []
    for entry in k.get("resources", []):
        p = os.path.normpath(os.path.join(directory, entry))
        if os.path.isdir(p):
            resources.extend(build(p))
        elif os.path.isfile(p):
            resources.extend(load_yaml_documents(p))
        else:
            raise RenderError(f"{path}: resource {entry} does not exist")
    seen = set()
    for r in resources:
        if key_of(r) in seen:
            raise RenderError(f"{path}: duplicate resource {key_of(r)}")
        seen.add(key_of(r))

    options = k.get("generatorOptions", {})
    for gen in k.get("configMapGenerator", []):
        generate_config_map(directory, gen, options, resources)

    for patch in k.get("patches", []):
        apply_patch(directory, patch, resources)

    if "namespace" in k:
        set_namespace(resources, k["namespace"])

    for image in k.get("images", []):
        set_image(resources, image)
    return resources


def generate_config_map(directory, gen, options, resources):
    allowed = {"name", "behavior", "files", "literals", "options"}
    if set(gen) - allowed:
        raise RenderError(f"configMapGenerator {gen.get('name')}: unsupported {sorted(set(gen) - allowed)}")
    data = {}
    for entry in gen.get("files", []):
        key, _, rel = entry.rpartition("=")
        key = key or os.path.basename(rel)
        with open(os.path.join(directory, rel), encoding="utf-8") as f:
            data[key] = f.read()
    for entry in gen.get("literals", []):
        key, sep, value = entry.partition("=")
        if not sep:
            raise RenderError(f"literal {entry!r} is not key=value")
        data[key] = value
    opts = {**options, **gen.get("options", {})}
    behavior = gen.get("behavior", "create")
    name = gen["name"]
    existing = next((r for r in resources if key_of(r) == ("ConfigMap", name) and GEN in r), None)
    if behavior == "create":
        if existing is not None:
            raise RenderError(f"ConfigMap {name} already generated by a base (use behavior: replace|merge)")
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
        resources.append(cm)
    elif behavior in ("replace", "merge"):
        if existing is None:
            raise RenderError(f"ConfigMap {name}: behavior {behavior} but no base generates it")
        cm = existing
        cm["data"] = data if behavior == "replace" else {**cm.get("data", {}), **data}
    else:
        raise RenderError(f"ConfigMap {name}: unknown behavior {behavior!r}")
    meta = cm["metadata"]
    for field in ("labels", "annotations"):
        if opts.get(field):
            meta.setdefault(field, {}).update(opts[field])
    cm[GEN] = {"hash": not opts.get("disableNameSuffixHash", False) and cm.get(GEN, {}).get("hash", True)}


def strategic_merge(base, patch, field=None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        merge_key = MERGE_KEYS.get(field)
        if field == "ports":
            merge_key = "containerPort" if any("containerPort" in p for p in base + patch) else "port"
        if merge_key is None:
            return copy.deepcopy(patch)
        out = [copy.deepcopy(item) for item in base]
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(merge_key) == item.get(merge_key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item, None)
        return out
    return copy.deepcopy(patch)


def apply_patch(directory, entry, resources):
    if set(entry) - {"path", "patch", "target"}:
        raise RenderError(f"patch {entry}: unsupported fields")
    if "path" in entry:
        docs = load_yaml_documents(os.path.join(directory, entry["path"]))
    else:
        docs = [d for d in yaml.safe_load_all(entry["patch"]) if d is not None]
    for patch in docs:
        if isinstance(patch, list):
            raise RenderError("JSON 6902 patches are not supported; use a strategic-merge patch")
        target = entry.get("target", {})
        kind = target.get("kind", patch.get("kind"))
        name = target.get("name", patch.get("metadata", {}).get("name"))
        matches = [i for i, r in enumerate(resources) if key_of(r) == (kind, name)]
        if len(matches) != 1:
            raise RenderError(f"patch targets {kind}/{name}, found {len(matches)} resources")
        i = matches[0]
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
        body.get("metadata", {}).pop("name", None)
        resources[i] = strategic_merge(resources[i], body)


def set_namespace(resources, namespace):
    for r in resources:
        if r.get("kind") not in CLUSTER_SCOPED:
            r.setdefault("metadata", {})["namespace"] = namespace
        if r.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
            for subject in r.get("subjects", []):
                if subject.get("kind") == "ServiceAccount" and subject.get("namespace") in (None, "default"):
                    subject["namespace"] = namespace


def pod_specs(obj):
    """Every pod spec inside a workload (Deployment, StatefulSet, Job, CronJob, Pod, ...)."""
    kind = obj.get("kind")
    spec = obj.get("spec", {})
    if kind == "Pod":
        return [spec]
    if kind == "CronJob":
        return [spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec", {})]
    if "template" in spec:
        return [spec["template"].get("spec", {})]
    return []


def containers(pod):
    return pod.get("containers", []) + pod.get("initContainers", [])


def set_image(resources, image):
    name = image["name"]
    for r in resources:
        for pod in pod_specs(r):
            for c in containers(pod):
                current = c.get("image", "")
                base = current.split("@")[0]
                repo = base.rsplit(":", 1)[0] if ":" in base.rsplit("/", 1)[-1] else base
                if repo != name:
                    continue
                new = image.get("newName", repo)
                if "digest" in image:
                    c["image"] = f"{new}@{image['digest']}"
                elif "newTag" in image:
                    c["image"] = f"{new}:{image['newTag']}"
                else:
                    c["image"] = current.replace(repo, new, 1)


def name_hash(cm):
    """A content hash of a ConfigMap, like kustomize's (10 characters, no vowels)."""
    encoded = json.dumps(
        {"kind": "ConfigMap", "name": cm["metadata"]["name"], "data": cm.get("data", {})},
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = hashlib.sha256(encoded.encode()).hexdigest()
    table = {"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}
    return "".join(table.get(ch, ch) for ch in digest[:10])


def finalize(resources):
    renames = {}
    for r in resources:
        gen = r.pop(GEN, None)
        if gen and gen["hash"]:
            old = r["metadata"]["name"]
            new = f"{old}-{name_hash(r)}"
            renames[(r["metadata"].get("namespace"), old)] = new
            r["metadata"]["name"] = new

    def renamed(namespace, name):
        return renames.get((namespace, name), name)

    for r in resources:
        ns = r.get("metadata", {}).get("namespace")
        for pod in pod_specs(r):
            for v in pod.get("volumes", []):
                if "configMap" in v:
                    v["configMap"]["name"] = renamed(ns, v["configMap"]["name"])
                for source in v.get("projected", {}).get("sources", []):
                    if "configMap" in source:
                        source["configMap"]["name"] = renamed(ns, source["configMap"]["name"])
            for c in containers(pod):
                for e in c.get("envFrom", []):
                    if "configMapRef" in e:
                        e["configMapRef"]["name"] = renamed(ns, e["configMapRef"]["name"])
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        ref["name"] = renamed(ns, ref["name"])

    def order(r):
        kind = r.get("kind")
        return (ORDER.index(kind) if kind in ORDER else len(ORDER), kind, r["metadata"].get("name", ""))

    return sorted(resources, key=order)


def render(directory):
    return finalize(build(directory))


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(resources):
    return yaml.dump_all(resources, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def main(argv):
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--out"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        text = dump(render(argv[1]))
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    if len(argv) == 4:
        with open(argv[3], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
