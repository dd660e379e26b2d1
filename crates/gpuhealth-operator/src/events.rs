//! Events, in a series only for repeats of the same message. kube's
//! `Recorder` (like client-go's) continues one series for every Event of a
//! reason about an object, whatever its note: a second, different error
//! (two malformed maintenance notices in a row) would show only as a
//! repeat of the first. Here the note is part of what makes a series.

use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
    time::Duration,
};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        events::v1::{Event, EventSeries},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio::sync::Mutex;

pub use kube::runtime::events::EventType;

/// How long a series goes on: after that, the same message is a new Event
/// (kube's `Recorder` keeps its series as long).
const SERIES_FOR: Duration = Duration::from_secs(6 * 60);

/// An Event's note is at most 1 kB.
const NOTE_LIMIT: usize = 1000;

/// Where an Event about an object without a namespace (a Node) goes.
const CLUSTER_EVENTS_NAMESPACE: &str = "default";

pub struct Events {
    client: Client,
    controller: String,
    instance: String,
    series: Mutex<HashMap<u64, Series>>,
}

/// An Event published, and how often its message has been seen since.
#[derive(Clone)]
struct Series {
    namespace: String,
    name: String,
    count: i32,
    last: Timestamp,
}

impl Events {
    pub fn new(client: Client, controller: &str, instance: &str) -> Events {
        Events {
            client,
            controller: controller.to_owned(),
            instance: instance.to_owned(),
            series: Mutex::default(),
        }
    }

    /// Publishes `note` about `regarding`: a new Event, or the next of the
    /// series of the same reason, action and note.
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let note: String = note.chars().take(NOTE_LIMIT).collect();
        let type_ = match type_ {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        let key = {
            let mut h = DefaultHasher::new();
            (
                &regarding.uid,
                &regarding.kind,
                &regarding.namespace,
                &regarding.name,
                type_,
                reason,
                action,
                &note,
            )
                .hash(&mut h);
            h.finish()
        };
        let now = Timestamp::now();
        let seen = {
            let mut series = self.series.lock().await;
            series.retain(|_, s| {
                now.duration_since(s.last) < SERIES_FOR.try_into().unwrap_or_default()
            });
            series.get_mut(&key).map(|s| {
                s.count += 1;
                s.last = now;
                s.clone()
            })
        };
        if let Some(s) = seen {
            let series = EventSeries {
                count: s.count,
                last_observed_time: MicroTime(now),
            };
            let patch = json!({ "series": series });
            Api::<Event>::namespaced(self.client.clone(), &s.namespace)
                .patch(&s.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            return Ok(());
        }
        let namespace = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| CLUSTER_EVENTS_NAMESPACE.to_owned());
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or(&self.controller),
            now.as_nanosecond()
        );
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            action: Some(action.to_owned()),
            reason: Some(reason.to_owned()),
            note: Some(note),
            type_: Some(type_.to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        };
        Api::<Event>::namespaced(self.client.clone(), &namespace)
            .create(&PostParams::default(), &event)
            .await?;
        self.series.lock().await.insert(
            key,
            Series {
                namespace,
                name,
                count: 1,
                last: now,
            },
        );
        Ok(())
    }
}
