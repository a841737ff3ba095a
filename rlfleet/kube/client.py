"""A small JSON client of the Kubernetes API over kubernetes_asyncio's transport.

The operator, the node agent and the Kubernetes fleet backend all speak plain JSON objects (dicts)
built by pure functions, so they need paths, verbs and error codes rather than generated models.
This wraps `kubernetes_asyncio.client.ApiClient` (kubeconfig / in-cluster auth, TLS) and adds:

- a timeout on every call (`timeout_s`, default 30 s; watches bound each line read);
- `ApiError` carrying the HTTP status and the API server's own message;
- per-verb request counters (the scale benchmark reports API requests per reconcile).
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from rlfleet.crds import conventions

DEFAULT_TIMEOUT_S = 30.0
MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    """A non-2xx answer of the API server (status 0: no answer, e.g. a timeout)."""

    def __init__(self, status: int, reason: str, message: str = "", body: dict | None = None):
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        return self.status == 410

    @property
    def passing(self) -> bool:
        """No answer, too many requests or a server error: the same request may well succeed again."""
        return self.status == 0 or self.status == 429 or self.status >= 500


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API: group ('' for core), version, plural, namespaced."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name, safe='')}"
            if sub:
                base += f"/{sub}"
        return base


PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes", namespaced=False)
EVENTS = Resource("", "v1", "events")
SERVICES = Resource("", "v1", "services")
PVCS = Resource("", "v1", "persistentvolumeclaims")
CONFIGMAPS = Resource("", "v1", "configmaps")
SECRETS = Resource("", "v1", "secrets")
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts")
DEPLOYMENTS = Resource("apps", "v1", "deployments")
REPLICASETS = Resource("apps", "v1", "replicasets")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings")


def rlfleet_resource(kind: str) -> Resource:
    """The API resource of one of rlfleet's kinds (TrainingRun, RolloutFleet, EvalFleet)."""
    return Resource(conventions.GROUP, conventions.VERSION, conventions.PLURALS[kind])


class KubeClient:
    """JSON requests to one API server. Use `async with await KubeClient.load(...)`."""

    def __init__(self, api: k8s_client.ApiClient, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.api = api
        self.timeout_s = timeout_s
        self.requests: collections.Counter[str] = collections.Counter()
        self.on_request: Callable[[str], None] | None = None  # e.g. a metrics counter

    def _count(self, verb: str) -> None:
        self.requests[verb] += 1
        if self.on_request is not None:
            self.on_request(verb)

    @classmethod
    async def load(cls, kubeconfig: str | os.PathLike | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                   qps_connections: int = 64) -> KubeClient:
        """From a kubeconfig file (argument, then $KUBECONFIG), else the in-cluster service account."""
        cfg = k8s_client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG")
        if path:
            await k8s_config.load_kube_config(config_file=str(path), client_configuration=cfg)
        else:
            k8s_config.load_incluster_config(client_configuration=cfg)
        cfg.connection_pool_maxsize = qps_connections
        return cls(k8s_client.ApiClient(cfg), timeout_s=timeout_s)

    async def close(self) -> None:
        await self.api.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    async def request(self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None,
                      content_type: str = "application/json", timeout_s: float | None = None) -> dict:
        """One call; returns the decoded JSON answer ({} when empty). Raises ApiError."""
        self._count(method.upper())
        headers = {"Accept": "application/json", "Content-Type": content_type}
        timeout = timeout_s or self.timeout_s
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation.
            async with asyncio.timeout(timeout):
                resp = await self.api.call_api(
                    path, method.upper(), query_params=_query(query), header_params=headers, body=body,
                    auth_settings=["BearerToken"], _preload_content=False, _request_timeout=timeout,
                )
                async with resp:
                    raw = await resp.read()
                    status = resp.status
        except ApiException as e:  # raised by the transport for some failures
            raise _api_error(e.status or 0, e.reason or "", e.body) from None
        except (TimeoutError, OSError, aiohttp.ClientError) as e:
            raise ApiError(0, type(e).__name__, f"{method} {path}: {e or 'timed out'}") from None
        if not 200 <= status <= 299:
            raise _api_error(status, "", raw)
        return json.loads(raw) if raw else {}

    # Verbs -------------------------------------------------------------------------------------------
    async def get(self, res: Resource, name: str, namespace: str | None = None, sub: str | None = None) -> dict:
        return await self.request("GET", res.path(namespace, name, sub))

    async def get_or_none(self, res: Resource, name: str, namespace: str | None = None) -> dict | None:
        try:
            return await self.get(res, name, namespace)
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def list(self, res: Resource, namespace: str | None = None, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> dict:
        return await self.request("GET", res.path(namespace), query={
            "labelSelector": label_selector, "fieldSelector": field_selector})

    async def create(self, res: Resource, body: dict, namespace: str | None = None, sub_of: str | None = None,
                     sub: str | None = None) -> dict:
        ns = namespace or body.get("metadata", {}).get("namespace")
        path = res.path(ns, sub_of, sub) if sub_of else res.path(ns)
        return await self.request("POST", path, body=body)

    async def merge_patch(self, res: Resource, name: str, patch: dict, namespace: str | None = None,
                          sub: str | None = None) -> dict:
        return await self.request("PATCH", res.path(namespace, name, sub), body=patch, content_type=MERGE_PATCH)

    async def delete(self, res: Resource, name: str, namespace: str | None = None, *,
                     grace_period_s: int | None = None, uid: str | None = None,
                     propagation: str | None = None, missing_ok: bool = True) -> dict | None:
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        if uid:
            body["preconditions"] = {"uid": uid}
        if propagation:
            body["propagationPolicy"] = propagation
        try:
            return await self.request("DELETE", res.path(namespace, name), body=body)
        except ApiError as e:
            if missing_ok and (e.not_found or (uid and e.conflict)):
                return None
            raise

    async def watch(self, res: Resource, namespace: str | None = None, *, resource_version: str,
                    label_selector: str | None = None, field_selector: str | None = None,
                    server_timeout_s: int = 240) -> AsyncIterator[tuple[str, dict]]:
        """Yield (type, object) from one watch request until the server ends it.

        Raises ApiError(410) when resource_version is too old (relist then). Each line read is bounded
        by the server's own timeout plus a margin, so a silent connection cannot hang the caller.
        """
        self._count("WATCH")
        query = _query({"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                        "timeoutSeconds": str(server_timeout_s), "labelSelector": label_selector,
                        "fieldSelector": field_selector})
        line_timeout = server_timeout_s + 30
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self.api.call_api(
                    res.path(namespace), "GET", query_params=query, header_params={"Accept": "application/json"},
                    auth_settings=["BearerToken"], _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(connect=self.timeout_s, sock_connect=self.timeout_s,
                                                           sock_read=line_timeout))
        except (TimeoutError, OSError, aiohttp.ClientError) as e:
            raise ApiError(0, type(e).__name__, f"watch {res.plural}: {e or 'timed out'}") from None
        async with resp:
            if resp.status != 200:
                raise _api_error(resp.status, "", await resp.read())
            while True:
                try:
                    async with asyncio.timeout(line_timeout):
                        line = await resp.content.readline()
                except (TimeoutError, OSError, aiohttp.ClientError):
                    return  # the caller watches again from the last version it saw
                if not line:
                    return
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object", {})
                if kind == "ERROR":
                    raise _api_error(obj.get("code", 0), obj.get("reason", ""), json.dumps(obj).encode())
                yield kind, obj


async def list_and_watch(kube: KubeClient, res: Resource, on_list, on_event, *, namespace: str | None = None,
                         label_selector: str | None = None, field_selector: str | None = None,
                         retry_s: float = 2.0, on_error=None) -> None:
    """An informer loop: list, then watch from the list's version; relist after 410 or any error.

    `on_list(items)` gets every list (the full current state), `on_event(type, obj)` every change.
    Runs until cancelled.
    """
    while True:
        try:
            listing = await kube.list(res, namespace, label_selector=label_selector, field_selector=field_selector)
            await on_list(listing.get("items", []))
            rv = listing["metadata"]["resourceVersion"]
            while True:
                async for kind, obj in kube.watch(res, namespace, resource_version=rv, label_selector=label_selector,
                                                  field_selector=field_selector):
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if kind != "BOOKMARK":
                        await on_event(kind, obj)
        except ApiError as e:
            if not e.gone:
                if on_error is not None:
                    on_error(e)
                await asyncio.sleep(retry_s)


def _query(params: dict[str, Any] | None) -> list[tuple[str, str]] | None:
    if not params:
        return None
    return [(k, str(v)) for k, v in params.items() if v is not None]


def _api_error(status: int, reason: str, raw: bytes | str | None) -> ApiError:
    body: dict = {}
    message = ""
    if raw:
        try:
            body = json.loads(raw)
            message = body.get("message", "")
            reason = body.get("reason", reason)
        except (ValueError, AttributeError):
            message = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return ApiError(status, reason, message, body)
