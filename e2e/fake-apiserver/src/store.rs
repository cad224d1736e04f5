//! The fake's object store: one resourceVersion counter for everything, a history of changes so a
//! watch resumes from any version it was given, and equality label selectors.

use crate::Body;
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::Response;
use hyper::body::Frame;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use tokio::sync::broadcast;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    Pods,
    HookChains,
    Capabilities,
}

impl Resource {
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::HookChains => "hookchains",
            Resource::Capabilities => "capabilities",
        }
    }
    fn list_kind(self) -> (&'static str, &'static str) {
        match self {
            Resource::Pods => ("v1", "PodList"),
            Resource::HookChains => ("sluice.dev/v1alpha1", "HookChainList"),
            Resource::Capabilities => ("sluice.dev/v1alpha1", "CapabilityList"),
        }
    }
}

/// A request path taken apart: `/api/v1/namespaces/{ns}/pods/{name}/exec`,
/// `/apis/sluice.dev/v1alpha1/hookchains`, ...
#[derive(Debug)]
pub struct Route {
    pub resource: Resource,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Option<String>,
}

impl Route {
    pub fn parse(path: &str) -> Option<Route> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let rest = match parts.as_slice() {
            ["api", "v1", rest @ ..] => rest,
            ["apis", "sluice.dev", "v1alpha1", rest @ ..] => rest,
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
        let resource = match plural {
            "pods" => Resource::Pods,
            "hookchains" => Resource::HookChains,
            "capabilities" => Resource::Capabilities,
            _ => return None,
        };
        Some(Route {
            resource,
            namespace,
            name,
            subresource: sub,
        })
    }
}

/// Query parameters, percent-decoded; a repeated key keeps its values joined by NUL (for `command`).
pub fn query_params(query: &str) -> HashMap<String, String> {
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
pub fn selector_matches(selector: Option<&str>, object: &Value) -> bool {
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
pub struct Event {
    rv: u64,
    resource: Resource,
    kind: &'static str,
    object: Value,
}

type Key = (Resource, String, String);

struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Event>,
    suffix: u64,
}

pub struct Store {
    inner: Mutex<Inner>,
    events: broadcast::Sender<Event>,
}

pub enum PatchError {
    NotFound,
    Conflict,
}

fn key_of(resource: Resource, object: &Value) -> Key {
    let meta = &object["metadata"];
    (
        resource,
        meta["namespace"].as_str().unwrap_or("default").to_string(),
        meta["name"].as_str().unwrap_or_default().to_string(),
    )
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

impl Store {
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner {
                rv: 100,
                objects: BTreeMap::new(),
                history: Vec::new(),
                suffix: 0,
            }),
            events: broadcast::channel(4096).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    pub fn next_suffix(&self) -> String {
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
        inner.history.push(event.clone());
        let _ = self.events.send(event);
    }

    pub fn upsert(&self, resource: Resource, mut object: Value) -> Value {
        let mut inner = self.lock();
        inner.rv += 1;
        let rv = inner.rv;
        let key = key_of(resource, &object);
        object["metadata"]["namespace"] = json!(key.1);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        // As the API server does: generation starts at 1 and moves when the spec changes.
        let previous = inner.objects.get(&key);
        let existed = previous.is_some();
        let generation = match previous {
            Some(p) if p["spec"] == object["spec"] => p["metadata"]["generation"].as_i64(),
            Some(p) => p["metadata"]["generation"].as_i64().map(|g| g + 1),
            None => Some(1),
        }
        .unwrap_or(1);
        object["metadata"]["generation"] = json!(generation);
        // An update keeps the object's identity, as the API server's does.
        if object["metadata"]["uid"].is_null()
            && let Some(uid) = previous.map(|p| p["metadata"]["uid"].clone())
        {
            object["metadata"]["uid"] = uid;
        }
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = json!(format!("uid-{}-{}-{rv}", key.1, key.2));
        }
        if object["metadata"]["creationTimestamp"].is_null() {
            object["metadata"]["creationTimestamp"] = json!(jiff::Timestamp::now().to_string());
        }
        inner.objects.insert(key, object.clone());
        let kind = if existed { "MODIFIED" } else { "ADDED" };
        self.record(&mut inner, resource, kind, object.clone());
        object
    }

    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(resource, namespace.to_string(), name.to_string()))
            .cloned()
    }

    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        let mut inner = self.lock();
        let mut object =
            inner
                .objects
                .remove(&(resource, namespace.to_string(), name.to_string()))?;
        inner.rv += 1;
        object["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        self.record(&mut inner, resource, "DELETED", object.clone());
        Some(object)
    }

    /// Applies a merge patch; a `metadata.resourceVersion` in the patch is a precondition.
    pub fn merge_patch(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
        patch: &Value,
    ) -> Result<Value, PatchError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let current = inner.objects.get(&key).ok_or(PatchError::NotFound)?;
        if let Some(want) = patch["metadata"]["resourceVersion"].as_str()
            && current["metadata"]["resourceVersion"].as_str() != Some(want)
        {
            return Err(PatchError::Conflict);
        }
        let mut object = current.clone();
        merge(&mut object, patch);
        if object["spec"] != current["spec"] {
            let next = current["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
            object["metadata"]["generation"] = json!(next);
        }
        inner.rv += 1;
        object["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        inner.objects.insert(key, object.clone());
        self.record(&mut inner, resource, "MODIFIED", object.clone());
        Ok(object)
    }

    pub fn list(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        selector: Option<&str>,
    ) -> Vec<Value> {
        self.lock()
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

    pub fn list_response(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        selector: Option<&str>,
    ) -> Value {
        let rv = self.lock().rv;
        let (api_version, kind) = resource.list_kind();
        json!({
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"resourceVersion": rv.to_string()},
            "items": self.list(resource, namespace, selector),
        })
    }

    /// A watch from `since`: first the changes after it from the history, then live ones, as JSON
    /// lines of `{"type", "object"}` on one long response.
    pub fn watch(
        &self,
        resource: Resource,
        namespace: Option<String>,
        selector: Option<String>,
        since: u64,
    ) -> Response<Body> {
        let wanted = move |e: &Event| {
            e.resource == resource
                && namespace
                    .as_deref()
                    .is_none_or(|ns| e.object["metadata"]["namespace"].as_str() == Some(ns))
                && selector_matches(selector.as_deref(), &e.object)
        };
        let line = |e: &Event| {
            let mut s = json!({"type": e.kind, "object": e.object}).to_string();
            s.push('\n');
            Bytes::from(s)
        };
        // Subscribe before reading the history so nothing falls between the two.
        let mut live = self.events.subscribe();
        let (backlog, mut last) = {
            let inner = self.lock();
            let backlog: Vec<Bytes> = inner
                .history
                .iter()
                .filter(|e| e.rv > since && wanted(e))
                .map(line)
                .collect();
            (backlog, inner.rv.max(since))
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(256);
        tokio::spawn(async move {
            for b in backlog {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            loop {
                match live.recv().await {
                    Ok(e) if e.rv > last => {
                        last = e.rv;
                        if wanted(&e) && tx.send(line(&e)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    // A watcher that falls this far behind is told to start over, like a 410.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let body = StreamBody::new(futures::StreamExt::map(stream, |b| {
            Ok::<_, std::convert::Infallible>(Frame::data(b))
        }));
        Response::builder()
            .header("content-type", "application/json")
            .body(body.boxed())
            .unwrap_or_else(|_| Response::new(http_body_util::Empty::new().boxed()))
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
        let r = Route::parse("/apis/sluice.dev/v1alpha1/hookchains").unwrap();
        assert_eq!((r.resource, r.namespace), (Resource::HookChains, None));
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

    #[test]
    fn a_stale_resource_version_conflicts() {
        let s = Store::new();
        let o = s.upsert(
            Resource::Pods,
            json!({"metadata": {"name": "p", "namespace": "n"}}),
        );
        let rv = o["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        let patch = json!({"metadata": {"resourceVersion": rv, "labels": {"x": "1"}}});
        assert!(s.merge_patch(Resource::Pods, "n", "p", &patch).is_ok());
        assert!(matches!(
            s.merge_patch(Resource::Pods, "n", "p", &patch),
            Err(PatchError::Conflict)
        ));
    }
}
