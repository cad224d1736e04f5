//! The fake's object store: one resourceVersion counter for everything, a bounded history of changes
//! so a watch resumes from a recent version (and an older one is told `410 Gone`, as etcd compaction
//! makes the real server do), bookmarks, and equality label selectors.

use crate::Body;
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::Response;
use hyper::body::Frame;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::broadcast;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    Pods,
    HookChains,
    Capabilities,
    /// core/v1 Events (what the kubelet writes).
    Events,
    /// events.k8s.io/v1 Events (what kube-rs's `Recorder`, and so the operator, writes).
    EventsV1,
    Leases,
    NetworkPolicies,
    /// apps/v1 ControllerRevisions (a chain's revisions of its hooks).
    ControllerRevisions,
    /// core/v1 Nodes (cluster-scoped: the operator watches them for cordons and lost nodes).
    Nodes,
}

impl Resource {
    pub const ALL: [Resource; 9] = [
        Resource::Pods,
        Resource::HookChains,
        Resource::Capabilities,
        Resource::Events,
        Resource::EventsV1,
        Resource::Leases,
        Resource::NetworkPolicies,
        Resource::ControllerRevisions,
        Resource::Nodes,
    ];

    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::HookChains => "hookchains",
            Resource::Capabilities => "capabilities",
            Resource::Events | Resource::EventsV1 => "events",
            Resource::Leases => "leases",
            Resource::NetworkPolicies => "networkpolicies",
            Resource::ControllerRevisions => "controllerrevisions",
            Resource::Nodes => "nodes",
        }
    }

    /// `apiVersion` of the resource's objects.
    pub fn api_version(self) -> &'static str {
        match self {
            Resource::Pods | Resource::Events | Resource::Nodes => "v1",
            Resource::HookChains | Resource::Capabilities => "sluice.dev/v1alpha1",
            Resource::EventsV1 => "events.k8s.io/v1",
            Resource::Leases => "coordination.k8s.io/v1",
            Resource::NetworkPolicies => "networking.k8s.io/v1",
            Resource::ControllerRevisions => "apps/v1",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::HookChains => "HookChain",
            Resource::Capabilities => "Capability",
            Resource::Events | Resource::EventsV1 => "Event",
            Resource::Leases => "Lease",
            Resource::NetworkPolicies => "NetworkPolicy",
            Resource::ControllerRevisions => "ControllerRevision",
            Resource::Nodes => "Node",
        }
    }

    /// Whether writes to the object leave `status` alone (it is written on `/status`).
    pub fn has_status_subresource(self) -> bool {
        matches!(
            self,
            Resource::Pods | Resource::HookChains | Resource::Capabilities | Resource::Nodes
        )
    }

    /// Cluster-scoped: stored under the empty namespace, and served without one.
    pub fn cluster_scoped(self) -> bool {
        matches!(self, Resource::Nodes)
    }

    fn of(api_version: &str, plural: &str) -> Option<Resource> {
        Resource::ALL
            .into_iter()
            .find(|r| r.api_version() == api_version && r.plural() == plural)
    }
}

/// A request path taken apart: `/api/v1/namespaces/{ns}/pods/{name}/exec`,
/// `/apis/sluice.dev/v1alpha1/hookchains`, ...
#[derive(Debug)]
pub(crate) struct Route {
    pub resource: Resource,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Option<String>,
}

impl Route {
    pub(crate) fn parse(path: &str) -> Option<Route> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (api_version, rest) = match parts.as_slice() {
            ["api", "v1", rest @ ..] => ("v1".to_string(), rest),
            ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] => (Some(ns.to_string()), rest),
            rest => (None, rest),
        };
        let (plural, name, sub) = match rest {
            [plural] => (*plural, None, None),
            [plural, name] => (*plural, Some(name.to_string()), None),
            [plural, name, sub] => (*plural, Some(name.to_string()), Some(sub.to_string())),
            _ => return None,
        };
        Some(Route {
            resource: Resource::of(&api_version, plural)?,
            namespace,
            name,
            subresource: sub,
        })
    }

    /// The resource as the audit log names it: `pods`, `pods/exec`, `hookchains/status`.
    pub(crate) fn audit_resource(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource.plural()),
            None => self.resource.plural().to_string(),
        }
    }
}

/// Query parameters, percent-decoded; a repeated key keeps its values joined by NUL (for `command`).
pub(crate) fn query_params(query: &str) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = HashMap::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (decode(k), decode(v));
        out.entry(k)
            .and_modify(|e| {
                e.push('\0');
                e.push_str(&v)
            })
            .or_insert(v);
    }
    out
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(
                    std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or(""),
                    16,
                ) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `a=b,c!=d,e`: equality, inequality and existence, as kubectl writes them.
pub(crate) fn selector_matches(selector: Option<&str>, object: &Value) -> bool {
    let Some(selector) = selector.filter(|s| !s.is_empty()) else {
        return true;
    };
    let labels = &object["metadata"]["labels"];
    selector.split(',').all(|term| {
        if let Some((k, v)) = term.split_once("!=") {
            labels[k.trim()].as_str() != Some(v.trim())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            labels[k.trim()].as_str() == Some(v.trim())
        } else {
            labels.get(term.trim()).is_some()
        }
    })
}

#[derive(Clone, Debug)]
pub(crate) struct Event {
    rv: u64,
    resource: Resource,
    kind: &'static str,
    object: Value,
}

type Key = (Resource, String, String);

struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// The latest changes, oldest first, at most `history_limit` of them.
    history: VecDeque<Event>,
    /// The newest resourceVersion no longer in `history`: a watch from before it cannot resume.
    compacted: u64,
    suffix: u64,
}

/// Why a write was refused, as the API server answers it.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    #[error(
        "the object has been modified; please apply your changes to the latest version and try again"
    )]
    Conflict,
    #[error("already exists")]
    AlreadyExists,
}

/// How a watch was asked for.
#[derive(Clone, Debug, Default)]
pub(crate) struct WatchParams {
    pub namespace: Option<String>,
    pub selector: Option<String>,
    /// `resourceVersion`: resume after it; `None` (or "0"): start with the current objects.
    pub since: Option<u64>,
    /// `allowWatchBookmarks=true`.
    pub bookmarks: bool,
    /// `sendInitialEvents=true`: the current objects, then a bookmark marking their end.
    pub send_initial_events: bool,
}

pub(crate) struct Store {
    inner: Mutex<Inner>,
    events: broadcast::Sender<Event>,
    history_limit: usize,
    bookmark_interval: Duration,
}

fn key_of(resource: Resource, object: &Value) -> Key {
    let meta = &object["metadata"];
    let namespace = if resource.cluster_scoped() {
        ""
    } else {
        meta["namespace"].as_str().unwrap_or("default")
    };
    (
        resource,
        namespace.to_string(),
        meta["name"].as_str().unwrap_or_default().to_string(),
    )
}

/// The namespace the object is stored under; none for a cluster-scoped one.
fn set_namespace(object: &mut Value, resource: Resource, namespace: &str) {
    if resource.cluster_scoped() {
        if let Some(meta) = object["metadata"].as_object_mut() {
            meta.remove("namespace");
        }
    } else {
        object["metadata"]["namespace"] = json!(namespace);
    }
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Which part of an object a write may change: a status write only `status`, a write of an object
/// whose status has its own endpoint everything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Main,
    Status,
}

/// `patch` cut down to what a write of `part` may change.
fn writable(resource: Resource, part: Part, patch: &Value) -> Value {
    let mut patch = patch.clone();
    match part {
        Part::Status => {
            let status = patch.get("status").cloned().unwrap_or(Value::Null);
            let meta = json!({"resourceVersion": patch["metadata"]["resourceVersion"].clone()});
            json!({"metadata": meta, "status": status})
        }
        Part::Main if resource.has_status_subresource() => {
            if let Some(o) = patch.as_object_mut() {
                o.remove("status");
            }
            patch
        }
        Part::Main => patch,
    }
}

pub(crate) fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

impl Store {
    pub(crate) fn new(history_limit: usize, bookmark_interval: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                rv: 100,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                compacted: 0,
                suffix: 0,
            }),
            events: broadcast::channel(4096).0,
            history_limit: history_limit.max(1),
            bookmark_interval,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    pub(crate) fn next_suffix(&self) -> String {
        let mut i = self.lock();
        i.suffix += 1;
        format!("{:05x}", i.suffix)
    }

    fn record(&self, inner: &mut Inner, resource: Resource, kind: &'static str, object: Value) {
        let event = Event {
            rv: inner.rv,
            resource,
            kind,
            object,
        };
        inner.history.push_back(event.clone());
        while inner.history.len() > self.history_limit {
            if let Some(old) = inner.history.pop_front() {
                inner.compacted = old.rv;
            }
        }
        let _ = self.events.send(event);
    }

    /// Stamps what the API server stamps on a new object and stores it.
    fn insert_new(
        &self,
        inner: &mut Inner,
        resource: Resource,
        key: Key,
        mut object: Value,
    ) -> Value {
        inner.rv += 1;
        let rv = inner.rv;
        object["apiVersion"] = json!(resource.api_version());
        object["kind"] = json!(resource.kind());
        set_namespace(&mut object, resource, &key.1);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        object["metadata"]["generation"] = json!(1);
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = json!(format!("uid-{}-{}-{rv}", key.1, key.2));
        }
        if object["metadata"]["creationTimestamp"].is_null() {
            object["metadata"]["creationTimestamp"] = json!(now_rfc3339());
        }
        inner.objects.insert(key, object.clone());
        self.record(inner, resource, "ADDED", object.clone());
        object
    }

    /// Stores a changed object under a new resourceVersion (the generation moves with the spec).
    fn store_changed(
        &self,
        inner: &mut Inner,
        resource: Resource,
        key: Key,
        previous: &Value,
        mut object: Value,
    ) -> Value {
        if object["spec"] != previous["spec"] {
            let next = previous["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
            object["metadata"]["generation"] = json!(next);
        }
        inner.rv += 1;
        object["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        // As the API server does: an object being deleted goes once its last finalizer has. (A pod
        // in its grace period has a deletionTimestamp and never had finalizers: it stays until the
        // kubelet stand-in has stopped its container.)
        let finalizers = |o: &Value| {
            o["metadata"]["finalizers"]
                .as_array()
                .map_or(0, |f| f.len())
        };
        let finalized = !object["metadata"]["deletionTimestamp"].is_null()
            && finalizers(previous) > 0
            && finalizers(&object) == 0;
        if finalized {
            inner.objects.remove(&key);
            self.record(inner, resource, "DELETED", object.clone());
            return object;
        }
        inner.objects.insert(key, object.clone());
        self.record(inner, resource, "MODIFIED", object.clone());
        object
    }

    /// Creates or replaces an object (as `kubectl apply` would), bumping its resourceVersion.
    pub(crate) fn upsert(&self, resource: Resource, object: Value) -> Value {
        let mut inner = self.lock();
        let key = key_of(resource, &object);
        match inner.objects.get(&key).cloned() {
            None => self.insert_new(&mut inner, resource, key, object),
            Some(previous) => {
                let mut object = object;
                set_namespace(&mut object, resource, &key.1);
                for kept in ["uid", "creationTimestamp", "generation"] {
                    if object["metadata"][kept].is_null() {
                        object["metadata"][kept] = previous["metadata"][kept].clone();
                    }
                }
                self.store_changed(&mut inner, resource, key, &previous, object)
            }
        }
    }

    /// A create (POST): refused if the name is taken.
    pub(crate) fn create(&self, resource: Resource, object: Value) -> Result<Value, StoreError> {
        let mut inner = self.lock();
        let key = key_of(resource, &object);
        if inner.objects.contains_key(&key) {
            return Err(StoreError::AlreadyExists);
        }
        Ok(self.insert_new(&mut inner, resource, key, object))
    }

    pub(crate) fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(resource, namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Changes an object in place; `change` says whether it changed anything (nothing is written
    /// otherwise). The object as stored afterwards, or `None` if there is no such object.
    pub(crate) fn modify(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value) -> bool,
    ) -> Option<Value> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let previous = inner.objects.get(&key)?.clone();
        let mut object = previous.clone();
        if !change(&mut object) {
            return Some(previous);
        }
        Some(self.store_changed(&mut inner, resource, key, &previous, object))
    }

    /// Removes an object for good; with `precondition` (a resourceVersion) only if it matches.
    pub(crate) fn remove(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
        precondition: Option<&str>,
    ) -> Result<Value, StoreError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let current = inner.objects.get(&key).ok_or(StoreError::NotFound)?;
        if precondition
            .is_some_and(|want| current["metadata"]["resourceVersion"].as_str() != Some(want))
        {
            return Err(StoreError::Conflict);
        }
        // An object with finalizers is only marked: it goes when they have (`store_changed`).
        let has_finalizers = current["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if has_finalizers {
            let previous = current.clone();
            let mut object = previous.clone();
            if object["metadata"]["deletionTimestamp"].is_null() {
                object["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
                return Ok(self.store_changed(&mut inner, resource, key, &previous, object));
            }
            return Ok(previous);
        }
        let mut object = inner.objects.remove(&key).ok_or(StoreError::NotFound)?;
        inner.rv += 1;
        object["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        self.record(&mut inner, resource, "DELETED", object.clone());
        Ok(object)
    }

    /// A merge patch (or, with `create`, a server-side apply, which creates a missing object); a
    /// `metadata.resourceVersion` in the patch is a precondition.
    pub(crate) fn patch(
        &self,
        resource: Resource,
        part: Part,
        namespace: &str,
        name: &str,
        patch: &Value,
        create: bool,
    ) -> Result<Value, StoreError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let Some(current) = inner.objects.get(&key).cloned() else {
            if !create || part == Part::Status {
                return Err(StoreError::NotFound);
            }
            let mut object = patch.clone();
            object["metadata"]["name"] = json!(name);
            if let Some(meta) = object["metadata"].as_object_mut() {
                meta.remove("resourceVersion");
            }
            return Ok(self.insert_new(&mut inner, resource, key, object));
        };
        if let Some(want) = patch["metadata"]["resourceVersion"].as_str()
            && current["metadata"]["resourceVersion"].as_str() != Some(want)
        {
            return Err(StoreError::Conflict);
        }
        let mut object = current.clone();
        merge(&mut object, &writable(resource, part, patch));
        Ok(self.store_changed(&mut inner, resource, key, &current, object))
    }

    /// A JSON patch (RFC 6902, as kube's finalizer helper sends): its `test` operations are the
    /// precondition (a failed one is a conflict).
    pub(crate) fn json_patch(
        &self,
        resource: Resource,
        part: Part,
        namespace: &str,
        name: &str,
        ops: &Value,
    ) -> Result<Value, StoreError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let current = inner
            .objects
            .get(&key)
            .cloned()
            .ok_or(StoreError::NotFound)?;
        let ops: json_patch::Patch =
            serde_json::from_value(ops.clone()).map_err(|_| StoreError::Conflict)?;
        let mut patched = current.clone();
        // The API server's JSON patch (evanphx/json-patch) takes a missing member as null for a
        // `test` against null, as kube's finalizer helper sends for an object without finalizers.
        for op in ops.iter() {
            if let json_patch::PatchOperation::Test(t) = op
                && t.value.is_null()
                && patched.pointer(t.path.as_str()).is_none()
                && let Some((parent, key)) = t.path.as_str().rsplit_once('/')
                && let Some(Value::Object(map)) = patched.pointer_mut(parent)
            {
                map.insert(key.to_string(), Value::Null);
            }
        }
        json_patch::patch(&mut patched, &ops).map_err(|_| StoreError::Conflict)?;
        let mut object = current.clone();
        match part {
            Part::Status => object["status"] = patched["status"].clone(),
            Part::Main => {
                object["metadata"] = patched["metadata"].clone();
                object["spec"] = patched["spec"].clone();
            }
        }
        keep_server_metadata(&mut object, &current);
        Ok(self.store_changed(&mut inner, resource, key, &current, object))
    }

    /// A replace (PUT): the whole object, preconditioned on the resourceVersion it carries.
    pub(crate) fn replace(
        &self,
        resource: Resource,
        part: Part,
        namespace: &str,
        name: &str,
        object: &Value,
    ) -> Result<Value, StoreError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let current = inner
            .objects
            .get(&key)
            .cloned()
            .ok_or(StoreError::NotFound)?;
        if let Some(want) = object["metadata"]["resourceVersion"].as_str()
            && current["metadata"]["resourceVersion"].as_str() != Some(want)
        {
            return Err(StoreError::Conflict);
        }
        let mut next = match part {
            Part::Status => {
                let mut next = current.clone();
                next["status"] = object["status"].clone();
                next
            }
            Part::Main => {
                let mut next = object.clone();
                if resource.has_status_subresource() {
                    next["status"] = current["status"].clone();
                }
                next
            }
        };
        keep_server_metadata(&mut next, &current);
        Ok(self.store_changed(&mut inner, resource, key, &current, next))
    }

    pub(crate) fn list(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        selector: Option<&str>,
    ) -> Vec<Value> {
        Self::matching(&self.lock(), resource, namespace, selector)
    }

    fn matching(
        inner: &Inner,
        resource: Resource,
        namespace: Option<&str>,
        selector: Option<&str>,
    ) -> Vec<Value> {
        inner
            .objects
            .iter()
            .filter(|((r, ns, _), o)| {
                *r == resource
                    && namespace.is_none_or(|want| want == ns)
                    && selector_matches(selector, o)
            })
            .map(|(_, o)| o.clone())
            .collect()
    }

    pub(crate) fn list_response(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        selector: Option<&str>,
    ) -> Value {
        let inner = self.lock();
        json!({
            "apiVersion": resource.api_version(),
            "kind": format!("{}List", resource.kind()),
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": Self::matching(&inner, resource, namespace, selector),
        })
    }

    /// A watch, as JSON lines of `{"type", "object"}` on one long response: from `since`, the
    /// changes after it from the history (or, if the history no longer reaches back that far, an
    /// ERROR event with a `410 Expired` Status and the end of the response); without it, the
    /// current objects as ADDED. Then live changes, and BOOKMARKs when they were asked for.
    pub(crate) fn watch(&self, resource: Resource, params: WatchParams) -> Response<Body> {
        let WatchParams {
            namespace,
            selector,
            since,
            bookmarks,
            send_initial_events,
        } = params;
        let wanted = move |e: &Event| {
            e.resource == resource
                && namespace
                    .as_deref()
                    .is_none_or(|ns| e.object["metadata"]["namespace"].as_str() == Some(ns))
                && selector_matches(selector.as_deref(), &e.object)
        };
        let line = |kind: &str, object: &Value| {
            let mut s = json!({"type": kind, "object": object}).to_string();
            s.push('\n');
            Bytes::from(s)
        };
        let bookmark = move |rv: u64, initial_end: bool| {
            let mut meta = json!({"resourceVersion": rv.to_string()});
            if initial_end {
                meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
            }
            line(
                "BOOKMARK",
                &json!({"kind": resource.kind(), "apiVersion": resource.api_version(), "metadata": meta}),
            )
        };
        // Subscribe before reading the history so nothing falls between the two.
        let mut live = self.events.subscribe();
        let (backlog, mut last) = {
            let inner = self.lock();
            let resume = since.filter(|rv| *rv > 0 && !send_initial_events);
            let mut backlog: Vec<Bytes> = Vec::new();
            match resume {
                Some(rv) if rv < inner.compacted => {
                    let gone = json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": format!("too old resource version: {rv} ({})", inner.compacted + 1),
                        "reason": "Expired", "code": 410,
                    });
                    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
                    let _ = tx.try_send(line("ERROR", &gone));
                    return Self::respond(rx);
                }
                Some(rv) => backlog.extend(
                    inner
                        .history
                        .iter()
                        .filter(|e| e.rv > rv && wanted(e))
                        .map(|e| line(e.kind, &e.object)),
                ),
                None => {
                    backlog.extend(
                        inner
                            .objects
                            .iter()
                            .filter(|((r, _, _), _)| *r == resource)
                            .map(|(_, o)| Event {
                                rv: 0,
                                resource,
                                kind: "ADDED",
                                object: o.clone(),
                            })
                            .filter(|e| wanted(e))
                            .map(|e| line("ADDED", &e.object)),
                    );
                    if send_initial_events && bookmarks {
                        backlog.push(bookmark(inner.rv, true));
                    }
                }
            }
            (backlog, inner.rv)
        };
        let interval = self.bookmark_interval;
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(256);
        tokio::spawn(async move {
            for b in backlog {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            let mut ticks =
                tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            loop {
                tokio::select! {
                    received = live.recv() => match received {
                        Ok(e) if e.rv > last => {
                            last = e.rv;
                            if wanted(&e) && tx.send(line(e.kind, &e.object)).await.is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                        // A watcher that falls this far behind is dropped; it resumes from its
                        // last version (or is told 410 if that is gone).
                        Err(broadcast::error::RecvError::Lagged(_)) => return,
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    _ = ticks.tick(), if bookmarks => {
                        if tx.send(bookmark(last, false)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Self::respond(rx)
    }

    /// The watch response: each line sent on `lines` as it comes; the end of `lines` ends it.
    fn respond(lines: tokio::sync::mpsc::Receiver<Bytes>) -> Response<Body> {
        let lines = tokio_stream::wrappers::ReceiverStream::new(lines);
        let body = StreamBody::new(futures::StreamExt::map(lines, |b| {
            Ok::<_, std::convert::Infallible>(Frame::data(b))
        }));
        Response::builder()
            .header("content-type", "application/json")
            .body(body.boxed())
            .unwrap_or_else(|_| Response::new(http_body_util::Empty::new().boxed()))
    }
}

/// The metadata a client cannot change by writing an object (replace or JSON patch): the server's
/// own fields are carried over from the stored object (store_changed then bumps resourceVersion and
/// generation). A field the stored object lacks is not added as null.
fn keep_server_metadata(next: &mut Value, current: &Value) {
    for kept in [
        "uid",
        "resourceVersion",
        "creationTimestamp",
        "generation",
        "namespace",
        "name",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        match current["metadata"].get(kept) {
            Some(v) if !v.is_null() => next["metadata"][kept] = v.clone(),
            _ => {
                if let Some(meta) = next["metadata"].as_object_mut() {
                    meta.remove(kept);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let r = Route::parse("/api/v1/namespaces/team/pods/p-1/exec").unwrap();
        assert_eq!(
            (
                r.resource,
                r.namespace.as_deref(),
                r.name.as_deref(),
                r.subresource.as_deref()
            ),
            (Resource::Pods, Some("team"), Some("p-1"), Some("exec"))
        );
        assert_eq!(r.audit_resource(), "pods/exec");
        let r = Route::parse("/apis/sluice.dev/v1alpha1/hookchains").unwrap();
        assert_eq!((r.resource, r.namespace), (Resource::HookChains, None));
        let r = Route::parse("/apis/coordination.k8s.io/v1/namespaces/s/leases/op").unwrap();
        assert_eq!(r.resource, Resource::Leases);
        let r = Route::parse("/apis/events.k8s.io/v1/namespaces/s/events").unwrap();
        assert_eq!(r.resource, Resource::EventsV1);
        assert_eq!(
            Route::parse("/api/v1/namespaces/s/events")
                .unwrap()
                .resource,
            Resource::Events
        );
        assert!(Route::parse("/apis/apps/v1/deployments").is_none());
    }

    #[test]
    fn selectors_and_queries() {
        let o = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        assert!(selector_matches(Some("a=1,b==2"), &o));
        assert!(!selector_matches(Some("a=1,b!=2"), &o));
        assert!(selector_matches(Some("a"), &o));
        assert!(!selector_matches(Some("c"), &o));
        let q = query_params("command=python3&command=-u&labelSelector=a%3D1%2Cb%3D2");
        assert_eq!(q["command"], "python3\0-u");
        assert_eq!(q["labelSelector"], "a=1,b=2");
    }

    fn store() -> Store {
        Store::new(4, Duration::from_secs(60))
    }

    #[test]
    fn a_stale_resource_version_conflicts() {
        let s = store();
        let o = s.upsert(
            Resource::Pods,
            json!({"metadata": {"name": "p", "namespace": "n"}}),
        );
        let rv = o["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        let patch = json!({"metadata": {"resourceVersion": rv, "labels": {"x": "1"}}});
        assert!(
            s.patch(Resource::Pods, Part::Main, "n", "p", &patch, false)
                .is_ok()
        );
        assert_eq!(
            s.patch(Resource::Pods, Part::Main, "n", "p", &patch, false),
            Err(StoreError::Conflict)
        );
        assert_eq!(
            s.remove(Resource::Pods, "n", "p", Some(&rv)),
            Err(StoreError::Conflict)
        );
        assert!(s.remove(Resource::Pods, "n", "p", None).is_ok());
    }

    #[test]
    fn status_and_object_are_written_apart() {
        let s = store();
        s.upsert(
            Resource::HookChains,
            json!({"metadata": {"name": "c", "namespace": "n"}, "spec": {"a": 1}}),
        );
        let patch = json!({"spec": {"a": 2}, "status": {"warm": 3}});
        let o = s
            .patch(Resource::HookChains, Part::Status, "n", "c", &patch, true)
            .unwrap();
        assert_eq!(
            (o["spec"]["a"].as_i64(), o["status"]["warm"].as_i64()),
            (Some(1), Some(3))
        );
        let o = s
            .patch(
                Resource::HookChains,
                Part::Main,
                "n",
                "c",
                &json!({"spec": {"a": 2}, "status": null}),
                false,
            )
            .unwrap();
        assert_eq!(
            (o["spec"]["a"].as_i64(), o["status"]["warm"].as_i64()),
            (Some(2), Some(3))
        );
        assert_eq!(o["metadata"]["generation"], 2);
        // A server-side apply creates what is missing; a create refuses a taken name.
        let p = json!({"metadata": {"name": "np", "namespace": "n"}, "spec": {}});
        assert!(
            s.patch(Resource::NetworkPolicies, Part::Main, "n", "np", &p, true)
                .is_ok()
        );
        assert_eq!(
            s.create(Resource::NetworkPolicies, p),
            Err(StoreError::AlreadyExists)
        );
    }

    async fn body_of(r: Response<Body>) -> String {
        let bytes = r
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[tokio::test]
    async fn a_watch_from_before_the_kept_history_is_gone() {
        let s = store();
        let first = s.upsert(
            Resource::Pods,
            json!({"metadata": {"name": "p0", "namespace": "n"}}),
        );
        let rv: u64 = first["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        for i in 1..10 {
            s.upsert(
                Resource::Pods,
                json!({"metadata": {"name": format!("p{i}"), "namespace": "n"}}),
            );
        }
        let params = WatchParams {
            since: Some(rv),
            ..Default::default()
        };
        let body = body_of(s.watch(Resource::Pods, params)).await;
        let ev: Value = serde_json::from_str(body.trim()).unwrap();
        assert_eq!(ev["type"], "ERROR");
        assert_eq!(
            (
                ev["object"]["code"].as_u64(),
                ev["object"]["reason"].as_str()
            ),
            (Some(410), Some("Expired"))
        );
    }
}
