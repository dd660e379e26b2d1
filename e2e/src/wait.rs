//! Waiting on conditions with deadlines, driven by watches: a test never
//! sleeps and hopes.

use std::{collections::BTreeMap, fmt::Debug, future::Future, time::Duration};

use futures::{StreamExt, TryStreamExt};
use kube::{
    Api, Resource, ResourceExt,
    runtime::{WatchStreamExt, watcher},
};
use serde::de::DeserializeOwned;

use crate::{HarnessError, Result};

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
        let mut stream = watcher(api, config).default_backoff().boxed();
        // The watcher restarts itself after errors; a persistent error still
        // ends in the timeout above, with the last error kept for context.
        loop {
            match stream.try_next().await {
                Ok(Some(event)) => {
                    apply(&mut objects, event);
                    if done(&objects) {
                        return Ok(objects);
                    }
                }
                Ok(None) => {
                    return Err(HarnessError::Timeout {
                        what: what.to_owned(),
                        secs: 0,
                    });
                }
                Err(source) => {
                    return Err(HarnessError::Watch {
                        what: what.to_owned(),
                        source,
                    });
                }
            }
        }
    })
    .await
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
