//! Leader election through a `coordination.k8s.io` Lease: of all replicas,
//! only the holder acts.
//!
//! As in client-go, a candidate judges expiry by its own clock: it takes the
//! lease only after seeing the record unchanged for a whole lease duration,
//! so clocks that disagree between machines cannot make two leaders. The
//! holder stops acting once it has gone `renew_deadline` without a renewal,
//! which is shorter than the lease duration: it has stopped before anyone
//! else may take over.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{PostParams, ResourceExt},
};
use parking_lot::Mutex;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct Settings {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// Whether this replica may act now. Cheap to clone and to ask.
#[derive(Clone)]
pub struct Leadership {
    term: Arc<Mutex<Option<Term>>>,
    deadline: Duration,
}

/// This replica's time as the leader: from its taking the lease to its
/// last renewal.
#[derive(Clone, Copy)]
struct Term {
    since: Instant,
    renewed: Instant,
}

impl Leadership {
    fn new(deadline: Duration) -> Self {
        Leadership {
            term: Arc::default(),
            deadline,
        }
    }

    /// A replica that took the lease `ago` and has just renewed it.
    #[cfg(test)]
    pub fn held_since(ago: Duration) -> Self {
        let leadership = Leadership::new(Duration::from_secs(10));
        let now = Instant::now();
        let since = now.checked_sub(ago).unwrap_or(now);
        *leadership.term.lock() = Some(Term {
            since,
            renewed: now,
        });
        leadership
    }

    /// How long this replica has led, while it does.
    pub fn held_for(&self) -> Option<Duration> {
        self.term()
            .filter(|t| t.renewed.elapsed() < self.deadline)
            .map(|t| t.since.elapsed())
    }

    /// When this replica's term began, while it leads: the same instant
    /// for the whole term.
    pub fn term_began(&self) -> Option<Instant> {
        self.held_for()?;
        self.term().map(|t| t.since)
    }

    /// True while the last renewal is recent enough that no other replica
    /// can hold the lease.
    pub fn is_held(&self) -> bool {
        self.held_for().is_some()
    }

    /// When the last renewal (or the taking of the lease) began.
    fn renewed(&self) -> Option<Instant> {
        self.term().map(|t| t.renewed)
    }

    /// How long until the renew deadline, while the lease is held.
    fn left(&self) -> Option<Duration> {
        self.term()
            .map(|t| self.deadline.saturating_sub(t.renewed.elapsed()))
            .filter(|left| !left.is_zero())
    }

    fn term(&self) -> Option<Term> {
        *self.term.lock()
    }

    /// A renewal, or the start of a term when none is running.
    fn renewed_at(&self, at: Instant) {
        let mut term = self.term.lock();
        let since = term.map_or(at, |t| t.since);
        *term = Some(Term { since, renewed: at });
    }

    fn drop_it(&self) {
        *self.term.lock() = None;
    }
}

/// The lease record as last seen, and when it was seen to change.
struct Observed {
    resource_version: Option<String>,
    holder: String,
    duration: Duration,
    changed_at: Instant,
}

/// The lease renewed in the background, until it is lost or handed back.
pub struct Renewing {
    stop: tokio::sync::oneshot::Sender<()>,
    /// The renewals; None once they ended with the lease lost.
    task: Option<tokio::task::JoinHandle<Option<Elector>>>,
}

impl Renewing {
    /// Resolves when the lease is lost (at once, if it already was).
    pub async fn lost(&mut self) {
        if let Some(task) = &mut self.task {
            let _ = task.await;
            self.task = None;
        }
    }

    /// Stops renewing and gives the lease up, so that another replica
    /// takes over at once; nothing to give up if it was lost.
    pub async fn release(self) {
        let _ = self.stop.send(());
        if let Some(task) = self.task
            && let Ok(Some(mut elector)) = task.await
        {
            elector.release().await;
        }
    }
}

pub struct Elector {
    api: Api<Lease>,
    settings: Settings,
    observed: Option<Observed>,
    leadership: Leadership,
}

impl Elector {
    pub fn new(client: Client, settings: Settings) -> Self {
        Elector {
            api: Api::namespaced(client, &settings.namespace),
            leadership: Leadership::new(settings.renew_deadline),
            settings,
            observed: None,
        }
    }

    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// Renews the lease in the background from now on (`keep`), beside
    /// everything else: on a slow API server the reads that set up the
    /// loops outlast the renew deadline.
    pub fn renew_in_background(mut self) -> Renewing {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tokio::select! {
                () = self.keep() => None,
                _ = stopped => Some(self),
            }
        });
        Renewing {
            stop,
            task: Some(task),
        }
    }

    /// Returns once this replica holds the lease.
    pub async fn acquire(&mut self) {
        let mut last_holder = String::new();
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    info!(lease = %self.settings.name, identity = %self.settings.identity, "became the leader");
                    return;
                }
                Ok(false) => {
                    let holder = self.holder();
                    if holder != last_holder {
                        info!(lease = %self.settings.name, %holder, "standing by: another replica leads");
                        last_holder = holder;
                    }
                }
                Err(e) => {
                    warn!(lease = %self.settings.name, error = %e, "could not read or take the lease")
                }
            }
            tokio::time::sleep(self.settings.retry_period).await;
        }
    }

    /// Renews the lease until a renewal is overdue or another replica holds
    /// it; returns then, with leadership already withdrawn.
    pub async fn keep(&mut self) {
        // Attempts start a retry period apart, however long each took, and
        // each may take until the renew deadline, as client-go's may: cut
        // at one retry period, every renewal failed while the API server
        // answered in more than that, and the leader exited with most of
        // its deadline left (the benchmark's large fleet).
        let mut last = self.leadership.renewed().unwrap_or_else(Instant::now);
        while let Some(left) = self.next_renewal(last).await {
            last = Instant::now();
            match tokio::time::timeout(left, self.try_acquire_or_renew()).await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    warn!(lease = %self.settings.name, holder = %self.holder(), "another replica took the lease");
                    break;
                }
                Ok(Err(e)) => {
                    warn!(lease = %self.settings.name, error = %e, "could not renew the lease")
                }
                Err(_) => warn!(lease = %self.settings.name, "renewing the lease timed out"),
            }
        }
        self.leadership.drop_it();
    }

    /// Waits until a retry period after the `last` attempt began; then the
    /// time left until the renew deadline, or none once it has passed.
    async fn next_renewal(&self, last: Instant) -> Option<Duration> {
        tokio::time::sleep_until((last + self.settings.retry_period).into()).await;
        let left = self.leadership.left();
        if left.is_none() {
            warn!(lease = %self.settings.name, deadline = ?self.settings.renew_deadline, "no renewal within the deadline");
        }
        left
    }

    /// Gives the lease up, so another replica takes over at once rather than
    /// after the lease duration.
    pub async fn release(&mut self) {
        self.leadership.drop_it();
        let Ok(Some(mut lease)) = self.api.get_opt(&self.settings.name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.settings.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self
            .api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => info!(lease = %self.settings.name, "released the lease"),
            Err(e) => warn!(lease = %self.settings.name, error = %e, "could not release the lease"),
        }
    }

    fn holder(&self) -> String {
        self.observed
            .as_ref()
            .map(|o| o.holder.clone())
            .unwrap_or_default()
    }

    /// One round: take the lease if it is free or expired, renew it if ours.
    /// Ok(false) while another replica holds it.
    async fn try_acquire_or_renew(&mut self) -> kube::Result<bool> {
        // Measured before the request: the lease is ours from no later than this.
        let started = Instant::now();
        let now = MicroTime(Timestamp::now());
        let me = self.settings.identity.clone();
        let duration_secs = i32::try_from(self.settings.lease_duration.as_secs()).unwrap_or(15);
        let Some(mut lease) = self.api.get_opt(&self.settings.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.settings.name.clone()),
                    namespace: Some(self.settings.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(me),
                    lease_duration_seconds: Some(duration_secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return self.write(
                started,
                self.api.create(&PostParams::default(), &lease).await,
            );
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let version = lease.metadata.resource_version.clone();
        if self
            .observed
            .as_ref()
            .is_none_or(|o| o.resource_version != version)
        {
            self.observed = Some(Observed {
                resource_version: version,
                holder: holder.clone(),
                duration: Duration::from_secs(
                    u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
                ),
                changed_at: Instant::now(),
            });
        }
        let unexpired = self
            .observed
            .as_ref()
            .is_some_and(|o| o.changed_at.elapsed() < o.duration);
        if holder != me && !holder.is_empty() && unexpired {
            return Ok(false);
        }
        if holder != me {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(me);
        spec.lease_duration_seconds = Some(duration_secs);
        spec.renew_time = Some(now);
        // The resourceVersion read above makes this a compare-and-swap: if
        // another replica wrote in between, ours fails with 409.
        let result = self
            .api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await;
        self.write(started, result)
    }

    fn write(&mut self, started: Instant, result: kube::Result<Lease>) -> kube::Result<bool> {
        match result {
            Ok(lease) => {
                self.observed = Some(Observed {
                    resource_version: lease.resource_version(),
                    holder: self.settings.identity.clone(),
                    duration: self.settings.lease_duration,
                    changed_at: started,
                });
                self.leadership.renewed_at(started);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}
