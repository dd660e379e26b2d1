//! Waiting on conditions with deadlines, driven by watches: a test never
//! sleeps and hopes.

use std::{collections::BTreeMap, fmt::Debug, future::Future, time::Duration};

use futures::{Stream, StreamExt};
use kube::{
    Api, Resource, ResourceExt,
    runtime::{WatchStreamExt, watcher},
};
use serde::de::DeserializeOwned;

use crate::{HarnessError, Result};

/// How long a test waits for something the system should do.
pub const WAIT: Duration = Duration::from_secs(180);

/// Fails with a `Timeout` naming `what` when `fut` does not finish in time.
pub async fn within<T>(
    what: &str,
    timeout: Duration,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| HarnessError::Timeout {
            what: what.to_owned(),
            secs: timeout.as_secs(),
        })?
}

/// Watches the objects `config` selects and returns them once `done` holds
/// for the whole set (name → object).
pub async fn until_set<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &str,
    timeout: Duration,
    done: impl Fn(&BTreeMap<String, K>) -> bool,
) -> Result<BTreeMap<String, K>>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + 'static,
{
    within(what, timeout, async {
        let mut objects = BTreeMap::new();
        let mut stream = std::pin::pin!(events(api, config));
        // Judged only on a whole list: mid-list, "none left" would hold
        // before the first object arrived.
        let mut listed = false;
        // Watch errors are retried; one that persists ends in the timeout.
        while let Some(event) = stream.next().await {
            match &event {
                watcher::Event::Init => listed = false,
                watcher::Event::InitDone => listed = true,
                _ => {}
            }
            apply(&mut objects, event);
            if listed && done(&objects) {
                return Ok(objects);
            }
        }
        Err(HarnessError::Timeout {
            what: what.to_owned(),
            secs: 0,
        })
    })
    .await
}

/// Every event of a watch, for as long as the caller reads. Watch errors are
/// retried with backoff and never end the stream: a recorder that stopped at
/// the first error would see nothing and let a test pass that should fail.
pub fn events<K>(api: Api<K>, config: watcher::Config) -> impl Stream<Item = watcher::Event<K>>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + 'static,
{
    watcher(api, config)
        .default_backoff()
        .filter_map(|event| async move {
            event
                .inspect_err(|e| eprintln!("watch error (retrying): {e}"))
                .ok()
        })
}

/// Every object a watch adds or changes; see [`events`].
pub fn applied<K>(api: Api<K>, config: watcher::Config) -> impl Stream<Item = K>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + 'static,
{
    events(api, config).flat_map(|event| {
        let obj = match event {
            watcher::Event::Apply(obj) | watcher::Event::InitApply(obj) => Some(obj),
            _ => None,
        };
        futures::stream::iter(obj)
    })
}

/// A background task that stops when this handle is dropped, so a failed
/// assertion cannot leave it running into the next scenario.
pub struct Background(tokio::task::JoinHandle<()>);

impl Background {
    pub fn spawn(fut: impl Future<Output = ()> + Send + 'static) -> Self {
        Background(tokio::spawn(fut))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Watches one object until `done` holds for it.
pub async fn until<K>(
    api: Api<K>,
    name: &str,
    timeout: Duration,
    done: impl Fn(&K) -> bool,
) -> Result<K>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    let what = format!("{} {name}", K::kind(&Default::default()));
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let set = until_set(api, config, &what, timeout, |objs| {
        objs.get(name).is_some_and(&done)
    })
    .await?;
    set.get(name).cloned().ok_or(HarnessError::Timeout {
        what,
        secs: timeout.as_secs(),
    })
}

fn apply<K: Resource + Clone>(objects: &mut BTreeMap<String, K>, event: watcher::Event<K>) {
    match event {
        watcher::Event::Apply(obj) | watcher::Event::InitApply(obj) => {
            objects.insert(obj.name_any(), obj);
        }
        watcher::Event::Delete(obj) => {
            objects.remove(&obj.name_any());
        }
        watcher::Event::Init => objects.clear(),
        watcher::Event::InitDone => {}
    }
}

/// Waits until an Event with `reason` about the object `name` whose message
/// contains `text` exists.
pub async fn event_saying(
    client: &kube::Client,
    name: &str,
    reason: &str,
    text: &str,
) -> crate::Result<()> {
    let config = watcher::Config::default().fields(&format!("involvedObject.name={name}"));
    let what = format!("an Event {reason} about {name} saying {text:?}");
    until_set(
        Api::<k8s_openapi::api::core::v1::Event>::all(client.clone()),
        config,
        &what,
        WAIT,
        |set| {
            set.values().any(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.message.as_deref().unwrap_or_default().contains(text)
            })
        },
    )
    .await?;
    Ok(())
}
