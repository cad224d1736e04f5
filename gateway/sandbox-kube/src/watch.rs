//! What the kube mode's watches share (the pod watch here, the chain source's HookChain and
//! Capability watches): one API per watched namespace (or one cluster-wide), and the watch tasks
//! that end with their owner.

use kube::api::Api;
use kube::core::NamespaceResourceScope;

/// The API of `K` in each of `namespaces`, or the cluster-wide one when it is empty.
pub fn apis<K>(client: &kube::Client, namespaces: &[String]) -> Vec<Api<K>>
where
    K: kube::Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    if namespaces.is_empty() {
        vec![Api::all(client.clone())]
    } else {
        namespaces
            .iter()
            .map(|ns| Api::namespaced(client.clone(), ns))
            .collect()
    }
}

/// Background watch tasks, aborted when their owner is dropped.
#[derive(Default)]
pub struct Tasks(pub Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}
